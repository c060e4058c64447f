// Package cache is the host cache of ready kernel modules.
//
// After the agent has linked or built the NVIDIA modules for a kernel, it
// stores them here, keyed by everything that decides their contents: the
// kernel banner (/proc/version's first line), the driver version, the module
// flavour and the build parameters. A later start on the same node, including
// after a reboot into the same kernel when the cache directory is a hostPath,
// finds them and skips the link or build.
//
// Each entry is a directory named after the key's hash holding
//
//	modules/<file>  the modules, ready to load
//	manifest.json   the key, and the size and checksum of every module
//
// Entries are written to a temporary directory and renamed into place, so a
// crash never leaves a half-written entry under its final name. Lookup
// verifies every checksum before it returns an entry and removes an entry that
// fails. Open is Lookup for a caller that loads the modules and writes
// through its own seam: it checks everything but the contents and writes
// nothing (the caller removes a damaged entry and marks a hit used), and
// OpenModule verifies each module's checksum on the descriptor the module is
// then loaded from, so what is loaded is read once. Prune bounds the number
// of entries, removing the least recently used first.
//
// The checksum is an xxh64 (entries of manifest format 2 carry a sha256 and
// are verified with it). It finds damage: a torn or truncated write, a bad
// disk, a module edited or swapped by hand. It is no defence against whoever
// can write the cache, since that writer can rewrite the manifest too, and
// neither was the sha256 it replaces, which only cost more: on every start
// of the cached path each module is read through it before it is loaded
// (about 50x the time of xxh64 on a CPU without SHA extensions, 9x with them).
package cache

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/link"
)

// File names inside an entry.
const (
	// ManifestFile is the entry's manifest.
	ManifestFile = "manifest.json"
	// ModulesDir is the directory of the modules.
	ModulesDir = "modules"
)

// Prefixes of the hidden working directories Store leaves behind only when
// interrupted; Prune removes them once they are StaleAge old.
const (
	tmpPrefix = ".tmp-"
	oldPrefix = ".old-"
)

// StaleAge is how old an interrupted Store's working directory must be before
// Prune removes it.
const StaleAge = time.Hour

// Sentinel errors; test with errors.Is.
var (
	// ErrCorrupt means a cache entry or a manifest failed verification.
	// Lookup removes such an entry before returning the error.
	ErrCorrupt = errors.New("corrupt cache entry")
	// ErrInvalid means a key or a set of modules cannot be stored.
	ErrInvalid = errors.New("invalid cache input")
)

// Key identifies the modules for one kernel and driver build.
type Key struct {
	// Banner is the first line of the kernel's /proc/version, compared byte
	// for byte.
	Banner string `json:"banner"`
	// DriverVersion is the NVIDIA driver version, e.g. "595.71.05".
	DriverVersion string `json:"driver_version"`
	// Flavor is the module flavour: "open" or "proprietary".
	Flavor string `json:"flavor"`
	// BuildParams are the inputs that change the built modules (e.g. make
	// variables), in the order given: a different order is a different key.
	BuildParams []string `json:"build_params"`
}

