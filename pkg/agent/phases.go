package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/devices"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/fabric"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/modparams"
	"github.com/driver-agent/driver-agent/pkg/modules"
	"github.com/driver-agent/driver-agent/pkg/status"
)

// firmwareSearchPath is where the host kernel finds the GSP firmware: the container's
// /lib/firmware as shared at /run/nvidia/driver. It is a value written to sysfs, not a path the
// agent opens.
const firmwareSearchPath = "/run/nvidia/driver/lib/firmware"

// NVIDIAModules are the NVIDIA modules the agent owns; their holders (gdrdrv, nvidia_fs, ...)
// are found from sysfs at unload time.
func NVIDIAModules() []string {
	return []string{"nvidia_drm", "nvidia_peermem", "nvidia_modeset", "nvidia_uvm", "nvidia"}
}

func (r *run) detect(context.Context) error {
	f, err := detect.Detect(r.Host.Roots)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.facts = f
	r.status.Kernel = f.KernelRelease
	r.mu.Unlock()
	for _, w := range f.Warnings {
		r.Log.Warn(w)
	}
	r.Log.Info("detected node", "kernel", f.KernelRelease, "os", f.OS.ID, "os_version", f.OS.VersionID,
		"gpus", len(f.GPUs), "nvswitches", len(f.NVSwitches), "mellanox", len(f.Mellanox), "nvlink5", f.NVLink5)
	if f.Flatcar != nil {
		r.Log.Info("Flatcar host", "version", f.Flatcar.Version, "board", f.Flatcar.Board, "channel", f.Flatcar.Channel, "channel_from", f.Flatcar.ChannelSource)
	}
	if len(f.GPUs) == 0 {
		r.Log.Warn("no NVIDIA GPU found on the PCI bus; loading nvidia will fail with ENODEV")
	}
	return nil
}

func (r *run) decide(ctx context.Context) error {
	d := Decision{}
	var flavorErr error
	d.Flavor, d.FlavorReason, flavorErr = r.chooseFlavor()
	nv, nvLoaded := r.facts.Modules["nvidia"]
	stored, _ := os.ReadFile(r.st.Paths.State())
	r.Log.Info("Checking NVIDIA driver packages...")
	switch {
	case r.Config.Modules == "host":
		d.Path, d.Reason = PathHost, "--modules=host: the host loads the NVIDIA modules"
		if r.facts.HostDriver != "" {
			d.Reason += "; " + r.facts.HostDriver
		}
	case r.Config.Modules == "auto" && r.facts.HostDriver != "":
		d.Path, d.Reason = PathHost, r.facts.HostDriver
	case nvLoaded && r.Config.ConfigDigest != "" && strings.TrimSpace(string(stored)) == strings.TrimSpace(r.Config.ConfigDigest):
		// Trimmed: NVIDIA's script stores the digest with echo, so its file ends in a newline.
		d.Path = PathFast
		d.Reason = fmt.Sprintf("nvidia %s is loaded and %s holds DRIVER_CONFIG_DIGEST %s", orUnset(nv.Version), r.st.Paths.State(), r.Config.ConfigDigest)
		r.Log.Info("The NVIDIA driver is already loaded with the desired configuration, performing userspace-only install")
	case flavorErr != nil: // only a path that loads modules needs a flavour
		return flavorErr
	default:
		found, err := r.source().Find(ctx, r.facts, d.Flavor)
		if err != nil {
			return err
		}
		if found.Path == PathCompile && r.LoadOnly {
			return fmt.Errorf("%w: %s; load never compiles (init does)", exitcode.ErrNoInstallPath, found.Reason)
		}
		found.Flavor, found.FlavorReason = d.Flavor, d.FlavorReason
		d = found
		if nvLoaded {
			d.Reload = true
			d.Reason += fmt.Sprintf("; nvidia %s is loaded with another configuration and is unloaded first", orUnset(nv.Version))
		}
	}
	d.Modules, d.ModulesWhy = r.moduleSet()
	if r.Config.RDMA && !slices.Contains(d.Modules, "nvidia_peermem") {
		d.Extra = []string{"nvidia_peermem"} // installed for the peermem sidecar
	}
	r.mu.Lock()
	r.decision = d
	r.status.InstallPath, r.status.PathReason, r.status.Flavor = d.Path, d.Reason, d.Flavor
	r.mu.Unlock()
	r.Log.Info("install path chosen", "path", d.Path, "reason", d.Reason, "flavor", d.Flavor, "flavor_reason", d.FlavorReason)
	return nil
}

