//go:build vmtest

package vm

import (
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/build/buildtest"
)

const (
	// defaultCache is where scripts/vm-deps.sh unpacks the kernel image; DRIVER_AGENT_VM_CACHE
	// overrides it (for both).
	defaultCache = "/var/cache/driver-agent-vm"
	// busyboxPath is where Debian's busybox-static installs its binary.
	busyboxPath = "/bin/busybox"
	// aptInstall is what scripts/vm-deps.sh installs with apt-get.
	aptInstall = "apt-get install -y --no-install-recommends qemu-system-x86 linux-headers-amd64 busybox-static cpio kmod binutils gcc make patchelf"
)

// secondSuite is the Debian suite of the second kernel the VM tests run on, cached by
// scripts/vm-deps-kernel.sh: trixie's 6.12, built with gcc 14, the generation Flatcar stable runs.
const secondSuite = "trixie"

// tools are the host programs the VM tests use and one kernel to boot: a harness runs on one.
type tools struct {
	name      string // the kernel's short name in test names and result lines, e.g. 6.1
	suite     string // the Debian suite the kernel comes from
	abi       string // kernel ABI, e.g. 6.1.0-57-amd64
	headers   string // a build tree whose helpers run here: the stand-ins and driver-agent build use it
	published string // the build tree as Debian ships it: what the NVIDIA test serves as a Flatcar release
	sysroot   string // the root of the C library the published tree's helpers need; "" for this machine's
	cc        string // the compiler of the kernel's generation; "" for this machine's gcc
	kernelDir string // <cache>/<abi>: vmlinuz, config, modules/
	vmlinuz   string
	modules   string // the image's lib/modules/<abi>, with a modules.dep
	qemu      string
	busybox   string
	ld        string // ld.bfd: copied into the guest with its shared libraries
	make      string
}

// kernelName is the major.minor of a kernel ABI: "6.12" for 6.12.117+deb13-amd64.
func kernelName(abi string) string {
	if m := regexp.MustCompile(`^[0-9]+\.[0-9]+`).FindString(abi); m != "" {
		return m
	}
	return abi
}

// findKernels locates everything the VM tests need, for each kernel they boot: the one of the
// installed headers (this machine's suite), then the second suite's. It installs nothing: when
// something is missing the error gives the apt-get line (and scripts/vm-deps.sh for the kernels).
func findKernels() ([]*tools, error) {
	first, err := findTools()
	if err != nil {
		return nil, err
	}
	second, err := first.cachedKernel(secondSuite)
	if err != nil {
		return nil, err
	}
	return []*tools{first, second}, nil
}

// cachedKernel is t's host programs with the kernel scripts/vm-deps-kernel.sh cached for suite
// (<cache>/<suite> links to <cache>/<abi>): its build trees, compiler and C library come from
// there.
func (t *tools) cachedKernel(suite string) (*tools, error) {
	link := filepath.Join(filepath.Dir(t.kernelDir), suite)
	dir, err := filepath.EvalSymlinks(link)
	if err == nil {
		_, err = os.Stat(filepath.Join(dir, "complete"))
	}
	if err != nil {
		return nil, fmt.Errorf("no %s kernel in %s: %w\nrun as root:\n  sudo bash scripts/vm-deps.sh\nwhich runs scripts/vm-deps-kernel.sh %s: it caches the suite's kernel image, headers and compiler there",
			suite, link, err, suite)
	}
	k := *t
	k.suite, k.abi, k.name = suite, filepath.Base(dir), kernelName(filepath.Base(dir))
	k.kernelDir = dir
	k.vmlinuz = filepath.Join(dir, "vmlinuz")
	k.modules = filepath.Join(dir, "modules")
	k.headers = filepath.Join(dir, "build")
	k.published = filepath.Join(dir, "headers")
	k.sysroot = filepath.Join(dir, "toolchain")
	k.cc = filepath.Join(dir, "cc")
	if k.name == t.name {
		return nil, fmt.Errorf("the %s kernel %s is of the same generation as the installed headers' %s", suite, k.abi, t.abi)
	}
	return &k, nil
}