// Name returns the entry directory name for k: the lower-case hex sha256 of
// an unambiguous encoding of every field.
func (k Key) Name() string {
	h := sha256.New()
	h.Write([]byte("driver-agent cache key v1\x00"))
	field := func(s string) {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	field(k.Banner)
	field(k.DriverVersion)
	field(k.Flavor)
	for _, p := range k.BuildParams {
		field(p)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// Equal reports whether k and o are the same key (nil and empty BuildParams
// are equal).
func (k Key) Equal(o Key) bool {
	return k.Banner == o.Banner && k.DriverVersion == o.DriverVersion && k.Flavor == o.Flavor &&
		slices.Equal(k.BuildParams, o.BuildParams)
}

func (k Key) validate() error {
	switch {
	case k.Banner == "" || strings.ContainsAny(k.Banner, "\n\x00"):
		return fmt.Errorf("key: banner %q must be one non-empty line", k.Banner)
	case k.DriverVersion == "":
		return errors.New("key: empty driver version")
	case k.Flavor == "":
		return errors.New("key: empty flavor")
	}
	return nil
}

// Entry is a verified cache entry.
type Entry struct {
	// Dir is the entry's directory.
	Dir string
	// Manifest is the entry's manifest.
	Manifest *Manifest
	// Modules are the entry's modules, with paths inside Dir.
	Modules []link.Module
}

// Store writes modules to the cache in dir under key, replacing an entry
// already stored under it, and returns the new entry. dir is created (mode
// 0700) when missing. Module files are read whole; each module's Name must be
// a kernel module name and the files' base names must be distinct, since the
// entry stores each as modules/<base name>.
func Store(dir string, key Key, modules []link.Module) (Entry, error) {
	if err := key.validate(); err != nil {
		return Entry{}, fmt.Errorf("cache store: %w: %w", ErrInvalid, err)
	}
	if len(modules) == 0 || len(modules) > maxModules {
		return Entry{}, fmt.Errorf("cache store: %w: %d modules, want 1 to %d", ErrInvalid, len(modules), maxModules)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return Entry{}, fmt.Errorf("cache store: %w", err)
	}
	name := key.Name()
	tmp, err := os.MkdirTemp(dir, tmpPrefix+name[:16]+"-")
	if err != nil {
		return Entry{}, fmt.Errorf("cache store: %w", err)
	}
	m, err := fill(tmp, key, modules)
	if err != nil {
		return Entry{}, errors.Join(fmt.Errorf("cache store: %w", err), os.RemoveAll(tmp))
	}
	final := filepath.Join(dir, name)
	if err := install(tmp, final); err != nil {
		return Entry{}, errors.Join(fmt.Errorf("cache store: %w", err), os.RemoveAll(tmp))
	}
	// The entry is what fill hashed and synced; reading it back here would only hash it a second
	// time on the way to Ready (Lookup verifies it on every later start).
	e := Entry{Dir: final, Manifest: m}
	for _, mod := range m.Modules {
		e.Modules = append(e.Modules, link.Module{Name: mod.Name, Path: filepath.Join(final, ModulesDir, mod.File), Signed: mod.Signed})
	}
	return e, nil
}

// fill writes a complete entry into the empty directory tmp and returns its manifest. Each
// module is read once: copied into modules/ and hashed on the way.
func fill(tmp string, key Key, modules []link.Module) (*Manifest, error) {
	m := &Manifest{Format: ManifestFormat, Key: key}
	m.Key.BuildParams = slices.Clone(key.BuildParams)
	if err := os.Mkdir(filepath.Join(tmp, ModulesDir), 0o755); err != nil {
		return nil, err
	}
	files := map[string]bool{}
	for _, mod := range modules {
		file := filepath.Base(mod.Path)
		if files[file] {
			return nil, fmt.Errorf("%w: module %s: file %s listed twice", ErrInvalid, mod.Name, file)
		}
		files[file] = true
		if !kernel.ValidModuleName(mod.Name) || strings.Contains(mod.Name, "-") {
			return nil, fmt.Errorf("%w: module name %q", ErrInvalid, mod.Name)
		}
		if err := checkFile(file); err != nil {
			return nil, fmt.Errorf("%w: module %s: %w", ErrInvalid, mod.Name, err)
		}
		size, sum, err := copyModule(mod.Path, filepath.Join(tmp, ModulesDir, file))
		if err != nil {
			return nil, fmt.Errorf("module %s: %w", mod.Name, err)
		}
		m.Modules = append(m.Modules, ModuleSum{Name: mod.Name, File: file, Size: size, XXH64: sum, Signed: mod.Signed})
	}
	if err := m.validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	manifest, err := m.marshal()
	if err != nil {
		return nil, err
	}
	if _, err := writeSynced(filepath.Join(tmp, ManifestFile), func(w io.Writer) error {
		_, err := w.Write(manifest)
		return err
	}); err != nil {
		return nil, err
	}
	if err := syncPath(filepath.Join(tmp, ModulesDir)); err != nil {
		return nil, err
	}
	if err := syncPath(tmp); err != nil {
		return nil, err
	}
	return m, nil
}

// install renames the complete entry tmp to final, moving an existing entry
// out of the way first.
func install(tmp, final string) error {
	dir := filepath.Dir(final)
	old := filepath.Join(dir, oldPrefix+filepath.Base(final))
	if err := os.RemoveAll(old); err != nil {
		return err
	}
	if err := os.Rename(final, old); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := os.Rename(tmp, final); err != nil {
		return err
	}
	if err := syncPath(dir); err != nil {
		return err
	}
	return os.RemoveAll(old)
}

// copyModule copies the module file src to dst (created, mode 0644, synced) and returns its
// size and xxh64, refusing anything that is not a regular file of at most
// maxModuleSize bytes.
func copyModule(src, dst string) (int64, string, error) {
	f, err := os.Open(src)
	if err != nil {
		return 0, "", err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, "", err
	}
	switch {
	case !st.Mode().IsRegular():
		return 0, "", fmt.Errorf("%w: %s is not a regular file", ErrInvalid, src)
	case st.Size() > maxModuleSize:
		return 0, "", fmt.Errorf("%w: %s: %d bytes, over %d", ErrInvalid, src, st.Size(), int64(maxModuleSize))
	}
	var n int64
	sum, err := writeSynced(dst, func(w io.Writer) error {
		var err error
		n, err = io.Copy(w, io.LimitReader(f, maxModuleSize+1))
		return err
	})
	switch {
	case err != nil:
		return 0, "", err
	case n != st.Size():
		return 0, "", fmt.Errorf("%s changed while it was copied: %d bytes, then %d", src, st.Size(), n)
	}
	return n, sum, nil
}

// writeSynced creates path (mode 0644), fills it with write, syncs it and
// returns the xxh64 of what was written.
func writeSynced(path string, write func(io.Writer) error) (sum string, err error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return "", err
	}
	defer func() { err = errors.Join(err, f.Close()) }()
	h := xxhash.New()
	if err := write(io.MultiWriter(f, h)); err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// syncPath fsyncs a file or directory.
func syncPath(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	return errors.Join(f.Sync(), f.Close())
}

// Lookup returns the entry stored under key in dir after verifying it.
//
// A missing entry is a plain miss (ok false, nil error). An entry that fails
// verification (an unreadable or inconsistent manifest, or one of another
// format, a module file missing or whose size or checksum differs, a manifest
// for another key) is removed and reported as a miss: ok is false
// and the error, wrapping ErrCorrupt, gives the reason. Other errors (an
// invalid key, an unreadable cache directory) are returned as they are.
//
// A hit sets the manifest's modification time to now, so that Prune removes
// the least recently used entries first.
func Lookup(dir string, key Key) (Entry, bool, error) {
	return lookup(dir, key, true)
}

// Open is Lookup without hashing the files and without writing: the
// manifest, the key and every module file's type (regular) and size are
// checked, their checksums not. An entry that fails is reported as Lookup
// reports it and left in place: the caller removes it (Path) and marks a hit
// used (UsedPath), through its own seam for writes, so that a dry run records
// both instead. A caller that loads the modules opens each with OpenModule,
// which verifies it.
func Open(dir string, key Key) (Entry, bool, error) {
	return lookup(dir, key, false)
}

// Path is where the entry for key is stored in dir.
func Path(dir string, key Key) string { return filepath.Join(dir, key.Name()) }

// UsedPath is the file whose modification time says when the entry in
// entryDir was last used: Prune removes the oldest first.
func UsedPath(entryDir string) string { return filepath.Join(entryDir, ManifestFile) }

// OpenModule opens the entry's module file for the module named name and
// verifies its size and checksum against the manifest, reading it through the
// returned file, which is positioned at its start again: load from it (e.g.
// finit_module on its descriptor) and the bytes loaded are the bytes
// verified, unless the file is written to meanwhile. A module that differs
// gives an error wrapping ErrCorrupt; the entry is left in place (see Remove).
func (e Entry) OpenModule(name string) (*os.File, error) {
	var sum *ModuleSum
	for i := range e.Manifest.Modules {
		if e.Manifest.Modules[i].Name == name {
			sum = &e.Manifest.Modules[i]
		}
	}
	if sum == nil {
		return nil, fmt.Errorf("cache: %s holds no module %s", e.Dir, name)
	}
	root, err := os.OpenRoot(e.Dir)
	if err != nil {
		return nil, fmt.Errorf("cache: %w", err)
	}
	// Under the modules directory the file is one name: its stat and its open walk no path.
	mods, err := root.OpenRoot(ModulesDir)
	root.Close()
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %s: %v", ErrCorrupt, e.Dir, ModulesDir, err)
	}
	defer mods.Close()
	rel := filepath.Join(ModulesDir, sum.File)
	f, err := openRegular(mods, sum.File)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %s: %v", ErrCorrupt, e.Dir, rel, err)
	}
	got, size, err := sum.of(f)
	if err == nil {
		_, err = f.Seek(0, io.SeekStart)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("cache: %s: %w", rel, err)
	}
	if err := sum.differs(got, size); err != nil {
		f.Close()
		return nil, fmt.Errorf("%w: %s: %s: %v", ErrCorrupt, e.Dir, rel, err)
	}
	return f, nil
}

// Remove removes the entry, as Lookup does with one that fails verification.
func (e Entry) Remove() error { return os.RemoveAll(e.Dir) }

// lookup is Lookup with full, Open without.
func lookup(dir string, key Key, full bool) (Entry, bool, error) {
	if err := key.validate(); err != nil {
		return Entry{}, false, fmt.Errorf("cache lookup: %w: %w", ErrInvalid, err)
	}
	final := Path(dir, key)
	if _, err := os.Lstat(final); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return Entry{}, false, nil
		}
		return Entry{}, false, fmt.Errorf("cache lookup: %w", err)
	}
	e, err := verify(final, key, full)
	if err != nil {
		if !errors.Is(err, ErrCorrupt) || !full {
			return Entry{}, false, fmt.Errorf("cache lookup: %w", err)
		}
		if rmErr := os.RemoveAll(final); rmErr != nil {
			return Entry{}, false, fmt.Errorf("cache lookup: %w; removing it failed: %w", err, rmErr)
		}
		return Entry{}, false, fmt.Errorf("cache lookup: %w (removed)", err)
	}
	if full {
		now := time.Now()
		// Best effort: a failed touch only makes the entry look older to Prune.
		_ = os.Chtimes(UsedPath(final), now, now)
	}
	return e, true, nil
}

