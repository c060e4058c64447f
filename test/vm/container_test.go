//go:build vmtest

package vm

import (
	"archive/tar"
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/build"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
)

// defaultImageWork is where scripts/image-test.sh (make image-test) leaves the driver image's
// root filesystem, rootfs.ext4, and its driver version, rootfs.version.
const defaultImageWork = "/var/tmp/driver-agent-image"

// upgradeVersion is the driver version the container-upgrade scenario moves to: stand-ins and
// a package of their own.
const upgradeVersion = "580.95.06"

// containerGroups are the boots of the container scenarios (guest/container.sh), three so that
// each stays within its timeout on a loaded machine: "container" has the precompiled and upgrade
// scenarios and the SIGKILLs during link and while nvidia is coming; "container-late" the SIGKILLs
// from there on (loaded before the device nodes, daemons started, the root mounted, Ready);
// "container-compile" the compile path, whose build alone takes minutes under TCG, with the
// kernel's build tree in the guest's root (see addCompileFiles).
func containerGroups() []group {
	early := group{name: "container", packages: true, memMiB: 1536, timeout: 10 * time.Minute,
		scenarios: []string{"container-precompiled", "container-upgrade"}}
	late := group{name: "container-late", packages: true, memMiB: 1536, timeout: 10 * time.Minute}
	for _, point := range []string{"link", "coming", "loaded", "daemons", "rbind", "ready"} {
		g := &late
		if point == "link" || point == "coming" {
			g = &early
		}
		for _, who := range []string{"container", "agent"} {
			g.scenarios = append(g.scenarios, "container-crash-"+point+"-"+who)
		}
	}
	compile := group{name: "container-compile", packages: true, memMiB: 1536, timeout: 12 * time.Minute,
		scenarios: []string{"container-compile"}, extra: addCompileFiles}
	return []group{early, late, compile}
}

// containerModules are the kernel's modules the container guest needs besides the agent's
// prerequisites: the virtio disk with the image, ext4 (with crc32c, which it asks the crypto API
// for), and overlayfs for each container's root.
func containerModules() []string {
	return []string{"virtio_pci", "virtio_blk", "crc32c_generic", "ext4", "overlay"}
}

// TestContainer runs the driver image of make image-test under crun in the guest, with the OCI
// spec generated from the gpu-operator's DaemonSet (test/vm/bundle): TestContainer/container/<scenario>.
func TestContainer(t *testing.T) {
	start := time.Now()
	tl, err := findTools()
	if err != nil {
		t.Fatal(err)
	}
	work := os.Getenv("DRIVER_AGENT_IMAGE_WORK")
	if work == "" {
		work = defaultImageWork
	}
	disk := filepath.Join(work, "rootfs.ext4")
	version, err := os.ReadFile(filepath.Join(work, "rootfs.version"))
	if err == nil {
		_, err = os.Stat(disk)
	}
	if err != nil {
		t.Fatalf("no driver image root filesystem in %s (%v): build it first with\n  make image-test   # as root; DRIVER_AGENT_IMAGE_WORK=%s", work, err, work)
	}
	crun, err := exec.LookPath("crun")
	if err != nil {
		t.Fatalf("crun is missing: sudo bash scripts/vm-deps.sh (or apt-get install -y --no-install-recommends crun)")
	}
	crunLibs, err := sharedLibraries(crun)
	if err != nil {
		t.Fatal(err)
	}
	h := setup(t, []*tools{tl}, true)[0] // the 6.1 kernel only
	up, err := buildStandin(context.Background(), tl, filepath.Join(h.repo, "test/vm/standin"), filepath.Join(h.work, "upgrade"), upgradeVersion, standinSpec{variant: "standard"})
	if err != nil {
		t.Fatal(err)
	}
	img := containerImage{disk: disk, version: strings.TrimSpace(string(version)), crun: crun, crunLibs: crunLibs, upgrade: up}
	for _, g := range containerGroups() {
		t.Run(g.name, func(t *testing.T) { h.containerBoot(t, g, img) })
	}
	h.timings = append(h.timings, fmt.Sprintf("total %s", since(start)))
	t.Logf("timings:\n  %s", strings.Join(h.timings, "\n  "))
}

