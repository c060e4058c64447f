package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/build"
	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/sysext"
)

func sysextUsage(w io.Writer, prog string) {
	fmt.Fprintf(w, `Usage: %[1]s sysext --flatcar-version V [--channel C] [--board B]
            [--kernel-build-tree DIR] [--source DIR] [--driver-version V] -o DIR

Image builds: make a systemd system extension of the driver for one Flatcar release, for node
images that carry the driver themselves (place it in /etc/extensions/). It downloads and
verifies the release's kernel build tree as fetch-build-tree does (or uses --kernel-build-tree),
builds the modules as build does, and writes
  DIR/nvidia-driver-<driver>-flatcar<V>.raw   a squashfs with
      /usr/lib/modules/<kver>/updates/nvidia*.ko (and their modules.dep entries in
          nvidia.modules.dep; no modules.dep of the kernel's name, which would hide the host's)
      /usr/bin/nvidia-smi, nvidia-persistenced; the driver's libraries in /usr/lib64;
          the GSP firmware in /usr/lib/firmware/nvidia/<driver>  (from --container-root)
      /usr/lib/systemd/system/%[2]s (enabled): loads the modules, runs nvidia-persistenced
      /usr/lib/extension-release.d/extension-release.<name>: ID=flatcar, VERSION_ID=V and
          ARCHITECTURE, so systemd-sysext refuses it on any other release
  DIR/SHA256SUMS                              its sha256 (other lines kept)
The image is written under a temporary name and renamed when complete: a failure leaves DIR as
it was. On a node with the extension, init takes the host-managed path and names it.

Options:
  --flatcar-version V       the release's VERSION_ID, e.g. 4593.2.0 (required)
  --board B                 amd64-usr (default) or arm64-usr
  --channel C               stable, beta, alpha or lts (default: from the version's minor number)
  --kernel-build-tree DIR   the release's kernel build tree, instead of downloading it
  --flatcar-release-url U, --flatcar-signing-key F, --insecure-skip-verify
                            as for fetch-build-tree
  --source DIR              the driver's kernel source directory (default
                            /usr/src/nvidia-<driver version>/kernel, or kernel-open)
  --kernel-module-type T    proprietary or open (default $KERNEL_MODULE_TYPE, else proprietary)
  --driver-version V        default $DRIVER_VERSION, else the source's NV_VERSION_STRING
  --container-root DIR      where the userspace is taken from (default /, the driver image)
  --cc CC, -j N, --work-dir DIR
                            as for build
  -o DIR                    the output directory (created if missing; required)

Exit codes: 0 done, 1 download, verification, build or image failed, 2 usage or unusable input.
`, prog, sysext.UnitName)
}

