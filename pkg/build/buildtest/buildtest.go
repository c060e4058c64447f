// Package buildtest provides what tests of real kernel module builds need: Debian's installed
// kernel headers as a kernel build tree, a matching kernel banner, and stand-in module sources
// shaped like NVIDIA's kernel source directory (a Makefile taking SYSSRC, per-module Kbuild
// fragments, prebuilt core objects). The stand-ins are GPL test fixtures adapted from
// test/vm/standin, not NVIDIA code.
package buildtest

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// AptInstall is the command that installs what real build tests need on Debian.
const AptInstall = "apt-get install -y --no-install-recommends linux-headers-amd64 gcc make binutils"

//go:embed standin
var standin embed.FS

// Headers returns the release and the build tree of the kernel headers that Debian's
// linux-headers-amd64 package installed (/usr/src/linux-headers-<abi>), which need not be the
// running kernel's. The error names the apt-get line when the headers, gcc, make or ld are
// missing.
func Headers() (release, tree string, err error) {
	var missing []string
	for _, tool := range []struct{ cmd, pkg string }{{"gcc", "gcc"}, {"make", "make"}, {"ld", "binutils"}} {
		if _, err := exec.LookPath(tool.cmd); err != nil {
			missing = append(missing, tool.pkg)
		}
	}
	abi, abiErr := HeadersABI()
	if abiErr == nil {
		tree = filepath.Join("/usr/src", "linux-headers-"+abi)
		if _, err := os.Stat(filepath.Join(tree, "Makefile")); err != nil {
			abiErr = err
		}
	}
	if abiErr != nil {
		missing = append(missing, "linux-headers-amd64")
	}
	if len(missing) > 0 {
		return "", "", fmt.Errorf("real kernel module builds need Debian packages that are missing (%s; headers: %v); install them as root with:\n  %s",
			strings.Join(missing, ", "), abiErr, AptInstall)
	}
	return abi, tree, nil
}

// HeadersABI returns the kernel ABI that the installed linux-headers-amd64 metapackage depends on,
// e.g. 6.1.0-57-amd64. The VM tests boot the kernel image of that ABI.
func HeadersABI() (string, error) {
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

// Kernel returns Headers' release and build tree and their Banner.
func Kernel() (release, tree, banner string, err error) {
	if release, tree, err = Headers(); err != nil {
		return "", "", "", err
	}
	banner, err = Banner(tree)
	return release, tree, banner, err
}

// Processes lists, as "pid comm", the live processes (not zombies) other than this one whose
// environment holds kv (KEY=value): put kv in a build's environment to find what it started.
func Processes(kv string) []string {
	entries, _ := os.ReadDir("/proc")
	var out []string
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
		if err != nil || !bytes.Contains(env, append([]byte(kv), 0)) && !bytes.HasSuffix(env, []byte(kv)) {
			continue
		}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		s := string(stat)
		if i := strings.LastIndexByte(s, ')'); i >= 0 && strings.HasPrefix(s[i+1:], " Z") {
			continue
		}
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		out = append(out, fmt.Sprintf("%d %s", pid, strings.TrimSpace(string(comm))))
	}
	return out
}

// ProcessesLeft waits up to within for the processes Processes(kv) finds to be gone (a SIGKILLed
// process takes a moment to die) and returns those still there.
func ProcessesLeft(kv string, within time.Duration) []string {
	deadline := time.Now().Add(within)
	left := Processes(kv)
	for len(left) > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
		left = Processes(kv)
	}
	return left
}

// Banner returns the /proc/version line of the kernel the build tree belongs to, put together
// from its include/generated headers the way the kernel prints it.
func Banner(tree string) (string, error) {
	read := func(name string) (string, error) {
		b, err := os.ReadFile(filepath.Join(tree, "include", "generated", name))
		return string(b), err
	}
	def := func(text, name string) string {
		m := regexp.MustCompile(`#define\s+` + name + `\s+"([^"]*)"`).FindStringSubmatch(text)
		if m == nil {
			return ""
		}
		return m[1]
	}
	release, err := read("utsrelease.h")
	if err != nil {
		return "", err
	}
	compile, err := read("compile.h")
	if err != nil {
		return "", err
	}
	version, err := read("utsversion.h")
	if err != nil {
		version = compile // older kernels keep UTS_VERSION in compile.h
	}
	fields := []string{def(release, "UTS_RELEASE"), def(compile, "LINUX_COMPILE_BY"), def(compile, "LINUX_COMPILE_HOST"),
		def(compile, "LINUX_COMPILER"), def(version, "UTS_VERSION")}
	for _, f := range fields {
		if f == "" {
			return "", fmt.Errorf("%s/include/generated: missing a banner field (have %q)", tree, fields)
		}
	}
	return fmt.Sprintf("Linux version %s (%s@%s) (%s) %s", fields[0], fields[1], fields[2], fields[3], fields[4]), nil
}

// WriteSource writes the stand-in driver sources for the kernel build tree tree into dir (which
// must not exist): the NVIDIA-shaped tree with nvidia, nvidia-uvm, nvidia-modeset and
// nvidia-peermem, and the core objects nvidia/nv-kernel.o_binary and
// nvidia-modeset/nv-modeset-kernel.o_binary compiled against tree (a short kbuild run in a
// scratch directory under dir's parent).
func WriteSource(ctx context.Context, dir, tree string) error {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	if err := copyEmbedded("standin", dir, func(rel string) bool { return rel == "core" || strings.HasPrefix(rel, "core/") }); err != nil {
		return err
	}
	scratch, err := os.MkdirTemp(filepath.Dir(dir), "standin-core-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(scratch)
	if err := copyEmbedded("standin/core", scratch, nil); err != nil {
		return err
	}
	h, err := standin.ReadFile("standin/common/standin.h")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(scratch, "standin.h"), h, 0o644); err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "make", "-C", tree, "M="+scratch, "nv-kernel.o", "nv-modeset-kernel.o")
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("compile the stand-in core objects: %w\n%s", err, out)
	}
	for obj, to := range map[string]string{
		"nv-kernel.o":         "nvidia/nv-kernel.o_binary",
		"nv-modeset-kernel.o": "nvidia-modeset/nv-modeset-kernel.o_binary",
	} {
		b, err := os.ReadFile(filepath.Join(scratch, obj))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, to), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// copyEmbedded copies the embedded directory from into to, leaving out what skip says.
func copyEmbedded(from, to string, skip func(rel string) bool) error {
	return fs.WalkDir(standin, from, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel := strings.TrimPrefix(strings.TrimPrefix(path, from), "/")
		if rel == "" {
			return nil
		}
		if skip != nil && skip(rel) {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		target := filepath.Join(to, filepath.FromSlash(rel))
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		b, err := standin.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(target, b, 0o644)
	})
}

// CopyDir copies the regular files and directories of src into dst (which must not exist), so a
// test can change a copy of a stand-in source directory.
func CopyDir(src, dst string) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.Mkdir(target, 0o755)
		case d.Type().IsRegular():
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			return os.WriteFile(target, b, 0o644)
		}
		return errors.New("CopyDir: " + path + " is neither a file nor a directory")
	})
}
