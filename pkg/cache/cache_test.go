package cache

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/link"
)

const (
	flatcarBanner = "Linux version 6.12.81-flatcar (build@pony-truck.infra.kinvolk.io) (x86_64-cros-linux-gnu-gcc (Gentoo Hardened 14.3.1 p1) 14.3.1 20250801, GNU ld (Gentoo 2.44 p1) 2.44.0) #1 SMP PREEMPT_DYNAMIC Fri Oct 10 18:05:42 -00 2026"
	debianBanner  = "Linux version 6.1.0-41-amd64 (debian-kernel@lists.debian.org) (gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40) #1 SMP PREEMPT_DYNAMIC Debian 6.1.158-1 (2025-11-09)"
)

func testKey() Key {
	return Key{Banner: flatcarBanner, DriverVersion: "595.71.05", Flavor: "open", BuildParams: []string{"IGNORE_CC_MISMATCH=1"}}
}

// moduleFiles writes stand-in modules and returns them as link.Modules.
func moduleFiles(t *testing.T) []link.Module {
	t.Helper()
	dir := t.TempDir()
	var mods []link.Module
	for _, m := range []struct {
		file, name string
		data       string
		signed     bool
	}{
		{"nvidia.ko", "nvidia", "\x7fELF nvidia module" + strings.Repeat("x", 5000), true},
		{"nvidia-modeset.ko", "nvidia_modeset", "\x7fELF modeset", false},
		{"nvidia-uvm.ko", "nvidia_uvm", "\x7fELF uvm", false},
		{"empty.ko", "empty", "", false},
	} {
		path := filepath.Join(dir, m.file)
		if err := os.WriteFile(path, []byte(m.data), 0o644); err != nil {
			t.Fatal(err)
		}
		mods = append(mods, link.Module{Name: m.name, Path: path, Signed: m.signed})
	}
	return mods
}

func checkEntry(t *testing.T, e Entry, src []link.Module) {
	t.Helper()
	if len(e.Modules) != len(src) {
		t.Fatalf("entry has %d modules, want %d", len(e.Modules), len(src))
	}
	for i, m := range e.Modules {
		want, _ := os.ReadFile(src[i].Path)
		got, err := os.ReadFile(m.Path)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("module %d (%s): contents differ from the stored file: %v", i, m.Path, err)
		}
		if m.Name != src[i].Name || m.Signed != src[i].Signed || filepath.Base(m.Path) != filepath.Base(src[i].Path) ||
			filepath.Dir(m.Path) != filepath.Join(e.Dir, ModulesDir) {
			t.Errorf("module %d = %+v, stored %+v", i, m, src[i])
		}
	}
}

func TestStoreLookup(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "cache")
	key := testKey()
	mods := moduleFiles(t)

	// First start: nothing cached.
	if _, ok, err := Lookup(dir, key); ok || err != nil {
		t.Fatalf("Lookup on an empty cache = %v, %v", ok, err)
	}
	stored, err := Store(dir, key, mods)
	if err != nil {
		t.Fatal(err)
	}
	if stored.Dir != filepath.Join(dir, key.Name()) {
		t.Errorf("entry dir %s, want %s", stored.Dir, filepath.Join(dir, key.Name()))
	}
	checkEntry(t, stored, mods)
	if st, err := os.Stat(dir); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("cache dir mode %v, %v", st.Mode(), err)
	}

	// Second start with the same key: hit, and the sources may be gone.
	for _, m := range mods {
		hosttest.Must(t, os.Remove(m.Path))
	}
	e, ok, err := Lookup(dir, key)
	if !ok || err != nil {
		t.Fatalf("Lookup after Store = %v, %v", ok, err)
	}
	if e.Dir != stored.Dir || !slices.Equal(e.Modules, stored.Modules) || !e.Manifest.Key.Equal(key) || !reflect.DeepEqual(e.Manifest, stored.Manifest) {
		t.Errorf("Lookup = %+v, Store gave %+v", e, stored)
	}

	// The entry holds the manifest and one copy of each module, nothing else.
	var files []string
	filepath.WalkDir(e.Dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			rel, _ := filepath.Rel(e.Dir, p)
			files = append(files, rel)
		}
		return err
	})
	want := []string{ManifestFile}
	for _, m := range mods {
		want = append(want, filepath.Join(ModulesDir, filepath.Base(m.Path)))
	}
	slices.Sort(files)
	slices.Sort(want)
	if !slices.Equal(files, want) {
		t.Errorf("entry files %v, want %v", files, want)
	}

	// No working directories are left behind.
	des, _ := os.ReadDir(dir)
	if len(des) != 1 || des[0].Name() != key.Name() {
		t.Errorf("cache dir holds %v", des)
	}
}

