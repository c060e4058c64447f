package build

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"
)

// skipDirs are top-level directories of a driver source directory that the
// build does not need: the precompiled packages shipped next to the sources.
var skipDirs = map[string]bool{"precompiled": true}

// CopyTree copies the tree src into dst, which exists and is empty:
// directories, regular files (with their permission bits and modification
// times) and symbolic links (as links). Anything else is an error. Top-level
// directories named precompiled (NVIDIA's packages next to the sources) are
// left out. ctx is checked between files.
func CopyTree(ctx context.Context, src, dst string) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		if d.IsDir() && skipDirs[rel] {
			return filepath.SkipDir
		}
		to := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch mode := info.Mode(); {
		case mode.IsDir():
			return os.Mkdir(to, mode.Perm()|0o700)
		case mode.IsRegular():
			if err := copyFile(path, to, mode.Perm()); err != nil {
				return err
			}
			// kbuild compares modification times; the copy must not look newer than it is.
			return os.Chtimes(to, info.ModTime(), info.ModTime())
		case mode&fs.ModeSymlink != 0:
			target, err := os.Readlink(path)
			if err != nil {
				return err
			}
			return os.Symlink(target, to)
		default:
			return fmt.Errorf("copy sources: %s is a %s, not a file, directory or symbolic link", path, mode.Type())
		}
	})
}

func copyFile(from, to string, perm fs.FileMode) (err error) {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm|0o600)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, out.Close()) }()
	_, err = io.Copy(out, in)
	return err
}

// prepareWorkDir creates dir with mode 0700, or checks that an existing one
// is an empty directory (not a symbolic link) and sets its mode to 0700.
func prepareWorkDir(dir string) error {
	switch err := os.Mkdir(dir, 0o700); {
	case err == nil:
		return nil
	case !errors.Is(err, fs.ErrExist):
		return err
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(entries) > 0 {
		return fmt.Errorf("%s is not empty", dir)
	}
	return os.Chmod(dir, 0o700)
}

// removeAll removes dir. A process that was killed a moment ago may still
// finish a system call that creates a file in it, so a failure is retried a
// few times.
func removeAll(dir string) error {
	var err error
	for range 5 {
		if err = os.RemoveAll(dir); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}