// containerImage is what every container boot ships besides the base guest.
type containerImage struct {
	disk     string   // make image-test's rootfs.ext4
	version  string   // the image's driver version
	crun     string   // the runtime's binary
	crunLibs []string // its shared libraries
	upgrade  standin  // the stand-ins of upgradeVersion
}

// containerBoot boots g's scenarios with the image disk attached.
func (h *harness) containerBoot(t *testing.T, g group, img containerImage) {
	up := img.upgrade
	h.kernelBanner(t)
	initrd := filepath.Join(h.work, g.name+".cpio")
	t0 := time.Now()
	r := h.baseRootfs(g, driverVersion)
	if err := h.addPrerequisites(r, false, append(prerequisiteModules(), containerModules()...)); err != nil {
		t.Fatal(err)
	}
	if err := h.addPackages(r); err != nil {
		t.Fatal(err)
	}
	pkg, err := makePackage(upgradeVersion, h.tl.abi, h.banner, up, up)
	if err != nil {
		t.Fatal(err)
	}
	kdir := "usr/src/nvidia-" + upgradeVersion + "/kernel"
	r.bytes(kdir+"/precompiled/nvidia-modules-"+h.tl.abi, 0o644, pkg)
	r.file(kdir+"/nvidia/"+nvCore, 0o644, up.path(nvCore))
	r.file(kdir+"/nvidia-modeset/"+modesetCore, 0o644, up.path(modesetCore))
	r.bytes("vmtest/upgrade-version", 0o644, []byte(upgradeVersion+"\n"))
	guest := filepath.Join(h.repo, "test/vm/guest")
	r.file("vmtest/container.sh", 0o644, filepath.Join(guest, "container.sh"))
	for _, f := range []string{"config.json", "pod.sh", "startup-probe.sh"} {
		r.file("vmtest/bundle/"+f, 0o644, filepath.Join(h.repo, "test/vm/bundle", f))
	}
	r.bytes("vmtest/image-version", 0o644, []byte(img.version+"\n"))
	if os.Getenv("DRIVER_AGENT_VM_CONTAINER_AGENT") == "tree" {
		// While working on the agent: this tree's agent in the container's layer instead of
		// the image's (make image-test builds the image from the tree, so make ci needs none).
		r.bytes("vmtest/container-agent-tree", 0o644, nil)
	}
	if g.extra != nil {
		g.extra(t, h, r)
	}
	r.file("usr/bin/crun", 0o755, img.crun)
	for _, l := range img.crunLibs {
		r.file(l, 0o755, l)
	}
	size, err := h.writeRootfs(r, initrd)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("initramfs %s: %.1f MiB in %s; image disk %s", g.name, float64(size)/(1<<20), since(t0), img.disk)
	h.check(t, g, h.bootInitrd(t, g, initrd, "-drive", "file="+img.disk+",if=virtio,format=raw,readonly=on"))
}

