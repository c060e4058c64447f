package flatcartest

import (
	"archive/tar"
	"os"
	"path/filepath"
	"testing"
)

// TestDirEntries lays out a tree like Debian's linux-headers-<kver>-amd64,
// whose entries link into the sibling -common directory, and checks that
// the links leaving the tree are replaced by what they point to while the
// links inside it stay links.
func TestDirEntries(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	common := filepath.Join(base, "common")
	tree := filepath.Join(base, "amd64")
	for _, d := range []string{filepath.Join(common, "include/linux"), filepath.Join(tree, "scripts")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p, s string) {
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(common, "include/linux/module.h"), "h")
	write(filepath.Join(common, "Makefile"), "m")
	write(filepath.Join(tree, "scripts/fixdep"), "x")
	for link, target := range map[string]string{
		"include":     "../common/include",
		"Makefile":    "../common/Makefile",
		"scripts/dep": "fixdep",
		"dangling":    "../nothing",
	} {
		if err := os.Symlink(target, filepath.Join(tree, link)); err != nil {
			t.Fatal(err)
		}
	}
	es, err := DirEntries(tree)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Entry{}
	for _, e := range es {
		got[e.Name] = e
	}
	want := map[string]byte{
		"Makefile": tar.TypeReg, "include/": tar.TypeDir, "include/linux/": tar.TypeDir,
		"include/linux/module.h": tar.TypeReg, "scripts/": tar.TypeDir, "scripts/fixdep": tar.TypeReg,
		"scripts/dep": tar.TypeSymlink,
	}
	if len(got) != len(want) {
		t.Errorf("entries %v, want %v", got, want)
	}
	for name, typ := range want {
		if e, ok := got[name]; !ok || e.Type != typ {
			t.Errorf("%s: %+v, want type %q", name, e, typ)
		}
	}
	if got["scripts/dep"].Linkname != "fixdep" || got["Makefile"].Source != filepath.Join(common, "Makefile") {
		t.Errorf("link %+v, file %+v", got["scripts/dep"], got["Makefile"])
	}
}
