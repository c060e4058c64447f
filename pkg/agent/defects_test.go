package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/cache"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/link"
	"github.com/driver-agent/driver-agent/pkg/status"
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
// dry run plans to load a good entry's own modules and to mark it used, and finds a damaged entry
// and plans its removal; the tree's contents and every modification time are as before.
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
		logs := &hosttest.LogBuffer{}
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

	dryRun("touch "+cache.UsedPath(entry.Dir), "install path chosen")
	dryRun("load-module nvidia (finit_module "+entry.Dir, "install path chosen")

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
	// Open sees no damage in the bytes; prepare, verifying what it would load, does: the plan
	// removes the entry (recorded) and goes on with the compile path.
	dryRun("remove-all "+entry.Dir, "damaged cache entry removed; it will be rebuilt")
	dryRun("Install path: compile", "damaged cache entry removed; it will be rebuilt")
	if _, err := os.Stat(entry.Dir); err != nil {
		t.Errorf("the damaged entry is gone: %v", err)
	}
}

// scrapeThroughout makes a's metrics server, once it listens, scraped without pause by a few
// clients until the run ends, so that -race sees every write of the state the metrics read. The
// returned function stops them and returns how many scrapes got an answer.
func scrapeThroughout(t *testing.T, a *Agent) (stop func() int) {
	t.Helper()
	var wg sync.WaitGroup
	quit := make(chan struct{})
	var answered atomic.Int64
	a.OnListen = func(addr string) {
		for i := range 4 {
			path := []string{"/metrics", "/readyz"}[i%2]
			wg.Add(1)
			go func() {
				defer wg.Done()
				client := &http.Client{Timeout: 5 * time.Second}
				for {
					select {
					case <-quit:
						return
					default:
					}
					resp, err := client.Get("http://" + addr + path)
					if err != nil {
						continue // the server has shut down at the end of the teardown
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					answered.Add(1)
				}
			}()
		}
	}
	return func() int {
		close(quit)
		wg.Wait()
		return int(answered.Load())
	}
}

// TestScrapesThroughoutEveryPath runs every install path (precompiled, cached, fast, host, and
// a start that fails for want of one) while the metrics are scraped all the time; under -race a
// field the metrics read that a phase writes without the run's lock fails the test.
func TestScrapesThroughoutEveryPath(t *testing.T) {
	// Starts of each path: the cached path is the second start with the same cache dir, and the
	// fast path, the shortest, runs several times so that a scrape lands in its short phases.
	starts := map[string]int{"precompiled and cached": 2, "fast": 6}
	for name, setup := range map[string]func(t *testing.T) (w *world, a *Agent, wantErr bool){
		"precompiled and cached": func(t *testing.T) (*world, *Agent, bool) {
			w := newWorld(t)
			banner, err := kernel.Banner(w.roots.Proc)
			if err != nil {
				t.Fatal(err)
			}
			writePackage(t, w.roots, "nvidia-modules-6.6.95", banner)
			a := w.agent(t, "--cache-dir", filepath.Join(t.TempDir(), "cache"))
			a.Source = nil
			return w, a, false
		},
		"fast": func(t *testing.T) (*world, *Agent, bool) {
			w := newWorld(t)
			w.loadedWithDigest(t, "digest-1")
			return w, w.agent(t), false
		},
		"host": func(t *testing.T) (*world, *Agent, bool) {
			w := newHostWorld(t)
			a := w.agent(t)
			a.Config.DriverVersion = "570.148.08"
			return w, a, false
		},
		"no install path": func(t *testing.T) (*world, *Agent, bool) {
			w := newWorld(t)
			for _, p := range []string{w.roots.InRoot("host-etc/os-release"), w.roots.InHost("usr/lib/os-release")} {
				hosttest.Must(t, os.WriteFile(p, []byte("ID=ubuntu\nVERSION_ID=24.04\n"), 0o644))
			}
			a := w.agent(t)
			a.Source = nil
			return w, a, true
		},
	} {
		t.Run(name, func(t *testing.T) {
			w, a, wantErr := setup(t)
			for i := range max(starts[name], 1) {
				stop := scrapeThroughout(t, a)
				cancel, done := startAgent(a)
				if wantErr {
					if err := runEnded(t, done, 10*time.Second, "a start without an install path"); err == nil {
						t.Error("Run = nil, want an error")
					}
				} else {
					w.waitReady(t, done)
					cancel()
					if err := runEnded(t, done, 10*time.Second, "SIGTERM"); err != nil {
						t.Fatal(err)
					}
				}
				cancel()
				if n := stop(); n == 0 {
					t.Error("no scrape was answered during the run")
				}
				next := w.agent(t, "--cache-dir", a.Config.CacheDir)
				next.Source, next.Config.DriverVersion = a.Source, a.Config.DriverVersion
				a = next
				if name == "fast" && i < starts[name]-1 { // the teardown unloaded what the fast path adopted
					w.loadedWithDigest(t, "digest-1")
				}
			}
		})
	}
}

// TestCancellationInsideTheRunIsNoSignal: a phase that fails with context.Canceled in its error
// chain (a request's or a child's own context) while the run's context is live is a failure
// (exit 1, status.json kept with the error), not the clean stop of a signal.
func TestCancellationInsideTheRunIsNoSignal(t *testing.T) {
	w := newWorld(t)
	a := w.agent(t)
	a.Source = fakeSource{dir: t.TempDir(), err: fmt.Errorf("fetch https://mirror.example/x: %w", context.Canceled)}
	logs := &hosttest.LogBuffer{}
	a.Log = slog.New(slog.NewTextHandler(logs, nil))
	err := a.Run(context.Background())
	if err == nil || exitcode.Code(err) != 1 || !strings.Contains(err.Error(), "decide: fetch https://mirror.example/x: context canceled") {
		t.Fatalf("Run = %v (code %d), want the decide phase's failure, exit 1", err, exitcode.Code(err))
	}
	if strings.Contains(logs.String(), "Caught signal") {
		t.Errorf("logged as a signal:\n%s", logs.String())
	}
	st := w.readStatus(t)
	failed := slices.ContainsFunc(st.Phases, func(p status.Timing) bool { return p.Result == "failed" })
	if !failed || !strings.Contains(st.LastError, "context canceled") {
		t.Errorf("status.json does not keep the failure: phases %+v, last error %q", st.Phases, st.LastError)
	}
	os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
	w.assertClean(t)

	// The same error while the run's context is cancelled is the signal's: a clean stop.
	ctx, cancel := context.WithCancel(context.Background())
	a = w.agent(t)
	a.BeforePhase = func(p string) {
		if p == PhaseDecide {
			cancel()
		}
	}
	if err := a.Run(ctx); err != nil {
		t.Fatalf("Run after a signal = %v, want nil", err)
	}
	w.assertClean(t)
}

// TestPreviousShutdownFromExitCode: the next start classifies how the last one ended by the exit
// code status.json keeps, not by words in its error: a failure that says "in use" is an error, a
// driver in use at the teardown is in_use, and a missing status.json is a clean stop.
func TestPreviousShutdownFromExitCode(t *testing.T) {
	w := newWorld(t)
	paths := status.Paths{Run: w.roots.Run}
	if got := previousShutdown(paths); got != "clean_or_first_start" {
		t.Errorf("without status.json: %q, want clean_or_first_start", got)
	}
	if _, err := status.Read(paths); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("status.Read without status.json = %v, want it to wrap fs.ErrNotExist", err)
	}

	a := w.agent(t)
	a.Source = fakeSource{dir: t.TempDir(), err: errors.New("the build directory /var/tmp/nvidia is in use by another build")}
	if err := a.Run(context.Background()); exitcode.Code(err) != 1 {
		t.Fatalf("Run = %v (code %d), want exit 1", err, exitcode.Code(err))
	}
	if st := w.readStatus(t); st.ExitCode != 1 {
		t.Errorf("status.json says exit code %d, want 1", st.ExitCode)
	}
	if got := previousShutdown(paths); got != "error" {
		t.Errorf("after a failure whose error says 'in use': %q, want error", got)
	}

	a = w.agent(t)
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	w.kernel.Use("nvidia_uvm", 1)
	cancel()
	if err := <-done; exitcode.Code(err) != 10 {
		t.Fatalf("Run = %v, want in use (10)", err)
	}
	if got := previousShutdown(paths); got != "in_use" {
		t.Errorf("after a driver in use at the teardown: %q, want in_use; status.json:\n%s", got, w.read(t, "run/nvidia/driver-agent/status.json"))
	}
}
