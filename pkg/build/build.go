// Package build compiles NVIDIA's kernel modules with kbuild against a kernel
// build tree.
//
// It copies the driver's kernel source directory
// (/usr/src/nvidia-<version>/<kernel|kernel-open>) into a private work
// directory and runs NVIDIA's Makefile there,
//
//	make -j<N> SYSSRC=<kernel build tree> CC=<cc> <targets>
//
// with IGNORE_CC_MISMATCH=1 in the environment, as NVIDIA's driver
// container scripts export it; the compiler is compared with the kernel's
// here instead (see Options.Banner). make runs in a process group of its own
// through host.Procs; when the context ends the whole group is killed and
// the work directory removed. Its output goes to a log file, and progress
// ("Building kernel modules:" and a bar of '#') is logged at a steady
// interval and drawn on a terminal when one is given. The result is checked:
// every expected module exists and its vermagic names the running kernel's
// release.
//
// Modules builds complete modules (the compile path of the agent).
// Interfaces builds the kernel interface objects of a precompiled package
// (nv-linux.o and nv-modeset-linux.o) together with the complete modules such
// a package carries (the image-build path of `driver-agent build`).
package build

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/link"
	"github.com/driver-agent/driver-agent/pkg/modfile"
)

// Sentinel errors; test with errors.Is.
var (
	// ErrInvalid means the options are incomplete or inconsistent.
	ErrInvalid = errors.New("invalid build options")
	// ErrKernelMismatch means the kernel build tree, or a module built from
	// it, is for another kernel release than the running one.
	ErrKernelMismatch = errors.New("built for another kernel")
	// ErrCompiler means the compiler cannot be run.
	ErrCompiler = errors.New("compiler unusable")
	// ErrCompilerMismatch means the compiler is of another family (gcc,
	// clang) than the one the kernel was built with.
	ErrCompilerMismatch = errors.New("compiler differs from the kernel's")
	// ErrBuild means make failed.
	ErrBuild = errors.New("kernel module build failed")
	// ErrNoSpace means the disk filled up during the build.
	ErrNoSpace = errors.New("no space left on device")
	// ErrVerify means make succeeded but a module it should have made is
	// missing or unreadable.
	ErrVerify = errors.New("build result incomplete")
)

// Error is a failed build: which failure (ErrBuild, ErrNoSpace), the build
// log and its last lines. errors.Is matches both Kind and the underlying
// error.
type Error struct {
	Kind   error    // ErrBuild or ErrNoSpace
	Log    string   // the build log's path
	Errors []string // its first distinct "error:" lines (at most ErrorLines): usually the cause
	Tail   []string // its last lines (at most TailLines)
	Err    error    // what the runner returned
}

// TailLines is how many lines of the build log an Error carries.
const TailLines = 30

// ErrorLines is how many of the build log's first error lines an Error carries.
const ErrorLines = 5

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v: %v", e.Kind, e.Err)
	if errors.Is(e.Kind, ErrNoSpace) {
		b.WriteString("; free space on the filesystem of the work directory or point the work directory elsewhere")
	}
	if len(e.Errors) > 0 {
		fmt.Fprintf(&b, "; the first errors:\n%s\n", strings.Join(e.Errors, "\n"))
	}
	fmt.Fprintf(&b, "; the full log is %s", e.Log)
	if len(e.Tail) > 0 {
		fmt.Fprintf(&b, "; its last %d lines:\n%s", len(e.Tail), strings.Join(e.Tail, "\n"))
	}
	return b.String()
}

// Unwrap returns Kind and Err.
func (e *Error) Unwrap() []error { return []error{e.Kind, e.Err} }

// DefaultProgressInterval is how often progress is logged during a build.
const DefaultProgressInterval = 10 * time.Second