func TestLookupMissesOnAnyKeyChange(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key := testKey()
	if _, err := Store(dir, key, moduleFiles(t)); err != nil {
		t.Fatal(err)
	}
	for name, change := range map[string]func(*Key){
		"banner":              func(k *Key) { k.Banner = debianBanner },
		"banner date":         func(k *Key) { k.Banner = strings.Replace(k.Banner, "Oct 10", "Oct 11", 1) },
		"driver version":      func(k *Key) { k.DriverVersion = "580.95.05" },
		"flavor":              func(k *Key) { k.Flavor = "proprietary" },
		"build params":        func(k *Key) { k.BuildParams = nil },
		"build params order":  func(k *Key) { k.BuildParams = []string{"A=1", "B=2"} },
		"field boundary move": func(k *Key) { k.DriverVersion, k.Flavor = "595.71.05o", "pen" },
	} {
		k := testKey()
		change(&k)
		if k.Name() == key.Name() {
			t.Errorf("%s: same entry name", name)
		}
		if _, ok, err := Lookup(dir, k); ok || err != nil {
			t.Errorf("%s: Lookup = %v, %v; want a plain miss", name, ok, err)
		}
	}
	if _, ok, err := Lookup(dir, key); !ok || err != nil {
		t.Fatalf("original key no longer hits: %v, %v", ok, err)
	}
	a := Key{Banner: "b", DriverVersion: "1", Flavor: "open", BuildParams: []string{"A=1", "B=2"}}
	b := a
	b.BuildParams = []string{"B=2", "A=1"}
	if a.Name() == b.Name() || a.Equal(b) {
		t.Error("build parameter order is ignored")
	}
	c := a
	c.BuildParams = []string{"A=1B=2"}
	if a.Name() == c.Name() {
		t.Error("build parameters are not delimited")
	}
}

