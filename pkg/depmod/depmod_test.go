package depmod

import (
	"bytes"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

var nvidiaEntries = []Entry{
	{Path: "kernel/lib/crc7.ko.xz"},
	{Path: "kernel/drivers/video/nvidia.ko"},
	{Path: "kernel/drivers/video/nvidia-uvm.ko", Depends: []string{"kernel/drivers/video/nvidia.ko"}},
	{Path: "kernel/drivers/video/nvidia-modeset.ko", Depends: []string{"kernel/drivers/video/nvidia.ko"}},
	{Path: "kernel/drivers/video/nvidia-peermem.ko", Depends: []string{"kernel/drivers/video/nvidia.ko"}},
	{Path: "kernel/drivers/video/nvidia-drm.ko", Depends: []string{"kernel/drivers/video/nvidia-modeset.ko", "kernel/drivers/video/nvidia.ko"}},
}

func TestDepRoundTrip(t *testing.T) {
	dep := Dep(nvidiaEntries)
	if !bytes.HasPrefix(dep, []byte("kernel/lib/crc7.ko.xz:\nkernel/drivers/video/nvidia.ko:\nkernel/drivers/video/nvidia-uvm.ko: kernel/drivers/video/nvidia.ko\n")) {
		t.Errorf("modules.dep =\n%s", dep)
	}
	got, err := Parse(bytes.NewReader(dep))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.EqualFunc(got, nvidiaEntries, func(a, b Entry) bool { return a.Path == b.Path && slices.Equal(a.Depends, b.Depends) }) {
		t.Errorf("Parse(Dep(x)) = %+v", got)
	}
	for _, bad := range []string{"no colon\n", ": a.ko\n", "a b.ko: c.ko\n"} {
		if _, err := Parse(strings.NewReader(bad)); err == nil {
			t.Errorf("Parse(%q) accepted it", bad)
		}
	}
	if (Entry{Path: "kernel/drivers/video/nvidia-peermem.ko"}).Name() != "nvidia_peermem" || (Entry{Path: "x/ipmi_devintf.ko.zst"}).Name() != "ipmi_devintf" {
		t.Error("Entry.Name")
	}
}

// lookup reads kmod's index the way libkmod does: prefix, then the child for the next character.
func lookup(t *testing.T, bin []byte, key string) (string, bool) {
	t.Helper()
	u32 := func(off uint32) uint32 { return binary.BigEndian.Uint32(bin[off:]) }
	if u32(0) != indexMagic || u32(4) != indexVersion {
		t.Fatalf("header %x %x", u32(0), u32(4))
	}
	off := u32(8)
	for i := 0; ; {
		pos := off & 0x0FFFFFFF
		if off&nodePrefix != 0 {
			end := pos + uint32(bytes.IndexByte(bin[pos:], 0))
			prefix := string(bin[pos:end])
			if !strings.HasPrefix(key[i:], prefix) {
				return "", false
			}
			i += len(prefix)
			pos = end + 1
		}
		var first, last byte
		var childs uint32
		if off&nodeChilds != 0 {
			first, last = bin[pos], bin[pos+1]
			childs = pos + 2
			pos += 2 + 4*uint32(last-first+1)
		}
		if i == len(key) {
			if off&nodeValues == 0 {
				return "", false
			}
			s := bin[pos+8:]
			return string(s[:bytes.IndexByte(s, 0)]), true
		}
		c := key[i]
		if off&nodeChilds == 0 || c < first || c > last {
			return "", false
		}
		if off = u32(childs + 4*uint32(c-first)); off == 0 {
			return "", false
		}
		i++
	}
}

func TestDepBinLookup(t *testing.T) {
	bin, err := DepBin(nvidiaEntries)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range nvidiaEntries {
		if got, ok := lookup(t, bin, e.Name()); !ok || got != e.line() {
			t.Errorf("lookup %s = %q %v, want %q", e.Name(), got, ok, e.line())
		}
	}
	for _, missing := range []string{"nvidia_", "nvidi", "nvidia_fs", "crc", ""} {
		if got, ok := lookup(t, bin, missing); ok {
			t.Errorf("lookup %q found %q", missing, got)
		}
	}
	if _, err := DepBin([]Entry{{Path: "kernel/\xffbad.ko"}}); err == nil {
		t.Error("a name kmod's index cannot hold was accepted")
	}
}

// kmod's own modprobe resolves the NVIDIA modules from the files written here, in a tree that
// has no other index (no modules.alias.bin, no modules.builtin.bin), as the shared driver root.
func TestKmodModprobeReadsTheIndex(t *testing.T) {
	modprobe := findModprobe(t)
	root := t.TempDir()
	const kver = "9.9.9-driver-agent"
	dir := filepath.Join(root, "lib/modules", kver)
	for _, e := range nvidiaEntries {
		hosttest.Must(t, os.MkdirAll(filepath.Dir(filepath.Join(dir, e.Path)), 0o755))
		hosttest.Must(t, os.WriteFile(filepath.Join(dir, e.Path), nil, 0o644))
	}
	bin, err := DepBin(nvidiaEntries)
	if err != nil {
		t.Fatal(err)
	}
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "modules.dep"), Dep(nvidiaEntries), 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "modules.dep.bin"), bin, 0o644))
	for name, want := range map[string][]string{
		"nvidia-peermem": {"kernel/drivers/video/nvidia.ko", "kernel/drivers/video/nvidia-peermem.ko"},
		"nvidia_drm":     {"kernel/drivers/video/nvidia.ko", "kernel/drivers/video/nvidia-modeset.ko", "kernel/drivers/video/nvidia-drm.ko"},
		"crc7":           {"kernel/lib/crc7.ko.xz"},
	} {
		out, err := exec.Command(modprobe, "-d", root, "-S", kver, "--show-depends", "--ignore-install", name).CombinedOutput()
		if err != nil {
			t.Fatalf("modprobe --show-depends %s: %v\n%s", name, err, out)
		}
		var got []string
		for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			got = append(got, strings.TrimPrefix(strings.TrimSpace(strings.TrimPrefix(l, "insmod ")), dir+"/"))
		}
		if !slices.Equal(got, want) {
			t.Errorf("modprobe --show-depends %s = %q, want %q", name, got, want)
		}
	}
	out, err := exec.Command(modprobe, "-d", root, "-S", kver, "--show-depends", "nvidia_fs").CombinedOutput()
	if err == nil {
		t.Errorf("modprobe found a module the index does not have:\n%s", out)
	}
}

func findModprobe(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("modprobe"); err == nil {
		return p
	}
	for _, p := range []string{"/usr/sbin/modprobe", "/sbin/modprobe"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Fatal("kmod's modprobe is missing: apt-get install kmod (scripts/install-deps.sh)")
	return ""
}
