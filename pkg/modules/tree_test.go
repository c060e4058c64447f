package modules

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/modfile"
)

// benchNames are the modules the agent asks the tree for: its prerequisites and a dependency of
// the NVIDIA modules outside their set.
var benchNames = []string{"i2c_core", "ipmi_msghandler", "ipmi_devintf", "video", "drm"}

// writeBenchTree writes a modules.dep of about 4000 lines, like Debian's for 6.1, with a
// modules.builtin of 200 lines, and returns its directory.
func writeBenchTree(b *testing.B) string {
	b.Helper()
	var dep, builtin strings.Builder
	for i := range 4000 {
		sep := "_"
		if i%3 == 0 {
			sep = "-"
		}
		fmt.Fprintf(&dep, "kernel/drivers/x%d/mod%s%04d.ko: kernel/a/dep%d.ko kernel/b/dep%d.ko", i%40, sep, i, i%97, i%89)
		if i%50 == 0 {
			for j := range 20 {
				fmt.Fprintf(&dep, " kernel/drivers/long/long-dependency%02d.ko", j)
			}
		}
		dep.WriteString("\n")
		switch i {
		case 1000:
			dep.WriteString("kernel/drivers/char/ipmi/ipmi_msghandler.ko:\n")
		case 1001:
			dep.WriteString("kernel/drivers/char/ipmi/ipmi_devintf.ko: kernel/drivers/char/ipmi/ipmi_msghandler.ko\n")
		case 2000:
			dep.WriteString("kernel/drivers/acpi/video.ko: kernel/drivers/platform/x86/wmi.ko\n")
		case 3000:
			dep.WriteString("kernel/drivers/gpu/drm/drm.ko: kernel/drivers/gpu/drm/drm_panel_orientation_quirks.ko\n")
		}
	}
	for i := range 199 {
		fmt.Fprintf(&builtin, "kernel/builtin/b%d/built-in%03d.ko\n", i%10, i)
	}
	builtin.WriteString("kernel/drivers/i2c/i2c-core.ko\n")
	dir := b.TempDir()
	hosttest.Must(b, os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep.String()), 0o644))
	hosttest.Must(b, os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte(builtin.String()), 0o644))
	return dir
}

// BenchmarkReadTree reads a tree of Debian's size for the agent's prerequisites.
func BenchmarkReadTree(b *testing.B) {
	dir := writeBenchTree(b)
	b.ReportAllocs()
	for b.Loop() {
		tree, err := ReadTree(dir, benchNames)
		if err != nil {
			b.Fatal(err)
		}
		for _, n := range benchNames {
			if _, ok := tree.Closure(n, nil); !ok {
				b.Fatalf("%s not found", n)
			}
		}
	}
}

