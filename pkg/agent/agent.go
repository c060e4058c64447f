// Package agent runs the init lifecycle as a state machine: detect, decide, prepare, load,
// devices, daemons, share-root, ready, then wait for a signal and tear down. Each phase registers
// the undo of what it changed; teardown runs the undos in reverse under a fresh deadline. With
// --dry-run the same phases run against recording seams and the result is printed as a plan.
package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/driver-agent/driver-agent/pkg/config"
	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/lock"
	"github.com/driver-agent/driver-agent/pkg/metrics"
	"github.com/driver-agent/driver-agent/pkg/modules"
	"github.com/driver-agent/driver-agent/pkg/status"
)

// Phase names, in the order they run.
const (
	PhaseDetect    = "detect"
	PhaseDecide    = "decide"
	PhasePrepare   = "prepare"
	PhaseLoad      = "load"
	PhaseDevices   = "devices"
	PhaseDaemons   = "daemons"
	PhaseShareRoot = "share-root"
	PhaseReady     = "ready"
	PhaseWait      = "wait"
	PhaseTeardown  = "teardown"
)

// Agent is one init run's configuration and collaborators.
type Agent struct {
	Config *config.Config
	Host   host.Host
	Log    *slog.Logger
	// Source provides kernel modules for the paths that load them; nil means the default,
	// which looks for NVIDIA's precompiled packages in the image.
	Source Source
	// Recorder receives the side effects of a dry run (Host must then be host.DryRun over it).
	Recorder *host.Recorder
	// Out receives the dry-run plan.
	Out io.Writer
	// Terminal, when set (stderr is an interactive terminal), gets the compile path's download
	// and build progress bars.
	Terminal io.Writer
	// BeforePhase, when set, is called as each phase starts (tests use it to interrupt a phase).
	BeforePhase func(phase string)
	// Clock is the run's one clock: timestamps, deadlines, polls and timers (the unload's
	// retries, the daemons' timeouts, the fabric and host-driver waits, the heartbeat); nil means
	// the wall clock.
	Clock daemon.Clock
	// LoadOnly is the load command (NVIDIA's script's load-only run): never compile; exit 11 when
	// no precompiled package or cached build matches.
	LoadOnly bool
	// ChildProc is the procfs in which the agent's own child processes are visible, for verifying
	// a daemon's PID file; "" means Host.Proc. Tests that fake Host.Proc set it to "/proc".
	ChildProc string
	// DaemonPolicy is the daemons' restart policy; the zero value takes the supervisor's defaults.
	DaemonPolicy daemon.Policy
	// FabricSettle is how long nv-fabricmanager must run before it counts as up; zero means the
	// fabric package's default (3s), negative means at once.
	FabricSettle time.Duration
	// FabricPoll is how often the fabric state is read again while GPUs are still registering;
	// zero means 5s.
	FabricPoll time.Duration
	// FabricTimeout bounds how long the fabric state may stay in progress once fabric manager is
	// up; zero means 2m.
	FabricTimeout time.Duration
	// Version is the agent's version, for the build-info metric.
	Version string
	// OnListen, when set, is told the metrics server's address once it listens.
	OnListen func(addr string)
}

type undo struct {
	phase string
	fn    func(context.Context) error
}

// run is the state of one Run. mu guards what the metrics read concurrently: status, facts,
// decision, loaded, devices, daemons, errors and heartbeat.
type run struct {
	*Agent
	clock  daemon.Clock
	st     status.Writer // the node's status files: readiness and the digest
	report status.Writer // status.json, through own
	// own writes the agent's own account of the run, status.json and the journal: Host.Files, or
	// in a dry run a recorder that nothing reads, so that the plan lists the node's changes only.
	own      host.Files
	src      Source
	sf       statusFile // status.json's writes (statusfile.go)
	mu       sync.Mutex
	status   status.Status
	errors   map[string]float64
	lastShut string
	beat     time.Time
	facts    detect.Facts
	decision Decision
	images   []host.ModuleImage // what prepare made, holding the files they load from open
	files    []modules.File     // images ordered by their dependencies, with their .modinfo
	loaded   []string           // NVIDIA modules this run owns (loaded or adopted)
	prereqs  []string           // prerequisite modules this run loaded
	devices  []string           // device nodes this run created
	inRoot   bool               // the modules are installed in the shared driver root
	toRoot   []modules.File     // what load left to install in the driver root (startInstall)
	install  *rootInstall       // that install, once started
	sup      *daemon.Supervisor
	undos    []undo
	notes    []string // what the dry run's plan says besides its actions
	jr       journal  // what this run and killed earlier ones changed (journal.go)
}

