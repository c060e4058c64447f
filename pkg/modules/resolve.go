package modules

import (
	"bufio"
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/modfile"
)

// File is a module file resolved for loading.
type File struct {
	Image host.ModuleImage
	Info  modfile.ModInfo
	// partial: Info holds only the name and the dependencies modules.dep gives (Tree.Resolve);
	// fullInfo reads the rest when a refusal needs it.
	partial bool
}

// Resolve reads each image's .modinfo (decompressing .ko.xz/.ko.zst/.ko.gz into Data, reading
// only the section of a plain .ko) and returns the images ordered so that every module comes
// after the modules of the set it depends on (depends= in .modinfo).
func Resolve(images []host.ModuleImage) ([]File, error) {
	return resolve(images, resolveOne)
}

// KernelDecompresses is the compression the running kernel decompresses itself
// (<sys>/module/compression, CONFIG_MODULE_DECOMPRESS, Linux 5.17 and later); None when it
// decompresses none.
func KernelDecompresses(r host.Roots) modfile.Compression {
	data, err := os.ReadFile(r.InSys("module/compression"))
	if err != nil {
		return modfile.None
	}
	c, _ := modfile.KernelCompression(string(data))
	return c
}

// Resolve is the package's Resolve for modules of the tree, which modules.dep describes: a plain
// module, or one compressed in kc, the format the kernel decompresses itself
// (KernelDecompresses), is not read here; its dependencies come from modules.dep and the kernel
// gets the file as it is (Compressed when compressed). Decompressing xz in Go costs about as
// much as the rest of a cached start, and parsing a plain module's ELF headers for its .modinfo
// several milliseconds of a start in the VM bench.
func (t *Tree) Resolve(images []host.ModuleImage, kc modfile.Compression) ([]File, error) {
	return resolve(images, func(im host.ModuleImage) (File, error) {
		c, err := modfile.CompressionFor(im.Path)
		if err != nil || c != modfile.None && c != kc {
			return resolveOne(im)
		}
		im.Compressed = c != modfile.None
		return File{Image: im, Info: modfile.ModInfo{Name: im.Name, Depends: t.Deps[im.Name]}, partial: true}, nil
	})
}

// resolve resolves each image with one and orders the files by their dependencies.
func resolve(images []host.ModuleImage, one func(host.ModuleImage) (File, error)) ([]File, error) {
	files := make([]File, 0, len(images))
	byName := map[string]int{}
	for _, im := range images {
		f, err := one(im)
		if err != nil {
			return nil, err
		}
		byName[f.Image.Name] = len(files)
		files = append(files, f)
	}
	names := make([]string, len(files))
	for i, f := range files {
		names[i] = f.Image.Name
	}
	order, err := kernel.DepthFirst(names, func(name string) []string {
		var deps []string
		for _, d := range files[byName[name]].Info.Depends {
			deps = append(deps, kernel.Normalize(d))
		}
		return deps
	}, "dependency")
	if err != nil {
		return nil, err
	}
	ordered := make([]File, len(order))
	for i, name := range order {
		ordered[i] = files[byName[name]]
	}
	return ordered, nil
}

// fullInfo is f's .modinfo; for a module of the tree Tree.Resolve knew only its name and the
// dependencies modules.dep gives for a module it was read for, so it is read here, when a refusal
// needs its version, vermagic or dependencies.
func (f File) fullInfo() modfile.ModInfo {
	if !f.partial {
		return f.Info
	}
	var info modfile.ModInfo
	var err error
	if f.Image.Compressed {
		var m *modfile.Module
		if m, err = modfile.Open(f.Image.Path); err == nil {
			info, err = modfile.Info(m.Data)
		}
	} else {
		info, err = plainInfo(f.Image)
	}
	if err != nil {
		return f.Info
	}
	return info
}

