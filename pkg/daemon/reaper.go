package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/host"
)

// ErrReaperClosed is returned by Start after Close.
var ErrReaperClosed = errors.New("reaper closed")

// reaperCloseWait bounds how long Close waits for the children it killed.
const reaperCloseWait = 5 * time.Second

// maxOrphanStatuses bounds how many exit statuses of reaped orphans are remembered.
const maxOrphanStatuses = 64

// outputLimit bounds what Output collects from a command's stdout.
const outputLimit = 1 << 20

// ReaperOptions configure a Reaper.
type ReaperOptions struct {
	// Log receives debug records about reaped orphans and the stderr of commands run through
	// Output; nil discards them.
	Log *slog.Logger
	// All makes the reaper wait for every child of the process (waitid(P_ALL)), orphans it adopted
	// included. This is the agent's mode: as PID 1 or a child subreaper it must reap every orphan.
	// At most one such reaper may exist in a process, and nothing else in the process may wait for
	// children (no exec.Cmd.Wait, no os.Process.Wait). Without All the reaper waits only for the
	// processes it started, so several can coexist in one process (tests).
	All bool
	// Subreaper marks the process a child subreaper (PR_SET_CHILD_SUBREAPER), so that the orphans
	// of its children, such as a daemon that forks into the background, are reparented to it and
	// can be reaped and watched. It is not needed, and not set, when the process is PID 1.
	Subreaper bool
	// ChildSched is the scheduling the children start with: the thread that starts them takes it
	// (host.BatchThreads changes the agent's own). Nil: the thread's as it is.
	ChildSched *host.Sched
}

// Reaper starts child processes and is the one place where the process waits for children: a
// single loop, woken by SIGCHLD, collects every exit status with waitid and wait4 and hands it to
// the Child it belongs to. Children are started from one locked OS thread with a parent-death
// signal of SIGKILL, each in its own process group.
//
// A Reaper is created once by the command line front end and passed down; it is not a global.
type Reaper struct {
	log        *slog.Logger
	all        bool
	childSched *host.Sched

	mu     sync.Mutex // held while reaping and while signalling, so a PID is never reused under us
	kids   map[int]*Child
	closed bool
	// orphans keeps the last exit statuses of adopted orphans, for a daemon watched by pidfd.
	orphans     map[int]unix.WaitStatus
	orphanOrder []int

	sigs        chan os.Signal
	quit        chan struct{}
	loopDone    chan struct{}
	spawns      chan spawnRequest
	spawnerDone chan struct{}

	closeOnce sync.Once
	closeErr  error
}

type spawnRequest struct {
	path  string
	argv  []string
	attr  *os.ProcAttr
	reply chan spawnResult
}

type spawnResult struct {
	pid int
	err error
}

// NewReaper starts the reaping loop. Call Close when done.
func NewReaper(o ReaperOptions) (*Reaper, error) {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if o.Subreaper && !o.All {
		return nil, errors.New("a child subreaper must reap all children: set All with Subreaper")
	}
	if o.Subreaper && os.Getpid() != 1 {
		if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
			return nil, fmt.Errorf("become a child subreaper: %w", err)
		}
	}
	r := &Reaper{
		log:         log,
		all:         o.All,
		childSched:  o.ChildSched,
		kids:        map[int]*Child{},
		orphans:     map[int]unix.WaitStatus{},
		sigs:        make(chan os.Signal, 1),
		quit:        make(chan struct{}),
		loopDone:    make(chan struct{}),
		spawns:      make(chan spawnRequest),
		spawnerDone: make(chan struct{}),
	}
	signal.Notify(r.sigs, unix.SIGCHLD)
	go r.spawner()
	go r.loop()
	r.sweep() // children that exited before SIGCHLD was caught
	return r, nil
}

// Start implements host.Procs: it starts c in a new process group with a parent-death signal of
// SIGKILL; Wait on the returned *Child waits through the reaper. c.Path is also argv[0].
func (r *Reaper) Start(_ context.Context, c host.Cmd, o host.StartOptions) (host.Process, error) {
	ch, err := r.spawn(c, o)
	if err != nil {
		return nil, err
	}
	return ch, nil
}

