package sysext_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/sysext"
	"github.com/driver-agent/driver-agent/pkg/sysext/sysexttest"
)

const (
	drv  = "535.261.03"
	fc   = "4593.2.0"
	kver = "6.12.81-flatcar"
)

// modules writes stand-in module files (ELF objects with a .modinfo) for kernel release kv; their
// depends= name modules as modpost does, by file name (nvidia-modeset).
func modules(t *testing.T, kv string) []sysext.Module {
	t.Helper()
	dir := t.TempDir()
	var mods []sysext.Module
	for name, deps := range map[string]string{"nvidia": "i2c_core", "nvidia-uvm": "nvidia", "nvidia-modeset": "nvidia", "nvidia-drm": "nvidia,nvidia-modeset,drm,drm_kms_helper"} {
		p := filepath.Join(dir, name+".ko")
		data := hosttest.ModuleELF("name="+strings.ReplaceAll(name, "-", "_"), "version="+drv, "depends="+deps, "vermagic="+kv+" SMP preempt mod_unload ")
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		mods = append(mods, sysext.Module{Path: p})
	}
	return mods
}

func options(t *testing.T) sysext.Options {
	t.Helper()
	root := t.TempDir()
	if err := sysexttest.UserspaceRoot(root, drv); err != nil {
		t.Fatal(err)
	}
	return sysext.Options{DriverVersion: drv, FlatcarVersion: fc, Architecture: "x86-64", KernelRelease: kver,
		Modules: modules(t, kver), ContainerRoot: root, OutDir: t.TempDir(), Procs: host.OSExec{}}
}

func needSquashfsTools(t *testing.T) {
	t.Helper()
	for _, p := range []string{"mksquashfs", "unsquashfs"} {
		if _, err := exec.LookPath(p); err != nil {
			t.Fatalf("%s is missing: install squashfs-tools (scripts/install-deps.sh)", p)
		}
	}
}

// listing is `unsquashfs -l`'s paths, without the squashfs-root/ prefix.
func listing(t *testing.T, image string) []string {
	t.Helper()
	out, err := exec.Command("unsquashfs", "-l", image).CombinedOutput()
	if err != nil {
		t.Fatalf("unsquashfs -l %s: %v\n%s", image, err, out)
	}
	var paths []string
	for _, line := range strings.Split(string(out), "\n") {
		if p, ok := strings.CutPrefix(line, "squashfs-root/"); ok {
			paths = append(paths, p)
		}
	}
	return paths
}

func catFile(t *testing.T, image, rel string) []byte {
	t.Helper()
	out, err := exec.Command("unsquashfs", "-cat", image, rel).Output()
	if err != nil {
		t.Fatalf("unsquashfs -cat %s %s: %v", image, rel, err)
	}
	return out
}

