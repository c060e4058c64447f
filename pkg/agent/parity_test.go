package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// TestFastPathDigestWrittenByScript: NVIDIA's script stores the digest with echo, a trailing
// newline included; the agent that replaces it must still take the fast path.
func TestFastPathDigestWrittenByScript(t *testing.T) {
	w := newWorld(t)
	if err := w.kernel.Preload("nvidia", "nvidia_uvm", "nvidia_modeset"); err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(w.roots.InRun("nvidia"), 0o755)
	os.WriteFile(w.roots.InRun("nvidia/nvidia-driver.state"), []byte("digest-1\n"), 0o644)
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
	os.RemoveAll(w.roots.InSys("bus/pci/devices/0000:3b:00.0"))
	for i, dev := range devices {
		dir := w.roots.InSys("bus/pci/devices", fmt.Sprintf("0000:%02x:00.0", 0x41+i))
		os.MkdirAll(dir, 0o755)
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
	os.MkdirAll(filepath.Dir(p), 0o755)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// dryRunPlan runs a dry run and returns its JSON plan.
func (w *world) dryRunPlan(t *testing.T, args ...string) (Plan, error) {
	t.Helper()
	a := w.agent(t, append([]string{"--dry-run", "--output", "json"}, args...)...)
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
		{"pre-Turing", []string{"0x1db4", "0x1db4"}, v580, "kernel", "the open modules do not support 0000:41:00.0 [10de:1db4] Tesla V100-PCIE-16GB, 0000:42:00.0 [10de:1db4]"},
		{"Turing+", []string{"0x1eb8", "0x2330"}, v580, "kernel-open", "all 2 GPU(s) support both flavours, and branch 580 defaults to the open modules"},
		{"mixed", []string{"0x2330", "0x1db6"}, v580, "kernel", "the open modules do not support 0000:42:00.0 [10de:1db6] Tesla V100-PCIE-32GB"},
		{"self-hosted on an old branch", []string{"0x2342"}, testVersion, "kernel-open", "the open modules are required by 0000:41:00.0 [10de:2342] NVIDIA GH200 120GB"},
		{"no GPU", nil, v580, "kernel-open", "no NVIDIA GPU on the PCI bus: the branch rule, branch 580 >= 560 defaults to open modules"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			w.setGPUs(t, tc.devices...)
			w.installSupportedGPUs(t, tc.version)
			w.before = files(hosttest.Snapshot(t, w.dir))
			p, err := w.dryRunPlan(t, "--driver-version", tc.version)
			if err != nil {
				t.Fatal(err)
			}
			if p.Decision.Flavor != tc.flavor || !strings.Contains(p.Decision.FlavorReason, tc.reason) {
				t.Errorf("flavour %s (%s); want %s because %q", p.Decision.Flavor, p.Decision.FlavorReason, tc.flavor, tc.reason)
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
	p, err := w.dryRunPlan(t, "--driver-version", "580.95.05")
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
