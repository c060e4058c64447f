package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ulikunitz/xz"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/build/buildtest"
	"github.com/driver-agent/driver-agent/pkg/config"
	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/daemon/daemontest"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
	"github.com/driver-agent/driver-agent/pkg/status"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testVersion = "535.309.01"

// fakeSource stands in for the precompiled/compile paths: it hands out stand-in modules.
type fakeSource struct {
	dir string // where the stand-in module files are written, outside the fixture tree
	err error
}

func (s fakeSource) Find(context.Context, detect.Facts, string) (Decision, error) {
	return Decision{Path: PathPrecompiled, Reason: "test source", Package: "nvidia-modules-test"}, s.err
}

// Prepare writes stand-in module files (ELF objects with a .modinfo) and returns them, deliberately
// not in dependency order: the agent orders them by depends=.
func (s fakeSource) Prepare(_ context.Context, d Decision, _ string) ([]host.ModuleImage, error) {
	dir := s.dir
	depends := map[string]string{"nvidia": "", "nvidia_uvm": "nvidia", "nvidia_modeset": "nvidia", "nvidia_peermem": "nvidia", "nvidia_drm": "nvidia_modeset"}
	var images []host.ModuleImage
	for i := len(d.Modules) - 1; i >= 0; i-- {
		name := d.Modules[i]
		path := filepath.Join(dir, strings.ReplaceAll(name, "_", "-")+".ko")
		elf := hosttest.ModuleELF("name="+name, "version="+testVersion, "depends="+depends[name], "license=GPL")
		if err := os.WriteFile(path, elf, 0o644); err != nil {
			return nil, err
		}
		images = append(images, host.ModuleImage{Name: name, Path: path})
	}
	return images, nil
}

// Wait has nothing to wait for: Prepare leaves nothing running.
func (fakeSource) Wait(context.Context) error { return nil }

type world struct {
	dir       string
	roots     host.Roots
	kernel    *hosttest.FakeKernel
	mounter   *hosttest.FakeMounter
	reaper    *daemon.Reaper
	daemonLog string // the fake persistenced appends "start <args>", "stop" here
	before    map[string]string
}

// newHostWorld is a world from the Talos fixture, whose host has loaded nvidia 570.148.08.
func newHostWorld(t *testing.T) *world {
	t.Helper()
	dir := hosttest.UnpackFile(t, "../../test/fixtures/talos.txtar")
	w := &world{dir: dir, roots: hosttest.Roots(t, dir)}
	w.setupDaemons(t)
	w.kernel = hosttest.NewFakeKernel(w.roots, nil)
	w.mounter = hosttest.NewFakeMounter(w.roots)
	w.before = files(hosttest.Snapshot(t, dir))
	return w
}

// planText runs a as a dry run on an instant clock and returns its text plan and the clock.
func planText(t *testing.T, a *Agent) (string, *daemontest.Instant) {
	t.Helper()
	rec := &host.Recorder{}
	a.Recorder, a.Host = rec, host.DryRun(a.Config.Roots, rec)
	clock := daemontest.NewInstant(time.Unix(1_800_000_000, 0))
	a.Clock = clock
	var out strings.Builder
	a.Out = &out
	if err := a.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	return out.String(), clock
}

func newWorld(t *testing.T) *world {
	t.Helper()
	dir := hosttest.UnpackFile(t, "../../test/fixtures/flatcar-stable-gpu.txtar")
	w := &world{dir: dir, roots: hosttest.Roots(t, dir)}
	w.setupDaemons(t)
	w.kernel = hosttest.NewFakeKernel(w.roots, map[string]hosttest.FakeModule{
		"nvidia":         {Version: testVersion},
		"nvidia_uvm":     {Version: testVersion, Deps: []string{"nvidia"}},
		"nvidia_modeset": {Version: testVersion, Deps: []string{"nvidia"}},
		"nvidia_drm":     {Version: testVersion, Deps: []string{"nvidia_modeset"}},
	})
	w.mounter = hosttest.NewFakeMounter(w.roots)
	writeHostModules(t, w.roots.InHost("usr/lib/modules/6.6.95-flatcar"))
	hosttest.Must(t, os.WriteFile(w.roots.InDrivers("nvidia.conf"), []byte("# from the operator's ConfigMap\nNVreg_EnableGpuFirmware=18 NVreg_OpenRmEnableUnsupportedGpus=1\n"), 0o644))
	w.before = files(hosttest.Snapshot(t, dir))
	return w
}

// fakePersistenced behaves like nvidia-persistenced of the 535 branch: it forks into the
// background, the child writes the PID file (its comm is still the script's name) and runs until
// SIGTERM, removing the PID file as it exits.
const fakePersistenced = `#!/bin/sh
dir="$(dirname "$0")/../../var/run/nvidia-persistenced"
echo "start $*" >> "$FAKE_DAEMON_LOG"
if [ -n "$FAKE_DAEMON_CRASH" ]; then echo crash >> "$FAKE_DAEMON_LOG"; exit 1; fi
(
  trap 'rm -f "$dir/nvidia-persistenced.pid"; echo stop >> "$FAKE_DAEMON_LOG"; exit 0' TERM
  sh -c 'echo $PPID' > "$dir/nvidia-persistenced.pid"
  while :; do sleep 0.05; done
) &
exit 0
`

// setupDaemons installs the fake daemon and a reaper for this test's children.
func (w *world) setupDaemons(t *testing.T) {
	t.Helper()
	bin := w.roots.InRoot("usr/bin/nvidia-persistenced")
	hosttest.Must(t, os.MkdirAll(filepath.Dir(bin), 0o755))
	if err := os.WriteFile(bin, []byte(fakePersistenced), 0o755); err != nil {
		t.Fatal(err)
	}
	hosttest.Must(t, os.Chmod(bin, 0o755)) // the fixture's file exists already, so WriteFile kept its mode
	w.daemonLog = filepath.Join(t.TempDir(), "daemon.log")
	t.Setenv("FAKE_DAEMON_LOG", w.daemonLog)
	reaper, err := daemon.NewReaper(daemon.ReaperOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reaper.Close() })
	w.reaper = reaper
}

func (w *world) daemonEvents(t *testing.T) []string {
	t.Helper()
	data, _ := os.ReadFile(w.daemonLog)
	return strings.Fields(strings.ReplaceAll(string(data), "\n", " | "))
}

// writeHostModules lays out the host's in-tree modules the way Flatcar does: compressed modules,
// modules.dep and modules.builtin.
func writeHostModules(t *testing.T, dir string) {
	t.Helper()
	mods := map[string][]byte{
		"kernel/drivers/i2c/i2c-core.ko":              hosttest.ModuleELF("name=i2c_core", "depends="),
		"kernel/drivers/char/ipmi/ipmi_msghandler.ko": hosttest.ModuleELF("name=ipmi_msghandler", "depends="),
		"kernel/drivers/char/ipmi/ipmi_devintf.ko.xz": xzCompress(t, hosttest.ModuleELF("name=ipmi_devintf", "depends=ipmi_msghandler")),
	}
	for p, data := range mods {
		hosttest.Must(t, os.MkdirAll(filepath.Dir(filepath.Join(dir, p)), 0o755))
		if err := os.WriteFile(filepath.Join(dir, p), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	dep := "kernel/drivers/i2c/i2c-core.ko:\nkernel/drivers/char/ipmi/ipmi_msghandler.ko:\nkernel/drivers/char/ipmi/ipmi_devintf.ko.xz: kernel/drivers/char/ipmi/ipmi_msghandler.ko\n"
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep), 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte("kernel/drivers/acpi/video.ko\n"), 0o644))
}

