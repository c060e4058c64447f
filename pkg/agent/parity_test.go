package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/peermem"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
	"github.com/driver-agent/driver-agent/pkg/status"
)

// TestFastPathDigestWrittenByScript: NVIDIA's script stores the digest with echo, a trailing
// newline included; the agent that replaces it must still take the fast path.
func TestFastPathDigestWrittenByScript(t *testing.T) {
	w := newWorld(t)
	w.loadedWithDigest(t, "digest-1\n")
	cancel, done := startAgent(w.agent(t))
	defer cancel()
	w.waitReady(t, done)
	if calls := w.kernel.Calls(); len(calls) != 0 {
		t.Errorf("a digest stored with a newline did not take the fast path: %v", calls)
	}
	if !strings.Contains(w.read(t, "run/nvidia/driver-agent/status.json"), `"installPath": "fast"`) {
		t.Error("status does not say fast path")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestCtrReadyRemovedWhenAgentStopsOnItsOwn: the operator's startup probe writes
// .driver-ctr-ready and only the pod's preStop removes it; an agent that ends by itself after
// Ready (here: its daemon crash-loops) must not leave it behind.
func TestCtrReadyRemovedWhenAgentStopsOnItsOwn(t *testing.T) {
	w := newWorld(t)
	cancel, done := startAgent(w.agent(t))
	defer cancel()
	w.waitReady(t, done)
	ctrReady := w.roots.InRun("nvidia/validations/.driver-ctr-ready")
	if err := os.WriteFile(ctrReady, []byte("GDRCOPY_ENABLED: false\nGDS_ENABLED: false\nGPU_DIRECT_RDMA_ENABLED: false\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(w.read(t, "container/var/run/nvidia-persistenced/nvidia-persistenced.pid")))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("FAKE_DAEMON_CRASH", "1")
	syscall.Kill(pid, syscall.SIGKILL)
	if err := <-done; !errors.Is(err, exitcode.ErrDaemon) {
		t.Fatalf("Run = %v, want a daemon failure", err)
	}
	if _, err := os.Stat(ctrReady); !errors.Is(err, os.ErrNotExist) {
		t.Errorf(".driver-ctr-ready left behind after the agent stopped (stat: %v)", err)
	}
}

// setGPUs replaces the fixture's NVIDIA GPU with GPUs of these PCI device IDs.
func (w *world) setGPUs(t *testing.T, devices ...string) {
	t.Helper()
	hosttest.Must(t, os.RemoveAll(w.roots.InSys("bus/pci/devices/0000:3b:00.0")))
	for i, dev := range devices {
		dir := w.roots.InSys("bus/pci/devices", fmt.Sprintf("0000:%02x:00.0", 0x41+i))
		hosttest.Must(t, os.MkdirAll(dir, 0o755))
		for name, v := range map[string]string{"vendor": "0x10de", "device": dev, "class": "0x030200", "subsystem_vendor": "0x10de", "subsystem_device": "0x1234"} {
			if err := os.WriteFile(filepath.Join(dir, name), []byte(v+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// installSupportedGPUs puts the driver's list of supported GPUs where the image keeps it.
func (w *world) installSupportedGPUs(t *testing.T, version string) {
	t.Helper()
	data, err := os.ReadFile("../flavor/testdata/supported-gpus.json")
	if err != nil {
		t.Fatal(err)
	}
	p := w.roots.InRoot("usr/src/nvidia-"+version, "supported-gpus/supported-gpus.json")
	hosttest.Must(t, os.MkdirAll(filepath.Dir(p), 0o755))
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// dryRunPlan runs a dry run and returns its JSON plan.
func (w *world) dryRunPlan(t *testing.T, log *messages, args ...string) (Plan, error) {
	t.Helper()
	a := w.agent(t, append([]string{"--dry-run", "--output", "json"}, args...)...)
	if log != nil {
		a.Log = slog.New(log)
	}
	rec := &host.Recorder{}
	a.Recorder, a.Host = rec, host.DryRun(w.roots, rec)
	var out strings.Builder
	a.Out = &out
	runErr := a.Run(context.Background())
	var p Plan
	if err := json.Unmarshal([]byte(out.String()), &p); err != nil {
		t.Fatalf("plan: %v\n%s", err, out.String())
	}
	return p, runErr
}

// TestFlavorFromGPUs: KERNEL_MODULE_TYPE=auto decides by the node's GPUs and the driver's
// supported-gpus.json, not by the branch alone (which would say open for 580 on every node).
func TestFlavorFromGPUs(t *testing.T) {
	const v580 = "580.95.05"
	for _, tc := range []struct {
		name    string
		devices []string
		version string
		flavor  string
		reason  string
	}{
		{name: "pre-Turing", devices: []string{"0x1db4", "0x1db4"}, version: v580, flavor: "kernel", reason: "the open modules do not support 0000:41:00.0 [10de:1db4] Tesla V100-PCIE-16GB, 0000:42:00.0 [10de:1db4]"},
		{name: "Turing+", devices: []string{"0x1eb8", "0x2330"}, version: v580, flavor: "kernel-open", reason: "all 2 GPU(s) support both flavours, and branch 580 defaults to the open modules"},
		{name: "mixed", devices: []string{"0x2330", "0x1db6"}, version: v580, flavor: "kernel", reason: "the open modules do not support 0000:42:00.0 [10de:1db6] Tesla V100-PCIE-32GB"},
		{name: "self-hosted on an old branch", devices: []string{"0x2342"}, version: testVersion, flavor: "kernel-open", reason: "the open modules are required by 0000:41:00.0 [10de:2342] NVIDIA GH200 120GB"},
		{name: "no GPU", version: v580, flavor: "kernel-open", reason: "no NVIDIA GPU on the PCI bus: the branch rule, branch 580 >= 560 defaults to open modules"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			w.setGPUs(t, tc.devices...)
			w.installSupportedGPUs(t, tc.version)
			w.before = files(hosttest.Snapshot(t, w.dir))
			log := &messages{}
			p, err := w.dryRunPlan(t, log, "--driver-version", tc.version)
			if err != nil {
				t.Fatal(err)
			}
			if p.Decision.Flavor != tc.flavor || !strings.Contains(p.Decision.FlavorReason, tc.reason) {
				t.Errorf("flavour %s (%s); want %s because %q", p.Decision.Flavor, p.Decision.FlavorReason, tc.flavor, tc.reason)
			}
			if !slices.ContainsFunc(log.attrs, func(a string) bool { return strings.HasPrefix(a, "flavor_reason=") && strings.Contains(a, tc.reason) }) {
				t.Errorf("the log does not give the flavour's reason %q:\n%s", tc.reason, strings.Join(log.attrs, "\n"))
			}
			w.assertClean(t)
		})
	}
}

// TestNoFlavorForTheseGPUs: a GPU only a legacy branch drives, or GPUs that need the open
// modules next to GPUs without open support, stop init before anything is loaded.
func TestNoFlavorForTheseGPUs(t *testing.T) {
	for name, devices := range map[string][]string{"legacy": {"0x2330", "0x1023"}, "conflict": {"0x2342", "0x1db4"}} {
		t.Run(name, func(t *testing.T) {
			w := newWorld(t)
			w.setGPUs(t, devices...)
			w.installSupportedGPUs(t, testVersion)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // an agent that gets Ready stops here
			defer cancel()
			err := w.agent(t).Run(ctx)
			if !errors.Is(err, exitcode.ErrNoGPU) || !strings.Contains(err.Error(), "no kernel module flavour of this driver supports every GPU") {
				t.Fatalf("Run = %v, want exit 5 naming the GPUs no flavour supports", err)
			}
			if calls := w.kernel.Calls(); len(calls) != 0 {
				t.Errorf("modules touched: %v", calls)
			}
		})
	}
}

// TestFlavorWithoutSupportedGPUs: an image without the list falls back to the branch, saying so.
func TestFlavorWithoutSupportedGPUs(t *testing.T) {
	w := newWorld(t)
	p, err := w.dryRunPlan(t, nil, "--driver-version", "580.95.05")
	if err != nil {
		t.Fatal(err)
	}
	if p.Decision.Flavor != "kernel-open" || !strings.Contains(p.Decision.FlavorReason, "without the driver's list of supported GPUs") {
		t.Errorf("flavour %s (%s)", p.Decision.Flavor, p.Decision.FlavorReason)
	}
	if !strings.Contains(strings.Join(p.Notes, "\n"), "has no supported-gpus.json") {
		t.Errorf("the plan does not say the list is missing: %q", p.Notes)
	}
}

// writePeermemPackage writes a precompiled package for the fixture's kernel with nvidia-peermem
// among its modules, as NVIDIA's packages have.
func writePeermemPackage(t *testing.T, w *world) {
	t.Helper()
	banner, err := os.ReadFile(w.roots.InProc("version"))
	hosttest.Must(t, err)
	p := &precompiled.Package{DriverVersion: testVersion, Description: "test", ProcVersion: strings.SplitN(string(banner), "\n", 2)[0]}
	for _, mod := range []string{"nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-peermem"} {
		dep := "nvidia"
		if mod == "nvidia" {
			dep = ""
		}
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
	dir := w.roots.InRoot("usr/src/nvidia-"+testVersion, "kernel/precompiled")
	hosttest.Must(t, os.MkdirAll(dir, 0o755))
	if err := os.WriteFile(filepath.Join(dir, "nvidia-modules-6.6.95"), data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestPeermemSidecarFindsInitsModules: the operator gives the peermem sidecar only
// USE_HOST_MOFED, not init's environment, so a --cache-dir set through driver.env, or a cache
// turned off, must not leave it looking in the default cache. Init records in status.json where
// its modules are (the cache, the shared driver root), and the sidecar loads nvidia-peermem from
// there; with the cache off, from the modules init installed into the driver root.
func TestPeermemSidecarFindsInitsModules(t *testing.T) {
	for _, tc := range []struct {
		name string
		// args gives init's cache flags and the cache status.json must then name ("" for none).
		args func(t *testing.T) (args []string, cacheDir string)
		// inDriverRoot: the sidecar can only have found nvidia-peermem.ko in the driver root.
		inDriverRoot bool
	}{
		{name: "non-default cache dir", args: func(t *testing.T) ([]string, string) {
			dir := filepath.Join(t.TempDir(), "hostpath-cache")
			return []string{"--cache-dir", dir}, dir
		}},
		{name: "cache off", args: func(t *testing.T) ([]string, string) { return []string{"--cache-max-entries", "0"}, "" },
			inDriverRoot: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			hosttest.Must(t, os.RemoveAll(w.roots.InSys("bus/pci/devices/0000:5e:00.0"))) // no Mellanox device yet: init does not load peermem
			writePeermemPackage(t, w)
			w.before = files(hosttest.Snapshot(t, w.dir))
			cacheArgs, wantCache := tc.args(t)
			a := w.agent(t, append([]string{"--gpu-direct-rdma"}, cacheArgs...)...)
			a.Source = nil
			cancel, done := startAgent(a)
			defer cancel()
			w.waitReady(t, done)
			if slices.Contains(w.kernel.Loaded(), "nvidia_peermem") {
				t.Fatal("init loaded nvidia_peermem without a Mellanox device")
			}
			st, err := status.Read(status.Paths{Run: w.roots.Run})
			if err != nil {
				t.Fatal(err)
			}
			installed := w.roots.InRoot("lib/modules/6.6.95-flatcar/kernel/drivers/video")
			if st.ModulesDir != w.roots.InRun("nvidia/driver/lib/modules/6.6.95-flatcar/kernel/drivers/video") {
				t.Errorf("status.json modulesDir = %q", st.ModulesDir)
			}
			if st.ModulesCacheDir != wantCache {
				t.Errorf("status.json modulesCacheDir = %q, want %q (\"\": the cache is off)", st.ModulesCacheDir, wantCache)
			}
			// The node sees the container root at /run/nvidia/driver (an rbind; the fake mounter only records it).
			shared := w.roots.InRun("nvidia/driver")
			os.Remove(shared)
			if err := os.Symlink(w.roots.Root, shared); err != nil {
				t.Fatal(err)
			}
			defer os.Remove(shared)

			o := peermem.Options{Host: host.Host{Roots: w.roots, Kernel: w.kernel, Files: host.OSFiles{}}, Log: a.Log,
				CacheDir: w.roots.InRun("nvidia/driver-agent/cache"), Wait: 2 * time.Second, Poll: 10 * time.Millisecond}
			hosttest.Must(t, os.MkdirAll(w.roots.InRun("mellanox/drivers"), 0o755))
			hosttest.Must(t, os.WriteFile(w.roots.InRun("mellanox/drivers/.driver-ready"), nil, 0o644))
			hosttest.Must(t, os.WriteFile(w.roots.InRun("nvidia/validations/.driver-ctr-ready"), nil, 0o644))
			defer os.Remove(w.roots.InRun("mellanox/drivers/.driver-ready"))
			sctx, scancel := context.WithCancel(context.Background())
			sdone := make(chan error, 1)
			go func() { sdone <- peermem.Reload(sctx, o) }()
			waitFor(t, "the sidecar to load nvidia_peermem", func() bool {
				select {
				case err := <-sdone:
					t.Fatalf("sidecar stopped: %v", err)
				default:
				}
				return slices.Contains(w.kernel.Loaded(), "nvidia_peermem")
			}, done)
			if tc.inDriverRoot {
				if _, err := os.Stat(filepath.Join(installed, "nvidia-peermem.ko")); err != nil {
					t.Errorf("nvidia-peermem.ko is not installed in the driver root: %v", err)
				}
			}
			scancel()
			if err := <-sdone; err != nil {
				t.Fatalf("sidecar: %v", err)
			}
			os.Remove(shared)
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			os.Remove(w.roots.InRun("mellanox/drivers/.driver-ready"))
			w.assertClean(t)
		})
	}
}

// TestModulesInstalledInDriverRoot: the loaded modules are copied into
// /lib/modules/<kver>/kernel/drivers/video/ of the shared root with a modules.dep and
// modules.dep.bin that list them with their dependencies, keeping what modules.dep had; teardown
// puts it all back.
func TestModulesInstalledInDriverRoot(t *testing.T) {
	w := newWorld(t)
	moddir := w.roots.InRoot("lib/modules/6.6.95-flatcar")
	hosttest.Must(t, os.MkdirAll(moddir, 0o755))
	hosttest.Must(t, os.WriteFile(filepath.Join(moddir, "modules.dep"), []byte("kernel/lib/crc7.ko:\nkernel/drivers/video/nvidia.ko:\n"), 0o644))
	w.before = files(hosttest.Snapshot(t, w.dir))
	cancel, done := startAgent(w.agent(t, "--load-drm"))
	defer cancel()
	w.waitReady(t, done)
	wantDep := "kernel/lib/crc7.ko:\nkernel/drivers/video/nvidia.ko:\nkernel/drivers/video/nvidia-modeset.ko: kernel/drivers/video/nvidia.ko\n" +
		"kernel/drivers/video/nvidia-drm.ko: kernel/drivers/video/nvidia-modeset.ko kernel/drivers/video/nvidia.ko\n" +
		"kernel/drivers/video/nvidia-uvm.ko: kernel/drivers/video/nvidia.ko\n"
	if got := w.read(t, "container/lib/modules/6.6.95-flatcar/modules.dep"); got != wantDep {
		t.Errorf("modules.dep =\n%s\nwant\n%s", got, wantDep)
	}
	for _, m := range []string{"nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm"} {
		if _, err := os.Stat(filepath.Join(moddir, "kernel/drivers/video", m+".ko")); err != nil {
			t.Errorf("%s not installed: %v", m, err)
		}
	}
	if bin := w.read(t, "container/lib/modules/6.6.95-flatcar/modules.dep.bin"); !strings.HasPrefix(bin, "\xb0\x07\xf4\x57") {
		t.Errorf("modules.dep.bin is not a kmod index: %q", bin[:min(len(bin), 16)])
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	w.assertClean(t)
}

// TestDriverRootInstallFails: the driver root is filled while persistenced starts, after the
// modules are loaded, so a failure there fails the start then: a load error naming the driver
// root, and a teardown that puts back what the install did before it failed (nvidia.ko copied)
// with everything else.
func TestDriverRootInstallFails(t *testing.T) {
	w := newWorld(t)
	moddir := w.roots.InRoot("lib/modules/6.6.95-flatcar")
	// Where nvidia-uvm.ko goes, a directory that is not empty: it cannot be replaced.
	hosttest.Must(t, os.MkdirAll(filepath.Join(moddir, "kernel/drivers/video/nvidia-uvm.ko/keep"), 0o755))
	hosttest.Must(t, os.WriteFile(filepath.Join(moddir, "modules.dep"), []byte("kernel/lib/crc7.ko:\n"), 0o644))
	w.before = files(hosttest.Snapshot(t, w.dir))
	a := w.agent(t)
	log := &messages{}
	a.Log = slog.New(log)
	err := a.Run(context.Background())
	if !errors.Is(err, exitcode.ErrModuleLoad) || !strings.Contains(err.Error(), "driver root") || !strings.Contains(err.Error(), "nvidia-uvm.ko") {
		t.Fatalf("Run = %v, want a module load error in the driver root naming nvidia-uvm.ko", err)
	}
	log.inOrder(t, "Loading NVIDIA driver kernel modules...", "Starting NVIDIA persistence daemon...", "Installing NVIDIA driver kernel modules...",
		"Stopping NVIDIA persistence daemon...", "Unloading NVIDIA driver kernel modules...")
	os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
	w.assertClean(t)
}

// messages records the log's messages, in order.
type messages struct {
	mu    sync.Mutex
	msgs  []string
	attrs []string // key=value of every record
}

func (m *messages) Enabled(context.Context, slog.Level) bool { return true }
func (m *messages) Handle(_ context.Context, r slog.Record) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.msgs = append(m.msgs, r.Message)
	r.Attrs(func(a slog.Attr) bool {
		m.attrs = append(m.attrs, a.String())
		return true
	})
	return nil
}
func (m *messages) WithAttrs([]slog.Attr) slog.Handler { return m }
func (m *messages) WithGroup(string) slog.Handler      { return m }

// inOrder checks that want appear among the messages in this order (prefixes).
func (m *messages) inOrder(t *testing.T, want ...string) {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	i := 0
	for _, msg := range m.msgs {
		if i < len(want) && strings.HasPrefix(msg, want[i]) {
			i++
		}
	}
	if i < len(want) {
		t.Errorf("log lacks %q (after %q):\n%s", want[i], want[:i], strings.Join(m.msgs, "\n"))
	}
}

// runToReady runs a until it is Ready, stops it, and returns what it logged; a run that fails,
// or fails to stop, fails the test.
func (w *world) runToReady(t *testing.T, a *Agent) *messages {
	t.Helper()
	log := &messages{}
	a.Log = slog.New(log)
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	return log
}

// TestScriptLogLines: the lines people grep the driver pod's log for, from NVIDIA's script.
func TestScriptLogLines(t *testing.T) {
	t.Run("full path", func(t *testing.T) {
		w := newWorld(t)
		log := w.runToReady(t, w.agent(t, "--gpu-direct-rdma"))
		// The script installs the modules before it loads them; the agent installs them in the
		// driver root while persistenced starts, and before it mounts that root.
		log.inOrder(t,
			"Starting installation of NVIDIA driver version 535.309.01 for Linux kernel version 6.6.95-flatcar",
			"Configuring the following firmware search path in '"+w.roots.InSys("module/firmware_class/parameters/path")+"': /run/nvidia/driver/lib/firmware",
			"Loading NVIDIA driver kernel modules...",
			"Loading NVIDIA Peer Memory kernel module...",
			"Starting NVIDIA persistence daemon...",
			"Installing NVIDIA driver kernel modules...",
			"Mounting NVIDIA driver rootfs...",
			"Storing driver configuration digest...",
			"Done, now waiting for signal")
	})
	t.Run("fast path", func(t *testing.T) {
		w := newWorld(t)
		w.loadedWithDigest(t, "digest-1")
		log := w.runToReady(t, w.agent(t))
		log.inOrder(t, "The NVIDIA driver is already loaded with the desired configuration, performing userspace-only install",
			"Storing driver configuration digest...", "Userspace-only install complete", "Done, now waiting for signal")
	})
	t.Run("compile path", func(t *testing.T) {
		w, args, _ := compileWorld(t, `for a in "$@"; do case "$a" in *uvm_ats.c) echo "$a:1:1: error: stand-in compiler failure" >&2; exit 1;; esac; done`)
		a := w.agent(t, args...)
		a.Source = nil
		log := &messages{}
		a.Log = slog.New(log)
		if err := a.Run(context.Background()); !errors.Is(err, exitcode.ErrBuild) {
			t.Fatalf("Run = %v, want the stand-in build failure", err)
		}
		log.inOrder(t, "Compiling NVIDIA driver kernel modules...")
		os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
		os.Remove(w.roots.InRun("nvidia/driver-agent/build-failed.log"))
	})
}
