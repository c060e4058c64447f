package extract

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// entry is one member of a test archive.
type entry struct {
	name, body, link string
	typ              byte
	mode             int64
}

func file(name, body string) entry {
	return entry{name: name, body: body, typ: tar.TypeReg, mode: 0o644}
}
func dir(name string) entry { return entry{name: name, typ: tar.TypeDir, mode: 0o755} }
func symlink(name, target string) entry {
	return entry{name: name, link: target, typ: tar.TypeSymlink, mode: 0o777}
}
func hardlink(name, target string) entry { return entry{name: name, link: target, typ: tar.TypeLink} }

var mtime = time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)

func archive(t testing.TB, entries ...entry) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range entries {
		size := int64(len(e.body))
		if e.typ != tar.TypeReg {
			size = 0
		}
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Size: size, ModTime: mtime, Format: tar.FormatPAX}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if e.typ == tar.TypeReg {
			if _, err := tw.Write([]byte(e.body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// setup returns an empty destination inside a parent directory that also
// holds a sentinel file, so tests can check that nothing outside dest changed.
func setup(t *testing.T) (parent, dest string) {
	t.Helper()
	parent = t.TempDir()
	dest = filepath.Join(parent, "dest")
	if err := os.Mkdir(dest, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(parent, "outside"), []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	return parent, dest
}

// assertClean fails unless dest is empty and parent holds only dest and the
// sentinel, unchanged.
func assertClean(t *testing.T, parent, dest string) {
	t.Helper()
	if ents, err := os.ReadDir(dest); err != nil || len(ents) != 0 {
		t.Errorf("dest not empty after a failure: %v %v", names(ents), err)
	}
	ents, err := os.ReadDir(parent)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(names(ents), ","); got != "dest,outside" {
		t.Errorf("parent holds %s, want dest,outside", got)
	}
	if b, err := os.ReadFile(filepath.Join(parent, "outside")); err != nil || string(b) != "keep" {
		t.Errorf("file outside dest changed: %q %v", b, err)
	}
}

func names(ents []os.DirEntry) []string {
	var n []string
	for _, e := range ents {
		n = append(n, e.Name())
	}
	return n
}

func TestTarExtractsSelectedMembers(t *testing.T) {
	t.Parallel()
	_, dest := setup(t)
	a := archive(t,
		dir("./"),
		dir("./usr/"),
		dir("./usr/lib/modules/6.1.0-flatcar/build/"),
		file("./usr/lib/modules/6.1.0-flatcar/build/Makefile", "all:\n"),
		entry{name: "./usr/lib/modules/6.1.0-flatcar/build/scripts/basic/fixdep", body: "\x7fELF", typ: tar.TypeReg, mode: 0o4755},
		symlink("./usr/lib/modules/6.1.0-flatcar/source", "build"),
		file("./usr/lib/modules/6.1.0-flatcar/modules.dep", "x\n"),
		file("./usr/lib/modules/6.1.0-flatcar/kernel/drivers/big.ko", "not wanted"),
		file("./usr/lib64/libc.so.6", "libc"),
		symlink("./usr/lib64/libc.so", "/usr/lib64/libc.so.6"),
		hardlink("./usr/lib64/libc-copy.so.6", "./usr/lib64/libc.so.6"),
		entry{name: "./dev/console", typ: tar.TypeChar, mode: 0o600}, // not selected: skipped, not rejected
		file("./usr/bin/bash", "not wanted"),
	)
	res, err := Tar(context.Background(), bytes.NewReader(a), dest, Options{
		Include: Prefixes("usr/lib/modules/6.1.0-flatcar/build/", "usr/lib/modules/6.1.0-flatcar/source",
			"usr/lib/modules/6.1.0-flatcar/modules.", "usr/lib64/"),
		RootFS: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	want := Result{Files: 4, Dirs: 1, Symlinks: 2, Hardlinks: 1, Bytes: int64(len("all:\n\x7fELFx\nlibc")), Skipped: 4}
	if res != want {
		t.Errorf("Result = %+v, want %+v", res, want)
	}
	read := func(p string) string {
		b, err := os.ReadFile(filepath.Join(dest, p))
		if err != nil {
			t.Error(err)
		}
		return string(b)
	}
	if got := read("usr/lib/modules/6.1.0-flatcar/source/Makefile"); got != "all:\n" {
		t.Errorf("source/Makefile = %q", got)
	}
	if got := read("usr/lib64/libc.so"); got != "libc" {
		t.Errorf("libc.so through the rebased link = %q", got)
	}
	if l, _ := os.Readlink(filepath.Join(dest, "usr/lib64/libc.so")); l != "libc.so.6" {
		t.Errorf("absolute link rebased to %q, want libc.so.6", l)
	}
	fi, err := os.Stat(filepath.Join(dest, "usr/lib/modules/6.1.0-flatcar/build/scripts/basic/fixdep"))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode() != 0o755 {
		t.Errorf("mode = %v, want 0755 (setuid dropped)", fi.Mode())
	}
	if !fi.ModTime().Equal(mtime) {
		t.Errorf("mtime = %v, want %v", fi.ModTime(), mtime)
	}
	for _, p := range []string{"usr/lib/modules/6.1.0-flatcar/kernel", "usr/bin", "dev"} {
		if _, err := os.Lstat(filepath.Join(dest, p)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s exists (%v); it was not selected", p, err)
		}
	}
	a1, _ := os.Stat(filepath.Join(dest, "usr/lib64/libc.so.6"))
	a2, _ := os.Stat(filepath.Join(dest, "usr/lib64/libc-copy.so.6"))
	if !os.SameFile(a1, a2) {
		t.Error("hard link is not the same file")
	}
}

func TestTarRejectsUnsafeMembers(t *testing.T) {
	t.Parallel()
	big := file("big", strings.Repeat("x", 2<<20))
	tests := []struct {
		name    string
		entries []entry
		opts    Options
		member  string
		want    error
	}{
		{"dotdot", []entry{file("a", "x"), file("../evil", "x")}, Options{}, "../evil", ErrUnsafe},
		{"dotdot inside", []entry{file("a/../../evil", "x")}, Options{}, "a/../../evil", ErrUnsafe},
		{"dotdot under a selected prefix", []entry{file("usr/lib64/../../../evil", "x")}, Options{Include: Prefixes("usr/lib64/")}, "usr/lib64/../../../evil", ErrUnsafe},
		{"dotdot not selected", []entry{file("../evil", "x")}, Options{Include: Prefixes("usr/")}, "../evil", ErrUnsafe},
		{"absolute", []entry{file("/etc/passwd", "x")}, Options{}, "/etc/passwd", ErrUnsafe},
		{"dot element", []entry{file("a/./b", "x")}, Options{}, "a/./b", ErrUnsafe},
		{"escaping symlink", []entry{symlink("a/link", "../../outside")}, Options{}, "a/link", ErrUnsafe},
		{"absolute symlink", []entry{symlink("link", "/etc")}, Options{}, "link", ErrUnsafe},
		{"write through symlink", []entry{dir("d"), symlink("link", "d"), file("link/f", "x")}, Options{}, "link/f", ErrUnsafe},
		{"write through escaping symlink", []entry{symlink("link", ".."), file("link/outside", "x")}, Options{}, "link", ErrUnsafe},
		{"symlink chain escapes", []entry{symlink("here", "."), dir("d"), symlink("d/up", "../here/..")}, Options{}, "d/up", ErrUnsafe},
		{"chain made escaping later", []entry{dir("d"), symlink("d/x", "t/../.."), symlink("d/t", "../d")}, Options{}, "d/x", ErrUnsafe},
		{"symlink loop", []entry{symlink("a", "b/x"), symlink("b", "a/y")}, Options{}, "", ErrUnsafe},
		{"hardlink outside", []entry{hardlink("h", "../outside")}, Options{}, "h", ErrUnsafe},
		{"hardlink to absolute", []entry{hardlink("h", "/etc/shadow")}, Options{}, "h", ErrUnsafe},
		{"hardlink to symlink", []entry{symlink("s", "."), hardlink("h", "s")}, Options{}, "h", ErrUnsafe},
		{"hardlink to missing", []entry{hardlink("h", "nothere")}, Options{}, "h", ErrUnsafe},
		{"device", []entry{{name: "dev/sda", typ: tar.TypeBlock, mode: 0o600}}, Options{}, "dev/sda", ErrUnsafe},
		{"char device", []entry{{name: "null", typ: tar.TypeChar, mode: 0o666}}, Options{}, "null", ErrUnsafe},
		{"fifo", []entry{{name: "fifo", typ: tar.TypeFifo, mode: 0o600}}, Options{}, "fifo", ErrUnsafe},
		{"file too large", []entry{big}, Options{MaxFileSize: 1 << 20}, "big", ErrTooLarge},
		{"total too large", []entry{file("a", "12345"), file("b", "67890")}, Options{MaxTotalSize: 8}, "b", ErrTooLarge},
		{"too many entries", []entry{file("a", ""), file("b", ""), file("c", "")}, Options{MaxEntries: 2}, "c", ErrTooLarge},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			parent, dest := setup(t)
			a := archive(t, tc.entries...)
			res, err := Tar(context.Background(), bytes.NewReader(a), dest, tc.opts)
			if !errors.Is(err, tc.want) {
				t.Fatalf("Tar = %+v, %v; want %v", res, err, tc.want)
			}
			var me *MemberError
			if !errors.As(err, &me) {
				t.Fatalf("error %v is not a *MemberError", err)
			}
			if tc.member != "" && me.Name != tc.member {
				t.Errorf("error names member %q, want %q (%v)", me.Name, tc.member, err)
			}
			if !strings.Contains(err.Error(), me.Name) {
				t.Errorf("error %q does not name the member", err)
			}
			if res != (Result{}) {
				t.Errorf("Result = %+v on failure, want zero", res)
			}
			assertClean(t, parent, dest)
		})
	}
}

func TestTarReplacesEarlierMembers(t *testing.T) {
	t.Parallel()
	_, dest := setup(t)
	// A later member of the same name wins, and writing it never follows
	// the symbolic link that was there before.
	a := archive(t, file("target", "original"), symlink("f", "target"), file("f", "new"))
	if _, err := Tar(context.Background(), bytes.NewReader(a), dest, Options{}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dest, "target")); string(b) != "original" {
		t.Errorf("target = %q: written through the link", b)
	}
	if b, _ := os.ReadFile(filepath.Join(dest, "f")); string(b) != "new" {
		t.Errorf("f = %q", b)
	}
}

func TestTarTruncatedArchive(t *testing.T) {
	t.Parallel()
	parent, dest := setup(t)
	a := archive(t, file("a", "hello"), file("b", strings.Repeat("x", 4096)))
	_, err := Tar(context.Background(), bytes.NewReader(a[:1024+512+100]), dest, Options{})
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("Tar = %v, want io.ErrUnexpectedEOF", err)
	}
	assertClean(t, parent, dest)
}

func TestTarCancelled(t *testing.T) {
	t.Parallel()
	parent, dest := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	a := archive(t, file("a", "hello"), file("b", strings.Repeat("x", 1<<20)))
	r := &cancelAfter{r: bytes.NewReader(a), n: 4096, cancel: cancel}
	_, err := Tar(ctx, r, dest, Options{})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Tar = %v, want context.Canceled", err)
	}
	assertClean(t, parent, dest)
}

type cancelAfter struct {
	r      io.Reader
	n      int
	cancel func()
}

func (c *cancelAfter) Read(p []byte) (int, error) {
	if c.n <= 0 {
		c.cancel()
	}
	if len(p) > 512 {
		p = p[:512]
	}
	n, err := c.r.Read(p)
	c.n -= n
	return n, err
}

func TestTarDestination(t *testing.T) {
	t.Parallel()
	dest := t.TempDir()
	if err := os.WriteFile(filepath.Join(dest, "x"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Tar(context.Background(), bytes.NewReader(archive(t, file("a", ""))), dest, Options{}); !errors.Is(err, ErrDestination) {
		t.Errorf("non-empty dest: %v, want ErrDestination", err)
	}
	if _, err := Tar(context.Background(), bytes.NewReader(nil), filepath.Join(dest, "missing"), Options{}); !errors.Is(err, ErrDestination) {
		t.Errorf("missing dest: %v, want ErrDestination", err)
	}
}

func TestPrefixes(t *testing.T) {
	t.Parallel()
	in := Prefixes("usr/lib64/", "lib/modules.")
	for name, want := range map[string]bool{
		"usr/lib64": true, "usr/lib64/libc.so": true, "usr/lib64x": false, "usr/lib": false,
		"lib/modules.dep": true, "lib/modules": false,
	} {
		if got := in(name); got != want {
			t.Errorf("Prefixes(...)(%q) = %v, want %v", name, got, want)
		}
	}
}

func TestRelativeTo(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ dir, target, want string }{
		{"usr/lib64", "usr/lib64/libc.so.6", "libc.so.6"},
		{"usr/lib/modules/k", "usr/src/linux", "../../../src/linux"},
		{".", "usr", "usr"},
		{"a/b", ".", "../.."},
		{"a", "a", "."},
	} {
		if got := relativeTo(tc.dir, tc.target); got != tc.want {
			t.Errorf("relativeTo(%q, %q) = %q, want %q", tc.dir, tc.target, got, tc.want)
		}
	}
}