// addCompileFiles gives the guest what the container-compile scenario needs: the kernel's build
// tree where the host keeps it (addHostBuildTree), and the stand-ins' sources laid out as NVIDIA's
// kernel source directory in /vmtest/compile-src, which guest/container.sh puts into the
// container's layer as /usr/src/nvidia-<version>/kernel and kernel-open, without precompiled
// packages. From test/vm/standin/source: the Kbuild and each module directory's <module>.Kbuild
// fragment; the build tests' stand-in Makefile (NVIDIA's command line, `make SYSSRC=... modules`,
// pkg/build/buildtest/standin); from the standard
// build: the C sources, standin.h, its standin-config.h (the driver version) and the core objects
// nvidia/nv-kernel.o_binary and nvidia-modeset/nv-modeset-kernel.o_binary, prebuilt as NVIDIA
// ships them.
func addCompileFiles(t *testing.T, h *harness, r *rootfs) {
	t0 := time.Now()
	files, size, err := h.addHostBuildTree(r, "usr/lib/modules/"+h.tl.abi+"/build")
	if err != nil {
		t.Fatal(err)
	}
	const dst = "vmtest/compile-src"
	src := filepath.Join(h.repo, "test/vm/standin/source")
	err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(src, p)
		r.file(dst+"/"+rel, 0o644, p)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	std := h.standins["standard"]
	for to, from := range map[string]string{
		"Makefile":                              filepath.Join(h.repo, "pkg/build/buildtest/standin/Makefile"),
		"standin.h":                             std.path("standin.h"),
		"standin-config.h":                      std.path("standin-config.h"),
		"nvidia/nv-interface.c":                 std.path("nv-interface.c"),
		"nvidia/" + nvCore:                      std.path(nvCore),
		"nvidia-uvm/nvidia-uvm.c":               std.path("nvidia-uvm.c"),
		"nvidia-modeset/nv-modeset-interface.c": std.path("nv-modeset-interface.c"),
		"nvidia-modeset/" + modesetCore:         std.path(modesetCore),
	} {
		r.file(dst+"/"+to, 0o644, from)
	}
	t.Logf("container-compile: build tree of %s from %s: %d files, %.1f MiB; stand-in sources in /%s (%s)",
		h.tl.abi, h.tl.published, files, float64(size)/(1<<20), dst, since(t0))
}

// addHostBuildTree puts the kernel's build tree, as its distribution ships it (h.tl.published),
// into the guest's root at dir as one self-contained directory, the way Flatcar ships it in
// /usr/lib/modules/<release>/build. Debian's is split: linux-headers-<abi>'s one-line Makefile
// includes linux-headers-<abi>-common's by absolute path, and its scripts and tools are links into
// linux-kbuild-<version>. Through the host root such a tree names files the container does not
// have, and the agent passes it over (compile.checkTree). So the common tree goes in first, then
// the flavour's files over it without the wrapper Makefile, with links that lead outside either
// replaced by what they point to (flatcartest.DirEntries): what scripts/vm-deps-kernel.sh does
// for the second suite's tree. Other architectures' arch/ directories are left out. It returns
// the number of regular files and their size.
func (h *harness) addHostBuildTree(r *rootfs, dir string) (files int, size int64, err error) {
	sizes := map[string]int64{}
	trees := []string{h.tl.published}
	if b, err := os.ReadFile(filepath.Join(h.tl.published, "Makefile")); err == nil && len(b) < 4096 {
		if common, ok := build.IncludedMakefileDir(string(b)); ok {
			trees = []string{common, h.tl.published}
		}
	}
	for i, tree := range trees {
		entries, err := flatcartest.DirEntries(tree)
		if err != nil {
			return 0, 0, fmt.Errorf("the build tree %s: %w", tree, err)
		}
		for _, e := range entries {
			name := strings.TrimSuffix(e.Name, "/")
			if i > 0 && name == "Makefile" || otherArch(name, e.Type == tar.TypeDir) {
				continue
			}
			p := dir + "/" + name
			switch e.Type {
			case tar.TypeDir:
				r.dir(p)
			case tar.TypeSymlink:
				r.symlink(p, e.Linkname)
			default:
				st, err := os.Stat(e.Source)
				if err != nil {
					return 0, 0, err
				}
				sizes[p] = st.Size()
				r.file(p, uint32(e.Mode), e.Source)
			}
		}
	}
	for _, f := range []string{"Makefile", ".config", "Module.symvers", "include/generated/utsrelease.h", "scripts/basic/fixdep", "scripts/mod/modpost"} {
		if !r.has(dir + "/" + f) {
			return 0, 0, fmt.Errorf("the merged build tree of %s lacks %s", h.tl.published, f)
		}
	}
	for _, n := range sizes {
		size += n
	}
	return len(sizes), size, nil
}

// otherArch reports whether the build tree's member name is under arch/<arch>/ for an
// architecture other than x86 (or is that directory).
func otherArch(name string, dir bool) bool {
	rest, ok := strings.CutPrefix(name, "arch/")
	if !ok {
		return false
	}
	a, _, sub := strings.Cut(rest, "/")
	return a != "x86" && (sub || dir)
}
