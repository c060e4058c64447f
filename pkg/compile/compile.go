package compile

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/driver-agent/driver-agent/pkg/build"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/link"
	"github.com/driver-agent/driver-agent/pkg/relocate"
)

// ErrImpossible means no build tree can be had for the running kernel: the host has none, none
// was given, and the host is not Flatcar, so there is no release server to download one from.
var ErrImpossible = errors.New("no way to get a kernel build tree")

// Options configures Plan and Run.
type Options struct {
	// Roots.HostRoot is the host's root filesystem, searched for the host's own build tree;
	// Roots.Proc and Roots.Sys are passed to the build (see build.Options.Roots).
	Roots host.Roots
	// KernelBuildTree is a tree given with --kernel-build-tree, tried after the host's.
	KernelBuildTree string
	// KernelRelease and Banner are the running kernel's release and /proc/version first line.
	KernelRelease, Banner string
	// DriverVersion is the NVIDIA driver version, for messages (the image tag to use instead).
	DriverVersion string
	// Flatcar is the host's Flatcar release; nil when the host is not Flatcar.
	Flatcar *detect.Flatcar
	// Fetch configures the download from Flatcar's release server (URLs, keyring, timeouts,
	// progress, log); its Log and Progress default to Log and Terminal.
	Fetch flatcar.Options
	// SourceDir is the driver's kernel source directory for the flavour,
	// /usr/src/nvidia-<version>/<kernel|kernel-open>.
	SourceDir string
	// WorkDir is private to this run (it must not exist, or be empty); the download and the build
	// go there, and the caller removes it.
	WorkDir string
	// Jobs and CC are passed to the build (see build.Options).
	Jobs int
	CC   string
	// Procs runs every child process (patchelf, the helpers' checks, make, the compiler).
	Procs host.Procs
	// Log receives progress; nil discards it.
	Log *slog.Logger
	// Terminal, when set, gets progress bars.
	Terminal io.Writer
}

// Result is a finished compile.
type Result struct {
	// Modules are the built modules, in WorkDir.
	Modules []link.Module
	// Tree is the build tree used.
	Tree Tree
	// Downloaded is the size of the downloaded tarball (0 for a local tree).
	Downloaded int64
	// DownloadTime and BuildTime are how long the download and the build took.
	DownloadTime, BuildTime time.Duration
	// LogFile is the build log.
	LogFile string
}

func (o *Options) log() *slog.Logger {
	if o.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return o.Log
}

// release is the Flatcar release to download, from what the host says.
func (o *Options) release() flatcar.Release {
	return flatcar.Release{Channel: o.Flatcar.Channel, Board: o.Flatcar.Board, Version: o.Flatcar.Version}
}

// imageTag is the driver image tag that carries a precompiled package for this host's release.
func (o *Options) imageTag() string {
	if o.Flatcar == nil {
		return ""
	}
	return fmt.Sprintf("%s-flatcar%s", o.DriverVersion, o.Flatcar.Version)
}

// Plan says, reading only, where the build tree would come from: a local tree, or the release
// server's first candidate URL. It returns an error wrapping ErrImpossible when there is none.
func Plan(o Options) (string, error) {
	t, skipped, err := localTree(o.Roots.HostRoot, o.KernelBuildTree, o.KernelRelease)
	switch {
	case err == nil:
		return fmt.Sprintf("compile against the build tree at %s (%s)", t.Dir, t.From), nil
	case !errors.Is(err, ErrNoTree):
		return "", err
	}
	if o.Flatcar == nil {
		return "", impossible(o, skipped)
	}
	f, err := flatcar.New(o.Fetch)
	if err != nil {
		return "", err
	}
	urls, err := f.Candidates(o.release())
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("download %s for Flatcar %s (%s, %s) from %s (then %d other places), verify it, and compile against its build tree",
		flatcar.ContainerImage, o.Flatcar.Version, o.Flatcar.Board, o.Flatcar.Channel, urls[0], len(urls)-1), nil
}

func impossible(o Options, skipped []string) error {
	why := ""
	if len(skipped) > 0 {
		why = " (passed over: " + strings.Join(skipped, "; ") + ")"
	}
	k := o.KernelRelease
	return fmt.Errorf("%w for kernel %s: the host has none in /usr/lib/modules/%s/build or /lib/modules/%s/build%s, --kernel-build-tree is not set, and the host is not Flatcar, so there is no release server to download one from; set --kernel-build-tree or use an image with a precompiled package for this kernel",
		ErrImpossible, k, k, k, why)
}