// phase is one step of init. plan, where set, stands in for run in a dry run: run would need
// what only a real run makes (linked modules, a loaded driver, running daemons).
type phase struct {
	name      string
	run, plan func(context.Context) error
}

// Run executes init until ctx is cancelled (SIGTERM), then tears down. It returns nil after a
// clean stop; otherwise an error whose class exitcode.Code maps to the exit status.
func (a *Agent) Run(ctx context.Context) (err error) {
	cfg := a.Config
	r := &run{Agent: a, st: status.Writer{Files: a.Host.Files, Paths: status.Paths{Run: a.Host.Run}}, own: a.Host.Files}
	if r.clock = a.Clock; r.clock == nil {
		r.clock = daemon.WallClock{}
	}
	r.status = status.Status{Phase: "starting", DriverVersion: cfg.DriverVersion, Node: cfg.NodeName, PID: os.Getpid(), Started: r.clock.Now()}
	r.errors = map[string]float64{}
	a.Log.Info("========== NVIDIA Software Installer ==========")
	release, rerr := kernel.Release(a.Host.Proc)
	if rerr != nil {
		release = "<unknown>" // detect fails on it with the reason
	}
	a.Log.Info(fmt.Sprintf("Starting installation of NVIDIA driver version %s for Linux kernel version %s", orUnset(cfg.DriverVersion), release), "dry_run", cfg.DryRun)

	if cfg.DryRun {
		// What a dry run does differently is decided here: it takes no lock (an agent may hold
		// it), serves no metrics and keeps no status.json or journal.
		r.notes = append(r.notes, "would take the lock "+r.st.Paths.PIDFile())
		r.own = &host.Recorder{}
	} else {
		l, err := lock.Acquire(r.st.Paths.PIDFile(), os.Getpid())
		if err != nil {
			a.Log.Error("An instance of the NVIDIA driver is already running, aborting", "error", err)
			return err
		}
		defer func() { err = errors.Join(err, l.Release()) }()
		r.lastShut = previousShutdown(r.st.Paths)
		if cfg.MetricsAddress != "" {
			srv, err := metrics.Start(cfg.MetricsAddress, r, a.Log)
			if err != nil {
				return err
			}
			if a.OnListen != nil {
				a.OnListen(srv.Addr())
			}
			r.push("metrics", srv.Shutdown) // runs last: scrapes see the teardown
		}
	}
	r.report = status.Writer{Files: r.own, Paths: r.st.Paths}
	if err := r.st.SetReady(false); err != nil {
		return err
	}
	r.push("start", func(context.Context) error {
		r.closeStatus()
		return errors.Join(r.st.ClearReady(), r.report.Remove())
	})
	r.adoptJournal()

	phases := []phase{
		{PhaseDetect, r.detect, nil}, {PhaseDecide, r.decide, nil}, {PhasePrepare, r.prepare, r.planPrepare},
		{PhaseLoad, r.load, r.planLoad}, {PhaseDevices, r.devicesPhase, r.planDevices}, {PhaseDaemons, r.daemonsPhase, r.planDaemons},
		{PhaseShareRoot, r.shareRoot, nil}, {PhaseReady, r.ready, nil},
	}
	runErr := r.runPhases(ctx, phases)
	if cfg.DryRun {
		steps := len(a.Recorder.Actions())
		if err := r.teardown(); err != nil {
			r.notes = append(r.notes, fmt.Sprintf("teardown: would fail: %v", err))
		}
		return r.printPlan(runErr, steps)
	}
	if runErr == nil {
		a.Log.Info("Done, now waiting for signal")
		runErr = r.wait(ctx)
	}
	switch {
	case ctx.Err() != nil: // the signal, whatever it made the phase return
		if runErr != nil && !errors.Is(runErr, ctx.Err()) {
			a.Log.Info("Caught signal, tearing down", "phase_error", runErr)
		} else {
			a.Log.Info("Caught signal, tearing down")
		}
		runErr = nil
	case errors.Is(runErr, context.Canceled) && exitcode.Code(runErr) == 0:
		// A cancellation inside the run (a request's or a child's context), not a signal: a
		// failure, which must not pass for a clean stop (exit 0, status.json removed).
		runErr = fmt.Errorf("%w: %w", exitcode.ErrUnexpected, runErr)
	}
	if runErr != nil {
		r.update(func(s *status.Status) { s.LastError, s.ExitCode = runErr.Error(), exitcode.Code(runErr) })
		a.Log.Error("init failed, tearing down", "error", runErr)
	}
	tdErr := r.teardown()
	r.closeJournal()
	if tdErr != nil {
		all := errors.Join(runErr, tdErr)
		r.update(func(s *status.Status) { s.LastError, s.ExitCode = all.Error(), exitcode.Code(all) })
	}
	if runErr != nil || tdErr != nil {
		// Keep the status file with the error, the only thing a failed run leaves: `driver-agent
		// status` shows it, and the next start reports how this one ended.
		r.setPhase(PhaseTeardown)
	}
	return errors.Join(runErr, tdErr)
}