func xzCompress(t *testing.T, data []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := xz.NewWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(data)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// files drops directories from a snapshot: empty directories are not state the run leaves.
func files(snap map[string]string) map[string]string {
	for p := range snap {
		if strings.HasSuffix(p, "/") {
			delete(snap, p)
		}
	}
	return snap
}

func (w *world) agent(t *testing.T, extraArgs ...string) *Agent {
	t.Helper()
	r := w.roots
	args := append([]string{"--root", r.Root, "--host-root", r.HostRoot, "--proc", r.Proc, "--sys", r.Sys, "--dev", r.Dev,
		"--run", r.Run, "--drivers-dir", r.DriversDir, "--shutdown-timeout", "2s", "--daemon-stop-timeout", "10s",
		"--metrics-address", "127.0.0.1:0", "--cache-dir", filepath.Join(t.TempDir(), "cache")}, extraArgs...)
	cfg, _, err := config.Parse("test", args, []string{"DRIVER_VERSION=" + testVersion, "DRIVER_CONFIG_DIGEST=digest-1", "NODE_NAME=node-a"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.ValidateInit(); err != nil {
		t.Fatal(err)
	}
	h := host.Host{Roots: r, Kernel: w.kernel, Mounter: w.mounter, Mknoder: hosttest.FakeMknoder{}, Files: host.OSFiles{}, Procs: w.reaper}
	return &Agent{Config: cfg, Host: h, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Source: fakeSource{dir: t.TempDir()}, Out: io.Discard, ChildProc: "/proc",
		DaemonPolicy: daemon.Policy{InitialBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, MaxRestarts: 2}}
}

func (w *world) read(t *testing.T, rel string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(w.dir, rel))
	if err != nil {
		return "<" + err.Error() + ">"
	}
	return string(data)
}

// readStatus reads status.json as the agent wrote it, through status.Read; a missing or malformed
// file fails the test.
func (w *world) readStatus(t *testing.T) status.Status {
	t.Helper()
	st, err := status.Read(status.Paths{Run: w.roots.Run})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func (w *world) assertClean(t *testing.T) {
	t.Helper()
	if diff := hosttest.DiffSnapshots(w.before, files(hosttest.Snapshot(t, w.dir))); diff != "" {
		t.Errorf("the run left the tree changed:\n%s", diff)
	}
	if l := w.kernel.Loaded(); len(l) != 0 {
		t.Errorf("modules still loaded: %v", l)
	}
	if m := w.mounter.Mounted(); len(m) != 0 {
		t.Errorf("still mounted: %v", m)
	}
	// The fake removes its PID file when SIGTERM stops it; the tree diff above catches a leftover.
}

// startAgent runs a in the background and returns a cancel and the result channel.
func startAgent(a *Agent) (context.CancelFunc, <-chan error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	return cancel, done
}

// waitReady waits until the agent is in its wait phase with the operator's file saying Ready.
func (w *world) waitReady(t *testing.T, done <-chan error) {
	t.Helper()
	waitFor(t, "Ready", func() bool {
		if w.read(t, "run/nvidia/validations/.driver-daemons-status") != "Ready" {
			return false
		}
		st, err := status.Read(status.Paths{Run: w.roots.Run})
		return err == nil && st.Phase == PhaseWait
	}, done)
}

// loadedWithDigest sets the node up as an earlier run left it: the NVIDIA modules loaded and
// the configuration digest stored as digest, so that a run whose digest matches takes the fast path.
func (w *world) loadedWithDigest(t *testing.T, digest string) {
	t.Helper()
	if err := w.kernel.Preload("nvidia", "nvidia_uvm", "nvidia_modeset"); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(w.roots.InRun("nvidia"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(w.roots.InRun("nvidia/nvidia-driver.state"), []byte(digest), 0o644); err != nil {
		t.Fatal(err)
	}
}

func waitFor(t *testing.T, what string, cond func() bool, done <-chan error) {
	t.Helper()
	waitForWithin(t, what, 10*time.Second, cond, done)
}

// waitForWithin waits up to within for cond, failing the test when the agent stops first.
func waitForWithin(t *testing.T, what string, within time.Duration, cond func() bool, done <-chan error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		select {
		case err := <-done:
			t.Fatalf("agent stopped before %s: %v", what, err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// runEnded returns Run's result, failing the test when Run has not ended within that long.
func runEnded(t *testing.T, done <-chan error, within time.Duration, what string) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(within):
		t.Fatalf("%s did not end the run within %s", what, within)
		return nil
	}
}

func TestWholeFlow(t *testing.T) {
	w := newWorld(t)
	a := w.agent(t)
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)

	if got := w.kernel.Loaded(); !slices.Equal(got, []string{"i2c_core", "ipmi_devintf", "nvidia", "nvidia_modeset", "nvidia_uvm"}) {
		t.Errorf("loaded %v: want the prerequisites (ipmi_msghandler was loaded already), then nvidia before its holders", got)
	}
	if got := w.read(t, "sys/module/nvidia/parameters/NVreg_OpenRmEnableUnsupportedGpus"); got != "1\n" {
		t.Errorf("second parameter on the conf line = %q", got)
	}
	if got := w.read(t, "container/etc/modprobe.d/nvidia.conf"); got != "options nvidia NVreg_EnableGpuFirmware=18 NVreg_OpenRmEnableUnsupportedGpus=1\n" {
		t.Errorf("modprobe.d/nvidia.conf = %q", got)
	}
	if got := w.read(t, "sys/module/nvidia/parameters/NVreg_EnableGpuFirmware"); got != "18\n" {
		t.Errorf("nvidia parameter = %q", got)
	}
	if got := w.read(t, "sys/module/firmware_class/parameters/path"); got != firmwareSearchPath {
		t.Errorf("firmware path = %q", got)
	}
	for node, want := range map[string]string{"nvidiactl": "c 195:255 0666\n", "nvidia0": "c 195:0 0666\n", "nvidia-modeset": "c 195:254 0666\n", "nvidia-uvm": "c 510:0 0666\n", "nvidia-uvm-tools": "c 510:1 0666\n"} {
		if got := w.read(t, "dev/"+node); got != want {
			t.Errorf("/dev/%s = %q, want %q", node, got, want)
		}
	}
	if got := w.mounter.Mounted(); !slices.Equal(got, []string{w.roots.InRun("nvidia/driver")}) {
		t.Errorf("mounted %v", got)
	}
	// The root becomes a slave before the rbind: a copy of a shared root is the root's peer, and
	// its unmount would take the container's own mounts with it (seen in the VM's container
	// scenarios: the teardown's files stayed on the host).
	target := w.roots.InRun("nvidia/driver")
	if got, want := w.mounter.Calls(), []string{
		"mount none " + w.roots.Sys + " rec,unbindable",
		"mount none " + w.roots.Sys + " private",
		"mount none " + w.roots.Root + " slave",
		"mount " + w.roots.Root + " " + target + " bind,rec",
	}; !slices.Equal(got, want) {
		t.Errorf("mount calls\n  %q\nwant\n  %q", got, want)
	}
	if ev := w.daemonEvents(t); !slices.Equal(ev, []string{"start", "--persistence-mode", "|"}) {
		t.Fatalf("daemon events %v, want one start with --persistence-mode", ev)
	}
	if pid := w.read(t, "container/var/run/nvidia-persistenced/nvidia-persistenced.pid"); !strings.HasSuffix(pid, "\n") {
		t.Errorf("persistenced PID file = %q", pid)
	}
	if got := w.read(t, "run/nvidia/nvidia-driver.state"); got != "digest-1" {
		t.Errorf("state = %q", got)
	}
	if got := w.read(t, "run/nvidia/nvidia-driver.pid"); strings.TrimSpace(got) != strconv.Itoa(os.Getpid()) {
		t.Errorf("pid file = %q", got)
	}
	if st := w.readStatus(t); st.Phase != PhaseWait || st.InstallPath != PathPrecompiled {
		t.Errorf("status.json: phase %q, install path %q; want wait, precompiled", st.Phase, st.InstallPath)
	}

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run after SIGTERM = %v, want nil", err)
	}
	if ev := w.daemonEvents(t); !slices.Equal(ev, []string{"start", "--persistence-mode", "|", "stop", "|"}) {
		t.Errorf("daemon events %v, want start then stop (SIGTERM)", ev)
	}
	calls := w.kernel.Calls()
	unloads := calls[5:]
	if !slices.Equal(unloads[2:], []string{"unload nvidia", "unload ipmi_devintf", "unload i2c_core"}) {
		t.Errorf("unload order %v: the holders, then nvidia, then the prerequisites this run loaded", unloads)
	}
	w.assertClean(t)
}

// TestSignalDuringEachPhase cancels as each phase starts: teardown must run only the undos
// registered so far and leave the tree as it was.
func TestSignalDuringEachPhase(t *testing.T) {
	for i, phase := range []string{PhaseDetect, PhaseDecide, PhasePrepare, PhaseLoad, PhaseDevices, PhaseDaemons, PhaseShareRoot, PhaseReady} {
		t.Run(phase, func(t *testing.T) {
			w := newWorld(t)
			a := w.agent(t)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var started []string
			a.BeforePhase = func(p string) {
				started = append(started, p)
				if p == phase {
					cancel()
				}
			}
			if err := a.Run(ctx); err != nil {
				t.Fatalf("Run = %v, want a clean stop", err)
			}
			if len(started) != i+1 {
				t.Errorf("phases started %v, want to stop at %s", started, phase)
			}
			loadedAny := slices.ContainsFunc(w.kernel.Calls(), func(c string) bool { return strings.HasPrefix(c, "load") })
			if wantLoad := i > 3; loadedAny != wantLoad {
				t.Errorf("modules loaded: %t, want %t (calls %v)", loadedAny, wantLoad, w.kernel.Calls())
			}
			if started := len(w.daemonEvents(t)) > 0; started != (i > 5) {
				t.Errorf("daemon started: %t", started)
			}
			w.assertClean(t)
		})
	}
}

func TestLockContention(t *testing.T) {
	w := newWorld(t)
	first := w.agent(t)
	cancel, done := startAgent(first)
	defer cancel()
	w.waitReady(t, done)

	second := w.agent(t)
	err := second.Run(context.Background())
	if !errors.Is(err, exitcode.ErrLockHeld) || exitcode.Code(err) != 4 {
		t.Fatalf("second instance: %v (code %d), want lock held (4)", err, exitcode.Code(err))
	}
	if w.read(t, "run/nvidia/validations/.driver-daemons-status") != "Ready" || len(w.kernel.Loaded()) != 5 {
		t.Error("the refused second instance disturbed the first")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	w.assertClean(t)
}

func TestFastPathAdoptsLoadedDriver(t *testing.T) {
	w := newWorld(t)
	w.loadedWithDigest(t, "digest-1")
	a := w.agent(t)
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	if calls := w.kernel.Calls(); len(calls) != 0 {
		t.Errorf("fast path touched the kernel: %v", calls)
	}
	if st := w.readStatus(t); st.InstallPath != PathFast {
		t.Errorf("status says install path %q, want fast", st.InstallPath)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if l := w.kernel.Loaded(); len(l) != 0 {
		t.Errorf("teardown left %v loaded", l)
	}
}

func TestReloadWhenDigestDiffers(t *testing.T) {
	w := newWorld(t)
	if err := w.kernel.Preload("nvidia", "nvidia_uvm"); err != nil {
		t.Fatal(err)
	}
	a := w.agent(t)
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	if calls := w.kernel.Calls(); !slices.Equal(calls[:2], []string{"unload nvidia_uvm", "unload nvidia"}) {
		t.Errorf("calls %v: the stale driver must be unloaded first, holders first", calls)
	}
	cancel()
	<-done
}

func TestInUseAtShutdown(t *testing.T) {
	w := newWorld(t)
	a := w.agent(t)
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	w.kernel.Use("nvidia_uvm", 1)
	cancel()
	err := <-done
	if !errors.Is(err, exitcode.ErrInUse) || exitcode.Code(err) != 10 {
		t.Fatalf("Run = %v, want in use (10)", err)
	}
	if !slices.Contains(w.kernel.Loaded(), "nvidia") {
		t.Error("nvidia was unloaded although in use")
	}
	if w.read(t, "run/nvidia/nvidia-driver.state") != "digest-1" {
		t.Error("the digest must stay while the driver stays loaded")
	}
	if st := w.readStatus(t); !strings.Contains(st.LastError, "in use") {
		t.Errorf("status.json does not keep the in-use error: last error %q", st.LastError)
	}
}

func TestLoadFailureRollsBack(t *testing.T) {
	w := newWorld(t)
	w.kernel = hosttest.NewFakeKernel(w.roots, map[string]hosttest.FakeModule{
		"nvidia":     {Version: testVersion},
		"nvidia_uvm": {Err: unix.ENODEV},
	})
	a := w.agent(t)
	err := a.Run(context.Background())
	if !errors.Is(err, exitcode.ErrNoGPU) || !strings.Contains(err.Error(), "no NVIDIA GPU") {
		t.Fatalf("Run = %v, want the no-GPU error", err)
	}
	if got := w.kernel.Calls(); !slices.Equal(got, []string{"load i2c_core", "load ipmi_devintf", "load nvidia", "load nvidia_modeset", "load nvidia_uvm", "unload nvidia_modeset", "unload nvidia", "unload ipmi_devintf", "unload i2c_core"}) {
		t.Errorf("calls %v", got)
	}
	if len(w.daemonEvents(t)) != 0 || len(w.mounter.Mounted()) != 0 {
		t.Error("phases after the failed load ran")
	}
	// The status file is kept for people to read; everything else is as before.
	os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
	w.assertClean(t)
}

func TestNoPackageMeansNoInstallPath(t *testing.T) {
	w := newWorld(t)
	// Not Flatcar, and no build tree: nothing can provide modules.
	for _, p := range []string{w.roots.InRoot("host-etc/os-release"), w.roots.InHost("usr/lib/os-release")} {
		hosttest.Must(t, os.WriteFile(p, []byte("ID=ubuntu\nVERSION_ID=24.04\n"), 0o644))
	}
	w.before = files(hosttest.Snapshot(t, w.dir))
	a := w.agent(t)
	a.Source = nil // the default: the cache, then precompiled packages in the image, of which the fixture has none
	err := a.Run(context.Background())
	if !errors.Is(err, exitcode.ErrNoInstallPath) || exitcode.Code(err) != 11 || !strings.Contains(err.Error(), "no precompiled package in") ||
		!strings.Contains(err.Error(), "set --kernel-build-tree or use an image with a precompiled package") {
		t.Fatalf("Run = %v, want prepare: no install path", err)
	}
	if calls := w.kernel.Calls(); len(calls) != 0 {
		t.Errorf("kernel calls %v", calls)
	}
	os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
	w.assertClean(t)
}

// TestCompilePathDownloadFailures: on Flatcar without a package the agent downloads the build
// tree; a release no server has fails with the download code and names the image to use, and a
// SIGTERM while the tarball streams ends the run cleanly with nothing loaded or left behind.
func TestCompilePathDownloadFailures(t *testing.T) {
	stall := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "/stall/") && strings.HasSuffix(r.URL.Path, ".tar.gz") { // no DIGESTS: insecure mode goes on
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			select {
			case <-stall:
			case <-r.Context().Done():
			}
			return
		}
		http.NotFound(w, r)
	}))
	defer srv.Close()
	defer close(stall)

	w := newWorld(t)
	a := w.agent(t, "--flatcar-release-url", srv.URL+"/{channel}/{board}/{version}/", "--insecure-skip-verify")
	a.Source = nil
	err := a.Run(context.Background())
	if !errors.Is(err, exitcode.ErrDownload) || exitcode.Code(err) != 8 || !strings.Contains(err.Error(), "precompiled image tagged "+testVersion+"-flatcar4230.2.1") {
		t.Fatalf("Run = %v, want the download code naming the image tag", err)
	}
	os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
	w.assertClean(t)

	a = w.agent(t, "--flatcar-release-url", srv.URL+"/stall/{version}/", "--insecure-skip-verify")
	a.Source = nil
	term := &hosttest.LogBuffer{}
	a.Terminal = term // as when stderr is a terminal: the download draws its bar there
	cancel, done := startAgent(a)
	waitFor(t, "the download's progress bar on the terminal", func() bool {
		return strings.Contains(term.String(), "\r0.0 MiB")
	}, done)
	cancel()
	if err := runEnded(t, done, 20*time.Second, "SIGTERM during the download"); err != nil {
		t.Fatalf("Run after SIGTERM during the download = %v, want nil", err)
	}
	if calls := w.kernel.Calls(); len(calls) != 0 {
		t.Errorf("kernel calls %v", calls)
	}
	w.assertClean(t)
}

// compileWorld is a world whose running kernel is the one Debian's installed headers are for,
// with the stand-in NVIDIA sources in the image and no precompiled package: init takes the compile
// path with a real kbuild, the headers given as --kernel-build-tree and the compiler a shell
// script that runs ccScript before gcc. work is the agent's --work-dir.
func compileWorld(t *testing.T, ccScript string) (w *world, args []string, work string) {
	t.Helper()
	release, tree, banner, err := buildtest.Kernel()
	if err != nil {
		t.Fatal(err)
	}
	w = newWorld(t)
	hosttest.Must(t, os.WriteFile(w.roots.InProc("version"), []byte(banner+"\n"), 0o644))
	hosttest.Must(t, os.WriteFile(w.roots.InProc("sys/kernel/osrelease"), []byte(release+"\n"), 0o644))
	src := w.roots.InRoot("usr/src/nvidia-"+testVersion, "kernel")
	hosttest.Must(t, os.MkdirAll(filepath.Dir(src), 0o755))
	if err := buildtest.WriteSource(context.Background(), src, tree); err != nil {
		t.Fatal(err)
	}
	work = t.TempDir()
	cc := filepath.Join(t.TempDir(), "gcc")
	if err := os.WriteFile(cc, []byte("#!/bin/sh\n"+ccScript+"\nexec gcc \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	w.before = files(hosttest.Snapshot(t, w.dir))
	return w, []string{"--kernel-build-tree", tree, "--cc", cc, "--work-dir", work}, work
}

// SIGTERM while NVIDIA's make runs (the compiler hangs on one file): the build's whole process
// group is killed, the work dir removed, nothing loaded, and the node left as it was.
func TestCompilePathSIGTERMDuringBuild(t *testing.T) {
	hanging := filepath.Join(t.TempDir(), "hanging")
	w, args, work := compileWorld(t, fmt.Sprintf(`for a in "$@"; do case "$a" in *uvm_ats.c) touch %s; sleep 600;; esac; done`, hanging))
	// Every process of the build inherits the agent's environment, so this marker finds them.
	marker := fmt.Sprintf("DRIVER_AGENT_TEST_BUILD=%d-%d", os.Getpid(), time.Now().UnixNano())
	k, v, _ := strings.Cut(marker, "=")
	t.Setenv(k, v)
	a := w.agent(t, args...)
	a.Source = nil
	cancel, done := startAgent(a)
	defer cancel()
	waitForWithin(t, "the build to reach the hanging compiler", 5*time.Minute, func() bool {
		_, err := os.Stat(hanging)
		return err == nil
	}, done)
	if len(buildtest.Processes(marker)) == 0 {
		t.Fatal("no build process seen while the build runs; the check below would prove nothing")
	}
	cancel()
	if err := runEnded(t, done, 30*time.Second, "SIGTERM during the build"); err != nil {
		t.Fatalf("Run after SIGTERM during the build = %v, want nil", err)
	}
	if left := buildtest.ProcessesLeft(marker, 20*time.Second); len(left) > 0 {
		t.Errorf("processes of the build left: %v", left)
	}
	if left, _ := os.ReadDir(work); len(left) != 0 {
		t.Errorf("the work dir keeps %v", left)
	}
	if calls := w.kernel.Calls(); len(calls) != 0 {
		t.Errorf("kernel calls %v", calls)
	}
	w.assertClean(t)
}

// A failed build: exit code 7, the error leads with the compiler's first error and names the
// build log, which outlives the work dir next to status.json; nothing loaded, nothing else left.
func TestCompilePathBuildFailure(t *testing.T) {
	w, args, work := compileWorld(t, `for a in "$@"; do case "$a" in *uvm_ats.c) echo "$a:1:1: error: stand-in compiler failure" >&2; exit 1;; esac; done`)
	a := w.agent(t, args...)
	a.Source = nil
	err := a.Run(context.Background())
	kept := w.roots.InRun("nvidia/driver-agent/build-failed.log")
	if !errors.Is(err, exitcode.ErrBuild) || exitcode.Code(err) != 7 {
		t.Fatalf("Run = %v, want the build failure code 7", err)
	}
	msg := err.Error()
	if !regexp.MustCompile(`the first errors:\n\S*uvm_ats\.c:1:1: error: stand-in compiler failure\n; the full log is ` + regexp.QuoteMeta(kept)).MatchString(msg) {
		t.Errorf("error does not lead with the compiler's error and name the kept log:\n%s", msg)
	}
	if log, err := os.ReadFile(kept); err != nil || !strings.Contains(string(log), "stand-in compiler failure") {
		t.Errorf("kept build log: %v\n%s", err, log)
	}
	if left, _ := os.ReadDir(work); len(left) != 0 {
		t.Errorf("the work dir keeps %v", left)
	}
	if calls := w.kernel.Calls(); len(calls) != 0 {
		t.Errorf("kernel calls %v", calls)
	}
	// What a failed run keeps: status.json with the error, and the log. The next build removes it.
	st := w.read(t, "run/nvidia/driver-agent/status.json")
	if !strings.Contains(st, "stand-in compiler failure") {
		t.Errorf("status.json does not carry the error: %s", st)
	}
	os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
	os.Remove(kept)
	w.assertClean(t)
}

// slowStoreSource is a fakeSource whose background cache store does not end; waiting gets a
// value each time the agent starts waiting for it.
type slowStoreSource struct {
	fakeSource
	waiting chan struct{}
}

func (s slowStoreSource) Wait(ctx context.Context) error {
	select {
	case s.waiting <- struct{}{}:
	default:
	}
	<-ctx.Done()
	return ctx.Err()
}

// Ready waits for the cache store; a store still running at the teardown's deadline leaves the
// work dir and says so instead of holding the teardown past it.
func TestCacheStoreHoldsReadyNotTeardown(t *testing.T) {
	w := newWorld(t)
	work := t.TempDir()
	a := w.agent(t, "--work-dir", work)
	src := slowStoreSource{fakeSource{dir: t.TempDir()}, make(chan struct{}, 1)}
	a.Source = src
	cancel, done := startAgent(a)
	select {
	case <-src.waiting:
	case err := <-done:
		t.Fatalf("the agent stopped before waiting for the store: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not wait for the store")
	}
	// The agent is held in Wait, so status.json, at most statusEvery behind, must come to say so.
	waitFor(t, "status.json to show the ready phase while the store runs", func() bool {
		return strings.Contains(w.read(t, "run/nvidia/driver-agent/status.json"), `"phase": "ready"`)
	}, done)
	if got := w.read(t, "run/nvidia/validations/.driver-daemons-status"); got != "NotReady" {
		t.Fatalf("the operator's file says %q while the store runs, want NotReady", got)
	}
	cancel()
	// The teardown's deadline is 2s; far longer means it waited for the store.
	if err := runEnded(t, done, 20*time.Second, "SIGTERM with a store that never ends"); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "work dir "+work) {
		t.Fatalf("Run = %v, want the work dir left at the deadline", err)
	}
	if l := w.kernel.Loaded(); len(l) != 0 {
		t.Errorf("modules still loaded: %v", l)
	}
	if m := w.mounter.Mounted(); len(m) != 0 {
		t.Errorf("still mounted: %v", m)
	}
}

// writePackage puts a precompiled package of complete stand-in modules (type-1 records, so no
// linker is needed) for banner into the image's precompiled directory.
func writePackage(t *testing.T, r host.Roots, name, banner string) string {
	t.Helper()
	p := &precompiled.Package{DriverVersion: testVersion, Description: "test", ProcVersion: banner}
	for mod, dep := range map[string]string{"nvidia": "", "nvidia-uvm": "nvidia", "nvidia-modeset": "nvidia"} {
		f, err := precompiled.NewKernelModule(mod+".ko", "", hosttest.ModuleELF("name="+strings.ReplaceAll(mod, "-", "_"), "version="+testVersion, "depends="+dep), false)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Append(f); err != nil {
			t.Fatal(err)
		}
	}
	data, err := p.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	dir := r.InRoot("usr/src/nvidia-"+testVersion, "kernel/precompiled")
	hosttest.Must(t, os.MkdirAll(dir, 0o755))
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestPrecompiledThenCached runs the default source for real: the matching package is chosen
// over one for another kernel, its modules land in the cache, the next start uses the cache,
// and a damaged cache entry is removed and rebuilt from the package.
func TestPrecompiledThenCached(t *testing.T) {
	w := newWorld(t)
	banner, err := os.ReadFile(w.roots.InProc("version"))
	hosttest.Must(t, err)
	writePackage(t, w.roots, "nvidia-modules-other", "Linux version 6.6.94-flatcar (build@pony) #1 SMP")
	writePackage(t, w.roots, "nvidia-modules-6.6.95", strings.SplitN(string(banner), "\n", 2)[0])
	w.before = files(hosttest.Snapshot(t, w.dir))
	cacheDir := filepath.Join(t.TempDir(), "cache")
	var counts []string // cache hits and misses of each start, from its /metrics
	start := func() string {
		a := w.agent(t, "--cache-dir", cacheDir)
		a.Source = nil
		addr := make(chan string, 1)
		a.OnListen = func(s string) { addr <- s }
		cancel, done := startAgent(a)
		defer cancel()
		w.waitReady(t, done)
		if entries, _ := filepath.Glob(filepath.Join(cacheDir, "*", "manifest.json")); len(entries) != 1 {
			t.Errorf("cache entries at Ready: %v, want one (Ready waits for the store)", entries)
		}
		at := <-addr
		k := &phaseKernel{t: t, addr: func() string { return at }}
		m := k.scrape()["/metrics"]
		counts = append(counts, regexp.MustCompile(`driver_agent_cache_(hits|misses)_total \d+`).FindAllString(m, -1)...)
		st := w.read(t, "run/nvidia/driver-agent/status.json")
		if got := w.kernel.Loaded(); !slices.Contains(got, "nvidia_uvm") || !slices.Contains(got, "nvidia_modeset") {
			t.Errorf("loaded %v", got)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		return st
	}
	if st := start(); !strings.Contains(st, `"installPath": "precompiled"`) || !strings.Contains(st, "nvidia-modules-6.6.95") {
		t.Fatalf("first start: %s", st)
	}
	if st := start(); !strings.Contains(st, `"installPath": "cached"`) {
		t.Fatalf("second start did not use the cache: %s", st)
	}
	// Damage the cached nvidia.ko: the entry is removed and the package used again.
	mods, _ := filepath.Glob(filepath.Join(cacheDir, "*", "modules", "nvidia.ko"))
	if len(mods) != 1 {
		t.Fatalf("cached modules %v", mods)
	}
	data, err := os.ReadFile(mods[0])
	hosttest.Must(t, err)
	data[len(data)-1] ^= 0xff
	hosttest.Must(t, os.WriteFile(mods[0], data, 0o644))
	if st := start(); !strings.Contains(st, `"installPath": "precompiled"`) {
		t.Fatalf("damaged cache entry was used: %s", st)
	}
	if st := start(); !strings.Contains(st, `"installPath": "cached"`) {
		t.Fatalf("the cache was not rebuilt: %s", st)
	}
	want := []string{"driver_agent_cache_hits_total 0", "driver_agent_cache_misses_total 1", "driver_agent_cache_hits_total 1", "driver_agent_cache_misses_total 0",
		"driver_agent_cache_hits_total 0", "driver_agent_cache_misses_total 1", "driver_agent_cache_hits_total 1", "driver_agent_cache_misses_total 0"}
	if !slices.Equal(counts, want) {
		t.Errorf("cache counters per start %q, want %q", counts, want)
	}
	w.assertClean(t)
}

func TestDaemonDeathEndsReadiness(t *testing.T) {
	w := newWorld(t)
	a := w.agent(t)
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	pid, err := strconv.Atoi(strings.TrimSpace(w.read(t, "container/var/run/nvidia-persistenced/nvidia-persistenced.pid")))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("FAKE_DAEMON_CRASH", "1") // every restart fails at once: the crash-loop limit ends it
	syscall.Kill(pid, syscall.SIGKILL)
	err = <-done
	if !errors.Is(err, exitcode.ErrDaemon) || !strings.Contains(err.Error(), "nvidia-persistenced") {
		t.Fatalf("Run = %v, want daemon failure naming nvidia-persistenced", err)
	}
	if ev := strings.Join(w.daemonEvents(t), " "); strings.Count(ev, "crash") != 2 {
		t.Errorf("daemon events %q: want the two restarts the policy allows", ev)
	}
	os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
	os.Remove(w.roots.InRoot("var/run/nvidia-persistenced/nvidia-persistenced.pid")) // left by the SIGKILL, as a real crash would
	w.assertClean(t)
}

func TestDryRunChangesNothing(t *testing.T) {
	w := newWorld(t)
	a := w.agent(t, "--dry-run")
	rec := &host.Recorder{}
	a.Recorder, a.Host = rec, host.DryRun(w.roots, rec)
	var out strings.Builder
	a.Out = &out
	if err := a.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.assertClean(t)
	plan := out.String()
	for _, want := range []string{"Install path: precompiled", "1 NVIDIA GPU(s): 0000:3b:00.0", "load-module nvidia (finit_module", "NVreg_EnableGpuFirmware=18",
		"mknod " + w.roots.InDev("nvidia0") + " (c 195:0 0666)", "exec " + w.roots.InRoot("usr/bin/nvidia-persistenced") + " (--persistence-mode)", "mount " + w.roots.InRun("nvidia/driver"), "channel stable",
		"kernel/drivers/video/nvidia.ko (to <precompiled>/nvidia.ko)", "write " + w.roots.InRoot("lib/modules/6.6.95-flatcar/modules.dep.bin")} {
		if !strings.Contains(plan, want) {
			t.Errorf("plan lacks %q:\n%s", want, plan)
		}
	}
	// The agent's own account of the run is not a change to the node.
	for _, own := range []string{"status.json", "journal.json"} {
		if strings.Contains(plan, own) {
			t.Errorf("the plan lists %s:\n%s", own, plan)
		}
	}
	// The teardown unloads what the plan loads (nothing is really loaded), holders first.
	if !regexp.MustCompile(`(?s)On SIGTERM:.*unload-module nvidia_modeset\n.*unload-module nvidia_uvm\n.*unload-module nvidia\n`).MatchString(plan) {
		t.Errorf("the plan's teardown does not unload modeset, uvm, nvidia in that order:\n%s", plan)
	}
}

// TestDryRunWithoutTheDriver: on a node where no NVIDIA driver is loaded the device nodes'
// majors are unknown: the plan says which nodes would be made, and plans no mknod.
func TestDryRunWithoutTheDriver(t *testing.T) {
	w := newWorld(t)
	hosttest.Must(t, os.RemoveAll(w.roots.InProc("driver/nvidia")))
	w.before = files(hosttest.Snapshot(t, w.dir))
	a := w.agent(t, "--dry-run")
	rec := &host.Recorder{}
	a.Recorder, a.Host = rec, host.DryRun(w.roots, rec)
	var out strings.Builder
	a.Out = &out
	if err := a.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	plan := out.String()
	if want := "devices: once the driver is loaded, would create " + w.roots.Dev + "/nvidiactl"; !strings.Contains(plan, want) {
		t.Errorf("plan lacks %q:\n%s", want, plan)
	}
	if strings.Contains(plan, "mknod") || !strings.Contains(plan, "load-module nvidia ") {
		t.Errorf("the plan makes device nodes, or loads no driver:\n%s", plan)
	}
	w.assertClean(t)
}

func TestHostManagedDriver(t *testing.T) {
	w := newHostWorld(t)

	// The image's version differs from what the host loaded: a clear refusal, nothing touched.
	err := w.agent(t, "--host-modules-timeout", "0s").Run(context.Background())
	if !errors.Is(err, exitcode.ErrHostDriver) || !strings.Contains(err.Error(), "the host loaded nvidia 570.148.08, the image has 535.309.01") {
		t.Fatalf("Run = %v", err)
	}
	os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
	w.assertClean(t)

	a := w.agent(t)
	a.Config.DriverVersion = "570.148.08"
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if calls := w.kernel.Calls(); len(calls) != 0 {
		t.Errorf("host mode touched the kernel: %v", calls)
	}
	if _, err := os.Stat(w.roots.InRun("nvidia/nvidia-driver.state")); !os.IsNotExist(err) {
		t.Error("host mode stored a digest")
	}
}

// TestHostManagedDriverWithoutModuleUnload: on a kernel built without CONFIG_MODULE_UNLOAD
// /sys/module/nvidia has no refcnt (seen on a node with an H200, driver 580.159.04); the host's
// driver is still found loaded and the agent gets Ready at once.
func TestHostManagedDriverWithoutModuleUnload(t *testing.T) {
	w := newHostWorld(t)
	hosttest.Must(t, w.kernel.WithoutModuleUnload())
	a := w.agent(t, "--host-modules-timeout", "1m")
	a.Config.DriverVersion = "570.148.08"
	log := w.runToReady(t, a)
	log.inOrder(t, "detected node", "using the host's NVIDIA driver", "Done, now waiting for signal")
	if slices.Contains(log.msgs, "waiting for the host to load the NVIDIA driver") {
		t.Errorf("the agent waited for the host's driver, which is loaded:\n%s", strings.Join(log.msgs, "\n"))
	}
	if _, err := os.Stat(w.roots.InRun("nvidia/driver-agent")); !os.IsNotExist(err) {
		t.Errorf("a clean stop left %s: %v", w.roots.InRun("nvidia/driver-agent"), err)
	}
	if calls := w.kernel.Calls(); len(calls) != 0 {
		t.Errorf("host mode touched the kernel: %v", calls)
	}
}

// With the host managing the driver and nvidia never loaded, the agent waits --host-modules-timeout
// on its clock, polling every second and logging every 30s, then refuses with exit 8.
func TestHostDriverWaitUsesTheClock(t *testing.T) {
	w := newHostWorld(t)
	if err := os.RemoveAll(w.roots.InSys("module/nvidia")); err != nil {
		t.Fatal(err)
	}
	a := w.agent(t, "--host-modules-timeout", "2m")
	var logBuf hosttest.LogBuffer
	a.Log = slog.New(slog.NewTextHandler(&logBuf, nil))
	start := time.Unix(1_800_000_000, 0)
	clock := daemontest.NewInstant(start)
	a.Clock = clock
	err := a.Run(context.Background())
	if !errors.Is(err, exitcode.ErrHostDriver) || !strings.Contains(err.Error(), "nvidia is not loaded after 2m0s") {
		t.Fatalf("Run = %v, want the host-driver refusal after 2m0s", err)
	}
	if waited := clock.Now().Sub(start); waited <= 2*time.Minute || waited > 2*time.Minute+time.Second {
		t.Errorf("the wait took %s on the clock, want just over 2m0s", waited)
	}
	for _, d := range clock.Waits() {
		if d != time.Second {
			t.Fatalf("a wait of %s, want 1s polls: %v", d, clock.Waits())
		}
	}
	if n := strings.Count(logBuf.String(), "waiting for the host to load the NVIDIA driver"); n != 4 {
		t.Errorf("%d waiting lines in 2m, want 4 (every 30s):\n%s", n, logBuf.String())
	}
	if calls := w.kernel.Calls(); len(calls) != 0 {
		t.Errorf("host mode touched the kernel: %v", calls)
	}
}

// TestDryRunHostManagedDriver: on a host-managed node the dry run's load looks once for the
// host's driver: a note when none is loaded (no wait, the clock does not move), the refusal as a
// note when the host's version differs, and nothing planned for the kernel either way.
func TestDryRunHostManagedDriver(t *testing.T) {
	for _, tc := range []struct {
		name, version, want string
		unloaded            bool
	}{
		{"not loaded", "570.148.08", "load: would wait up to 5m0s for the host to load nvidia", true},
		{"another version", "535.309.01", "load: would fail: ", false},
		{"the image's version", "570.148.08", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newHostWorld(t)
			if tc.unloaded {
				hosttest.Must(t, os.RemoveAll(w.roots.InSys("module/nvidia")))
			}
			a := w.agent(t, "--dry-run", "--host-modules-timeout", "5m")
			a.Config.DriverVersion = tc.version
			start := time.Unix(1_800_000_000, 0)
			plan, clock := planText(t, a)
			if tc.want != "" && !strings.Contains(plan, tc.want) {
				t.Errorf("plan lacks %q:\n%s", tc.want, plan)
			}
			if tc.want == "" && strings.Contains(plan, "load: would") {
				t.Errorf("the plan notes the load although the host's driver is there:\n%s", plan)
			}
			if strings.Contains(plan, "load-module") || strings.Contains(plan, "unload-module") {
				t.Errorf("the plan touches the kernel on a host-managed node:\n%s", plan)
			}
			if waited := clock.Now().Sub(start); waited != 0 {
				t.Errorf("the dry run waited %s on the clock", waited)
			}
		})
	}
}

// phaseKernel scrapes the agent's endpoints when a module is first loaded (the load phase is
// running) and when one is first unloaded (teardown has begun).
type phaseKernel struct {
	*hosttest.FakeKernel
	addr               func() string
	events             func() []string
	daemonsAtUnload    string
	duringLoad, inTear map[string]string
	t                  *testing.T
}

func (k *phaseKernel) scrape() map[string]string {
	out := map[string]string{}
	for _, path := range []string{"/metrics", "/readyz"} {
		resp, err := http.Get("http://" + k.addr() + path)
		if err != nil {
			k.t.Errorf("GET %s: %v", path, err)
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		out[path] = fmt.Sprintf("%d %s", resp.StatusCode, body)
	}
	return out
}

func (k *phaseKernel) LoadModule(m host.ModuleImage) error {
	if k.duringLoad == nil {
		k.duringLoad = k.scrape()
	}
	return k.FakeKernel.LoadModule(m)
}

func (k *phaseKernel) UnloadModule(name string) error {
	if k.inTear == nil {
		k.inTear = k.scrape()
		k.daemonsAtUnload = strings.Join(k.events(), " ")
	}
	return k.FakeKernel.UnloadModule(name)
}

// TestMetricsFollowTheRun scrapes the real server of a running agent: the phase while loading,
// /readyz 503 until Ready, 200 at Ready and 503 again once teardown starts, and promtool accepts
// the exposition. It also checks the teardown order: the daemons are stopped before the first
// module is unloaded.
func TestMetricsFollowTheRun(t *testing.T) {
	w := newWorld(t)
	a := w.agent(t)
	var mu sync.Mutex
	var addr string
	a.OnListen = func(s string) { mu.Lock(); addr = s; mu.Unlock() }
	k := &phaseKernel{FakeKernel: w.kernel, t: t, addr: func() string { mu.Lock(); defer mu.Unlock(); return addr },
		events: func() []string { return w.daemonEvents(t) }}
	a.Host.Kernel = k
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	ready := k.scrape()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if m := k.duringLoad["/metrics"]; !strings.Contains(m, `driver_agent_phase{phase="load"} 1`) || !strings.HasPrefix(k.duringLoad["/readyz"], "503") {
		t.Errorf("during the load: /readyz %q, metrics:\n%s", k.duringLoad["/readyz"], m)
	}
	if !strings.HasPrefix(ready["/readyz"], "200") || !strings.Contains(ready["/metrics"], "driver_agent_ready 1") ||
		!strings.Contains(ready["/metrics"], `driver_agent_module_loaded{module="nvidia",version="535.309.01"} 1`) ||
		!strings.Contains(ready["/metrics"], `driver_agent_daemon_up{daemon="nvidia-persistenced"} 1`) {
		t.Errorf("at Ready: /readyz %q, metrics:\n%s", ready["/readyz"], ready["/metrics"])
	}
	if !strings.HasPrefix(k.inTear["/readyz"], "503") || !strings.Contains(k.inTear["/metrics"], `driver_agent_phase{phase="teardown"} 1`) {
		t.Errorf("in teardown: /readyz %q", k.inTear["/readyz"])
	}
	if !strings.Contains(k.daemonsAtUnload, "stop") {
		t.Errorf("daemon events when the first module was unloaded: %q; the daemons must stop first", k.daemonsAtUnload)
	}
	promtool := exec.Command("promtool", "check", "metrics")
	promtool.Stdin = strings.NewReader(strings.SplitN(ready["/metrics"], " ", 2)[1])
	if out, err := promtool.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics on the agent's scrape: %v\n%s", err, out)
	}
}

func TestLoadDRMDefaultsModeset(t *testing.T) {
	w := newWorld(t)
	a := w.agent(t, "--load-drm")
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	if got := w.read(t, "sys/module/nvidia_drm/parameters/modeset"); got != "1\n" {
		t.Errorf("nvidia_drm modeset = %q, want 1 by default with --load-drm", got)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	w2 := newWorld(t)
	a2 := w2.agent(t, "--load-drm", "--module-param", "nvidia-drm.modeset=0")
	cancel2, done2 := startAgent(a2)
	defer cancel2()
	w2.waitReady(t, done2)
	if got := w2.read(t, "sys/module/nvidia_drm/parameters/modeset"); got != "0\n" {
		t.Errorf("nvidia_drm modeset = %q: the user's value must win", got)
	}
	cancel2()
	<-done2
}

// TestFirmwareOffLeavesThePathAlone: NVreg_EnableGpuFirmware=0 anywhere on a conf line keeps the
// kernel's firmware search path untouched (the script only saw it alone on a line).
func TestFirmwareOffLeavesThePathAlone(t *testing.T) {
	w := newWorld(t)
	hosttest.Must(t, os.WriteFile(w.roots.InDrivers("nvidia.conf"), []byte("NVreg_OpenRmEnableUnsupportedGpus=1 NVreg_EnableGpuFirmware=0\n"), 0o644))
	w.before = files(hosttest.Snapshot(t, w.dir))
	cancel, done := startAgent(w.agent(t))
	defer cancel()
	w.waitReady(t, done)
	if got := w.read(t, "sys/module/firmware_class/parameters/path"); got != "\n" {
		t.Errorf("firmware path = %q, want it untouched", got)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestGSPFirmwareInstalledBeforeLoad: the image's copy of the GSP firmware reaches
// <root>/lib/firmware/nvidia/<version> (the host directory the kernel reads) before nvidia loads,
// and teardown removes what it copied once nvidia is gone.
func TestGSPFirmwareInstalledBeforeLoad(t *testing.T) {
	w := newWorld(t)
	src := w.roots.InRoot(imageFirmwareDir, testVersion)
	hosttest.Must(t, os.MkdirAll(src, 0o755))
	hosttest.Must(t, os.WriteFile(filepath.Join(src, "gsp_ga10x.bin"), bytes.Repeat([]byte{0xa5}, 1<<20), 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(src, "gsp_tu10x.bin"), []byte("tu10x"), 0o644))
	// A file already there with the same size is kept as it is.
	dst := w.roots.InRoot("lib/firmware/nvidia", testVersion)
	hosttest.Must(t, os.MkdirAll(dst, 0o755))
	hosttest.Must(t, os.WriteFile(filepath.Join(dst, "gsp_tu10x.bin"), []byte("TU10X"), 0o644))
	w.before = files(hosttest.Snapshot(t, w.dir))
	var atLoad []string
	a := w.agent(t)
	a.Host.Kernel = loadHook{w.kernel, func(name string) {
		if name == "nvidia" {
			entries, _ := os.ReadDir(dst)
			for _, e := range entries {
				atLoad = append(atLoad, e.Name())
			}
		}
	}}
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	if !slices.Equal(atLoad, []string{"gsp_ga10x.bin", "gsp_tu10x.bin"}) {
		t.Errorf("firmware when nvidia loaded: %v", atLoad)
	}
	if got := w.read(t, "container/lib/firmware/nvidia/"+testVersion+"/gsp_tu10x.bin"); got != "TU10X" {
		t.Errorf("existing firmware file replaced: %q", got)
	}
	if got := w.read(t, "container/lib/firmware/nvidia/"+testVersion+"/gsp_ga10x.bin"); len(got) != 1<<20 {
		t.Errorf("copied firmware has %d bytes", len(got))
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	w.assertClean(t)
}

// loadHook calls before ahead of every module load.
type loadHook struct {
	*hosttest.FakeKernel
	before func(name string)
}

func (k loadHook) LoadModule(m host.ModuleImage) error {
	k.before(m.Name)
	return k.FakeKernel.LoadModule(m)
}

// TestStatusFollowsDaemonCrash: status.json shows a daemon that crashed while the agent waits
// (before the restart policy gives up), not only the state at the last phase change.
func TestStatusFollowsDaemonCrash(t *testing.T) {
	w := newWorld(t)
	a := w.agent(t)
	a.DaemonPolicy = daemon.Policy{InitialBackoff: time.Minute, MaxBackoff: time.Minute, MaxRestarts: 100} // nothing else happens for a minute
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	if st := w.read(t, "run/nvidia/driver-agent/status.json"); !strings.Contains(st, `"state": "up"`) {
		t.Fatalf("status at Ready: %s", st)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(w.read(t, "container/var/run/nvidia-persistenced/nvidia-persistenced.pid")))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("FAKE_DAEMON_CRASH", "1")
	syscall.Kill(pid, syscall.SIGKILL)
	waitFor(t, "status.json to show the crash", func() bool {
		st := w.read(t, "run/nvidia/driver-agent/status.json")
		return strings.Contains(st, `"name": "nvidia-persistenced"`) && !strings.Contains(st, `"state": "up"`)
	}, done)
	cancel()
	<-done
}

// TestStaleWorkDirsRemoved: with --work-dir, work dirs that killed agents left behind are removed
// at the next start (the node lock makes them nobody's), and the run's own goes at teardown.
func TestStaleWorkDirsRemoved(t *testing.T) {
	w := newWorld(t)
	work := t.TempDir()
	hosttest.Must(t, os.MkdirAll(filepath.Join(work, "driver-agent-1234", "compile", "build"), 0o700))
	hosttest.Must(t, os.WriteFile(filepath.Join(work, "keep-me"), []byte("x"), 0o644))
	cancel, done := startAgent(w.agent(t, "--work-dir", work))
	defer cancel()
	w.waitReady(t, done)
	if _, err := os.Stat(filepath.Join(work, "driver-agent-1234")); !os.IsNotExist(err) {
		t.Errorf("stale work dir still there: %v", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	left, _ := filepath.Glob(filepath.Join(work, "*"))
	if len(left) != 1 || filepath.Base(left[0]) != "keep-me" {
		t.Errorf("work dir holds %v after teardown", left)
	}
}

// A Flatcar node with the driver's system extension merged: the plan, the log and the status
// take the host-managed path and name the extension, with --modules=auto and --modules=host.
func TestDryRunDriverExtension(t *testing.T) {
	name := "nvidia-driver-" + testVersion + "-flatcar4230.2.1"
	for _, modules := range []string{"auto", "host"} {
		t.Run(modules, func(t *testing.T) {
			w := newWorld(t)
			rel := w.roots.InHost("usr/lib/extension-release.d/extension-release." + name)
			hosttest.Must(t, os.MkdirAll(filepath.Dir(rel), 0o755))
			if err := os.WriteFile(rel, []byte("ID=flatcar\nVERSION_ID=4230.2.1\nARCHITECTURE=x86-64\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			w.before = files(hosttest.Snapshot(t, w.dir))
			a := w.agent(t, "--dry-run", "--modules", modules, "--host-modules-timeout", "0s")
			rec := &host.Recorder{}
			a.Recorder, a.Host = rec, host.DryRun(w.roots, rec)
			var out, log strings.Builder
			a.Out, a.Log = &out, slog.New(slog.NewTextHandler(&log, nil))
			a.Run(context.Background()) // nvidia is not loaded: the host-managed path fails; the plan is printed
			provides := "the system extension " + name + " (driver " + testVersion + ", /usr/lib/extension-release.d/extension-release." + name + ") provides the driver"
			plan := out.String()
			for _, want := range []string{"Install path: host", "host driver   " + provides, "why:    " + map[string]string{"auto": "", "host": "--modules=host: the host loads the NVIDIA modules; "}[modules] + provides} {
				if !strings.Contains(plan, want) {
					t.Errorf("plan lacks %q:\n%s", want, plan)
				}
			}
			if !strings.Contains(log.String(), "path=host reason=\""+map[string]string{"auto": "", "host": "--modules=host: the host loads the NVIDIA modules; "}[modules]+provides) {
				t.Errorf("the log does not name the extension:\n%s", log.String())
			}
			if calls := w.kernel.Calls(); len(calls) != 0 {
				t.Errorf("the kernel was touched: %v", calls)
			}
		})
	}
}

// unreadableSource is fakeSource with nvidia-uvm.ko not a kernel module.
type unreadableSource struct{ fakeSource }

func (s unreadableSource) Prepare(ctx context.Context, d Decision, workDir string) ([]host.ModuleImage, error) {
	images, err := s.fakeSource.Prepare(ctx, d, workDir)
	if err == nil {
		err = os.WriteFile(filepath.Join(s.dir, "nvidia-uvm.ko"), []byte("not an ELF object"), 0o644)
	}
	return images, err
}

// TestUnreadableModuleKeepsTheLoadedDriver: the new modules are read before a driver of another
// configuration is unloaded, so a module that cannot be read fails the start with the old driver
// still loaded and in place.
func TestUnreadableModuleKeepsTheLoadedDriver(t *testing.T) {
	w := newWorld(t)
	hosttest.Must(t, w.kernel.Preload("nvidia", "nvidia_uvm"))
	a := w.agent(t)
	a.Source = unreadableSource{fakeSource{dir: t.TempDir()}}
	err := a.Run(context.Background())
	if !errors.Is(err, exitcode.ErrModuleLoad) || !strings.Contains(err.Error(), "nvidia-uvm.ko") {
		t.Fatalf("Run = %v, want a module load error naming nvidia-uvm.ko", err)
	}
	if calls := w.kernel.Calls(); len(calls) > 0 {
		t.Errorf("kernel calls %v, want none: the loaded driver must stay", calls)
	}
	if got := w.kernel.Loaded(); !slices.Equal(got, []string{"nvidia", "nvidia_uvm"}) {
		t.Errorf("loaded %v, want the old driver", got)
	}
}
