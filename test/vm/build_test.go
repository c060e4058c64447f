//go:build vmtest

package vm

import (
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/precompiled"
)

// buildAgent builds the static agent from the repository at repo into dir/driver-agent.
func buildAgent(ctx context.Context, repo, dir string) (string, error) {
	out := filepath.Join(dir, "driver-agent")
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", "-s -w", "-o", out, "./cmd/driver-agent")
	cmd.Dir = repo
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/driver-agent: %w\n%s", err, b)
	}
	if static, err := isStatic(out); err != nil || !static {
		return "", fmt.Errorf("%s is not a static executable (err %v)", out, err)
	}
	return out, nil
}

// standinSpec is one build of the stand-in modules.
type standinSpec struct {
	variant    string
	enodev     bool // nvidia's init returns -ENODEV
	delayMS    int  // nvidia's init sleeps first
	nvidiaOnly bool // build only nvidia (variants share uvm and modeset with "standard")
}

// standinSpecs are the builds the scenarios use.
func standinSpecs() []standinSpec {
	return []standinSpec{
		{variant: "standard"},
		{variant: "enodev", enodev: true, nvidiaOnly: true},
		{variant: "slow", delayMS: 6000, nvidiaOnly: true},
	}
}

// standin is a finished build: the kbuild modules plus the split objects of a precompiled
// package, all in dir.
type standin struct {
	spec standinSpec
	dir  string
}

func (s standin) path(name string) string { return filepath.Join(s.dir, name) }

// Names of the split objects, as in NVIDIA's packages and kernel source directory.
const (
	nvInterface      = "nv-linux.o"
	nvCore           = "nv-kernel.o_binary"
	modesetInterface = "nv-modeset-linux.o"
	modesetCore      = "nv-modeset-kernel.o_binary"
)

// buildStandin copies the C sources from src into work/standin-<variant>, writes their
// standin-config.h, builds them with kbuild against the headers, and splits nvidia (and
// nvidia-modeset) into an interface object and a core object the way NVIDIA's packages ship
// them. It checks on the host that `ld -d -r` of the two gives a module again.
func buildStandin(ctx context.Context, tl *tools, src, work, version string, spec standinSpec) (standin, error) {
	s := standin{spec: spec, dir: filepath.Join(work, "standin-"+spec.variant)}
	if err := os.MkdirAll(s.dir, 0o755); err != nil {
		return s, err
	}
	entries, err := os.ReadDir(src)
	if err != nil {
		return s, err
	}
	for _, e := range entries {
		if e.IsDir() || strings.HasSuffix(e.Name(), ".md") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			return s, err
		}
		if err := os.WriteFile(s.path(e.Name()), b, 0o644); err != nil {
			return s, err
		}
	}
	config := fmt.Sprintf("/* Written by the VM-test harness (test/vm/build_test.go). */\n"+
		"#define STANDIN_DRIVER_VERSION %q\n#define STANDIN_VARIANT %q\n#define STANDIN_INIT_ENODEV %d\n#define STANDIN_INIT_DELAY_MS %d\n",
		version, spec.variant, btoi(spec.enodev), spec.delayMS)
	if err := os.WriteFile(s.path("standin-config.h"), []byte(config), 0o644); err != nil {
		return s, err
	}
	args := []string{"-s", "-j2", "-C", tl.headers, "M=" + s.dir, "modules"}
	if tl.cc != "" {
		args = append(args, "CC="+tl.cc)
	}
	if spec.nvidiaOnly {
		args = append(args, "STANDIN_NVIDIA_ONLY=1")
	}
	if out, err := run(ctx, "", tl.make, args...); err != nil {
		return s, fmt.Errorf("kbuild of the %s stand-ins: %w\n%s", spec.variant, err, out)
	}

	lds, err := moduleLinkerScript(s.path(".nvidia.ko.cmd"), tl.headers)
	if err != nil {
		return s, err
	}
	// Kernels from 6.12 on link every module with .module-common.o (its vermagic and, with ORC,
	// the unwinder's header); the interface object carries it, as driver-agent build makes it.
	var common []string
	if _, err := os.Stat(s.path(".module-common.o")); err == nil {
		common = []string{".module-common.o"}
	}
	type split struct{ module, iface, core, ifaceOut, coreOut string }
	splits := []split{{"nvidia", "nv-interface.o", "nv-core.o", nvInterface, nvCore}}
	if !spec.nvidiaOnly {
		splits = append(splits, split{"nvidia-modeset", "nv-modeset-interface.o", "nv-modeset-core.o", modesetInterface, modesetCore})
	}
	for _, sp := range splits {
		// The interface object is the module's own objects plus <module>.mod.o (modinfo,
		// __this_module, symbol versions), linked with the kernel's module linker script so
		// that exported symbols land in __ksymtab*; the core object is linked in unchanged.
		args := append([]string{"-r", "-m", "elf_x86_64", "-T", lds, "-o", sp.ifaceOut, sp.iface, sp.module + ".mod.o"}, common...)
		if out, err := run(ctx, s.dir, tl.ld, args...); err != nil {
			return s, fmt.Errorf("make %s: %w\n%s", sp.ifaceOut, err, out)
		}
		if out, err := run(ctx, s.dir, "cp", sp.core, sp.coreOut); err != nil {
			return s, fmt.Errorf("make %s: %w\n%s", sp.coreOut, err, out)
		}
		linked := "host-linked-" + sp.module + ".ko"
		if out, err := run(ctx, s.dir, tl.ld, "-d", "-r", "-o", linked, sp.ifaceOut, sp.coreOut); err != nil {
			return s, fmt.Errorf("host check: ld -d -r %s %s: %w\n%s", sp.ifaceOut, sp.coreOut, err, out)
		}
		if err := checkModinfo(s.path(linked), sp.module, version); err != nil {
			return s, fmt.Errorf("host check of %s: %w", linked, err)
		}
	}
	return s, nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// run runs a command in dir and returns its combined output.
