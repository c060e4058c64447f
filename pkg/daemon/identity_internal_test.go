package daemon

import (
	"os"
	"path/filepath"
	"testing"
)

func TestIsProgram(t *testing.T) {
	for _, tc := range []struct {
		program, exe, comm string
		want               bool
	}{
		{"nvidia-persistenced", "nvidia-persistenced", "nvidia-persiste", true},
		{"nvidia-persistenced", "", "nvidia-persiste", true}, // exe unreadable (another user's process)
		{"nvidia-persistenced", "nvidia-persistenced", "", true},
		{"nvidia-persistenced", "sleep", "sleep", false},
		{"nvidia-persistenced", "", "nvidia-persistenced", false}, // comm is never that long
		{"nvidia-persistenced", "", "", false},
		{"nv-fabricmanager", "", "nv-fabricmanage", true},
		{"nvlsm", "", "nvlsm", true},
		{"", "", "", false},
	} {
		if got := isProgram(tc.program, tc.exe, tc.comm); got != tc.want {
			t.Errorf("isProgram(%q, %q, %q) = %v", tc.program, tc.exe, tc.comm, got)
		}
	}
}

// The identity comes from the configured proc root, and a deleted executable keeps its name.
func TestProcessIdentityUnderProcRoot(t *testing.T) {
	proc := t.TempDir()
	dir := filepath.Join(proc, "4242")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/usr/bin/nvidia-persistenced (deleted)", filepath.Join(dir, "exe")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "comm"), []byte("nvidia-persiste\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	exe, comm, err := processIdentity(proc, 4242)
	if err != nil || exe != "nvidia-persistenced" || comm != "nvidia-persiste" {
		t.Fatalf("processIdentity = %q, %q, %v", exe, comm, err)
	}
	if _, _, err := processIdentity(proc, 4343); err == nil {
		t.Error("no error for a PID missing from the proc root")
	}
}

func TestReadPIDFile(t *testing.T) {
	dir := t.TempDir()
	for content, want := range map[string]int{"123\n": 123, " 77 ": 77, "0": 0, "-5": 0, "abc": 0, "": 0} {
		p := filepath.Join(dir, "pid")
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		got, err := readPIDFile(p)
		if got != want || (want == 0) != (err != nil) {
			t.Errorf("readPIDFile(%q) = %d, %v", content, got, err)
		}
	}
}

// The tail keeps the last lines, each bounded.
func TestTail(t *testing.T) {
	tl := newTail(3)
	for _, l := range []string{"a", "b", "c", "d"} {
		tl.add(l)
	}
	if got := tl.Lines(); len(got) != 3 || got[0] != "b" || got[2] != "d" {
		t.Errorf("lines %q", got)
	}
	long := make([]byte, 2*tailLineBytes)
	for i := range long {
		long[i] = 'x'
	}
	tl.add(string(long))
	if got := tl.Lines(); len(got[2]) != tailLineBytes+3 {
		t.Errorf("long line kept as %d bytes", len(got[2]))
	}
}