// TestDamagedEntry damages a stored entry in different ways: each time
// Lookup removes it and misses with a reason, and a new Store works.
func TestDamagedEntry(t *testing.T) {
	t.Parallel()
	flip := func(rel string, off int) func(t *testing.T, entry string) {
		return func(t *testing.T, entry string) {
			path := filepath.Join(entry, rel)
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if off < 0 {
				off += len(b)
			}
			b[off] ^= 0x01
			if err := os.WriteFile(path, b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	editManifest := func(edit func(m *Manifest)) func(t *testing.T, entry string) {
		return func(t *testing.T, entry string) {
			path := filepath.Join(entry, ManifestFile)
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			m, err := ReadManifest(f)
			f.Close()
			if err != nil {
				t.Fatal(err)
			}
			edit(m)
			b, err := m.marshal()
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	tests := []struct {
		name   string
		damage func(t *testing.T, entry string)
		reason string
	}{
		{"module byte flipped", flip("modules/nvidia.ko", 100), "modules/nvidia.ko: xxh64"},
		{"module last byte flipped", flip("modules/nvidia-uvm.ko", -1), "modules/nvidia-uvm.ko: xxh64"},
		{"manifest of an older format", editManifest(func(m *Manifest) { m.Format = 1 }), "format 1, want 3 or 2"},
		{"manifest byte flipped", flip(ManifestFile, 2), "manifest"},
		{"module missing", func(t *testing.T, e string) {
			hosttest.Must(t, os.Remove(filepath.Join(e, "modules", "nvidia-modeset.ko")))
		}, "nvidia-modeset.ko"},
		{"module truncated", func(t *testing.T, e string) {
			hosttest.Must(t, os.Truncate(filepath.Join(e, "modules", "nvidia.ko"), 10))
		}, "nvidia.ko"},
		{"module appended to", func(t *testing.T, e string) {
			f, _ := os.OpenFile(filepath.Join(e, "modules", "empty.ko"), os.O_WRONLY|os.O_APPEND, 0)
			f.Write([]byte("x"))
			f.Close()
		}, "empty.ko"},
		{"module replaced by a symlink", func(t *testing.T, e string) {
			p := filepath.Join(e, "modules", "nvidia-uvm.ko")
			hosttest.Must(t, os.Rename(p, p+".real"))
			hosttest.Must(t, os.Symlink("nvidia-uvm.ko.real", p))
		}, "not a regular file"},
		{"manifest missing", func(t *testing.T, e string) { hosttest.Must(t, os.Remove(filepath.Join(e, ManifestFile))) }, ManifestFile},
		{"manifest empty", func(t *testing.T, e string) {
			hosttest.Must(t, os.WriteFile(filepath.Join(e, ManifestFile), nil, 0o644))
		}, "manifest"},
		{"manifest for another key", editManifest(func(m *Manifest) { m.Key.Flavor = "proprietary" }), "another key"},
		{"manifest sum edited", editManifest(func(m *Manifest) { m.Modules[0].XXH64 = strings.Repeat("0", 16) }), "manifest says " + strings.Repeat("0", 16)},
		{"manifest lists fewer modules", editManifest(func(m *Manifest) { m.Modules = m.Modules[:2] }), "which the manifest does not list"},
		{"manifest size edited", editManifest(func(m *Manifest) { m.Modules[1].Size++ }), "manifest says"},
		{"entry is a file", func(t *testing.T, e string) {
			hosttest.Must(t, os.RemoveAll(e))
			hosttest.Must(t, os.WriteFile(e, []byte("x"), 0o644))
		}, "not a directory"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			key := testKey()
			mods := moduleFiles(t)
			e, err := Store(dir, key, mods)
			if err != nil {
				t.Fatal(err)
			}
			tc.damage(t, e.Dir)
			// Open (which writes nothing) reports the damage it sees without hashing, or hits and
			// OpenModule finds it; either way the entry is left for the caller to remove.
			if oe, ok, err := Open(dir, key); ok {
				found := false
				for _, m := range oe.Manifest.Modules {
					f, err := oe.OpenModule(m.Name)
					if err == nil {
						f.Close()
						continue
					}
					if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.reason) {
						t.Fatalf("OpenModule(%s) = %v; want an error wrapping ErrCorrupt mentioning %q", m.Name, err, tc.reason)
					}
					found = true
				}
				if !found {
					t.Fatal("Open hit and OpenModule verified every module: the damage went unseen")
				}
			} else if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.reason) || strings.Contains(err.Error(), "removed") {
				t.Fatalf("Open = %v, %v; want a miss wrapping ErrCorrupt mentioning %q, not removed", ok, err, tc.reason)
			}
			if _, err := os.Lstat(e.Dir); err != nil {
				t.Fatalf("Open removed the damaged entry: %v", err)
			}
			var ok bool
			_, ok, err = Lookup(dir, key)
			if ok || !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.reason) || !strings.Contains(err.Error(), "removed") {
				t.Fatalf("Lookup = %v, %v; want a miss wrapping ErrCorrupt mentioning %q", ok, err, tc.reason)
			}
			t.Log(err)
			if _, err := os.Lstat(e.Dir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("damaged entry not removed: %v", err)
			}
			if _, ok, err := Lookup(dir, key); ok || err != nil {
				t.Errorf("second Lookup = %v, %v; want a plain miss", ok, err)
			}
			// Rebuilt: stored again, then hit.
			if _, err := Store(dir, key, mods); err != nil {
				t.Fatal(err)
			}
			if e, ok, err := Lookup(dir, key); !ok || err != nil {
				t.Fatalf("Lookup after the rebuild = %v, %v", ok, err)
			} else {
				checkEntry(t, e, mods)
			}
		})
	}
}

// TestOpenWritesNothing: a hit through Open leaves the manifest's modification time (Prune's
// recency) as it was; Lookup's hit sets it to now.
func TestOpenWritesNothing(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	e, err := Store(dir, testKey(), moduleFiles(t))
	if err != nil {
		t.Fatal(err)
	}
	manifest := filepath.Join(e.Dir, ManifestFile)
	old := time.Now().Add(-48 * time.Hour).Truncate(time.Second)
	if err := os.Chtimes(manifest, old, old); err != nil {
		t.Fatal(err)
	}
	mtime := func() time.Time {
		st, err := os.Stat(manifest)
		if err != nil {
			t.Fatal(err)
		}
		return st.ModTime()
	}
	if got, ok, err := Open(dir, testKey()); !ok || err != nil || got.Dir != e.Dir {
		t.Fatalf("Open = %+v, %v, %v; want a hit", got, ok, err)
	}
	if !mtime().Equal(old) {
		t.Errorf("Open changed the manifest's mtime to %v", mtime())
	}
	if _, ok, err := Lookup(dir, testKey()); !ok || err != nil {
		t.Fatalf("Lookup = %v, %v; want a hit", ok, err)
	}
	if !mtime().After(old) {
		t.Errorf("Lookup left the manifest's mtime at %v", mtime())
	}
}

func TestStoreReplaces(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key := testKey()
	mods := moduleFiles(t)
	if _, err := Store(dir, key, mods); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mods[2].Path, []byte("\x7fELF uvm, rebuilt"), 0o644); err != nil {
		t.Fatal(err)
	}
	e, err := Store(dir, key, mods[1:3])
	if err != nil {
		t.Fatal(err)
	}
	checkEntry(t, e, mods[1:3])
	if _, err := os.Stat(filepath.Join(e.Dir, ModulesDir, "nvidia.ko")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("old entry's files survive the replacement: %v", err)
	}
	des, _ := os.ReadDir(dir)
	if len(des) != 1 {
		t.Errorf("cache dir holds %d entries after a replacement", len(des))
	}
}

