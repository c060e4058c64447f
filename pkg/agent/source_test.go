package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/cache"
	"github.com/driver-agent/driver-agent/pkg/config"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/link"
)

// TestPrepareLinksThePackageFindChose: the package is read and checked once, by Find; Prepare
// links what Find chose even when the file is replaced in between (no second read).
func TestPrepareLinksThePackageFindChose(t *testing.T) {
	dir := t.TempDir()
	roots := hosttest.Roots(t, dir)
	banner := "Linux version 6.6.95-flatcar (build@pony) #1 SMP"
	path := writePackage(t, roots, "nvidia-modules-6.6.95", banner)
	s := &imageSource{cfg: &config.Config{DriverVersion: testVersion}, roots: roots, files: host.OSFiles{}, procs: host.OSExec{}, log: slog.New(slog.DiscardHandler)}
	d, err := s.Find(context.Background(), detect.Facts{KernelRelease: "6.6.95-flatcar", Banner: banner}, "kernel")
	if err != nil || d.Path != PathPrecompiled || d.Package != path {
		t.Fatalf("Find = %+v, %v; want the package %s", d, err, path)
	}
	if err := os.WriteFile(path, []byte("not a package"), 0o644); err != nil {
		t.Fatal(err)
	}
	d.Modules = []string{"nvidia", "nvidia_uvm", "nvidia_modeset"}
	work := t.TempDir()
	images, err := s.Prepare(context.Background(), d, work)
	if err != nil {
		t.Fatalf("Prepare after the file changed = %v; want the package Find read", err)
	}
	if len(images) != 3 {
		t.Fatalf("images %+v", images)
	}
	for _, im := range images {
		data, err := os.ReadFile(im.Path)
		if err != nil || !strings.HasPrefix(im.Path, filepath.Join(work, "link")) || !strings.Contains(string(data), "name="+im.Name) {
			t.Errorf("module %s at %s: %q, %v", im.Name, im.Path, data, err)
		}
	}
}

// TestCachedModulesLoadFromTheVerifiedFile: Prepare hands over each cached module open, after
// verifying it through that file, so a file put in its place afterwards is not what is loaded;
// a damaged module removes the entry.
func TestCachedModulesLoadFromTheVerifiedFile(t *testing.T) {
	dir := t.TempDir()
	roots := hosttest.Roots(t, dir)
	banner := "Linux version 6.6.95-flatcar (build@pony) #1 SMP"
	cacheDir := filepath.Join(dir, "cache")
	var mods []link.Module
	for _, name := range []string{"nvidia", "nvidia_uvm", "nvidia_modeset"} {
		path := filepath.Join(dir, strings.ReplaceAll(name, "_", "-")+".ko")
		if err := os.WriteFile(path, hosttest.ModuleELF("name="+name, "version="+testVersion), 0o644); err != nil {
			t.Fatal(err)
		}
		mods = append(mods, link.Module{Name: name, Path: path})
	}
	s := &imageSource{cfg: &config.Config{DriverVersion: testVersion, CacheDir: cacheDir, CacheMaxEntries: 3}, roots: roots, files: host.OSFiles{}, procs: host.OSExec{}, banner: banner, log: slog.New(slog.DiscardHandler)}
	entry, err := cache.Store(cacheDir, s.key("kernel"), mods)
	if err != nil {
		t.Fatal(err)
	}
	find := func() Decision {
		t.Helper()
		d, err := s.Find(context.Background(), detect.Facts{KernelRelease: "6.6.95-flatcar", Banner: banner}, "kernel")
		if err != nil {
			t.Fatal(err)
		}
		d.Modules = []string{"nvidia", "nvidia_uvm", "nvidia_modeset"}
		return d
	}
	d := find()
	if d.Path != PathCached {
		t.Fatalf("Find = %+v; want the cache", d)
	}
	images, err := s.Prepare(context.Background(), d, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer closeFiles(images)
	want, _ := os.ReadFile(entry.Modules[0].Path)
	other := bytes.Clone(want)
	other[len(other)/2] ^= 0xff // same size: only the sha256 tells
	if err := os.WriteFile(entry.Modules[0].Path+".new", other, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(entry.Modules[0].Path+".new", entry.Modules[0].Path); err != nil {
		t.Fatal(err)
	}
	if images[0].File == nil {
		t.Fatal("nvidia's image has no open file: the kernel would read whatever is at its path now")
	}
	got, _ := io.ReadAll(io.NewSectionReader(images[0].File, 0, 1<<30))
	if !bytes.Equal(got, want) {
		t.Errorf("the open file holds %d other bytes, want the verified module", len(got))
	}

	// The replaced file is damage: the next Prepare refuses the entry and removes it.
	if d = find(); d.Path != PathCached {
		t.Fatalf("Find = %+v; want the cache (only the contents differ)", d)
	}
	if _, err := s.Prepare(context.Background(), d, t.TempDir()); !errors.Is(err, errDamagedEntry) || !errors.Is(err, cache.ErrCorrupt) {
		t.Fatalf("Prepare of the damaged entry = %v; want errDamagedEntry", err)
	}
	if _, err := os.Stat(entry.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the damaged entry is still there: %v", err)
	}
}
