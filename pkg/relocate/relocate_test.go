package relocate_test

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/relocate"
)

const aptInstall = "apt-get install -y --no-install-recommends gcc libc6-dev patchelf"

// hello reports which C library it runs with.
const helloC = `#include <stdio.h>
#include <string.h>
int main(void) {
	char line[512];
	FILE *f = fopen("/proc/self/maps", "r");
	while (f && fgets(line, sizeof line, f))
		if (strstr(line, "libc.so")) { fputs(strchr(line, '/'), stdout); break; }
	return 0;
}
`

// needs fails the test, naming the apt-get line, when a tool is missing.
func needs(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("this test needs %s: %v; install it as root with:\n  %s", tool, err, aptInstall)
		}
	}
}

func run(t *testing.T, dir, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %q: %v\n%s", name, args, err, out)
	}
	return string(out)
}

func write(t *testing.T, path, content string, perm os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), perm); err != nil {
		t.Fatal(err)
	}
}

// hostLibs returns the real paths of this machine's dynamic loader and C library, which bin uses.
func hostLibs(t *testing.T, bin string) (loader, libc string) {
	t.Helper()
	for _, line := range strings.Split(run(t, "", "ldd", bin), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) >= 3 && f[0] == "libc.so.6":
			libc = f[2]
		case len(f) >= 1 && strings.HasPrefix(f[0], "/") && strings.Contains(f[0], "ld-linux"):
			loader = f[0]
		}
	}
	if loader == "" || libc == "" {
		t.Fatalf("ldd %s: no loader or libc", bin)
	}
	for _, p := range []*string{&loader, &libc} {
		real, err := filepath.EvalSymlinks(*p)
		if err != nil {
			t.Fatal(err)
		}
		*p = real
	}
	return loader, libc
}

// copyFile copies a file's content, with mode 0755.
func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	write(t, to, string(b), 0o755)
}

func interpreter(t *testing.T, path string) string {
	t.Helper()
	f, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			b := make([]byte, p.Filesz)
			if _, err := p.ReadAt(b, 0); err != nil {
				t.Fatal(err)
			}
			return strings.TrimRight(string(b), "\x00")
		}
	}
	return ""
}

// setup builds a tree of helpers and a sysroot holding copies of this machine's loader (behind an
// absolute symbolic link, as distributions install it) and C library.
//
//	scripts/basic/fixdep   dynamic, its interpreter moved to a path that does not exist
//	scripts/mod/modpost    dynamic, runs as it is
//	scripts/static-helper  static
//	scripts/run.sh         an executable script (not ELF)
//	scripts/helper.o       an object file with an execute bit (not an executable)
func setup(t *testing.T) (tree, sysroot string) {
	t.Helper()
	needs(t, "gcc", "patchelf", "ldd")
	src := t.TempDir()
	write(t, filepath.Join(src, "hello.c"), helloC, 0o644)
	tree, sysroot = t.TempDir(), t.TempDir()
	fixdep := filepath.Join(tree, "scripts", "basic", "fixdep")
	modpost := filepath.Join(tree, "scripts", "mod", "modpost")
	static := filepath.Join(tree, "scripts", "static-helper")
	for _, p := range []string{fixdep, modpost, static} {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	run(t, src, "gcc", "-o", fixdep, "hello.c")
	run(t, src, "gcc", "-o", modpost, "hello.c")
	run(t, src, "gcc", "-static", "-o", static, "hello.c")
	run(t, src, "gcc", "-c", "-o", filepath.Join(tree, "scripts", "helper.o"), "hello.c")
	if err := os.Chmod(filepath.Join(tree, "scripts", "helper.o"), 0o755); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(tree, "scripts", "run.sh"), "#!/bin/sh\nexit 0\n", 0o755)

	loader, libc := hostLibs(t, fixdep)
	lib64 := filepath.Join(sysroot, "usr", "lib64")
	copyFile(t, loader, filepath.Join(lib64, "ld-2.99.so"))
	if err := os.Symlink("/usr/lib64/ld-2.99.so", filepath.Join(lib64, filepath.Base(interpreter(t, fixdep)))); err != nil {
		t.Fatal(err)
	}
	copyFile(t, libc, filepath.Join(lib64, "libc.so.6"))
	run(t, "", "patchelf", "--set-interpreter", "/nonexistent/lib64/"+filepath.Base(interpreter(t, fixdep)), fixdep)
	if err := exec.Command(fixdep).Run(); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the broken fixdep runs: %v", err)
	}
	return tree, sysroot
}