func TestStoreRejects(t *testing.T) {
	t.Parallel()
	mods := moduleFiles(t)
	good := testKey()
	dup := slices.Clone(mods)
	dup[1].Name = dup[0].Name
	sameFile := slices.Clone(mods)
	sameFile[1].Path = filepath.Join(t.TempDir(), filepath.Base(mods[0].Path))
	hosttest.Must(t, os.WriteFile(sameFile[1].Path, []byte("x"), 0o644))
	hidden := filepath.Join(t.TempDir(), ".hidden.ko")
	hosttest.Must(t, os.WriteFile(hidden, []byte("x"), 0o644))
	tests := []struct {
		name string
		key  Key
		mods []link.Module
		want string
	}{
		{"no banner", Key{DriverVersion: "1", Flavor: "open"}, mods, "banner"},
		{"two-line banner", Key{Banner: "a\nb", DriverVersion: "1", Flavor: "open"}, mods, "banner"},
		{"no driver version", Key{Banner: "b", Flavor: "open"}, mods, "driver version"},
		{"no flavor", Key{Banner: "b", DriverVersion: "1"}, mods, "flavor"},
		{"no modules", good, nil, "0 modules"},
		{"duplicate module name", good, dup, "listed twice"},
		{"duplicate file name", good, sameFile, "listed twice"},
		{"bad module name", good, []link.Module{{Name: "nvidia-uvm", Path: mods[0].Path}}, "module name"},
		{"hidden file", good, []link.Module{{Name: "x", Path: hidden}}, "file name"},
		{"directory as module", good, []link.Module{{Name: "x", Path: t.TempDir()}}, "not a regular file"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			_, err := Store(dir, tc.key, tc.mods)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Store = %v, want ErrInvalid mentioning %q", err, tc.want)
			}
			if des, _ := os.ReadDir(dir); len(des) != 0 {
				t.Errorf("a failed Store left %v", des)
			}
		})
	}
	if _, err := Store(t.TempDir(), good, []link.Module{{Name: "x", Path: "/nonexistent/x.ko"}}); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing module file: %v", err)
	}
	if _, _, err := Lookup(t.TempDir(), Key{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("Lookup with an empty key: %v", err)
	}
}

