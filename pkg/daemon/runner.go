// Package daemon supervises the NVIDIA daemons (nvidia-persistenced, nv-fabricmanager, nvlsm):
// a Runner per daemon starts it, logs its output line by line tagged daemon=<name>, keeps its last
// lines for error messages, restarts it with capped exponential backoff up to a crash-loop limit,
// and stops it with SIGTERM to its process group, then SIGKILL after a timeout. A daemon that forks
// into the background is tracked through its PID file and a pidfd, and is signalled only after
// the PID is verified to run that program. A Supervisor runs a set of runners for the agent: wait
// until the required ones are up, report one failing for good, stop them in reverse start order.
//
// Every child is started and waited for through host.Procs: in the agent the Reaper, the
// process's single wait loop, which implements it.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// ErrGaveUp marks a daemon that failed for good: it kept exiting and the restart limit was reached.
var ErrGaveUp = errors.New("restart limit reached")

// State is where a daemon is in its life.
type State string

// The states of a daemon.
const (
	// StateStarting: the process was started and is not up yet (start delay, readiness probe, PID file).
	StateStarting State = "starting"
	// StateUp: the daemon runs and passed its readiness check.
	StateUp State = "up"
	// StateBackingOff: the daemon exited and waits for its next start.
	StateBackingOff State = "backing-off"
	// StateStopping: the daemon was sent SIGTERM and is being waited for.
	StateStopping State = "stopping"
	// StateFailed: the daemon kept failing and will not be restarted.
	StateFailed State = "failed"
	// StateStopped: the daemon is not running, on request (or has not run yet).
	StateStopped State = "stopped"
)

// Policy is how a daemon is restarted.
type Policy struct {
	// InitialBackoff is the wait before the first restart; it doubles after every failed run up
	// to MaxBackoff. Zero means 1s.
	InitialBackoff time.Duration
	// MaxBackoff caps the wait between restarts. Zero means 30s.
	MaxBackoff time.Duration
	// MaxRestarts is how many consecutive failed runs are restarted before the daemon is failed
	// for good. Zero means 5; negative means never restart.
	MaxRestarts int
	// ResetAfter is how long a run must last for its exit to count as a first failure again
	// (backoff and count start over). Zero means 1m.
	ResetAfter time.Duration
}

func (p Policy) withDefaults() Policy {
	if p.InitialBackoff <= 0 {
		p.InitialBackoff = time.Second
	}
	if p.MaxBackoff <= 0 {
		p.MaxBackoff = 30 * time.Second
	}
	if p.MaxBackoff < p.InitialBackoff {
		p.MaxBackoff = p.InitialBackoff
	}
	if p.MaxRestarts == 0 {
		p.MaxRestarts = 5
	}
	if p.ResetAfter <= 0 {
		p.ResetAfter = time.Minute
	}
	return p
}

// Spec says how to run one daemon. Paths are as the agent sees them (under its roots).
type Spec struct {
	// Name names the daemon in logs, errors and metrics.
	Name string
	// Cmd is the program and its arguments.
	Cmd host.Cmd
	// Required daemons gate readiness: the Supervisor waits for them and reports their failure.
	Required bool
	// PIDFile, when set, says the program forks into the background and the forked daemon writes
	// its PID there. The daemon is then tracked through that file: the PID is used only after it
	// is verified to run Program, and it is watched with a pidfd. A file left by an earlier run is
	// checked the same way before the start: an unrelated process is never signalled.
	PIDFile string
	// Program is the name the process from PIDFile must have: the base name of its executable or
	// its comm (which the kernel cuts to 15 bytes). Empty means the base name of Cmd.Path.
	Program string
	// UpAfter is how long the process must run before it counts as up (then Ready, if set, is
	// polled). Zero means up as soon as it started.
	UpAfter time.Duration
	// Ready, when set, is polled every ProbeInterval until it returns nil; the daemon is up then.
	// It must return promptly.
	Ready func(ctx context.Context) error
	// ProbeInterval is how often Ready and PIDFile are checked. Zero means 500ms.
	ProbeInterval time.Duration
	// StartTimeout bounds how long Ready may fail, and how long a forking program may take to
	// return and leave a valid PID file; past it the start counts as failed. Zero means 60s.
	StartTimeout time.Duration
	// StopTimeout is how long the daemon gets after SIGTERM before SIGKILL. Zero means 5s.
	StopTimeout time.Duration
	// Prepare, when set, runs before every start (for example to remove a stale socket); its
	// error counts as a failed start.
	Prepare func() error
	// Policy is the restart policy.
	Policy Policy
	// TailLines is how many of the last output lines are kept for errors and status. Zero means 20.
	TailLines int
}

