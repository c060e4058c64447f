// Package kernel reads the running kernel's identity and module state from procfs and sysfs:
// the release, the /proc/version banner, /proc/modules, /sys/module/<name>/{version,refcnt,holders},
// the mount points in /proc/self/mountinfo, and the order in which loaded modules can be removed.
package kernel

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// maxPseudoFile bounds reads of procfs and sysfs files.
const maxPseudoFile = 4 << 20

// ReadSmall reads a pseudo-file of at most 4 MiB.
func ReadSmall(path string) ([]byte, error) { return ReadLimit(path, maxPseudoFile) }

// ReadAttr reads a sysfs text attribute, which the kernel hands out whole in one read of at most
// a page, in three system calls (open, read, close; ReadSmall takes five): detection reads
// several of each of a node's hundreds of PCI devices. More than a page is refused: the file is
// no sysfs attribute.
func ReadAttr(path string) ([]byte, error) {
	fd, err := retryEINTR(func() (int, error) { return unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0) })
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	var buf [attrMax + 1]byte
	n, err := retryEINTR(func() (int, error) { return unix.Read(fd, buf[:]) })
	switch {
	case err != nil:
		return nil, &fs.PathError{Op: "read", Path: path, Err: err}
	case n > attrMax:
		return nil, fmt.Errorf("read %s: longer than the %d bytes of a sysfs attribute", path, attrMax)
	}
	return bytes.Clone(buf[:n]), nil // the attribute's bytes, not a page, stay on the heap
}

// attrMax is the most a sysfs attribute holds (PAGE_SIZE on the architectures the agent runs on).
const attrMax = 4096

func retryEINTR(f func() (int, error)) (int, error) {
	for {
		n, err := f()
		if !errors.Is(err, unix.EINTR) {
			return n, err
		}
	}
}

// ReadLimit reads path whole, refusing a file larger than limit bytes without reading more
// than limit+1 of it.
func ReadLimit(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("read %s: larger than %d bytes", path, limit)
	}
	return data, nil
}

// Release returns the kernel release ("6.6.95-flatcar") from <proc>/sys/kernel/osrelease.
func Release(proc string) (string, error) {
	data, err := ReadSmall(filepath.Join(proc, "sys/kernel/osrelease"))
	if err != nil {
		return "", fmt.Errorf("kernel release: %w", err)
	}
	rel := strings.TrimSpace(string(data))
	if rel == "" {
		return "", errors.New("kernel release: sys/kernel/osrelease is empty")
	}
	return rel, nil
}

// Banner returns the first line of <proc>/version without its newline: the string NVIDIA's
// precompiled packages are matched against byte for byte.
func Banner(proc string) (string, error) {
	data, err := ReadSmall(filepath.Join(proc, "version"))
	if err != nil {
		return "", fmt.Errorf("kernel banner: %w", err)
	}
	line, _, _ := bytes.Cut(data, []byte("\n"))
	if len(line) == 0 {
		return "", errors.New("kernel banner: version is empty")
	}
	return string(line), nil
}

// Module is one line of /proc/modules.
type Module struct {
	Name    string
	Size    uint64
	RefCnt  int      // -1 when the kernel prints "-" (no unload support)
	UsedBy  []string // modules that hold a reference, as listed by the kernel
	State   string   // Live, Loading, Unloading
	Address string
}

// ParseModules parses /proc/modules. Malformed lines are errors that name the line, since a
// wrong reading of the loaded set would make the agent load or unload the wrong thing.
func ParseModules(r io.Reader) ([]Module, error) {
	var mods []Module
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 5 {
			return nil, fmt.Errorf("proc modules line %d: want at least 5 fields, have %d: %q", n, len(f), line)
		}
		m := Module{Name: f[0], State: f[4]}
		if !ValidModuleName(m.Name) {
			return nil, fmt.Errorf("proc modules line %d: bad module name %q", n, m.Name)
		}
		size, err := strconv.ParseUint(f[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("proc modules line %d: bad size %q", n, f[1])
		}
		m.Size = size
		if f[2] == "-" {
			m.RefCnt = -1
		} else if m.RefCnt, err = strconv.Atoi(f[2]); err != nil || m.RefCnt < 0 {
			return nil, fmt.Errorf("proc modules line %d: bad reference count %q", n, f[2])
		}
		if f[3] != "-" {
			for _, u := range strings.Split(strings.TrimSuffix(f[3], ","), ",") {
				if u == "[permanent]" || u == "" {
					continue
				}
				if !ValidModuleName(u) {
					return nil, fmt.Errorf("proc modules line %d: bad holder name %q", n, u)
				}
				m.UsedBy = append(m.UsedBy, u)
			}
		}
		if len(f) > 5 {
			m.Address = f[5]
		}
		mods = append(mods, m)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("proc modules: %w", err)
	}
	return mods, nil
}

// ValidModuleName reports whether s is a plausible kernel module name.
func ValidModuleName(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if (c < 'a' || c > 'z') && (c < 'A' || c > 'Z') && (c < '0' || c > '9') && c != '_' && c != '-' {
			return false
		}
	}
	return true
}