func TestPrune(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	mods := moduleFiles(t)
	base := time.Now().Add(-24 * time.Hour)
	var keys []Key
	var entries []string
	// Entries stored at base+0h, +1h, ... +4h, in a shuffled order of names.
	for i, age := range []int{3, 0, 4, 1, 2} {
		k := testKey()
		k.BuildParams = []string{"N=" + string(rune('a'+i))}
		e, err := Store(dir, k, mods)
		if err != nil {
			t.Fatal(err)
		}
		ts := base.Add(time.Duration(age) * time.Hour)
		if err := os.Chtimes(filepath.Join(e.Dir, ManifestFile), ts, ts); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k)
		entries = append(entries, e.Dir)
	}
	// A hit makes the oldest entry (age 0, index 1) the most recently used.
	if _, ok, err := Lookup(dir, keys[1]); !ok || err != nil {
		t.Fatal(ok, err)
	}
	// An entry without a manifest counts as oldest; stale working dirs go;
	// a fresh one (a Store in progress) and unrelated files stay.
	broken := filepath.Join(dir, strings.Repeat("ab", 32))
	hosttest.Must(t, os.Mkdir(broken, 0o700))
	stale := filepath.Join(dir, tmpPrefix+"stale")
	hosttest.Must(t, os.Mkdir(stale, 0o700))
	old := base.Add(-StaleAge)
	hosttest.Must(t, os.Chtimes(stale, old, old))
	fresh := filepath.Join(dir, tmpPrefix+"fresh")
	hosttest.Must(t, os.Mkdir(fresh, 0o700))
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "README"), []byte("x"), 0o644))

	removed, err := Prune(dir, 3)
	if err != nil {
		t.Fatal(err)
	}
	// 6 entries, keep 3: broken, then age 1 (index 3), then age 2 (index 4).
	want := []string{stale, broken, entries[3], entries[4]}
	if !slices.Equal(removed, want) {
		t.Errorf("removed %v\nwant %v", removed, want)
	}
	for i, k := range keys {
		_, ok, err := Lookup(dir, k)
		if wantHit := i != 3 && i != 4; ok != wantHit || err != nil {
			t.Errorf("entry %d: hit = %v, %v; want %v", i, ok, err, wantHit)
		}
	}
	for _, p := range []string{fresh, filepath.Join(dir, "README")} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s removed: %v", p, err)
		}
	}

	if removed, err := Prune(dir, 3); err != nil || len(removed) != 0 {
		t.Errorf("second Prune removed %v, %v", removed, err)
	}
	if removed, err := Prune(dir, 0); err != nil || len(removed) != 3 {
		t.Errorf("Prune(0) removed %v, %v", removed, err)
	}
	if _, err := Prune(dir, -1); !errors.Is(err, ErrInvalid) {
		t.Errorf("Prune(-1) = %v", err)
	}
	if removed, err := Prune(filepath.Join(dir, "missing"), 1); err != nil || removed != nil {
		t.Errorf("Prune of a missing dir = %v, %v", removed, err)
	}
}

// TestOpenVerifiesWhatIsLoaded: Open checks all but the contents; OpenModule hashes the module
// through the file it returns (at its start, holding the stored bytes) and refuses a damaged one.
func TestOpenVerifiesWhatIsLoaded(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key := testKey()
	mods := moduleFiles(t)
	stored, err := Store(dir, key, mods)
	if err != nil {
		t.Fatal(err)
	}
	e, ok, err := Open(dir, key)
	if !ok || err != nil || e.Dir != stored.Dir || !slices.Equal(e.Modules, stored.Modules) {
		t.Fatalf("Open = %+v, %v, %v; want the stored entry", e, ok, err)
	}
	for _, m := range mods {
		f, err := e.OpenModule(m.Name)
		if err != nil {
			t.Fatalf("OpenModule(%s) = %v", m.Name, err)
		}
		got, _ := io.ReadAll(f)
		f.Close()
		if want, _ := os.ReadFile(filepath.Join(e.Dir, ModulesDir, filepath.Base(m.Path))); !bytes.Equal(got, want) {
			t.Errorf("%s: read %d bytes through the opened file, want the module's %d", m.Name, len(got), len(want))
		}
	}
	if _, err := e.OpenModule("nvidia_drm"); err == nil || !strings.Contains(err.Error(), "no module nvidia_drm") {
		t.Errorf("OpenModule of a module not in the entry = %v", err)
	}

	// A flipped byte keeps the size: Open cannot see it, OpenModule refuses the module.
	path := filepath.Join(e.Dir, ModulesDir, "nvidia.ko")
	data, _ := os.ReadFile(path)
	data[100] ^= 0x01
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	e, ok, err = Open(dir, key)
	if !ok || err != nil {
		t.Fatalf("Open after a flipped byte = %v, %v; want a hit (contents are OpenModule's)", ok, err)
	}
	if f, err := e.OpenModule("nvidia"); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "modules/nvidia.ko: xxh64") {
		if f != nil {
			f.Close()
		}
		t.Fatalf("OpenModule of the damaged module = %v; want ErrCorrupt naming modules/nvidia.ko", err)
	}
	if f, err := e.OpenModule("nvidia_uvm"); err != nil {
		t.Errorf("OpenModule of an intact module = %v", err)
	} else {
		f.Close()
	}
	if err := e.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := Open(dir, key); ok || err != nil {
		t.Errorf("Open after Remove = %v, %v; want a plain miss", ok, err)
	}
}

