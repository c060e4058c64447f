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
)

const (
	// defaultCache is where scripts/vm-deps.sh unpacks the kernel image; DRIVER_AGENT_VM_CACHE
	// overrides it (for both).
	defaultCache = "/var/cache/driver-agent-vm"
	// busyboxPath is where Debian's busybox-static installs its binary.
	busyboxPath = "/bin/busybox"
	// aptInstall is what scripts/vm-deps.sh installs with apt-get.
	aptInstall = "apt-get install -y --no-install-recommends qemu-system-x86 linux-headers-amd64 busybox-static cpio kmod binutils gcc make"
)

// tools are the host programs and kernel files the VM tests use.
type tools struct {
	abi       string // kernel ABI, e.g. 6.1.0-57-amd64
	headers   string // /usr/src/linux-headers-<abi>
	kernelDir string // <cache>/<abi>: vmlinuz, config, modules/
	vmlinuz   string
	modules   string // the image's lib/modules/<abi>, with a modules.dep
	qemu      string
	busybox   string
	ld        string // ld.bfd: copied into the guest with its shared libraries
	make      string
}

// findTools locates everything the VM tests need. It installs nothing: when something is missing
// the error gives the apt-get line (and scripts/vm-deps.sh for the kernel image).
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
	abi, err := headersABI()
	if err == nil {
		t.abi = abi
		t.headers = filepath.Join("/usr/src", "linux-headers-"+abi)
		if _, err := os.Stat(filepath.Join(t.headers, "Makefile")); err != nil {
			missing = append(missing, "linux-headers-"+abi)
		}
	} else {
		missing = append(missing, "linux-headers-amd64")
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("the VM tests need Debian packages that are missing: %s\ninstall them as root with:\n  apt-get update && apt-get install -y --no-install-recommends %s\nor install everything the VM tests need, the kernel image included:\n  sudo bash scripts/vm-deps.sh  # runs: %s",
			strings.Join(missing, " "), strings.Join(missing, " "), aptInstall)
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

// headersABI returns the kernel ABI that the installed linux-headers-amd64 metapackage depends on.
func headersABI() (string, error) {
	out, err := exec.Command("dpkg-query", "-W", "-f=${Depends}", "linux-headers-amd64").Output()
	if err != nil {
		return "", fmt.Errorf("dpkg-query linux-headers-amd64: %w", err)
	}
	m := regexp.MustCompile(`linux-headers-([0-9][^ ,]*-amd64)`).FindStringSubmatch(string(out))
	if m == nil {
		return "", fmt.Errorf("linux-headers-amd64 depends on %q: no linux-headers-<abi>-amd64 in it", out)
	}
	return m[1], nil
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
