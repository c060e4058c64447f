package fabric

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// StateUnknown is the state reported when it could not be read (no nvidia-smi, or nvidia-smi
// failing): status.json says so, and driver_agent_fabric_state has no sample.
const StateUnknown State = "unknown"

const (
	// queryTimeout bounds one `nvidia-smi -q`.
	queryTimeout = 30 * time.Second
	// defaultPoll is how often the state is read again while a GPU is still registering.
	defaultPoll = 5 * time.Second
	// defaultStateTimeout bounds how long the fabric may stay in progress after fabric manager is up.
	defaultStateTimeout = 2 * time.Minute
	// queryAttempts is how many failed reads in a row (nvidia-smi failing, output without a GPU)
	// are tried before the state is reported unknown.
	queryAttempts = 3
)

// StateOptions are what WaitState needs.
type StateOptions struct {
	// NvidiaSMI is the image's nvidia-smi, as the agent sees it.
	NvidiaSMI string
	// Procs runs nvidia-smi to completion (Host.Procs: the agent's reaper).
	Procs host.Procs
	// Clock times the polls and the timeout. Nil means the wall clock.
	Clock daemon.Clock
	// Log receives the states read. Nil discards it.
	Log *slog.Logger
	// Poll is how often the state is read again while a GPU is in progress. Zero means 5s.
	Poll time.Duration
	// Timeout bounds how long the fabric may stay in progress. Zero means 2m.
	Timeout time.Duration
	// Shared is FABRIC_MODE=1 (Plan.ResetGPUs): GPUs stay in progress until a partition is
	// activated, so in progress is accepted at once.
	Shared bool
	// Daemons, when set, ends the wait while it polls: once Failed is closed (a required daemon
	// failed for good), WaitState returns Err's error. The agent passes its supervisor.
	Daemons interface {
		Failed() <-chan struct{}
		Err() error
	}
	// Report, when set, is told every state read, StateUnknown included, with its detail (the
	// agent writes it to status.json at once).
	Report func(state State, detail string)
}

func (o StateOptions) withDefaults() StateOptions {
	if o.Clock == nil {
		o.Clock = daemon.WallClock{}
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.Poll <= 0 {
		o.Poll = defaultPoll
	}
	if o.Timeout <= 0 {
		o.Timeout = defaultStateTimeout
	}
	if o.Report == nil {
		o.Report = func(State, string) {}
	}
	return o
}

// WaitState reads the GPUs' fabric state with `nvidia-smi -q` (fabric manager being up) and
// reports it. A failure the GPUs report is an error (exitcode.ErrDaemon): fabric manager running
// is not enough for Ready. In progress is read again every Poll until it settles, for at most
// Timeout, after which it is an error too; with Shared it is accepted. Without nvidia-smi, or
// when it cannot be read three times in a row (or at the timeout), the state is unknown and
// WaitState returns nil: the agent goes on without it.
func WaitState(ctx context.Context, o StateOptions) error {
	o = o.withDefaults()
	if _, err := os.Stat(o.NvidiaSMI); err != nil {
		o.Log.Warn("the fabric state cannot be checked: nvidia-smi is not in the image", "path", o.NvidiaSMI)
		o.Report(StateUnknown, "nvidia-smi is not in the image")
		return nil
	}
	var failed <-chan struct{}
	if o.Daemons != nil {
		failed = o.Daemons.Failed()
	}
	unknown := func(err error) error {
		o.Log.Warn("the fabric state cannot be checked; going on without it", "error", err)
		o.Report(StateUnknown, err.Error())
		return nil
	}
	deadline := o.Clock.Now().Add(o.Timeout)
	var last Summary
	var readErr error
	attempts, waiting := 0, false
	for {
		sum, err := query(ctx, o)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		readErr = err
		if err != nil {
			attempts++
			o.Log.Warn("could not read the fabric state", "attempt", attempts, "error", err)
			if attempts >= queryAttempts {
				return unknown(err)
			}
		} else {
			attempts, last = 0, sum
			o.Report(sum.State, sum.Detail)
			switch sum.State {
			case StateCompleted:
				o.Log.Info("the NVSwitch fabric is up", "fabric_state", sum.State, "detail", sum.Detail)
				for _, g := range sum.Unhealthy() {
					o.Log.Warn("a GPU's fabric health is degraded", "gpu", g.GPU, "health", g.Health)
				}
				return nil
			case StateNotSupported:
				o.Log.Info("the GPUs report no fabric state; nothing to check", "fabric_state", sum.State, "detail", sum.Detail)
				return nil
			case StateFailed:
				o.Log.Error("the NVSwitch fabric reports a failure", "fabric_state", sum.State, "detail", sum.Detail)
				return fmt.Errorf("%w: the NVSwitch fabric reports a failure although %s is running: %s", exitcode.ErrDaemon, FabricManagerName, sum.Detail)
			case StateInProgress:
				if o.Shared {
					o.Log.Info("the fabric is in progress, as expected with FABRIC_MODE=1 until a partition is activated", "fabric_state", sum.State, "detail", sum.Detail)
					return nil
				}
				if !waiting {
					o.Log.Info("waiting for the GPUs to register with the NVSwitch fabric", "timeout", o.Timeout, "detail", sum.Detail)
					waiting = true
				}
			}
		}
		if !o.Clock.Now().Before(deadline) {
			if readErr != nil {
				return unknown(readErr)
			}
			o.Log.Error("the NVSwitch fabric did not settle", "fabric_state", last.State, "detail", last.Detail, "timeout", o.Timeout)
			return fmt.Errorf("%w: the NVSwitch fabric is still in progress %s after %s came up: %s", exitcode.ErrDaemon, o.Timeout, FabricManagerName, last.Detail)
		}
		t := o.Clock.NewTimer(o.Poll)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-failed:
			t.Stop()
			return fmt.Errorf("%w: %w", exitcode.ErrDaemon, o.Daemons.Err())
		case <-t.C():
		}
	}
}

// query runs `nvidia-smi -q`, bounded, and summarizes its Fabric sections.
func query(ctx context.Context, o StateOptions) (Summary, error) {
	qctx, cancel := context.WithTimeout(ctx, queryTimeout)
	defer cancel()
	out, err := o.Procs.Output(qctx, host.Cmd{Path: o.NvidiaSMI, Args: []string{"-q"}})
	if err != nil {
		return Summary{}, fmt.Errorf("nvidia-smi -q: %w", err)
	}
	gpus, err := ParseFabricState(bytes.NewReader(out))
	if err != nil {
		return Summary{}, fmt.Errorf("nvidia-smi -q: %w", err)
	}
	return Summarize(gpus), nil
}
