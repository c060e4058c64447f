package host

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Real returns the Host that acts on the running machine and runs processes through procs: the
// agent's reaper, or OSExec where no reaper runs.
func Real(r Roots, procs Procs) Host {
	return Host{Roots: r, Kernel: LinuxKernel{}, Mounter: LinuxMounter{}, Mknoder: LinuxMknoder{}, Files: OSFiles{}, Procs: procs}
}

// LinuxKernel loads modules with finit_module/init_module and removes them with delete_module.
type LinuxKernel struct{}

// LoadModule implements Kernel.
func (LinuxKernel) LoadModule(m ModuleImage) error {
	if m.Data != nil {
		return unix.InitModule(m.Data, m.Params)
	}
	flags := 0
	if m.Compressed {
		flags = unix.MODULE_INIT_COMPRESSED_FILE
	}
	if m.File != nil { // the kernel reads it from the start, whatever the file offset
		return unix.FinitModule(int(m.File.Fd()), m.Params, flags)
	}
	f, err := os.Open(m.Path)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.FinitModule(int(f.Fd()), m.Params, flags)
}

// UnloadModule implements Kernel.
func (LinuxKernel) UnloadModule(name string) error {
	return unix.DeleteModule(name, unix.O_NONBLOCK)
}

// LinuxMounter calls mount(2) and umount2(2).
type LinuxMounter struct{}

// Mount implements Mounter.
func (LinuxMounter) Mount(source, target, fstype string, flags uintptr, data string) error {
	return unix.Mount(source, target, fstype, flags, data)
}

// Unmount implements Mounter.
func (LinuxMounter) Unmount(target string, flags int) error { return unix.Unmount(target, flags) }

// LinuxMknoder calls mknod(2).
type LinuxMknoder struct{}

// Mknod implements Mknoder. The mode is applied exactly, whatever the umask.
func (LinuxMknoder) Mknod(path string, perm os.FileMode, major, minor uint32) error {
	if err := unix.Mknod(path, unix.S_IFCHR|uint32(perm.Perm()), int(unix.Mkdev(major, minor))); err != nil {
		return err
	}
	return os.Chmod(path, perm.Perm())
}

// OSExec implements Procs with os/exec, for the build-time subcommands, which run no reaper. The
// agent itself must not use it: its reaper waits for every child, and os/exec would race it.
type OSExec struct{}

// Start implements Procs.
func (OSExec) Start(_ context.Context, c Cmd, o StartOptions) (Process, error) {
	cmd := exec.Command(c.Path, c.Args...)
	cmd.Env, cmd.Dir = c.Env, c.Dir
	if o.Stdout != nil {
		cmd.Stdout = o.Stdout
	}
	if o.Stderr != nil {
		cmd.Stderr = o.Stderr
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", c.Path, err)
	}
	p := &osProcess{cmd: cmd, done: make(chan struct{})}
	go func() {
		// Wait for the leader to exit without reaping it: while it is a zombie its group ID
		// cannot be reused, so what is left of the group can be killed safely before Wait reaps it.
		var info unix.Siginfo
		for {
			if err := unix.Waitid(unix.P_PID, cmd.Process.Pid, &info, unix.WEXITED|unix.WNOWAIT, nil); !errors.Is(err, unix.EINTR) {
				break
			}
		}
		if o.KillGroup {
			_ = unix.Kill(-cmd.Process.Pid, unix.SIGKILL)
		}
		p.mu.Lock()
		p.err = cmd.Wait()
		p.exited = true
		p.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

type osProcess struct {
	cmd    *exec.Cmd
	done   chan struct{}
	mu     sync.Mutex // held while reaping and signalling, so the PID is never reused under Signal
	exited bool
	err    error
}

func (p *osProcess) Pid() int { return p.cmd.Process.Pid }

// Signal signals the whole process group.
func (p *osProcess) Signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exited {
		return os.ErrProcessDone
	}
	return unix.Kill(-p.cmd.Process.Pid, sig)
}

func (p *osProcess) Done() <-chan struct{} { return p.done }

func (p *osProcess) Wait() error { <-p.done; return p.err }

// Run implements Procs. After the command exits, what is left of its process group is killed
// too, so nothing it started outlives it.
func (e OSExec) Run(ctx context.Context, c Cmd, out *os.File) error {
	return e.run(ctx, c, out, out)
}

func (e OSExec) run(ctx context.Context, c Cmd, stdout, stderr *os.File) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("run %s: %w", c.Path, err)
	}
	p, err := e.Start(ctx, c, StartOptions{Stdout: stdout, Stderr: stderr, KillGroup: true})
	if err != nil {
		return err
	}
	select {
	case <-p.Done():
	case <-ctx.Done():
		_ = p.Signal(unix.SIGKILL)
		<-p.Done()
		return fmt.Errorf("run %s: %w", c.Path, ctx.Err())
	}
	if err := p.Wait(); err != nil {
		return fmt.Errorf("%s: %w", c.Path, err)
	}
	return nil
}