func (s Spec) withDefaults() Spec {
	if s.Program == "" {
		s.Program = filepath.Base(s.Cmd.Path)
	}
	if s.ProbeInterval <= 0 {
		s.ProbeInterval = 500 * time.Millisecond
	}
	if s.StartTimeout <= 0 {
		s.StartTimeout = time.Minute
	}
	if s.StopTimeout <= 0 {
		s.StopTimeout = 5 * time.Second
	}
	if s.TailLines <= 0 {
		s.TailLines = 20
	}
	s.Policy = s.Policy.withDefaults()
	return s
}

// CommandLine renders the command for logs and plans.
func (s Spec) CommandLine() string {
	return strings.Join(append([]string{s.Cmd.Path}, s.Cmd.Args...), " ")
}

// Status is a daemon's state as readiness, status files and metrics see it.
type Status struct {
	Name     string    `json:"name"`               // the daemon's name
	Required bool      `json:"required"`           // whether it gates readiness
	State    State     `json:"state"`              // where it is in its life
	PID      int       `json:"pid,omitempty"`      // the process now tracked: launcher, daemon, or 0
	Restarts int       `json:"restarts"`           // restarts since the runner began
	Since    time.Time `json:"since"`              // when State was entered
	LastExit string    `json:"lastExit,omitempty"` // why the last run ended
	Error    string    `json:"error,omitempty"`    // why the daemon failed for good
	Tail     []string  `json:"tail,omitempty"`     // the last output lines
}

// Options are what runners and supervisors work with.
type Options struct {
	// Procs starts the processes and reports their exits: the agent's Reaper (Host.Procs), or a
	// fake in tests. Required. With a Reaper, a daemon that forks into the background and is
	// adopted as an orphan is reaped at once when it exits, and its exit status is reported.
	Procs host.Procs
	// Log receives the supervisor's records and every line the daemons print; records are tagged
	// daemon=<name>. Nil discards them.
	Log *slog.Logger
	// Clock times backoff, readiness, start and stop timeouts. Nil means the wall clock.
	Clock Clock
	// Proc is the procfs root where the identity of a PID from a PID file is read. Empty means /proc.
	Proc string
	// OnChange, when set, is called with the new status after every change. It must not block.
	OnChange func(Status)
}

func (o Options) withDefaults() Options {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.Clock == nil {
		o.Clock = WallClock{}
	}
	if o.Proc == "" {
		o.Proc = "/proc"
	}
	return o
}

// Runner supervises one daemon. Its status may be read from any goroutine.
type Runner struct {
	spec Spec
	opts Options
	log  *slog.Logger
	tail *tail

	mu      sync.Mutex
	st      Status
	changed chan struct{}
	running bool

	hurry     chan struct{}
	hurryOnce sync.Once
}

// NewRunner checks spec and returns its runner; Run starts it.
func NewRunner(spec Spec, o Options) (*Runner, error) {
	if spec.Name == "" {
		return nil, errors.New("daemon spec without a name")
	}
	if spec.Cmd.Path == "" {
		return nil, fmt.Errorf("daemon %s: no command", spec.Name)
	}
	if o.Procs == nil {
		return nil, fmt.Errorf("daemon %s: no way to start processes", spec.Name)
	}
	spec = spec.withDefaults()
	o = o.withDefaults()
	r := &Runner{
		spec:    spec,
		opts:    o,
		log:     o.Log.With("daemon", spec.Name),
		tail:    newTail(spec.TailLines),
		changed: make(chan struct{}),
		hurry:   make(chan struct{}),
	}
	r.st = Status{Name: spec.Name, Required: spec.Required, State: StateStopped, Since: o.Clock.Now()}
	return r, nil
}

// Name returns the daemon's name.
func (r *Runner) Name() string { return r.spec.Name }

// Spec returns the daemon's spec with its defaults filled in.
func (r *Runner) Spec() Spec { return r.spec }

