package agent

import (
	"errors"
	"io/fs"
	"strings"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/metrics"
	"github.com/driver-agent/driver-agent/pkg/status"
)

// Phases lists every phase name, in order.
func Phases() []string {
	return []string{PhaseDetect, PhaseDecide, PhasePrepare, PhaseLoad, PhaseDevices, PhaseDaemons, PhaseShareRoot, PhaseReady, PhaseWait, PhaseTeardown}
}

// Snapshot implements metrics.Source: the run's state, read under its lock.
func (r *run) Snapshot() metrics.Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := metrics.Snapshot{
		AgentVersion: r.Version, DriverVersion: r.Config.DriverVersion, DriverBranch: r.Config.DriverBranch,
		Flavor: r.decision.Flavor, Kernel: r.facts.KernelRelease, OS: strings.TrimSpace(r.facts.OS.ID + " " + r.facts.OS.VersionID),
		InstallPath: r.decision.Path, Phase: r.status.Phase, Phases: Phases(), Ready: r.status.Ready,
		DeviceNodes: len(r.devices), GPUs: len(r.facts.GPUs), NVSwitches: len(r.facts.NVSwitches),
		Errors: map[string]float64{}, LastShutdown: r.lastShut, FabricState: metricsFabricState(r.status.Fabric),
	}
	// Alive: a phase is running (each is bounded by its own timeouts), or the wait loop ticked lately.
	s.Alive = r.status.Phase != PhaseWait || r.clock.Now().Sub(r.beat) < time.Minute
	for _, t := range r.status.Phases {
		d := t.Duration
		if t.Result == "running" {
			d = r.clock.Now().Sub(t.Started)
		}
		s.Timing = append(s.Timing, metrics.PhaseDuration{Phase: t.Name, Seconds: d.Seconds()})
	}
	for _, name := range r.loaded {
		if m, err := kernel.ReadSysModule(r.Host.Sys, name); err == nil && m.Loaded {
			s.Modules = append(s.Modules, metrics.Module{Name: name, Version: m.Version})
		}
	}
	for _, d := range daemonStatuses(r.sup) {
		s.Daemons = append(s.Daemons, metrics.Daemon{Name: d.Name, Up: d.State == string(daemon.StateUp), Restarts: float64(d.Restarts)})
	}
	if src, ok := r.src.(interface{ Stats() SourceStats }); ok {
		st := src.Stats()
		s.CacheHits, s.CacheMisses = float64(st.CacheHits), float64(st.CacheMisses)
		s.DownloadBytes, s.DownloadSeconds, s.BuildSeconds = float64(st.DownloadBytes), st.DownloadSeconds, st.BuildSeconds
	}
	for k, v := range r.errors {
		s.Errors[k] = v
	}
	return s
}

// previousShutdown says how the last agent on this node ended: a clean stop removes
// status.json; a failed init or teardown leaves it with its error and exit code.
func previousShutdown(p status.Paths) string {
	prev, err := status.Read(p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "clean_or_first_start"
	case err != nil:
		return "unknown"
	case prev.ExitCode == exitcode.Code(exitcode.ErrInUse):
		return "in_use"
	case prev.LastError != "" || prev.ExitCode != 0:
		return "error"
	}
	return "killed" // status.json without an error: the previous agent never reached teardown's end
}
