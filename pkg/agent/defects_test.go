package agent

import (
	"context"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/cache"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/link"
)

// modTimes records the modification time of everything under dir: what a snapshot of contents
// does not see (a cache hit marks its manifest as used by touching it).
func modTimes(t *testing.T, dir string) map[string]time.Time {
	t.Helper()
	out := map[string]time.Time{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		out[p] = info.ModTime()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// storeEntry puts stand-in NVIDIA modules in the cache at dir under the key the real source
// looks up on w's node, and returns the entry.
func storeEntry(t *testing.T, w *world, dir string) cache.Entry {
	t.Helper()
	banner, err := kernel.Banner(w.roots.Proc)
	if err != nil {
		t.Fatal(err)
	}
	src := t.TempDir()
	var mods []link.Module
	for _, name := range []string{"nvidia", "nvidia_uvm", "nvidia_modeset"} {
		p := filepath.Join(src, strings.ReplaceAll(name, "_", "-")+".ko")
		if err := os.WriteFile(p, hosttest.ModuleELF("name="+name, "version="+testVersion, "license=GPL"), 0o644); err != nil {
			t.Fatal(err)
		}
		mods = append(mods, link.Module{Name: name, Path: p})
	}
	e, err := cache.Store(dir, cache.Key{Banner: banner, DriverVersion: testVersion, Flavor: "kernel"}, mods)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// TestDryRunLeavesTheCacheAlone: with the real source and the cache inside the node's tree, a
// dry run finds a damaged entry without removing it, and a good entry without marking it used;
// the tree's contents and every modification time are as before.
func TestDryRunLeavesTheCacheAlone(t *testing.T) {
	w := newWorld(t)
	cacheDir := w.roots.InHost("var/lib/nvidia-driver-agent/cache")
	entry := storeEntry(t, w, cacheDir)
	old := time.Now().Add(-time.Hour).Truncate(time.Second)
	if err := os.Chtimes(filepath.Join(entry.Dir, cache.ManifestFile), old, old); err != nil {
		t.Fatal(err)
	}
	dryRun := func(wantPlan, wantLog string) {
		t.Helper()
		before, times := files(hosttest.Snapshot(t, w.dir)), modTimes(t, w.dir)
		a := w.agent(t, "--dry-run", "--cache-dir", cacheDir)
		rec := &host.Recorder{}
		a.Recorder, a.Host, a.Source = rec, host.DryRun(w.roots, rec), nil
		var out strings.Builder
		logs := &lockedBuffer{}
		a.Out, a.Log = &out, slog.New(slog.NewTextHandler(logs, nil))
		if err := a.Run(context.Background()); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out.String(), wantPlan) {
			t.Errorf("plan lacks %q:\n%s", wantPlan, out.String())
		}
		if !strings.Contains(logs.String(), wantLog) {
			t.Errorf("log lacks %q:\n%s", wantLog, logs.String())
		}
		if diff := hosttest.DiffSnapshots(before, files(hosttest.Snapshot(t, w.dir))); diff != "" {
			t.Errorf("the dry run changed the tree:\n%s", diff)
		}
		for p, mt := range modTimes(t, w.dir) {
			if was, ok := times[p]; ok && !mt.Equal(was) {
				t.Errorf("the dry run touched %s (mtime %v, was %v)", p, mt, was)
			}
		}
	}

	dryRun("Install path: cached", "install path chosen")

	// Damage the entry: one byte of a module.
	ko := entry.Modules[0].Path
	data, err := os.ReadFile(ko)
	if err != nil {
		t.Fatal(err)
	}
	data[len(data)/2] ^= 1
	if err := os.WriteFile(ko, data, 0o644); err != nil {
		t.Fatal(err)
	}
	dryRun("Install path: compile", "damaged cache entry; a real run removes it and makes the modules again")
	if _, err := os.Stat(entry.Dir); err != nil {
		t.Errorf("the damaged entry is gone: %v", err)
	}
}