// Output implements Procs; stderr is not logged but its last KiB is part of the error.
func (e OSExec) Output(ctx context.Context, c Cmd) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("run %s: %w", c.Path, err)
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return nil, fmt.Errorf("run %s: %w", c.Path, err)
	}
	var wg sync.WaitGroup
	for _, rd := range []struct {
		r *os.File
		b *bytes.Buffer
	}{{outR, &stdout}, {errR, &stderr}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer rd.r.Close()
			_, _ = io.Copy(rd.b, io.LimitReader(rd.r, 1<<20))
			_, _ = io.Copy(io.Discard, rd.r)
		}()
	}
	runErr := e.run(ctx, c, outW, errW)
	outW.Close()
	errW.Close()
	wg.Wait()
	if runErr != nil {
		if tail := strings.TrimSpace(lastBytes(stderr.Bytes(), 1024)); tail != "" {
			runErr = fmt.Errorf("%w (stderr: %q)", runErr, tail)
		}
		return stdout.Bytes(), runErr
	}
	return stdout.Bytes(), nil
}

func lastBytes(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// SpareProc gives the Go runtime a second P on a machine of one CPU (cpus, runtime.NumCPU: the
// CPUs the process may run on) when environ does not set GOMAXPROCS. The agent spends most of its
// start in system calls (finit_module, mknod, mount, reading /proc and /sys, starting processes);
// with one P the runtime's monitor takes the P from every call that lasts over about 20 µs and
// wakes another thread to look for work that is not there: two thread switches for each call, on
// the one CPU. With a second, idle P it leaves the call its P. It returns whether it raised
// GOMAXPROCS. A CPU limit of one on a larger machine is left alone: there the woken thread runs on
// another CPU, and CPUs could no longer tell the limit.
func SpareProc(environ []string, cpus int) bool {
	for _, kv := range environ {
		if strings.HasPrefix(kv, "GOMAXPROCS=") {
			return false
		}
	}
	if cpus != 1 || runtime.GOMAXPROCS(0) != 1 {
		return false
	}
	runtime.GOMAXPROCS(2)
	return true
}

// Sched is a thread's scheduling policy (unix.SCHED_*) and nice value.
type Sched struct {
	Policy uint32
	Nice   int32
}

// Apply gives the calling goroutine's thread s; nil changes nothing. The goroutine must stay
// locked to its thread (runtime.LockOSThread) for the rest of its life, or others would run with s.
func (s *Sched) Apply() error {
	if s == nil {
		return nil
	}
	if err := unix.SchedSetAttr(0, &unix.SchedAttr{Policy: s.Policy, Nice: s.Nice}, 0); err != nil {
		return fmt.Errorf("set the thread's scheduling policy %d, nice %d: %w", s.Policy, s.Nice, err)
	}
	return nil
}

// BatchThreads puts every thread of the process in SCHED_BATCH on a machine of one CPU (cpus,
// runtime.NumCPU) when the process runs in SCHED_OTHER, and returns the scheduling it had, for the
// thread that starts children (Sched.Apply), so that they get what they would have had; it
// returns nil when it changes nothing. The runtime's monitor thread (sysmon) polls every 20 µs
// for a millisecond, then less and less often, each time it takes a P from a system call that has
// blocked for 10 ms (finit_module, a wait for a child) and each time a system call ends its sleep
// after the agent was idle: in a start on one vCPU about 300 to 600 wakeups, each of which
// preempted the agent's work. A SCHED_BATCH thread that wakes does not preempt the running one; it
// waits for the next tick. Threads started later inherit the policy from the thread that clones
// them (the runtime clones from an unlocked thread, or from its template thread). When it fails
// part of the way it returns the error with the scheduling to give children.
func BatchThreads(cpus int) (*Sched, error) {
	if cpus != 1 {
		return nil, nil
	}
	own, err := unix.SchedGetAttr(0, 0)
	if err != nil {
		return nil, fmt.Errorf("read the scheduling policy: %w", err)
	}
	if own.Policy != unix.SCHED_NORMAL {
		return nil, nil // chosen by whoever started the agent
	}
	s := &Sched{Policy: own.Policy, Nice: own.Nice}
	// A thread cloned while the list is read may copy a thread not yet changed: read it again
	// until a pass changes nothing.
	for pass := 0; ; pass++ {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return s, fmt.Errorf("batch scheduling: %w", err)
		}
		changed := 0
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			a, err := unix.SchedGetAttr(tid, 0)
			if err != nil || a.Policy != unix.SCHED_NORMAL {
				continue // ended, or already changed
			}
			a.Policy = unix.SCHED_BATCH
			if err := unix.SchedSetAttr(tid, a, 0); err != nil && !errors.Is(err, unix.ESRCH) {
				return s, fmt.Errorf("batch scheduling of thread %d: %w", tid, err)
			}
			changed++
		}
		if changed == 0 {
			return s, nil
		}
		if pass == 9 {
			return s, errors.New("batch scheduling: threads are still being started after 10 passes")
		}
	}
}

