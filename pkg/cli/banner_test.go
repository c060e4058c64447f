package cli_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/cli"
)

const (
	cliBanner        = "Linux version 6.6.95-flatcar (builder@localhost) (gcc (Gentoo 13.3.1) 13.3.1, GNU ld 2.42.0) #1 SMP PREEMPT_DYNAMIC Fri Jul 11 12:34:56 -00 2025"
	cliKernelVersion = "6.6.95-flatcar (builder@localhost) #1 SMP PREEMPT_DYNAMIC Fri Jul 11 12:34:56 -00 2025"
)

// writeBzImage writes a minimal x86 bzImage (boot protocol 2.15, one setup sector) whose gzip
// payload holds the banner as a C string.
func writeBzImage(t *testing.T) string {
	t.Helper()
	return writeBzImageWith(t, cliBanner, cliKernelVersion)
}

// writeBzImageWith is writeBzImage for another banner and kernel version string.
func writeBzImageWith(t *testing.T, banner, kernelVersion string) string {
	t.Helper()
	kernel := append(bytes.Repeat([]byte{0x90, 0xe8, 0, 0, 0, 0}, 4000), []byte(banner+"\n\x00")...)
	var gz bytes.Buffer
	w := gzip.NewWriter(&gz)
	w.Write(kernel)
	w.Close()
	img := make([]byte, 2*512)
	img[0x1f1] = 1
	binary.LittleEndian.PutUint16(img[0x1fe:], 0xaa55)
	copy(img[0x202:], "HdrS")
	binary.LittleEndian.PutUint16(img[0x206:], 0x020f)
	copy(img[0x300:], kernelVersion+"\x00")
	binary.LittleEndian.PutUint16(img[0x20e:], 0x100)
	binary.LittleEndian.PutUint32(img[0x248:], 0)
	binary.LittleEndian.PutUint32(img[0x24c:], uint32(gz.Len()))
	img = append(img, gz.Bytes()...)
	path := filepath.Join(t.TempDir(), "vmlinuz")
	if err := os.WriteFile(path, img, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func runCLI(args ...string) (int, string, string) {
	var stdout, stderr bytes.Buffer
	code := cli.Main(context.Background(), append([]string{"driver-agent"}, args...), nil, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func TestBannerCommand(t *testing.T) {
	img := writeBzImage(t)
	code, out, errOut := runCLI("banner", "--vmlinuz", img)
	if code != 0 || out != cliBanner+"\n" {
		t.Fatalf("exit %d, stdout %q, stderr %q; want the banner and a newline", code, out, errOut)
	}

	code, out, _ = runCLI("banner", "--json", "--vmlinuz", img)
	var got struct {
		Banner, Compression, KernelVersion string
		Offset                             int64
	}
	if err := json.Unmarshal([]byte(out), &got); code != 0 || err != nil {
		t.Fatalf("--json: exit %d, %v: %s", code, err, out)
	}
	if got.Banner != cliBanner || got.Compression != "gzip" || got.KernelVersion != cliKernelVersion || got.Offset != 1024 {
		t.Fatalf("--json: %+v", got)
	}

	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"banner"}, 2, "set --vmlinuz"},
		{[]string{"banner", "--vmlinuz", img, "extra"}, 2, "unexpected arguments"},
		{[]string{"banner", "--bogus"}, 2, "flag provided but not defined"},
		{[]string{"banner", "--vmlinuz", filepath.Join(t.TempDir(), "missing")}, 1, "no such file"},
		{[]string{"banner", "--vmlinuz", "/dev/null"}, 1, "no Linux kernel banner"},
	} {
		code, out, errOut := runCLI(c.args...)
		if code != c.code || out != "" || !strings.Contains(errOut, c.want) {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want exit %d and %q", c.args, code, out, errOut, c.code, c.want)
		}
	}
	if code, out, _ := runCLI("banner", "--help"); code != 0 || !strings.Contains(out, "--vmlinuz FILE") {
		t.Errorf("--help: exit %d, %q", code, out)
	}
	if code, out, _ := runCLI("help"); code != 0 || !strings.Contains(out, "banner --vmlinuz FILE") {
		t.Errorf("help does not list banner: %q", out)
	}
}
