package host_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/host"
)

// The os/exec one implements Procs, as the agent's reaper (package daemon), the recorder and
// hosttest's fake do.
var (
	_ host.Procs = host.OSExec{}
	_ host.Procs = (*host.Recorder)(nil)
)

func shell(t *testing.T, script string) host.Cmd {
	t.Helper()
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Fatalf("no sh: %v", err)
	}
	return host.Cmd{Path: sh, Args: []string{"-c", script}}
}

func tempOut(t *testing.T) *os.File {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "out")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func TestOSExecRunOutputAndStatus(t *testing.T) {
	t.Parallel()
	out := tempOut(t)
	err := host.OSExec{}.Run(context.Background(), shell(t, "echo to-stdout; echo to-stderr >&2; exit 3"), out)
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 3 {
		t.Fatalf("Run = %v, want exit status 3", err)
	}
	b, _ := os.ReadFile(out.Name())
	if string(b) != "to-stdout\nto-stderr\n" {
		t.Errorf("output %q", b)
	}
	if err := (host.OSExec{}).Run(context.Background(), shell(t, "true"), out); err != nil {
		t.Errorf("Run(true) = %v", err)
	}
}

func TestOSExecOutput(t *testing.T) {
	t.Parallel()
	out, err := host.OSExec{}.Output(context.Background(), shell(t, "echo to-stdout; echo to-stderr >&2"))
	if err != nil || string(out) != "to-stdout\n" {
		t.Fatalf("Output = %q, %v; want only stdout", out, err)
	}
	_, err = host.OSExec{}.Output(context.Background(), shell(t, "echo undefined reference >&2; exit 1"))
	if err == nil || !strings.Contains(err.Error(), "exit status 1") || !strings.Contains(err.Error(), "undefined reference") {
		t.Fatalf("Output = %v, want exit status 1 with stderr", err)
	}
}

func TestOSExecStartSignal(t *testing.T) {
	t.Parallel()
	p, err := host.OSExec{}.Start(context.Background(), shell(t, "exec sleep 300"), host.StartOptions{KillGroup: true})
	if err != nil {
		t.Fatal(err)
	}
	if pgid, err := syscall.Getpgid(p.Pid()); err != nil || pgid != p.Pid() {
		t.Errorf("pgid %d (%v), pid %d: want a group of its own", pgid, err, p.Pid())
	}
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-p.Done()
	if err := p.Wait(); err == nil || !strings.Contains(err.Error(), "terminated") {
		t.Errorf("Wait = %v, want killed by SIGTERM", err)
	}
	if err := p.Signal(syscall.SIGTERM); !errors.Is(err, os.ErrProcessDone) {
		t.Errorf("Signal after exit = %v, want os.ErrProcessDone", err)
	}
}

func TestOSExecRunStartError(t *testing.T) {
	t.Parallel()
	err := host.OSExec{}.Run(context.Background(), host.Cmd{Path: "/nonexistent/make"}, tempOut(t))
	if !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("Run = %v, want ENOENT", err)
	}
}

// What a command leaves in its process group is killed when it exits and when ctx ends.
func TestOSExecRunKillsGroup(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		script string
		cancel bool
	}{
		{"exit", "sleep 300 & echo $!", false},
		{"cancel", "sleep 300 & echo $!; wait", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r, w, err := os.Pipe()
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			res := make(chan error, 1)
			go func() { res <- host.OSExec{}.Run(ctx, shell(t, tc.script), w); w.Close() }()
			line, err := bufio.NewReader(r).ReadString('\n')
			if err != nil {
				t.Fatalf("read the child's pid: %v", err)
			}
			pid, err := strconv.Atoi(strings.TrimSpace(line))
			if err != nil {
				t.Fatal(err)
			}
			if tc.cancel {
				cancel()
			}
			err = <-res
			if tc.cancel && !errors.Is(err, context.Canceled) {
				t.Errorf("Run = %v, want context.Canceled", err)
			}
			if !tc.cancel && err != nil {
				t.Errorf("Run = %v", err)
			}
			waitNotRunning(t, pid)
		})
	}
}