// CPUs is how many CPUs the process's work may use at once (links, compile jobs): GOMAXPROCS,
// which follows the container's CPU limit, but no more than the CPUs it may run on (SpareProc
// raises GOMAXPROCS above them on a machine of one CPU).
func CPUs() int { return min(runtime.GOMAXPROCS(0), runtime.NumCPU()) }

// Background runs work that must end before Ready but is not on the way to it (storing new
// modules in the cache, installing them in the driver root) on a thread of idle priority, which
// Wait raises back: the work takes the CPU the agent's steps leave idle instead of theirs, and
// once the agent has nothing left but to wait for it, it runs as the agent does, so a busy node
// does not hold Ready back behind other work. The zero value is ready for use; Go runs the work.
type Background struct {
	// Name says what the work is in log lines, e.g. "the cache store".
	Name string
	// Log receives, at debug level, a thread that could not be lowered or raised: the work then
	// runs at the priority it has. Nil discards it.
	Log *slog.Logger

	done   <-chan struct{} // closed when Go's function has returned; nil before Go
	mu     sync.Mutex
	tid    int // the lowered thread, while the goroutine on it runs
	saved  *unix.SchedAttr
	raised bool
}

// Go runs fn in a goroutine of its own, on a thread in SCHED_IDLE that ends with it. Call it
// once, and Wait from the goroutine that called it.
func (b *Background) Go(fn func()) {
	done := make(chan struct{})
	b.done = done
	go func() {
		defer close(done)
		defer b.ended()
		if err := b.lower(); err != nil {
			b.log().Debug(b.Name+" runs at normal priority", "error", err)
		}
		fn()
	}()
}

// Wait returns once Go's function has returned, giving its thread back the priority it had
// (Raise) if it is still running; it returns ctx's error if ctx ends first, and nil at once when
// Go was never called.
func (b *Background) Wait(ctx context.Context) error {
	if b.done == nil {
		return nil
	}
	select {
	case <-b.done:
		return nil
	default:
	}
	if err := b.Raise(); err != nil {
		b.log().Debug(b.Name+" stays at idle priority", "error", err)
	}
	select {
	case <-b.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (b *Background) log() *slog.Logger {
	if b.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return b.Log
}

// lower locks the calling goroutine to its OS thread for the rest of the goroutine's life and
// puts the thread in SCHED_IDLE (Linux schedules each thread on its own), unless Raise came
// first. The goroutine must defer ended, and must not call runtime.UnlockOSThread: the thread
// ends with the goroutine, and its priority with it, so no other goroutine ever runs at that
// priority. In a pod the kernel weighs the threads of the pod's own cgroup against each other,
// so other workloads on the node do not starve it any more than they would the agent.
//
// The kernel's priorities only decide between threads that want a CPU; Go code runs only on a
// thread that holds one of GOMAXPROCS Ps. With one P (one CPU, or a CPU limit of one) the locked
// thread would take the only P for each of its turns in the Go scheduler, and the other
// goroutines would wait for it: so GOMAXPROCS is raised to at least 2, leaving a P for the rest
// of the agent whenever the lowered thread runs Go code.
func (b *Background) lower() error {
	if runtime.GOMAXPROCS(0) < 2 {
		runtime.GOMAXPROCS(2)
	}
	runtime.LockOSThread()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.raised {
		return nil
	}
	tid := unix.Gettid()
	saved, err := unix.SchedGetAttr(tid, 0)
	if err != nil {
		return fmt.Errorf("lower the thread's priority: %w", err)
	}
	if err := unix.SchedSetAttr(tid, &unix.SchedAttr{Policy: unix.SCHED_IDLE}, 0); err != nil {
		return fmt.Errorf("lower the thread's priority: %w", err)
	}
	b.tid, b.saved = tid, saved
	return nil
}

// Raise gives the lowered thread back the priority it had, or keeps the thread Go starts from
// being lowered; once Go's function has returned it does nothing. Wait calls it.
func (b *Background) Raise() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.raised = true
	if b.tid == 0 {
		return nil
	}
	// The thread lives while its goroutine has not called ended, which takes this lock: the ID
	// cannot name another thread yet.
	tid := b.tid
	b.tid = 0
	if err := unix.SchedSetAttr(tid, b.saved, 0); err != nil {
		return fmt.Errorf("raise the background thread's priority: %w", err)
	}
	return nil
}

// ended says the goroutine that called lower is about to end; it defers it.
func (b *Background) ended() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tid = 0
}
