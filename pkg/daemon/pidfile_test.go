package daemon_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// persistencedSpec runs the fake nvidia-persistenced in mode: started through a symlink of that
// name (so its comm is nvidia-persiste, as the real one's), forking into the background and
// writing its PID file.
func persistencedSpec(t *testing.T, mode string) (daemon.Spec, string) {
	t.Helper()
	pidFile := filepath.Join(t.TempDir(), "nvidia-persistenced.pid")
	return daemon.Spec{
		Name:          "nvidia-persistenced",
		Cmd:           linkedCmd(t, "nvidia-persistenced", mode, pidFileEnv+"="+pidFile),
		Required:      true,
		PIDFile:       pidFile,
		ProbeInterval: 10 * time.Millisecond,
		StartTimeout:  20 * time.Second,
		StopTimeout:   5 * time.Second,
		Policy:        daemon.Policy{InitialBackoff: 10 * time.Millisecond},
	}, pidFile
}

func readPID(t *testing.T, path string) int {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// TestPIDFileWrittenAfterTheLauncher: the daemon writes its PID file 300 ms after the launcher
// returned, and the probe interval is an hour: the start notices the file when it is written
// (inotify on its directory), not at the next probe.
func TestPIDFileWrittenAfterTheLauncher(t *testing.T) {
	t.Parallel()
	spec, pidFile := persistencedSpec(t, "fork1=300ms")
	spec.ProbeInterval = time.Hour
	f := newRunner(t, spec, false)
	stop, _ := runAsync(t, f.r)
	waitLog(t, f.log, "launcher done")
	if _, err := os.Stat(pidFile); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the PID file is there when the launcher is done (%v); the wait below would prove nothing", err)
	}
	st := waitState(t, f.r, daemon.StateUp)
	if got := readPID(t, pidFile); got != st.PID {
		t.Errorf("up with pid %d, the PID file says %d", st.PID, got)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run = %v", err)
	}
}

func TestPIDFileDaemon(t *testing.T) {
	t.Parallel()
	spec, pidFile := persistencedSpec(t, "fork1")
	f := newRunner(t, spec, false)
	stop, _ := runAsync(t, f.r)
	st := waitState(t, f.r, daemon.StateUp)
	d := mustProc(t, st.PID)
	if got := readPID(t, pidFile); got != st.PID {
		t.Errorf("up with pid %d, the PID file says %d", st.PID, got)
	}
	launcher := f.rec.Seen()[0]
	if launcher.State != daemon.StateStarting || launcher.PID == st.PID {
		t.Errorf("first status %+v: want starting with the launcher's pid", launcher)
	}
	if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", st.PID)); strings.TrimSpace(string(comm)) != "nvidia-persiste" {
		t.Errorf("comm %q", comm)
	}
	if ppid := statFields(st.PID)[1]; ppid != strconv.Itoa(os.Getpid()) {
		t.Errorf("the daemon's parent is %s, want the subreaper %d", ppid, os.Getpid())
	}
	// The daemon kept the launcher's stdout: its output is captured too.
	waitLog(t, f.log, fmt.Sprintf("persistence daemon running, pid %d", st.PID))
	waitLog(t, f.log, "launcher done")

	if err := stop(); err != nil {
		t.Fatalf("Run = %v", err)
	}
	if !d.gone() {
		t.Errorf("pid %d left (or a zombie) after Run returned", d.pid)
	}
	if _, err := os.Stat(pidFile); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("PID file after a clean stop: %v", err)
	}
	waitLog(t, f.log, "persistence daemon stopping")
	assertStates(t, f.rec, states(daemon.StateStarting, daemon.StateUp, daemon.StateStopping, daemon.StateStopped))
}

// The daemon's exit, seen through its pidfd, is a crash: it is restarted.
func TestPIDFileDaemonCrashRestarts(t *testing.T) {
	t.Parallel()
	spec, _ := persistencedSpec(t, "fork1")
	f := newRunner(t, spec, false)
	stop, _ := runAsync(t, f.r)
	first := waitState(t, f.r, daemon.StateUp)
	p1 := mustProc(t, first.PID)
	sendSignal(t, first.PID, syscall.SIGKILL)
	waitState(t, f.r, daemon.StateBackingOff)
	st := waitState(t, f.r, daemon.StateUp)
	if st.PID == first.PID || st.Restarts != 1 {
		t.Errorf("after the crash: %+v", st)
	}
	if want := fmt.Sprintf("pid %d killed by signal SIGKILL", first.PID); st.LastExit != want {
		t.Errorf("last exit %q, want %q", st.LastExit, want)
	}
	waitGone(t, p1)
	p2 := mustProc(t, st.PID)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if !p2.gone() {
		t.Errorf("pid %d left", p2.pid)
	}
}

