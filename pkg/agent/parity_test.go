package agent

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
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
