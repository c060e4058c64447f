//go:build vmtest

package vm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/sysext"
	"github.com/driver-agent/driver-agent/pkg/sysext/sysexttest"
)

// Flatcar releases of the sysext group: the guest's os-release says sysextHostVersion; the
// second extension is made for sysextOtherVersion.
const (
	sysextHostVersion  = "4593.2.0"
	sysextOtherVersion = "4459.2.4"
)

// sysextGroup is the boot for driver extensions (guest/sysext.sh): the guest is a Flatcar host
// with the kernel's loop, squashfs and overlay modules, and two images made by pkg/sysext from
// the standard stand-ins, one for its release and one for another.
func sysextGroup() group {
	return group{name: "sysext", timeout: 4 * time.Minute, modules: []string{"loop", "squashfs", "overlay"},
		scenarios: []string{"sysext-refused", "sysext-host"}, extra: addSysext}
}

// addSysext makes the two extensions (the userspace from a container root with the guest's
// nvidia-smi and nvidia-persistenced stand-ins), checks the first with unsquashfs, and adds
// them, guest/sysext.sh and a Flatcar os-release to the guest.
func addSysext(t *testing.T, h *harness, r *rootfs) {
	t.Helper()
	root := filepath.Join(h.work, "sysext-root")
	if err := sysexttest.UserspaceRoot(root, driverVersion); err != nil {
		t.Fatal(err)
	}
	guest := filepath.Join(h.repo, "test/vm/guest")
	for _, bin := range []string{"nvidia-smi", "nvidia-persistenced"} {
		data, err := os.ReadFile(filepath.Join(guest, bin))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, "usr/bin", bin), data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	out := filepath.Join(h.work, "sysext-out")
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	std := h.standins["standard"]
	var images []string
	for _, v := range []string{sysextHostVersion, sysextOtherVersion} {
		o := sysext.Options{DriverVersion: driverVersion, FlatcarVersion: v, Architecture: "x86-64", KernelRelease: h.tl.abi,
			ContainerRoot: root, OutDir: out, Generator: "test/vm", Procs: host.OSExec{}}
		for _, m := range []string{"nvidia.ko", "nvidia-uvm.ko", "nvidia-modeset.ko"} {
			o.Modules = append(o.Modules, sysext.Module{Path: std.path(m)})
		}
		res, err := sysext.Build(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		images = append(images, res.Image)
		r.file("vmtest/sysext/"+filepath.Base(res.Image), 0o644, res.Image)
	}
	list, err := exec.Command("unsquashfs", "-l", images[0]).CombinedOutput()
	if err != nil {
		t.Fatalf("unsquashfs -l %s: %v\n%s", images[0], err, list)
	}
	for _, want := range []string{"usr/lib/modules/" + h.tl.abi + "/updates/nvidia.ko", "usr/lib/systemd/system/" + sysext.UnitName,
		"usr/lib/extension-release.d/extension-release." + sysext.Name(driverVersion, sysextHostVersion)} {
		if !strings.Contains(string(list), "squashfs-root/"+want+"\n") {
			t.Fatalf("unsquashfs -l %s lacks %s:\n%s", images[0], want, list)
		}
	}
	r.file("vmtest/sysext.sh", 0o644, filepath.Join(guest, "sysext.sh"))
	r.bytes("etc/os-release", 0o644, []byte("NAME=\"Flatcar Container Linux by Kinvolk\"\nID=flatcar\nVERSION_ID="+sysextHostVersion+
		"\nSYSEXT_LEVEL=1.0\nFLATCAR_BOARD=\"amd64-usr\"\nPRETTY_NAME=\"driver-agent VM test guest as Flatcar "+sysextHostVersion+"\"\n"))
	r.bytes("vmtest/sysext/config", 0o644, []byte("SYSEXT_NAME="+sysext.Name(driverVersion, sysextHostVersion)+
		"\nSYSEXT_OTHER="+sysext.Name(driverVersion, sysextOtherVersion)+"\nSYSEXT_HOST_VERSION="+sysextHostVersion+
		"\nSYSEXT_OTHER_VERSION="+sysextOtherVersion+"\nSYSEXT_UNIT="+sysext.UnitName+"\n"))
}
