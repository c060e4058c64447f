package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/depmod"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/modules"
)

// driverRootModuleDir is where NVIDIA's installer puts the modules, relative to
// /lib/modules/<kver>.
const driverRootModuleDir = "kernel/drivers/video"

// modulesKept says where the modules in use are kept for the peermem sidecar: the module cache
// that holds them, and where they are installed in the shared driver root as the node sees it.
func (r *run) modulesKept() (cacheDir, driverRoot string) {
	if r.decision.Path == PathHost {
		return "", ""
	}
	if k, ok := r.source().(interface{ KeptIn() string }); ok {
		cacheDir = k.KeptIn()
	}
	if r.inRoot {
		driverRoot = r.Host.InRun("nvidia/driver/lib/modules", r.facts.KernelRelease, driverRootModuleDir)
	}
	return cacheDir, driverRoot
}

// startInstall starts installing in the driver root the modules load left for it (toRoot), in
// a goroutine whose thread runs in SCHED_IDLE, and pushes the undo, which waits for it. The
// daemons phase calls it once the first daemon, nvidia-persistenced, is started: that daemon's
// start waits on the GPUs (on a node, each GPU's firmware; in the VM bench, the stand-in's
// launcher sleeps), and the copies and the two index writes take that idle time instead of
// adding to the start. A dry run installs at once, so that its plan is in a fixed order.
// waitInstall, before the root is shared, gives the thread its priority back and waits.
func (r *run) startInstall() {
	files := r.toRoot
	r.toRoot = nil
	if len(files) == 0 {
		return
	}
	in := &rootInstall{}
	r.install = in
	r.push(PhaseDaemons, func(ctx context.Context) error {
		r.waitInstall() // its error was share-root's, or the run failed before that
		if in.undo == nil {
			return nil
		}
		return in.undo(ctx)
	})
	if r.Config.DryRun {
		in.undo, in.err = r.installModules(files)
		return
	}
	in.bg.Name, in.bg.Log = "the driver root's install", r.Log
	in.bg.Go(func() { in.undo, in.err = r.installModules(files) })
}

// rootInstall is startInstall's install: undo and err are set once bg's Wait has returned (at
// once in a dry run, which installs before startInstall returns and never calls bg's Go).
type rootInstall struct {
	bg   host.Background
	undo func(context.Context) error // what it changed, nil when nothing
	err  error
}

// waitInstall waits for the install startInstall began, if any, and returns its error.
func (r *run) waitInstall() error {
	in := r.install
	if in == nil {
		return nil
	}
	in.bg.Wait(context.Background()) // never ends early: the install only copies local files
	if in.err == nil {
		r.inRoot = true
	}
	return in.err
}