// Options configures Modules and Interfaces.
type Options struct {
	// SourceDir is the driver's kernel source directory,
	// /usr/src/nvidia-<version>/kernel or .../kernel-open. It is only read.
	SourceDir string
	// BuildTree is the kernel build tree, e.g. /usr/lib/modules/<release>/build:
	// the kernel's output directory with .config, Module.symvers and
	// include/generated.
	BuildTree string
	// KernelSource is the kernel source tree when it is apart from the
	// build tree (Debian's linux-headers-<abi>-common next to
	// linux-headers-<abi>). Empty means found automatically: a directory
	// named by BuildTree/source (the link `make O=` and distributions
	// create), else the directory of the Makefile that BuildTree/Makefile
	// includes (Debian's wrapper), else BuildTree itself. NVIDIA's Makefile
	// gets SYSSRC=<source> and, when the two differ, SYSOUT=<build tree>;
	// its configuration tests need the source tree's headers.
	KernelSource string
	// KernelRelease is the running kernel's release (uname -r). The modules'
	// vermagic must name it.
	KernelRelease string
	// Banner is the first line of the running kernel's /proc/version. The
	// compiler it names is compared with CC's --version: another family
	// (gcc, clang) is an error, another major version a warning. Empty
	// skips the comparison.
	Banner string
	// Jobs is the number of parallel make jobs (MAX_THREADS); 0 means
	// DefaultJobs(Roots).
	Jobs int
	// Roots.Proc (procfs, read for the default number of jobs) and Roots.Sys (sysfs, read for
	// the container's memory limit) are the only roots the build reads; "" means /proc and /sys.
	Roots host.Roots
	// CC is the C compiler, a name looked up in PATH or a path. Empty means
	// CC from Env, else "gcc" (what kbuild uses by default). It is passed
	// to make as CC=<path>.
	CC string
	// LD is the linker that merges .module-common.o into the interface
	// objects (Interfaces, kernels 6.12 and newer); "" means "ld".
	LD string
	// Make is the make program; "" means "make".
	Make string
	// Env is the environment of make and the compiler; nil means this
	// process's. MAKEFLAGS, MFLAGS and MAKELEVEL are removed; LC_ALL=C and
	// IGNORE_CC_MISMATCH=1 are set.
	Env []string
	// WorkDir is where the sources are copied and built. It must not exist
	// or be an empty directory; it is created with mode 0700. On failure
	// or cancellation it is removed; on success it holds the results and
	// belongs to the caller.
	WorkDir string
	// LogFile receives make's output; "" means WorkDir + ".log". It is kept
	// whatever the outcome.
	LogFile string
	// Targets are the make targets of Modules; nil means "modules".
	// Interfaces chooses its own.
	Targets []string
	// Procs runs make, the compiler check and the linker. Required: the
	// agent passes Host.Procs, the build-time subcommands host.OSExec.
	Procs host.Procs
	// Log receives progress and warnings; nil discards them.
	Log *slog.Logger
	// Terminal, when set, gets a progress bar redrawn in place ("\r").
	Terminal io.Writer
	// ProgressInterval is how often progress is logged; 0 means
	// DefaultProgressInterval.
	ProgressInterval time.Duration
}

// moduleNames are NVIDIA's kernel modules in build order. A source directory
// has a sub-directory for each module it can build; NVIDIA's Makefile builds
// every one present.
var moduleNames = []string{"nvidia", "nvidia-uvm", "nvidia-vgpu-vfio", "nvidia-modeset", "nvidia-drm", "nvidia-peermem"}

// Member is a file for a precompiled package, made by Interfaces.
type Member struct {
	// Path is the file, in the work directory.
	Path string
	// LinkedModuleName is, for a kernel interface, the module it is linked
	// into ("nvidia.ko"); empty for a complete module.
	LinkedModuleName string
	// CoreObjectName is, for a kernel interface, its core object relative
	// to the source directory ("nvidia/nv-kernel.o_binary").
	CoreObjectName string
}