// Status returns the daemon's current status.
func (r *Runner) Status() Status {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.st
	st.Tail = r.tail.Lines()
	return st
}

// Changed returns a channel that is closed at the next status change.
func (r *Runner) Changed() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.changed
}

// Kill makes a stop in progress, or the next one, send SIGKILL without waiting for the stop
// timeout. The Supervisor calls it when its stop deadline is reached.
func (r *Runner) Kill() { r.hurryOnce.Do(func() { close(r.hurry) }) }

func (r *Runner) update(fn func(*Status)) {
	r.mu.Lock()
	prev := r.st.State
	fn(&r.st)
	if r.st.State != prev {
		r.st.Since = r.opts.Clock.Now()
	}
	st := r.st
	st.Tail = r.tail.Lines()
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	if r.opts.OnChange != nil {
		r.opts.OnChange(st)
	}
}

func (r *Runner) setState(s State, pid int) {
	r.update(func(st *Status) { st.State, st.PID = s, pid })
}

// Run runs the daemon until ctx ends, restarting it when it exits, and stops it when ctx ends.
// It returns nil after a stop on request; an error wrapping exitcode.ErrDaemon and ErrGaveUp when
// the daemon failed for good; or an error when the daemon could not be stopped. Whatever it
// returns, the processes it started have exited.
func (r *Runner) Run(ctx context.Context) error {
	r.mu.Lock()
	if r.running {
		r.mu.Unlock()
		return fmt.Errorf("daemon %s: already running", r.spec.Name)
	}
	r.running = true
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.running = false
		r.mu.Unlock()
	}()

	pol := r.spec.Policy
	clock := r.opts.Clock
	failures := 0
	backoff := pol.InitialBackoff
	for {
		if ctx.Err() != nil {
			r.setState(StateStopped, 0)
			return nil
		}
		began := clock.Now()
		r.setState(StateStarting, 0)
		var crash, stopErr error
		if r.spec.PIDFile != "" {
			crash, stopErr = r.runForking(ctx)
		} else {
			crash, stopErr = r.runForeground(ctx)
		}
		if crash == nil || ctx.Err() != nil {
			r.update(func(st *Status) { st.State, st.PID = StateStopped, 0 })
			if stopErr != nil {
				return fmt.Errorf("%w: %s: %w", exitcode.ErrDaemon, r.spec.Name, stopErr)
			}
			r.log.Info("daemon stopped")
			return nil
		}
		if clock.Now().Sub(began) >= pol.ResetAfter {
			failures, backoff = 0, pol.InitialBackoff
		}
		failures++
		if pol.MaxRestarts < 0 || failures > pol.MaxRestarts {
			restarts := r.Status().Restarts
			err := fmt.Errorf("%w: %s: %w after %d restarts: %w%s", exitcode.ErrDaemon, r.spec.Name, ErrGaveUp,
				restarts, crash, lastOutput(r.tail.Lines()))
			r.update(func(st *Status) {
				st.State, st.PID, st.LastExit, st.Error = StateFailed, 0, crash.Error(), err.Error()
			})
			r.log.Error("daemon failed for good", "restarts", restarts, "error", crash, "last_output", r.tail.Lines())
			return err
		}
		r.update(func(st *Status) { st.State, st.PID, st.LastExit = StateBackingOff, 0, crash.Error() })
		r.log.Warn("daemon exited, restarting", "error", crash, "in", backoff, "failures", failures, "last_output", r.tail.Lines())
		t := clock.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			r.setState(StateStopped, 0)
			r.log.Info("daemon stopped")
			return nil
		case <-t.C():
		}
		backoff = min(2*backoff, pol.MaxBackoff)
		r.update(func(st *Status) { st.Restarts++ })
	}
}

// errCancelled says ctx ended while a daemon was starting.
var errCancelled = errors.New("cancelled")

