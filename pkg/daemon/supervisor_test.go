package daemon_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

func newSupervisor(t *testing.T) (*daemon.Supervisor, *hosttest.LogBuffer, *recorder) {
	t.Helper()
	log, buf := hosttest.NewLog()
	rec := &recorder{}
	s := daemon.NewSupervisor(daemon.Options{Procs: testReaper, Log: log, OnChange: rec.onChange})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = s.Stop(ctx)
	})
	return s, buf, rec
}

func start(t *testing.T, s *daemon.Supervisor, spec daemon.Spec) *daemon.Runner {
	t.Helper()
	r, err := s.Start(spec)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func ctxTimeout(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestSupervisorStartWaitStop(t *testing.T) {
	t.Parallel()
	s, _, rec := newSupervisor(t)
	start(t, s, daemon.Spec{Name: "nvidia-persistenced", Cmd: fakeCmd(t, "up"), Required: true})
	start(t, s, daemon.Spec{Name: "nvlsm", Cmd: fakeCmd(t, "up"), Required: true, UpAfter: 50 * time.Millisecond})
	start(t, s, daemon.Spec{Name: "nv-fabricmanager", Cmd: fakeCmd(t, "up"), Required: true})
	start(t, s, daemon.Spec{Name: "nvidia-gridd", Cmd: fakeCmd(t, "up")})

	// Readers poll the statuses all along, as metrics would.
	var wg sync.WaitGroup
	quit := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-quit:
				return
			default:
				_ = s.Statuses()
			}
		}
	}()
	defer func() { close(quit); wg.Wait() }()

	if err := s.WaitUp(ctxTimeout(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	var procs []proc
	var names []string
	for _, st := range s.Statuses() {
		names = append(names, st.Name)
		if st.Required && st.State != daemon.StateUp {
			t.Errorf("%s is %s after WaitUp", st.Name, st.State)
		}
		if st.State == daemon.StateUp {
			procs = append(procs, mustProc(t, st.PID))
		}
	}
	if strings.Join(names, ",") != "nvidia-persistenced,nvlsm,nv-fabricmanager,nvidia-gridd" {
		t.Errorf("statuses in order %v", names)
	}
	if err := s.WaitUp(ctxTimeout(t, 20*time.Second), "nvidia-gridd"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Failed():
		t.Fatal("Failed closed with every daemon up")
	default:
	}

	if err := s.Stop(ctxTimeout(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		if !p.gone() {
			t.Errorf("pid %d left after Stop", p.pid)
		}
	}
	var order []string
	for _, st := range rec.Seen() {
		if st.State == daemon.StateStopping {
			order = append(order, st.Name)
		}
	}
	if strings.Join(order, ",") != "nvidia-gridd,nv-fabricmanager,nvlsm,nvidia-persistenced" {
		t.Errorf("stop order %v, want the reverse of the start order", order)
	}
	if err := s.Stop(context.Background()); err != nil {
		t.Errorf("second Stop = %v", err)
	}
	if _, err := s.Start(daemon.Spec{Name: "late", Cmd: fakeCmd(t, "up")}); !errors.Is(err, daemon.ErrStopped) {
		t.Errorf("Start after Stop = %v", err)
	}
}

func TestSupervisorWaitUpReportsFailure(t *testing.T) {
	t.Parallel()
	s, _, _ := newSupervisor(t)
	// UpAfter: without a start delay (or a probe) a daemon counts as up once started.
	start(t, s, daemon.Spec{Name: "nv-fabricmanager", Cmd: fakeCmd(t, "exit"), Required: true, UpAfter: time.Minute, Policy: daemon.Policy{MaxRestarts: -1}})
	err := s.WaitUp(ctxTimeout(t, 20*time.Second))
	if !errors.Is(err, daemon.ErrGaveUp) || !errors.Is(err, exitcode.ErrDaemon) || !strings.Contains(err.Error(), "fatal: cannot open /dev/nvidiactl") {
		t.Fatalf("WaitUp = %v", err)
	}
	select {
	case <-s.Failed():
	case <-time.After(20 * time.Second):
		t.Fatal("Failed not closed")
	}
	if !errors.Is(s.Err(), daemon.ErrGaveUp) {
		t.Errorf("Err() = %v", s.Err())
	}
}

func TestSupervisorWaitUpTimeout(t *testing.T) {
	t.Parallel()
	s, _, _ := newSupervisor(t)
	start(t, s, daemon.Spec{
		Name: "nvlsm", Cmd: fakeCmd(t, "up"), Required: true,
		Ready: func(context.Context) error { return errors.New("no socket") },
	})
	err := s.WaitUp(ctxTimeout(t, 300*time.Millisecond))
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, exitcode.ErrDaemon) || !strings.Contains(err.Error(), "nvlsm is starting") {
		t.Fatalf("WaitUp = %v", err)
	}
}

// A required daemon that fails for good after readiness is reported through Failed and Err.
func TestSupervisorFailedAfterReady(t *testing.T) {
	t.Parallel()
	s, buf, _ := newSupervisor(t)
	r := start(t, s, daemon.Spec{Name: "nv-fabricmanager", Cmd: fakeCmd(t, "crash-on-usr1"), Required: true, Policy: daemon.Policy{MaxRestarts: -1}})
	if err := s.WaitUp(ctxTimeout(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	if s.Err() != nil {
		t.Fatalf("Err() = %v before any failure", s.Err())
	}
	waitLog(t, buf, "waiting for SIGUSR1")
	sendSignal(t, r.Status().PID, syscall.SIGUSR1)
	select {
	case <-s.Failed():
	case <-time.After(20 * time.Second):
		t.Fatal("Failed not closed")
	}
	if err := s.Err(); err == nil || !strings.Contains(err.Error(), "nv-fabricmanager") || !strings.Contains(err.Error(), "crash on request") {
		t.Errorf("Err() = %v", err)
	}
	if st := r.Status(); st.State != daemon.StateFailed {
		t.Errorf("state %s", st.State)
	}
}

func TestSupervisorOptionalFailureNotReported(t *testing.T) {
	t.Parallel()
	s, _, _ := newSupervisor(t)
	opt := start(t, s, daemon.Spec{Name: "nvidia-topologyd", Cmd: fakeCmd(t, "exit"), Policy: daemon.Policy{MaxRestarts: -1}})
	start(t, s, daemon.Spec{Name: "nvidia-persistenced", Cmd: fakeCmd(t, "up"), Required: true})
	if err := s.WaitUp(ctxTimeout(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	waitState(t, opt, daemon.StateFailed)
	select {
	case <-s.Failed():
		t.Fatalf("an optional daemon's failure was reported: %v", s.Err())
	default:
	}
	if err := s.WaitUp(ctxTimeout(t, 20*time.Second), "nvidia-topologyd"); !errors.Is(err, daemon.ErrGaveUp) {
		t.Errorf("WaitUp(nvidia-topologyd) = %v", err)
	}
}

// When the stop deadline passes, the remaining daemons are SIGKILLed without their timeouts.
func TestSupervisorStopDeadline(t *testing.T) {
	t.Parallel()
	s, buf, _ := newSupervisor(t)
	for _, name := range []string{"a", "b"} {
		start(t, s, daemon.Spec{Name: name, Cmd: fakeCmd(t, "ignore-term"), Required: true, StopTimeout: time.Hour})
	}
	if err := s.WaitUp(ctxTimeout(t, 20*time.Second)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "both SIGTERM handlers", func() bool { return strings.Count(buf.String(), "ignoring SIGTERM") == 2 })
	var procs []proc
	for _, st := range s.Statuses() {
		procs = append(procs, mustProc(t, st.PID))
	}
	began := time.Now()
	if err := s.Stop(ctxTimeout(t, 200*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(began); took > 10*time.Second {
		t.Errorf("Stop took %s with a 200ms deadline", took)
	}
	for _, p := range procs {
		if !p.gone() {
			t.Errorf("pid %d left", p.pid)
		}
	}
	if n := strings.Count(buf.String(), "stop deadline reached, sending SIGKILL"); n != 2 {
		t.Errorf("%d daemons hurried, want 2", n)
	}
}

func TestSupervisorNames(t *testing.T) {
	t.Parallel()
	s, _, _ := newSupervisor(t)
	start(t, s, daemon.Spec{Name: "x", Cmd: fakeCmd(t, "up")})
	if _, err := s.Start(daemon.Spec{Name: "x", Cmd: fakeCmd(t, "up")}); err == nil {
		t.Error("a second daemon named x was accepted")
	}
	if err := s.WaitUp(context.Background(), "y"); err == nil {
		t.Error("WaitUp for an unknown daemon succeeded")
	}
	if s.Runner("x") == nil || s.Runner("y") != nil {
		t.Error("Runner lookup")
	}
	if _, err := s.Start(daemon.Spec{Name: "z"}); err == nil {
		t.Error("a spec without a command was accepted")
	}
}