// moduleSet is the NVIDIA modules to load and why the optional ones are in or out.
func (r *run) moduleSet() ([]string, []string) {
	set := []string{"nvidia", "nvidia_uvm", "nvidia_modeset"}
	var why []string
	switch {
	case r.Config.RDMA && len(r.facts.Mellanox) > 0:
		set = append(set, "nvidia_peermem")
		why = append(why, fmt.Sprintf("nvidia_peermem: GPU_DIRECT_RDMA_ENABLED=true and %d Mellanox device(s)", len(r.facts.Mellanox)))
	case r.Config.RDMA:
		why = append(why, "nvidia_peermem left out: GPU_DIRECT_RDMA_ENABLED=true but no Mellanox device")
	}
	if r.Config.LoadDRM {
		set = append(set, "nvidia_drm")
		why = append(why, "nvidia_drm: --load-drm")
	}
	return set, why
}

func (r *run) source() Source {
	r.mu.Lock() // Snapshot reads r.src
	defer r.mu.Unlock()
	if r.src != nil {
		return r.src
	}
	r.src = r.Source
	if r.src == nil {
		src := &imageSource{cfg: r.Config, roots: r.Host.Roots, files: r.Host.Files, procs: r.Host.Procs, log: r.Log, terminal: r.Terminal}
		r.src = src
	}
	return r.src
}

func (r *run) prepare(ctx context.Context) error {
	switch r.decision.Path {
	case PathFast, PathHost:
		return nil
	}
	// The work dir is the run's private scratch (see package host): created, filled by the
	// compile and link path and removed here with os directly, never in a dry run.
	if r.Config.WorkDir != "" {
		if err := os.MkdirAll(r.Config.WorkDir, 0o700); err != nil {
			return fmt.Errorf("work dir: %w", err)
		}
		// This run holds the node's lock: work dirs there are left by agents that were killed.
		stale, _ := filepath.Glob(filepath.Join(r.Config.WorkDir, "driver-agent-*"))
		for _, d := range stale {
			r.Log.Info("removing the work dir of an earlier agent", "dir", d)
			if err := os.RemoveAll(d); err != nil {
				r.Log.Warn("could not remove an earlier agent's work dir", "dir", d, "error", err)
			}
		}
	}
	workDir, err := os.MkdirTemp(r.Config.WorkDir, "driver-agent-")
	if err != nil {
		return fmt.Errorf("work dir: %w", err)
	}
	r.push(PhasePrepare, func(ctx context.Context) error {
		// A cache store may still read the work dir; at the teardown's deadline the dir is left
		// (in the container's filesystem, or removed by the next start under --work-dir).
		if err := r.source().Wait(ctx); err != nil {
			return fmt.Errorf("work dir %s left: %w", workDir, err)
		}
		return os.RemoveAll(workDir)
	})
	return r.prepareModules(ctx, workDir, func(ctx context.Context) error { return r.prepareModules(ctx, workDir, nil) })
}

// planPrepare is prepare in a dry run. A cache entry's modules are opened, verified and read
// as a real run does (that only reads; a damaged entry's removal goes to the recorder, and the
// run decides again). Linking runs ld and writes files: for the precompiled and compile paths
// the plan names what would be loaded instead, modules whose .modinfo is not read.
func (r *run) planPrepare(ctx context.Context) error {
	switch r.decision.Path {
	case PathFast, PathHost:
		return nil
	case PathCached:
		return r.prepareModules(ctx, "", r.planPrepare)
	}
	for _, name := range r.decision.Modules {
		im := host.ModuleImage{Name: name, Path: fmt.Sprintf("<%s>/%s.ko", r.decision.Path, strings.ReplaceAll(name, "_", "-"))}
		r.images = append(r.images, im)
		r.files = append(r.files, modules.File{Image: im})
	}
	if r.decision.Path == PathCompile {
		_, err := r.source().Prepare(ctx, r.decision, "")
		return err
	}
	return nil
}

