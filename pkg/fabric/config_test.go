package fabric_test

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/fabric"
	"github.com/driver-agent/driver-agent/pkg/host"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden from the current output")

// golden compares got with testdata/<name>.golden, or rewrites it with -update.
func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from %s (run go test -update after checking):\n--- got ---\n%s\n--- want ---\n%s", name, path, got, want)
	}
}

// render shows an edit the way the golden files hold it: the written file, the warnings, or
// the error.
func render(ed fabric.Edited, err error) []byte {
	var b bytes.Buffer
	if err != nil {
		b.WriteString("-- error --\n" + err.Error() + "\n")
		return b.Bytes()
	}
	b.WriteString("-- fabricmanager.cfg --\n")
	b.Write(ed.Data)
	b.WriteString("-- warnings --\n")
	for _, w := range ed.Warnings {
		b.WriteString(w + "\n")
	}
	return b.Bytes()
}

func TestEditConfigGolden(t *testing.T) {
	shipped, err := os.ReadFile("testdata/fabricmanager.cfg")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		in        []byte
		overrides map[string]string
	}{
		{"defaults", shipped, nil},
		{"overrides", shipped, map[string]string{"FABRIC_MODE": "1", "LOG_LEVEL": "2", "ABORT_CUDA_JOBS_ON_FM_EXIT": "0"}},
		{"unknown-key", shipped, map[string]string{"FM_NEW_SETTING": "abc", "LOG_LEVEL": "3"}},
		{"forced", shipped, map[string]string{"DAEMONIZE": "1", "LOG_FILE_NAME": "/var/log/fm.log", "LOG_USE_SYSLOG": "0"}},
		{"value-verbatim", shipped, map[string]string{"UNIX_SOCKET_PATH": "/run/fm sock=1 # not a comment", "STATE_FILE_NAME": ""}},
		{"invalid-keys", shipped, map[string]string{"lower_case": "1", "FOO-BAR": "2", "": "3", "OK_KEY": "4"}},
		{"invalid-values", shipped, map[string]string{"LOG_LEVEL": "4\nDAEMONIZE=1", "FABRIC_MODE": "1\r", "STATE_FILE_NAME": "a\x00b"}},
		{"duplicates-crlf-malformed", []byte("# dup\r\nLOG_LEVEL=1\r\n  LOG_LEVEL = 2\r\nthis is not a setting\r\nDAEMONIZE=1"), map[string]string{"LOG_LEVEL": "4"}},
		{"empty", nil, map[string]string{"FABRIC_MODE": "0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ed, err := fabric.EditConfig(tc.in, tc.overrides)
			golden(t, "edit-"+tc.name, render(ed, err))
			if err != nil {
				if !errors.Is(err, exitcode.ErrConfig) {
					t.Errorf("error %v is not a configuration error", err)
				}
				return
			}
			for _, kv := range [][2]string{{"DAEMONIZE", "0"}, {"LOG_FILE_NAME", ""}, {"LOG_USE_SYSLOG", "0"}} {
				if v, ok := ed.Config.Get(kv[0]); !ok || v != kv[1] {
					t.Errorf("%s=%q (set %v), want %q", kv[0], v, ok, kv[1])
				}
			}
		})
	}
}

// The unchanged lines keep their bytes: only the edited settings differ from the input.
func TestEditConfigKeepsOtherLines(t *testing.T) {
	t.Parallel()
	in, err := os.ReadFile("testdata/fabricmanager.cfg")
	if err != nil {
		t.Fatal(err)
	}
	ed, err := fabric.EditConfig(in, map[string]string{"FABRIC_MODE": "1"})
	if err != nil {
		t.Fatal(err)
	}
	a, b := strings.Split(string(in), "\n"), strings.Split(string(ed.Data), "\n")
	if len(a) != len(b) {
		t.Fatalf("%d lines became %d: no key was missing, nothing should be appended", len(a), len(b))
	}
	changed := map[string]bool{}
	for i := range a {
		if a[i] != b[i] {
			changed[strings.SplitN(b[i], "=", 2)[0]] = true
		}
	}
	want := map[string]bool{"FABRIC_MODE": true, "DAEMONIZE": true, "LOG_FILE_NAME": true}
	if len(changed) != len(want) {
		t.Errorf("changed %v, want %v", changed, want)
	}
	for k := range want {
		if !changed[k] {
			t.Errorf("%s not changed", k)
		}
	}
}

func TestWriteConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	src := filepath.Join(dir, "usr/share/nvidia/nvswitch/fabricmanager.cfg")
	if err := os.MkdirAll(filepath.Dir(src), 0o755); err != nil {
		t.Fatal(err)
	}
	in, _ := os.ReadFile("testdata/fabricmanager.cfg")
	if err := os.WriteFile(src, in, 0o444); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "run/nvidia/driver-agent/fabricmanager.cfg")
	ed, err := fabric.WriteConfig(host.OSFiles{}, src, dst, map[string]string{"FABRIC_MODE": "1"})
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(dst)
	if err != nil || !bytes.Equal(got, ed.Data) {
		t.Fatalf("written %q, %v", got, err)
	}
	if after, _ := os.ReadFile(src); !bytes.Equal(after, in) {
		t.Error("the shipped file was changed")
	}

	// A missing source: only the agent's settings and the overrides, and a warning.
	ed, err = fabric.WriteConfig(host.OSFiles{}, filepath.Join(dir, "missing.cfg"), dst, map[string]string{"FABRIC_MODE": "1"})
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "write-missing-source", bytes.ReplaceAll(render(ed, nil), []byte(dir), []byte("<dir>")))

	// Invalid overrides: nothing is written.
	dst2 := filepath.Join(dir, "other.cfg")
	if _, err := fabric.WriteConfig(host.OSFiles{}, src, dst2, map[string]string{"bad": "1"}); !errors.Is(err, exitcode.ErrConfig) {
		t.Fatalf("WriteConfig = %v", err)
	}
	if _, err := os.Stat(dst2); err == nil {
		t.Error("a file was written for invalid overrides")
	}
}

func TestConfigAccessors(t *testing.T) {
	t.Parallel()
	c := fabric.ParseConfig([]byte("# c\nA=1\nB = two words \nA=3\nnonsense\n=x\n"))
	if v, ok := c.Get("A"); !ok || v != "1" {
		t.Errorf("Get(A) = %q, %v", v, ok)
	}
	if v, ok := c.Get("B"); !ok || v != "two words" {
		t.Errorf("Get(B) = %q, %v", v, ok)
	}
	if _, ok := c.Get("C"); ok {
		t.Error("Get(C) found")
	}
	if got := strings.Join(c.Keys(), ","); got != "A,B" {
		t.Errorf("Keys() = %s", got)
	}
	if got := c.Malformed(); len(got) != 2 || got[0] != "nonsense" || got[1] != "=x" {
		t.Errorf("Malformed() = %q", got)
	}
	if !c.Set("A", "9") || c.Set("C", "x") {
		t.Error("Set reported the wrong existence")
	}
	if got := string(c.Bytes()); got != "# c\nA=9\nB = two words \nA=9\nnonsense\n=x\nC=x\n" {
		t.Errorf("Bytes() = %q", got)
	}
}
