package daemon

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
)

// ErrStopped is returned by Start after Stop.
var ErrStopped = errors.New("supervisor stopped")

// Supervisor runs the agent's daemons: Start them in order, WaitUp for the required ones, watch
// Failed for a required daemon that fails for good, and Stop them in reverse start order.
type Supervisor struct {
	opts Options

	mu       sync.Mutex
	entries  []*entry
	changed  chan struct{}
	stopping bool
	failErrs []error
	failed   chan struct{}

	stopOnce sync.Once
	stopErr  error
}

type entry struct {
	r      *Runner
	cancel context.CancelFunc
	done   chan struct{}
	err    error // Run's result, set before done is closed
}

// NewSupervisor returns a supervisor whose runners use o.
func NewSupervisor(o Options) *Supervisor {
	s := &Supervisor{changed: make(chan struct{}), failed: make(chan struct{})}
	user := o.OnChange
	o.OnChange = func(st Status) {
		if user != nil {
			user(st)
		}
		s.notify()
	}
	s.opts = o.withDefaults()
	return s
}

func (s *Supervisor) notify() {
	s.mu.Lock()
	close(s.changed)
	s.changed = make(chan struct{})
	s.mu.Unlock()
}

// Start starts a runner for spec in the background. It does not wait for the daemon to be up;
// use WaitUp. The daemon runs until Stop, not until some caller's context ends.
func (s *Supervisor) Start(spec Spec) (*Runner, error) {
	r, err := NewRunner(spec, s.opts)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping {
		return nil, fmt.Errorf("start %s: %w", spec.Name, ErrStopped)
	}
	for _, e := range s.entries {
		if e.r.Name() == spec.Name {
			return nil, fmt.Errorf("start %s: a daemon of that name is already supervised", spec.Name)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &entry{r: r, cancel: cancel, done: make(chan struct{})}
	s.entries = append(s.entries, e)
	go s.run(ctx, e)
	return r, nil
}

func (s *Supervisor) run(ctx context.Context, e *entry) {
	err := e.r.Run(ctx)
	e.err = err
	close(e.done)
	if err != nil && ctx.Err() == nil && e.r.Spec().Required {
		s.mu.Lock()
		s.failErrs = append(s.failErrs, err)
		if len(s.failErrs) == 1 {
			close(s.failed)
		}
		s.mu.Unlock()
		s.opts.Log.Error("a required daemon failed for good", "daemon", e.r.Name(), "error", err)
	}
	s.notify()
}

// WaitUp waits until every named daemon (every required one when no name is given) is up at
// once. It returns an error wrapping exitcode.ErrDaemon as soon as one of them has failed for good
// or ended, and when ctx ends first (bound the wait with a deadline on ctx); the error names
// each daemon not up, its state and its last output lines.
func (s *Supervisor) WaitUp(ctx context.Context, names ...string) error {
	for {
		s.mu.Lock()
		changed := s.changed
		targets, err := s.pick(names)
		s.mu.Unlock()
		if err != nil {
			return err
		}
		var waiting []string
		for _, e := range targets {
			select {
			case <-e.done:
				if e.err != nil {
					return e.err
				}
				return fmt.Errorf("%w: %s is not running", exitcode.ErrDaemon, e.r.Name())
			default:
			}
			if st := e.r.Status(); st.State != StateUp {
				waiting = append(waiting, describeWaiting(st))
			}
		}
		if len(waiting) == 0 {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("%w: not up: %s: %w", exitcode.ErrDaemon, strings.Join(waiting, "; "), ctx.Err())
		}
	}
}

func describeWaiting(st Status) string {
	msg := fmt.Sprintf("%s is %s", st.Name, st.State)
	if st.Restarts > 0 {
		msg += fmt.Sprintf(" after %d restarts", st.Restarts)
	}
	if st.LastExit != "" {
		msg += " (last exit: " + st.LastExit + ")"
	}
	return msg + lastOutput(st.Tail)
}

// pick returns the entries for names, or the required ones. Call with s.mu held.
func (s *Supervisor) pick(names []string) ([]*entry, error) {
	if len(names) == 0 {
		var out []*entry
		for _, e := range s.entries {
			if e.r.Spec().Required {
				out = append(out, e)
			}
		}
		return out, nil
	}
	out := make([]*entry, 0, len(names))
	for _, n := range names {
		var found *entry
		for _, e := range s.entries {
			if e.r.Name() == n {
				found = e
			}
		}
		if found == nil {
			return nil, fmt.Errorf("wait for %s: no such daemon", n)
		}
		out = append(out, found)
	}
	return out, nil
}

// Failed is closed when a required daemon has failed for good (before or after WaitUp returned).
func (s *Supervisor) Failed() <-chan struct{} { return s.failed }

// Err returns why required daemons failed for good, nil while none has.
func (s *Supervisor) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return errors.Join(s.failErrs...)
}

// Statuses returns the status of every daemon in start order.
func (s *Supervisor) Statuses() []Status {
	s.mu.Lock()
	entries := append([]*entry(nil), s.entries...)
	s.mu.Unlock()
	out := make([]Status, 0, len(entries))
	for _, e := range entries {
		out = append(out, e.r.Status())
	}
	return out
}

// Runner returns the runner of the named daemon, or nil.
func (s *Supervisor) Runner(name string) *Runner {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.entries {
		if e.r.Name() == name {
			return e.r
		}
	}
	return nil
}

// Stop stops the daemons one by one in reverse start order, each with SIGTERM and then SIGKILL
// after its stop timeout. When ctx ends, the daemon being stopped and all the remaining ones get
// SIGKILL at once. Stop returns when every daemon's runner has returned, so no process it started
// is left running; its error joins those of daemons that could not be stopped. Later calls return
// the same result; Start fails after Stop.
func (s *Supervisor) Stop(ctx context.Context) error {
	s.stopOnce.Do(func() {
		s.mu.Lock()
		s.stopping = true
		entries := append([]*entry(nil), s.entries...)
		s.mu.Unlock()
		var errs []error
		for i := len(entries) - 1; i >= 0; i-- {
			e := entries[i]
			select {
			case <-e.done:
				continue // ended on its own: already reported through Failed
			default:
			}
			e.cancel()
			select {
			case <-e.done:
			case <-ctx.Done():
				e.r.Kill()
				<-e.done
			}
			if e.err != nil {
				errs = append(errs, e.err)
			}
		}
		for _, e := range entries {
			e.cancel()
		}
		s.stopErr = errors.Join(errs...)
	})
	return s.stopErr
}
