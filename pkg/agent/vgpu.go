package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// The vGPU guest daemons, as the supervisor, the log and the metrics call them.
const (
	GriddName     = "nvidia-gridd"
	TopologydName = "nvidia-topologyd"
)

// DriverTypeVGPU is the DRIVER_TYPE of a vGPU guest.
const DriverTypeVGPU = "vgpu"

// vgpuSpecs prepares a vGPU guest (DRIVER_TYPE=vgpu) the way NVIDIA's script does: it copies
// <drivers-dir>/gridd.conf to /etc/nvidia/gridd.conf and, with VGPU_LICENSE_SERVER_TYPE=NLS,
// <drivers-dir>/ClientConfigToken/* to /etc/nvidia/ClientConfigToken/ (each copy undone at
// teardown), and returns nvidia-gridd (required: an unlicensed guest is throttled) and, when the
// image has it, nvidia-topologyd (best effort). Both fork and are tracked by their PID files.
func (r *run) vgpuSpecs() ([]daemon.Spec, error) {
	if r.Config.DriverType != DriverTypeVGPU {
		return nil, nil
	}
	etc := r.Host.InRoot("etc/nvidia")
	r.Log.Info("Copying gridd.conf...")
	src := r.Host.InDrivers("gridd.conf")
	if err := r.installFile(src, filepath.Join(etc, "gridd.conf"), 0o644); errors.Is(err, fs.ErrNotExist) {
		r.Log.Warn("DRIVER_TYPE=vgpu but there is no gridd.conf: nvidia-gridd starts without a license server (set the operator's driver.licensingConfig)", "path", src)
		r.notes = append(r.notes, "vgpu: no "+src+"; nvidia-gridd would start without a license server")
	} else if err != nil {
		return nil, fmt.Errorf("%w: vGPU licensing: %w", exitcode.ErrDaemon, err)
	}
	if r.Config.VGPULicenseType == "NLS" {
		r.Log.Info("Copying ClientConfigToken...")
		n, err := r.installDir(r.Host.InDrivers("ClientConfigToken"), filepath.Join(etc, "ClientConfigToken"), 0o600)
		if err != nil {
			return nil, fmt.Errorf("%w: vGPU licensing: %w", exitcode.ErrDaemon, err)
		}
		if n == 0 {
			r.Log.Warn("VGPU_LICENSE_SERVER_TYPE=NLS but there is no client configuration token: nvidia-gridd cannot get a license", "dir", r.Host.InDrivers("ClientConfigToken"))
		}
	} else {
		r.Log.Info("not copying ClientConfigToken: the license server type is not NLS", "type", r.Config.VGPULicenseType)
	}

	lib := r.griddLibraryPath()
	specs := []daemon.Spec{r.forkingSpec(GriddName, true, []string{"LD_LIBRARY_PATH=" + lib})}
	r.Log.Info("nvidia-gridd runs with its own libraries", "LD_LIBRARY_PATH", lib)
	if _, err := os.Stat(r.Host.InRoot("usr/bin", TopologydName)); err == nil {
		specs = append(specs, r.forkingSpec(TopologydName, false, nil))
	} else {
		r.Log.Info("nvidia-topologyd is not in the image; not starting it")
	}
	return specs, nil
}

// forkingSpec is a daemon in /usr/bin that forks into the background and writes
// /var/run/<name>/<name>.pid, like nvidia-gridd and nvidia-topologyd.
func (r *run) forkingSpec(name string, required bool, env []string) daemon.Spec {
	pidDir := r.Host.InRoot("var/run", name)
	s := daemon.Spec{
		Name: name, Required: required,
		Cmd:     host.Cmd{Path: r.Host.InRoot("usr/bin", name)},
		PIDFile: filepath.Join(pidDir, name+".pid"), StopTimeout: r.Config.DaemonStopTimeout,
		Prepare: func() error { return r.Host.Files.MkdirAll(pidDir, 0o755) },
	}
	if len(env) > 0 {
		s.Cmd.Env = withEnv(os.Environ(), env...)
	}
	return s
}

