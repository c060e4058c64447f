// Package cli is the command line: it picks the subcommand (init, status, version, help, ...), builds
// the configuration, the logger and the host, runs the command and returns the exit code. The
// binary behaves the same whether it is called driver-agent or nvidia-driver.
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
	"runtime"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/agent"
	"github.com/driver-agent/driver-agent/pkg/config"
	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/lock"
	"github.com/driver-agent/driver-agent/pkg/modules"
	"github.com/driver-agent/driver-agent/pkg/status"
)

// version is set at build time with -ldflags "-X github.com/driver-agent/driver-agent/pkg/cli.version=...".
var version = "dev"

// Version returns the agent's version.
func Version() string { return version }

// Main runs the command line argv (argv[0] is the program name) and returns the exit code.
func Main(ctx context.Context, argv, environ []string, stdout, stderr io.Writer) int {
	prog := "driver-agent"
	if len(argv) > 0 {
		prog = filepath.Base(argv[0])
	}
	var args []string
	if len(argv) > 1 {
		args = argv[1:]
	}
	if len(args) == 0 {
		usage(stderr, prog)
		return exitcode.Code(exitcode.ErrUsage)
	}
	cmd := args[0]
	switch {
	case cmd == "--version" || cmd == "-version":
		cmd, args = "version", args[1:]
	case strings.HasPrefix(cmd, "-"):
		cmd = "init" // the operator may replace or append args: flags alone mean init
	default:
		args = args[1:]
	}
	switch cmd {
	case "init", "load":
		return runInit(ctx, prog, cmd, args, environ, stdout, stderr)
	case "update":
		fmt.Fprint(stderr, updateReplaced(prog))
		return exitcode.Code(exitcode.ErrUsage)
	case "status":
		return runStatus(prog, args, environ, stdout, stderr)
	case "unload":
		return runUnload(ctx, prog, args, environ, stdout, stderr)
	case "reload_nvidia_peermem":
		return runReloadPeermem(ctx, prog, args, environ, stderr)
	case "probe_nvidia_peermem":
		return runProbePeermem(prog, args, environ, stdout, stderr)
	case "version":
		fmt.Fprintf(stdout, "driver-agent %s\n", version)
		return 0
	case "help":
		return help(prog, args, stdout, stderr)
	case "precompiled":
		return runPrecompiled(prog, args, stdout, stderr)
	case "banner":
		return runBanner(prog, args, stdout, stderr)
	case "build":
		return runBuild(ctx, prog, args, environ, stdout, stderr)
	case "fetch-build-tree":
		return runFetch(ctx, prog, args, stdout, stderr)
	case "sysext":
		return runSysext(ctx, prog, args, environ, stdout, stderr)
	}
	fmt.Fprintf(stderr, "%s: unknown command %q\n\n", prog, cmd)
	usage(stderr, prog)
	return exitcode.Code(exitcode.ErrUsage)
}

func usage(w io.Writer, prog string) {
	fmt.Fprintf(w, `Usage: %[1]s <command> [flags]

Commands:
  init        install and load the NVIDIA driver, start its daemons, share the driver root, wait for SIGTERM
  load        init with prebuilt modules only (a precompiled package or the cache): never compiles
  status      print what the running agent is doing (--output json for scripts)
  unload      unload the NVIDIA modules (holders first); refuses while init runs
  reload_nvidia_peermem, probe_nvidia_peermem
              the GPUDirect RDMA sidecar's entrypoint and probe (the operator's names)
  version     print the version (also --version)
  precompiled read, match, pack and unpack NVIDIA precompiled kernel-interface packages
  banner      print a kernel image's banner (the first line of /proc/version): banner --vmlinuz FILE
  build       build the kernel interfaces for one kernel and pack them into a precompiled
              package (image builds; "build --help" for its options)
  fetch-build-tree
              download and verify a Flatcar release's kernel and build tree (image builds)
  sysext      build a Flatcar system extension of the driver for one release (node images;
              "sysext --help")
  help        this text; "help init" lists every flag, "help exit-codes" the exit codes

"%[1]s --dry-run" is "%[1]s init --dry-run": decide and print the plan without changing anything.
Flags without a command mean init. NVIDIA's script's "update" is replaced by "build" (run "%[1]s update"
for how).
`, prog)
}