func run(ctx context.Context, dir, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	return cmd.CombinedOutput()
}

// moduleLinkerScript returns the module linker script kbuild used for a module, read from its
// .<module>.ko.cmd ("ld -r ... -T <script> ..."), as an absolute path.
func moduleLinkerScript(cmdFile, headers string) (string, error) {
	b, err := os.ReadFile(cmdFile)
	if err != nil {
		return "", fmt.Errorf("module linker script: %w", err)
	}
	f := strings.Fields(string(b))
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "-T" {
			p := f[i+1]
			if !filepath.IsAbs(p) {
				p = filepath.Join(headers, p)
			}
			if _, err := os.Stat(p); err != nil {
				return "", fmt.Errorf("module linker script from %s: %w", cmdFile, err)
			}
			return p, nil
		}
	}
	return "", fmt.Errorf("module linker script: no -T in %s", cmdFile)
}

// checkModinfo checks that the module at path carries name= and version= in .modinfo.
func checkModinfo(path, name, version string) error {
	f, err := elf.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return fmt.Errorf("%s has no .modinfo", path)
	}
	data, err := sec.Data()
	if err != nil {
		return err
	}
	for _, want := range []string{"name=" + strings.ReplaceAll(name, "-", "_"), "version=" + version} {
		if !bytes.Contains(data, append([]byte(want), 0)) {
			return fmt.Errorf("%s: .modinfo has no %q", path, want)
		}
	}
	if !bytes.Contains(data, []byte("vermagic=")) {
		return fmt.Errorf("%s: .modinfo has no vermagic", path)
	}
	return nil
}

// makePackage packs a precompiled package the way the driver container packs one with
// mkprecompiled: the nvidia and nvidia-modeset interfaces (linked with the core objects in the
// driver's kernel directory) and nvidia-uvm.ko as a complete module, all with target directory
// ".". nv comes from the variant under test; modeset and uvm from the standard build.
func makePackage(version, release, banner string, nv, std standin) ([]byte, error) {
	p := &precompiled.Package{DriverVersion: version, Description: release, ProcVersion: banner}
	read := func(s standin, name string) ([]byte, error) { return os.ReadFile(s.path(name)) }
	type iface struct {
		from             standin
		name, linked, co string
	}
	for _, i := range []iface{
		{nv, nvInterface, "nvidia.ko", "nvidia/" + nvCore},
		{std, modesetInterface, "nvidia-modeset.ko", "nvidia-modeset/" + modesetCore},
	} {
		data, err := read(i.from, i.name)
		if err != nil {
			return nil, err
		}
		f, err := precompiled.NewKernelInterface(i.name, i.linked, i.co, ".", data)
		if err != nil {
			return nil, err
		}
		if err := p.Append(f); err != nil {
			return nil, err
		}
	}
	uvm, err := read(std, "nvidia-uvm.ko")
	if err != nil {
		return nil, err
	}
	f, err := precompiled.NewKernelModule("nvidia-uvm.ko", ".", uvm, false)
	if err != nil {
		return nil, err
	}
	if err := p.Append(f); err != nil {
		return nil, err
	}
	b, err := p.Marshal()
	if err != nil {
		return nil, err
	}
	back, err := precompiled.Parse(b)
	if err != nil {
		return nil, fmt.Errorf("the package does not parse back: %w", err)
	}
	if banner != "" && !precompiled.Match(back, banner) {
		return nil, fmt.Errorf("the package does not match its own banner %q", banner)
	}
	return b, nil
}
