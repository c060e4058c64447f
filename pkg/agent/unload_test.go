package agent

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon/daemontest"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// holdDevice makes pid 4242 (python3) hold /dev/nvidia0 in the fixture's procfs, with the
// reference on nvidia that the open device gives it.
func (w *world) holdDevice(t *testing.T) {
	t.Helper()
	w.kernel.Use("nvidia", 1)
	pid := w.roots.InProc("4242")
	if err := os.MkdirAll(filepath.Join(pid, "fd"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/dev/nvidia0", filepath.Join(pid, "fd/3")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pid, "comm"), []byte("python3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// A driver of another configuration in use at start: the unload waits --unload-timeout (60s by
// default, on the injected clock), logging each retry with the holder, then the run ends with
// exit 10, the script's line and the holder in the error (the termination log), nothing unloaded.
func TestInUseAtStart(t *testing.T) {
	w := newWorld(t)
	if err := w.kernel.Preload("nvidia", "nvidia_uvm", "nvidia_modeset"); err != nil {
		t.Fatal(err)
	}
	w.holdDevice(t)
	a := w.agent(t)
	var logBuf hosttest.LogBuffer
	a.Log = slog.New(slog.NewTextHandler(&logBuf, nil))
	start := time.Unix(1_800_000_000, 0)
	clock := daemontest.NewInstant(start)
	a.Clock = clock
	cancel, done := startAgent(a)
	defer cancel()
	err := runEnded(t, done, 10*time.Second, "the in-use driver")
	if !errors.Is(err, exitcode.ErrInUse) || exitcode.Code(err) != 10 {
		t.Fatalf("Run = %v, want in use (10)", err)
	}
	if waited := clock.Now().Sub(start); waited != time.Minute {
		t.Errorf("the unload waited %s, want the default --unload-timeout 1m0s", waited)
	}
	logs := logBuf.String()
	retries := strings.Count(logs, "NVIDIA driver kernel modules are in use; retrying")
	if retries == 0 || retries != len(clock.Waits()) || strings.Count(logs, "pid 4242 (python3) has /dev/nvidia0 open") < retries {
		t.Errorf("%d retry lines for %d waits, each must name pid 4242 (python3):\n%s", retries, len(clock.Waits()), logs)
	}
	if !strings.Contains(logs, `level=ERROR msg="Could not unload NVIDIA driver kernel modules, driver is in use"`) {
		t.Errorf("the script's line is not a message of its own:\n%s", logs)
	}
	for _, c := range w.kernel.Calls() {
		t.Errorf("kernel call %q: nothing may be loaded or unloaded while the old driver is in use", c)
	}
	path := filepath.Join(t.TempDir(), "termination-log")
	hosttest.Must(t, os.WriteFile(path, nil, 0o644))
	WriteTerminationLog(path, err)
	if got, _ := os.ReadFile(path); !strings.HasPrefix(string(got), "driver-agent exit 10: load: ") ||
		!strings.Contains(string(got), "driver is in use") || !strings.Contains(string(got), "pid 4242 (python3)") {
		t.Errorf("termination log %q", got)
	}
	if l := w.kernel.Loaded(); !slices.Equal(l, []string{"nvidia", "nvidia_uvm", "nvidia_modeset"}) {
		t.Errorf("loaded %v", l)
	}
}

// TestDryRunDriverInUse: the dry run on the same node looks once and says what the real run
// would wait for, and for how long; it waits for nothing and changes nothing.
func TestDryRunDriverInUse(t *testing.T) {
	w := newWorld(t)
	hosttest.Must(t, w.kernel.Preload("nvidia", "nvidia_uvm", "nvidia_modeset"))
	w.holdDevice(t)
	w.before = files(hosttest.Snapshot(t, w.dir))
	start := time.Unix(1_800_000_000, 0)
	plan, clock := planText(t, w.agent(t, "--dry-run", "--unload-timeout", "90s"))
	want := "load: would fail: driver in use: could not unload NVIDIA driver kernel modules now, driver is in use: nvidia busy; " +
		"held by: pid 4242 (python3) has /dev/nvidia0 open; a real run retries for up to 1m30s, then leaves every module loaded"
	if !strings.Contains(plan, want) {
		t.Errorf("plan lacks %q:\n%s", want, plan)
	}
	if strings.Contains(plan, "unload-module") || strings.Contains(plan, "load-module nvidia") {
		t.Errorf("the plan unloads or loads although the driver is in use:\n%s", plan)
	}
	if !clock.Now().Equal(start) || len(clock.Waits()) != 0 || len(w.kernel.Calls()) != 0 {
		t.Errorf("clock moved %s, waits %v, kernel calls %v", clock.Now().Sub(start), clock.Waits(), w.kernel.Calls())
	}
	if diff := hosttest.DiffSnapshots(w.before, files(hosttest.Snapshot(t, w.dir))); diff != "" {
		t.Errorf("the dry run changed the tree:\n%s", diff)
	}
	if l := w.kernel.Loaded(); !slices.Equal(l, []string{"nvidia", "nvidia_uvm", "nvidia_modeset"}) {
		t.Errorf("loaded %v", l)
	}
}

// TestDryRunReloadPlansWhatIsLoaded: the plan unloads the old driver's loaded modules, holders
// first, and none that is not loaded (on the GPU node it once planned nvidia_modeset,
// nvidia_peermem and nvidia_drm, which were not there, after nvidia).
func TestDryRunReloadPlansWhatIsLoaded(t *testing.T) {
	w := newWorld(t)
	hosttest.Must(t, w.kernel.Preload("nvidia", "nvidia_uvm"))
	plan, _ := planText(t, w.agent(t, "--dry-run"))
	steps, _, _ := strings.Cut(plan, "On SIGTERM:")
	var unloads []string
	for _, l := range strings.Split(steps, "\n") {
		if _, m, ok := strings.Cut(l, "unload-module "); ok {
			unloads = append(unloads, m)
		}
	}
	if !slices.Equal(unloads, []string{"nvidia_uvm", "nvidia"}) {
		t.Errorf("the plan unloads %v before loading, want [nvidia_uvm nvidia]:\n%s", unloads, plan)
	}
}

// TestReloadWithoutModuleUnload: a driver of another configuration on a kernel that cannot
// unload modules is refused at once, before anything is changed, with what to do instead.
func TestReloadWithoutModuleUnload(t *testing.T) {
	w := newWorld(t)
	hosttest.Must(t, w.kernel.Preload("nvidia", "nvidia_uvm"))
	hosttest.Must(t, w.kernel.WithoutModuleUnload())
	a := w.agent(t)
	clock := daemontest.NewInstant(time.Unix(1_800_000_000, 0))
	a.Clock = clock
	err := a.Run(context.Background())
	if !errors.Is(err, exitcode.ErrInUse) || !strings.Contains(err.Error(), "cannot be replaced: driver in use: nvidia, nvidia_uvm cannot be unloaded: the running kernel was built without module unloading") ||
		!strings.Contains(err.Error(), "with --modules=host an image of driver") {
		t.Fatalf("Run = %v", err)
	}
	if len(clock.Waits()) != 0 || len(w.kernel.Calls()) != 0 {
		t.Errorf("waits %v, kernel calls %v: the refusal is at once and changes nothing", clock.Waits(), w.kernel.Calls())
	}
}

// loadForeign loads gdrdrv, holding nvidia, as the GDRCopy sidecar does.
func (w *world) loadForeign(t *testing.T) {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "gdrdrv.ko")
	if err := os.WriteFile(path, hosttest.ModuleELF("name=gdrdrv", "version=2.4", "depends=nvidia"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := w.kernel.LoadModule(host.ModuleImage{Name: "gdrdrv", Path: path}); err != nil {
		t.Fatal(err)
	}
}

// A holder module the agent did not load stays at teardown, as a user of the driver: exit 10,
// named; with --unload-foreign-holders it is unloaded first and the stop is clean.
func TestForeignHolderAtTeardown(t *testing.T) {
	for _, unloadForeign := range []bool{false, true} {
		t.Run(map[bool]string{false: "left", true: "unloaded"}[unloadForeign], func(t *testing.T) {
			w := newWorld(t)
			var args []string
			if unloadForeign {
				args = append(args, "--unload-foreign-holders")
			}
			a := w.agent(t, args...)
			a.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
			cancel, done := startAgent(a)
			defer cancel()
			w.waitReady(t, done)
			w.loadForeign(t)
			cancel()
			err := runEnded(t, done, 10*time.Second, "SIGTERM")
			if unloadForeign {
				if err != nil {
					t.Fatalf("Run = %v", err)
				}
				w.assertClean(t)
				return
			}
			if !errors.Is(err, exitcode.ErrInUse) || !strings.Contains(err.Error(), "module gdrdrv (not loaded by driver-agent") {
				t.Fatalf("Run = %v, want in use (10) naming gdrdrv", err)
			}
			for _, m := range []string{"nvidia", "nvidia_uvm", "nvidia_modeset", "gdrdrv"} {
				if !slices.Contains(w.kernel.Loaded(), m) {
					t.Errorf("%s was unloaded although gdrdrv holds the driver", m)
				}
			}
		})
	}
}