// updateReplaced says what replaces NVIDIA's script's update command, which builds a precompiled
// package for a kernel on the node or at image build.
func updateReplaced(prog string) string {
	return fmt.Sprintf(`%[1]s: "update" (NVIDIA's script builds a precompiled package with it) is not a command here.
  On a node, "%[1]s init" compiles when no precompiled package matches the running kernel, and
  keeps the modules in its cache (--cache-dir) for the next start.
  For an image, build the package with
    %[1]s build --kernel-build-tree DIR (--kernel-banner FILE | --proc DIR) -o PKG
  ("%[1]s fetch-build-tree" downloads a Flatcar release's build tree and kernel; "%[1]s build --help").
`, prog)
}

func help(prog string, args []string, stdout, stderr io.Writer) int {
	switch {
	case len(args) == 0:
		usage(stdout, prog)
	case args[0] == "exit-codes":
		exitcode.WriteTable(stdout)
	case args[0] == "init":
		config.Usage(stdout, prog+" init")
	case args[0] == "build":
		buildUsage(stdout, prog)
	case args[0] == "sysext":
		sysextUsage(stdout, prog)
	default:
		fmt.Fprintf(stderr, "%s: no help for %q\n", prog, args[0])
		return exitcode.Code(exitcode.ErrUsage)
	}
	return 0
}

// parse parses flags and environment; a returned code >= 0 means stop with it.
func parse(prog, cmd string, args, environ []string, stderr io.Writer) (*config.Config, int) {
	cfg, rest, err := config.Parse(prog+" "+cmd, args, environ, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil, 0
	}
	if err == nil && len(rest) > 0 {
		err = fmt.Errorf("%w: unexpected arguments %q", exitcode.ErrUsage, rest)
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", prog, err)
		if errors.Is(err, exitcode.ErrUsage) {
			config.Usage(stderr, prog+" "+cmd)
		}
		return nil, exitcode.Code(err)
	}
	return cfg, -1
}

func newLogger(cfg *config.Config, w io.Writer) *slog.Logger {
	var level slog.Level
	level.UnmarshalText([]byte(cfg.LogLevel)) // validated by config
	opts := &slog.HandlerOptions{Level: level}
	if cfg.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// runInit runs init, or load: init that never compiles (NVIDIA's script's load-only command).
func runInit(ctx context.Context, prog, cmd string, args, environ []string, stdout, stderr io.Writer) int {
	cfg, code := parse(prog, cmd, args, environ, stderr)
	if cfg == nil {
		return code
	}
	log := newLogger(cfg, stderr).With("node", cfg.NodeName)
	release, _ := kernel.Release(cfg.Proc)
	for _, note := range cfg.Script.Notes(release) {
		log.Warn(note)
	}
	if err := cfg.ValidateInit(); err != nil {
		if !cfg.DryRun {
			fmt.Fprintf(stderr, "%s: %v\n", prog, err)
			return exitcode.Code(err)
		}
		log.Warn("dry run with incomplete configuration; a real run would refuse to start", "error", err)
	}
	if _, err := os.ReadDir(cfg.HostRoot); err != nil {
		log.Warn("host root is unreadable (is the pod hostPID and privileged?); reading host files from the fallback",
			"host_root", cfg.HostRoot, "fallback", cfg.HostRootFallback, "error", err)
		cfg.HostRoot = cfg.HostRootFallback
	}
	if host.SpareProc(environ, runtime.NumCPU()) {
		log.Debug("GOMAXPROCS raised from 1 to 2, so that a system call keeps its P (host.SpareProc)")
	}
	a := &agent.Agent{Config: cfg, Log: log, Out: stdout, Terminal: terminal(stderr), Version: version, LoadOnly: cmd == "load"}
	if cfg.DryRun {
		a.Recorder = &host.Recorder{}
		a.Host = host.DryRun(cfg.Roots, a.Recorder)
	} else {
		sched, err := host.BatchThreads(runtime.NumCPU())
		switch {
		case err != nil:
			log.Warn("not every thread of the agent is in SCHED_BATCH; it runs on as it is", "error", err)
		case sched != nil:
			log.Debug("threads in SCHED_BATCH, so that the runtime's monitor does not preempt the agent on the one CPU (host.BatchThreads)")
		}
		// Every child (daemons, the linker) is started and reaped in one place, with the
		// scheduling the agent had; as PID 1, or as a child subreaper otherwise, the agent also
		// reaps what the daemons leave behind.
		reaper, err := daemon.NewReaper(daemon.ReaperOptions{Log: log, All: true, Subreaper: os.Getpid() != 1, ChildSched: sched})
		if err != nil {
			log.Error("cannot set up child process handling", "error", err)
			return 1
		}
		defer reaper.Close()
		a.Host = host.Real(cfg.Roots, reaper)
	}
	err := a.Run(ctx)
	if !cfg.DryRun {
		agent.WriteTerminationLog(cfg.TerminationLog, err)
	}
	if err != nil {
		log.Error("driver-agent stopped with an error", "exit_code", exitcode.Code(err), "error", err)
	}
	return exitcode.Code(err)
}

func runStatus(prog string, args, environ []string, stdout, stderr io.Writer) int {
	for i, a := range args {
		if a == "--json" || a == "-json" { // the short form scripts use
			args[i] = "--output=json"
		}
	}
	cfg, code := parse(prog, "status", args, environ, stderr)
	if cfg == nil {
		return code
	}
	s, err := status.Read(status.Paths{Run: cfg.Run})
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", prog, err)
		return 1
	}
	if cfg.Output == "json" {
		return writeJSON(stdout, s)
	}
	fmt.Fprint(stdout, status.Format(s))
	return 0
}