// prepareModules has the source make or open the decided modules and reads their .modinfo.
// When the cache entry chosen turns out damaged (and is removed), the run decides again and
// calls again, once: the source does not choose that entry a second time.
func (r *run) prepareModules(ctx context.Context, workDir string, again func(context.Context) error) error {
	images, err := r.source().Prepare(ctx, r.decision, workDir)
	if errors.Is(err, errDamagedEntry) && again != nil {
		r.Log.Warn("damaged cache entry removed; it will be rebuilt", "error", err)
		if err := r.decide(ctx); err != nil {
			return err
		}
		return again(ctx)
	}
	if err != nil {
		return err
	}
	r.images = images
	r.push(PhasePrepare, func(context.Context) error { closeFiles(r.images); return nil }) // when load did not run
	// Each module's .modinfo is read here, before load unloads a driver of another configuration:
	// a module that cannot be read fails the run with that driver still loaded.
	if r.files, err = modules.Resolve(images); err != nil {
		return fmt.Errorf("%w: %w", exitcode.ErrModuleLoad, err)
	}
	return nil
}

func (r *run) load(ctx context.Context) error {
	switch r.decision.Path {
	case PathHost:
		return r.waitForHostDriver(ctx)
	case PathFast:
		// What the agent that loaded them would have loaded; under the lock, the metrics read it.
		r.mu.Lock()
		r.loaded = r.decision.Modules
		r.mu.Unlock()
		r.push(PhaseLoad, r.unloadUndo)
		return nil
	}
	if r.decision.Reload {
		r.Log.Info("Unloading NVIDIA driver kernel modules...")
		u := r.unloader()
		u.Timeout = r.Config.UnloadTimeout
		if err := u.Unload(ctx, NVIDIAModules()); err != nil {
			if nu := (*modules.NoUnloadError)(nil); errors.As(err, &nu) {
				v := r.facts.Modules["nvidia"].Version
				return fmt.Errorf("the loaded NVIDIA driver %s cannot be replaced: %w; with --modules=host an image of driver %[1]s uses it", v, err)
			}
			return err
		}
	}
	// The driver root gets the modules while the first daemon starts (startInstall): nothing
	// before the peermem sidecar, which waits for Ready, reads them there.
	r.toRoot = slices.Clone(r.files)
	files := slices.DeleteFunc(slices.Clone(r.files), func(f modules.File) bool { return slices.Contains(r.decision.Extra, f.Image.Name) })
	if err := r.applyParams(files); err != nil {
		return err
	}
	prereqs, err := r.prerequisites(files)
	if err != nil {
		return err
	}
	if firmwareDisabled(files) {
		r.Log.Info("GPU firmware is disabled (NVreg_EnableGpuFirmware=0); leaving the firmware search path alone")
	} else {
		r.setFirmwarePath()
		if err := r.installFirmware(); err != nil {
			return fmt.Errorf("%w: %w", exitcode.ErrModuleLoad, err)
		}
	}
	loader := modules.Loader{Host: r.Host, Log: r.Log, Release: r.facts.KernelRelease}
	if len(prereqs) > 0 {
		r.Log.Info("Loading ipmi and i2c_core kernel modules...")
		if err := r.recordPrerequisites(fileNames(prereqs)); err != nil {
			return err
		}
		loaded, err := loader.Load(ctx, prereqs)
		if err != nil {
			return err
		}
		r.prereqs = loaded
		r.push(PhaseLoad, r.unloadPrereqs)
	}
	// nvidia-peermem goes last, on its own, as in NVIDIA's script (nothing of the set needs it).
	var peermem []modules.File
	if i := slices.IndexFunc(files, func(f modules.File) bool { return f.Image.Name == "nvidia_peermem" }); i >= 0 {
		peermem, files = files[i:i+1], slices.Delete(slices.Clone(files), i, i+1)
	}
	r.Log.Info("Loading NVIDIA driver kernel modules...")
	loaded, err := loader.Load(ctx, files)
	closeFiles(r.images)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.loaded = loaded
	r.mu.Unlock()
	r.push(PhaseLoad, r.unloadUndo)
	if len(peermem) > 0 {
		r.Log.Info("Loading NVIDIA Peer Memory kernel module...")
		loaded, err := loader.Load(ctx, peermem)
		r.mu.Lock()
		r.loaded = append(r.loaded, loaded...)
		r.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}

// applyParams sets each module's parameters from <drivers-dir>/<module>.conf, --module-param and
// the branch defaults, logs them, and writes /etc/modprobe.d/<module>.conf in the container root
// so that a later `chroot /run/nvidia/driver modprobe` (the peermem sidecar) uses the same ones.
func (r *run) applyParams(files []modules.File) error {
	var confNames []string
	for _, f := range files {
		confNames = append(confNames, strings.ReplaceAll(f.Image.Name, "_", "-"))
	}
	set, err := modparams.LoadDir(r.Host.DriversDir, confNames)
	if err != nil {
		return fmt.Errorf("%w: module parameters: %w", exitcode.ErrConfig, err)
	}
	set.Merge(&r.Config.ModuleParams)
	set.AddDefaults(modparams.Defaults(r.Config.DriverBranch))
	if r.Config.LoadDRM {
		// nvidia-drm is only loaded on request, and then for a display: modeset=1 unless the user says otherwise.
		var drm modparams.Set
		if err := drm.Add("nvidia-drm", modparams.Param{Name: "modeset", Value: "1"}); err != nil {
			return err
		}
		set.AddDefaults(&drm)
	}
	for i := range files {
		name := strings.ReplaceAll(files[i].Image.Name, "_", "-")
		ps := set.Params(name)
		files[i].Image.Params = ps.String()
		if len(ps) == 0 {
			continue
		}
		r.Log.Info(fmt.Sprintf("Module parameters provided for %s: %s", name, ps.String()))
		if err := r.writeModprobeConf(name, modparams.ModprobeConf(name, ps)); err != nil {
			return err
		}
	}
	return nil
}

func (r *run) writeModprobeConf(name string, content []byte) error {
	path := r.Host.InRoot("etc/modprobe.d", name+".conf")
	old, err := os.ReadFile(path)
	existed := err == nil
	if err := r.Host.Files.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := r.Host.Files.WriteFile(path, content, 0o644, true); err != nil {
		return err
	}
	r.push(PhaseLoad, func(context.Context) error {
		if existed {
			return r.Host.Files.WriteFile(path, old, 0o644, true)
		}
		return r.Host.Files.Remove(path)
	})
	return nil
}

// prerequisites are the in-kernel modules to load before the NVIDIA ones: i2c_core,
// ipmi_msghandler, ipmi_devintf, video where the kernel has it, and whatever the NVIDIA modules'
// depends= name outside their own set (drm on some kernels), each with its modules.dep closure.
func (r *run) prerequisites(files []modules.File) ([]modules.File, error) {
	inSet := map[string]bool{}
	for _, f := range files {
		inSet[f.Image.Name] = true
	}
	wanted := []string{"i2c_core", "ipmi_msghandler", "ipmi_devintf"}
	optional := map[string]bool{"video": true}
	wanted = append(wanted, "video")
	for _, f := range files {
		for _, d := range f.Info.Depends {
			if d = kernel.Normalize(d); !inSet[d] && !slices.Contains(wanted, d) {
				wanted = append(wanted, d)
			}
		}
	}
	loaded := map[string]bool{}
	if mods, err := kernel.Loaded(r.Host.Proc); err == nil {
		for _, m := range mods {
			loaded[m.Name] = true
		}
	}
	tree, err := modules.FindTree(r.Host.Roots, r.facts.KernelRelease, wanted)
	if err != nil {
		r.Log.Warn("cannot load prerequisite modules; the NVIDIA modules may fail with unknown symbols", "wanted", wanted, "error", err)
		return nil, nil
	}
	var images []host.ModuleImage
	seen := map[string]bool{}
	for _, w := range wanted {
		closure, known := tree.Closure(w, loaded)
		if !known {
			if !optional[w] {
				r.Log.Warn("prerequisite module not found in modules.dep; skipping", "module", w, "dir", tree.Dir)
			}
			continue
		}
		for _, im := range closure {
			if !seen[im.Name] {
				seen[im.Name] = true
				images = append(images, im)
			}
		}
	}
	resolved, err := tree.Resolve(images, modules.KernelDecompresses(r.Host.Roots))
	if err != nil {
		return nil, fmt.Errorf("%w: prerequisites: %w", exitcode.ErrModuleLoad, err)
	}
	return resolved, nil
}

// unloadPrereqs removes the prerequisites this run loaded, last first, once nvidia is gone; one
// that something else now uses stays loaded.
func (r *run) unloadPrereqs(context.Context) error {
	if r.nvidiaLoaded() {
		r.Log.Info("nvidia is still loaded; leaving the prerequisite modules loaded", "modules", r.prereqs)
		return nil
	}
	for i := len(r.prereqs) - 1; i >= 0; i-- {
		if err := r.Host.Kernel.UnloadModule(r.prereqs[i]); err != nil {
			r.Log.Info("leaving prerequisite module loaded", "module", r.prereqs[i], "reason", err)
		}
	}
	return nil
}

// waitForHostDriver waits, bounded by --host-modules-timeout, for the host to have loaded nvidia
// with the image's version; the agent never loads or unloads modules in this mode.
func (r *run) waitForHostDriver(ctx context.Context) error {
	deadline := r.clock.Now().Add(r.Config.HostModulesTimeout)
	lastLog := time.Time{}
	for {
		if ok, err := r.hostDriverLoaded(); ok || err != nil {
			return err
		}
		if r.clock.Now().After(deadline) {
			return fmt.Errorf("%w: the host manages the NVIDIA modules (%s) but nvidia is not loaded after %s", exitcode.ErrHostDriver, r.decision.Reason, r.Config.HostModulesTimeout)
		}
		if r.clock.Now().Sub(lastLog) > 30*time.Second {
			r.Log.Info("waiting for the host to load the NVIDIA driver", "why", r.decision.Reason, "timeout", r.Config.HostModulesTimeout)
			lastLog = r.clock.Now()
		}
		t := r.clock.NewTimer(time.Second)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C():
		}
	}
}