// Run finds or downloads the build tree, makes its helpers runnable when it came from the
// release server, and builds the modules.
func Run(ctx context.Context, o Options) (Result, error) {
	log := o.log()
	var res Result
	if err := os.MkdirAll(o.WorkDir, 0o700); err != nil {
		return res, fmt.Errorf("work dir: %w", err)
	}
	log.Info("Finding the kernel build tree...", "kernel", o.KernelRelease) // the Flatcar download says the script's line itself
	t, skipped, err := localTree(o.Roots.HostRoot, o.KernelBuildTree, o.KernelRelease)
	for _, s := range skipped {
		log.Warn("kernel build tree passed over", "why", s)
	}
	switch {
	case err == nil && t.From == "host":
		// The host's tree is read-only host data whose helpers are linked against the host's C
		// library: build against a private copy, relocated to the host's loader where needed.
		log.Info("copying the host's kernel build tree", "dir", t.Dir)
		cp := filepath.Join(o.WorkDir, "host-tree")
		if err := os.Mkdir(cp, 0o700); err != nil {
			return res, fmt.Errorf("copy the host's kernel build tree: %w", err)
		}
		if err := build.CopyTree(ctx, t.Dir, cp); err != nil {
			return res, fmt.Errorf("copy the host's kernel build tree %s: %w", t.Dir, err)
		}
		t.Dir, t.Sysroot = cp, o.Roots.HostRoot
	case err == nil:
		log.Info("using the kernel build tree", "dir", t.Dir, "from", t.From)
	case !errors.Is(err, ErrNoTree):
		return res, err
	case o.Flatcar == nil:
		return res, impossible(o, skipped)
	default:
		start := time.Now()
		if t, res.Downloaded, err = fetch(ctx, o, log); err != nil {
			return res, err
		}
		res.DownloadTime = time.Since(start)
	}
	res.Tree = t
	if t.Sysroot != "" {
		r, err := relocate.Tree(ctx, t.Dir, relocate.Options{Sysroot: t.Sysroot, Procs: o.Procs, Log: log})
		if err != nil {
			return res, fmt.Errorf("make the build helpers of %s runnable: %w", t.Dir, err)
		}
		log.Info("build helpers ready", "relocated", len(r.Relocated), "runnable", len(r.Runnable), "static", len(r.Static))
	}
	start := time.Now()
	res.LogFile = filepath.Join(o.WorkDir, "build.log")
	res.Modules, err = build.Modules(ctx, build.Options{
		SourceDir: o.SourceDir, BuildTree: t.Dir, KernelRelease: o.KernelRelease, Banner: o.Banner,
		Jobs: o.Jobs, Roots: o.Roots, CC: o.CC, WorkDir: filepath.Join(o.WorkDir, "build"), LogFile: res.LogFile,
		Procs: o.Procs, Log: log, Terminal: o.Terminal,
	})
	res.BuildTime = time.Since(start)
	if err != nil {
		return res, err
	}
	log.Info("kernel modules built", "modules", len(res.Modules), "seconds", res.BuildTime.Seconds())
	return res, nil
}

// fetch downloads and verifies the host release's build tree into the work dir.
func fetch(ctx context.Context, o Options, log *slog.Logger) (Tree, int64, error) {
	fo := o.Fetch
	if fo.Log == nil {
		fo.Log = log
	}
	if fo.Progress == nil {
		fo.Progress = o.Terminal
	}
	f, err := flatcar.New(fo)
	if err != nil {
		return Tree{}, 0, err
	}
	ft, err := f.BuildTree(ctx, o.release(), o.KernelRelease, filepath.Join(o.WorkDir, "flatcar"))
	switch {
	case errors.Is(err, flatcar.ErrUnreachable):
		return Tree{}, 0, fmt.Errorf("%w; or use the precompiled image tagged %s", err, o.imageTag())
	case errors.Is(err, flatcar.ErrNotFound):
		return Tree{}, 0, fmt.Errorf("%w; or use the precompiled image tagged %s", err, o.imageTag())
	case err != nil:
		return Tree{}, 0, err
	}
	if !ft.Verified {
		log.Warn("using a kernel build tree whose signature was not verified (--insecure-skip-verify)", "url", ft.URL)
	}
	return Tree{Dir: ft.BuildDir, From: ft.URL, Sysroot: ft.Root}, ft.Downloaded, nil
}