// runUnload is the one-shot unload: it takes the same lock as init, so it never pulls the driver
// from under a running agent, and exits 10 naming the holders when the driver is in use.
func runUnload(ctx context.Context, prog string, args, environ []string, stdout, stderr io.Writer) int {
	cfg, code := parse(prog, "unload", args, environ, stderr)
	if cfg == nil {
		return code
	}
	log := newLogger(cfg, stderr)
	paths := status.Paths{Run: cfg.Run}
	if cfg.DryRun {
		return planUnload(ctx, cfg, log, paths, stdout)
	}
	l, err := lock.Acquire(paths.PIDFile(), os.Getpid())
	if err != nil {
		log.Error("refusing to unload", "error", err)
		return exitcode.Code(err)
	}
	defer l.Release()
	ctx, cancel := context.WithTimeout(ctx, cfg.ShutdownTimeout)
	defer cancel()
	h := host.Real(cfg.Roots, host.OSExec{}) // it runs no process
	log.Info("Unloading NVIDIA driver kernel modules...")
	u := modules.Unloader{Host: h, Log: log, UnloadForeign: cfg.UnloadForeignHolders}
	if err := u.Unload(ctx, agent.NVIDIAModules()); err != nil {
		if !errors.Is(err, exitcode.ErrInUse) { // the unloader has said so, naming the holders
			log.Error("Could not unload NVIDIA driver kernel modules", "error", err)
		}
		return exitcode.Code(err)
	}
	if err := (status.Writer{Files: h.Files, Paths: paths}).ClearDigest(); err != nil {
		log.Warn("could not remove the stored digest", "error", err)
	}
	return 0
}

// unloadPlan is what unload --dry-run prints.
type unloadPlan struct {
	Actions []host.Action `json:"actions"`
	Notes   []string      `json:"notes,omitempty"`
}

// planUnload is unload --dry-run: the real unloader's order and in-use check with every change
// recorded, not made; the lock is looked at, not taken. A refusal is a note: the exit code is 0.
func planUnload(ctx context.Context, cfg *config.Config, log *slog.Logger, paths status.Paths, stdout io.Writer) int {
	var p unloadPlan
	if err := lock.Check(paths.PIDFile()); err != nil {
		p.Notes = append(p.Notes, "would refuse to unload: "+err.Error())
	}
	rec := &host.Recorder{}
	h := host.DryRun(cfg.Roots, rec)
	if len(p.Notes) == 0 {
		log.Info("Unloading NVIDIA driver kernel modules...")
		u := modules.Unloader{Host: h, Log: log, UnloadForeign: cfg.UnloadForeignHolders, Timeout: cfg.ShutdownTimeout, DryRun: true}
		if err := u.Unload(ctx, agent.NVIDIAModules()); err != nil {
			p.Notes = append(p.Notes, "would fail: "+err.Error())
		} else {
			if len(rec.Actions()) == 0 {
				p.Notes = append(p.Notes, "no NVIDIA kernel module is loaded: nothing to unload")
			}
			if err := (status.Writer{Files: h.Files, Paths: paths}).ClearDigest(); err != nil {
				p.Notes = append(p.Notes, "would fail to remove the stored digest: "+err.Error())
			}
		}
	}
	p.Actions = rec.Actions()
	if cfg.Output == "json" {
		return writeJSON(stdout, p)
	}
	var b strings.Builder
	b.WriteString("driver-agent unload plan (dry run: nothing was changed)\n")
	for _, a := range p.Actions {
		fmt.Fprintf(&b, "  %s\n", a)
	}
	for _, n := range p.Notes {
		fmt.Fprintf(&b, "Note: %s\n", n)
	}
	if _, err := io.WriteString(stdout, b.String()); err != nil {
		return 1
	}
	return 0
}
