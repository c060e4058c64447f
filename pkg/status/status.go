// Package status writes the files other components read to know where the driver stands: the
// gpu-operator's .driver-daemons-status and nvidia-driver.state, and the agent's own status.json
// that `driver-agent status` and people read. Every write goes through host.Files, so a dry run
// only records them, and replacements are atomic.
package status

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/driver-agent/driver-agent/pkg/host"
)

// Status is the content of status.json.
type Status struct {
	Phase         string    `json:"phase"`
	InstallPath   string    `json:"installPath,omitempty"`
	PathReason    string    `json:"pathReason,omitempty"`
	DriverVersion string    `json:"driverVersion"`
	Flavor        string    `json:"flavor,omitempty"`
	Kernel        string    `json:"kernel,omitempty"`
	Node          string    `json:"node,omitempty"`
	PID           int       `json:"pid"`
	Ready         bool      `json:"ready"`
	Started       time.Time `json:"started"`
	Updated       time.Time `json:"updated"`
	Phases        []Timing  `json:"phases"`
	Daemons       []Daemon  `json:"daemons,omitempty"`
	// ModulesCacheDir is the module cache that holds the modules in use, and ModulesDir where
	// they are installed in the shared driver root as the node sees it
	// (/run/nvidia/driver/lib/modules/<kver>/kernel/drivers/video). The peermem sidecar, which
	// gets none of init's configuration, finds nvidia-peermem through them.
	ModulesCacheDir string `json:"modulesCacheDir,omitempty"`
	ModulesDir      string `json:"modulesDir,omitempty"`
	// Fabric is the NVSwitch fabric state the GPUs report once fabric manager is up (completed,
	// in_progress, failed, not_supported), or unknown when it could not be read; empty on nodes
	// without fabric manager.
	Fabric string `json:"fabric,omitempty"`
	// FabricDetail says what the GPUs report, or why the state is unknown.
	FabricDetail string `json:"fabricDetail,omitempty"`
	LastError    string `json:"lastError,omitempty"`
	// ExitCode is the exit code of the failed run that wrote LastError (exitcode's table); the
	// next start classifies how this one ended by it.
	ExitCode int `json:"exitCode,omitempty"`
}

// Timing is how one phase went.
type Timing struct {
	Name     string        `json:"name"`
	Started  time.Time     `json:"started"`
	Duration time.Duration `json:"durationNanoseconds"`
	Result   string        `json:"result"` // running, ok, failed, cancelled
	Error    string        `json:"error,omitempty"`
}

// Daemon is a supervised daemon's state.
type Daemon struct {
	Name     string `json:"name"`
	State    string `json:"state"`
	Restarts int    `json:"restarts"`
	LastLog  string `json:"lastLog,omitempty"`
}

// Paths of the files, under the run root.
type Paths struct{ Run string }

// DaemonsStatus is the operator's readiness file.
func (p Paths) DaemonsStatus() string {
	return filepath.Join(p.Run, "nvidia/validations/.driver-daemons-status")
}

// State holds DRIVER_CONFIG_DIGEST after a successful install.
func (p Paths) State() string { return filepath.Join(p.Run, "nvidia/nvidia-driver.state") }

// PIDFile is the single-instance lock.
func (p Paths) PIDFile() string { return filepath.Join(p.Run, "nvidia/nvidia-driver.pid") }

// StatusJSON is the agent's status file.
func (p Paths) StatusJSON() string { return filepath.Join(p.Run, "nvidia/driver-agent/status.json") }

// Writer writes the files through a host.Files seam.
type Writer struct {
	Files host.Files
	Paths Paths
}

// SetReady writes Ready or NotReady to .driver-daemons-status.
func (w Writer) SetReady(ready bool) error {
	v := "NotReady"
	if ready {
		v = "Ready"
	}
	return w.write(w.Paths.DaemonsStatus(), []byte(v))
}

// CtrReady is the file the operator's startup probe writes once the driver works.
func (p Paths) CtrReady() string { return filepath.Join(p.Run, "nvidia/validations/.driver-ctr-ready") }

