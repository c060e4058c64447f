package hosttest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/host"
)

// FakeProcs implements host.Procs without starting anything. It remembers every command line, in
// order, and the processes it started, which run until they are signalled with a signal that
// ends them (SIGTERM, SIGKILL, SIGINT) or until the test ends them with Exit.
type FakeProcs struct {
	// Handle answers Output and Run: the command's stdout (Run writes it to out) and its exit
	// error. Nil means every command succeeds with no output. It may block until ctx ends.
	Handle func(ctx context.Context, c host.Cmd) ([]byte, error)

	mu      sync.Mutex
	cmds    []host.Cmd
	procs   []*FakeProcess
	nextPid int
}

// Start implements host.Procs.
func (f *FakeProcs) Start(_ context.Context, c host.Cmd, _ host.StartOptions) (host.Process, error) {
	if c.Path == "" {
		return nil, errors.New("start: empty path")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cmds = append(f.cmds, c)
	f.nextPid++
	p := &FakeProcess{Cmd: c, pid: 1000 + f.nextPid, done: make(chan struct{})}
	f.procs = append(f.procs, p)
	return p, nil
}

// Output implements host.Procs.
func (f *FakeProcs) Output(ctx context.Context, c host.Cmd) ([]byte, error) {
	f.mu.Lock()
	f.cmds = append(f.cmds, c)
	handle := f.Handle
	f.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("run %s: %w", c.Path, err)
	}
	if handle == nil {
		return nil, nil
	}
	return handle(ctx, c)
}

// Run implements host.Procs.
func (f *FakeProcs) Run(ctx context.Context, c host.Cmd, out *os.File) error {
	b, err := f.Output(ctx, c)
	if len(b) > 0 {
		if _, werr := out.Write(b); werr != nil {
			return errors.Join(err, werr)
		}
	}
	return err
}

// Cmds returns the command lines run or started so far, in order.
func (f *FakeProcs) Cmds() []host.Cmd {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]host.Cmd(nil), f.cmds...)
}

// Started returns the processes started so far, in order.
func (f *FakeProcs) Started() []*FakeProcess {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*FakeProcess(nil), f.procs...)
}

// Running returns the started processes that have not exited.
func (f *FakeProcs) Running() []*FakeProcess {
	var out []*FakeProcess
	for _, p := range f.Started() {
		if !p.Exited() {
			out = append(out, p)
		}
	}
	return out
}

// FakeProcess is a process FakeProcs started.
type FakeProcess struct {
	Cmd  host.Cmd
	pid  int
	done chan struct{}

	mu      sync.Mutex
	signals []syscall.Signal
	exited  bool
	err     error
}

// Pid implements host.Process.
func (p *FakeProcess) Pid() int { return p.pid }

// Signal implements host.Process: SIGTERM, SIGINT and SIGKILL end the process ("killed by
// signal"); other signals are only recorded.
func (p *FakeProcess) Signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exited {
		return os.ErrProcessDone
	}
	p.signals = append(p.signals, sig)
	switch sig {
	case syscall.SIGTERM, syscall.SIGINT, syscall.SIGKILL:
		p.exitLocked(fmt.Errorf("killed by signal %s", unix.SignalName(sig)))
	}
	return nil
}

// Done implements host.Process.
func (p *FakeProcess) Done() <-chan struct{} { return p.done }

// Wait implements host.Process.
func (p *FakeProcess) Wait() error {
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Exit ends the process with err (nil for exit status 0); it does nothing once it has exited.
func (p *FakeProcess) Exit(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.exited {
		p.exitLocked(err)
	}
}

func (p *FakeProcess) exitLocked(err error) {
	p.exited, p.err = true, err
	close(p.done)
}

// Exited reports whether the process has exited.
func (p *FakeProcess) Exited() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exited
}

// Signals returns the signals the process received while it ran.
func (p *FakeProcess) Signals() []syscall.Signal {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]syscall.Signal(nil), p.signals...)
}
