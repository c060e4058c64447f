package build_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/build"
	"github.com/driver-agent/driver-agent/pkg/build/buildtest"
	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/modfile"
)

// The real-build tests run kbuild against Debian's installed kernel headers with the stand-in
// sources of package buildtest. They share one stand-in source directory (builds only read it).
var shared struct {
	once          sync.Once
	err           error
	dir           string
	release, tree string
	banner        string
	source        string
}

// realSetup fails the test, with the apt-get line, when the headers or tools are missing.
func realSetup(t *testing.T) (release, tree, banner, source string) {
	t.Helper()
	shared.once.Do(func() {
		if shared.release, shared.tree, shared.banner, shared.err = buildtest.Kernel(); shared.err != nil {
			return
		}
		if shared.dir, shared.err = os.MkdirTemp("", "build-real-"); shared.err != nil {
			return
		}
		shared.source = filepath.Join(shared.dir, "src")
		shared.err = buildtest.WriteSource(context.Background(), shared.source, shared.tree)
	})
	if shared.err != nil {
		t.Fatal(shared.err)
	}
	return shared.release, shared.tree, shared.banner, shared.source
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.dir != "" {
		os.RemoveAll(shared.dir)
	}
	os.Exit(code)
}

func TestRealModules(t *testing.T) {
	t.Parallel()
	release, tree, banner, source := realSetup(t)
	before := hosttest.Snapshot(t, source)
	var logs, term bytes.Buffer
	work := filepath.Join(t.TempDir(), "build")
	mods, err := build.Modules(context.Background(), build.Options{
		SourceDir: source, BuildTree: tree, KernelRelease: release, Banner: banner, Jobs: 2,
		WorkDir: work, Terminal: &term, Log: slog.New(slog.NewTextHandler(&logs, nil)), Procs: host.OSExec{},
	})
	if err != nil {
		t.Fatalf("%v\nlog:\n%s", err, logs.String())
	}
	var names []string
	for _, m := range mods {
		names = append(names, m.Name)
		mi, err := modfile.Open(m.Path)
		if err != nil {
			t.Fatal(err)
		}
		info, err := mi.Info()
		if err != nil {
			t.Fatal(err)
		}
		if r, _, _ := strings.Cut(info.Vermagic, " "); r != release {
			t.Errorf("%s: vermagic %q, want release %s", m.Path, info.Vermagic, release)
		}
		if info.Version != "0.0.1-buildtest" || info.Name != m.Name {
			t.Errorf("%s: modinfo name %q version %q", m.Path, info.Name, info.Version)
		}
	}
	if got := strings.Join(names, " "); got != "nvidia nvidia_uvm nvidia_modeset nvidia_peermem" {
		t.Errorf("modules %s", got)
	}
	full := "[" + strings.Repeat("#", 40) + "] 100%"
	if !strings.HasSuffix(term.String(), "\rBuilding kernel modules: "+full+"\n") {
		t.Errorf("terminal: %q", term.String())
	}
	// 7 sources and 4 .mod.o: every one was seen before the end, so the last bar before 100% is 99%.
	if !strings.Contains(term.String(), "]  99%\r") || !strings.Contains(logs.String(), `progress="`+full+`" percent=100 objects=11 total=11`) {
		t.Errorf("progress did not count the 11 objects:\nterminal %q\nlog:\n%s", term.String(), logs.String())
	}
	// Debian's headers are split: linux-headers-<abi> (the build tree, whose Makefile includes the
	// source tree's) and linux-headers-<abi>-common (the source tree, SYSSRC).
	if mk, _ := os.ReadFile(filepath.Join(tree, "Makefile")); strings.HasPrefix(string(mk), "include ") {
		buildLog, err := os.ReadFile(work + ".log")
		if err != nil || !strings.Contains(string(buildLog), " SYSOUT="+tree+" ") {
			t.Errorf("the split build tree was not given as SYSOUT (%v)", err)
		}
	}
	if d := hosttest.DiffSnapshots(before, hosttest.Snapshot(t, source)); d != "" {
		t.Errorf("the build wrote into the source directory:\n%s", d)
	}
}

