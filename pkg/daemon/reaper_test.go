package daemon_test

import (
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// The reaper implements the host seam, so the agent can start every process through it.
var _ host.Procs = (*daemon.Reaper)(nil)

func TestReaperExitStatus(t *testing.T) {
	t.Parallel()
	c, err := testReaper.Start(context.Background(), fakeCmd(t, "exit"), host.StartOptions{})
	if err != nil {
		t.Fatal(err)
	}
	err = c.Wait()
	var ee *daemon.ExitError
	if !errors.As(err, &ee) || !ee.Status.Exited() || ee.Status.ExitStatus() != 3 {
		t.Fatalf("Wait() = %v, want exit status 3", err)
	}
	if err.Error() != "exit status 3" {
		t.Errorf("message %q", err)
	}
	if err := c.Signal(syscall.SIGTERM); !errors.Is(err, os.ErrProcessDone) {
		t.Errorf("Signal after exit = %v, want os.ErrProcessDone", err)
	}
}

func TestReaperSignalledStatus(t *testing.T) {
	t.Parallel()
	c, err := testReaper.Start(context.Background(), fakeCmd(t, "ignore-term"), host.StartOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(); err == nil || err.Error() != "killed by signal SIGKILL" {
		t.Fatalf("Wait() = %v", err)
	}
}

func TestReaperOwnProcessGroup(t *testing.T) {
	t.Parallel()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	c, err := testReaper.Start(context.Background(), fakeCmd(t, "up"), host.StartOptions{Stdout: w})
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	readLine(t, r) // up: its SIGTERM handler is in place
	pgid, err := syscall.Getpgid(c.Pid())
	if err != nil {
		t.Fatal(err)
	}
	if pgid != c.Pid() || pgid == syscall.Getpgrp() {
		t.Errorf("pgid %d, pid %d, ours %d: want a group of its own", pgid, c.Pid(), syscall.Getpgrp())
	}
	p := mustProc(t, c.Pid())
	if err := c.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(); err != nil {
		t.Errorf("Wait() = %v", err)
	}
	waitGone(t, p)
}

// KillGroup: a grandchild left in the group dies with its parent, and no zombie stays. Without
// KillGroup it outlives its parent (a launcher's daemon must).
func TestReaperKillGroup(t *testing.T) {
	t.Parallel()
	for _, kill := range []bool{true, false} {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		c, err := testReaper.Start(context.Background(), fakeCmd(t, "group"), host.StartOptions{Stdout: w, KillGroup: kill})
		w.Close()
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close() // a grandchild writing to a closed pipe would die of SIGPIPE
		line := readLine(t, r)
		pids := pidsIn(line, "grandchild ")
		if len(pids) != 1 {
			t.Fatalf("no grandchild pid in %q", line)
		}
		g := mustProc(t, pids[0])
		if err := c.Wait(); err == nil {
			t.Fatal("the group helper should exit 1")
		}
		if kill {
			waitGone(t, g)
			continue
		}
		readLine(t, r) // the grandchild is up
		if !g.alive() {
			t.Fatal("without KillGroup the grandchild was killed")
		}
		sendSignal(t, g.pid, syscall.SIGKILL)
		waitGone(t, g)
	}
}

func readLine(t *testing.T, f *os.File) string {
	t.Helper()
	_ = f.SetReadDeadline(time.Now().Add(20 * time.Second))
	var out []byte
	b := make([]byte, 1)
	for {
		n, err := f.Read(b)
		if n == 1 {
			if b[0] == '\n' {
				return string(out)
			}
			out = append(out, b[0])
		}
		if err != nil {
			t.Fatalf("read: %v (got %q)", err, out)
		}
	}
}

// An orphan a child leaves behind is adopted (subreaper) and reaped: no zombie.
func TestReaperReapsOrphans(t *testing.T) {
	t.Parallel()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	c, err := testReaper.Start(context.Background(), fakeCmd(t, "orphan"), host.StartOptions{Stdout: w})
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, _ := r.Read(buf)
	pids := pidsIn(string(buf[:n]), "orphan ")
	if len(pids) != 1 {
		t.Fatalf("no orphan pid in %q", buf[:n])
	}
	p, ok := procOf(pids[0])
	if !ok {
		return // already exited and reaped
	}
	waitGone(t, p)
}

func pidsIn(s, prefix string) []int {
	b := &hosttest.LogBuffer{}
	_, _ = b.Write([]byte(s))
	return pidsInLog(b, prefix)
}

func TestReaperOutputLogsStderr(t *testing.T) {
	t.Parallel()
	_, err := testReaper.Output(context.Background(), fakeCmd(t, "exit"))
	if err == nil || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "fatal: cannot open /dev/nvidiactl") {
		t.Fatalf("Output() = %v, want exit status 3 with the last stderr line", err)
	}
	waitLog(t, testReaperLog, "fatal: cannot open /dev/nvidiactl")
}

// Reapers that reap only their own children coexist in one process; Close kills what is left.
// They cannot run beside the shared reaper (which reaps every child), so this runs in a child
// process of its own.
func TestReaperOwnChildrenOnly(t *testing.T) {
	t.Parallel()
	out, err := testReaper.Output(context.Background(), fakeCmd(t, "own-reapers"))
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !strings.Contains(string(out), "ok") {
		t.Fatalf("output %q", out)
	}
}

func TestReaperOutput(t *testing.T) {
	t.Parallel()
	out, err := testReaper.Output(context.Background(), fakeCmd(t, "crash-after=1ms"))
	if err == nil || !strings.Contains(err.Error(), "exit status 1") || !strings.Contains(err.Error(), "crashing now") {
		t.Fatalf("Output error = %v, want exit status 1 with the last stderr line", err)
	}
	if string(out) != "up for 1ms\n" {
		t.Errorf("stdout %q", out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := testReaper.Output(ctx, fakeCmd(t, "ignore-term")); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Output past its deadline = %v", err)
	}
}

func TestReaperMissingProgram(t *testing.T) {
	t.Parallel()
	_, err := testReaper.Start(context.Background(), host.Cmd{Path: "/nonexistent/nvidia-persistenced"}, host.StartOptions{})
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Start = %v, want ErrNotExist", err)
	}
}

func TestSubreaperNeedsAll(t *testing.T) {
	t.Parallel()
	if _, err := daemon.NewReaper(daemon.ReaperOptions{Subreaper: true}); err == nil {
		t.Fatal("a subreaper that reaps only its own children was accepted")
	}
}

// The reaper implements the build runner seam too.
var _ host.Procs = (*daemon.Reaper)(nil)

func TestReaperRunStatusAndOutput(t *testing.T) {
	t.Parallel()
	out, err := os.CreateTemp(t.TempDir(), "out")
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	err = testReaper.Run(context.Background(), fakeCmd(t, "exit"), out)
	var ee *daemon.ExitError
	if !errors.As(err, &ee) || ee.Status.ExitStatus() != 3 {
		t.Fatalf("Run = %v, want exit status 3", err)
	}
	if err := testReaper.Run(context.Background(), fakeCmd(t, "fork1-nopid"), out); err != nil {
		t.Fatalf("Run = %v", err)
	}
	b, _ := os.ReadFile(out.Name())
	if want := "fatal: cannot open /dev/nvidiactl\nstarted, honest\n"; string(b) != want {
		t.Errorf("output %q, want %q", b, want)
	}
	if err := testReaper.Run(context.Background(), host.Cmd{Path: "/nonexistent/make"}, out); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("Run of a missing program = %v, want ENOENT", err)
	}
}