// verify checks the entry in dir against key and returns it; without
// contents, the files' checksums are not computed. Every problem with the
// entry's contents wraps ErrCorrupt.
func verify(dir string, key Key, contents bool) (Entry, error) {
	corrupt := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrCorrupt, dir, fmt.Sprintf(format, args...))
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return Entry{}, err
	}
	if !st.IsDir() {
		return Entry{}, corrupt("not a directory")
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return Entry{}, err
	}
	defer root.Close()
	mods, err := root.OpenRoot(ModulesDir)
	if err != nil {
		return Entry{}, corrupt("%v", err)
	}
	defer mods.Close()

	mf, err := root.Open(ManifestFile)
	if err != nil {
		return Entry{}, corrupt("%v", err)
	}
	m, err := readManifest(mf)
	mf.Close()
	if err != nil {
		return Entry{}, corrupt("%s: %v", ManifestFile, err)
	}
	if !m.Key.Equal(key) {
		return Entry{}, corrupt("manifest is for another key")
	}
	e := Entry{Dir: dir, Manifest: m}
	for _, mod := range m.Modules {
		rel := filepath.Join(ModulesDir, mod.File)
		if err := checkModule(mods, mod.File, mod, contents); err != nil {
			return Entry{}, corrupt("%s: %v", rel, err)
		}
		e.Modules = append(e.Modules, link.Module{Name: mod.Name, Path: filepath.Join(dir, rel), Signed: mod.Signed})
	}
	// modules/ holds what the manifest lists and nothing else: a manifest that lost a module
	// does not pass for a smaller entry.
	md, err := mods.Open(".")
	if err != nil {
		return Entry{}, corrupt("%v", err)
	}
	names, err := md.Readdirnames(maxModules + 1)
	md.Close()
	if err != nil && !errors.Is(err, io.EOF) {
		return Entry{}, corrupt("%s: %v", ModulesDir, err)
	}
	for _, n := range names {
		if !slices.ContainsFunc(m.Modules, func(mod ModuleSum) bool { return mod.File == n }) {
			return Entry{}, corrupt("%s holds %s, which the manifest does not list", ModulesDir, n)
		}
	}
	return e, nil
}