// hostDriverLoaded reports whether the host has loaded nvidia; one of another version than the
// image's is an error.
func (r *run) hostDriverLoaded() (bool, error) {
	nv, err := kernel.ReadSysModule(r.Host.Sys, "nvidia")
	switch {
	case err != nil:
		return false, err
	case nv.Loaded && (r.Config.DriverVersion == "" || nv.Version == r.Config.DriverVersion):
		r.Log.Info("using the host's NVIDIA driver", "version", nv.Version, "why", r.decision.Reason)
		return true, nil
	case nv.Loaded:
		return false, fmt.Errorf("%w: the host loaded nvidia %s, the image has %s: use the image that matches the host's driver", exitcode.ErrHostDriver, nv.Version, r.Config.DriverVersion)
	}
	return false, nil
}

// planLoad is load in a dry run: where the host manages the modules, it looks once for the
// host's driver instead of waiting for it.
func (r *run) planLoad(ctx context.Context) error {
	if r.decision.Path != PathHost {
		return r.load(ctx)
	}
	ok, err := r.hostDriverLoaded()
	if err == nil && !ok {
		r.notes = append(r.notes, "load: would wait up to "+r.Config.HostModulesTimeout.String()+" for the host to load nvidia")
	}
	return err
}

// unloadUndo unloads the modules this run owns; only once they are gone does it remove the
// device nodes and the stored digest, which stay valid while the driver is in use.
func (r *run) unloadUndo(ctx context.Context) error {
	r.Log.Info("Unloading NVIDIA driver kernel modules...")
	u := r.unloader()
	u.Pretended = r.loaded // in a dry run these were never loaded
	if err := u.Unload(ctx, r.loaded); err != nil {
		return err
	}
	return errors.Join(devices.Remove(r.Host, r.devices), r.st.ClearDigest())
}