// installModules copies the NVIDIA modules of files into the container root's
// /lib/modules/<kver>/kernel/drivers/video/ and adds them to modules.dep and modules.dep.bin
// there, as NVIDIA's script does with nvidia-installer --kernel-module-only, so that `chroot
// /run/nvidia/driver modprobe nvidia-peermem` (the peermem sidecar, and tools that expect it)
// finds them. A modules.dep already there keeps its other lines. It returns, with any error,
// the undo of what it changed (nil when nothing): remove the files and restore the index.
func (r *run) installModules(files []modules.File) (func(context.Context) error, error) {
	// In the container root, which the node sees as /run/nvidia/driver.
	moddir := r.Host.InRoot("lib/modules", r.facts.KernelRelease)
	dir := filepath.Join(moddir, driverRootModuleDir)
	r.Log.Info("Installing NVIDIA driver kernel modules...", "dir", dir)
	oldDep, depErr := kernel.ReadLimit(filepath.Join(moddir, "modules.dep"), 64<<20)
	if depErr != nil && !errors.Is(depErr, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: driver root: %w", exitcode.ErrModuleLoad, depErr)
	}
	oldBin, binErr := kernel.ReadLimit(filepath.Join(moddir, "modules.dep.bin"), 64<<20)
	if binErr != nil && !errors.Is(binErr, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: driver root: %w", exitcode.ErrModuleLoad, binErr)
	}
	entries, err := depmod.Parse(bytes.NewReader(oldDep))
	if err != nil {
		return nil, fmt.Errorf("%w: driver root %s: %w", exitcode.ErrModuleLoad, moddir, err)
	}
	rmdirs, err := r.mkdirs(dir)
	if err != nil {
		return nil, fmt.Errorf("%w: driver root: %w", exitcode.ErrModuleLoad, err)
	}
	var copied []string
	undo := func(ctx context.Context) error {
		errs := []error{restore(r, filepath.Join(moddir, "modules.dep"), oldDep, depErr), restore(r, filepath.Join(moddir, "modules.dep.bin"), oldBin, binErr)}
		for _, p := range copied {
			errs = append(errs, r.Host.Files.Remove(p))
		}
		if rmdirs != nil {
			errs = append(errs, rmdirs(ctx))
		}
		return errors.Join(errs...)
	}
	rel := map[string]string{} // module name -> path relative to moddir
	for _, f := range files {
		rel[f.Image.Name] = path.Join(driverRootModuleDir, strings.ReplaceAll(f.Image.Name, "_", "-")+moduleSuffix(f.Image.Path))
	}
	// The NVIDIA modules' lines replace any earlier ones for the same names (an earlier run's).
	entries = slices.DeleteFunc(entries, func(e depmod.Entry) bool { _, ours := rel[e.Name()]; return ours })
	for _, f := range files {
		to := filepath.Join(moddir, rel[f.Image.Name])
		if err := r.linkOrCopy(f.Image.Path, to); err != nil {
			return undo, fmt.Errorf("%w: driver root: %w", exitcode.ErrModuleLoad, err)
		}
		copied = append(copied, to)
		entries = append(entries, depmod.Entry{Path: rel[f.Image.Name], Depends: closure(f.Image.Name, files, rel)})
	}
	bin, err := depmod.DepBin(entries)
	if err != nil {
		return undo, fmt.Errorf("%w: driver root: %w", exitcode.ErrModuleLoad, err)
	}
	if err := r.Host.Files.WriteFile(filepath.Join(moddir, "modules.dep"), depmod.Dep(entries), 0o644, true); err != nil {
		return undo, fmt.Errorf("%w: driver root: %w", exitcode.ErrModuleLoad, err)
	}
	if err := r.Host.Files.WriteFile(filepath.Join(moddir, "modules.dep.bin"), bin, 0o644, true); err != nil {
		return undo, fmt.Errorf("%w: driver root: %w", exitcode.ErrModuleLoad, err)
	}
	return undo, nil
}

// linkOrCopy hard-links src at dst when both are on one filesystem (a module linked in the work
// dir), and copies it otherwise (a module from the host cache).
func (r *run) linkOrCopy(src, dst string) error {
	if err := r.Host.Files.Remove(dst); err != nil {
		return err
	}
	if r.Host.Files.Link(src, dst) == nil {
		return nil
	}
	return r.Host.Files.CopyFile(src, dst, 0o644)
}

// restore puts back a file as it was before the run: rewritten, or removed when it did not exist.
func restore(r *run, p string, old []byte, readErr error) error {
	if readErr != nil {
		return r.Host.Files.Remove(p)
	}
	return r.Host.Files.WriteFile(p, old, 0o644, true)
}

// moduleSuffix keeps a compressed module's suffix, which modprobe needs to read it.
func moduleSuffix(p string) string {
	for _, s := range []string{".ko.xz", ".ko.zst", ".ko.gz"} {
		if strings.HasSuffix(p, s) {
			return s
		}
	}
	return ".ko"
}

// closure lists what name needs among files, as modules.dep does: every module it needs
// directly or not, those loaded first last. Dependencies outside the set (drm, ib_core) are
// loaded by the agent or by MOFED before anything runs modprobe, so they are left out.
func closure(name string, files []modules.File, rel map[string]string) []string {
	byName := map[string]modules.File{}
	for _, f := range files {
		byName[f.Image.Name] = f
	}
	var order []string
	seen := map[string]bool{name: true}
	var visit func(n string)
	visit = func(n string) {
		for _, d := range byName[n].Info.Depends {
			d = kernel.Normalize(d)
			if _, ok := byName[d]; !ok || seen[d] {
				continue
			}
			seen[d] = true
			visit(d)
			order = append(order, rel[d])
		}
	}
	visit(name)
	slices.Reverse(order)
	return order
}