// Interface reports whether m is a kernel interface (else a complete module).
func (m Member) Interface() bool { return m.LinkedModuleName != "" }

// kernelInterface describes one of NVIDIA's kernel interface objects.
type kernelInterface struct {
	module, target, core string
}

// kernelInterfaces are the interfaces of a precompiled package, as NVIDIA's
// Makefile builds them (`make nv-linux.o nv-modeset-linux.o`: each is
// <module>.mod.o and <module dir>/<interface>-interface.o linked with -r)
// and as its packages name them.
var kernelInterfaces = []kernelInterface{
	{"nvidia", "nv-linux.o", "nvidia/nv-kernel.o_binary"},
	{"nvidia-modeset", "nv-modeset-linux.o", "nvidia-modeset/nv-modeset-kernel.o_binary"},
}

// packagedModules are the complete modules a precompiled package carries
// next to the interfaces, when the source builds them.
var packagedModules = []string{"nvidia-uvm", "nvidia-peermem"}

// Modules builds every module the source directory has a directory for
// (nvidia, nvidia-uvm, nvidia-vgpu-vfio, nvidia-modeset, nvidia-drm,
// nvidia-peermem; NVIDIA's Makefile builds each one present) and returns
// them, in that order, in the work directory. See the package
// comment and Options.
func Modules(ctx context.Context, o Options) ([]link.Module, error) {
	b, err := newBuilder(o)
	if err != nil {
		return nil, err
	}
	targets := o.Targets
	if len(targets) == 0 {
		targets = []string{"modules"}
	}
	var mods []link.Module
	err = b.run(ctx, targets, func() error {
		for _, m := range b.modules {
			path := filepath.Join(b.o.WorkDir, m+".ko")
			if err := b.verify(path); err != nil {
				return err
			}
			mods = append(mods, link.Module{Name: modfile.NameFromPath(path), Path: path})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return mods, nil
}

// Interfaces builds what a precompiled package of NVIDIA's format holds:
// the kernel interfaces nv-linux.o (linked with nvidia/nv-kernel.o_binary
// into nvidia.ko) and, when the source has nvidia-modeset,
// nv-modeset-linux.o (with nvidia-modeset/nv-modeset-kernel.o_binary into
// nvidia-modeset.ko), then the complete modules nvidia-uvm.ko and, when the
// source has it, nvidia-peermem.ko, in that order. It runs
//
//	make ... nv-linux.o [nv-modeset-linux.o]
//
// which builds all modules first. On kernels 6.12 and newer kbuild puts the
// module's vermagic into .module-common.o instead of <module>.mod.o; when
// the build made one it is merged into each interface with `ld -r`, so that
// a module linked from the package carries it, as a kbuild-made one does.
func Interfaces(ctx context.Context, o Options) ([]Member, error) {
	b, err := newBuilder(o)
	if err != nil {
		return nil, err
	}
	if !slices.Contains(b.modules, "nvidia") || !slices.Contains(b.modules, "nvidia-uvm") {
		return nil, fmt.Errorf("build: %w: %s has no nvidia or nvidia-uvm directory; is it NVIDIA's kernel source directory?",
			ErrInvalid, o.SourceDir)
	}
	var interfaces []kernelInterface
	var targets []string
	for _, ki := range kernelInterfaces {
		if !slices.Contains(b.modules, ki.module) {
			continue
		}
		if st, err := os.Stat(filepath.Join(o.SourceDir, ki.core)); err != nil || !st.Mode().IsRegular() {
			return nil, fmt.Errorf("build: %w: the core object %s is missing from %s; a package naming it could not be linked",
				ErrInvalid, ki.core, o.SourceDir)
		}
		interfaces = append(interfaces, ki)
		targets = append(targets, ki.target)
	}
	var members []Member
	err = b.run(ctx, targets, func() error {
		common := filepath.Join(b.o.WorkDir, link.ModuleCommonObject)
		if st, err := os.Stat(common); err != nil || !st.Mode().IsRegular() {
			common = ""
		}
		for _, ki := range interfaces {
			path := filepath.Join(b.o.WorkDir, ki.target)
			if common != "" {
				if err := b.mergeCommon(ctx, path, common); err != nil {
					return err
				}
			}
			if err := b.verify(path); err != nil {
				return err
			}
			members = append(members, Member{Path: path, LinkedModuleName: ki.module + ".ko", CoreObjectName: ki.core})
		}
		for _, m := range packagedModules {
			if !slices.Contains(b.modules, m) {
				continue
			}
			path := filepath.Join(b.o.WorkDir, m+".ko")
			if err := b.verify(path); err != nil {
				return err
			}
			members = append(members, Member{Path: path})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return members, nil
}

// builder is one build.
type builder struct {
	o        Options
	log      *slog.Logger
	runner   host.Procs
	make     string // path
	cc       string // as given or defaulted
	ccPath   string
	jobs     int
	env      []string
	modules  []string // moduleNames present in the source directory
	source   string   // the kernel source tree (SYSSRC)
	logFile  *os.File
	interval time.Duration
}

func newBuilder(o Options) (*builder, error) {
	b := &builder{o: o, log: o.Log, runner: o.Procs, interval: o.ProgressInterval}
	if b.log == nil {
		b.log = slog.New(slog.DiscardHandler)
	}
	if b.runner == nil {
		return nil, errors.New("build: no Procs to run make with")
	}
	if b.interval <= 0 {
		b.interval = DefaultProgressInterval
	}
	for _, f := range []struct{ name, value string }{
		{"source directory", o.SourceDir}, {"kernel build tree", o.BuildTree},
		{"kernel release", o.KernelRelease}, {"work directory", o.WorkDir},
	} {
		if f.value == "" {
			return nil, fmt.Errorf("build: %w: no %s given", ErrInvalid, f.name)
		}
	}
	if o.Jobs < 0 {
		return nil, fmt.Errorf("build: %w: %d jobs", ErrInvalid, o.Jobs)
	}
	if b.o.LogFile == "" {
		b.o.LogFile = filepath.Clean(o.WorkDir) + ".log"
	}
	for _, m := range moduleNames {
		if st, err := os.Stat(filepath.Join(o.SourceDir, m)); err == nil && st.IsDir() {
			b.modules = append(b.modules, m)
		}
	}
	if len(b.modules) == 0 {
		return nil, fmt.Errorf("build: %w: %s has none of the module directories %s; is it NVIDIA's kernel source directory?",
			ErrInvalid, o.SourceDir, strings.Join(moduleNames, ", "))
	}
	if _, err := os.Stat(filepath.Join(o.SourceDir, "Makefile")); err != nil {
		return nil, fmt.Errorf("build: %w: the source directory has no Makefile: %w", ErrInvalid, err)
	}
	if st, err := os.Stat(filepath.Join(o.BuildTree, "Makefile")); err != nil || !st.Mode().IsRegular() {
		return nil, fmt.Errorf("build: %w: %s is not a kernel build tree (no Makefile)", ErrInvalid, o.BuildTree)
	}
	if err := checkTreeRelease(o.BuildTree, o.KernelRelease); err != nil {
		return nil, err
	}
	b.source = o.KernelSource
	if b.source == "" {
		b.source = kernelSource(o.BuildTree)
	} else if st, err := os.Stat(filepath.Join(b.source, "Makefile")); err != nil || !st.Mode().IsRegular() {
		return nil, fmt.Errorf("build: %w: %s is not a kernel source tree (no Makefile)", ErrInvalid, b.source)
	}

	b.env = buildEnv(o.Env)
	b.cc = o.CC
	if b.cc == "" {
		b.cc = lookupEnv(b.env, "CC")
	}
	if b.cc == "" {
		b.cc = "gcc"
	}
	var err error
	if b.ccPath, err = lookPath(b.cc, b.env); err != nil {
		return nil, fmt.Errorf("build: %w: %w; set --cc to a C compiler in the image", ErrCompiler, err)
	}
	makeName := o.Make
	if makeName == "" {
		makeName = "make"
	}
	if b.make, err = lookPath(makeName, b.env); err != nil {
		return nil, fmt.Errorf("build: %w: %w; the image needs make", ErrInvalid, err)
	}
	b.jobs = o.Jobs
	if b.jobs == 0 {
		r := host.Roots{Proc: o.Roots.Proc, Sys: o.Roots.Sys}
		if r.Proc == "" {
			r.Proc = "/proc"
		}
		if r.Sys == "" {
			r.Sys = "/sys"
		}
		b.jobs = DefaultJobs(r)
	}
	return b, nil
}

// kernelSource finds the kernel source tree of a build tree; see Options.KernelSource.
func kernelSource(tree string) string {
	isTree := func(dir string) bool {
		st, err := os.Stat(filepath.Join(dir, "Makefile"))
		if err != nil || !st.Mode().IsRegular() {
			return false
		}
		st, err = os.Stat(filepath.Join(dir, "include", "linux"))
		return err == nil && st.IsDir()
	}
	if dir := filepath.Join(tree, "source"); isTree(dir) {
		return dir
	}
	if b, err := os.ReadFile(filepath.Join(tree, "Makefile")); err == nil && len(b) < 4096 {
		if dir, ok := IncludedMakefileDir(string(b)); ok && filepath.Clean(dir) != filepath.Clean(tree) && isTree(dir) {
			return dir
		}
	}
	return tree
}

// IncludedMakefileDir reads a kernel output directory's wrapper Makefile, such as Debian's
// "include /usr/src/linux-headers-6.1.0-57-common/Makefile" or the one `make O=` writes, and
// returns the directory of the Makefile it includes (an absolute path).
func IncludedMakefileDir(makefile string) (string, bool) {
	for _, line := range strings.Split(makefile, "\n") {
		f := strings.Fields(line)
		if len(f) != 2 || f[0] != "include" || !strings.HasSuffix(f[1], "/Makefile") || !filepath.IsAbs(f[1]) ||
			strings.ContainsAny(f[1], "$()") {
			continue
		}
		return filepath.Dir(f[1]), true
	}
	return "", false
}

// checkTreeRelease compares the kernel release the build tree was made for
// (UTS_RELEASE in include/generated/utsrelease.h, which becomes the modules'
// vermagic) with the running one. A tree without the header is not checked
// here; the modules' vermagic is checked after the build.
func checkTreeRelease(tree, release string) error {
	b, err := os.ReadFile(filepath.Join(tree, "include", "generated", "utsrelease.h"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("build: kernel build tree: %w", err)
	}
	got, ok := ParseUTSRelease(string(b))
	if !ok {
		return fmt.Errorf("build: %w: %s/include/generated/utsrelease.h defines no UTS_RELEASE", ErrInvalid, tree)
	}
	if got != release {
		return fmt.Errorf("build: %w: the kernel build tree %s is for kernel %s, the running kernel is %s; give the build tree of the running kernel",
			ErrKernelMismatch, tree, got, release)
	}
	return nil
}

// ParseUTSRelease returns the release in a kernel's
// include/generated/utsrelease.h: `#define UTS_RELEASE "6.1.0-57-amd64"`.
func ParseUTSRelease(header string) (string, bool) {
	for _, line := range strings.Split(header, "\n") {
		f := strings.Fields(line)
		if len(f) != 3 || f[0] != "#define" || f[1] != "UTS_RELEASE" {
			continue
		}
		v := f[2]
		if len(v) < 3 || v[0] != '"' || v[len(v)-1] != '"' || strings.ContainsAny(v[1:len(v)-1], "\"\\") {
			return "", false
		}
		return v[1 : len(v)-1], true
	}
	return "", false
}

// buildEnv returns env (nil: this process's) without make's own variables,
// with LC_ALL=C (messages the failure classification reads) and
// IGNORE_CC_MISMATCH=1.
func buildEnv(env []string) []string {
	if env == nil {
		env = os.Environ()
	}
	drop := []string{"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "LC_ALL", "IGNORE_CC_MISMATCH"}
	out := make([]string, 0, len(env)+2)
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if !slices.Contains(drop, k) {
			out = append(out, kv)
		}
	}
	return append(out, "LC_ALL=C", "IGNORE_CC_MISMATCH=1")
}

func lookupEnv(env []string, key string) string {
	v := ""
	for _, kv := range env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			v = val // the last one wins, as in exec
		}
	}
	return v
}

// lookPath finds name in env's PATH (a name with a slash is used as is).
func lookPath(name string, env []string) (string, error) {
	if strings.Contains(name, "/") {
		st, err := os.Stat(name)
		if err != nil {
			return "", err
		}
		if st.IsDir() || st.Mode().Perm()&0o111 == 0 {
			return "", fmt.Errorf("%s is not an executable file", name)
		}
		return name, nil
	}
	for _, dir := range filepath.SplitList(lookupEnv(env, "PATH")) {
		if dir == "" {
			continue
		}
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in PATH: %w", name, exec.ErrNotFound)
}

// run does the build: log file, compiler check, copy, make, then check (on
// success). On any failure the work directory is removed.
func (b *builder) run(ctx context.Context, targets []string, check func() error) (err error) {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("build: %w", err)
	}
	if b.logFile, err = os.OpenFile(b.o.LogFile, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644); err != nil {
		return fmt.Errorf("build: log file: %w", noSpace(err))
	}
	defer b.logFile.Close()
	if err := b.checkCompiler(ctx); err != nil {
		return fmt.Errorf("build: %w", err)
	}

	if err := prepareWorkDir(b.o.WorkDir); err != nil {
		return fmt.Errorf("build: work directory: %w", noSpace(err))
	}
	defer func() {
		if err == nil {
			return
		}
		if rmErr := removeAll(b.o.WorkDir); rmErr != nil {
			err = errors.Join(err, fmt.Errorf("remove the work directory: %w", rmErr))
		}
	}()
	b.log.Info("copying the driver sources into the work directory", "source", b.o.SourceDir, "work_dir", b.o.WorkDir)
	if err := CopyTree(ctx, b.o.SourceDir, b.o.WorkDir); err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return fmt.Errorf("build: %w", ctxErr)
		}
		return fmt.Errorf("build: copy the driver sources: %w", noSpace(err))
	}

	sources, err := countSources(b.o.WorkDir, b.modules)
	if err != nil {
		return fmt.Errorf("build: count the sources: %w", err)
	}
	total := sources + len(b.modules) // one <module>.mod.o each
	if newer, ok := releaseAtLeast(b.o.KernelRelease, 6, 12); ok && newer {
		total++ // .module-common.o
	}

	args := []string{"-j" + strconv.Itoa(b.jobs), "SYSSRC=" + b.source}
	if b.source != b.o.BuildTree {
		args = append(args, "SYSOUT="+b.o.BuildTree)
	}
	args = append(args, "CC="+b.ccPath)
	args = append(args, targets...)
	fmt.Fprintf(b.logFile, "$ cd %s && %s %s\n", b.o.WorkDir, b.make, strings.Join(args, " "))
	b.log.Info("building the NVIDIA kernel modules", "modules", strings.Join(b.modules, " "), "kernel", b.o.KernelRelease,
		"build_tree", b.o.BuildTree, "kernel_source", b.source, "cc", b.ccPath, "jobs", b.jobs, "targets", strings.Join(targets, " "), "log", b.o.LogFile)
	p := newProgress(total, b.log, b.o.Terminal)
	runErr := b.runMake(ctx, p, args)
	if runErr != nil {
		p.abort()
		if ctxErr := ctx.Err(); ctxErr != nil {
			b.log.Info("build cancelled; the work directory is removed", "work_dir", b.o.WorkDir)
			return fmt.Errorf("build: %w", ctxErr)
		}
		return b.failure(runErr)
	}
	if err := check(); err != nil {
		p.abort()
		if ctxErr := ctx.Err(); ctxErr != nil {
			return fmt.Errorf("build: %w", ctxErr)
		}
		return fmt.Errorf("build: %w", err)
	}
	p.finish()
	b.log.Info("built the NVIDIA kernel modules", "work_dir", b.o.WorkDir, "log", b.o.LogFile)
	return nil
}

// runMake runs make with its output going through p into the log file.
func (b *builder) runMake(ctx context.Context, p *progress, args []string) error {
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	followed := make(chan error, 1)
	go func() { followed <- p.follow(r, b.logFile) }()
	stop := p.start(b.interval)
	runErr := b.runner.Run(ctx, host.Cmd{Path: b.make, Args: args, Env: b.env, Dir: b.o.WorkDir}, w)
	w.Close()
	// Everything that held the pipe is dead now; wait for the rest of the
	// output, but not forever should something have inherited it.
	var logErr error
	select {
	case logErr = <-followed:
	case <-time.After(5 * time.Second):
		r.Close()
		logErr = <-followed
	}
	r.Close()
	stop()
	if runErr != nil {
		return runErr
	}
	if logErr != nil {
		return fmt.Errorf("write the build log: %w", logErr)
	}
	return nil
}

// failure describes a failed make.
func (b *builder) failure(runErr error) error {
	tail, tailErr := lastLines(b.o.LogFile, TailLines)
	if tailErr != nil {
		tail = []string{fmt.Sprintf("(cannot read the build log: %v)", tailErr)}
	}
	first, _ := firstErrors(b.o.LogFile, ErrorLines) // the tail says why when the log is unreadable
	kind := ErrBuild
	if errors.Is(runErr, syscall.ENOSPC) || slices.ContainsFunc(tail, func(l string) bool {
		return strings.Contains(l, "No space left on device")
	}) {
		kind = ErrNoSpace
	}
	return &Error{Kind: kind, Log: b.o.LogFile, Errors: first, Tail: tail, Err: runErr}
}

// firstErrors returns the first n distinct lines of the file at path that report an error
// ("error:" in any case: the compiler's, the linker's, modpost's "ERROR:"), each trimmed and cut
// to 500 bytes. With make -j the cause is usually the first of them, not the last lines.
func firstErrors(path string, n int) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() && len(out) < n {
		l := strings.TrimSpace(sc.Text())
		if !strings.Contains(strings.ToLower(l), "error:") {
			continue
		}
		if len(l) > 500 {
			l = l[:500] + "..."
		}
		if !slices.Contains(out, l) {
			out = append(out, l)
		}
	}
	return out, sc.Err()
}

// noSpace marks an ENOSPC error with ErrNoSpace.
func noSpace(err error) error {
	if errors.Is(err, syscall.ENOSPC) {
		return fmt.Errorf("%w: %w", ErrNoSpace, err)
	}
	return err
}

// lastLines returns the last n lines of the file at path (reading at most its
// last 64 KiB).
func lastLines(path string, n int) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	const window = 64 << 10
	off := max(0, st.Size()-window)
	buf := make([]byte, st.Size()-off)
	if _, err := f.ReadAt(buf, off); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	lines := strings.Split(strings.TrimRight(string(buf), "\n"), "\n")
	if off > 0 && len(lines) > 1 {
		lines = lines[1:] // the first is probably cut
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	if len(lines) == 1 && lines[0] == "" {
		return nil, nil
	}
	return lines, nil
}

// mergeCommon links .module-common.o into the interface object at path.
func (b *builder) mergeCommon(ctx context.Context, path, common string) error {
	ld := b.o.LD
	if ld == "" {
		ld = "ld"
	}
	ldPath, err := lookPath(ld, b.env)
	if err != nil {
		return fmt.Errorf("merge %s into %s: %w", link.ModuleCommonObject, filepath.Base(path), err)
	}
	tmp := path + ".merged"
	args := []string{"-r", "-o", tmp, path, common}
	fmt.Fprintf(b.logFile, "$ %s %s\n", ldPath, strings.Join(args, " "))
	if err := b.runner.Run(ctx, host.Cmd{Path: ldPath, Args: args, Env: b.env, Dir: b.o.WorkDir}, b.logFile); err != nil {
		return fmt.Errorf("merge %s into %s: %w", link.ModuleCommonObject, filepath.Base(path), err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("merge %s into %s: %w", link.ModuleCommonObject, filepath.Base(path), err)
	}
	b.log.Info("merged "+link.ModuleCommonObject+" into the kernel interface", "interface", filepath.Base(path))
	return nil
}

// verify checks that the module or interface object at path exists and that
// its vermagic names the running kernel's release.
func (b *builder) verify(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrVerify, filepath.Base(path), err)
	}
	mi, err := modfile.Info(data)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrVerify, filepath.Base(path), err)
	}
	release, _, _ := strings.Cut(mi.Vermagic, " ")
	if release != b.o.KernelRelease {
		return fmt.Errorf("%w: %s has vermagic %q, for kernel %q; the running kernel is %s: give the build tree of the running kernel",
			ErrKernelMismatch, filepath.Base(path), mi.Vermagic, release, b.o.KernelRelease)
	}
	return nil
}