// ClearReady removes .driver-daemons-status, and the startup probe's .driver-ctr-ready: the
// pod's preStop hook removes it only when the pod is deleted, so an agent that stops on its own
// would leave it saying the driver container is ready.
func (w Writer) ClearReady() error {
	return errors.Join(w.Files.Remove(w.Paths.DaemonsStatus()), w.Files.Remove(w.Paths.CtrReady()))
}

// StoreDigest writes the config digest to nvidia-driver.state.
func (w Writer) StoreDigest(digest string) error { return w.write(w.Paths.State(), []byte(digest)) }

// ClearDigest removes nvidia-driver.state.
func (w Writer) ClearDigest() error { return w.Files.Remove(w.Paths.State()) }

// Write replaces status.json.
func (w Writer) Write(s Status) error {
	data, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	return w.write(w.Paths.StatusJSON(), append(data, '\n'))
}

// Remove removes status.json, and its directory unless something else (the module cache) is in it.
func (w Writer) Remove() error {
	if err := w.Files.Remove(w.Paths.StatusJSON()); err != nil {
		return err
	}
	return host.RemoveIfEmpty(w.Files, filepath.Dir(w.Paths.StatusJSON()))
}

func (w Writer) write(path string, data []byte) error {
	if err := w.Files.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := w.Files.WriteFile(path, data, 0o644, true); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// Read reads status.json; when there is none the error wraps fs.ErrNotExist.
func Read(p Paths) (Status, error) {
	var s Status
	data, err := os.ReadFile(p.StatusJSON())
	if errors.Is(err, fs.ErrNotExist) {
		return s, fmt.Errorf("no status at %s: the agent is not running on this node or has stopped cleanly (%w)", p.StatusJSON(), fs.ErrNotExist)
	}
	if err != nil {
		return s, err
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return s, fmt.Errorf("status %s: %w", p.StatusJSON(), err)
	}
	return s, nil
}

// Format renders s for people.
func Format(s Status) string {
	var b strings.Builder
	fmt.Fprintf(&b, "phase:          %s (ready: %t)\n", s.Phase, s.Ready)
	fmt.Fprintf(&b, "install path:   %s", orDash(s.InstallPath))
	if s.PathReason != "" {
		fmt.Fprintf(&b, " (%s)", s.PathReason)
	}
	fmt.Fprintf(&b, "\ndriver:         %s %s\nkernel:         %s\nnode:           %s\npid:            %d\nstarted:        %s\nupdated:        %s\n",
		s.DriverVersion, s.Flavor, orDash(s.Kernel), orDash(s.Node), s.PID, s.Started.Format(time.RFC3339), s.Updated.Format(time.RFC3339))
	b.WriteString("phases:\n")
	for _, t := range s.Phases {
		fmt.Fprintf(&b, "  %-12s %-9s %10s", t.Name, t.Result, t.Duration.Round(time.Millisecond))
		if t.Error != "" {
			fmt.Fprintf(&b, "  %s", t.Error)
		}
		b.WriteString("\n")
	}
	if s.ModulesCacheDir != "" || s.ModulesDir != "" {
		fmt.Fprintf(&b, "modules:        cache %s, driver root %s\n", orDash(s.ModulesCacheDir), orDash(s.ModulesDir))
	}
	for _, d := range s.Daemons {
		fmt.Fprintf(&b, "daemon %s: %s, %d restarts %s\n", d.Name, d.State, d.Restarts, d.LastLog)
	}
	if s.Fabric != "" {
		fmt.Fprintf(&b, "fabric:         %s", s.Fabric)
		if s.FabricDetail != "" {
			fmt.Fprintf(&b, " (%s)", s.FabricDetail)
		}
		b.WriteString("\n")
	}
	if s.LastError != "" {
		fmt.Fprintf(&b, "last error:     %s (exit %d)\n", s.LastError, s.ExitCode)
	}
	return b.String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