// griddLibraryPath is nvidia-gridd's private library directory: /usr/lib/<arch>-linux-gnu/nvidia/gridd
// (Debian and Ubuntu images) or /usr/lib64/nvidia/gridd (RHEL images), whichever the image has;
// the Debian one when neither exists.
func (r *run) griddLibraryPath() string {
	arch := map[string]string{"amd64": "x86_64", "arm64": "aarch64"}[runtime.GOARCH]
	if arch == "" {
		arch = runtime.GOARCH
	}
	candidates := []string{r.Host.InRoot("usr/lib", arch+"-linux-gnu", "nvidia/gridd"), r.Host.InRoot("usr/lib64/nvidia/gridd")}
	for _, c := range candidates {
		if fi, err := os.Stat(c); err == nil && fi.IsDir() {
			return c
		}
	}
	return candidates[0]
}

// withEnv returns environ with each KEY=value of set replacing any earlier KEY.
func withEnv(environ []string, set ...string) []string {
	out := make([]string, 0, len(environ)+len(set))
	for _, kv := range environ {
		key, _, _ := strings.Cut(kv, "=")
		if !hasKey(set, key) {
			out = append(out, kv)
		}
	}
	return append(out, set...)
}

func hasKey(set []string, key string) bool {
	for _, kv := range set {
		if k, _, _ := strings.Cut(kv, "="); k == key {
			return true
		}
	}
	return false
}

// installFile copies src to dst (creating dst's missing directories) and registers the undo: the
// old content back, or dst and the directories removed. A missing src is returned as
// fs.ErrNotExist with nothing changed.
func (r *run) installFile(src, dst string, perm os.FileMode) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	if err := r.mkdirUndo(PhaseDaemons, filepath.Dir(dst)); err != nil {
		return err
	}
	old, err := os.ReadFile(dst)
	existed := err == nil
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := r.Host.Files.WriteFile(dst, data, perm, true); err != nil {
		return err
	}
	r.push(PhaseDaemons, func(context.Context) error {
		if existed {
			return r.Host.Files.WriteFile(dst, old, perm, true)
		}
		return r.Host.Files.Remove(dst)
	})
	return nil
}

// installDir copies the regular files of srcDir (following symlinks, as a ConfigMap volume has
// them; names starting with a dot, such as ..data, are skipped like the shell's * does) into
// dstDir, and returns how many it copied. A missing srcDir copies nothing.
func (r *run) installDir(srcDir, dstDir string, perm os.FileMode) (int, error) {
	entries, err := os.ReadDir(srcDir)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	names := make([]string, 0, len(entries))
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".") {
			continue
		}
		if fi, err := os.Stat(filepath.Join(srcDir, e.Name())); err == nil && fi.Mode().IsRegular() {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	for _, n := range names {
		if err := r.installFile(filepath.Join(srcDir, n), filepath.Join(dstDir, n), perm); err != nil {
			return 0, err
		}
	}
	return len(names), nil
}

// mkdirUndo creates dir and its missing parents and registers their removal as an undo of phase
// (deepest first; a directory something else has put files in stays).
func (r *run) mkdirUndo(phase, dir string) error {
	undo, err := r.mkdirs(dir)
	if undo != nil {
		r.push(phase, undo)
	}
	return err
}

// mkdirs creates dir and its missing parents and returns their removal, deepest first (a
// directory something else has put files in stays); nil when none was missing.
func (r *run) mkdirs(dir string) (func(context.Context) error, error) {
	missing := missingDirs(dir)
	if err := r.Host.Files.MkdirAll(dir, 0o755); err != nil || len(missing) == 0 {
		return nil, err
	}
	return func(context.Context) error {
		var errs []error
		for i := len(missing) - 1; i >= 0; i-- {
			errs = append(errs, host.RemoveIfEmpty(r.Host.Files, missing[i]))
		}
		return errors.Join(errs...)
	}, nil
}