// TestSHA256Entry: an entry an earlier agent stored (manifest format 2, a sha256 for each module)
// is still a hit for Lookup and Open, and its modules are verified with their sha256.
func TestSHA256Entry(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key := testKey()
	stored, err := Store(dir, key, moduleFiles(t))
	if err != nil {
		t.Fatal(err)
	}
	m := *stored.Manifest
	m.Format, m.Modules = sha256Format, slices.Clone(m.Modules)
	for i := range m.Modules {
		data, err := os.ReadFile(filepath.Join(stored.Dir, ModulesDir, m.Modules[i].File))
		hosttest.Must(t, err)
		sum := sha256.Sum256(data)
		m.Modules[i].XXH64, m.Modules[i].SHA256 = "", hex.EncodeToString(sum[:])
	}
	b, err := m.marshal()
	hosttest.Must(t, err)
	if !bytes.Contains(b, []byte(`"sha256": "`)) || bytes.Contains(b, []byte("xxh64")) {
		t.Fatalf("not a format 2 manifest:\n%s", b)
	}
	hosttest.Must(t, os.WriteFile(filepath.Join(stored.Dir, ManifestFile), b, 0o644))

	if e, ok, err := Lookup(dir, key); !ok || err != nil || e.Manifest.Format != sha256Format {
		t.Fatalf("Lookup = %+v, %v, %v; want the format 2 entry", e.Manifest, ok, err)
	}
	e, ok, err := Open(dir, key)
	if !ok || err != nil {
		t.Fatalf("Open = %v, %v; want a hit", ok, err)
	}
	for _, mod := range m.Modules {
		f, err := e.OpenModule(mod.Name)
		if err != nil {
			t.Fatalf("OpenModule(%s) = %v", mod.Name, err)
		}
		f.Close()
	}
	path := filepath.Join(e.Dir, ModulesDir, "nvidia.ko")
	data, _ := os.ReadFile(path)
	data[100] ^= 0x01
	hosttest.Must(t, os.WriteFile(path, data, 0o644))
	if f, err := e.OpenModule("nvidia"); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "modules/nvidia.ko: sha256") {
		if f != nil {
			f.Close()
		}
		t.Fatalf("OpenModule of the damaged module = %v; want ErrCorrupt naming its sha256", err)
	}
	if _, ok, err := Lookup(dir, key); ok || !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "sha256") {
		t.Fatalf("Lookup of the damaged entry = %v, %v; want a miss naming the sha256", ok, err)
	}
}

// TestOpenDamagedEntry: what Open checks (manifest, key, header, module type and size) reports
// the entry damaged as Lookup does, and leaves it in place at Path for the caller to remove.
func TestOpenDamagedEntry(t *testing.T) {
	t.Parallel()
	for name, damage := range map[string]func(t *testing.T, e string){
		"module truncated": func(t *testing.T, e string) {
			hosttest.Must(t, os.Truncate(filepath.Join(e, ModulesDir, "nvidia.ko"), 10))
		},
		"module missing": func(t *testing.T, e string) {
			hosttest.Must(t, os.Remove(filepath.Join(e, ModulesDir, "nvidia-modeset.ko")))
		},
		"module is symlink": func(t *testing.T, e string) {
			p := filepath.Join(e, ModulesDir, "nvidia-uvm.ko")
			hosttest.Must(t, os.Rename(p, p+".real"))
			hosttest.Must(t, os.Symlink("nvidia-uvm.ko.real", p))
		},
		"manifest missing": func(t *testing.T, e string) { hosttest.Must(t, os.Remove(filepath.Join(e, ManifestFile))) },
		"manifest of an older format": func(t *testing.T, e string) {
			p := filepath.Join(e, ManifestFile)
			b, err := os.ReadFile(p)
			hosttest.Must(t, err)
			hosttest.Must(t, os.WriteFile(p, bytes.Replace(b, []byte(`"format": 3`), []byte(`"format": 1`), 1), 0o644))
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			e, err := Store(dir, testKey(), moduleFiles(t))
			if err != nil {
				t.Fatal(err)
			}
			damage(t, e.Dir)
			if _, ok, err := Open(dir, testKey()); ok || !errors.Is(err, ErrCorrupt) || strings.Contains(err.Error(), "removed") {
				t.Fatalf("Open = %v, %v; want a miss wrapping ErrCorrupt, not removed", ok, err)
			}
			if p := Path(dir, testKey()); p != e.Dir {
				t.Errorf("Path = %s; the entry is at %s", p, e.Dir)
			}
			if _, err := os.Lstat(e.Dir); err != nil {
				t.Errorf("Open removed the damaged entry: %v", err)
			}
		})
	}
}