// waitNotRunning waits until pid has exited (a zombie left to init counts as exited).
func waitNotRunning(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return
		}
		s := string(b)
		if i := strings.LastIndexByte(s, ')'); i >= 0 && strings.HasPrefix(s[i+1:], " Z") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d still runs: %s", pid, s)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// threadPolicy reads a thread's scheduling policy and nice value; ok is false once it is gone.
func threadPolicy(tid int) (policy uint32, nice int32, ok bool) {
	a, err := unix.SchedGetAttr(tid, 0)
	if err != nil {
		return 0, 0, false
	}
	return a.Policy, a.Nice, true
}

// TestBackground: Go runs its function in a goroutine of its own whose thread is put at idle
// priority, leaves the test's own thread as it was, and leaves the process at least two Ps (one
// for the rest when the lowered thread runs); Raise gives the thread back the policy and nice
// value it had; Wait returns ctx's error while the function runs and nil once it has returned;
// the thread ends with the goroutine, and a Raise after the end, or a Go after Raise, lowers
// nothing. Wait raises a thread still lowered; a Background never started waits for nothing.
func TestBackground(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))      // as on a node with one CPU
	ownPolicy, ownNice, _ := threadPolicy(unix.Gettid()) // whatever the test runs at (nice make lint, ...)
	var logged bytes.Buffer                              // written by Go's goroutine before its function runs, read after
	bg := host.Background{Name: "the test's work", Log: slog.New(slog.NewTextHandler(&logged, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	type lowered struct {
		tid    int
		policy uint32
	}
	low, raised := make(chan lowered), make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(raised) }) }
	defer release() // the goroutine ends even when the test stops early
	bg.Go(func() {
		tid := unix.Gettid()
		p, _, _ := threadPolicy(tid)
		low <- lowered{tid, p}
		<-raised
	})
	l := <-low
	if l.policy != unix.SCHED_IDLE {
		t.Fatalf("the thread's policy is %d, want SCHED_IDLE (%d); log: %s", l.policy, unix.SCHED_IDLE, logged.String())
	}
	if l.tid == unix.Gettid() {
		t.Error("Go's function ran on the test's thread")
	}
	if p, n, _ := threadPolicy(unix.Gettid()); p != ownPolicy || n != ownNice {
		t.Errorf("the test's own thread has policy %d nice %d, want %d %d as before", p, n, ownPolicy, ownNice)
	}
	if n := runtime.GOMAXPROCS(0); n < 2 {
		t.Errorf("GOMAXPROCS is %d after Go, want at least 2", n)
	}
	if err := bg.Raise(); err != nil {
		if errors.Is(err, unix.EPERM) && os.Geteuid() != 0 {
			release()
			t.Skipf("Raise: %v: leaving SCHED_IDLE takes CAP_SYS_NICE; run as root (CI does)", err)
		}
		t.Fatalf("Raise: %v", err)
	}
	if p, n, _ := threadPolicy(l.tid); p != ownPolicy || n != ownNice {
		t.Errorf("after Raise the thread has policy %d nice %d, want %d %d", p, n, ownPolicy, ownNice)
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if err := bg.Wait(cancelled); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait with its function running and ctx ended = %v, want context.Canceled", err)
	}
	release()
	if err := bg.Wait(context.Background()); err != nil {
		t.Fatalf("Wait: %v", err)
	}
	if err := bg.Raise(); err != nil {
		t.Errorf("Raise after the end: %v", err)
	}
	if strings.Contains(logged.String(), "priority") {
		t.Errorf("the thread's priority was not changed as asked; log: %s", logged.String())
	}
	// On the main thread the runtime cannot end the thread; it parks it for good instead, and no
	// goroutine runs there again.
	deadline := time.Now().Add(10 * time.Second)
	for l.tid != os.Getpid() {
		if _, _, ok := threadPolicy(l.tid); !ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("thread %d outlived its goroutine: another goroutine could run at its priority", l.tid)
		}
		time.Sleep(10 * time.Millisecond)
	}

	// Wait raises a thread still lowered before it waits.
	var waited host.Background
	tids, stop := make(chan int), make(chan struct{})
	waited.Go(func() {
		tids <- unix.Gettid()
		<-stop
	})
	tid := <-tids
	waitErr := make(chan error, 1)
	go func() { waitErr <- waited.Wait(context.Background()) }()
	for deadline = time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if p, n, _ := threadPolicy(tid); p == ownPolicy && n == ownNice {
			break
		}
		if time.Now().After(deadline) {
			close(stop)
			t.Fatal("Wait did not raise the lowered thread")
		}
	}
	close(stop)
	if err := <-waitErr; err != nil {
		t.Errorf("Wait: %v", err)
	}

	// Raise before Go: the thread is never lowered.
	var early host.Background
	early.Log = bg.Log
	if err := early.Raise(); err != nil {
		t.Fatalf("Raise before Go: %v", err)
	}
	res := make(chan uint32, 1)
	early.Go(func() {
		p, _, _ := threadPolicy(unix.Gettid())
		res <- p
	})
	if err := early.Wait(context.Background()); err != nil {
		t.Errorf("Wait: %v", err)
	}
	if p := <-res; p != ownPolicy {
		t.Errorf("Go after Raise set policy %d, want %d", p, ownPolicy)
	}
	if strings.Contains(logged.String(), "priority") {
		t.Errorf("Go after Raise logged a priority change; log: %s", logged.String())
	}

	// A Background never started has nothing to wait for.
	var idle host.Background
	if err := idle.Wait(cancelled); err != nil {
		t.Errorf("Wait without Go = %v, want nil", err)
	}
}