// Normalize returns the kernel's name for a module: dashes become underscores.
func Normalize(name string) string { return strings.ReplaceAll(name, "-", "_") }

// Loaded reads <proc>/modules.
func Loaded(proc string) ([]Module, error) {
	data, err := ReadSmall(filepath.Join(proc, "modules"))
	if err != nil {
		return nil, fmt.Errorf("loaded modules: %w", err)
	}
	return ParseModules(bytes.NewReader(data))
}

// SysModule is what /sys/module/<name> says about a loaded module.
type SysModule struct {
	Name    string
	Version string   // MODULE_VERSION, empty when the module has none
	RefCnt  int      // -1 when unreadable
	Holders []string // sorted
	Present bool     // /sys/module/<name> exists
	Loaded  bool     // initstate or refcnt exists, i.e. a loadable module (not built in)
	// Unloadable: refcnt exists. A kernel built without CONFIG_MODULE_UNLOAD has no refcnt (and
	// no holder links): its modules stay loaded until the node reboots.
	Unloadable bool
}

// ReadSysModule reads <sys>/module/<name>.
func ReadSysModule(sys, name string) (SysModule, error) {
	name = Normalize(name)
	dir := filepath.Join(sys, "module", name)
	m := SysModule{Name: name, RefCnt: -1}
	if _, err := os.Stat(dir); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return m, nil
		}
		return m, fmt.Errorf("module %s: %w", name, err)
	}
	m.Present = true
	if data, err := ReadAttr(filepath.Join(dir, "version")); err == nil {
		m.Version = strings.TrimSpace(string(data))
	} else if !errors.Is(err, fs.ErrNotExist) {
		return m, fmt.Errorf("module %s: %w", name, err)
	}
	if data, err := ReadAttr(filepath.Join(dir, "refcnt")); err == nil {
		m.Loaded, m.Unloadable = true, true
		if m.RefCnt, err = strconv.Atoi(strings.TrimSpace(string(data))); err != nil {
			return m, fmt.Errorf("module %s: bad refcnt %q", name, strings.TrimSpace(string(data)))
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return m, fmt.Errorf("module %s: %w", name, err)
	} else if _, err := os.Stat(filepath.Join(dir, "initstate")); err == nil {
		m.Loaded = true // a kernel without module unloading
	} else if !errors.Is(err, fs.ErrNotExist) {
		return m, fmt.Errorf("module %s: %w", name, err)
	}
	entries, err := os.ReadDir(filepath.Join(dir, "holders"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return m, fmt.Errorf("module %s holders: %w", name, err)
	}
	for _, e := range entries {
		m.Holders = append(m.Holders, e.Name())
	}
	sort.Strings(m.Holders)
	return m, nil
}

// UnloadOrder returns the modules of want that are loaded, together with every loaded module
// that holds one of them (directly or through others), ordered so that each module comes
// before every module it holds a reference on: the order in which delete_module can succeed.
// The holder graph is read from <sys>/module/*/holders, never from a fixed list.
func UnloadOrder(sys string, want []string) ([]string, error) {
	seen := map[string]bool{}
	holders := map[string][]string{}
	var visit func(name string) error
	visit = func(name string) error {
		if seen[name] {
			return nil
		}
		seen[name] = true
		m, err := ReadSysModule(sys, name)
		if err != nil {
			return err
		}
		if !m.Loaded {
			delete(seen, name)
			return nil
		}
		holders[name] = m.Holders
		for _, h := range m.Holders {
			if err := visit(h); err != nil {
				return err
			}
		}
		return nil
	}
	for _, w := range want {
		if err := visit(Normalize(w)); err != nil {
			return nil, err
		}
	}
	names := make([]string, 0, len(holders))
	for n := range holders {
		names = append(names, n)
	}
	sort.Strings(names)
	// Every holder before the module it holds.
	return DepthFirst(names, func(n string) []string { return holders[n] }, "holder")
}

// DepthFirst orders nodes so that each comes after every one of nodes that after(node) names
// (the others are ignored), keeping the order of nodes where it is free. A cycle is an error that
// names one module on it, as a module <what> cycle.
func DepthFirst(nodes []string, after func(string) []string, what string) ([]string, error) {
	in := make(map[string]bool, len(nodes))
	for _, n := range nodes {
		in[n] = true
	}
	order := make([]string, 0, len(nodes))
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(name string) error
	visit = func(name string) error {
		switch state[name] {
		case 1:
			return fmt.Errorf("module %s cycle through %s", what, name)
		case 2:
			return nil
		}
		state[name] = 1
		for _, a := range after(name) {
			if in[a] {
				if err := visit(a); err != nil {
					return err
				}
			}
		}
		state[name] = 2
		order = append(order, name)
		return nil
	}
	for _, n := range nodes {
		if err := visit(n); err != nil {
			return nil, err
		}
	}
	return order, nil
}
