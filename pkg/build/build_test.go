package build_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/build"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/link"
)

const (
	release    = "6.1.0-57-amd64"
	gccVersion = "gcc (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.\n"
	banner     = "Linux version 6.1.0-57-amd64 (debian-kernel@lists.debian.org) (gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40) #1 SMP PREEMPT_DYNAMIC Debian 6.1.192-3 (2026-11-26)"
)

// sourceTree is an NVIDIA-shaped source directory: module directories with Kbuild fragments
// listing their sources.
const sourceTree = `
-- Makefile --
# stand-in
-- nvidia/nvidia.Kbuild --
NVIDIA_SOURCES := nvidia/nv.c   # the main file
NVIDIA_SOURCES += nvidia/nv-procfs.c
# nvidia/not-counted.c is a comment
-- nvidia/nv.c --
-- nvidia/nv-procfs.c --
-- nvidia/nv-kernel.o_binary --
core
-- nvidia-modeset/nvidia-modeset.Kbuild --
NVIDIA_MODESET_SOURCES = nvidia-modeset/nvidia-modeset-linux.c nvidia-modeset/missing.c
-- nvidia-modeset/nvidia-modeset-linux.c --
-- nvidia-modeset/nv-modeset-kernel.o_binary --
core
-- nvidia-uvm/nvidia-uvm.Kbuild --
NVIDIA_UVM_SOURCES := nvidia-uvm/uvm.c \
	nvidia-uvm/uvm_common.c
-- nvidia-uvm/uvm.c --
-- nvidia-uvm/uvm_common.c --
-- nvidia-peermem/nvidia-peermem.Kbuild --
NVIDIA_PEERMEM_SOURCES += nvidia-peermem/nvidia-peermem.c
-- nvidia-peermem/nvidia-peermem.c --
-- precompiled/nvidia-modules-6.1.0 --
an old package, not copied
`

// The objects kbuild compiles for sourceTree: 6 sources and 4 .mod.o.
var compiledObjects = []string{"nvidia/nv.o", "nvidia/nv-procfs.o", "nvidia-modeset/nvidia-modeset-linux.o",
	"nvidia-uvm/uvm.o", "nvidia-uvm/uvm_common.o", "nvidia-peermem/nvidia-peermem.o",
	"nvidia.mod.o", "nvidia-uvm.mod.o", "nvidia-modeset.mod.o", "nvidia-peermem.mod.o"}

// fakeRunner plays the compiler (--version), make and ld.
type fakeRunner struct {
	hosttest.FakeProcs        // Start and Output, which the build does not use
	ccVersion          string // --version output
	ccFail             bool
	vermagic           string // of the modules make writes; default release
	common             bool   // make also writes .module-common.o (kernels 6.12+)
	skip               string // a module make does not write
	failLines          int    // make prints this many lines and fails
	failText           string // the last of them
	failFirst          string // and, when set, the first
	block              bool   // make waits for ctx

	mu    sync.Mutex
	calls []host.Cmd
}