// TestSpareProc: one P becomes two on a machine of one CPU unless the environment sets
// GOMAXPROCS; more Ps, or more CPUs, are left alone; CPUs stays at the CPUs the process may run on.
func TestSpareProc(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, tc := range []struct {
		procs, cpus int
		environ     []string
		raised      bool
		want        int
	}{
		{1, 1, []string{"PATH=/bin"}, true, 2},
		{1, 1, []string{"GOMAXPROCS=1"}, false, 1},
		{1, 8, nil, false, 1},
		{4, 1, nil, false, 4},
	} {
		runtime.GOMAXPROCS(tc.procs)
		if got := host.SpareProc(tc.environ, tc.cpus); got != tc.raised || runtime.GOMAXPROCS(0) != tc.want {
			t.Errorf("GOMAXPROCS %d, %d CPUs, environ %q: SpareProc = %v and GOMAXPROCS %d; want %v and %d",
				tc.procs, tc.cpus, tc.environ, got, runtime.GOMAXPROCS(0), tc.raised, tc.want)
		}
		if want := min(tc.want, runtime.NumCPU()); host.CPUs() != want {
			t.Errorf("GOMAXPROCS %d: CPUs = %d, want %d", runtime.GOMAXPROCS(0), host.CPUs(), want)
		}
	}
}