// A build cancelled while the compiler runs leaves no process and no work directory. It runs
// through the agent's reaper.
func TestRealCancel(t *testing.T) {
	t.Parallel()
	release, tree, banner, source := realSetup(t)
	reaper, err := daemon.NewReaper(daemon.ReaperOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer reaper.Close()

	// A compiler that hangs on one source, after saying so.
	dir := t.TempDir()
	sleeping := filepath.Join(dir, "sleeping")
	cc := filepath.Join(dir, "gcc")
	script := fmt.Sprintf("#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in *uvm_ats.c) touch %s; sleep 600;; esac; done\nexec gcc \"$@\"\n", sleeping)
	if err := os.WriteFile(cc, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	marker := "BUILD_TEST_MARKER=" + randomHex(t)
	work := filepath.Join(t.TempDir(), "build")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	res := make(chan error, 1)
	go func() {
		_, err := build.Modules(ctx, build.Options{
			SourceDir: source, BuildTree: tree, KernelRelease: release, Banner: banner, Jobs: 2, CC: cc,
			Env: append(os.Environ(), marker), WorkDir: work, Procs: reaper,
		})
		res <- err
	}()
	deadline := time.Now().Add(5 * time.Minute)
	for {
		if _, err := os.Stat(sleeping); err == nil {
			break
		}
		select {
		case err := <-res:
			t.Fatalf("the build ended before the compiler hung: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the compiler did not reach uvm_ats.c")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if left := buildtest.Processes(marker); len(left) == 0 {
		t.Fatal("no build process seen while the build runs; the check below would prove nothing")
	}
	cancel()
	if err := <-res; !errors.Is(err, context.Canceled) {
		t.Fatalf("Modules = %v, want context.Canceled", err)
	}
	if left := buildtest.ProcessesLeft(marker, 20*time.Second); len(left) > 0 {
		t.Fatalf("processes left after the cancelled build: %v", left)
	}
	if _, err := os.Stat(work); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("work dir left: %v", err)
	}
}

// A compile error gives the last lines of the build log and its path.
func TestRealBuildError(t *testing.T) {
	t.Parallel()
	release, tree, banner, source := realSetup(t)
	broken := filepath.Join(t.TempDir(), "src")
	if err := buildtest.CopyDir(source, broken); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(broken, "nvidia-uvm", "uvm_broken.c"), []byte("#error stand-in compile failure\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	kbuild := filepath.Join(broken, "nvidia-uvm", "nvidia-uvm.Kbuild")
	b, err := os.ReadFile(kbuild)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kbuild, append(b, "NVIDIA_UVM_SOURCES += nvidia-uvm/uvm_broken.c\n"...), 0o644); err != nil {
		t.Fatal(err)
	}
	work := filepath.Join(t.TempDir(), "build")
	_, err = build.Modules(context.Background(), build.Options{
		SourceDir: broken, BuildTree: tree, KernelRelease: release, Banner: banner, Jobs: 2, WorkDir: work, Procs: host.OSExec{},
	})
	var be *build.Error
	if !errors.As(err, &be) || !errors.Is(err, build.ErrBuild) {
		t.Fatalf("Modules = %v, want a build error", err)
	}
	if !strings.Contains(err.Error(), "#error stand-in compile failure") || !strings.Contains(err.Error(), "the full log is "+work+".log") {
		t.Errorf("error lacks the compiler's message or the log path: %v", err)
	}
	if len(be.Tail) == 0 || len(be.Tail) > build.TailLines {
		t.Errorf("tail has %d lines", len(be.Tail))
	}
	if _, err := os.Stat(work); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("work dir left: %v", err)
	}
	log, err := os.ReadFile(be.Log)
	if err != nil || !bytes.Contains(log, []byte("uvm_broken.c")) {
		t.Errorf("build log: %v\n%s", err, log)
	}
}

func randomHex(t *testing.T) string {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