// ReadTree reads the lines of the modules it is asked for only: their dependencies get their
// files from those lines, whether their own lines are elsewhere (and say otherwise) or absent, a
// module asked for keeps its own line's file, and of modules.builtin only the names asked for
// are kept. The tree knows nothing of a module it was not read for.
func TestReadTreeForNames(t *testing.T) {
	t.Parallel()
	x := "kernel/x.ko.xz: kernel/a/dep-a.ko.xz kernel/b/dep_b.ko.xz\n"
	others := []string{
		"kernel/y.ko: kernel/y/dep-a.ko.xz\n",
		"kernel/own/dep-a.ko.xz: kernel/b/dep_b.ko.xz\n",
		"kernel/z.ko: /abs/bad.ko ../up.ko\n",
		"/abs/w w.ko: kernel/../w.ko\n",
	}
	for _, dep := range []string{x + strings.Join(others, ""), strings.Join(others, "") + x} {
		dir := t.TempDir()
		hosttest.Must(t, os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep), 0o644))
		hosttest.Must(t, os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte("kernel/drivers/video/video.ko\nkernel/drivers/i2c/i2c-core.ko\n"), 0o644))
		if _, err := ReadTree(dir, nil); err != nil {
			t.Fatalf("a bad dependency on a line not read: %v", err)
		}
		if _, _, err := ParseDep(strings.NewReader(dep), nil); err == nil {
			t.Fatal("the whole modules.dep parsed without the bad dependency's error")
		}

		tree, err := ReadTree(dir, []string{"x", "i2c-core"})
		if err != nil {
			t.Fatal(err)
		}
		images, ok := tree.Closure("x", nil)
		want := []host.ModuleImage{
			{Name: "dep_b", Path: filepath.Join(dir, "kernel/b/dep_b.ko.xz")},
			{Name: "dep_a", Path: filepath.Join(dir, "kernel/a/dep-a.ko.xz")},
			{Name: "x", Path: filepath.Join(dir, "kernel/x.ko.xz")},
		}
		if !ok || !slices.EqualFunc(images, want, func(a, b host.ModuleImage) bool { return a.Name == b.Name && a.Path == b.Path }) {
			t.Errorf("closure of x: %+v, %v; want %+v", images, ok, want)
		}
		for _, name := range []string{"dep_a", "dep_b", "y", "video", "nope"} {
			if images, ok := tree.Closure(name, nil); ok {
				t.Errorf("closure of %s, not read: %+v, ok", name, images)
			}
		}
		if images, ok := tree.Closure("i2c_core", nil); !ok || images != nil {
			t.Errorf("closure of the built-in i2c_core: %+v, %v", images, ok)
		}
		if !maps.Equal(tree.Builtin, map[string]bool{"i2c_core": true}) || len(tree.Deps) != 1 {
			t.Errorf("builtin %v, deps %v: want only what was asked for", tree.Builtin, tree.Deps)
		}
		// A kernel that decompresses xz: no depends for dep_a and dep_b, kept in Closure's order.
		files, err := tree.Resolve(images, modfile.XZ)
		if err != nil || len(files) != 3 || files[0].Image.Name != "dep_b" || files[1].Image.Name != "dep_a" || files[2].Image.Name != "x" {
			t.Errorf("resolve: %+v, %v", files, err)
		}

		tree, err = ReadTree(dir, []string{"x", "dep-a"})
		if err != nil {
			t.Fatal(err)
		}
		if images, ok := tree.Closure("dep_a", nil); !ok || len(images) != 2 || images[1].Path != filepath.Join(dir, "kernel/own/dep-a.ko.xz") {
			t.Errorf("closure of dep_a, read: %+v, %v; want its own line's file", images, ok)
		}
	}
}

// firstModule is the module path of in's first line that is not blank.
func firstModule(in string) string {
	for line := range strings.Lines(in) {
		if line = strings.TrimSpace(line); line != "" {
			mod, _, _ := strings.Cut(line, ":")
			return strings.TrimSpace(mod)
		}
	}
	return ""
}

// Filtered, ParseDep accepts whatever it accepts whole, and gives the modules it was asked for
// the dependencies and files the whole parse gives them, with a file for each dependency.
func FuzzParseDepFiltered(f *testing.F) {
	f.Add("kernel/a.ko: kernel/b.ko\nkernel/b.ko:\n")
	f.Add("kernel/x-y.ko.xz: kernel/b.ko kernel/c/c.ko\nkernel/c/c.ko: kernel/b.ko\nkernel/z.ko: /bad.ko\n")
	f.Add("\n a/b-c/ : d.ko.zst\nother/b.ko: e.ko\nkernel/a/b_c.ko.gz:\n")
	f.Fuzz(func(t *testing.T, in string) {
		paths, deps, err := ParseDep(strings.NewReader(in), nil)
		if err != nil {
			return
		}
		wanted := map[string]bool{"b": true}
		if first := firstModule(in); first != "" {
			name := modfile.NameFromPath(first)
			if _, ok := deps[name]; !ok {
				t.Fatalf("the first line's module %s is not in the whole parse", name)
			}
			wanted[name] = true
		}
		fpaths, fdeps, err := ParseDep(strings.NewReader(in), func(name string) bool { return wanted[name] })
		if err != nil {
			t.Fatalf("filtered: %v", err)
		}
		named := map[string]bool{}
		for name, ds := range fdeps {
			named[name] = true
			if !wanted[name] {
				t.Fatalf("%s read, not asked for", name)
			}
			if _, ok := deps[name]; !ok || !slices.Equal(ds, deps[name]) || fpaths[name] != paths[name] {
				t.Fatalf("%s: filtered %v at %q, whole %v at %q", name, ds, fpaths[name], deps[name], paths[name])
			}
			for _, d := range ds {
				named[d] = true
				if _, ok := fpaths[d]; !ok {
					t.Fatalf("%s: no file for its dependency %s", name, d)
				}
			}
		}
		for name := range wanted {
			if _, ok := deps[name]; ok {
				if _, ok := fdeps[name]; !ok {
					t.Fatalf("%s in the whole parse, not in the filtered one", name)
				}
			}
		}
		for name := range fpaths {
			if !named[name] {
				t.Fatalf("a file for %s, neither read nor a dependency", name)
			}
		}
	})
}
