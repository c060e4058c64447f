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
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
)

// Exit codes of `driver-agent build`, as those of `precompiled`.
const (
	buildOK       = 0
	buildFailed   = 1 // the build or the packing failed
	buildBadInput = 2 // usage error or unusable input
)

func buildUsage(w io.Writer, prog string) {
	fmt.Fprintf(w, `Usage: %[1]s build (--kernel-banner FILE | --proc DIR) --kernel-build-tree DIR
            [--source DIR] [--driver-version V] [--cc CC] [-j N] [--work-dir DIR] -o PKG

Build the NVIDIA kernel interfaces for one kernel and pack them into a
precompiled package (NVIDIA's format), for an image that then needs no
compiler at run time. It runs NVIDIA's build in a copy of the source
directory (make nv-linux.o nv-modeset-linux.o, which builds every module) and
packs nv-linux.o and nv-modeset-linux.o as kernel interfaces (linked at run
time with nvidia/nv-kernel.o_binary and nvidia-modeset/nv-modeset-kernel.o_binary)
and nvidia-uvm.ko and nvidia-peermem.ko as complete modules, with the
kernel's banner as the package's proc version.

Options:
  --kernel-banner FILE    the target kernel's /proc/version line (first line of FILE)
  --proc DIR              read the banner from DIR/version instead
  --kernel-build-tree DIR the target kernel's build tree (SYSSRC)
  --source DIR            the driver's kernel source directory (default
                          /usr/src/nvidia-<driver version>/kernel, or kernel-open)
  --kernel-module-type T  proprietary or open: which source directory is the
                          default (default $KERNEL_MODULE_TYPE, else proprietary)
  --driver-version V      the package's driver version (default $DRIVER_VERSION,
                          else the source's NV_VERSION_STRING)
  --cc CC                 the C compiler (default $CC, else gcc)
  -j N                    parallel jobs (default $MAX_THREADS, else from CPUs
                          and memory)
  --work-dir DIR          where the build directory is made (default $TMPDIR)
  -o PKG                  the package to write (replaced if it exists)

Exit codes: 0 success, 1 the build failed (the error quotes the end of the
build log and names it; the log is kept), 2 usage error or unusable input
(a build tree or compiler that does not fit the banner's kernel included).
`, prog)
}

// buildArgs are the parsed options of `driver-agent build`.
type buildArgs struct {
	bannerFile, proc, tree, source, version, cc, workDir, out string
	moduleType                                                string
	jobs                                                      int
}

// parseBuildArgs parses the options; DRIVER_VERSION, KERNEL_MODULE_TYPE and MAX_THREADS in
// environ (the driver image sets them) are the defaults of --driver-version,
// --kernel-module-type and -j.
func parseBuildArgs(args, environ []string) (*buildArgs, error) {
	env := map[string]string{}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	a := &buildArgs{version: env["DRIVER_VERSION"], moduleType: env["KERNEL_MODULE_TYPE"]}
	if a.moduleType == "" || a.moduleType == "auto" {
		a.moduleType = "proprietary"
	}
	if v := env["MAX_THREADS"]; v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return nil, fmt.Errorf("MAX_THREADS=%q: want a whole number", v)
		}
		a.jobs = n
	}
	fs := flag.NewFlagSet("build", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&a.bannerFile, "kernel-banner", "", "")
	fs.StringVar(&a.proc, "proc", "", "")
	fs.StringVar(&a.tree, "kernel-build-tree", "", "")
	fs.StringVar(&a.source, "source", "", "")
	fs.StringVar(&a.version, "driver-version", a.version, "")
	fs.StringVar(&a.moduleType, "kernel-module-type", a.moduleType, "")
	fs.StringVar(&a.cc, "cc", "", "")
	fs.IntVar(&a.jobs, "j", a.jobs, "")
	fs.StringVar(&a.workDir, "work-dir", "", "")
	fs.StringVar(&a.out, "o", "", "")
	fs.StringVar(&a.out, "output", "", "")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	case (a.bannerFile == "") == (a.proc == ""):
		return nil, errors.New("give the target kernel's banner with --kernel-banner FILE or --proc DIR (one of them)")
	case a.tree == "":
		return nil, errors.New("give the target kernel's build tree with --kernel-build-tree DIR")
	case a.out == "":
		return nil, errors.New("give the package to write with -o PKG")
	case a.source == "" && a.version == "":
		return nil, errors.New("give --source DIR or --driver-version V (the source is then /usr/src/nvidia-V/kernel, or kernel-open with --kernel-module-type open)")
	case a.moduleType != "proprietary" && a.moduleType != "open":
		return nil, fmt.Errorf("--kernel-module-type %q: want proprietary or open", a.moduleType)
	case a.jobs < 0 || a.jobs > 1024:
		return nil, fmt.Errorf("-j %d: want 1 to 1024 (0: from CPUs and memory)", a.jobs)
	}
	return a, nil
}