// unloader removes the NVIDIA modules; holders the agent did not load stay, as users of the
// driver, unless --unload-foreign-holders.
func (r *run) unloader() modules.Unloader {
	return modules.Unloader{Host: r.Host, Log: r.Log, Clock: r.clock, UnloadForeign: r.Config.UnloadForeignHolders, DryRun: r.Config.DryRun}
}

// firmwareDisabled reports whether the nvidia parameters turn GPU firmware off.
func firmwareDisabled(files []modules.File) bool {
	for _, f := range files {
		ps, _ := modparams.ParseConf(strings.NewReader(f.Image.Params), "") // rendered by applyParams: valid
		if f.Image.Name == "nvidia" && ps.Is("NVreg_EnableGpuFirmware", "0") {
			return true
		}
	}
	return false
}

// setFirmwarePath points the kernel's firmware search path at the shared driver root, unless
// something is configured there already. Failures only warn: the modules may not need firmware.
func (r *run) setFirmwarePath() {
	path := r.Host.InSys("module/firmware_class/parameters/path")
	cur, err := os.ReadFile(path)
	if err != nil {
		r.Log.Warn("cannot read the firmware search path; not setting it", "path", path, "error", err)
		return
	}
	if r.jr.firmware {
		r.Log.Info("the firmware search path was set by an earlier agent; this run resets it at teardown", "path", path)
		return
	}
	if v := strings.TrimSpace(string(cur)); v != "" {
		r.Log.Warn("A search path is already configured; retaining the current configuration", "path", path, "value", v)
		return
	}
	if len(cur) == 0 {
		cur = []byte("\n")
	}
	if err := r.recordFirmwarePath(cur); err != nil {
		r.Log.Warn("not setting the firmware search path", "path", path, "error", err)
		return
	}
	r.Log.Info(fmt.Sprintf("Configuring the following firmware search path in '%s': %s", path, firmwareSearchPath))
	if err := r.Host.Files.WriteFile(path, []byte(firmwareSearchPath), 0o644, false); err != nil {
		r.Log.Warn("could not set the firmware search path", "path", path, "error", err)
		return
	}
	r.push(PhaseLoad, func(context.Context) error {
		if r.nvidiaLoaded() {
			r.Log.Info("nvidia is still loaded; leaving the firmware search path set", "path", path)
			return nil
		}
		return r.Host.Files.WriteFile(path, cur, 0o644, false)
	})
}