func TestTree(t *testing.T) {
	t.Parallel()
	tree, sysroot := setup(t)
	static := filepath.Join(tree, "scripts", "static-helper")
	modpost := filepath.Join(tree, "scripts", "mod", "modpost")
	before := map[string][]byte{}
	for _, p := range []string{static, modpost} {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		before[p] = b
	}

	res, err := relocate.Tree(context.Background(), tree, relocate.Options{Sysroot: sysroot, Procs: host.OSExec{}})
	if err != nil {
		t.Fatal(err)
	}
	want := relocate.Result{Relocated: []string{"scripts/basic/fixdep"}, Runnable: []string{"scripts/mod/modpost"}, Static: []string{"scripts/static-helper"}}
	if !slices.Equal(res.Relocated, want.Relocated) || !slices.Equal(res.Runnable, want.Runnable) || !slices.Equal(res.Static, want.Static) {
		t.Errorf("result %+v, want %+v", res, want)
	}

	// fixdep now starts with the sysroot's loader and C library.
	fixdep := filepath.Join(tree, "scripts", "basic", "fixdep")
	lib64 := filepath.Join(sysroot, "usr", "lib64")
	if got := interpreter(t, fixdep); got != filepath.Join(lib64, "ld-2.99.so") {
		t.Errorf("interpreter %s, want the sysroot's loader with its link resolved inside the sysroot", got)
	}
	out, err := exec.Command(fixdep).Output()
	if err != nil {
		t.Fatalf("relocated fixdep: %v", err)
	}
	if got := strings.TrimSpace(string(out)); got != filepath.Join(lib64, "libc.so.6") {
		t.Errorf("relocated fixdep runs with C library %q, want the sysroot's", got)
	}
	rpath := run(t, "", "patchelf", "--print-rpath", fixdep)
	if strings.TrimSpace(rpath) != lib64 {
		t.Errorf("rpath %q", rpath)
	}
	for p, b := range before {
		if now, _ := os.ReadFile(p); !bytes.Equal(now, b) {
			t.Errorf("%s was changed", p)
		}
	}

	// A second run finds everything runnable and changes nothing.
	res, err = relocate.Tree(context.Background(), tree, relocate.Options{Sysroot: sysroot, Procs: host.OSExec{}})
	if err != nil || len(res.Relocated) != 0 || len(res.Runnable) != 2 {
		t.Errorf("second run: %+v, %v", res, err)
	}
}

// A helper that needs a library the sysroot lacks is reported with the loader's message; it runs
// through the agent's reaper.
func TestTreeMissingLibrary(t *testing.T) {
	t.Parallel()
	tree, sysroot := setup(t)
	src := t.TempDir()
	write(t, filepath.Join(src, "lib.c"), "int standin_value(void) { return 7; }\n", 0o644)
	write(t, filepath.Join(src, "main.c"), "int standin_value(void);\nint main(void) { return standin_value() - 7; }\n", 0o644)
	run(t, src, "gcc", "-shared", "-fPIC", "-o", "libstandin.so", "lib.c")
	objtool := filepath.Join(tree, "tools", "objtool", "objtool")
	if err := os.MkdirAll(filepath.Dir(objtool), 0o755); err != nil {
		t.Fatal(err)
	}
	run(t, src, "gcc", "-o", objtool, "main.c", "-L.", "-lstandin")
	run(t, "", "patchelf", "--set-interpreter", "/nonexistent/lib64/"+filepath.Base(interpreter(t, objtool)), objtool)

	reaper, err := daemon.NewReaper(daemon.ReaperOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer reaper.Close()
	res, err := relocate.Tree(context.Background(), tree, relocate.Options{Sysroot: sysroot, Procs: reaper})
	if !errors.Is(err, relocate.ErrNotRunnable) {
		t.Fatalf("Tree = %v, want ErrNotRunnable", err)
	}
	for _, s := range []string{"tools/objtool/objtool does not start after relocation", "libstandin.so: cannot open shared object file"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error lacks %q: %v", s, err)
		}
	}
	if !slices.Equal(res.Relocated, []string{"scripts/basic/fixdep"}) {
		t.Errorf("relocated %v", res.Relocated)
	}
}

func TestTreeNoLoader(t *testing.T) {
	t.Parallel()
	tree, _ := setup(t)
	empty := t.TempDir()
	if err := os.MkdirAll(filepath.Join(empty, "usr", "lib64"), 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := relocate.Tree(context.Background(), tree, relocate.Options{Sysroot: empty, Procs: host.OSExec{}})
	if !errors.Is(err, relocate.ErrNoLoader) || !strings.Contains(err.Error(), "scripts/basic/fixdep") {
		t.Fatalf("Tree = %v, want ErrNoLoader naming fixdep", err)
	}
	if _, err := relocate.Tree(context.Background(), tree, relocate.Options{Sysroot: filepath.Join(empty, "nope"), Procs: host.OSExec{}}); err == nil {
		t.Error("Tree with a missing sysroot succeeded")
	}
	if _, err := relocate.Tree(context.Background(), tree, relocate.Options{}); err == nil {
		t.Error("Tree without a sysroot succeeded")
	}
}

func TestTreeCancelled(t *testing.T) {
	t.Parallel()
	tree, sysroot := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := relocate.Tree(ctx, tree, relocate.Options{Sysroot: sysroot, Procs: host.OSExec{}}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Tree = %v, want context.Canceled", err)
	}
}
