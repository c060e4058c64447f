// Package peermem is the GPUDirect RDMA sidecar's side of the driver: the operator's
// nvidia-peermem-ctr runs `nvidia-driver reload_nvidia_peermem` and probes it with
// `nvidia-driver probe_nvidia_peermem`. It waits (bounded) for MOFED and the driver, loads
// nvidia-peermem from the modules the init container prepared, and unloads it on SIGTERM.
package peermem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/driver-agent/driver-agent/pkg/cache"
	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/modparams"
	"github.com/driver-agent/driver-agent/pkg/modules"
	"github.com/driver-agent/driver-agent/pkg/status"
)

// ErrNotReady means MOFED or the driver did not become ready in time.
var ErrNotReady = errors.New("MOFED or the NVIDIA driver is not ready")

// Options configure the sidecar.
type Options struct {
	Host      host.Host
	Log       *slog.Logger
	HostMOFED bool          // USE_HOST_MOFED: MOFED is on the host (wait for mlx5_core), not from the network operator
	CacheDir  string        // where init stored the modules
	Wait      time.Duration // how long to wait for MOFED and the driver
	Poll      time.Duration // how often to look
	Clock     daemon.Clock  // times the wait; nil means the wall clock
}

// find looks for nvidia-peermem where status.json says init keeps its modules: the module cache
// (verified, keyed by this kernel's banner, the driver version and flavour) and the shared
// driver root. The sidecar gets none of init's configuration (a --cache-dir set through the
// operator's driver.env is not in its environment), so its own CacheDir counts only when init
// recorded nothing (an older init).
func (o Options) find(st status.Status, banner string) (string, error) {
	cacheDir := o.CacheDir
	if st.ModulesCacheDir != "" || st.ModulesDir != "" {
		cacheDir = st.ModulesCacheDir
	}
	var tried []string
	if cacheDir != "" {
		entry, ok, err := cache.Lookup(cacheDir, cache.Key{Banner: banner, DriverVersion: st.DriverVersion, Flavor: st.Flavor})
		switch {
		case ok:
			for _, m := range entry.Modules {
				if kernel.Normalize(m.Name) == "nvidia_peermem" {
					return m.Path, nil
				}
			}
			tried = append(tried, fmt.Sprintf("the driver's modules (%s) do not include nvidia-peermem; the image needs a package built with it", entry.Dir))
		default:
			tried = append(tried, fmt.Sprintf("no modules for driver %s (%s) and this kernel in %s: %v", st.DriverVersion, st.Flavor, cacheDir, err))
		}
	}
	if st.ModulesDir != "" {
		for _, suffix := range []string{".ko", ".ko.xz", ".ko.zst", ".ko.gz"} {
			if p := filepath.Join(st.ModulesDir, "nvidia-peermem"+suffix); exists(p) {
				return p, nil
			}
		}
		tried = append(tried, "no nvidia-peermem in "+st.ModulesDir)
	}
	if len(tried) == 0 {
		tried = append(tried, "the init container recorded no modules (status.json has neither modulesCacheDir nor modulesDir) and the module cache is off")
	}
	return "", fmt.Errorf("%w: %s", exitcode.ErrModuleLoad, strings.Join(tried, "; "))
}

// Probe implements probe_nvidia_peermem: it fails only when MOFED's mlx5_core is loaded and
// nvidia_peermem is not, as NVIDIA's script does, so the probe never restarts the sidecar while
// MOFED is still coming up. The message says which case it is.
func Probe(r host.Roots) (string, error) {
	mlx, err := kernel.ReadSysModule(r.Sys, "mlx5_core")
	if err != nil {
		return "", err
	}
	if !mlx.Present {
		return "MOFED drivers are not ready, skipping probe to avoid container restarts...", nil
	}
	pm, err := kernel.ReadSysModule(r.Sys, "nvidia_peermem")
	if err != nil {
		return "", err
	}
	if !pm.Loaded {
		return "", errors.New("nvidia-peermem is not loaded although MOFED (mlx5_core) is")
	}
	return "nvidia-peermem is loaded", nil
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// ready says whether MOFED and the driver are ready, and if not, what is missing.
func (o Options) ready() (bool, string) {
	r := o.Host.Roots
	driver := r.InRun("nvidia/validations/.driver-ctr-ready")
	if o.HostMOFED {
		mlx, _ := kernel.ReadSysModule(r.Sys, "mlx5_core")
		if !mlx.Present {
			return false, "mlx5_core (host MOFED) is not loaded"
		}
	} else if p := r.InRun("mellanox/drivers/.driver-ready"); !exists(p) {
		return false, p + " does not exist (the network operator's MOFED is not ready)"
	}
	if !exists(driver) {
		return false, driver + " does not exist (the driver container is not ready)"
	}
	return true, ""
}

// Reload implements reload_nvidia_peermem: wait for MOFED and the driver, load nvidia-peermem
// with the parameters of <drivers-dir>/nvidia-peermem.conf unless it is loaded, then wait for
// ctx to end and unload it again if this run loaded it.
func Reload(ctx context.Context, o Options) error {
	if o.Poll == 0 {
		o.Poll = 10 * time.Second
	}
	if o.Clock == nil {
		o.Clock = daemon.WallClock{}
	}
	deadline := o.Clock.Now().Add(o.Wait)
	for {
		ok, why := o.ready()
		if ok {
			break
		}
		if o.Clock.Now().After(deadline) {
			return fmt.Errorf("%w after %s: %s", ErrNotReady, o.Wait, why)
		}
		o.Log.Info("waiting for mellanox ofed and nvidia drivers to be installed", "missing", why)
		t := o.Clock.NewTimer(o.Poll)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C():
		}
	}
	pm, err := kernel.ReadSysModule(o.Host.Sys, "nvidia_peermem")
	if err != nil {
		return err
	}
	loadedHere := false
	if pm.Loaded {
		o.Log.Info("nvidia-peermem is already loaded, now waiting for signal")
	} else {
		if err := o.load(ctx); err != nil {
			return err
		}
		loadedHere = true
		o.Log.Info("successfully loaded nvidia-peermem module, now waiting for signal")
	}
	<-ctx.Done()
	if !loadedHere {
		return nil
	}
	stop, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return modules.Unload(stop, o.Host, o.Log, []string{"nvidia_peermem"})
}

// load finds nvidia-peermem among the modules the init container uses, and loads it.
func (o Options) load(ctx context.Context) error {
	st, err := status.Read(status.Paths{Run: o.Host.Run})
	if err != nil {
		return fmt.Errorf("%w: %w", exitcode.ErrModuleLoad, err)
	}
	banner, err := kernel.Banner(o.Host.Proc)
	if err != nil {
		return err
	}
	path, err := o.find(st, banner)
	if err != nil {
		return err
	}
	files, err := modules.Resolve([]host.ModuleImage{{Name: "nvidia_peermem", Path: path}})
	if err != nil {
		return fmt.Errorf("%w: %w", exitcode.ErrModuleLoad, err)
	}
	params, err := modparams.LoadDir(o.Host.DriversDir, []string{"nvidia-peermem"})
	if err != nil {
		return fmt.Errorf("%w: %w", exitcode.ErrConfig, err)
	}
	files[0].Image.Params = params.Params("nvidia-peermem").String()
	release, _ := kernel.Release(o.Host.Proc)
	_, err = modules.Loader{Host: o.Host, Log: o.Log, Release: release}.Load(ctx, files)
	return err
}