func TestBuild(t *testing.T) {
	needSquashfsTools(t)
	o := options(t)
	res, err := sysext.Build(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	name := "nvidia-driver-" + drv + "-flatcar" + fc
	if res.Name != name || res.Image != filepath.Join(o.OutDir, name+".raw") {
		t.Fatalf("name %q image %q", res.Name, res.Image)
	}
	got := listing(t, res.Image)
	upd := "usr/lib/modules/" + kver + "/updates/"
	for _, want := range []string{
		upd + "nvidia.ko", upd + "nvidia-uvm.ko", upd + "nvidia-modeset.ko", upd + "nvidia-drm.ko", upd + sysext.DepFile,
		"usr/bin/nvidia-smi", "usr/bin/nvidia-persistenced",
		"usr/lib64/libnvidia-ml.so." + drv, "usr/lib64/libcuda.so." + drv, "usr/lib64/libcuda.so.1", "usr/lib64/libcuda.so",
		"usr/lib/firmware/nvidia/" + drv + "/gsp_ga10x.bin",
		"usr/lib/systemd/system/" + sysext.UnitName, "usr/lib/systemd/system/multi-user.target.wants/" + sysext.UnitName,
		"usr/lib/extension-release.d/extension-release." + name,
	} {
		if !slices.Contains(got, want) {
			t.Errorf("the image lacks %s; it has:\n%s", want, strings.Join(got, "\n"))
		}
	}
	for _, p := range got {
		if strings.Contains(p, "libz") || (strings.HasPrefix(filepath.Base(p), "modules.") && !strings.HasSuffix(p, sysext.DepFile)) {
			t.Errorf("the image has %s", p)
		}
	}

	modes, err := exec.Command("unsquashfs", "-lls", res.Image).CombinedOutput()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"drwxr-xr-x root/root", "-rwxr-xr-x root/root", "-rw-r--r-- root/root"} {
		if !strings.Contains(string(modes), want) {
			t.Errorf("unsquashfs -lls has no %q:\n%s", want, modes)
		}
	}
	for _, line := range strings.Split(string(modes), "\n") {
		if strings.HasPrefix(line, "d") && !strings.HasPrefix(line, "drwxr-xr-x root/root") {
			t.Errorf("directory not 0755 root/root: %s", line)
		}
	}

	rel, err := sysext.ParseRelease(catFile(t, res.Image, "usr/lib/extension-release.d/extension-release."+name))
	if err != nil {
		t.Fatal(err)
	}
	if want := (sysext.Release{ID: "flatcar", VersionID: fc, Architecture: "x86-64"}); rel != want {
		t.Errorf("extension-release %+v, want %+v", rel, want)
	}
	flatcar := sysext.Host{ID: "flatcar", VersionID: fc, SysextLevel: "1.0", Architecture: "x86-64"}
	if err := sysext.Check(name, rel, flatcar); err != nil {
		t.Errorf("the host it was built for refuses it: %v", err)
	}
	other := flatcar
	other.VersionID = "4593.2.1"
	if err := sysext.Check(name, rel, other); !errors.Is(err, sysext.ErrRefused) {
		t.Errorf("another Flatcar release (same SYSEXT_LEVEL) accepts it: %v", err)
	}

	deps := string(catFile(t, res.Image, upd+sysext.DepFile))
	for _, want := range []string{"updates/nvidia.ko:\n", "updates/nvidia-uvm.ko: updates/nvidia.ko\n", "updates/nvidia-drm.ko: updates/nvidia-modeset.ko updates/nvidia.ko\n"} {
		if !strings.Contains(deps, want) {
			t.Errorf("%s lacks %q:\n%s", sysext.DepFile, want, deps)
		}
	}
	unit := catFile(t, res.Image, "usr/lib/systemd/system/"+sysext.UnitName)
	cmds, ignore, err := sysext.LoadCommands(unit)
	if err != nil {
		t.Fatalf("%v\n%s", err, unit)
	}
	want := []string{
		"modprobe -a i2c_core ipmi_msghandler ipmi_devintf",
		"test -d /sys/module/nvidia || insmod /usr/lib/modules/" + kver + "/updates/nvidia.ko",
		"test -d /sys/module/nvidia_uvm || insmod /usr/lib/modules/" + kver + "/updates/nvidia-uvm.ko",
		"test -d /sys/module/nvidia_modeset || insmod /usr/lib/modules/" + kver + "/updates/nvidia-modeset.ko",
	}
	if !slices.Equal(cmds, want) || !slices.Equal(ignore, []bool{true, false, false, false}) {
		t.Errorf("load commands %q (ignore failure %v), want %q", cmds, ignore, want)
	}
	if !strings.Contains(string(unit), "ExecStart=/usr/bin/nvidia-persistenced --persistence-mode\n") {
		t.Errorf("the unit does not start nvidia-persistenced:\n%s", unit)
	}

	sums, err := os.ReadFile(filepath.Join(o.OutDir, sysext.SumsFile))
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(res.Image)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.Sum256(data)
	if want := hex.EncodeToString(h[:]) + "  " + name + ".raw\n"; string(sums) != want || res.SHA256 != hex.EncodeToString(h[:]) {
		t.Errorf("SHA256SUMS %q, want %q", sums, want)
	}
	if ents, _ := os.ReadDir(o.OutDir); len(ents) != 2 {
		t.Errorf("the output directory holds %d entries, want the image and SHA256SUMS", len(ents))
	}

	// The same inputs make the same image; a second release joins SHA256SUMS.
	o2 := o
	o2.FlatcarVersion = "4593.2.1"
	res2, err := sysext.Build(context.Background(), o2)
	if err != nil {
		t.Fatal(err)
	}
	again, err := sysext.Build(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if again.SHA256 != res.SHA256 {
		t.Errorf("rebuilding changed the image: %s then %s", res.SHA256, again.SHA256)
	}
	sums, _ = os.ReadFile(filepath.Join(o.OutDir, sysext.SumsFile))
	if want := res.SHA256 + "  " + name + ".raw\n" + res2.SHA256 + "  " + res2.Name + ".raw\n"; string(sums) != want {
		t.Errorf("SHA256SUMS after two releases:\n%s\nwant\n%s", sums, want)
	}
}

func TestBuildBadInput(t *testing.T) {
	needSquashfsTools(t)
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, o *sysext.Options)
		want   string
	}{
		{"no nvidia.ko", func(t *testing.T, o *sysext.Options) {
			o.Modules = slices.DeleteFunc(o.Modules, func(m sysext.Module) bool { return filepath.Base(m.Path) == "nvidia.ko" })
		}, "no nvidia.ko among the modules"},
		{"module for another kernel", func(t *testing.T, o *sysext.Options) { o.Modules = modules(t, "6.1.0-57-amd64") }, "not for kernel " + kver},
		{"no nvidia-smi", func(t *testing.T, o *sysext.Options) {
			hosttest.Must(t, os.Remove(filepath.Join(o.ContainerRoot, "usr/bin/nvidia-smi")))
		}, "nvidia-smi is in none of"},
		{"no firmware", func(t *testing.T, o *sysext.Options) {
			hosttest.Must(t, os.RemoveAll(filepath.Join(o.ContainerRoot, "usr/share/driver-agent/firmware")))
		}, "no GSP firmware"},
		{"no libnvidia-ml", func(t *testing.T, o *sysext.Options) {
			hosttest.Must(t, os.Remove(filepath.Join(o.ContainerRoot, "usr/lib/x86_64-linux-gnu/libnvidia-ml.so."+drv)))
		}, "libnvidia-ml.so." + drv},
		{"bad version", func(t *testing.T, o *sysext.Options) { o.FlatcarVersion = "4593" }, "do not make an extension name"},
		{"bad architecture", func(t *testing.T, o *sysext.Options) { o.Architecture = "amd64" }, "want x86-64 or arm64"},
		{"no mksquashfs", func(t *testing.T, o *sysext.Options) { o.Mksquashfs = "/nonexistent/mksquashfs" }, "install squashfs-tools"},
		{"corrupt SHA256SUMS", func(t *testing.T, o *sysext.Options) {
			hosttest.Must(t, os.WriteFile(filepath.Join(o.OutDir, sysext.SumsFile), []byte("garbage\n"), 0o644))
		}, "is not `<sha256>  <file>`"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := options(t)
			tc.change(t, &o)
			before := hosttest.Snapshot(t, o.OutDir)
			_, err := sysext.Build(context.Background(), o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one with %q", err, tc.want)
			}
			if d := hosttest.DiffSnapshots(before, hosttest.Snapshot(t, o.OutDir)); d != "" {
				t.Errorf("a failed build changed the output directory:\n%s", d)
			}
		})
	}
}

func TestBuildMksquashfsFails(t *testing.T) {
	o := options(t)
	fake := filepath.Join(t.TempDir(), "mksquashfs")
	// Writes part of an image, then fails, as a full disk would.
	if err := os.WriteFile(fake, []byte("#!/bin/sh\necho partial > \"$2\"\necho 'Write failed because No space left on device' >&2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	o.Mksquashfs = fake
	_, err := sysext.Build(context.Background(), o)
	if err == nil || !strings.Contains(err.Error(), "No space left on device") {
		t.Fatalf("error %v, want mksquashfs's message", err)
	}
	if ents, _ := os.ReadDir(o.OutDir); len(ents) != 0 {
		t.Errorf("a failed mksquashfs left %d entries in the output directory", len(ents))
	}
}