func orUnset(s string) string {
	if s == "" {
		return "<unset>"
	}
	return s
}

func (r *run) push(phase string, fn func(context.Context) error) {
	r.undos = append(r.undos, undo{phase: phase, fn: fn})
}

// update changes the status under the lock.
func (r *run) update(fn func(s *status.Status)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fn(&r.status)
}

// setPhase records the phase and writes status.json at once: Ready, a failure, the teardown.
func (r *run) setPhase(name string) {
	r.markPhase(name)
	r.writeStatus()
}

// enterPhase records the phase a run enters; status.json shows it within statusEvery.
func (r *run) enterPhase(name string) {
	r.markPhase(name)
	r.noteStatus()
}

func (r *run) markPhase(name string) {
	r.mu.Lock()
	r.status.Phase = name
	r.beat = r.clock.Now()
	r.mu.Unlock()
}

func (r *run) runPhases(ctx context.Context, phases []phase) error {
	for _, p := range phases {
		if r.BeforePhase != nil {
			r.BeforePhase(p.name)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		start := r.clock.Now()
		r.update(func(s *status.Status) {
			s.Phases = append(s.Phases, status.Timing{Name: p.name, Started: start, Result: "running"})
		})
		r.enterPhase(p.name)
		step := p.run
		if r.Config.DryRun && p.plan != nil {
			step = p.plan
		}
		err := step(ctx)
		r.update(func(s *status.Status) {
			t := &s.Phases[len(s.Phases)-1]
			t.Duration = r.clock.Now().Sub(start)
			switch {
			case err == nil:
				t.Result = "ok"
			case ctx.Err() != nil:
				t.Result = "cancelled"
			default:
				t.Result, t.Error = "failed", err.Error()
				r.errors[p.name]++
			}
			r.Log.Debug("phase finished", "phase", p.name, "result", t.Result, "duration", t.Duration)
		})
		if err != nil {
			if r.Config.DryRun && ctx.Err() == nil {
				r.notes = append(r.notes, fmt.Sprintf("%s: would fail: %v", p.name, err))
				continue
			}
			r.setPhase(p.name)
			return fmt.Errorf("%s: %w", p.name, err)
		}
	}
	return nil
}

// heartbeat is how often the wait phase records that the agent is alive.
const heartbeat = 5 * time.Second

// wait blocks until ctx ends or a required daemon fails for good.
func (r *run) wait(ctx context.Context) error {
	r.enterPhase(PhaseWait)
	var failed <-chan struct{}
	if r.sup != nil {
		failed = r.sup.Failed()
	}
	for {
		tick := r.clock.NewTimer(heartbeat)
		select {
		case <-ctx.Done():
			tick.Stop()
			return ctx.Err()
		case <-failed:
			tick.Stop()
			if err := r.st.SetReady(false); err != nil {
				r.Log.Warn("could not write NotReady", "error", err)
			}
			r.update(func(s *status.Status) { s.Ready = false })
			return fmt.Errorf("%w: %w", exitcode.ErrDaemon, r.sup.Err())
		case <-tick.C():
			r.mu.Lock()
			r.beat = r.clock.Now()
			r.mu.Unlock()
		}
	}
}

// teardown runs the undos in reverse under a fresh deadline and joins their errors.
func (r *run) teardown() error {
	r.setPhase(PhaseTeardown)
	ctx, cancel := context.WithTimeout(context.Background(), r.Config.ShutdownTimeout)
	defer cancel()
	var errs []error
	for i := len(r.undos) - 1; i >= 0; i-- {
		u := r.undos[i]
		r.Log.Debug("undo", "phase", u.phase)
		if err := u.fn(ctx); err != nil {
			r.Log.Error("teardown step failed", "phase", u.phase, "error", err)
			errs = append(errs, fmt.Errorf("undo %s: %w", u.phase, err))
		}
	}
	return errors.Join(errs...)
}

// WriteTerminationLog writes a one-line cause to path when the file exists and is writable, so
// `kubectl describe pod` shows why the container stopped. The file is the container's own
// (Kubernetes mounts it), not the node's, so it is written directly rather than through Host.
func WriteTerminationLog(path string, err error) {
	f, ferr := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if ferr != nil {
		return
	}
	defer f.Close()
	msg := "driver-agent stopped cleanly"
	if err != nil {
		msg = fmt.Sprintf("driver-agent exit %d: %s", exitcode.Code(err), strings.Join(strings.Fields(err.Error()), " "))
	}
	fmt.Fprintln(f, msg)
}