func (f *fakeRunner) Calls() []host.Cmd {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

func (f *fakeRunner) Run(ctx context.Context, c host.Cmd, out *os.File) error {
	f.mu.Lock()
	f.calls = append(f.calls, c)
	f.mu.Unlock()
	switch filepath.Base(c.Path) {
	case "gcc", "clang", "cc":
		if f.ccFail {
			fmt.Fprintln(out, "gcc: fatal error: cannot execute 'cc1'")
			return errors.New("exit status 1")
		}
		fmt.Fprint(out, f.ccVersion)
		return nil
	case "ld":
		return os.WriteFile(c.Args[2], hosttest.ModuleELF("vermagic="+release+" SMP mod_unload"), 0o644)
	case "make":
		return f.make(ctx, c, out)
	}
	return fmt.Errorf("fake runner: unexpected %s", c.Path)
}

func (f *fakeRunner) make(ctx context.Context, c host.Cmd, out *os.File) error {
	fmt.Fprintf(out, "make[1]: Entering directory '/usr/src/linux-headers-%s'\n", release)
	fmt.Fprintln(out, " CONFTEST: drm/drm_drv.h")
	if f.block {
		fmt.Fprintf(out, "  CC [M]  %s\n", filepath.Join(c.Dir, compiledObjects[0]))
		<-ctx.Done()
		return fmt.Errorf("run make: %w", ctx.Err())
	}
	if f.failLines > 0 {
		for i := 1; i < f.failLines; i++ {
			if i == 1 && f.failFirst != "" {
				fmt.Fprintln(out, f.failFirst)
				continue
			}
			fmt.Fprintf(out, "line %d\n", i)
		}
		fmt.Fprintln(out, f.failText)
		return errors.New("exit status 2")
	}
	for _, o := range compiledObjects {
		fmt.Fprintf(out, "  CC [M]  %s\n", filepath.Join(c.Dir, o))
		fmt.Fprintf(out, "  CC [M]  %s\n", filepath.Join(c.Dir, o)) // a repeated line counts once
	}
	vermagic := f.vermagic
	if vermagic == "" {
		vermagic = release + " SMP preempt mod_unload modversions"
	}
	write := func(name string) error {
		return os.WriteFile(filepath.Join(c.Dir, name), hosttest.ModuleELF("name="+strings.TrimSuffix(name, ".ko"), "vermagic="+vermagic), 0o644)
	}
	for _, m := range []string{"nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-peermem"} {
		if m == f.skip {
			continue
		}
		if err := write(m + ".ko"); err != nil {
			return err
		}
	}
	for _, t := range c.Args {
		if strings.HasSuffix(t, "-linux.o") {
			if err := write(t); err != nil {
				return err
			}
		}
	}
	if f.common {
		if err := os.WriteFile(filepath.Join(c.Dir, link.ModuleCommonObject), hosttest.ModuleELF("vermagic="+vermagic), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// fixture is a source tree, a build tree, fake tools and options pointing at them.
type fixture struct {
	src, tree, work string
	runner          *fakeRunner
	logs            *bytes.Buffer
	term            *bytes.Buffer
	opts            build.Options
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{src: hosttest.Unpack(t, sourceTree), runner: &fakeRunner{ccVersion: gccVersion}, logs: &bytes.Buffer{}, term: &bytes.Buffer{}}
	f.tree = hosttest.Unpack(t, `
-- Makefile --
-- include/generated/utsrelease.h --
#define UTS_RELEASE "`+release+`"
`)
	bin := t.TempDir()
	for _, tool := range []string{"make", "gcc", "ld"} {
		if err := os.WriteFile(filepath.Join(bin, tool), []byte("#!/bin/false\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	f.work = filepath.Join(t.TempDir(), "build")
	f.opts = build.Options{
		SourceDir: f.src, BuildTree: f.tree, KernelRelease: release, Banner: banner, Jobs: 3,
		Env:     []string{"PATH=" + bin, "MAKEFLAGS=-j9 --jobserver-auth=3,4", "HOME=/root", "IGNORE_CC_MISMATCH=0"},
		WorkDir: f.work, Procs: f.runner, Terminal: f.term,
		Log: slog.New(slog.NewTextHandler(f.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	return f
}

func (f *fixture) makeCall(t *testing.T) host.Cmd {
	t.Helper()
	for _, c := range f.runner.Calls() {
		if filepath.Base(c.Path) == "make" {
			return c
		}
	}
	t.Fatalf("make did not run; calls %v", f.runner.Calls())
	return host.Cmd{}
}

func TestModules(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	before := hosttest.Snapshot(t, f.src)
	mods, err := build.Modules(context.Background(), f.opts)
	if err != nil {
		t.Fatal(err)
	}
	want := []link.Module{
		{Name: "nvidia", Path: filepath.Join(f.work, "nvidia.ko")},
		{Name: "nvidia_uvm", Path: filepath.Join(f.work, "nvidia-uvm.ko")},
		{Name: "nvidia_modeset", Path: filepath.Join(f.work, "nvidia-modeset.ko")},
		{Name: "nvidia_peermem", Path: filepath.Join(f.work, "nvidia-peermem.ko")},
	}
	if !slices.Equal(mods, want) {
		t.Errorf("modules\n%v\nwant\n%v", mods, want)
	}

	// make ran in the private copy with the script's command line and environment.
	c := f.makeCall(t)
	wantArgs := []string{"-j3", "SYSSRC=" + f.tree, "CC=" + filepath.Join(filepath.Dir(c.Path), "gcc"), "modules"}
	if c.Dir != f.work || !slices.Equal(c.Args, wantArgs) {
		t.Errorf("make in %s with %q, want in %s with %q", c.Dir, c.Args, f.work, wantArgs)
	}
	for _, kv := range []string{"IGNORE_CC_MISMATCH=1", "LC_ALL=C", "HOME=/root"} {
		if !slices.Contains(c.Env, kv) {
			t.Errorf("make's environment lacks %s: %q", kv, c.Env)
		}
	}
	for _, kv := range c.Env {
		if strings.HasPrefix(kv, "MAKEFLAGS=") || kv == "IGNORE_CC_MISMATCH=0" {
			t.Errorf("make's environment keeps %s", kv)
		}
	}
	if st, err := os.Stat(f.work); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("work dir: %v, %v", st, err)
	}
	if _, err := os.Stat(filepath.Join(f.work, "nvidia", "nv.c")); err != nil {
		t.Errorf("sources not copied: %v", err)
	}
	if _, err := os.Stat(filepath.Join(f.work, "precompiled")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("precompiled/ copied: %v", err)
	}
	if d := hosttest.DiffSnapshots(before, hosttest.Snapshot(t, f.src)); d != "" {
		t.Errorf("the source directory changed:\n%s", d)
	}

	// Progress: the bar reaches 100% on the terminal and in the log; the log file has make's output.
	full := "[" + strings.Repeat("#", 40) + "] 100%"
	if term := f.term.String(); !strings.HasSuffix(term, "\rBuilding kernel modules: "+full+"\n") {
		t.Errorf("terminal output ends %q", term[max(0, len(term)-80):])
	}
	logs := f.logs.String()
	if !strings.Contains(logs, `msg="Building kernel modules:" progress="[                                        ]   0%" percent=0 objects=0 total=10`) {
		t.Errorf("no 0%% progress record for 10 objects:\n%s", logs)
	}
	if !strings.Contains(logs, `msg="Building kernel modules:" progress="`+full+`" percent=100 objects=10 total=10 conftests=1`) {
		t.Errorf("no 100%% progress record:\n%s", logs)
	}
	logFile, err := os.ReadFile(f.work + ".log")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"--version\ngcc (Debian 12.2.0-14+deb12u1) 12.2.0", " -j3 SYSSRC=", "  CC [M]  " + filepath.Join(f.work, "nvidia-peermem.mod.o")} {
		if !strings.Contains(string(logFile), want) {
			t.Errorf("build log lacks %q:\n%s", want, logFile)
		}
	}
}

// The bar is drawn as objects are compiled, never past 99% before the end, and never backwards.
func TestProgressBarSteps(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	if _, err := build.Modules(context.Background(), f.opts); err != nil {
		t.Fatal(err)
	}
	frames := strings.Split(strings.TrimSuffix(f.term.String(), "\n"), "\r")[1:]
	var pcts []int
	for _, fr := range frames {
		var p int
		if _, err := fmt.Sscanf(fr[strings.LastIndexByte(fr, ']')+1:], "%d%%", &p); err != nil {
			t.Fatalf("frame %q: %v", fr, err)
		}
		pcts = append(pcts, p)
	}
	want := []int{10, 20, 30, 40, 50, 60, 70, 80, 90, 99, 100}
	if !slices.Equal(pcts, want) {
		t.Errorf("bar percentages %v, want %v", pcts, want)
	}
}

func TestInterfaces(t *testing.T) {
	t.Parallel()
	for _, common := range []bool{false, true} {
		t.Run(fmt.Sprintf("module-common=%v", common), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			f.runner.common = common
			members, err := build.Interfaces(context.Background(), f.opts)
			if err != nil {
				t.Fatal(err)
			}
			want := []build.Member{
				{Path: filepath.Join(f.work, "nv-linux.o"), LinkedModuleName: "nvidia.ko", CoreObjectName: "nvidia/nv-kernel.o_binary"},
				{Path: filepath.Join(f.work, "nv-modeset-linux.o"), LinkedModuleName: "nvidia-modeset.ko", CoreObjectName: "nvidia-modeset/nv-modeset-kernel.o_binary"},
				{Path: filepath.Join(f.work, "nvidia-uvm.ko")},
				{Path: filepath.Join(f.work, "nvidia-peermem.ko")},
			}
			if !slices.Equal(members, want) {
				t.Errorf("members\n%v\nwant\n%v", members, want)
			}
			if !members[0].Interface() || members[2].Interface() {
				t.Error("Interface() is wrong")
			}
			if c := f.makeCall(t); !slices.Equal(c.Args[3:], []string{"nv-linux.o", "nv-modeset-linux.o"}) {
				t.Errorf("make targets %q", c.Args[3:])
			}
			var merges []string
			for _, c := range f.runner.Calls() {
				if filepath.Base(c.Path) == "ld" {
					merges = append(merges, strings.Join(c.Args, " "))
				}
			}
			var wantMerges []string
			if common {
				mc := filepath.Join(f.work, link.ModuleCommonObject)
				for _, i := range []string{"nv-linux.o", "nv-modeset-linux.o"} {
					p := filepath.Join(f.work, i)
					wantMerges = append(wantMerges, "-r -o "+p+".merged "+p+" "+mc)
				}
			}
			if !slices.Equal(merges, wantMerges) {
				t.Errorf("ld runs\n%q\nwant\n%q", merges, wantMerges)
			}
		})
	}
}

func TestBuildFailure(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, first, last string
		kind              error
		errs              []string
	}{
		{"compile error", "", "nvidia-uvm/uvm.c:3:2: error: #error broken", build.ErrBuild, []string{"nvidia-uvm/uvm.c:3:2: error: #error broken"}},
		// With make -j the cause is far above the last lines; modpost's ERROR: counts too.
		{"early error", "  nvidia/nv.c:7:1: error: unknown type name 'foo'", "ERROR: modpost: \"bar\" [nvidia.ko] undefined!", build.ErrBuild,
			[]string{"nvidia/nv.c:7:1: error: unknown type name 'foo'", `ERROR: modpost: "bar" [nvidia.ko] undefined!`}},
		{"disk full", "", "nvidia-uvm/uvm.o: No space left on device", build.ErrNoSpace, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			f.runner.failLines, f.runner.failText, f.runner.failFirst = 40, tc.last, tc.first
			_, err := build.Modules(context.Background(), f.opts)
			var be *build.Error
			if !errors.As(err, &be) || !errors.Is(err, tc.kind) {
				t.Fatalf("Modules = %v, want a *build.Error of kind %v", err, tc.kind)
			}
			if len(be.Tail) != build.TailLines || be.Tail[0] != "line 11" || be.Tail[29] != tc.last {
				t.Errorf("tail %q", be.Tail)
			}
			if !slices.Equal(be.Errors, tc.errs) {
				t.Errorf("first errors %q, want %q", be.Errors, tc.errs)
			}
			if len(tc.errs) > 0 && !strings.Contains(err.Error(), "; the first errors:\n"+strings.Join(tc.errs, "\n")+"\n; the full log is ") {
				t.Errorf("error %q does not list the first errors", err)
			}
			if be.Log != f.work+".log" || !strings.Contains(err.Error(), "the full log is "+f.work+".log") ||
				!strings.Contains(err.Error(), tc.last) || !strings.Contains(err.Error(), "exit status 2") {
				t.Errorf("error %q", err)
			}
			if _, err := os.Stat(f.work); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("work dir left: %v", err)
			}
			if _, err := os.Stat(be.Log); err != nil {
				t.Errorf("log removed: %v", err)
			}
		})
	}
}

func TestVerifyFailure(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, vermagic, skip string
		want                 error
		text                 string
	}{
		{name: "other kernel", vermagic: "6.1.0-99-amd64 SMP", want: build.ErrKernelMismatch, text: `nvidia.ko has vermagic "6.1.0-99-amd64 SMP", for kernel "6.1.0-99-amd64"`},
		{name: "missing module", skip: "nvidia-peermem", want: build.ErrVerify, text: "nvidia-peermem.ko"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			f.runner.vermagic, f.runner.skip = tc.vermagic, tc.skip
			_, err := build.Modules(context.Background(), f.opts)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
				t.Fatalf("Modules = %v, want %v mentioning %q", err, tc.want, tc.text)
			}
			if _, err := os.Stat(f.work); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("work dir left: %v", err)
			}
			if strings.Contains(f.term.String(), "100%") {
				t.Errorf("the bar reached 100%% for a failed build: %q", f.term.String())
			}
		})
	}
}

