// Package daemon starts the NVIDIA daemons (nvidia-persistenced, nv-fabricmanager) as children of
// the agent and stops them: SIGTERM to the process group, then SIGKILL after a timeout.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"syscall"
	"time"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// Spec says how to run one daemon.
type Spec struct {
	Name string
	Cmd  host.Cmd
}

// State values.
const (
	StateUp     = "up"
	StateExited = "exited"
)

// Daemon is a started daemon.
type Daemon struct {
	Spec Spec
	proc host.Process
	done chan struct{}

	mu  sync.Mutex
	err error
}

// Start starts spec through h.Exec.
func Start(ctx context.Context, h host.Host, log *slog.Logger, spec Spec) (*Daemon, error) {
	proc, err := h.Exec.Start(ctx, spec.Cmd)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", exitcode.ErrDaemon, spec.Name, err)
	}
	d := &Daemon{Spec: spec, proc: proc, done: make(chan struct{})}
	log = log.With("daemon", spec.Name, "pid", proc.Pid())
	log.Info("started daemon", "command", spec.Cmd.Path, "args", spec.Cmd.Args)
	go func() {
		err := proc.Wait()
		d.mu.Lock()
		d.err = err
		d.mu.Unlock()
		log.Info("daemon exited", "error", err)
		close(d.done)
	}()
	return d, nil
}

// Done is closed when the process has exited.
func (d *Daemon) Done() <-chan struct{} { return d.done }

// State is StateUp while the process runs, StateExited afterwards.
func (d *Daemon) State() string {
	select {
	case <-d.done:
		return StateExited
	default:
		return StateUp
	}
}

// Stop sends SIGTERM, waits up to timeout (or ctx), then sends SIGKILL and waits for the exit.
func (d *Daemon) Stop(ctx context.Context, timeout time.Duration) error {
	select {
	case <-d.done:
		return nil
	default:
	}
	if err := d.proc.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("stop %s: %w", d.Spec.Name, err)
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-d.done:
		return nil
	case <-t.C:
	case <-ctx.Done():
	}
	if err := d.proc.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill %s: %w", d.Spec.Name, err)
	}
	select {
	case <-d.done:
		return fmt.Errorf("%s did not stop within %s after SIGTERM and was killed", d.Spec.Name, timeout)
	case <-ctx.Done():
		return fmt.Errorf("%s (pid %d) is still running after SIGKILL: %w", d.Spec.Name, d.proc.Pid(), ctx.Err())
	}
}
