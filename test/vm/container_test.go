//go:build vmtest

package vm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// defaultImageWork is where scripts/image-test.sh (make image-test) leaves the driver image's
// root filesystem, rootfs.ext4, and its driver version, rootfs.version.
const defaultImageWork = "/var/tmp/driver-agent-image"

// upgradeVersion is the driver version the container-upgrade scenario moves to: stand-ins and
// a package of their own.
const upgradeVersion = "580.95.06"

// containerGroups are the boots of the container scenarios (guest/container.sh), two so that
// each stays within its timeout on a loaded machine: "container" has the scenarios without a
// crash and the SIGKILLs during link and while nvidia is coming; "container-late" the SIGKILLs
// from there on (loaded before the device nodes, daemons started, the root mounted, Ready).
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
	return []group{early, late}
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