func (r *Reaper) spawn(c host.Cmd, o host.StartOptions) (*Child, error) {
	if c.Path == "" {
		return nil, errors.New("spawn: empty path")
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("spawn %s: %w", c.Path, err)
	}
	defer devnull.Close()
	stdout, stderr := o.Stdout, o.Stderr
	if stdout == nil {
		stdout = devnull
	}
	if stderr == nil {
		stderr = devnull
	}
	req := spawnRequest{
		path: c.Path,
		argv: append([]string{c.Path}, c.Args...),
		attr: &os.ProcAttr{
			Dir:   c.Dir,
			Env:   c.Env,
			Files: []*os.File{devnull, stdout, stderr},
			Sys:   &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL},
		},
		reply: make(chan spawnResult, 1),
	}
	// Registering under the lock keeps the loop from reaping the new child before it is known.
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, fmt.Errorf("spawn %s: %w", c.Path, ErrReaperClosed)
	}
	r.spawns <- req
	res := <-req.reply
	if res.err != nil {
		return nil, fmt.Errorf("spawn %s: %w", c.Path, res.err)
	}
	ch := &Child{r: r, pid: res.pid, killGroup: o.KillGroup, done: make(chan struct{})}
	r.kids[res.pid] = ch
	return ch, nil
}

// Output implements host.Procs: it runs c to completion and returns its stdout (at most 1 MiB).
// Its stderr is logged with cmd=<base name> and its last lines are part of the error when it
// fails. When ctx ends first the process group is killed and ctx's error returned.
func (r *Reaper) Output(ctx context.Context, c host.Cmd) ([]byte, error) {
	name := filepath.Base(c.Path)
	log := r.log.With("cmd", name)
	t := newTail(10)
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("run %s: %w", name, err)
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return nil, fmt.Errorf("run %s: %w", name, err)
	}
	var buf bytes.Buffer
	stdout := readAll(outR, &buf, outputLimit)
	stderr := readLines(errR, func(line string) { t.add(line); log.Info(line, "stream", "stderr") })
	ch, err := r.spawn(c, host.StartOptions{Stdout: outW, Stderr: errW, KillGroup: true})
	outW.Close()
	errW.Close()
	if err != nil {
		stdout.finish(0)
		stderr.finish(0)
		return nil, err
	}
	select {
	case <-ch.done:
	case <-ctx.Done():
		_ = ch.Signal(syscall.SIGKILL)
		<-ch.done
	}
	stdout.finish(drainTimeout)
	stderr.finish(drainTimeout)
	if ctx.Err() != nil {
		return buf.Bytes(), fmt.Errorf("run %s: %w", name, ctx.Err())
	}
	if err := ch.Wait(); err != nil {
		return buf.Bytes(), fmt.Errorf("%s: %w%s", name, err, lastOutput(t.Lines()))
	}
	return buf.Bytes(), nil
}

// Run implements host.Procs: it runs c to completion in its own process group with stdout and
// stderr going to out, and kills what is left of the group when c exits. When ctx ends first the
// whole group is killed with SIGKILL and ctx's error is returned. A non-zero exit gives an
// *ExitError (wrapped).
func (r *Reaper) Run(ctx context.Context, c host.Cmd, out *os.File) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("run %s: %w", c.Path, err)
	}
	ch, err := r.spawn(c, host.StartOptions{Stdout: out, Stderr: out, KillGroup: true})
	if err != nil {
		return err
	}
	select {
	case <-ch.done:
	case <-ctx.Done():
		_ = ch.Signal(syscall.SIGKILL)
		<-ch.done
		return fmt.Errorf("run %s: %w", c.Path, ctx.Err())
	}
	if err := ch.Wait(); err != nil {
		return fmt.Errorf("%s: %w", c.Path, err)
	}
	return nil
}

// Close kills the children still running (their process groups, with SIGKILL), waits a bounded
// time for them to be reaped, and stops the loop. Later starts fail with ErrReaperClosed.
func (r *Reaper) Close() error {
	r.closeOnce.Do(func() {
		r.mu.Lock()
		r.closed = true
		kids := make([]*Child, 0, len(r.kids))
		for _, c := range r.kids {
			kids = append(kids, c)
		}
		r.mu.Unlock()
		for _, c := range kids {
			_ = c.Signal(syscall.SIGKILL)
		}
		deadline := time.NewTimer(reaperCloseWait)
		defer deadline.Stop()
		timedOut := false
		var stuck []int
		for _, c := range kids {
			if !timedOut {
				select {
				case <-c.done:
					continue
				case <-deadline.C:
					timedOut = true
				}
			}
			select {
			case <-c.done:
			default:
				stuck = append(stuck, c.pid)
			}
		}
		signal.Stop(r.sigs)
		close(r.quit)
		<-r.loopDone
		r.sweep()
		close(r.spawns)
		<-r.spawnerDone
		if len(stuck) > 0 {
			sort.Ints(stuck)
			r.closeErr = fmt.Errorf("close reaper: pids %v still running %s after SIGKILL", stuck, reaperCloseWait)
		}
	})
	return r.closeErr
}