func (r *run) devicesPhase(context.Context) error {
	if r.decision.Path == PathHost {
		return nil
	}
	nodes, err := devices.Plan(r.Host.Roots, slices.Contains(r.loaded, "nvidia_modeset"))
	if err != nil {
		return err
	}
	if err := r.recordDevices(nodePaths(nodes)); err != nil {
		return err
	}
	created, err := devices.Create(r.Host, nodes)
	r.mu.Lock()
	r.devices = append(r.devices, created...)
	r.mu.Unlock()
	return err
}

// planDevices is devicesPhase in a dry run: the nodes' major numbers are the loaded driver's, so
// with none loaded the plan says what would be created.
func (r *run) planDevices(ctx context.Context) error {
	if _, err := os.Stat(r.Host.InProc("driver/nvidia")); err != nil && r.decision.Path != PathHost {
		r.notes = append(r.notes, fmt.Sprintf("devices: once the driver is loaded, would create %[1]s/nvidiactl, %[1]s/nvidia<N> for each GPU (%[2]d found on PCI), %[1]s/nvidia-modeset and %[1]s/nvidia-uvm{,-tools}", r.Host.Dev, len(r.facts.GPUs)))
		return nil
	}
	return r.devicesPhase(ctx)
}

// daemonStartTimeout bounds how long the agent waits for each required daemon to come up.
const daemonStartTimeout = 2 * time.Minute

// daemonSpecs are the daemons this node needs, in start order: nvidia-persistenced; on a vGPU
// guest nvidia-gridd and nvidia-topologyd; then NVLSM and fabric manager on NVLink5 nodes, or
// fabric manager on NVSwitch nodes. With noWait the NVLink5 prerequisites are checked once,
// not waited for.
func (r *run) daemonSpecs(ctx context.Context, noWait bool) ([]daemon.Spec, fabric.Plan, error) {
	pidDir := r.Host.InRoot("var/run/nvidia-persistenced")
	specs := []daemon.Spec{{
		Name: "nvidia-persistenced", Required: true,
		Cmd:     host.Cmd{Path: r.Host.InRoot("usr/bin/nvidia-persistenced"), Args: r.Config.PersistencedArgs},
		PIDFile: filepath.Join(pidDir, "nvidia-persistenced.pid"), StopTimeout: r.Config.DaemonStopTimeout,
		Prepare: func() error { return r.Host.Files.MkdirAll(pidDir, 0o755) },
	}}
	vgpu, err := r.vgpuSpecs()
	if err != nil {
		return nil, fabric.Plan{}, err
	}
	specs = append(specs, vgpu...)
	plan, err := fabric.Prepare(ctx, fabric.Options{
		Roots: r.Host.Roots, Files: r.Host.Files, Log: r.Log, Overrides: r.Config.NVFM,
		ConfigCopy: r.Host.InRun("nvidia/driver-agent/fabricmanager.cfg"), PrereqTimeout: r.Config.NVLink5PrereqTimeout,
		StopTimeout: r.Config.DaemonStopTimeout, NoWait: noWait, SettleTime: r.FabricSettle, Clock: r.clock,
		SwitchTrays: &r.facts.SwitchTrays,
	})
	if err != nil {
		return nil, plan, err
	}
	if plan.ConfigPath != "" {
		r.push(PhaseDaemons, func(context.Context) error { return r.Host.Files.Remove(plan.ConfigPath) })
	}
	for _, w := range plan.Warnings {
		r.notes = append(r.notes, "fabric: "+w)
	}
	return append(specs, plan.Daemons...), plan, nil
}

