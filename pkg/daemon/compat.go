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

// This file keeps the first, unsupervised API that pkg/agent still uses, so the tree builds while
// the agent moves to Supervisor. Remove it with the agent's last use of Start.

// Daemon is a process started by Start: not restarted, not tracked by PID file.
type Daemon struct {
	Spec Spec // what was started
	proc host.Process
	done chan struct{}

	mu  sync.Mutex
	err error
}

// Start starts spec.Cmd through h.Exec and watches it (transitional; use Supervisor).
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

// State is "up" while the process runs, "exited" afterwards.
func (d *Daemon) State() string {
	select {
	case <-d.done:
		return "exited"
	default:
		return string(StateUp)
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
