package agent

import (
	"context"

	"github.com/driver-agent/driver-agent/pkg/fabric"
)

// nvidiaSMI is where the image has nvidia-smi.
func (r *run) nvidiaSMI() string { return r.Host.InRoot("usr/bin/nvidia-smi") }

// checkFabric reads the GPUs' fabric state once fabric manager is up (fabric.WaitState, with the
// agent's Host.Procs, clock, log and supervisor), and reports it in the log, status.json and the
// metrics.
func (r *run) checkFabric(ctx context.Context, plan fabric.Plan) error {
	o := fabric.StateOptions{
		NvidiaSMI: r.nvidiaSMI(), Procs: r.Host.Procs, Clock: r.clock, Log: r.Log,
		Poll: r.FabricPoll, Timeout: r.FabricTimeout, Shared: plan.ResetGPUs,
		Report: func(state fabric.State, detail string) { r.setFabric(string(state), detail) },
	}
	if r.sup != nil {
		o.Daemons = r.sup
	}
	return fabric.WaitState(ctx, o)
}

// setFabric records the fabric state, and status.json shows it within statusEvery, so
// `driver-agent status` shows it while the agent waits.
func (r *run) setFabric(state, detail string) {
	r.mu.Lock()
	r.status.Fabric, r.status.FabricDetail = state, detail
	r.mu.Unlock()
	r.noteStatus()
}

// metricsFabricState is the state label for driver_agent_fabric_state: one of fabric's four
// states, or "" (no metric) while unknown.
func metricsFabricState(s string) string {
	switch fabric.State(s) {
	case fabric.StateCompleted, fabric.StateInProgress, fabric.StateFailed, fabric.StateNotSupported:
		return s
	}
	return ""
}