func resolveOne(im host.ModuleImage) (File, error) {
	c, err := modfile.CompressionFor(im.Path)
	if err != nil {
		return File{}, fmt.Errorf("module %s: %w", im.Path, err)
	}
	var info modfile.ModInfo
	switch {
	case im.Data != nil:
		info, err = modfile.Info(im.Data)
	case c != modfile.None:
		var m *modfile.Module
		if m, err = modfile.Open(im.Path); err == nil {
			im.Data = m.Data
			info, err = modfile.Info(m.Data)
		}
	default:
		info, err = plainInfo(im)
	}
	if err != nil {
		return File{}, fmt.Errorf("module %s: %w", im.Path, err)
	}
	if im.Name == "" {
		im.Name = kernel.Normalize(info.Name)
	}
	if info.Name != "" && kernel.Normalize(info.Name) != im.Name {
		return File{}, fmt.Errorf("module %s: its .modinfo says it is %q, not %q", im.Path, info.Name, im.Name)
	}
	return File{Image: im, Info: info}, nil
}

// plainInfo reads only the .modinfo section of an uncompressed module, so a 70 MiB nvidia.ko is
// not read into memory just to learn its dependencies. A module open already (File: one verified
// as it was opened) is read through that descriptor, which stays open, and not opened again by path.
func plainInfo(im host.ModuleImage) (modfile.ModInfo, error) {
	var f *elf.File
	var err error
	if im.File != nil {
		f, err = elf.NewFile(im.File)
	} else {
		f, err = elf.Open(im.Path)
		if f != nil {
			defer f.Close()
		}
	}
	if err != nil {
		return modfile.ModInfo{}, err
	}
	sec := f.Section(".modinfo")
	if sec == nil {
		return modfile.ModInfo{}, modfile.ErrNoModinfo
	}
	if sec.Size > 1<<20 {
		return modfile.ModInfo{}, fmt.Errorf(".modinfo is %d bytes: %w", sec.Size, modfile.ErrMalformed)
	}
	data, err := sec.Data()
	if err != nil {
		return modfile.ModInfo{}, err
	}
	return modfile.ParseModinfo(data), nil
}

// Tree is a kernel's module directory (<...>/lib/modules/<release>) with what its depmod files
// say of the modules it was read for (ReadTree's names) only: Deps has an entry, possibly empty,
// for each of them that modules.dep lists, Paths also has their dependencies, and Builtin has
// those of them built in. A dependency's own line is not read (unless it was asked for too): Deps
// has no entry for it, so Resolve keeps it, in the kernel's format, where Closure put it.
type Tree struct {
	Dir     string
	Deps    map[string][]string // module read -> dependency names, deepest last
	Paths   map[string]string   // module read, or a dependency of one -> file, relative to Dir
	Builtin map[string]bool     // modules read that are built in
}

// FindTree returns the first of the candidate module directories for release that has a
// modules.dep, read for the modules names (ReadTree): the host's /usr/lib/modules (Flatcar),
// /lib/modules, /usr/lib64/modules (old Flatcar), then the container's /lib/modules.
func FindTree(r host.Roots, release string, names []string) (*Tree, error) {
	candidates := []string{
		r.InHost("usr/lib/modules", release), r.InHost("lib/modules", release), r.InHost("usr/lib64/modules", release),
		r.InRoot("lib/modules", release), r.InRoot("usr/lib/modules", release),
	}
	var errs []error
	for i, dir := range candidates {
		if slices.Contains(candidates[:i], dir) { // the host root is the container's (a fallback)
			continue
		}
		t, err := ReadTree(dir, names)
		if err == nil {
			return t, nil
		}
		errs = append(errs, err)
	}
	return nil, fmt.Errorf("no modules.dep for kernel %s: %w", release, errors.Join(errs...))
}

