package host

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestWriteAtomicFrom checks that a streamed write lands whole with its mode, and that a failed one
// leaves the old file as it was and no temporary file beside it.
func TestWriteAtomicFrom(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := WriteAtomic(path, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	err := WriteAtomicFrom(path, 0o644, func(w io.Writer) error {
		if _, err := io.WriteString(w, "partial"); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("WriteAtomicFrom = %v, want the fill error", err)
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "old" {
		t.Fatalf("after a failed write the file is %q, %v; want the old content", b, err)
	}
	if err := WriteAtomicFrom(path, 0o644, func(w io.Writer) error {
		_, err := io.WriteString(w, "new")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil || string(b) != "new" {
		t.Fatalf("the file is %q, %v; want new", b, err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("mode %v, %v; want 0644", fi.Mode().Perm(), err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) != 1 {
		t.Fatalf("the directory holds %v, %v; want only f", entries, err)
	}
}

// TestWriteAtomicOntoDirectory: a write whose path is a directory fails, leaving the directory
// as it was and no temporary file beside it.
func TestWriteAtomicOntoDirectory(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "d")
	if err := os.MkdirAll(filepath.Join(path, "inside"), 0o755); err != nil {
		t.Fatal(err)
	}
	err := WriteAtomic(path, []byte("x"), 0o644)
	if !errors.Is(err, syscall.EISDIR) {
		t.Fatalf("WriteAtomic onto a directory = %v, want EISDIR", err)
	}
	if _, err := os.Stat(filepath.Join(path, "inside")); err != nil {
		t.Fatalf("the directory changed: %v", err)
	}
	if entries, err := os.ReadDir(dir); err != nil || len(entries) != 1 {
		t.Fatalf("the parent holds %v, %v; want only d", entries, err)
	}
}

// TestRemoveIfEmpty: a directory with something in it stays, without an error; an empty one goes;
// one already gone is no error.
func TestRemoveIfEmpty(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "d")
	if err := os.MkdirAll(filepath.Join(dir, "cache"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := RemoveIfEmpty(OSFiles{}, dir); err != nil {
		t.Fatalf("not empty: %v", err)
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("a directory with something in it was removed: %v", err)
	}
	if err := os.Remove(filepath.Join(dir, "cache")); err != nil {
		t.Fatal(err)
	}
	if err := RemoveIfEmpty(OSFiles{}, dir); err != nil {
		t.Fatalf("empty: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the empty directory stayed: %v", err)
	}
	if err := RemoveIfEmpty(OSFiles{}, dir); err != nil {
		t.Fatalf("gone: %v", err)
	}
}
