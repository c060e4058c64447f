package hosttest

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/modfile"
)

// FakeModule describes a module the fake kernel can load. When the image handed to LoadModule is
// an ELF object with a .modinfo section (see ModuleELF), its version and depends are used instead,
// and an image that is not a module is refused with ENOEXEC, as the kernel does.
type FakeModule struct {
	Version string   // MODULE_VERSION, shown in /sys/module/<name>/version
	Deps    []string // modules that must be loaded first; they become holders' targets
	Err     error    // returned by LoadModule instead of loading
}

// FakeKernel is a stateful host.Kernel. Loading writes <proc>/modules and <sys>/module/<name>/
// (initstate, refcnt, version, holders/, parameters/); unloading refuses while holders or users
// remain. After WithoutModuleUnload it is a kernel built without CONFIG_MODULE_UNLOAD.
type FakeKernel struct {
	proc, sys string
	modules   map[string]FakeModule

	mu     sync.Mutex
	base   string          // the fixture's own /proc/modules lines
	fixed  map[string]bool // the modules on those lines: loaded, and never unloaded by the fake
	loaded []string        // load order
	params map[string]map[string]string
	users  map[string]int // extra references, like open device files
	busy   map[string]int // UnloadModule fails with EBUSY this many more times
	calls  []string
	// noUnload: no counts ("-" in /proc/modules, no refcnt), no holder links, and
	// delete_module answers ENOSYS.
	noUnload bool
}

// NewFakeKernel returns a fake kernel over the roots' proc and sys. modules says what can be
// loaded; unknown names load with no dependencies.
func NewFakeKernel(r host.Roots, modules map[string]FakeModule) *FakeKernel {
	if modules == nil {
		modules = map[string]FakeModule{}
	}
	base, _ := os.ReadFile(filepath.Join(r.Proc, "modules"))
	fixed := map[string]bool{}
	for _, line := range strings.Split(string(base), "\n") {
		if f := strings.Fields(line); len(f) > 0 {
			fixed[f[0]] = true
		}
	}
	return &FakeKernel{proc: r.Proc, sys: r.Sys, modules: modules, base: string(base), fixed: fixed,
		params: map[string]map[string]string{}, users: map[string]int{}, busy: map[string]int{}}
}

// LoadModule implements host.Kernel.
func (k *FakeKernel) LoadModule(m host.ModuleImage) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, "load "+m.Name)
	spec := k.modules[m.Name]
	if spec.Err != nil {
		return spec.Err
	}
	if m.Data != nil || m.Path != "" {
		data := m.Data
		var err error
		switch {
		case data != nil:
		case m.Compressed: // the kernel decompresses it
			mod, err := modfile.Open(m.Path)
			if err != nil {
				return unix.ENOEXEC
			}
			data = mod.Data
		case m.File != nil: // what the real kernel reads: the open file, from its start
			if data, err = io.ReadAll(io.NewSectionReader(m.File, 0, 1<<40)); err != nil {
				return err
			}
		default:
			if data, err = os.ReadFile(m.Path); err != nil {
				return err
			}
		}
		info, err := modfile.Info(data)
		if err != nil || info.Name != m.Name {
			return unix.ENOEXEC
		}
		spec.Version, spec.Deps = info.Version, info.Depends
		k.modules[m.Name] = spec
	}
	if k.isLoaded(m.Name) {
		return unix.EEXIST
	}
	for _, d := range spec.Deps {
		if !k.isLoaded(d) {
			return unix.ENOENT // "Unknown symbol"
		}
	}
	params := map[string]string{}
	for _, f := range strings.Fields(m.Params) {
		key, val, _ := strings.Cut(f, "=")
		params[key] = val
	}
	k.params[m.Name] = params
	k.loaded = append(k.loaded, m.Name)
	return k.sync()
}

// UnloadModule implements host.Kernel.
func (k *FakeKernel) UnloadModule(name string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, "unload "+name)
	if k.noUnload {
		return unix.ENOSYS
	}
	if !k.isLoaded(name) {
		return unix.ENOENT
	}
	if len(k.holders(name)) > 0 {
		return unix.EAGAIN
	}
	if k.users[name] > 0 {
		return unix.EBUSY
	}
	if k.busy[name] > 0 {
		k.busy[name]--
		return unix.EBUSY
	}
	k.loaded = removeString(k.loaded, name)
	delete(k.params, name)
	if err := os.RemoveAll(filepath.Join(k.sys, "module", name)); err != nil {
		return err
	}
	return k.sync()
}

