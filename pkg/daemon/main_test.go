package daemon_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// helperEnv switches the test binary into a fake daemon; pidFileEnv is where the fake
// persistenced writes its PID.
const (
	helperEnv  = "DAEMON_TEST_HELPER"
	pidFileEnv = "DAEMON_TEST_PIDFILE"
)

// testReaper is the one reaper of this test binary. It reaps every child (All) and is a child
// subreaper, as in the agent, so double-forked fake daemons are adopted and reaped here. Tests share
// it because only one such reaper may exist in a process; it is created and closed by TestMain.
var testReaper *daemon.Reaper

// testReaperLog receives testReaper's log.
var testReaperLog = &hosttest.LogBuffer{}

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helper(mode))
	}
	log := slog.New(slog.NewTextHandler(testReaperLog, &slog.HandlerOptions{Level: slog.LevelDebug}))
	r, err := daemon.NewReaper(daemon.ReaperOptions{Log: log, All: true, Subreaper: true})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	testReaper = r
	code := m.Run()
	if err := r.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "reaper:", err)
		code = 1
	}
	if kids := childrenOf(os.Getpid()); len(kids) > 0 {
		fmt.Fprintf(os.Stderr, "children left after the tests (pid state comm): %v\n", kids)
		code = 1
	}
	if err := goleak.Find(); err != nil {
		fmt.Fprintln(os.Stderr, "goroutines leaked:", err)
		code = 1
	}
	os.Exit(code)
}

// helper is a fake daemon. Its modes are what the acceptance tests need.
func helper(mode string) int {
	name, arg, _ := strings.Cut(mode, "=")
	pid := os.Getpid()
	switch name {
	case "up": // start, say so on both streams, stay up; exit 0 on SIGTERM
		term := notify(syscall.SIGTERM)
		fmt.Printf("daemon up, pid %d\n", pid)
		fmt.Fprintln(os.Stderr, "warning: running on stderr too")
		<-term
		fmt.Println("got SIGTERM, bye")
		return 0
	case "exit": // exit at once, with a reason
		fmt.Fprintln(os.Stderr, "fatal: cannot open /dev/nvidiactl")
		return 3
	case "crash-after": // run for a while, then crash
		d, _ := time.ParseDuration(arg)
		fmt.Printf("up for %s\n", d)
		time.Sleep(d)
		fmt.Fprintln(os.Stderr, "crashing now")
		return 1
	case "crash-on-usr1": // crash when told to
		sig := notify(syscall.SIGUSR1, syscall.SIGTERM)
		fmt.Println("waiting for SIGUSR1")
		if <-sig == syscall.SIGTERM {
			return 0
		}
		fmt.Fprintln(os.Stderr, "crash on request")
		return 1
	case "ignore-term": // only SIGKILL stops it
		signal.Ignore(syscall.SIGTERM)
		never := notify(syscall.SIGUSR2)
		fmt.Println("ignoring SIGTERM")
		<-never
		return 0
	case "group": // leave a grandchild in the process group, then exit or stay
		c, err := spawnSelf("up", false)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		fmt.Printf("grandchild %d\n", c.Pid)
		if arg == "stay" {
			<-notify(syscall.SIGTERM)
			return 0
		}
		time.Sleep(100 * time.Millisecond) // let the grandchild start
		return 1
	case "orphan": // leave an orphan that exits on its own
		c, err := spawnSelf("crash-after=200ms", true)
		if err != nil {
			return 2
		}
		fmt.Printf("orphan %d\n", c.Pid)
		return 0
	case "fork1": // like nvidia-persistenced: fork a daemon into its own session, return 0
		// fork1=<duration>: the daemon writes its PID file that long after the launcher returned.
		c, err := spawnSelf("fork2="+arg, true)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		st, _ := c.Wait()
		fmt.Printf("launcher done (%v)\n", st)
		return 0
	case "fork2": // the middle of the double fork: start the daemon and leave it orphaned
		if _, err := spawnSelf("persist="+arg, false); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		return 0
	case "fork1-fail":
		fmt.Fprintln(os.Stderr, "nvidia-persistenced failed to initialize. Check syslog for more details.")
		return 1
	case "fork1-nopid": // returns success but never starts a daemon
		fmt.Println("started, honest")
		return 0
	case "persist": // the daemon itself: write the PID file, run until SIGTERM, clean up
		term := notify(syscall.SIGTERM)
		if d, err := time.ParseDuration(arg); err == nil {
			time.Sleep(d)
		}
		path := os.Getenv(pidFileEnv)
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(strconv.Itoa(pid)+"\n"), 0o644); err == nil {
			_ = os.Rename(tmp, path)
		}
		fmt.Printf("persistence daemon running, pid %d\n", pid)
		<-term
		_ = os.Remove(path)
		fmt.Println("persistence daemon stopping")
		return 0
	case "sched": // print the scheduling policy it runs with
		a, err := unix.SchedGetAttr(0, 0)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println(a.Policy)
		return 0
	case "child-sched":
		return okOrError(childSched())
	case "own-reapers":
		return okOrError(ownReapers())
	}
	fmt.Fprintf(os.Stderr, "unknown helper mode %q\n", mode)
	return 2
}

