package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/build/buildtest"
	"github.com/driver-agent/driver-agent/pkg/cli"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/link"
	"github.com/driver-agent/driver-agent/pkg/modfile"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
)

// `driver-agent build` runs a real kbuild of the stand-in sources against Debian's headers and
// writes a package that reads back with NVIDIA's records and links into loadable modules.
func TestBuildCommand(t *testing.T) {
	t.Parallel()
	release, tree, banner, err := buildtest.Kernel()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	source := filepath.Join(dir, "nvidia-0.0.1-buildtest", "kernel")
	if err := os.MkdirAll(filepath.Dir(source), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := buildtest.WriteSource(context.Background(), source, tree); err != nil {
		t.Fatal(err)
	}
	bannerFile := filepath.Join(dir, "version")
	if err := os.WriteFile(bannerFile, []byte(banner+"\nignored second line\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	pkg := filepath.Join(dir, "nvidia-modules-"+release)
	work := filepath.Join(dir, "work")
	if err := os.Mkdir(work, 0o755); err != nil {
		t.Fatal(err)
	}
	// No --driver-version: it comes from the source's Kbuild.
	code, stdout, stderr := runCLI("build", "--kernel-banner", bannerFile, "--kernel-build-tree", tree,
		"--source", source, "-j", "2", "--work-dir", work, "-o", pkg)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	if !strings.Contains(stderr, `msg="Building kernel modules:" progress="[`+strings.Repeat("#", 40)+`] 100%"`) {
		t.Errorf("no 100%% progress in the log:\n%s", stderr)
	}
	if entries, _ := os.ReadDir(work); len(entries) != 0 {
		t.Errorf("the work directory keeps %v", entries)
	}

	p, err := precompiled.ReadFile(pkg)
	if err != nil {
		t.Fatal(err)
	}
	if p.DriverVersion != "0.0.1-buildtest" || p.Description != release || p.ProcVersion != banner || !precompiled.Match(p, banner) {
		t.Errorf("header: driver %q, description %q, proc version %q", p.DriverVersion, p.Description, p.ProcVersion)
	}
	type record struct {
		typ                           precompiled.FileType
		name, linked, core, targetDir string
		attrs                         precompiled.Attr
	}
	want := []record{
		{precompiled.KernelInterface, "nv-linux.o", "nvidia.ko", "nvidia/nv-kernel.o_binary", ".", 0},
		{precompiled.KernelInterface, "nv-modeset-linux.o", "nvidia-modeset.ko", "nvidia-modeset/nv-modeset-kernel.o_binary", ".", 0},
		{precompiled.KernelModule, "nvidia-uvm.ko", "", "", ".", 0},
		{precompiled.KernelModule, "nvidia-peermem.ko", "", "", ".", 0},
	}
	var got []record
	for _, f := range p.Files {
		got = append(got, record{f.Type, f.Name, f.LinkedModuleName, f.CoreObjectName, f.TargetDirectory, f.Attributes})
	}
	if len(got) != len(want) {
		t.Fatalf("records %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("record %d: %+v, want %+v", i, got[i], want[i])
		}
	}

	// The subcommands read it back.
	if code, out, errOut := runCLI("precompiled", "info", "--json", pkg); code != 0 || !json.Valid([]byte(out)) {
		t.Errorf("precompiled info: exit %d, %s%s", code, out, errOut)
	}
	proc := filepath.Join(dir, "proc")
	if err := os.Mkdir(proc, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(proc, "version"), []byte(banner+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, out, _ := runCLI("precompiled", "match", pkg, "--proc", proc); code != 0 || out != "kernel interface matches.\n" {
		t.Errorf("precompiled match: exit %d, %q", code, out)
	}

	// Linked with the source's core objects, the interfaces give modules for this kernel.
	mods, err := link.Link(context.Background(), p, filepath.Join(dir, "link"), link.Options{CoreObjectDir: source, KernelRelease: release, Procs: host.OSExec{}})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range mods {
		names = append(names, m.Name)
		mf, err := modfile.Open(m.Path)
		if err != nil {
			t.Fatal(err)
		}
		info, err := mf.Info()
		if err != nil {
			t.Fatal(err)
		}
		if r, _, _ := strings.Cut(info.Vermagic, " "); r != release || info.Name != m.Name {
			t.Errorf("%s: name %q vermagic %q", m.Path, info.Name, info.Vermagic)
		}
	}
	if strings.Join(names, " ") != "nvidia nvidia_modeset nvidia_uvm nvidia_peermem" {
		t.Errorf("linked modules %v", names)
	}
}

func TestBuildCommandUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	banner := filepath.Join(dir, "banner")
	if err := os.WriteFile(banner, []byte("not a banner\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "pkg")
	for _, tc := range []struct {
		name string
		args []string
		text string
	}{
		{"no banner", []string{"--kernel-build-tree", dir, "--source", dir, "-o", out}, "--kernel-banner FILE or --proc DIR"},
		{"two banners", []string{"--kernel-banner", banner, "--proc", "/proc", "--kernel-build-tree", dir, "--source", dir, "-o", out}, "one of them"},
		{"no tree", []string{"--proc", "/proc", "--source", dir, "-o", out}, "--kernel-build-tree DIR"},
		{"no output", []string{"--proc", "/proc", "--kernel-build-tree", dir, "--source", dir}, "-o PKG"},
		{"no source or version", []string{"--proc", "/proc", "--kernel-build-tree", dir, "-o", out}, "--source DIR or --driver-version V"},
		{"bad jobs", []string{"--proc", "/proc", "--kernel-build-tree", dir, "--source", dir, "-j", "-3", "-o", out}, "-j -3"},
		{"extra argument", []string{"--proc", "/proc", "--kernel-build-tree", dir, "--source", dir, "-o", out, "extra"}, `unexpected arguments ["extra"]`},
		{"unknown flag", []string{"--frobnicate"}, "flag provided but not defined"},
		{"bad module type", []string{"--proc", "/proc", "--kernel-build-tree", dir, "--source", dir, "--kernel-module-type", "closed", "-o", out}, `--kernel-module-type "closed": want proprietary or open`},
		{"not a banner", []string{"--kernel-banner", banner, "--kernel-build-tree", dir, "--source", dir, "-o", out}, `"not a banner" is not a Linux banner`},
		{"missing banner file", []string{"--kernel-banner", filepath.Join(dir, "nope"), "--kernel-build-tree", dir, "--source", dir, "-o", out}, "no such file"},
		{"no version in the source", []string{"--proc", "/proc", "--kernel-build-tree", dir, "--source", dir, "-o", out}, "give --driver-version"},
		{"not a source", []string{"--proc", "/proc", "--kernel-build-tree", dir, "--source", dir, "--driver-version", "1.0", "-o", out}, "none of the module directories"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, stdout, stderr := runCLI(append([]string{"build"}, tc.args...)...)
			if code != 2 || !strings.Contains(stderr, tc.text) || stdout != "" {
				t.Errorf("exit %d, stdout %q, stderr %q; want 2 with %q", code, stdout, stderr, tc.text)
			}
		})
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("a package was written: %v", err)
	}
	if code, stdout, _ := runCLI("build", "--help"); code != 0 || !strings.Contains(stdout, "--kernel-build-tree DIR") {
		t.Errorf("build --help: exit %d\n%s", code, stdout)
	}
	if code, stdout, _ := runCLI("help"); code != 0 || !strings.Contains(stdout, "  build ") {
		t.Errorf("help does not list build:\n%s", stdout)
	}
}

// The image sets DRIVER_VERSION, KERNEL_MODULE_TYPE and MAX_THREADS; they are build's defaults.
func TestBuildDefaultsFromTheImageEnvironment(t *testing.T) {
	var stdout, stderr bytes.Buffer
	tree := t.TempDir()
	code := cli.Main(context.Background(), []string{"driver-agent", "build", "--proc", "/proc", "--kernel-build-tree", tree, "-o", filepath.Join(t.TempDir(), "pkg")},
		[]string{"DRIVER_VERSION=0.0.0-none", "KERNEL_MODULE_TYPE=open"}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), "/usr/src/nvidia-0.0.0-none/kernel-open") {
		t.Errorf("exit %d, stderr %q: want the open source directory of DRIVER_VERSION", code, stderr.String())
	}
	stderr.Reset()
	code = cli.Main(context.Background(), []string{"driver-agent", "build", "--proc", "/proc", "--kernel-build-tree", tree, "-o", "x"},
		[]string{"DRIVER_VERSION=1.0", "MAX_THREADS=many"}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), `MAX_THREADS="many"`) {
		t.Errorf("exit %d, stderr %q", code, stderr.String())
	}
}
