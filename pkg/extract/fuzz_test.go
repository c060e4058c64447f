package extract

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// FuzzTar feeds arbitrary bytes to Tar as an archive and checks its
// promises: no panic; nothing outside the destination changes; on error the
// destination is empty; on success every symbolic link resolves, through
// the real file system, to a place inside the destination, and there are no
// device nodes or FIFOs. Seeds: well-formed and hostile archives.
func FuzzTar(f *testing.F) {
	f.Add(archive(f, dir("./"), file("./a/b", "x"), symlink("./a/c", "b"), hardlink("./a/d", "./a/b")))
	f.Add(archive(f, file("../evil", "x")))
	f.Add(archive(f, symlink("here", "."), dir("d"), symlink("d/up", "../here/..")))
	f.Add(archive(f, dir("d"), symlink("d/x", "t/../.."), symlink("d/t", "../d")))
	f.Add(archive(f, symlink("l", "/usr/lib64"), file("usr/lib64/x", "y")))
	f.Add(archive(f, symlink("a", "b/x"), symlink("b", "a/y")))
	f.Add(archive(f, file("f", "1"), symlink("f", "f"), file("f", "2")))
	f.Add([]byte("not a tar archive"))
	f.Fuzz(func(t *testing.T, in []byte) {
		parent, dest := setup(t)
		for _, rootfs := range []bool{false, true} {
			_, err := Tar(context.Background(), bytes.NewReader(in), dest, Options{RootFS: rootfs, MaxTotalSize: 1 << 20})
			if err != nil {
				assertClean(t, parent, dest)
				continue
			}
			checkTree(t, dest)
			if err := os.RemoveAll(dest); err != nil {
				t.Fatal(err)
			}
			if err := os.Mkdir(dest, 0o755); err != nil {
				t.Fatal(err)
			}
			assertClean(t, parent, dest)
		}
	})
}

// checkTree walks dest and fails on special files and on links that the
// kernel would resolve outside dest.
func checkTree(t *testing.T, dest string) {
	t.Helper()
	realDest, err := filepath.EvalSymlinks(dest)
	if err != nil {
		t.Fatal(err)
	}
	err = filepath.WalkDir(dest, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		switch typ := d.Type(); {
		case typ&(fs.ModeDevice|fs.ModeCharDevice|fs.ModeNamedPipe|fs.ModeSocket) != 0:
			t.Errorf("%s: special file %v", p, typ)
		case typ&fs.ModeSymlink != 0:
			r, err := filepath.EvalSymlinks(p)
			if errors.Is(err, fs.ErrNotExist) {
				// Dangling: check the lexical part that does exist.
				r, err = resolveExisting(p)
			}
			if err != nil {
				t.Errorf("%s: %v", p, err)
			} else if r != realDest && !strings.HasPrefix(r, realDest+"/") {
				t.Errorf("%s resolves to %s, outside %s", p, r, realDest)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// resolveExisting resolves the longest existing prefix of a dangling link's
// target and appends the rest lexically.
func resolveExisting(p string) (string, error) {
	target, err := os.Readlink(p)
	if err != nil {
		return "", err
	}
	full := filepath.Join(filepath.Dir(p), target)
	rest := ""
	for cur := full; ; {
		r, err := filepath.EvalSymlinks(cur)
		if err == nil {
			return filepath.Join(r, rest), nil
		}
		if !errors.Is(err, fs.ErrNotExist) || cur == "/" {
			return "", err
		}
		rest = filepath.Join(filepath.Base(cur), rest)
		cur = filepath.Dir(cur)
	}
}
