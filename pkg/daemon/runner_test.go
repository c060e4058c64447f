package daemon_test

import (
	"context"
	"errors"
	"io/fs"
	"reflect"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/daemon/daemontest"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

type fixture struct {
	r     *daemon.Runner
	clock *daemontest.Clock
	log   *hosttest.LogBuffer
	rec   *recorder
}

// newRunner makes a runner on a fake clock (nil clock: the wall clock) with a recorded log.
func newRunner(t *testing.T, spec daemon.Spec, fake bool) fixture {
	t.Helper()
	log, buf := hosttest.NewLog()
	f := fixture{log: buf, rec: &recorder{}}
	o := daemon.Options{Procs: testReaper, Log: log, OnChange: f.rec.onChange}
	if fake {
		f.clock = daemontest.NewClock(epoch)
		o.Clock = f.clock
	}
	r, err := daemon.NewRunner(spec, o)
	if err != nil {
		t.Fatal(err)
	}
	f.r = r
	return f
}

func states(s ...daemon.State) []daemon.State { return s }

func assertStates(t *testing.T, rec *recorder, want []daemon.State) {
	t.Helper()
	if got := rec.States(); !reflect.DeepEqual(got, want) {
		t.Errorf("states %v, want %v", got, want)
	}
}

func expectTimer(t *testing.T, c *daemontest.Clock, d time.Duration) *daemontest.Timer {
	t.Helper()
	tm := c.Next(t)
	if tm.D != d {
		t.Fatalf("timer of %s, want %s", tm.D, d)
	}
	return tm
}

func TestRunnerUpLogsAndStops(t *testing.T) {
	t.Parallel()
	f := newRunner(t, daemon.Spec{Name: "fake-fm", Cmd: fakeCmd(t, "up"), StopTimeout: 7 * time.Second}, true)
	stop, _ := runAsync(t, f.r)
	st := waitState(t, f.r, daemon.StateUp)
	p := mustProc(t, st.PID)
	waitLog(t, f.log, `level=INFO msg="warning: running on stderr too" daemon=fake-fm stream=stderr`)
	waitLog(t, f.log, `msg="daemon up, pid `)
	waitLog(t, f.log, `daemon=fake-fm stream=stdout`)

	res := make(chan error, 1)
	go func() { res <- stop() }()
	expectTimer(t, f.clock, 7*time.Second) // SIGTERM sent; the daemon exits on its own
	if err := <-res; err != nil {
		t.Fatalf("Run after stop = %v", err)
	}
	if !p.gone() {
		t.Errorf("pid %d left after Run returned", p.pid)
	}
	assertStates(t, f.rec, states(daemon.StateStarting, daemon.StateUp, daemon.StateStopping, daemon.StateStopped))
	waitLog(t, f.log, "got SIGTERM, bye") // output drained after the exit
	if got := f.r.Status(); got.State != daemon.StateStopped || got.PID != 0 || got.Restarts != 0 {
		t.Errorf("final status %+v", got)
	}
}

// A daemon that exits at once is restarted with doubling, capped backoff, then failed for good.
func TestRunnerExitAtOnceBacksOffThenFails(t *testing.T) {
	t.Parallel()
	spec := daemon.Spec{
		Name: "fake-exit", Cmd: fakeCmd(t, "exit"), Required: true, UpAfter: 2 * time.Second,
		Policy: daemon.Policy{InitialBackoff: time.Second, MaxBackoff: 3 * time.Second, MaxRestarts: 3},
	}
	f := newRunner(t, spec, true)
	_, wait := runAsync(t, f.r)
	for i, want := range []time.Duration{time.Second, 2 * time.Second, 3 * time.Second} {
		up := expectTimer(t, f.clock, 2*time.Second) // never reached: it exits first
		b := expectTimer(t, f.clock, want)
		if !up.Stopped() {
			t.Error("the start delay timer was not stopped")
		}
		st := f.r.Status()
		if st.State != daemon.StateBackingOff || st.Restarts != i || st.LastExit != "exit status 3" {
			t.Fatalf("before restart %d: %+v", i+1, st)
		}
		b.Fire()
	}
	expectTimer(t, f.clock, 2*time.Second)
	err := wait()
	if !errors.Is(err, daemon.ErrGaveUp) || !errors.Is(err, exitcode.ErrDaemon) {
		t.Fatalf("Run = %v, want ErrGaveUp and exitcode.ErrDaemon", err)
	}
	for _, want := range []string{"fake-exit", "after 3 restarts", "exit status 3", "fatal: cannot open /dev/nvidiactl"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	st := f.r.Status()
	if st.State != daemon.StateFailed || st.Restarts != 3 || st.Error != err.Error() || len(st.Tail) == 0 {
		t.Errorf("final status %+v", st)
	}
	assertStates(t, f.rec, states(daemon.StateStarting, daemon.StateBackingOff, daemon.StateStarting, daemon.StateBackingOff,
		daemon.StateStarting, daemon.StateBackingOff, daemon.StateStarting, daemon.StateFailed))
}

// A daemon that crashes after a while: each run lasts at least that long (wall clock), and it is
// failed for good after the restart limit.
func TestRunnerCrashAfter(t *testing.T) {
	t.Parallel()
	const life = 300 * time.Millisecond
	spec := daemon.Spec{
		Name: "fake-crash", Cmd: fakeCmd(t, "crash-after="+life.String()),
		Policy: daemon.Policy{InitialBackoff: 10 * time.Millisecond, MaxRestarts: 2},
	}
	f := newRunner(t, spec, false)
	err := f.r.Run(context.Background())
	if !errors.Is(err, daemon.ErrGaveUp) || !strings.Contains(err.Error(), "exit status 1") || !strings.Contains(err.Error(), "crashing now") {
		t.Fatalf("Run = %v", err)
	}
	assertStates(t, f.rec, states(daemon.StateStarting, daemon.StateUp, daemon.StateBackingOff, daemon.StateStarting, daemon.StateUp,
		daemon.StateBackingOff, daemon.StateStarting, daemon.StateUp, daemon.StateFailed))
	var upAt time.Time
	runs := 0
	prev := daemon.State("")
	for _, st := range f.rec.Seen() {
		if st.State == prev {
			continue
		}
		prev = st.State
		switch st.State {
		case daemon.StateUp:
			upAt = st.Since
			defer waitGone(t, mustProcOrGone(st.PID))
		case daemon.StateBackingOff, daemon.StateFailed:
			if lived := st.Since.Sub(upAt); lived < life {
				t.Errorf("run %d lasted %s, less than the %s the daemon lives", runs+1, lived, life)
			}
			runs++
		}
	}
	if runs != 3 || f.r.Status().Restarts != 2 {
		t.Errorf("%d runs, %d restarts; want 3 and 2", runs, f.r.Status().Restarts)
	}
}

// mustProcOrGone returns pid's identity, or one that reads as gone when it has already exited.
func mustProcOrGone(pid int) proc {
	p, ok := procOf(pid)
	if !ok {
		return proc{pid: pid, start: "gone"}
	}
	return p
}

// A run that lasted ResetAfter makes its exit a first failure again: backoff and count restart.
func TestRunnerResetAfterLongRun(t *testing.T) {
	t.Parallel()
	spec := daemon.Spec{
		Name: "fake-usr1", Cmd: fakeCmd(t, "crash-on-usr1"),
		Policy: daemon.Policy{InitialBackoff: time.Second, MaxBackoff: 8 * time.Second, MaxRestarts: 1, ResetAfter: 10 * time.Second},
	}
	f := newRunner(t, spec, true)
	_, wait := runAsync(t, f.r)
	up := func(n int) int {
		t.Helper()
		st := waitState(t, f.r, daemon.StateUp)
		eventually(t, "crash handler", func() bool { return strings.Count(f.log.String(), "waiting for SIGUSR1") >= n })
		return st.PID
	}
	crash := func(n int) { t.Helper(); sendSignal(t, up(n), syscall.SIGUSR1) }
	crash(1)
	expectTimer(t, f.clock, time.Second).Fire() // first failure
	// Second failure in a row would exceed MaxRestarts, but this run lasts past ResetAfter: the
	// clock moves on while it is up, before it crashes (moving it after the signal raced the
	// runner seeing the exit, which then counted a short run and gave up).
	pid := up(2)
	f.clock.Advance(11 * time.Second)
	sendSignal(t, pid, syscall.SIGUSR1)
	eventually(t, "second run to end", func() bool { return f.r.Status().State == daemon.StateBackingOff })
	expectTimer(t, f.clock, time.Second).Fire()
	crash(3)
	err := wait()
	if !errors.Is(err, daemon.ErrGaveUp) || !strings.Contains(err.Error(), "crash on request") {
		t.Fatalf("Run = %v", err)
	}
	if st := f.r.Status(); st.Restarts != 2 {
		t.Errorf("restarts %d, want 2", st.Restarts)
	}
}

// A daemon that ignores SIGTERM is SIGKILLed when the stop timeout fires, not before.
func TestRunnerIgnoresTERM(t *testing.T) {
	t.Parallel()
	f := newRunner(t, daemon.Spec{Name: "fake-stubborn", Cmd: fakeCmd(t, "ignore-term"), StopTimeout: 5 * time.Second}, true)
	stop, _ := runAsync(t, f.r)
	st := waitState(t, f.r, daemon.StateUp)
	waitLog(t, f.log, "ignoring SIGTERM")
	p := mustProc(t, st.PID)
	res := make(chan error, 1)
	go func() { res <- stop() }()
	tm := expectTimer(t, f.clock, 5*time.Second)
	waitState(t, f.r, daemon.StateStopping)
	if !p.alive() {
		t.Fatal("the daemon died of SIGTERM although it ignores it")
	}
	select {
	case err := <-res:
		t.Fatalf("Run returned before the stop timeout: %v", err)
	default:
	}
	tm.Fire()
	expectTimer(t, f.clock, 5*time.Second) // the wait after SIGKILL
	if err := <-res; err != nil {
		t.Fatalf("Run = %v", err)
	}
	if !p.gone() {
		t.Errorf("pid %d left after Run returned", p.pid)
	}
	waitLog(t, f.log, "did not stop within 5s of SIGTERM, sending SIGKILL")
	assertStates(t, f.rec, states(daemon.StateStarting, daemon.StateUp, daemon.StateStopping, daemon.StateStopped))
}

// The same with the wall clock: the stop takes the timeout, and not much more.
func TestRunnerIgnoresTERMWallClock(t *testing.T) {
	t.Parallel()
	const timeout = 300 * time.Millisecond
	f := newRunner(t, daemon.Spec{Name: "fake-stubborn", Cmd: fakeCmd(t, "ignore-term"), StopTimeout: timeout}, false)
	stop, _ := runAsync(t, f.r)
	st := waitState(t, f.r, daemon.StateUp)
	waitLog(t, f.log, "ignoring SIGTERM")
	p := mustProc(t, st.PID)
	began := time.Now()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	took := time.Since(began)
	if took < timeout || took > timeout+5*time.Second {
		t.Errorf("stop took %s; want the %s timeout, then SIGKILL", took, timeout)
	}
	if !p.gone() {
		t.Errorf("pid %d left", p.pid)
	}
}

// Kill skips the rest of the stop timeout.
func TestRunnerKillHurriesStop(t *testing.T) {
	t.Parallel()
	f := newRunner(t, daemon.Spec{Name: "fake-stubborn", Cmd: fakeCmd(t, "ignore-term"), StopTimeout: time.Hour}, true)
	stop, _ := runAsync(t, f.r)
	st := waitState(t, f.r, daemon.StateUp)
	waitLog(t, f.log, "ignoring SIGTERM")
	p := mustProc(t, st.PID)
	res := make(chan error, 1)
	go func() { res <- stop() }()
	expectTimer(t, f.clock, time.Hour)
	f.r.Kill()
	if err := <-res; err != nil {
		t.Fatal(err)
	}
	waitGone(t, p)
	waitLog(t, f.log, "stop deadline reached, sending SIGKILL")
}

// Stopping takes the whole process group: a grandchild goes too.
func TestRunnerStopTakesGroup(t *testing.T) {
	t.Parallel()
	f := newRunner(t, daemon.Spec{Name: "fake-group", Cmd: fakeCmd(t, "group=stay")}, false)
	stop, _ := runAsync(t, f.r)
	waitState(t, f.r, daemon.StateUp)
	waitLog(t, f.log, "grandchild ")
	g := pidsInLog(f.log, "grandchild ")
	waitLog(t, f.log, "daemon up, pid") // the grandchild's SIGTERM handler is in place
	gp := mustProc(t, g[0])
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	waitGone(t, gp)
}

func TestRunnerReadyProbe(t *testing.T) {
	t.Parallel()
	var ready atomic.Bool
	spec := daemon.Spec{
		Name: "fake-nvlsm", Cmd: fakeCmd(t, "up"), ProbeInterval: 250 * time.Millisecond, StartTimeout: 10 * time.Second,
		Ready: func(context.Context) error {
			if ready.Load() {
				return nil
			}
			return errors.New("no fm_sm_ipc.socket yet")
		},
	}
	f := newRunner(t, spec, true)
	stop, _ := runAsync(t, f.r)
	deadline := expectTimer(t, f.clock, 10*time.Second)
	probe := expectTimer(t, f.clock, 250*time.Millisecond)
	if st := f.r.Status(); st.State != daemon.StateStarting {
		t.Fatalf("state %s before the probe passed", st.State)
	}
	ready.Store(true)
	probe.Fire()
	waitState(t, f.r, daemon.StateUp)
	if !deadline.Stopped() {
		t.Error("start deadline not stopped")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// Not ready within StartTimeout: the process is stopped and the start counts as failed.
func TestRunnerNotReadyInTime(t *testing.T) {
	t.Parallel()
	spec := daemon.Spec{
		Name: "fake-nvlsm", Cmd: fakeCmd(t, "up"), StartTimeout: 10 * time.Second, Policy: daemon.Policy{MaxRestarts: -1},
		Ready: func(context.Context) error { return errors.New("no fm_sm_ipc.socket yet") },
	}
	f := newRunner(t, spec, true)
	_, wait := runAsync(t, f.r)
	deadline := expectTimer(t, f.clock, 10*time.Second)
	expectTimer(t, f.clock, 500*time.Millisecond)
	st := f.r.Status()
	p := mustProc(t, st.PID)
	deadline.Fire()
	err := wait()
	if !errors.Is(err, daemon.ErrGaveUp) || !strings.Contains(err.Error(), "not ready within 10s: no fm_sm_ipc.socket yet") {
		t.Fatalf("Run = %v", err)
	}
	waitGone(t, p)
}

func TestRunnerMissingProgram(t *testing.T) {
	t.Parallel()
	calls := 0
	spec := daemon.Spec{
		Name: "nv-fabricmanager", Cmd: host.Cmd{Path: "/nonexistent/nv-fabricmanager"},
		Prepare: func() error { calls++; return nil },
		Policy:  daemon.Policy{InitialBackoff: time.Second, MaxRestarts: 1},
	}
	f := newRunner(t, spec, true)
	_, wait := runAsync(t, f.r)
	expectTimer(t, f.clock, time.Second).Fire()
	err := wait()
	if !errors.Is(err, fs.ErrNotExist) || !errors.Is(err, daemon.ErrGaveUp) {
		t.Fatalf("Run = %v", err)
	}
	if calls != 2 {
		t.Errorf("Prepare ran %d times, want once per start (2)", calls)
	}
}

func TestRunnerPrepareFailure(t *testing.T) {
	t.Parallel()
	spec := daemon.Spec{
		Name: "fake", Cmd: fakeCmd(t, "up"), Policy: daemon.Policy{MaxRestarts: -1},
		Prepare: func() error { return errors.New("cannot create /var/run/nvidia-fabricmanager") },
	}
	f := newRunner(t, spec, true)
	err := f.r.Run(context.Background())
	if !errors.Is(err, daemon.ErrGaveUp) || !strings.Contains(err.Error(), "prepare: cannot create") {
		t.Fatalf("Run = %v", err)
	}
}

func TestRunnerSpecChecks(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		spec daemon.Spec
		o    daemon.Options
	}{
		{"no name", daemon.Spec{Cmd: host.Cmd{Path: "/bin/true"}}, daemon.Options{Procs: testReaper}},
		{"no command", daemon.Spec{Name: "x"}, daemon.Options{Procs: testReaper}},
		{"no reaper", daemon.Spec{Name: "x", Cmd: host.Cmd{Path: "/bin/true"}}, daemon.Options{}},
	} {
		if _, err := daemon.NewRunner(tc.spec, tc.o); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

func TestRunnerRunTwice(t *testing.T) {
	t.Parallel()
	f := newRunner(t, daemon.Spec{Name: "fake", Cmd: fakeCmd(t, "up")}, true)
	stop, _ := runAsync(t, f.r)
	waitState(t, f.r, daemon.StateUp)
	if err := f.r.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "already running") {
		t.Errorf("second Run = %v", err)
	}
	go func() { f.clock.Next(t) }() // the stop timer
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

func TestRunnerCancelledBeforeStart(t *testing.T) {
	t.Parallel()
	f := newRunner(t, daemon.Spec{Name: "fake", Cmd: fakeCmd(t, "up")}, true)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := f.r.Run(ctx); err != nil {
		t.Fatal(err)
	}
	assertStates(t, f.rec, states(daemon.StateStopped))
}

// TestRunnerThroughFakeProcs: the runner needs only host.Procs. It starts the daemon through it,
// restarts it after a crash, and stops it with SIGTERM to what it started.
func TestRunnerThroughFakeProcs(t *testing.T) {
	t.Parallel()
	procs := &hosttest.FakeProcs{}
	spec := daemon.Spec{Name: "fake", Cmd: host.Cmd{Path: "/usr/bin/nvidia-persistenced", Args: []string{"--verbose"}},
		Policy: daemon.Policy{InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond, MaxRestarts: 1}}
	r, err := daemon.NewRunner(spec, daemon.Options{Procs: procs})
	if err != nil {
		t.Fatal(err)
	}
	stop, _ := runAsync(t, r)
	first := waitState(t, r, daemon.StateUp)
	started := procs.Started()
	if len(started) != 1 || first.PID != started[0].Pid() || started[0].Cmd.Args[0] != "--verbose" {
		t.Fatalf("up as pid %d; started %+v", first.PID, started)
	}
	started[0].Exit(errors.New("exit status 1"))
	deadline := time.After(20 * time.Second) // a guard against a hang, not a timed assertion
	for {
		ch := r.Changed()
		st := r.Status()
		if st.State == daemon.StateUp && st.PID != first.PID {
			if st.Restarts != 1 || st.LastExit != "exit status 1" {
				t.Errorf("after the crash: %+v", st)
			}
			break
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("not restarted: %+v", st)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("stop = %v", err)
	}
	started = procs.Started()
	if len(started) != 2 || len(procs.Running()) != 0 || !reflect.DeepEqual(started[1].Signals(), []syscall.Signal{syscall.SIGTERM}) {
		t.Fatalf("after stop: %d started, %d running, signals %v; want SIGTERM to the second", len(started), len(procs.Running()), started[1].Signals())
	}
}