// openRegular opens rel under root when it is a regular file (not a symbolic link).
func openRegular(root *os.Root, rel string) (*os.File, error) {
	st, err := root.Lstat(rel)
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, errors.New("not a regular file")
	}
	return root.Open(rel)
}

// checkModule checks the module file rel under root against mod: a regular file of mod's size
// and, with contents, mod's checksum. Without contents it only stats the file.
func checkModule(root *os.Root, rel string, mod ModuleSum, contents bool) error {
	if !contents {
		st, err := root.Lstat(rel)
		switch {
		case err != nil:
			return err
		case !st.Mode().IsRegular():
			return errors.New("not a regular file")
		case st.Size() != mod.Size:
			return fmt.Errorf("%d bytes, manifest says %d", st.Size(), mod.Size)
		}
		return nil
	}
	f, err := openRegular(root, rel)
	if err != nil {
		return err
	}
	defer f.Close()
	sum, size, err := mod.of(f)
	if err != nil {
		return err
	}
	return mod.differs(sum, size)
}

// of reads r to its end and returns its checksum of m's kind in hex, and the length of what it
// read.
func (m ModuleSum) of(r io.Reader) (string, int64, error) {
	var h hash.Hash = xxhash.New()
	if m.SHA256 != "" {
		h = sha256.New()
	}
	n, err := io.Copy(h, r)
	return hex.EncodeToString(h.Sum(nil)), n, err
}