func (r *run) daemonsPhase(ctx context.Context) error {
	specs, plan, err := r.daemonSpecs(ctx, false)
	if err != nil {
		return err
	}
	childProc := r.ChildProc
	if childProc == "" {
		childProc = r.Host.Proc
	}
	sup := daemon.NewSupervisor(daemon.Options{Procs: r.Host.Procs, Log: r.Log, Proc: childProc, Clock: r.clock, OnChange: func(daemon.Status) {
		// status.json follows every daemon change (a crash, a restart) within statusEvery.
		r.mu.Lock()
		r.status.Daemons = daemonStatuses(r.sup)
		r.mu.Unlock()
		r.noteStatus()
	}})
	r.mu.Lock()
	r.sup = sup
	r.mu.Unlock()
	r.push(PhaseDaemons, func(ctx context.Context) error {
		r.Log.Info("Stopping NVIDIA persistence daemon...")
		return sup.Stop(ctx)
	})
	for _, s := range specs {
		if s.Policy == (daemon.Policy{}) {
			s.Policy = r.DaemonPolicy
		}
		r.Log.Info(daemonStartLine(s.Name), "command", s.CommandLine())
		if _, err := sup.Start(s); err != nil {
			return fmt.Errorf("%w: %w", exitcode.ErrDaemon, err)
		}
		r.startInstall()
		wctx, cancel := context.WithTimeout(ctx, daemonStartTimeout)
		err := sup.WaitUp(wctx, s.Name)
		cancel()
		switch {
		case err == nil:
		case ctx.Err() != nil:
			return ctx.Err()
		case !s.Required:
			r.Log.Warn("an optional daemon is not up; going on without it", "daemon", s.Name, "error", err)
		default:
			return err
		}
	}
	if plan.ResetGPUs {
		r.Log.Info("Resetting the GPUs to clear stale fabric partitions (NVFM_CONFIG_FABRIC_MODE=1)")
		if _, err := r.Host.Procs.Output(ctx, host.Cmd{Path: r.nvidiaSMI(), Args: []string{"-r"}}); err != nil {
			r.Log.Warn("nvidia-smi -r failed", "error", err)
		}
	}
	if len(plan.Daemons) > 0 {
		return r.checkFabric(ctx, plan)
	}
	return nil
}

// planDaemons is the daemons phase of a dry run: the recorder takes each daemon's command line
// and, at teardown, its SIGTERM. The supervisor, which waits for a PID file or a readiness
// probe, does not run, nor is the fabric state read or the NVLink5 prerequisites waited for.
func (r *run) planDaemons(ctx context.Context) error {
	specs, plan, err := r.daemonSpecs(ctx, true)
	if err != nil {
		return err
	}
	for _, s := range specs {
		if _, err := os.Stat(s.Cmd.Path); err != nil {
			r.notes = append(r.notes, fmt.Sprintf("daemons: %s is not in this container root; in the driver image it is", s.Cmd.Path))
		}
		p, _ := r.Host.Procs.Start(ctx, s.Cmd, host.StartOptions{}) // the recorder: the plan shows the command line
		r.push(PhaseDaemons, func(context.Context) error { return p.Signal(syscall.SIGTERM) })
		r.startInstall()
	}
	if len(plan.Daemons) > 0 {
		if _, err := os.Stat(r.nvidiaSMI()); err != nil {
			r.notes = append(r.notes, fmt.Sprintf("daemons: %s is not in this container root, so the fabric state would not be checked", r.nvidiaSMI()))
		} else {
			r.notes = append(r.notes, fmt.Sprintf("daemons: once %s is up, would read the fabric state with %s -q and fail on a fabric failure", fabric.FabricManagerName, r.nvidiaSMI()))
		}
	}
	return nil
}