// A PID file left behind naming an unrelated process: that process is never signalled.
func TestPIDFileStaleUnrelatedProcess(t *testing.T) {
	t.Parallel()
	sleepPath, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep binary")
	}
	sl, err := testReaper.Start(context.Background(), host.Cmd{Path: sleepPath, Args: []string{"1000"}}, host.StartOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = sl.Signal(syscall.SIGKILL)
		<-sl.Done()
	}()
	spec, pidFile := persistencedSpec(t, "fork1")
	if err := os.WriteFile(pidFile, []byte(strconv.Itoa(sl.Pid())+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f := newRunner(t, spec, false)
	stop, _ := runAsync(t, f.r)
	st := waitState(t, f.r, daemon.StateUp)
	if st.PID == sl.Pid() {
		t.Fatalf("took the unrelated pid %d for the daemon", sl.Pid())
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-sl.Done():
		t.Fatalf("the unrelated process was signalled: %v", sl.Wait())
	default:
	}
	if p := mustProc(t, sl.Pid()); !p.alive() {
		t.Fatal("the unrelated process is not running")
	}
	waitLog(t, f.log, "removing a stale PID file that names another program; that process is left alone")
	waitLog(t, f.log, fmt.Sprintf("pid %d runs sleep, not nvidia-persistenced", sl.Pid()))
}

// A PID file left by an earlier run whose daemon still runs: that daemon is stopped first.
func TestPIDFileStaleSameProgram(t *testing.T) {
	t.Parallel()
	spec, pidFile := persistencedSpec(t, "fork1")
	oldCmd := spec.Cmd
	oldCmd.Env = helperEnviron("persist", pidFileEnv+"="+pidFile)
	old, err := testReaper.Start(context.Background(), oldCmd, host.StartOptions{})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the old daemon's PID file", func() bool {
		data, _ := os.ReadFile(pidFile)
		return strings.TrimSpace(string(data)) == strconv.Itoa(old.Pid())
	})
	f := newRunner(t, spec, false)
	stop, _ := runAsync(t, f.r)
	st := waitState(t, f.r, daemon.StateUp)
	if st.PID == old.Pid() {
		t.Fatal("adopted the old daemon instead of starting a new one")
	}
	select {
	case <-old.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the old daemon was not stopped")
	}
	if err := old.Wait(); err != nil {
		t.Errorf("the old daemon did not exit cleanly on SIGTERM: %v", err)
	}
	waitLog(t, f.log, "stopping the daemon an earlier run left")
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// A PID file naming a process that is gone is removed.
func TestPIDFileStaleDeadPID(t *testing.T) {
	t.Parallel()
	gone, err := testReaper.Start(context.Background(), fakeCmd(t, "exit"), host.StartOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_ = gone.Wait()
	spec, pidFile := persistencedSpec(t, "fork1")
	if err := os.WriteFile(pidFile, []byte(strconv.Itoa(gone.Pid())), 0o644); err != nil {
		t.Fatal(err)
	}
	f := newRunner(t, spec, false)
	stop, _ := runAsync(t, f.r)
	waitState(t, f.r, daemon.StateUp)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(f.log.String(), "removing a stale PID file: its process is gone") &&
		!strings.Contains(f.log.String(), "names another program") { // the PID was reused meanwhile
		t.Errorf("no stale PID file record in %s", f.log)
	}
}

func TestPIDFileGarbage(t *testing.T) {
	t.Parallel()
	spec, pidFile := persistencedSpec(t, "fork1")
	if err := os.WriteFile(pidFile, []byte("not a pid\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f := newRunner(t, spec, false)
	stop, _ := runAsync(t, f.r)
	waitState(t, f.r, daemon.StateUp)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	waitLog(t, f.log, "removing an unreadable PID file")
}

func TestPIDFileLauncherFails(t *testing.T) {
	t.Parallel()
	spec, _ := persistencedSpec(t, "fork1-fail")
	spec.Policy.MaxRestarts = -1
	f := newRunner(t, spec, false)
	err := f.r.Run(t.Context())
	for _, want := range []string{"exited before going into the background: exit status 1", "nvidia-persistenced failed to initialize"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Run = %v, want %q in it", err, want)
		}
	}
}

// The launcher returns success but no daemon writes the PID file: the start fails at StartTimeout.
func TestPIDFileNeverWritten(t *testing.T) {
	t.Parallel()
	spec, _ := persistencedSpec(t, "fork1-nopid")
	spec.Policy.MaxRestarts = -1
	f := newRunner(t, spec, true)
	_, wait := runAsync(t, f.r)
	deadline := expectTimer(t, f.clock, 20*time.Second)
	expectTimer(t, f.clock, 10*time.Millisecond) // the launcher returned; polling the PID file
	deadline.Fire()
	err := wait()
	if err == nil || !strings.Contains(err.Error(), "no running nvidia-persistenced in ") || !strings.Contains(err.Error(), "within 20s") {
		t.Fatalf("Run = %v", err)
	}
}
