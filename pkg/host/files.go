package host

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// OSFiles is the real Files implementation.
type OSFiles struct{}

// WriteFile implements Files.
func (OSFiles) WriteFile(path string, data []byte, perm os.FileMode, atomic bool) error {
	if !atomic {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, perm)
		if err != nil {
			return err
		}
		_, werr := f.Write(data)
		return errors.Join(werr, f.Close())
	}
	return WriteAtomic(path, data, perm)
}

// WriteAtomic writes data to a temporary file beside path, syncs it and renames it over path, so a
// reader sees either the old or the new content, never a partial one.
func WriteAtomic(path string, data []byte, perm os.FileMode) error {
	return WriteAtomicFrom(path, perm, func(w io.Writer) error {
		if _, err := w.Write(data); err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
		return nil
	})
}

// WriteAtomicFrom is WriteAtomic for content that is streamed: fill writes it to a temporary file
// beside path, which is then synced, given perm and renamed over path. When fill or any step fails
// the temporary file is removed and path is left as it was; fill's error is returned as it is.
func WriteAtomicFrom(path string, perm os.FileMode, fill func(io.Writer) error) error {
	return replace(path, perm, true, fill)
}

// replace is WriteAtomicFrom, with the sync of the temporary file only when sync is set.
func replace(path string, perm os.FileMode, sync bool, fill func(io.Writer) error) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	name := tmp.Name()
	if err := fill(tmp); err != nil {
		tmp.Close()
		os.Remove(name)
		return err
	}
	var werr error
	if sync {
		werr = tmp.Sync()
	}
	if werr == nil {
		werr = tmp.Chmod(perm)
	}
	if err := errors.Join(werr, tmp.Close()); err != nil {
		os.Remove(name)
		return fmt.Errorf("write %s: %w", path, err)
	}
	// rename(2) itself: os.Rename first stats path to refuse a directory, which rename(2)
	// refuses as well (EISDIR), and a run writes a dozen such files.
	if err := syscall.Rename(name, path); err != nil {
		os.Remove(name)
		return fmt.Errorf("write %s: %w", path, &os.LinkError{Op: "rename", Old: name, New: path, Err: err})
	}
	return nil
}

// MkdirAll implements Files.
func (OSFiles) MkdirAll(path string, perm os.FileMode) error { return os.MkdirAll(path, perm) }

// Remove implements Files.
func (OSFiles) Remove(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// RemoveIfEmpty removes the directory dir through f unless something is in it.
func RemoveIfEmpty(f Files, dir string) error {
	if err := f.Remove(dir); err != nil && !errors.Is(err, syscall.ENOTEMPTY) && !errors.Is(err, syscall.EEXIST) {
		return err
	}
	return nil
}

// RemoveAll implements Files.
func (OSFiles) RemoveAll(path string) error { return os.RemoveAll(path) }

// Link implements Files.
func (OSFiles) Link(src, dst string) error { return os.Link(src, dst) }

// Touch implements Files.
func (OSFiles) Touch(path string) error {
	now := time.Now()
	return os.Chtimes(path, now, now)
}

// CopyFile implements Files.
func (OSFiles) CopyFile(src, dst string, perm os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	return replace(dst, perm, false, func(w io.Writer) error {
		if _, err := io.Copy(w, in); err != nil {
			return fmt.Errorf("copy %s: %w", src, err)
		}
		return nil
	})
}
