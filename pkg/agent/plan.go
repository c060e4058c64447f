package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// Plan is what a dry run prints: what was found, which path, and every side effect in order.
type Plan struct {
	Facts    detect.Facts  `json:"facts"`
	Decision Decision      `json:"decision"`
	Actions  []host.Action `json:"actions"`
	Teardown []host.Action `json:"teardown"` // what SIGTERM would undo
	Notes    []string      `json:"notes,omitempty"`
}

// printPlan writes the plan. It fails only when even detection failed, so a dry run on any
// ordinary machine exits 0 and says plainly what it could not do.
func (r *run) printPlan(runErr error, steps int) error {
	p := Plan{Facts: r.facts, Decision: r.decision, Notes: r.notes}
	all := r.Recorder.Actions()
	p.Actions, p.Teardown = all[:steps], all[steps:]
	if r.Config.Output == "json" {
		enc := json.NewEncoder(r.Out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(p); err != nil {
			return err
		}
	} else if _, err := fmt.Fprint(r.Out, formatPlan(p)); err != nil {
		return err
	}
	if r.facts.KernelRelease == "" {
		return errors.Join(runErr, errors.New("dry run: could not even identify the running kernel"))
	}
	return nil
}

func formatPlan(p Plan) string {
	var b strings.Builder
	f := p.Facts
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w("driver-agent plan (dry run: nothing was changed)\n\n")
	w("Found:\n")
	w("  kernel        %s\n  banner        %s\n", f.KernelRelease, f.Banner)
	w("  host OS       %s %s (from %s)\n", f.OS.ID, f.OS.VersionID, orUnset(f.OS.Source))
	if f.Flatcar != nil {
		w("  Flatcar       version %s, board %s, channel %s (from %s)\n", f.Flatcar.Version, f.Flatcar.Board, f.Flatcar.Channel, f.Flatcar.ChannelSource)
	}
	if len(f.GPUs) == 0 {
		w("  GPUs          no NVIDIA GPU found\n")
	} else {
		w("  GPUs          %d NVIDIA GPU(s):", len(f.GPUs))
		for _, g := range f.GPUs {
			w(" %s [10de:%04x]", g.Address, g.Device)
		}
		w("\n")
	}
	w("  NVSwitches    %d on PCI, %d in /proc/driver/nvidia-nvswitch; NVLink5: %t\n", len(f.NVSwitches), f.NVSwitchProc, f.NVLink5)
	w("  Mellanox      %d device(s)\n", len(f.Mellanox))
	var nv []string
	for name, m := range f.Modules {
		if strings.HasPrefix(name, "nvidia") {
			nv = append(nv, fmt.Sprintf("%s %s", name, m.Version))
		}
	}
	if len(nv) == 0 {
		w("  loaded        no NVIDIA kernel module is loaded\n")
	} else {
		w("  loaded        %s\n", strings.Join(nv, ", "))
	}
	if f.HostDriver != "" {
		w("  host driver   %s\n", f.HostDriver)
	}
	for _, warn := range f.Warnings {
		w("  warning       %s\n", warn)
	}
	d := p.Decision
	w("\nInstall path: %s\n  why:    %s\n  flavor: %s (%s)\n", orUnset(d.Path), d.Reason, d.Flavor, d.FlavorReason)
	if d.Package != "" {
		w("  package: %s\n", d.Package)
	}
	w("\nSteps:\n")
	for i, a := range p.Actions {
		w("  %2d. %s\n", i+1, a)
	}
	w("\nOn SIGTERM:\n")
	for i, a := range p.Teardown {
		w("  %2d. %s\n", i+1, a)
	}
	if len(p.Notes) > 0 {
		w("\nNotes:\n")
		for _, n := range p.Notes {
			w("  - %s\n", n)
		}
	}
	return b.String()
}