// differs says how module contents with checksum sum and size bytes differ from m, or nil when
// they match: Lookup and OpenModule compare through it.
func (m ModuleSum) differs(sum string, size int64) error {
	kind, want := "xxh64", m.XXH64
	if m.SHA256 != "" {
		kind, want = "sha256", m.SHA256
	}
	if sum == want && size == m.Size {
		return nil
	}
	return fmt.Errorf("%s %s (%d bytes), manifest says %s (%d bytes)", kind, sum, size, want, m.Size)
}

// Prune keeps at most maxEntries entries in dir, removing those whose manifest was
// modified longest ago (stored or last hit) first; entries without a readable
// manifest go first. It also removes the working directories of interrupted
// Store calls that are StaleAge old. It returns the directories removed.
// maxEntries 0 empties the cache.
func Prune(dir string, maxEntries int) ([]string, error) {
	if maxEntries < 0 {
		return nil, fmt.Errorf("cache prune: %w: max entries %d", ErrInvalid, maxEntries)
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("cache prune: %w", err)
	}
	type entry struct {
		path  string
		mtime time.Time
	}
	var entries []entry
	var removed []string
	var errs []error
	remove := func(path string) {
		if err := os.RemoveAll(path); err != nil {
			errs = append(errs, err)
			return
		}
		removed = append(removed, path)
	}
	for _, de := range des {
		path := filepath.Join(dir, de.Name())
		switch {
		case strings.HasPrefix(de.Name(), tmpPrefix) || strings.HasPrefix(de.Name(), oldPrefix):
			if info, err := de.Info(); err == nil && time.Since(info.ModTime()) >= StaleAge {
				remove(path)
			}
		case de.IsDir() && isKeyName(de.Name()):
			var mtime time.Time
			if st, err := os.Stat(UsedPath(path)); err == nil {
				mtime = st.ModTime()
			}
			entries = append(entries, entry{path, mtime})
		}
	}
	slices.SortFunc(entries, func(a, b entry) int {
		if c := a.mtime.Compare(b.mtime); c != 0 {
			return c
		}
		return strings.Compare(a.path, b.path)
	})
	for i := 0; i < len(entries)-maxEntries; i++ {
		remove(entries[i].path)
	}
	if len(errs) > 0 {
		return removed, fmt.Errorf("cache prune: %w", errors.Join(errs...))
	}
	return removed, nil
}

// isKeyName reports whether name looks like Key.Name's output.
func isKeyName(name string) bool {
	return checkHex("key name", name, sha256.Size) == nil
}