func daemonStartLine(name string) string {
	switch name {
	case "nvidia-persistenced":
		return "Starting NVIDIA persistence daemon..."
	case fabric.NVLSMName:
		return "Starting NVIDIA NVLink subnet manager..."
	case fabric.FabricManagerName:
		return "Starting NVIDIA fabric manager daemon..."
	}
	return "Starting " + name + "..."
}

// daemonStatuses converts the supervisor's view for status.json; sup may be nil.
func daemonStatuses(sup *daemon.Supervisor) []status.Daemon {
	if sup == nil {
		return nil
	}
	var out []status.Daemon
	for _, st := range sup.Statuses() {
		d := status.Daemon{Name: st.Name, State: string(st.State), Restarts: st.Restarts}
		if n := len(st.Tail); n > 0 {
			d.LastLog = st.Tail[n-1]
		}
		out = append(out, d)
	}
	return out
}

func (r *run) shareRoot(context.Context) error {
	if err := r.waitInstall(); err != nil { // the root is complete before the node sees it
		return err
	}
	target := r.Host.InRun("nvidia/driver")
	if mounted, err := kernel.IsMountPoint(r.Host.Proc, target); err != nil {
		return err
	} else if mounted {
		r.Log.Info("Unmounting NVIDIA driver rootfs...")
		if err := r.Host.Mounter.Unmount(target, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount stale %s: %w", target, err)
		}
	}
	r.Log.Info("Mounting NVIDIA driver rootfs...")
	if err := r.Host.Mounter.Mount("none", r.Host.Sys, "", unix.MS_REC|unix.MS_UNBINDABLE, ""); err != nil {
		return fmt.Errorf("make %s unbindable: %w", r.Host.Sys, err)
	}
	if err := r.Host.Mounter.Mount("none", r.Host.Sys, "", unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make %s private: %w", r.Host.Sys, err)
	}
	if err := r.Host.Files.MkdirAll(target, 0o755); err != nil {
		return err
	}
	// A Bidirectional volume makes the runtime's root rshared, and a copy of a shared mount is
	// its peer. The copy holds copies of the root's own mounts (<run>/nvidia among them), so
	// unmounting it would propagate to the root and unmount the container's /proc, /dev and
	// <run>/nvidia volume: the teardown's digest, PID file and status writes then land in the
	// image's empty directory and stay on the host (seen in the VM's container scenarios). As a
	// slave the root still receives mounts but sends none, and its copy, mounted on the shared
	// <run>/nvidia, is a peer of the host's copy alone: the unmount takes the host's with it.
	if err := r.Host.Mounter.Mount("none", r.Host.Root, "", unix.MS_SLAVE, ""); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("make %s a slave mount: %w", r.Host.Root, err)
	} // EINVAL: the root is not a mount point, so not shared either
	if err := r.recordMount(target); err != nil {
		return err
	}
	if err := r.Host.Mounter.Mount(r.Host.Root, target, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("share %s at %s: %w", r.Host.Root, target, err)
	}
	r.push(PhaseShareRoot, func(context.Context) error {
		r.Log.Info("Unmounting NVIDIA driver rootfs...")
		if err := r.Host.Mounter.Unmount(target, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount %s: %w", target, err)
		}
		return nil
	})
	return nil
}

func (r *run) ready(ctx context.Context) error {
	if err := r.source().Wait(ctx); err != nil { // a Ready node's cache holds its modules
		return err
	}
	if r.decision.Path != PathHost {
		r.Log.Info("Storing driver configuration digest...")
		if err := r.st.StoreDigest(r.Config.ConfigDigest); err != nil {
			return err
		}
		r.Log.Info("Driver configuration digest stored", "path", r.st.Paths.State())
	}
	if r.decision.Path == PathFast {
		r.Log.Info("Userspace-only install complete")
	}
	cacheDir, modulesDir := r.modulesKept()
	r.update(func(s *status.Status) {
		s.Ready = true // status.json says ready no later than the operator's file
		s.ModulesCacheDir, s.ModulesDir = cacheDir, modulesDir
	})
	r.setPhase(PhaseReady)
	if err := r.st.SetReady(true); err != nil {
		return err
	}
	r.push(PhaseReady, func(context.Context) error {
		r.update(func(s *status.Status) { s.Ready = false })
		return r.st.SetReady(false)
	})
	return nil
}