// Preload marks modules as loaded before the test starts, as a running node would have them.
func (k *FakeKernel) Preload(names ...string) error {
	for _, n := range names {
		if err := k.LoadModule(host.ModuleImage{Name: n}); err != nil {
			return fmt.Errorf("preload %s: %w", n, err)
		}
	}
	k.mu.Lock()
	k.calls = nil
	k.mu.Unlock()
	return nil
}

// WithoutModuleUnload makes k a kernel built without CONFIG_MODULE_UNLOAD (as seen on a GPU
// node): the loaded modules, the fixture's too, keep initstate and lose their counts and holder
// links, and nothing can be unloaded any more.
func (k *FakeKernel) WithoutModuleUnload() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.noUnload = true
	var base strings.Builder
	for _, line := range strings.Split(strings.TrimRight(k.base, "\n"), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		f[2], f[3] = "-", "-"
		base.WriteString(strings.Join(f, " ") + "\n")
		dir := filepath.Join(k.sys, "module", f[0])
		if _, err := os.Stat(dir); err != nil {
			continue // the fixture has no sysfs entry for it
		}
		if err := os.Remove(filepath.Join(dir, "refcnt")); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if err := errors.Join(os.RemoveAll(filepath.Join(dir, "holders")), os.WriteFile(filepath.Join(dir, "initstate"), []byte("live\n"), 0o644)); err != nil {
			return err
		}
	}
	k.base = base.String()
	return k.sync()
}

// Use adds (n > 0) or drops (n < 0) references on name, like a process opening /dev/nvidia0.
func (k *FakeKernel) Use(name string, n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.users[name] += n
	k.sync()
}

// BusyFor makes the next n unloads of name fail with EBUSY.
func (k *FakeKernel) BusyFor(name string, n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.busy[name] = n
}

// Loaded returns the loaded modules in load order.
func (k *FakeKernel) Loaded() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.loaded...)
}

// Calls returns every load and unload call, in order.
func (k *FakeKernel) Calls() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.calls...)
}

func (k *FakeKernel) isLoaded(name string) bool {
	if k.fixed[name] {
		return true
	}
	for _, l := range k.loaded {
		if l == name {
			return true
		}
	}
	return false
}

// holders lists the loaded modules that depend on name.
func (k *FakeKernel) holders(name string) []string {
	var hs []string
	for _, l := range k.loaded {
		for _, d := range k.modules[l].Deps {
			if d == name {
				hs = append(hs, l)
			}
		}
	}
	sort.Strings(hs)
	return hs
}

// sync rewrites <proc>/modules and <sys>/module/* from the state.
func (k *FakeKernel) sync() error {
	var b strings.Builder
	b.WriteString(k.base)
	for i := len(k.loaded) - 1; i >= 0; i-- { // the kernel lists the newest first
		name := k.loaded[i]
		hs := k.holders(name)
		count, used := strconv.Itoa(len(hs)+k.users[name]), "-"
		if len(hs) > 0 {
			used = strings.Join(hs, ",") + ","
		}
		if k.noUnload {
			hs, count, used = nil, "-", "-"
		}
		fmt.Fprintf(&b, "%s 16384 %s %s Live 0x0000000000000000 (OE)\n", name, count, used)
		dir := filepath.Join(k.sys, "module", name)
		if err := os.MkdirAll(filepath.Join(dir, "holders"), 0o755); err != nil {
			return err
		}
		entries, _ := os.ReadDir(filepath.Join(dir, "holders"))
		for _, e := range entries {
			os.Remove(filepath.Join(dir, "holders", e.Name()))
		}
		for _, h := range hs {
			if err := os.Symlink("../../"+h, filepath.Join(dir, "holders", h)); err != nil {
				return err
			}
		}
		files := map[string]string{"initstate": "live\n", "refcnt": count + "\n"}
		if k.noUnload {
			delete(files, "refcnt")
			os.Remove(filepath.Join(dir, "refcnt"))
		}
		if v := k.modules[name].Version; v != "" {
			files["version"] = v + "\n"
		}
		for key, val := range k.params[name] {
			files["parameters/"+key] = val + "\n"
		}
		for p, c := range files {
			if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, p)), 0o755); err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644); err != nil {
				return err
			}
		}
	}
	return os.WriteFile(filepath.Join(k.proc, "modules"), []byte(b.String()), 0o644)
}

func removeString(list []string, s string) []string {
	out := list[:0]
	for _, v := range list {
		if v != s {
			out = append(out, v)
		}
	}
	return out
}