// runSysext runs `driver-agent sysext`.
func runSysext(ctx context.Context, prog string, args, environ []string, stdout, stderr io.Writer) int {
	env := map[string]string{}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	fs := flag.NewFlagSet(prog+" sysext", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var flags releaseFlags
	flags.register(fs)
	rel := &flags.rel
	tree := fs.String("kernel-build-tree", "", "")
	source := fs.String("source", "", "")
	moduleType := fs.String("kernel-module-type", env["KERNEL_MODULE_TYPE"], "")
	driverVersion := fs.String("driver-version", env["DRIVER_VERSION"], "")
	root := fs.String("container-root", "/", "")
	cc := fs.String("cc", "", "")
	jobs := fs.String("j", env["MAX_THREADS"], "")
	workDir := fs.String("work-dir", "", "")
	out := fs.String("o", "", "")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			sysextUsage(stdout, prog)
			return 0
		}
		fmt.Fprintf(stderr, "%s sysext: %v\nRun '%s sysext --help' for usage.\n", prog, err, prog)
		return 2
	}
	fail := func(code int, format string, a ...any) int {
		fmt.Fprintf(stderr, "%s sysext: %s\n", prog, fmt.Sprintf(format, a...))
		return code
	}
	if *moduleType == "" || *moduleType == "auto" {
		*moduleType = "proprietary"
	}
	n := 0
	if *jobs != "" {
		var err error
		if n, err = strconv.Atoi(*jobs); err != nil || n < 0 || n > 1024 {
			return fail(2, "-j %q (or MAX_THREADS): want 1 to 1024 (0: from CPUs and memory)", *jobs)
		}
	}
	switch {
	case fs.NArg() > 0:
		return fail(2, "unexpected arguments %q", fs.Args())
	case rel.Version == "":
		return fail(2, "set --flatcar-version to the release's VERSION_ID, e.g. 4593.2.0")
	case *out == "":
		return fail(2, "set -o to the output directory")
	case *source == "" && *driverVersion == "":
		return fail(2, "give --source DIR or --driver-version V (the source is then /usr/src/nvidia-V/kernel, or kernel-open with --kernel-module-type open)")
	case *moduleType != "proprietary" && *moduleType != "open":
		return fail(2, "--kernel-module-type %q: want proprietary or open", *moduleType)
	}
	if err := rel.Validate(); err != nil {
		return fail(2, "%v", err)
	}
	arch, err := sysext.Architecture(rel.Board)
	if err != nil {
		return fail(2, "--board: %v", err)
	}
	if *source == "" {
		flavor := "kernel"
		if *moduleType == "open" {
			flavor = "kernel-open"
		}
		*source = filepath.Join("/usr/src", "nvidia-"+*driverVersion, flavor)
	}
	if *driverVersion == "" {
		if *driverVersion, err = build.SourceVersion(*source); err != nil {
			return fail(2, "%v; give --driver-version", err)
		}
	}
	if _, _, ok := sysext.ParseName(sysext.Name(*driverVersion, rel.Version)); !ok {
		return fail(2, "driver version %q: want one like 535.261.03", *driverVersion)
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	var fetcher *flatcar.Fetcher
	if *tree == "" {
		if fetcher, err = flags.fetcher(log); err != nil {
			return fail(2, "%v", err)
		}
	}

	tmp, err := os.MkdirTemp(*workDir, "driver-agent-sysext-")
	if err != nil {
		return fail(1, "work directory: %v", err)
	}
	keep := false // a failed build keeps its log
	defer func() {
		if !keep {
			os.RemoveAll(tmp)
		}
	}()
	banner := ""
	if *tree == "" {
		dl := filepath.Join(tmp, "flatcar")
		if banner, err = fetchBuildTree(ctx, fetcher, *rel, dl, log); err != nil {
			return fail(1, "Flatcar %s: %v", rel.Version, err)
		}
		*tree = filepath.Join(dl, "build")
	}
	uts, err := os.ReadFile(filepath.Join(*tree, "include", "generated", "utsrelease.h"))
	if err != nil {
		return fail(2, "kernel build tree: %v (want the output directory of a kernel build, with include/generated/utsrelease.h)", err)
	}
	kver, ok := build.ParseUTSRelease(string(uts))
	if !ok {
		return fail(2, "kernel build tree %s: include/generated/utsrelease.h defines no UTS_RELEASE", *tree)
	}

	mods, err := build.Modules(ctx, build.Options{
		SourceDir: *source, BuildTree: *tree, KernelRelease: kver, Banner: banner, Jobs: n, CC: *cc,
		WorkDir: filepath.Join(tmp, "build"), LogFile: filepath.Join(tmp, "build.log"), Log: log, Terminal: terminal(stderr),
		Procs: host.OSExec{}, // a build machine: no reaper
	})
	if err != nil {
		var be *build.Error
		if keep = errors.As(err, &be); keep {
			os.RemoveAll(filepath.Join(tmp, "flatcar")) // the log stays; the download need not
		}
		code := 1
		for _, input := range []error{build.ErrInvalid, build.ErrKernelMismatch, build.ErrCompiler, build.ErrCompilerMismatch} {
			if errors.Is(err, input) {
				code = 2
			}
		}
		return fail(code, "%v", err)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return fail(1, "-o: %v", err)
	}
	o := sysext.Options{DriverVersion: *driverVersion, FlatcarVersion: rel.Version, Architecture: arch, KernelRelease: kver,
		ContainerRoot: *root, OutDir: *out, Generator: "driver-agent " + version + " sysext", Log: log,
		Procs: host.OSExec{}}
	for _, m := range mods {
		o.Modules = append(o.Modules, sysext.Module{Path: m.Path})
	}
	res, err := sysext.Build(ctx, o)
	if err != nil {
		code := 1
		if errors.Is(err, sysext.ErrInput) {
			code = 2
		}
		return fail(code, "%v", err)
	}
	fmt.Fprintf(stdout, "wrote %s: driver %s for Flatcar %s (%s, kernel %s), %d files, %d bytes, sha256 %s\n",
		res.Image, *driverVersion, rel.Version, arch, kver, len(res.Files), res.Size, res.SHA256)
	return 0
}