func TestCancel(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.runner.block = true
	ctx, cancel := context.WithCancel(context.Background())
	f.opts.Terminal = writerFunc(func(p []byte) {
		if bytes.Contains(p, []byte("%")) {
			cancel() // the first object is compiled: stop the build
		}
	})
	_, err := build.Modules(ctx, f.opts)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Modules = %v, want context.Canceled", err)
	}
	if _, err := os.Stat(f.work); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("work dir left: %v", err)
	}
}

type writerFunc func(p []byte)

func (w writerFunc) Write(p []byte) (int, error) { w(p); return len(p), nil }

func TestCompilerCheck(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, cc, version string
		fail              bool
		want              error
		inErr, inLog      []string
	}{
		{name: "same", version: gccVersion, inLog: []string{`msg="the compiler matches the kernel's"`}},
		{name: "minor", version: "gcc (Debian 12.3.0-1) 12.3.0\n", inLog: []string{`below the major version" kernel_compiler_version=12.2.0`}},
		{name: "major", version: "gcc (Debian 14.2.0-19) 14.2.0\n", inLog: []string{
			`level=WARN msg="the compiler's major version differs from the kernel's; the modules may not work correctly: set --cc to a matching compiler if the image has one"`,
			`kernel_compiler_version=12.2.0`, `cc_version=14.2.0`}},
		{name: "family", cc: "clang", version: "Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu\n", want: build.ErrCompilerMismatch,
			inErr: []string{`the kernel was built with gcc 12.2.0 ("gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0")`, `clang 14.0.6 ("Debian clang version 14.0.6")`, "set --cc to a gcc compiler"}},
		{name: "broken", fail: true, want: build.ErrCompiler, inErr: []string{"cannot execute 'cc1'", "set --cc"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			f.runner.ccVersion, f.runner.ccFail = tc.version, tc.fail
			if tc.cc != "" {
				bin := strings.TrimPrefix(f.opts.Env[0], "PATH=")
				if err := os.WriteFile(filepath.Join(bin, tc.cc), nil, 0o755); err != nil {
					t.Fatal(err)
				}
				f.opts.CC = tc.cc
			}
			_, err := build.Modules(context.Background(), f.opts)
			if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("Modules = %v, want %v", err, tc.want)
			}
			for _, s := range tc.inErr {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q lacks %q", err, s)
				}
			}
			for _, s := range tc.inLog {
				if !strings.Contains(f.logs.String(), s) {
					t.Errorf("log lacks %q:\n%s", s, f.logs)
				}
			}
			if tc.want != nil {
				if _, err := os.Stat(f.work); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("work dir made: %v", err)
				}
			}
		})
	}
	// Without a banner nothing is compared.
	f := newFixture(t)
	f.opts.Banner, f.runner.ccFail = "", true
	if _, err := build.Modules(context.Background(), f.opts); err != nil {
		t.Errorf("Modules without a banner = %v", err)
	}
}