// runBuild runs `driver-agent build ...`.
func runBuild(ctx context.Context, prog string, args, environ []string, stdout, stderr io.Writer) int {
	for _, arg := range args {
		if arg == "-h" || arg == "--help" || arg == "-help" || arg == "help" {
			buildUsage(stdout, prog)
			return buildOK
		}
	}
	fail := func(code int, format string, a ...any) int {
		fmt.Fprintf(stderr, "%s build: %s\n", prog, fmt.Sprintf(format, a...))
		return code
	}
	a, err := parseBuildArgs(args, environ)
	if err != nil {
		fail(buildBadInput, "%v", err)
		fmt.Fprintf(stderr, "Run '%s build --help' for usage.\n", prog)
		return buildBadInput
	}

	var banner string
	if a.bannerFile != "" {
		b, err := os.ReadFile(a.bannerFile)
		if err != nil {
			return fail(buildBadInput, "kernel banner: %v", err)
		}
		banner = firstLineOf(string(b))
	} else if banner, err = precompiled.ReadBanner(a.proc); err != nil {
		return fail(buildBadInput, "kernel banner: %v", err)
	}
	parsed, ok := precompiled.ParseBanner(banner)
	if !ok {
		return fail(buildBadInput, "kernel banner %q is not a Linux banner (\"Linux version <release> (...) ...\")", banner)
	}
	source := a.source
	if source == "" {
		flavor := "kernel"
		if a.moduleType == "open" {
			flavor = "kernel-open"
		}
		source = filepath.Join("/usr/src", "nvidia-"+a.version, flavor)
	}
	version := a.version
	if version == "" {
		if version, err = build.SourceVersion(source); err != nil {
			return fail(buildBadInput, "%v; give --driver-version", err)
		}
	}

	log := slog.New(slog.NewTextHandler(stderr, nil))
	tmp, err := os.MkdirTemp(a.workDir, "driver-agent-build-")
	if err != nil {
		return fail(buildFailed, "work directory: %v", err)
	}
	opts := build.Options{
		SourceDir: source, BuildTree: a.tree, KernelRelease: parsed.Release, Banner: banner,
		Jobs: a.jobs, CC: a.cc, WorkDir: filepath.Join(tmp, "build"), LogFile: filepath.Join(tmp, "build.log"),
		Log: log, Terminal: terminal(stderr), Procs: host.OSExec{}, // a build machine: no reaper
	}
	members, err := build.Interfaces(ctx, opts)
	if err != nil {
		var be *build.Error
		if !errors.As(err, &be) {
			os.RemoveAll(tmp) // nothing worth keeping; a failed build keeps its log
		}
		code := buildFailed
		for _, input := range []error{build.ErrInvalid, build.ErrKernelMismatch, build.ErrCompiler, build.ErrCompilerMismatch} {
			if errors.Is(err, input) {
				code = buildBadInput
			}
		}
		return fail(code, "%v", err)
	}
	defer os.RemoveAll(tmp)

	p := &precompiled.Package{DriverVersion: version, Description: parsed.Release, ProcVersion: banner}
	for _, m := range members {
		if m.Interface() {
			err = p.AddKernelInterface(m.Path, m.LinkedModuleName, m.CoreObjectName, ".", "", "")
		} else {
			err = p.AddKernelModule(m.Path, ".", false)
		}
		if err != nil {
			return fail(buildFailed, "pack %s: %v", filepath.Base(m.Path), err)
		}
	}
	data, err := p.Marshal()
	if err != nil {
		return fail(buildFailed, "pack: %v", err)
	}
	if back, err := precompiled.Parse(data); err != nil || !precompiled.Match(back, banner) {
		return fail(buildFailed, "the package does not read back or match its banner (%v)", err)
	}
	if err := host.WriteAtomic(a.out, data, 0o644); err != nil {
		return fail(buildFailed, "write the package: %v", err)
	}
	fmt.Fprintf(stdout, "wrote %s: driver %s, kernel %s, %d members, %d bytes\n", a.out, version, parsed.Release, len(p.Files), len(data))
	for _, f := range p.Files {
		if f.Type == precompiled.KernelInterface {
			fmt.Fprintf(stdout, "  kernel interface %s -> %s (with %s)\n", f.Name, f.LinkedModuleName, f.CoreObjectName)
		} else {
			fmt.Fprintf(stdout, "  kernel module %s\n", f.Name)
		}
	}
	return buildOK
}

func firstLineOf(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			return s[:i]
		}
	}
	return s
}

// terminal returns w when it is an interactive terminal (a progress bar is drawn there), else nil.
func terminal(w io.Writer) io.Writer {
	f, ok := w.(*os.File)
	if !ok {
		return nil
	}
	st, err := f.Stat()
	if err != nil || st.Mode()&os.ModeCharDevice == 0 {
		return nil
	}
	return f
}