// Cancelling Run kills the child and what it started in its group.
func TestReaperRunCancelKillsGroup(t *testing.T) {
	t.Parallel()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	res := make(chan error, 1)
	go func() { res <- testReaper.Run(ctx, fakeCmd(t, "group=stay"), w); w.Close() }()
	var grandchild int
	for grandchild == 0 {
		line := readLine(t, r)
		if rest, ok := strings.CutPrefix(line, "grandchild "); ok {
			grandchild, _ = strconv.Atoi(rest)
		}
	}
	g := mustProc(t, grandchild)
	for !strings.HasPrefix(readLine(t, r), "daemon up") { // the grandchild's handler is in place
	}
	cancel()
	if err := <-res; !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
	waitGone(t, g)
}

// ChildSched: the children start with the scheduling given, set on the spawner's thread only;
// without it they have the agent's. The reapers involved cannot run beside the shared reaper
// (which reaps every child), so this runs in a child process of its own.
func TestReaperChildSched(t *testing.T) {
	t.Parallel()
	if a, err := unix.SchedGetAttr(0, 0); err != nil || a.Policy != unix.SCHED_NORMAL {
		t.Skipf("the test runs with scheduling %+v, %v; the check needs SCHED_OTHER", a, err)
	}
	out, err := testReaper.Output(context.Background(), fakeCmd(t, "child-sched"))
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !strings.Contains(string(out), "ok") {
		t.Fatalf("output %q", out)
	}
}
