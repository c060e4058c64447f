package agent

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"time"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/fabric"
	"github.com/driver-agent/driver-agent/pkg/host"
)

const (
	// fabricQueryTimeout bounds one `nvidia-smi -q`.
	fabricQueryTimeout = 30 * time.Second
	// defaultFabricPoll is how often the state is read again while a GPU is still registering.
	defaultFabricPoll = 5 * time.Second
	// defaultFabricTimeout bounds how long the fabric may stay in progress after fabric manager is up.
	defaultFabricTimeout = 2 * time.Minute
	// fabricQueryAttempts is how many failed reads (nvidia-smi failing, output without a GPU) are
	// tried before the state is reported unknown.
	fabricQueryAttempts = 3
)

// fabricUnknown is status.json's fabric value when the state could not be read.
const fabricUnknown = "unknown"

// nvidiaSMI is where the image has nvidia-smi.
func (r *run) nvidiaSMI() string { return r.Host.InRoot("usr/bin/nvidia-smi") }

// checkFabric reads the GPUs' fabric state with `nvidia-smi -q` once fabric manager is up, and
// reports it in the log, status.json and the metrics. A failure the GPUs report is an error
// (exitcode.ErrDaemon): fabric manager running is not enough for Ready. "In Progress" is read
// again every FabricPoll until it settles, for at most FabricTimeout; with FABRIC_MODE=1 (shared
// NVSwitch mode, where GPUs stay in progress until a partition is activated) it is reported and
// accepted. Without nvidia-smi in the image, or when it cannot be read, the state is unknown and
// the agent goes on.
func (r *run) checkFabric(ctx context.Context, plan fabric.Plan) error {
	smi := r.nvidiaSMI()
	if _, err := os.Stat(smi); err != nil {
		r.Log.Warn("the fabric state cannot be checked: nvidia-smi is not in the image", "path", smi)
		r.setFabric(fabricUnknown, "nvidia-smi is not in the image")
		return nil
	}
	poll, timeout := r.FabricPoll, r.FabricTimeout
	if poll <= 0 {
		poll = defaultFabricPoll
	}
	if timeout <= 0 {
		timeout = defaultFabricTimeout
	}
	var failed <-chan struct{}
	if r.sup != nil {
		failed = r.sup.Failed()
	}
	deadline := r.clock.Now().Add(timeout)
	var last fabric.Summary
	var readErr error
	attempts, waiting := 0, false
	for {
		sum, err := r.queryFabric(ctx, smi)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		readErr = err
		if err != nil {
			attempts++
			r.Log.Warn("could not read the fabric state", "attempt", attempts, "error", err)
			if attempts >= fabricQueryAttempts {
				r.Log.Warn("the fabric state cannot be checked; going on without it", "error", err)
				r.setFabric(fabricUnknown, err.Error())
				return nil
			}
		} else {
			attempts, last = 0, sum
			r.setFabric(string(sum.State), sum.Detail)
			switch sum.State {
			case fabric.StateCompleted:
				r.Log.Info("the NVSwitch fabric is up", "fabric_state", sum.State, "detail", sum.Detail)
				for _, g := range sum.Unhealthy() {
					r.Log.Warn("a GPU's fabric health is degraded", "gpu", g.GPU, "health", g.Health)
				}
				return nil
			case fabric.StateNotSupported:
				r.Log.Info("the GPUs report no fabric state; nothing to check", "fabric_state", sum.State, "detail", sum.Detail)
				return nil
			case fabric.StateFailed:
				r.Log.Error("the NVSwitch fabric reports a failure", "fabric_state", sum.State, "detail", sum.Detail)
				return fmt.Errorf("%w: the NVSwitch fabric reports a failure although %s is running: %s", exitcode.ErrDaemon, fabric.FabricManagerName, sum.Detail)
			case fabric.StateInProgress:
				if plan.ResetGPUs {
					r.Log.Info("the fabric is in progress, as expected with FABRIC_MODE=1 until a partition is activated", "fabric_state", sum.State, "detail", sum.Detail)
					return nil
				}
				if !waiting {
					r.Log.Info("waiting for the GPUs to register with the NVSwitch fabric", "timeout", timeout, "detail", sum.Detail)
					waiting = true
				}
			}
		}
		if !r.clock.Now().Before(deadline) {
			if readErr != nil {
				r.Log.Warn("the fabric state cannot be checked; going on without it", "error", readErr)
				r.setFabric(fabricUnknown, readErr.Error())
				return nil
			}
			r.Log.Error("the NVSwitch fabric did not settle", "fabric_state", last.State, "detail", last.Detail, "timeout", timeout)
			return fmt.Errorf("%w: the NVSwitch fabric is still in progress %s after %s came up: %s", exitcode.ErrDaemon, timeout, fabric.FabricManagerName, last.Detail)
		}
		t := r.clock.NewTimer(poll)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-failed:
			t.Stop()
			return fmt.Errorf("%w: %w", exitcode.ErrDaemon, r.sup.Err())
		case <-t.C():
		}
	}
}

// queryFabric runs `nvidia-smi -q` through the reaper, bounded, and summarizes its Fabric sections.
func (r *run) queryFabric(ctx context.Context, smi string) (fabric.Summary, error) {
	qctx, cancel := context.WithTimeout(ctx, fabricQueryTimeout)
	defer cancel()
	out, err := r.Reaper.Output(qctx, host.Cmd{Path: smi, Args: []string{"-q"}})
	if err != nil {
		return fabric.Summary{}, fmt.Errorf("nvidia-smi -q: %w", err)
	}
	gpus, err := fabric.ParseFabricState(bytes.NewReader(out))
	if err != nil {
		return fabric.Summary{}, fmt.Errorf("nvidia-smi -q: %w", err)
	}
	return fabric.Summarize(gpus), nil
}

// setFabric records the fabric state and writes status.json at once, so `driver-agent status`
// shows it while the agent waits.
func (r *run) setFabric(state, detail string) {
	r.mu.Lock()
	r.status.Fabric, r.status.FabricDetail = state, detail
	r.mu.Unlock()
	r.writeStatus()
}

// metricsFabricState is the state label for driver_agent_fabric_state: one of fabric's four
// states, or "" (no metric) while unknown.
func metricsFabricState(s string) string {
	switch fabric.State(s) {
	case fabric.StateCompleted, fabric.StateInProgress, fabric.StateFailed, fabric.StateNotSupported:
		return s
	}
	return ""
}
