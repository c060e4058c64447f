package main

import (
	"bufio"
	"bytes"
	"debug/elf"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// build compiles the binary exactly as the Makefile does and links nvidia-driver to it.
func build(t *testing.T) (agent, nvidiaDriver string) {
	t.Helper()
	dir := t.TempDir()
	agent = filepath.Join(dir, "driver-agent")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w -X github.com/driver-agent/driver-agent/pkg/cli.version=test-1.2.3", "-o", agent, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	nvidiaDriver = filepath.Join(dir, "nvidia-driver")
	if err := os.Symlink("driver-agent", nvidiaDriver); err != nil {
		t.Fatal(err)
	}
	return agent, nvidiaDriver
}

func run(t *testing.T, bin string, env []string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return o.String(), e.String(), exit.ExitCode()
	}
	if err != nil {
		t.Fatal(err)
	}
	return o.String(), e.String(), 0
}

func TestBinary(t *testing.T) {
	agent, nvidiaDriver := build(t)

	t.Run("static", func(t *testing.T) {
		f, err := elf.Open(agent)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
				t.Errorf("binary has a %v program header: not statically linked", p.Type)
			}
		}
		if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
			t.Errorf("binary needs shared libraries %v", libs)
		}
	})

	t.Run("multi-call", func(t *testing.T) {
		for _, args := range [][]string{{"version"}, {"help"}, {"help", "exit-codes"}, {"bogus"}, {"init", "--bogus"}, {}} {
			o1, e1, c1 := run(t, agent, nil, args...)
			o2, e2, c2 := run(t, nvidiaDriver, nil, args...)
			e2, o2 = progName.ReplaceAllString(e2, "driver-agent$1"), progName.ReplaceAllString(o2, "driver-agent$1")
			if o1 != o2 || e1 != e2 || c1 != c2 {
				t.Errorf("%v differs by name: %q/%q/%d vs %q/%q/%d", args, o1, e1, c1, o2, e2, c2)
			}
		}
		for _, args := range [][]string{{"version"}, {"--version"}} {
			if out, _, code := run(t, nvidiaDriver, nil, args...); out != "driver-agent test-1.2.3\n" || code != 0 {
				t.Errorf("%v = %q, exit %d", args, out, code)
			}
		}
	})

	t.Run("usage errors exit 2", func(t *testing.T) {
		for _, args := range [][]string{{"bogus"}, {"init", "--bogus"}, {"--bogus"}, {}} {
			_, stderr, code := run(t, agent, nil, args...)
			if code != 2 || !strings.Contains(stderr, "Usage:") {
				t.Errorf("%v: exit %d, stderr %q", args, code, stderr)
			}
		}
		// A bad flag: the error and the usage of that command, once each.
		for cmd, usage := range map[string]string{"init": "Usage: driver-agent init [flags]", "status": "Usage: driver-agent status [flags]"} {
			_, stderr, code := run(t, agent, nil, cmd, "--bogus")
			if code != 2 || strings.Count(stderr, "Usage:") != 1 || !strings.Contains(stderr, usage) || strings.Count(stderr, "-bogus") != 1 {
				t.Errorf("%s --bogus: exit %d, stderr %q; want %q once and the error once", cmd, code, stderr, usage)
			}
		}
	})

	t.Run("bad config exits 3 before any side effect", func(t *testing.T) {
		runDir := t.TempDir()
		_, stderr, code := run(t, agent, []string{"DRIVER_VERSION=580.95.05", "KERNEL_MODULE_TYPE=closed", "MAX_THREADS=lots"}, "init", "--run", runDir)
		if code != 3 || !strings.Contains(stderr, `KERNEL_MODULE_TYPE="closed"`) || !strings.Contains(stderr, `MAX_THREADS="lots"`) {
			t.Errorf("exit %d, stderr %q", code, stderr)
		}
		if entries, _ := os.ReadDir(runDir); len(entries) != 0 {
			t.Errorf("bad config still wrote %v", entries)
		}
	})

	t.Run("bad module parameter file exits 3 before any side effect", func(t *testing.T) {
		dir := hosttest.UnpackFile(t, "../../test/fixtures/ubuntu-nogpu.txtar")
		r := hosttest.Roots(t, dir)
		conf := filepath.Join(r.DriversDir, "nvidia.conf")
		if err := os.WriteFile(conf, []byte("NVreg_EnableGpuFirmware=0\nNVreg_RegistryDwords=\"unterminated\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		before := hosttest.Snapshot(t, dir)
		_, stderr, code := run(t, agent, []string{"DRIVER_VERSION=535.309.01"}, "init", "--root", r.Root, "--host-root", r.HostRoot,
			"--proc", r.Proc, "--sys", r.Sys, "--dev", r.Dev, "--run", r.Run, "--drivers-dir", r.DriversDir, "--metrics-address", "127.0.0.1:0",
			"--termination-log", filepath.Join(dir, "termination-log"))
		if code != 3 || !strings.Contains(stderr, conf+`:2: parameter "NVreg_RegistryDwords=\"unterminated"`) {
			t.Errorf("exit %d, stderr %q; want 3 naming %s:2", code, stderr, conf)
		}
		if diff := hosttest.DiffSnapshots(before, hosttest.Snapshot(t, dir)); diff != "" {
			t.Errorf("a bad parameter file still changed the tree:\n%s", diff)
		}
	})

	t.Run("dry run on this machine", func(t *testing.T) {
		stdout, stderr, code := run(t, agent, []string{"PATH=/usr/bin:/bin"}, "--dry-run")
		if code != 0 || !strings.Contains(stdout, "Install path: ") || !strings.Contains(stdout, "dry run: nothing was changed") {
			t.Errorf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
		}
	})

	t.Run("dry run on a machine without a GPU", func(t *testing.T) {
		dir := hosttest.UnpackFile(t, "../../test/fixtures/ubuntu-nogpu.txtar")
		r := hosttest.Roots(t, dir)
		before := hosttest.Snapshot(t, dir)
		stdout, stderr, code := run(t, agent, []string{"DRIVER_VERSION=535.309.01"}, "--dry-run", "--root", r.Root, "--host-root", r.HostRoot,
			"--proc", r.Proc, "--sys", r.Sys, "--dev", r.Dev, "--run", r.Run, "--drivers-dir", r.DriversDir)
		if code != 0 {
			t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
		}
		for _, want := range []string{"no NVIDIA GPU found", "ubuntu 24.04", "Install path: compile", "On SIGTERM:"} {
			if !strings.Contains(stdout, want) {
				t.Errorf("plan lacks %q:\n%s", want, stdout)
			}
		}
		if diff := hosttest.DiffSnapshots(before, hosttest.Snapshot(t, dir)); diff != "" {
			t.Errorf("dry run changed the tree:\n%s", diff)
		}
		jsonOut, _, code := run(t, agent, []string{"DRIVER_VERSION=535.309.01"}, "--dry-run", "--output", "json", "--proc", r.Proc, "--sys", r.Sys, "--run", r.Run, "--root", r.Root)
		if code != 0 || !strings.Contains(jsonOut, `"path": "compile"`) || !strings.Contains(jsonOut, `"gpus": null`) {
			t.Errorf("json plan (exit %d):\n%s", code, jsonOut)
		}
	})
}

// TestScriptCLI: the options and commands of NVIDIA's nvidia-driver script, which the
// gpu-operator's driver.args may pass, work: never a usage error for an option the script takes.
func TestScriptCLI(t *testing.T) {
	_, nvidiaDriver := build(t)
	dir := hosttest.UnpackFile(t, "../../test/fixtures/ubuntu-nogpu.txtar")
	r := hosttest.Roots(t, dir)
	roots := []string{"--root", r.Root, "--host-root", r.HostRoot, "--proc", r.Proc, "--sys", r.Sys, "--dev", r.Dev, "--run", r.Run, "--drivers-dir", r.DriversDir}
	env := []string{"DRIVER_VERSION=535.309.01"}

	t.Run("init options", func(t *testing.T) {
		args := append([]string{"init", "-a", "-m", "4", "--kernel", "5.4.0-bogus", "-s", "key1", "-t", "builtin", "--dry-run"}, roots...)
		stdout, stderr, code := run(t, nvidiaDriver, env, args...)
		if code != 0 || !strings.Contains(stdout, "Install path: compile") {
			t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
		}
		for _, want := range []string{"-k/--kernel 5.4.0-bogus ignored: the agent installs for the running kernel", "-s/--sign key1 ignored", "-t/--tag builtin ignored"} {
			if !strings.Contains(stderr, want) {
				t.Errorf("log lacks %q:\n%s", want, stderr)
			}
		}
		if _, stderr, code := run(t, nvidiaDriver, env, append([]string{"init", "-am4", "--dry-run"}, roots...)...); code != 0 || strings.Contains(stderr, "ignored") {
			t.Errorf("-am4: exit %d\n%s", code, stderr)
		}
	})

	t.Run("load never compiles", func(t *testing.T) {
		stdout, stderr, code := run(t, nvidiaDriver, env, append([]string{"load", "--dry-run"}, roots...)...)
		if code != 0 || !strings.Contains(stdout, "load never compiles (init does)") {
			t.Errorf("exit %d\n%s\n%s", code, stdout, stderr)
		}
	})

	t.Run("update names its replacement", func(t *testing.T) {
		_, stderr, code := run(t, nvidiaDriver, env, "update", "-k", "6.1.0-57-amd64", "-t", "builtin")
		if code != 2 || !strings.Contains(stderr, `"update" (NVIDIA's script builds a precompiled package with it) is not a command here`) ||
			!strings.Contains(stderr, "nvidia-driver build --kernel-build-tree DIR") {
			t.Errorf("exit %d\n%s", code, stderr)
		}
	})

	// The script traps HUP, INT, QUIT, PIPE and TERM alike; so does the agent: each ends a waiting
	// command as SIGTERM does (here the peermem sidecar's wait for MOFED), with exit 0.
	for _, sig := range []syscall.Signal{syscall.SIGHUP, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGPIPE, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			cmd := exec.Command(nvidiaDriver, "reload_nvidia_peermem", "--run", t.TempDir(), "--sys", t.TempDir(), "--proc", r.Proc)
			stderr, err := cmd.StderrPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			lines := bufio.NewScanner(stderr)
			for lines.Scan() && !strings.Contains(lines.Text(), "waiting for mellanox ofed") {
			}
			cmd.Process.Signal(sig)
			go io.Copy(io.Discard, stderr)
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			select {
			case err := <-exited:
				if err != nil {
					t.Errorf("after %v: %v, want exit 0", sig, err)
				}
			case <-time.After(10 * time.Second):
				cmd.Process.Kill()
				<-exited
				t.Errorf("still running 10s after %v", sig)
			}
		})
	}
}

// progName matches the program name in usage text, not in file names like nvidia-driver.pid.
var progName = regexp.MustCompile(`nvidia-driver([^.]|$)`)
