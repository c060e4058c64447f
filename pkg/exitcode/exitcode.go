// Package exitcode is the agent's one table of exit codes: a sentinel error per failure class,
// and the mapping from an error chain to the process exit status.
package exitcode

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// Failure classes. Wrap them with %w where the failure happens; Code finds them in the chain.
var (
	// ErrUnexpected marks a failure of no other class that must not pass for a clean stop: a
	// cancellation inside the run that no signal caused.
	ErrUnexpected    = errors.New("unexpected error")
	ErrUsage         = errors.New("usage error")
	ErrConfig        = errors.New("invalid configuration")
	ErrLockHeld      = errors.New("another instance holds the lock")
	ErrNoGPU         = errors.New("no NVIDIA GPU found")
	ErrModuleLoad    = errors.New("kernel module load failed")
	ErrBuild         = errors.New("kernel module build failed")
	ErrDownload      = errors.New("download or verification failed")
	ErrDaemon        = errors.New("daemon failed")
	ErrInUse         = errors.New("driver in use")
	ErrNoInstallPath = errors.New("no install path available")
	ErrHostDriver    = errors.New("host-managed driver not ready")
)

// Entry is one row of the table.
type Entry struct {
	Code    int
	Err     error // nil for success and the catch-all
	Meaning string
}

// Table lists every exit code the agent uses.
func Table() []Entry {
	return []Entry{
		{0, nil, "success: stopped cleanly after a signal, or a one-shot command succeeded"},
		{1, ErrUnexpected, "unexpected error (see the log and /dev/termination-log)"},
		{2, ErrUsage, "usage: unknown subcommand or flag"},
		{3, ErrConfig, "bad configuration: an environment variable, a flag or a <drivers-dir>/<module>.conf parameter file has a value that is not allowed"},
		{4, ErrLockHeld, "another driver-agent holds <run>/nvidia/nvidia-driver.pid"},
		{5, ErrNoGPU, "the kernel found no NVIDIA GPU this driver supports, or (KERNEL_MODULE_TYPE=auto) no flavour of the driver supports every GPU on the node"},
		{6, ErrModuleLoad, "a kernel module failed to load (everything this run loaded was unloaded again)"},
		{7, ErrBuild, "building the kernel modules failed"},
		{8, ErrDownload, "downloading or verifying the kernel build tree failed"},
		{9, ErrDaemon, "a required daemon (nvidia-persistenced, nv-fabricmanager, NVLSM, nvidia-gridd) failed, or the NVSwitch fabric reports a failure"},
		{10, ErrInUse, "the driver is in use: at shutdown, or at start when a loaded driver of another configuration stays in use for --unload-timeout, or the kernel cannot unload modules at all (built without CONFIG_MODULE_UNLOAD); modules left loaded, the holders (processes, modules the agent did not load) are logged"},
		{11, ErrNoInstallPath, "no precompiled package matches, no cached build, and no way to compile"},
		{12, ErrHostDriver, "the host manages the driver and it is not loaded, or has another version"},
	}
}

// Code maps err to its exit code. nil and context cancellation after a clean stop map to 0.
func Code(err error) int {
	if err == nil || errors.Is(err, context.Canceled) && !classified(err) {
		return 0
	}
	for _, e := range Table() {
		// ErrUnexpected is the fallback's own class: any other class in the chain wins.
		if e.Err != nil && e.Err != ErrUnexpected && errors.Is(err, e.Err) {
			return e.Code
		}
	}
	return 1
}

func classified(err error) bool {
	for _, e := range Table() {
		if e.Err != nil && errors.Is(err, e.Err) {
			return true
		}
	}
	return false
}

// WriteTable prints the table for `driver-agent help exit-codes`.
func WriteTable(w io.Writer) error {
	for _, e := range Table() {
		if _, err := fmt.Fprintf(w, "%3d  %s\n", e.Code, e.Meaning); err != nil {
			return err
		}
	}
	return nil
}
