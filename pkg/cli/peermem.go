package cli

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/peermem"
)

// peermemWait bounds how long reload_nvidia_peermem waits for MOFED and the driver (NVIDIA's
// script waits forever).
const peermemWait = 30 * time.Minute

// runReloadPeermem is the entrypoint of the operator's nvidia-peermem-ctr sidecar.
func runReloadPeermem(ctx context.Context, prog string, args, environ []string, stderr io.Writer) int {
	cfg, code := parse(prog, "reload_nvidia_peermem", args, environ, stderr)
	if cfg == nil {
		return code
	}
	if cfg.DryRun {
		fmt.Fprintf(stderr, "%s: reload_nvidia_peermem has no dry run (it would load nvidia-peermem); run it without --dry-run\n", prog)
		return exitcode.Code(exitcode.ErrUsage)
	}
	cacheDir := cfg.CacheDir
	if cacheDir == "" {
		cacheDir = cfg.Roots.InRun("nvidia/driver-agent/cache")
	}
	log := newLogger(cfg, stderr).With("node", cfg.NodeName)
	err := peermem.Reload(ctx, peermem.Options{Host: host.Real(cfg.Roots, host.OSExec{}), // it runs no process
		Log: log, HostMOFED: cfg.HostMOFED, CacheDir: cacheDir, Wait: peermemWait})
	if err != nil {
		log.Error("failed to load nvidia-peermem module", "error", err)
	}
	return exitcode.Code(err)
}

// runProbePeermem is the sidecar's startup and liveness probe.
func runProbePeermem(prog string, args, environ []string, stdout, stderr io.Writer) int {
	cfg, code := parse(prog, "probe_nvidia_peermem", args, environ, stderr)
	if cfg == nil {
		return code
	}
	msg, err := peermem.Probe(cfg.Roots)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", prog, err)
		return 1
	}
	fmt.Fprintln(stdout, msg)
	return 0
}
