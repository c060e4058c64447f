//go:build vmtest && nvidiatest

package vm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/link"
	"github.com/driver-agent/driver-agent/pkg/sysext"
	"github.com/driver-agent/driver-agent/pkg/sysext/sysexttest"
)

// sysext makes a Flatcar system extension from the modules the compile step built from NVIDIA's
// real sources (no build of its own) and checks it with unsquashfs: every module under
// updates/, their modules.dep entries as NVIDIA's depends= make them, and a unit that modprobes
// the host modules they need (drm for nvidia.ko) before loading them.
func (nv *nvidiaRun) sysext(t *testing.T, mods []link.Module) {
	t.Helper()
	root := filepath.Join(nv.h.work, "sysext-root")
	if err := sysexttest.UserspaceRoot(root, nv.src.version); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(nv.h.work, "sysext")
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	o := sysext.Options{DriverVersion: nv.src.version, FlatcarVersion: "4593.2.0", Architecture: "x86-64", KernelRelease: nv.h.tl.abi,
		ContainerRoot: root, OutDir: out, Generator: "test/vm nvidia", Procs: host.OSExec{}}
	for _, m := range mods {
		o.Modules = append(o.Modules, sysext.Module{Path: m.Path})
	}
	res, err := sysext.Build(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	nv.timing("sysext of the real modules: %s, %d bytes", filepath.Base(res.Image), res.Size)
	list, err := exec.Command("unsquashfs", "-l", res.Image).CombinedOutput()
	if err != nil {
		t.Fatalf("unsquashfs -l: %v\n%s", err, list)
	}
	upd := "usr/lib/modules/" + nv.h.tl.abi + "/updates/"
	for _, m := range mods {
		if !strings.Contains(string(list), "squashfs-root/"+upd+filepath.Base(m.Path)+"\n") {
			t.Errorf("unsquashfs -l lacks %s%s", upd, filepath.Base(m.Path))
		}
	}
	cat := func(rel string) string {
		b, err := exec.Command("unsquashfs", "-cat", res.Image, rel).Output()
		if err != nil {
			t.Fatalf("unsquashfs -cat %s: %v", rel, err)
		}
		return string(b)
	}
	deps := cat(upd + sysext.DepFile)
	for _, want := range []string{"updates/nvidia-uvm.ko: updates/nvidia.ko\n", "updates/nvidia-modeset.ko: updates/nvidia.ko\n", "updates/nvidia-drm.ko: updates/nvidia-modeset.ko updates/nvidia.ko"} {
		if !strings.Contains(deps, want) {
			t.Errorf("%s lacks %q:\n%s", sysext.DepFile, want, deps)
		}
	}
	cmds, _, err := sysext.LoadCommands([]byte(cat("usr/lib/systemd/system/" + sysext.UnitName)))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(cmds[0], "modprobe -a i2c_core ipmi_msghandler ipmi_devintf") || !strings.Contains(cmds[0], " drm") {
		t.Errorf("the unit's first command %q does not modprobe the host modules nvidia needs", cmds[0])
	}
	if r, err := sysext.ParseRelease([]byte(cat("usr/lib/extension-release.d/extension-release." + res.Name))); err != nil || r.VersionID != "4593.2.0" {
		t.Errorf("extension-release %+v, %v", r, err)
	}
}
