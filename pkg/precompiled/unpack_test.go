package precompiled

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func modulePackage(t *testing.T, name, target string) *Package {
	t.Helper()
	f := File{Type: KernelModule, Name: name, TargetDirectory: target, Data: []byte("data"), CRC: StoredCRC([]byte("data"))}
	return &Package{DriverVersion: "1", Files: []File{f}}
}

func TestUnpackRefusesUnsafePaths(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, target string }{
		{"../evil.ko", ""}, {"evil.ko", "../out"}, {"evil.ko", "/tmp"}, {"a/b.ko", ""}, {"", "."}, {"x\x00.ko", ""},
	} {
		parent := t.TempDir()
		dir := filepath.Join(parent, "out")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		paths, err := Unpack(modulePackage(t, tc.name, tc.target), dir)
		if !errors.Is(err, ErrUnsafePath) || len(paths) != 0 {
			t.Errorf("Unpack(%q, %q) = %v, %v; want ErrUnsafePath", tc.name, tc.target, paths, err)
		}
		assertEmpty(t, parent, 1)
	}
}

// assertEmpty fails if dir holds anything but want entries (the out dir).
func assertEmpty(t *testing.T, dir string, want int) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != want {
		t.Errorf("%s has %d entries, want %d", dir, len(entries), want)
	}
}

func TestUnpackRefusesSymlinkEscape(t *testing.T) {
	t.Parallel()
	outside := t.TempDir()
	dir := t.TempDir()
	// A target directory that is a symlink out of dir.
	if err := os.Symlink(outside, filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	if _, err := Unpack(modulePackage(t, "m.ko", "link"), dir); err == nil {
		t.Error("Unpack through a directory symlink out of dir succeeded")
	}
	// A member name that is an existing symlink to a file outside dir.
	victim := filepath.Join(outside, "victim")
	if err := os.WriteFile(victim, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, filepath.Join(dir, "m.ko")); err != nil {
		t.Fatal(err)
	}
	if _, err := Unpack(modulePackage(t, "m.ko", "."), dir); err == nil {
		t.Error("Unpack through a file symlink out of dir succeeded")
	}
	if b, _ := os.ReadFile(victim); string(b) != "keep" {
		t.Errorf("file outside dir was changed to %q", b)
	}
	assertEmpty(t, outside, 1)
}

func TestUnpackCreatesTargetAndFixesMode(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	// An existing file with another mode is overwritten and made 0644.
	if err := os.MkdirAll(filepath.Join(dir, "a", "b"), 0o755); err != nil {
		t.Fatal(err)
	}
	old := filepath.Join(dir, "a", "b", "m.ko")
	if err := os.WriteFile(old, []byte("old contents, longer"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := modulePackage(t, "m.ko", "a/b")
	f2 := p.Files[0]
	f2.Index, f2.Name, f2.TargetDirectory = 1, "n.ko", "c/d"
	p.Files = append(p.Files, f2)
	paths, err := Unpack(p, dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{old, filepath.Join(dir, "c", "d", "n.ko")}
	for i, path := range want {
		if i >= len(paths) || paths[i] != path {
			t.Fatalf("paths = %v, want %v", paths, want)
		}
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(path)
		if st.Mode().Perm() != 0o644 || string(b) != "data" {
			t.Errorf("%s: mode %v, contents %q", path, st.Mode(), b)
		}
	}
	if _, err := Unpack(p, filepath.Join(dir, "missing")); err == nil {
		t.Error("Unpack into a missing dir succeeded")
	}
}
