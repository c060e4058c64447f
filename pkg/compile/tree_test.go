package compile

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const kver = "6.6.95-flatcar"

// mkTree writes a minimal configured build tree at dir for release.
func mkTree(t *testing.T, dir, release, makefile string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(dir, "include/generated"), 0o755); err != nil {
		t.Fatal(err)
	}
	files := map[string]string{"Makefile": makefile, ".config": "CONFIG_MODULES=y\n", "include/generated/utsrelease.h": "#define UTS_RELEASE \"" + release + "\"\n"}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func symlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

func TestLocalTreeFollowsHostSymlinksInsideHostRoot(t *testing.T) {
	host := t.TempDir()
	// /lib/modules/<kver>/build -> /usr/src/linux-<kver>, an absolute link as distributions make it.
	mkTree(t, filepath.Join(host, "usr/src/linux-"+kver), kver, "VERSION = 6\n")
	symlink(t, "/usr/src/linux-"+kver, filepath.Join(host, "lib/modules", kver, "build"))
	tree, skipped, err := localTree(host, "", kver)
	if err != nil {
		t.Fatalf("localTree: %v (skipped %q)", err, skipped)
	}
	if want := filepath.Join(host, "usr/src/linux-"+kver); tree.Dir != want || tree.From != "host" {
		t.Errorf("tree = %+v, want %s from host", tree, want)
	}
}

func TestLocalTreePrefersUsrLibModules(t *testing.T) {
	host := t.TempDir()
	mkTree(t, filepath.Join(host, "usr/lib/modules", kver, "build"), kver, "")
	mkTree(t, filepath.Join(host, "lib/modules", kver, "build"), kver, "")
	tree, _, err := localTree(host, "", kver)
	if err != nil || !strings.Contains(tree.Dir, "usr/lib/modules") {
		t.Fatalf("tree %+v, err %v: want the Flatcar location first", tree, err)
	}
}

func TestLocalTreeSkipsUnusableHostTrees(t *testing.T) {
	host, given := t.TempDir(), t.TempDir()
	mkTree(t, filepath.Join(host, "usr/lib/modules", kver, "build"), "6.6.94-flatcar", "")
	mkTree(t, filepath.Join(host, "lib/modules", kver, "build"), kver, "include /nonexistent/linux-headers-common/Makefile\n")
	symlink(t, "../../../../..", filepath.Join(host, "usr/lib64/modules", kver, "build"))
	mkTree(t, given, kver, "")
	tree, skipped, err := localTree(host, given, kver)
	if err != nil || tree.Dir != given || tree.From != "--kernel-build-tree" {
		t.Fatalf("tree %+v, err %v: want the given tree", tree, err)
	}
	all := strings.Join(skipped, "\n")
	for _, want := range []string{"build tree of kernel 6.6.94-flatcar, not of the running kernel " + kver, "includes /nonexistent/linux-headers-common/Makefile", "is not a configured kernel build tree"} {
		if !strings.Contains(all, want) {
			t.Errorf("skipped reasons\n%s\nlack %q", all, want)
		}
	}
}

func TestLocalTreeNoTree(t *testing.T) {
	_, _, err := localTree(t.TempDir(), "", kver)
	if !errors.Is(err, ErrNoTree) {
		t.Fatalf("err = %v, want ErrNoTree", err)
	}
	bad := t.TempDir()
	_, _, err = localTree(t.TempDir(), bad, kver)
	if err == nil || errors.Is(err, ErrNoTree) || !strings.Contains(err.Error(), "--kernel-build-tree: "+bad+" is not a configured kernel build tree") {
		t.Fatalf("err = %v, want a --kernel-build-tree error", err)
	}
}

func TestResolveInStaysInsideRoot(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	symlink(t, outside, filepath.Join(root, "abs"))     // absolute: taken under root, where it does not exist
	symlink(t, "../../..", filepath.Join(root, "a/up")) // climbs to root and stops there
	symlink(t, "loop", filepath.Join(root, "loop"))
	if _, err := resolveIn(root, "abs"); err == nil {
		t.Error("an absolute link resolved outside the root")
	}
	if got, err := resolveIn(root, "a/up"); err != nil || got != root {
		t.Errorf("a/up = %q, %v; want the root", got, err)
	}
	if _, err := resolveIn(root, "loop"); err == nil || !strings.Contains(err.Error(), "too many symbolic links") {
		t.Errorf("loop: %v", err)
	}
}