func TestBadOptions(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		change func(f *fixture)
		want   error
		text   string
	}{
		{"no source", func(f *fixture) { f.opts.SourceDir = "" }, build.ErrInvalid, "no source directory"},
		{"no tree", func(f *fixture) { f.opts.BuildTree = "" }, build.ErrInvalid, "no kernel build tree"},
		{"no release", func(f *fixture) { f.opts.KernelRelease = "" }, build.ErrInvalid, "no kernel release"},
		{"no work dir", func(f *fixture) { f.opts.WorkDir = "" }, build.ErrInvalid, "no work directory"},
		{"negative jobs", func(f *fixture) { f.opts.Jobs = -1 }, build.ErrInvalid, "-1 jobs"},
		{"not nvidia", func(f *fixture) { f.opts.SourceDir = f.tree }, build.ErrInvalid, "none of the module directories"},
		{"not a tree", func(f *fixture) { f.opts.BuildTree = f.src + "/nvidia" }, build.ErrInvalid, "is not a kernel build tree"},
		{"tree for another kernel", func(f *fixture) { f.opts.KernelRelease = "6.12.81-flatcar" }, build.ErrKernelMismatch,
			"is for kernel 6.1.0-57-amd64, the running kernel is 6.12.81-flatcar"},
		{"no compiler", func(f *fixture) { f.opts.CC = "gcc-15" }, build.ErrCompiler, "gcc-15 not found in PATH"},
		{"no make", func(f *fixture) { f.opts.Make = "/nonexistent/make" }, build.ErrInvalid, "/nonexistent/make"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			tc.change(f)
			_, err := build.Modules(context.Background(), f.opts)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
				t.Fatalf("Modules = %v, want %v with %q", err, tc.want, tc.text)
			}
			if len(f.runner.Calls()) > 0 {
				t.Errorf("ran %v", f.runner.Calls())
			}
			if _, err := os.Stat(filepath.Dir(f.work)); err == nil {
				if entries, _ := os.ReadDir(filepath.Dir(f.work)); len(entries) > 0 {
					t.Errorf("left %v next to the work dir", entries)
				}
			}
		})
	}
	// A work dir that is not empty is refused, and kept as it is.
	f := newFixture(t)
	if err := os.MkdirAll(filepath.Join(f.work, "keep"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := build.Modules(context.Background(), f.opts); err == nil || !strings.Contains(err.Error(), "is not empty") {
		t.Errorf("Modules into a full work dir = %v", err)
	}
	if _, err := os.Stat(filepath.Join(f.work, "keep")); err != nil {
		t.Errorf("the existing work dir was touched: %v", err)
	}
	// Interfaces needs nvidia and nvidia-uvm.
	f = newFixture(t)
	if err := os.RemoveAll(filepath.Join(f.src, "nvidia-uvm")); err != nil {
		t.Fatal(err)
	}
	if _, err := build.Interfaces(context.Background(), f.opts); !errors.Is(err, build.ErrInvalid) {
		t.Errorf("Interfaces without nvidia-uvm = %v", err)
	}
}

func TestNoSpaceFromRunner(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.opts.Procs = runnerFunc{f.runner, func(ctx context.Context, c host.Cmd, out *os.File) error {
		if filepath.Base(c.Path) == "make" {
			return fmt.Errorf("write: %w", syscall.ENOSPC)
		}
		return f.runner.Run(ctx, c, out)
	}}
	_, err := build.Modules(context.Background(), f.opts)
	if !errors.Is(err, build.ErrNoSpace) || !strings.Contains(err.Error(), "free space") {
		t.Fatalf("Modules = %v, want ErrNoSpace", err)
	}
}

// runnerFunc is a host.Procs whose Run is run.
type runnerFunc struct {
	host.Procs
	run func(ctx context.Context, c host.Cmd, out *os.File) error
}

func (r runnerFunc) Run(ctx context.Context, c host.Cmd, out *os.File) error {
	return r.run(ctx, c, out)
}

// On kernels 6.12 and newer kbuild also compiles .module-common.o: one object more to count.
func TestProgressCountsModuleCommon(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const newer = "6.12.81-flatcar"
	if err := os.WriteFile(filepath.Join(f.tree, "include", "generated", "utsrelease.h"), []byte(`#define UTS_RELEASE "`+newer+`"`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f.opts.KernelRelease, f.runner.vermagic, f.runner.common = newer, newer+" SMP preempt mod_unload", true
	if _, err := build.Modules(context.Background(), f.opts); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(f.logs.String(), "percent=0 objects=0 total=11") {
		t.Errorf("total is not 10 objects + .module-common.o:\n%s", f.logs)
	}
}

// Interfaces refuses a source directory without the core objects a package would name.
func TestInterfacesNeedCoreObjects(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	if err := os.Remove(filepath.Join(f.src, "nvidia-modeset", "nv-modeset-kernel.o_binary")); err != nil {
		t.Fatal(err)
	}
	_, err := build.Interfaces(context.Background(), f.opts)
	if !errors.Is(err, build.ErrInvalid) || !strings.Contains(err.Error(), "nvidia-modeset/nv-modeset-kernel.o_binary is missing") {
		t.Fatalf("Interfaces = %v", err)
	}
	if len(f.runner.Calls()) > 0 {
		t.Errorf("ran %v", f.runner.Calls())
	}
}

// NVIDIA's Makefile gets the kernel source tree as SYSSRC and a separate build tree as SYSOUT.
func TestKernelSourceTree(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		layout func(t *testing.T, f *fixture) (source string)
	}{
		{"merged", func(t *testing.T, f *fixture) string { return f.tree }},
		{"source link", func(t *testing.T, f *fixture) string {
			src := hosttest.Unpack(t, "-- Makefile --\n-- include/linux/module.h --\n")
			if err := os.Symlink(src, filepath.Join(f.tree, "source")); err != nil {
				t.Fatal(err)
			}
			return filepath.Join(f.tree, "source")
		}},
		{"debian wrapper", func(t *testing.T, f *fixture) string {
			common := hosttest.Unpack(t, "-- Makefile --\n-- include/linux/module.h --\n")
			if err := os.WriteFile(filepath.Join(f.tree, "Makefile"), []byte("include "+common+"/Makefile\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			return common
		}},
		{"wrapper of a tree without headers", func(t *testing.T, f *fixture) string {
			if err := os.WriteFile(filepath.Join(f.tree, "Makefile"), []byte("include "+t.TempDir()+"/Makefile\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			return f.tree
		}},
		{"given", func(t *testing.T, f *fixture) string {
			f.opts.KernelSource = hosttest.Unpack(t, "-- Makefile --\n")
			return f.opts.KernelSource
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			source := tc.layout(t, f)
			if _, err := build.Modules(context.Background(), f.opts); err != nil {
				t.Fatal(err)
			}
			want := []string{"-j3", "SYSSRC=" + source}
			if source != f.tree {
				want = append(want, "SYSOUT="+f.tree)
			}
			if c := f.makeCall(t); !slices.Equal(c.Args[:len(want)], want) || !strings.HasPrefix(c.Args[len(want)], "CC=") {
				t.Errorf("make %q, want %q CC=...", c.Args, want)
			}
		})
	}
	f := newFixture(t)
	f.opts.KernelSource = t.TempDir()
	if _, err := build.Modules(context.Background(), f.opts); !errors.Is(err, build.ErrInvalid) || !strings.Contains(err.Error(), "is not a kernel source tree") {
		t.Errorf("Modules with a source tree without a Makefile = %v", err)
	}
}
