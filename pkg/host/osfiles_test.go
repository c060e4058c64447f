package host_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/host"
)

func writeFile(t *testing.T, path, data string, perm os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), perm); err != nil {
		t.Fatal(err)
	}
}

// names lists dir, so a test can see that no temporary file was left beside a copy.
func names(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, de := range des {
		out = append(out, de.Name())
	}
	return out
}

// TestOSFilesCopyFile: the copy replaces what was there, has the mode asked for whatever the
// source's, and leaves no temporary file; a failed copy leaves the old file as it was.
func TestOSFilesCopyFile(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(t.TempDir(), "dst")
	writeFile(t, src, "new firmware", 0o600)
	writeFile(t, dst, "old", 0o600)
	if err := (host.OSFiles{}).CopyFile(src, dst, 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(dst)
	if err != nil || string(got) != "new firmware" {
		t.Fatalf("dst = %q, %v; want the source's content", got, err)
	}
	if fi, err := os.Stat(dst); err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("dst mode = %v, %v; want 0644", fi.Mode(), err)
	}
	if n := names(t, filepath.Dir(dst)); !slices.Equal(n, []string{"dst"}) {
		t.Errorf("dst's directory holds %v, want only dst", n)
	}

	err = (host.OSFiles{}).CopyFile(filepath.Join(dir, "missing"), dst, 0o644)
	if !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("copy of a missing file: %v, want ErrNotExist", err)
	}
	if got, _ := os.ReadFile(dst); string(got) != "new firmware" {
		t.Errorf("a failed copy changed dst to %q", got)
	}
	if err := (host.OSFiles{}).CopyFile(dir, dst, 0o644); err == nil {
		t.Error("copying a directory succeeded")
	}
	if n := names(t, filepath.Dir(dst)); !slices.Equal(n, []string{"dst"}) {
		t.Errorf("a failed copy left %v, want only dst", n)
	}
}

// TestOSFilesLinkAndRemoveAll: Link shares the file, refuses an existing dst; RemoveAll removes a
// tree and accepts a missing path.
func TestOSFilesLinkAndRemoveAll(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "a.ko"), filepath.Join(dir, "b.ko")
	writeFile(t, src, "module", 0o644)
	files := host.OSFiles{}
	if err := files.Link(src, dst); err != nil {
		t.Fatal(err)
	}
	a, errA := os.Stat(src)
	b, errB := os.Stat(dst)
	if errA != nil || errB != nil || !os.SameFile(a, b) {
		t.Fatalf("dst is not a link to src: %v %v", errA, errB)
	}
	if err := files.Link(src, dst); !errors.Is(err, fs.ErrExist) {
		t.Errorf("Link over an existing file: %v, want ErrExist", err)
	}

	tree := filepath.Join(dir, "entry")
	if err := os.MkdirAll(filepath.Join(tree, "modules"), 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(tree, "modules/nvidia.ko"), "x", 0o644)
	if err := files.RemoveAll(tree); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(tree); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("after RemoveAll: %v, want the tree gone", err)
	}
	if err := files.RemoveAll(tree); err != nil {
		t.Errorf("RemoveAll of a missing path: %v", err)
	}
}

// TestOSFilesTouch: Touch moves a file's modification time to now and fails on a missing path.
func TestOSFilesTouch(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	writeFile(t, p, "x", 0o644)
	old := time.Now().Add(-time.Hour).Truncate(time.Second)
	if err := os.Chtimes(p, old, old); err != nil {
		t.Fatal(err)
	}
	if err := (host.OSFiles{}).Touch(p); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(p); err != nil || !st.ModTime().After(old) {
		t.Errorf("after Touch: %v, %v; want a modification time after %v", st.ModTime(), err, old)
	}
	if err := (host.OSFiles{}).Touch(filepath.Join(dir, "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Touch of a missing path = %v, want ErrNotExist", err)
	}
}

// TestRecorderFiles: the dry run's Files records each call and touches nothing.
func TestRecorderFiles(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	writeFile(t, src, "data", 0o644)
	var rec host.Recorder
	h := host.DryRun(host.Roots{}, &rec)
	for _, err := range []error{h.Files.CopyFile(src, dst, 0o644), h.Files.Link(src, dst), h.Files.Touch(src), h.Files.RemoveAll(src)} {
		if err != nil {
			t.Fatal(err)
		}
	}
	want := []host.Action{
		{Kind: "copy", Target: dst, Detail: "from " + src + " 0644"},
		{Kind: "link", Target: dst, Detail: "to " + src},
		{Kind: "touch", Target: src},
		{Kind: "remove-all", Target: src},
	}
	if got := rec.Actions(); !slices.Equal(got, want) {
		t.Errorf("recorded %v, want %v", got, want)
	}
	if n := names(t, dir); !slices.Equal(n, []string{"src"}) {
		t.Errorf("the recorder changed the tree: %v", n)
	}
}

// BenchmarkCopyFile copies a module the size of a large nvidia.ko into the temporary directory's
// filesystem, as the cached path installs its modules into the container root on every start.
func BenchmarkCopyFile(b *testing.B) {
	dir := b.TempDir()
	src, dst := filepath.Join(dir, "nvidia.ko"), filepath.Join(dir, "copy.ko")
	data := make([]byte, 64<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if err := os.WriteFile(src, data, 0o644); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		if err := (host.OSFiles{}).CopyFile(src, dst, 0o644); err != nil {
			b.Fatal(err)
		}
	}
}