// findTools locates the host programs and the kernel of the installed linux-headers-amd64. It
// installs nothing: when something is missing the error gives the apt-get line (and
// scripts/vm-deps.sh for the kernel image).
func findTools() (*tools, error) {
	t := &tools{busybox: busyboxPath}
	var missing []string // Debian packages
	look := func(cmd, pkg string) string {
		p, err := exec.LookPath(cmd)
		if err != nil {
			missing = append(missing, pkg)
		}
		return p
	}
	t.qemu = look("qemu-system-x86_64", "qemu-system-x86")
	t.ld = look("ld.bfd", "binutils")
	t.make = look("make", "make")
	look("gcc", "gcc")
	if static, err := isStatic(t.busybox); err != nil || !static {
		missing = append(missing, "busybox-static")
	}
	abi, err := buildtest.HeadersABI()
	if err == nil {
		t.abi, t.name = abi, kernelName(abi)
		t.headers = filepath.Join("/usr/src", "linux-headers-"+abi)
		t.published = t.headers
		if _, err := os.Stat(filepath.Join(t.headers, "Makefile")); err != nil {
			missing = append(missing, "linux-headers-"+abi)
		}
	} else {
		missing = append(missing, "linux-headers-amd64")
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("the VM tests need Debian packages that are missing: %s\ninstall them as root with:\n  apt-get update && apt-get install -y --no-install-recommends %s\nor install everything the VM tests need, the kernel images included:\n  sudo bash scripts/vm-deps.sh  # runs: %s",
			strings.Join(missing, " "), strings.Join(missing, " "), aptInstall)
	}
	if b, err := os.ReadFile("/etc/os-release"); err == nil {
		if m := regexp.MustCompile(`(?m)^VERSION_CODENAME=(\S+)$`).FindSubmatch(b); m != nil {
			t.suite = string(m[1])
		}
	}

	cache := os.Getenv("DRIVER_AGENT_VM_CACHE")
	if cache == "" {
		cache = defaultCache
	}
	t.kernelDir = filepath.Join(cache, abi)
	t.vmlinuz = filepath.Join(t.kernelDir, "vmlinuz")
	t.modules = filepath.Join(t.kernelDir, "modules")
	if _, err := os.Stat(filepath.Join(t.kernelDir, "complete")); err != nil {
		return nil, fmt.Errorf("no kernel image for the installed headers (%s) in %s: %w\nrun as root:\n  sudo bash scripts/vm-deps.sh\nwhich runs: apt-get download linux-image-%s && dpkg-deb -x linux-image-%s_*.deb <dir>, then keeps boot/vmlinuz-%s and lib/modules/%s (after depmod -b) in %s",
			abi, t.kernelDir, err, abi, abi, abi, abi, t.kernelDir)
	}
	return t, nil
}

// isStatic reports whether the ELF executable at path has no program interpreter.
func isStatic(path string) (bool, error) {
	f, err := elf.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return false, nil
		}
	}
	return true, nil
}

// sharedLibraries returns the dynamic loader and the shared libraries that bin needs, as ldd
// resolves them on this machine (absolute paths).
func sharedLibraries(bin string) ([]string, error) {
	out, err := exec.Command("ldd", bin).CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w: %s", bin, err, out)
	}
	var libs []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) >= 3 && f[1] == "=>" && strings.HasPrefix(f[2], "/"):
			libs = append(libs, f[2])
		case len(f) >= 1 && strings.HasPrefix(f[0], "/"):
			libs = append(libs, f[0]) // the dynamic loader
		case len(f) >= 2 && f[1] == "=>" && (len(f) < 3 || f[2] == "not"):
			return nil, fmt.Errorf("ldd %s: %s", bin, strings.TrimSpace(line))
		}
	}
	if len(libs) == 0 {
		return nil, errors.New("ldd " + bin + ": no libraries listed")
	}
	return libs, nil
}