// runForeground runs one life of a daemon that stays in the foreground. It returns why the daemon
// ended on its own (crash), or nil with the error of stopping it when ctx ended.
func (r *Runner) runForeground(ctx context.Context) (crash, stopErr error) {
	if err := r.prepare(); err != nil {
		return err, nil
	}
	out, err := newCapture(r.log, r.tail)
	if err != nil {
		return fmt.Errorf("start: %w", err), nil
	}
	child, err := r.opts.Procs.Start(context.Background(), r.spec.Cmd, host.StartOptions{Stdout: out.stdout, Stderr: out.stderr, KillGroup: true})
	out.closeWriters()
	if err != nil {
		out.finish(0)
		return err, nil
	}
	defer out.finish(drainTimeout)
	defer killLeft(child)
	r.setState(StateStarting, child.Pid())
	r.log.Info("started daemon", "pid", child.Pid(), "command", r.spec.CommandLine())

	switch err := r.waitUp(ctx, child.Done()); {
	case errors.Is(err, errCancelled):
		return nil, r.stopChild(child)
	case errors.Is(err, errExited):
		return child.Wait(), nil
	case err != nil:
		r.log.Warn("daemon did not come up, stopping it", "error", err)
		if serr := r.stopChild(child); serr != nil {
			return errors.Join(err, serr), nil
		}
		return err, nil
	}
	r.setState(StateUp, child.Pid())
	r.log.Info("daemon is up", "pid", child.Pid())
	select {
	case <-child.Done():
		return child.Wait(), nil
	case <-ctx.Done():
		return nil, r.stopChild(child)
	}
}

// errExited says the process exited while it was starting.
var errExited = errors.New("exited while starting")

// waitUp waits for UpAfter and then for Ready, bounded by StartTimeout.
func (r *Runner) waitUp(ctx context.Context, exited <-chan struct{}) error {
	clock := r.opts.Clock
	if r.spec.UpAfter > 0 {
		t := clock.NewTimer(r.spec.UpAfter)
		select {
		case <-exited:
			t.Stop()
			return errExited
		case <-ctx.Done():
			t.Stop()
			return errCancelled
		case <-t.C():
		}
	}
	if r.spec.Ready == nil {
		return nil
	}
	deadline := clock.NewTimer(r.spec.StartTimeout)
	defer deadline.Stop()
	for {
		err := r.spec.Ready(ctx)
		if err == nil {
			return nil
		}
		t := clock.NewTimer(r.spec.ProbeInterval)
		select {
		case <-exited:
			t.Stop()
			return errExited
		case <-ctx.Done():
			t.Stop()
			return errCancelled
		case <-deadline.C():
			t.Stop()
			return fmt.Errorf("not ready within %s: %w", r.spec.StartTimeout, err)
		case <-t.C():
		}
	}
}

func (r *Runner) prepare() error {
	if r.spec.Prepare == nil {
		return nil
	}
	if err := r.spec.Prepare(); err != nil {
		return fmt.Errorf("prepare: %w", err)
	}
	return nil
}

func (r *Runner) stopChild(c host.Process) error {
	r.setState(StateStopping, c.Pid())
	return r.terminate(c.Pid(), c.Signal, c.Done())
}

// terminate sends SIGTERM, waits StopTimeout (less after Kill), sends SIGKILL and waits again.
func (r *Runner) terminate(pid int, signal func(syscall.Signal) error, done <-chan struct{}) error {
	clock := r.opts.Clock
	r.log.Info("stopping daemon", "pid", pid, "timeout", r.spec.StopTimeout)
	if err := signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		r.log.Warn("could not send SIGTERM", "pid", pid, "error", err)
	}
	t := clock.NewTimer(r.spec.StopTimeout)
	select {
	case <-done:
		t.Stop()
		return nil
	case <-t.C():
		r.log.Warn(fmt.Sprintf("daemon did not stop within %s of SIGTERM, sending SIGKILL", r.spec.StopTimeout), "pid", pid)
	case <-r.hurry:
		t.Stop()
		r.log.Warn("stop deadline reached, sending SIGKILL", "pid", pid)
	}
	if err := signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		r.log.Warn("could not send SIGKILL", "pid", pid, "error", err)
	}
	t = clock.NewTimer(r.spec.StopTimeout)
	defer t.Stop()
	select {
	case <-done:
		return nil
	case <-t.C():
		return fmt.Errorf("pid %d still running %s after SIGKILL", pid, r.spec.StopTimeout)
	}
}

// killLeft makes sure a child is not left running whatever path a run took. It does not wait: a
// child that survives SIGKILL cannot be helped, and the reaper collects it when it goes.
func killLeft(c host.Process) {
	select {
	case <-c.Done():
	default:
		_ = c.Signal(syscall.SIGKILL)
	}
}