// spawner starts every child from one OS thread that stays locked for the reaper's life, so the
// children's parent-death signal (which follows the thread that forked them) fires only when the
// reaper is closed or the agent dies, and so that the scheduling the children inherit
// (ChildSched) is set on that thread alone. The thread is never unlocked: it ends with the
// goroutine.
func (r *Reaper) spawner() {
	runtime.LockOSThread()
	defer close(r.spawnerDone)
	if err := r.childSched.Apply(); err != nil {
		r.log.Warn("children start with the agent's scheduling", "error", err)
	}
	for req := range r.spawns {
		p, err := os.StartProcess(req.path, req.argv, req.attr)
		if err != nil {
			req.reply <- spawnResult{err: err}
			continue
		}
		pid := p.Pid
		_ = p.Release() // waiting goes through the reaper, never through os.Process
		req.reply <- spawnResult{pid: pid}
	}
}

func (r *Reaper) loop() {
	defer close(r.loopDone)
	for {
		select {
		case <-r.sigs:
			r.sweep()
		case <-r.quit:
			return
		}
	}
}

// sweep reaps every child that has exited.
func (r *Reaper) sweep() {
	if r.all {
		failed := 0
		for {
			pid, err := peekExited(unix.P_ALL, 0)
			if err != nil || pid == 0 {
				return
			}
			if r.reap(pid) {
				continue
			}
			// Another sweep reaped it first: look again. A child that cannot be reaped at all
			// would come back every time, so give up on it after a second try.
			if pid == failed {
				return
			}
			failed = pid
		}
	}
	r.mu.Lock()
	pids := make([]int, 0, len(r.kids))
	for pid := range r.kids {
		pids = append(pids, pid)
	}
	r.mu.Unlock()
	for _, pid := range pids {
		if p, err := peekExited(unix.P_PID, pid); err == nil && p == pid {
			r.reap(pid)
		}
	}
}