// ReadTree reads dir/modules.dep and, when present, dir/modules.builtin for the modules names
// ('-' and '_' alike). A module's line in modules.dep lists every module it needs, so only the
// lines of names are parsed.
func ReadTree(dir string, names []string) (*Tree, error) {
	f, err := os.Open(filepath.Join(dir, "modules.dep"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	wanted := make(map[string]bool, len(names))
	for _, n := range names {
		wanted[kernel.Normalize(n)] = true
	}
	t := &Tree{Dir: dir}
	if t.Paths, t.Deps, err = ParseDep(f, func(name string) bool { return wanted[name] }); err != nil {
		return nil, fmt.Errorf("%s: %w", f.Name(), err)
	}
	t.Builtin = map[string]bool{}
	if b, err := os.Open(filepath.Join(dir, "modules.builtin")); err == nil {
		defer b.Close()
		sc := bufio.NewScanner(b)
		for sc.Scan() {
			if p := bytes.TrimSpace(sc.Bytes()); len(p) > 0 {
				if name := modfile.NameFromPath(string(p)); wanted[name] {
					t.Builtin[name] = true
				}
			}
		}
	}
	return t, nil
}

// ParseDep parses modules.dep ("kernel/a/b.ko.xz: kernel/c.ko kernel/d.ko") for the modules want
// accepts (by normalised name; every module when want is nil): deps has an entry, possibly empty,
// for each of them, and paths has their files and their dependencies' (a module's own line wins
// over the lines that name it as a dependency). The line of another module is read only as far as
// its module name: only a line without one is an error there.
func ParseDep(r io.Reader, want func(name string) bool) (paths map[string]string, deps map[string][]string, err error) {
	paths, deps = map[string]string{}, map[string][]string{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20) // reads of 64 KiB: modules.dep is 0.5 MiB or more
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		mod, rest, ok := bytes.Cut(line, []byte(":"))
		mod = bytes.TrimSpace(mod)
		if !ok || len(mod) == 0 {
			return nil, nil, badLine(n, line)
		}
		name := modfile.NameFromPath(string(mod))
		if want != nil && !want(name) {
			continue
		}
		if bytes.IndexByte(mod, ' ') >= 0 || mod[0] == '/' || bytes.Contains(mod, []byte("..")) {
			return nil, nil, badLine(n, line)
		}
		if err := addDep(paths, deps, name, string(mod), string(rest)); err != nil {
			return nil, nil, fmt.Errorf("modules.dep line %d: %w", n, err)
		}
	}
	return paths, deps, sc.Err()
}

// badLine is the error for line n of modules.dep, which is not "<module path>: <dependencies>".
func badLine(n int, line []byte) error {
	return fmt.Errorf("modules.dep line %d: want \"<module path>: <dependencies>\": %q", n, line)
}

// addDep records the module name at path and the dependencies rest (the rest of its line) lists:
// their names in deps[name], in order, and their paths unless paths has them already.
func addDep(paths map[string]string, deps map[string][]string, name, path, rest string) error {
	paths[name] = path
	ds := deps[name]
	for _, d := range strings.Fields(rest) {
		if strings.HasPrefix(d, "/") || strings.Contains(d, "..") {
			return fmt.Errorf("bad dependency %q", d)
		}
		dn := modfile.NameFromPath(d)
		if _, ok := paths[dn]; !ok {
			paths[dn] = d
		}
		ds = append(ds, dn)
	}
	deps[name] = ds
	return nil
}

// Closure returns the files to load for name, dependencies first (modules.dep lists them with the
// deepest last), leaving out modules that are loaded or built in. ok is false when the tree does
// not know the module: modules.dep does not list it, or the tree was not read for it (Tree).
func (t *Tree) Closure(name string, loaded map[string]bool) (images []host.ModuleImage, ok bool) {
	name = kernel.Normalize(name)
	if t.Builtin[name] {
		return nil, true
	}
	deps, read := t.Deps[name]
	if !read {
		return nil, false
	}
	for i := len(deps) - 1; i >= 0; i-- {
		d := deps[i]
		if loaded[d] || t.Builtin[d] {
			continue
		}
		if p, known := t.Paths[d]; known {
			images = append(images, host.ModuleImage{Name: d, Path: filepath.Join(t.Dir, p)})
		}
	}
	if !loaded[name] {
		images = append(images, host.ModuleImage{Name: name, Path: filepath.Join(t.Dir, t.Paths[name])})
	}
	return images, true
}