// releaseAtLeast reports whether the kernel release (e.g. "6.12.81-flatcar")
// is major.minor or newer; ok is false when release does not start with
// <major>.<minor>.
func releaseAtLeast(release string, major, minor int) (newer, ok bool) {
	majS, rest, found := strings.Cut(release, ".")
	if !found {
		return false, false
	}
	end := 0
	for end < len(rest) && isDigit(rest[end]) {
		end++
	}
	maj, err1 := strconv.Atoi(majS)
	mnr, err2 := strconv.Atoi(rest[:end])
	if err1 != nil || err2 != nil {
		return false, false
	}
	return maj > major || maj == major && mnr >= minor, true
}

// SourceVersion returns the driver version of NVIDIA's kernel source directory: the
// NV_VERSION_STRING its Kbuild file defines (ccflags-y += -DNV_VERSION_STRING=\"535.261.03\").
func SourceVersion(sourceDir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(sourceDir, "Kbuild"))
	if err != nil {
		return "", fmt.Errorf("driver version: %w", err)
	}
	v, ok := ParseVersionString(string(b))
	if !ok {
		return "", fmt.Errorf("driver version: %s/Kbuild defines no NV_VERSION_STRING", sourceDir)
	}
	return v, nil
}

// ParseVersionString returns the version in a Kbuild line such as
// `ccflags-y += -DNV_VERSION_STRING=\"535.261.03\"` (the first one; comments are skipped). The
// version must be digits, letters, dots, dashes, plus signs or underscores.
func ParseVersionString(kbuild string) (string, bool) {
	const key = "-DNV_VERSION_STRING="
	for _, line := range strings.Split(kbuild, "\n") {
		line, _, _ = strings.Cut(line, "#")
		i := strings.Index(line, key)
		if i < 0 {
			continue
		}
		v := line[i+len(key):]
		if end := strings.IndexAny(v, " \t"); end >= 0 {
			v = v[:end]
		}
		v = strings.TrimPrefix(strings.TrimSuffix(v, `\"`), `\"`)
		v = strings.Trim(v, `"'`)
		if v == "" || strings.Trim(v, "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-+_") != "" {
			return "", false
		}
		return v, true
	}
	return "", false
}