// reap collects pid's exit status and hands it to its Child. It reports whether pid was reaped.
func (r *Reaper) reap(pid int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	// Look again under the lock: only the lock's holder reaps, so this answer is current.
	if p, err := peekExited(unix.P_PID, pid); err != nil || p != pid {
		return false
	}
	c := r.kids[pid]
	if c != nil && c.killGroup {
		// The exited leader is a zombie until wait4 below, so its group ID still names its group.
		_ = unix.Kill(-pid, unix.SIGKILL)
	}
	var ws unix.WaitStatus
	for {
		got, err := unix.Wait4(pid, &ws, unix.WNOHANG|unix.WALL, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || got != pid {
			return false
		}
		break
	}
	if c == nil {
		r.log.Debug("reaped orphan", "pid", pid, "status", describeStatus(ws))
		if _, ok := r.orphans[pid]; !ok {
			r.orphanOrder = append(r.orphanOrder, pid)
		}
		r.orphans[pid] = ws
		if len(r.orphanOrder) > maxOrphanStatuses {
			delete(r.orphans, r.orphanOrder[0])
			r.orphanOrder = r.orphanOrder[1:]
		}
		return true
	}
	delete(r.kids, pid)
	c.status = ws
	c.exited = true
	close(c.done)
	return true
}

// orphanExit returns the exit status of the orphan pid when this reaper reaped it lately.
func (r *Reaper) orphanExit(pid int) (unix.WaitStatus, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ws, ok := r.orphans[pid]
	return ws, ok
}

// Offsets in siginfo_t: si_code follows si_signo and si_errno; si_pid starts the union that
// follows, aligned like a pointer; si_uid and si_status come after si_pid.
const (
	siginfoCodeOffset   = 8
	siginfoPidOffset    = (12 + unsafe.Sizeof(uintptr(0)) - 1) &^ (unsafe.Sizeof(uintptr(0)) - 1)
	siginfoStatusOffset = siginfoPidOffset + 8
)

// childInfo is what waitid reports about an exited child.
type childInfo struct {
	pid    int
	code   int32 // CLD_EXITED, CLD_KILLED, CLD_DUMPED
	status int32 // exit status or signal
}

// si_code values for SIGCHLD (include/uapi/asm-generic/siginfo.h).
const (
	cldExited = 1
	cldKilled = 2
	cldDumped = 3
)

// describe renders the exit like describeStatus does.
func (ci childInfo) describe() string {
	switch ci.code {
	case cldExited:
		return fmt.Sprintf("exit status %d", ci.status)
	case cldKilled:
		return fmt.Sprintf("killed by signal %s", unix.SignalName(syscall.Signal(ci.status)))
	case cldDumped:
		return fmt.Sprintf("killed by signal %s (core dumped)", unix.SignalName(syscall.Signal(ci.status)))
	default:
		return "exited"
	}
}

// peekChild reports an exited child matching idtype and id without reaping it; pid 0 means none.
func peekChild(idtype, id int) (childInfo, error) {
	for {
		var info unix.Siginfo
		err := unix.Waitid(idtype, id, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT|unix.WALL, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return childInfo{}, err
		}
		p := unsafe.Pointer(&info)
		return childInfo{
			pid:    int(*(*int32)(unsafe.Add(p, siginfoPidOffset))),
			code:   *(*int32)(unsafe.Add(p, siginfoCodeOffset)),
			status: *(*int32)(unsafe.Add(p, siginfoStatusOffset)),
		}, nil
	}
}

// peekExited returns the PID of an exited child matching idtype and id without reaping it, or 0.
func peekExited(idtype, id int) (int, error) {
	ci, err := peekChild(idtype, id)
	return ci.pid, err
}

// Child is a process started by a Reaper.
type Child struct {
	r         *Reaper
	pid       int
	killGroup bool
	done      chan struct{}
	// Set under r.mu before done is closed.
	exited bool
	status unix.WaitStatus
}

// Pid returns the process ID, which is also its process group ID.
func (c *Child) Pid() int { return c.pid }

// Signal sends sig to the child's process group (to the child alone if it left its group). After
// the child has been reaped it returns os.ErrProcessDone and signals nothing.
func (c *Child) Signal(sig syscall.Signal) error {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	if c.exited {
		return os.ErrProcessDone
	}
	err := unix.Kill(-c.pid, sig)
	if errors.Is(err, unix.ESRCH) {
		err = unix.Kill(c.pid, sig)
	}
	if err != nil {
		return fmt.Errorf("signal pid %d: %w", c.pid, err)
	}
	return nil
}

// Done is closed once the child has exited and been reaped.
func (c *Child) Done() <-chan struct{} { return c.done }

// Wait waits for the child to exit; it returns nil for exit status 0 and an *ExitError otherwise.
func (c *Child) Wait() error {
	<-c.done
	if c.status.Exited() && c.status.ExitStatus() == 0 {
		return nil
	}
	return &ExitError{Pid: c.pid, Status: c.status}
}

// ExitError is a child's unsuccessful exit.
type ExitError struct {
	Pid    int             // the child's PID
	Status unix.WaitStatus // its wait status: exit code or signal
}

// Error says how the child ended, e.g. "exit status 1" or "killed by signal SIGKILL".
func (e *ExitError) Error() string { return describeStatus(e.Status) }

func describeStatus(ws unix.WaitStatus) string {
	switch {
	case ws.Exited():
		return fmt.Sprintf("exit status %d", ws.ExitStatus())
	case ws.Signaled() && ws.CoreDump():
		return fmt.Sprintf("killed by signal %s (core dumped)", unix.SignalName(ws.Signal()))
	case ws.Signaled():
		return fmt.Sprintf("killed by signal %s", unix.SignalName(ws.Signal()))
	default:
		return fmt.Sprintf("wait status %#x", uint32(ws))
	}
}

// lastOutput renders a daemon's last lines for an error message.
func lastOutput(lines []string) string {
	if len(lines) == 0 {
		return ""
	}
	return fmt.Sprintf(" (last output: %q)", lines)
}