// okOrError is a helper mode's end: "ok" and 0, or the error on stderr and 1.
func okOrError(err error) int {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("ok")
	return 0
}

// childSched starts a child through a reaper whose ChildSched is SCHED_BATCH, then one through a
// reaper without: the first child runs in SCHED_BATCH, the second, like this thread, in SCHED_OTHER.
func childSched() error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	own, err := unix.SchedGetAttr(0, 0)
	if err != nil {
		return err
	}
	for _, tc := range []struct {
		sched *host.Sched
		want  string
	}{
		{&host.Sched{Policy: unix.SCHED_BATCH, Nice: own.Nice}, strconv.Itoa(unix.SCHED_BATCH)},
		{nil, strconv.Itoa(unix.SCHED_NORMAL)},
	} {
		r, err := daemon.NewReaper(daemon.ReaperOptions{ChildSched: tc.sched})
		if err != nil {
			return err
		}
		out, err := r.Output(context.Background(), host.Cmd{Path: exe, Env: helperEnviron("sched")})
		if cerr := r.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		if got := strings.TrimSpace(string(out)); got != tc.want {
			return fmt.Errorf("ChildSched %+v: the child runs with policy %s, want %s", tc.sched, got, tc.want)
		}
	}
	if a, err := unix.SchedGetAttr(0, 0); err != nil || a.Policy != own.Policy {
		return fmt.Errorf("this thread: scheduling %+v, %v; want policy %d as before", a, err, own.Policy)
	}
	return nil
}

// ownReapers runs two reapers that reap only their own children side by side.
func ownReapers() error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := func(mode string) host.Cmd {
		return host.Cmd{Path: exe, Env: helperEnviron(mode)}
	}
	a, err := daemon.NewReaper(daemon.ReaperOptions{})
	if err != nil {
		return err
	}
	defer a.Close()
	b, err := daemon.NewReaper(daemon.ReaperOptions{})
	if err != nil {
		return err
	}
	ca, err := a.Start(context.Background(), cmd("exit"), host.StartOptions{})
	if err != nil {
		return err
	}
	cb, err := b.Start(context.Background(), cmd("up"), host.StartOptions{})
	if err != nil {
		return err
	}
	if err := ca.Wait(); err == nil || err.Error() != "exit status 3" {
		return fmt.Errorf("reaper a: Wait() = %v, want exit status 3", err)
	}
	select {
	case <-cb.Done():
		return errors.New("reaper b: the daemon exited by itself")
	default:
	}
	if err := b.Close(); err != nil {
		return err
	}
	if err := cb.Wait(); err == nil || err.Error() != "killed by signal SIGKILL" {
		return fmt.Errorf("reaper b: after Close, Wait() = %v, want killed by SIGKILL", err)
	}
	if _, err := b.Start(context.Background(), cmd("exit"), host.StartOptions{}); !errors.Is(err, daemon.ErrReaperClosed) {
		return fmt.Errorf("Start after Close = %v, want ErrReaperClosed", err)
	}
	return nil
}

// notify catches sigs from now on.
func notify(sigs ...os.Signal) chan os.Signal {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, sigs...)
	return ch
}

// helperEnviron is the environment with the helper switch set to mode (replaced, not added:
// the first of two duplicate variables wins). GORACE keeps a race-enabled helper from sleeping a
// second when it exits.
func helperEnviron(mode string, extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, helperEnv+"=") && !strings.HasPrefix(kv, "GORACE=") {
			env = append(env, kv)
		}
	}
	return append(append(env, helperEnv+"="+mode, "GORACE=atexit_sleep_ms=0"), extra...)
}

// spawnSelf starts this binary (through the name it was started by) in another helper mode.
func spawnSelf(mode string, newSession bool) (*os.Process, error) {
	env := helperEnviron(mode)
	return os.StartProcess(os.Args[0], []string{os.Args[0]}, &os.ProcAttr{
		Env:   env,
		Files: []*os.File{nil, os.Stdout, os.Stderr},
		Sys:   &syscall.SysProcAttr{Setsid: newSession},
	})
}

// fakeCmd runs this test binary as a fake daemon in mode.
func fakeCmd(t *testing.T, mode string, extraEnv ...string) host.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return host.Cmd{Path: exe, Env: helperEnviron(mode, extraEnv...)}
}