// TestBatchThreads: on one CPU every thread of the process goes to SCHED_BATCH with its nice
// value, and so do threads started later; the Sched returned gives a locked thread back
// SCHED_OTHER, and a child started there has it while one started elsewhere has SCHED_BATCH; more
// CPUs, or a process no longer in SCHED_OTHER, are left alone. BatchThreads changes the whole
// process, so the test runs in a child process of the test binary.
func TestBatchThreads(t *testing.T) {
	if os.Getenv("DRIVER_AGENT_TEST_BATCH") != "1" {
		if p, _, _ := threadPolicy(unix.Gettid()); p != unix.SCHED_NORMAL {
			t.Skipf("the test runs with scheduling policy %d, which BatchThreads leaves alone", p)
		}
		cmd := exec.Command(os.Args[0], "-test.run=^TestBatchThreads$", "-test.v")
		cmd.Env = append(os.Environ(), "DRIVER_AGENT_TEST_BATCH=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: TestBatchThreads") {
			t.Fatalf("the test in a child process failed (%v):\n%s", err, out)
		}
		return
	}
	_, nice, _ := threadPolicy(unix.Gettid())
	policies := func() map[int]uint32 {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			t.Fatal(err)
		}
		m := map[int]uint32{}
		for _, e := range tasks {
			tid, _ := strconv.Atoi(e.Name())
			if p, n, ok := threadPolicy(tid); ok {
				m[tid] = p
				if n != nice {
					t.Errorf("thread %d has nice %d, want %d", tid, n, nice)
				}
			}
		}
		return m
	}
	if s, err := host.BatchThreads(2); s != nil || err != nil {
		t.Fatalf("BatchThreads(2) = %+v, %v; want nil, nil", s, err)
	}
	for tid, p := range policies() {
		if p != unix.SCHED_NORMAL {
			t.Fatalf("after BatchThreads(2) thread %d has policy %d", tid, p)
		}
	}
	s, err := host.BatchThreads(1)
	if err != nil || s == nil || *s != (host.Sched{Policy: unix.SCHED_NORMAL, Nice: nice}) {
		t.Fatalf("BatchThreads(1) = %+v, %v; want the process's SCHED_OTHER and nice %d", s, err, nice)
	}
	// Locked goroutines each hold a thread, so the runtime starts new ones for them.
	release := make(chan struct{})
	var locked, wg sync.WaitGroup
	for range 4 {
		locked.Add(1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			locked.Done()
			<-release
		}()
	}
	locked.Wait()
	all := policies()
	close(release)
	wg.Wait()
	for tid, p := range all {
		if p != unix.SCHED_BATCH {
			t.Errorf("thread %d has policy %d, want SCHED_BATCH (%d)", tid, p, unix.SCHED_BATCH)
		}
	}
	if len(all) < 5 {
		t.Errorf("%d threads; the locked goroutines should have needed more", len(all))
	}

	// child starts a process from the calling thread and returns its policy; it may run off the
	// test's goroutine, so it returns errors instead of failing the test.
	child := func() (uint32, error) {
		cmd := exec.Command("sleep", "30")
		if err := cmd.Start(); err != nil {
			return 0, err
		}
		defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
		p, _, ok := threadPolicy(cmd.Process.Pid)
		if !ok {
			return 0, fmt.Errorf("no policy for child %d", cmd.Process.Pid)
		}
		return p, nil
	}
	type result struct {
		thread, child uint32
		err           error
	}
	res := make(chan result)
	go func() { // locked for good: the thread ends with the goroutine
		runtime.LockOSThread()
		if err := s.Apply(); err != nil {
			res <- result{err: fmt.Errorf("Apply: %w", err)}
			return
		}
		p, _, _ := threadPolicy(unix.Gettid())
		c, err := child()
		res <- result{p, c, err}
	}()
	if r := <-res; r.err != nil {
		t.Error(r.err)
	} else if r.thread != unix.SCHED_NORMAL || r.child != unix.SCHED_NORMAL {
		t.Errorf("after Apply the thread has policy %d and its child %d, want SCHED_OTHER (0) for both", r.thread, r.child)
	}
	if p, err := child(); err != nil {
		t.Error(err)
	} else if p != unix.SCHED_BATCH {
		t.Errorf("a child started from another thread has policy %d, want SCHED_BATCH (%d)", p, unix.SCHED_BATCH)
	}
	if s, err := host.BatchThreads(1); s != nil || err != nil {
		t.Errorf("BatchThreads(1) in SCHED_BATCH = %+v, %v; want nil, nil (left alone)", s, err)
	}
	if err := (*host.Sched)(nil).Apply(); err != nil {
		t.Errorf("nil Apply: %v", err)
	}
}