// linkedCmd runs this test binary through a symlink named name, so its comm is name.
func linkedCmd(t *testing.T, name, mode string, extraEnv ...string) host.Cmd {
	t.Helper()
	c := fakeCmd(t, mode, extraEnv...)
	link := filepath.Join(t.TempDir(), name)
	if err := os.Symlink(c.Path, link); err != nil {
		t.Fatal(err)
	}
	c.Path = link
	return c
}

// waitLog waits until the log contains s.
func waitLog(t *testing.T, b *hosttest.LogBuffer, s string) {
	t.Helper()
	eventually(t, "log line "+strconv.Quote(s), func() bool { return strings.Contains(b.String(), s) })
}

// eventually polls cond until it holds, failing the test after 20s of real time. It bounds
// waits on other processes; it never stands in for an assertion about durations.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// recorder keeps every state a runner went through.
type recorder struct {
	mu     sync.Mutex
	states []daemon.State
	seen   []daemon.Status
}

func (r *recorder) onChange(st daemon.Status) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, st)
	if n := len(r.states); n == 0 || r.states[n-1] != st.State {
		r.states = append(r.states, st.State)
	}
}

func (r *recorder) States() []daemon.State {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]daemon.State(nil), r.states...)
}

func (r *recorder) Seen() []daemon.Status {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]daemon.Status(nil), r.seen...)
}

// waitState waits for the runner to reach state s.
func waitState(t *testing.T, r *daemon.Runner, s daemon.State) daemon.Status {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		ch := r.Changed()
		st := r.Status()
		if st.State == s {
			return st
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("%s: still %s (want %s); last exit %q, tail %q", st.Name, st.State, s, st.LastExit, st.Tail)
		}
	}
}

// runAsync runs r in the background. stop cancels it and returns Run's result; wait returns
// it without cancelling. Both fail the test when Run does not return within 30s.
func runAsync(t *testing.T, r *daemon.Runner) (stop, wait func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var res error
	go func() {
		res = r.Run(ctx)
		close(done)
	}()
	wait = func() error {
		select {
		case <-done:
			return res
		case <-time.After(30 * time.Second):
			t.Fatal("Run did not return within 30s")
			return nil
		}
	}
	stop = func() error {
		cancel()
		return wait()
	}
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return stop, wait
}

// proc is a process identity that survives PID reuse: its PID and start time.
type proc struct {
	pid   int
	start string
}

// procOf reads pid's start time; ok is false when it does not exist.
func procOf(pid int) (proc, bool) {
	f := statFields(pid)
	if f == nil {
		return proc{}, false
	}
	return proc{pid: pid, start: f[19]}, true
}

// statFields returns /proc/<pid>/stat's fields after the comm (field 3, the state, is [0]).
func statFields(pid int) []string {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(s[i+1:])
}

// alive reports whether p still runs (exists and is not a zombie).
func (p proc) alive() bool {
	f := statFields(p.pid)
	return f != nil && f[19] == p.start && f[0] != "Z"
}

// gone reports whether p no longer exists, not even as a zombie.
func (p proc) gone() bool {
	f := statFields(p.pid)
	return f == nil || f[19] != p.start
}

// mustProc records a running process.
func mustProc(t *testing.T, pid int) proc {
	t.Helper()
	p, ok := procOf(pid)
	if !ok {
		t.Fatalf("pid %d does not exist", pid)
	}
	return p
}

// waitGone waits until p has exited and been reaped (no zombie left).
func waitGone(t *testing.T, p proc) {
	t.Helper()
	eventually(t, fmt.Sprintf("pid %d to be gone", p.pid), p.gone)
}

// childrenOf lists the processes whose parent is pid, zombies included.
func childrenOf(pid int) []string {
	entries, _ := os.ReadDir("/proc")
	var out []string
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		f := statFields(n)
		if f != nil && f[1] == strconv.Itoa(pid) {
			comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", n))
			out = append(out, fmt.Sprintf("%d %s %s", n, f[0], strings.TrimSpace(string(comm))))
		}
	}
	return out
}

// pidsInLog returns the numbers printed after prefix in the log, in order.
func pidsInLog(b *hosttest.LogBuffer, prefix string) []int {
	var out []int
	sc := bufio.NewScanner(strings.NewReader(b.String()))
	for sc.Scan() {
		line := sc.Text()
		i := strings.Index(line, prefix)
		if i < 0 {
			continue
		}
		rest := line[i+len(prefix):]
		j := 0
		for j < len(rest) && rest[j] >= '0' && rest[j] <= '9' {
			j++
		}
		if n, err := strconv.Atoi(rest[:j]); err == nil {
			out = append(out, n)
		}
	}
	return out
}

// sendSignal signals a process by PID, failing the test on error.
func sendSignal(t *testing.T, pid int, sig syscall.Signal) {
	t.Helper()
	if err := unix.Kill(pid, sig); err != nil {
		t.Fatalf("signal %d: %v", pid, err)
	}
}
