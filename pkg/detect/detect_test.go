package detect

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

func fixture(t *testing.T, name string) Facts {
	t.Helper()
	dir := hosttest.UnpackFile(t, filepath.Join("..", "..", "test", "fixtures", name))
	f, err := Detect(hosttest.Roots(t, dir))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestFlatcarStable(t *testing.T) {
	t.Parallel()
	f := fixture(t, "flatcar-stable-gpu.txtar")
	if f.KernelRelease != "6.6.95-flatcar" || f.OS.ID != "flatcar" || f.OS.VersionID != "4230.2.1" {
		t.Errorf("identity = %q %+v", f.KernelRelease, f.OS)
	}
	if f.Flatcar == nil || f.Flatcar.Version != "4230.2.1" || f.Flatcar.Board != "amd64-usr" || f.Flatcar.Channel != "stable" {
		t.Fatalf("flatcar = %+v", f.Flatcar)
	}
	if filepath.Base(f.Flatcar.ChannelSource) != "update.conf" {
		t.Errorf("channel from %q: it must come from update.conf's GROUP when present", f.Flatcar.ChannelSource)
	}
	if len(f.GPUs) != 1 || f.GPUs[0].Address != "0000:3b:00.0" || f.GPUs[0].Device != 0x2330 {
		t.Errorf("GPUs = %+v", f.GPUs)
	}
	if len(f.Mellanox) != 1 || len(f.NVSwitches) != 0 || f.NVLink5 {
		t.Errorf("mellanox %d, nvswitches %d, nvlink5 %t", len(f.Mellanox), len(f.NVSwitches), f.NVLink5)
	}
	if _, ok := f.Modules["kvm"]; !ok || len(f.Modules) != 3 {
		t.Errorf("modules = %v", f.Modules)
	}
	if f.HostDriver != "" || len(f.Warnings) != 0 {
		t.Errorf("host driver %q, warnings %v", f.HostDriver, f.Warnings)
	}
}

func TestFlatcarLTS(t *testing.T) {
	t.Parallel()
	f := fixture(t, "flatcar-lts-nvswitch.txtar")
	if f.Flatcar == nil || f.Flatcar.Channel != "lts" || f.Flatcar.ChannelSource != "version" || f.Flatcar.Board != "arm64-usr" {
		t.Errorf("flatcar = %+v", f.Flatcar)
	}
	if len(f.GPUs) != 1 || len(f.NVSwitches) != 1 || !f.NVLink5 {
		t.Errorf("gpus %d, nvswitches %d, nvlink5 %t", len(f.GPUs), len(f.NVSwitches), f.NVLink5)
	}
}

func TestUbuntuNoGPU(t *testing.T) {
	t.Parallel()
	f := fixture(t, "ubuntu-nogpu.txtar")
	if f.OS.ID != "ubuntu" || f.OS.VersionID != "24.04" || f.Flatcar != nil {
		t.Errorf("os = %+v, flatcar = %+v", f.OS, f.Flatcar)
	}
	if len(f.GPUs) != 0 {
		t.Errorf("an Intel display controller counted as an NVIDIA GPU: %+v", f.GPUs)
	}
	if f.Modules["i2c_core"].RefCnt != 0 {
		t.Errorf("modules = %+v", f.Modules)
	}
}

func TestTalos(t *testing.T) {
	t.Parallel()
	f := fixture(t, "talos.txtar")
	if f.OS.ID != "talos" || f.HostDriver == "" {
		t.Errorf("os = %+v, host driver %q", f.OS, f.HostDriver)
	}
	if f.Modules["nvidia"].Version != "570.148.08" || f.Modules["nvidia"].RefCnt != 1 {
		t.Errorf("nvidia = %+v", f.Modules["nvidia"])
	}
}

func TestChannelFromVersion(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]string{"4459.0.0": "alpha", "4426.1.0": "beta", "4230.2.1": "stable", "3510.3.6": "lts", "4230": "", "1.9.0": ""} {
		if got := ChannelFromVersion(v); got != want {
			t.Errorf("ChannelFromVersion(%q) = %q, want %q", v, got, want)
		}
	}
}

func TestMissingKernelIsAnError(t *testing.T) {
	t.Parallel()
	if _, err := Detect(hosttest.Roots(t, t.TempDir())); err == nil {
		t.Error("Detect on an empty tree: no error")
	}
}

// The board's subsystem IDs are read where sysfs has them (NVIDIA's list of supported GPUs has
// entries for single boards), and are 0 where it does not.
func TestPCISubsystemIDs(t *testing.T) {
	sys := t.TempDir()
	for addr, files := range map[string]map[string]string{
		"0000:41:00.0": {"vendor": "0x10de", "device": "0x2bb1", "class": "0x030000", "subsystem_vendor": "0x1028", "subsystem_device": "0x204b"},
		"0000:42:00.0": {"vendor": "0x10de", "device": "0x1db4", "class": "0x030200"},
	} {
		dir := filepath.Join(sys, "bus/pci/devices", addr)
		hosttest.Must(t, os.MkdirAll(dir, 0o755))
		for name, v := range files {
			hosttest.Must(t, os.WriteFile(filepath.Join(dir, name), []byte(v+"\n"), 0o644))
		}
	}
	devs, err := PCIDevices(sys)
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 2 || devs[0].SubVendor != 0x1028 || devs[0].SubDevice != 0x204b || devs[1].SubVendor != 0 || devs[1].SubDevice != 0 {
		t.Errorf("devices = %+v", devs)
	}
}

// Only NVIDIA and Mellanox devices are read past their vendor: another vendor's device with an
// unreadable class is neither listed nor an error; an NVIDIA one is an error naming the file.
func TestPCIDevicesReadsOnlyNVIDIAAndMellanox(t *testing.T) {
	t.Parallel()
	sys := t.TempDir()
	for addr, files := range map[string]map[string]string{
		"0000:00:02.0": {"vendor": "0x8086", "device": "0x1234", "class": "zz"},
		"0000:00:03.0": {"vendor": "0x1af4"},
		"0000:41:00.0": {"vendor": "0x10de", "device": "0x2330", "class": "0x030200"},
		"0000:42:00.0": {"vendor": "0x15b3", "device": "0x1021", "class": "0x020700"},
		"0000:43:00.0": {"vendor": "0x10de", "device": "0x22a3", "class": "not hex"},
		"0000:44:00.0": {"vendor": "0x10de", "device": "0x22a3", "class": "0x068000"},
	} {
		dir := filepath.Join(sys, "bus/pci/devices", addr)
		hosttest.Must(t, os.MkdirAll(dir, 0o755))
		for name, v := range files {
			hosttest.Must(t, os.WriteFile(filepath.Join(dir, name), []byte(v+"\n"), 0o644))
		}
	}
	devs, err := PCIDevices(sys)
	if err == nil || !strings.Contains(err.Error(), "0000:43:00.0/class") || strings.Contains(err.Error(), "0000:00:02.0") {
		t.Errorf("error = %v; want one naming 0000:43:00.0/class and nothing of 0000:00:02.0", err)
	}
	var got []string
	for _, d := range devs {
		got = append(got, fmt.Sprintf("%s %04x:%04x %06x sub %04x", d.Address, d.Vendor, d.Device, d.Class, d.SubVendor))
	}
	want := []string{"0000:41:00.0 10de:2330 030200 sub 0000", "0000:42:00.0 15b3:1021 020700 sub 0000", "0000:44:00.0 10de:22a3 068000 sub 0000"}
	if !slices.Equal(got, want) {
		t.Errorf("devices:\n got %q\nwant %q", got, want)
	}
}

// A driver extension made by `driver-agent sysext` makes the host own the modules, and is named;
// one made for another release, or another architecture, is refused as systemd-sysext would
// refuse it, with a warning, and does not.
func TestFlatcarDriverExtension(t *testing.T) {
	t.Parallel()
	const name = "nvidia-driver-535.261.03-flatcar4230.2.1"
	write := func(t *testing.T, dir, rel, data string) {
		t.Helper()
		p := filepath.Join(dir, "host", filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name     string
		files    map[string]string
		driver   string // part of HostDriver; "" for none
		warnings []string
	}{
		{"image waiting", map[string]string{"etc/extensions/" + name + ".raw": "squashfs"},
			"the system extension " + name + " (driver 535.261.03, /etc/extensions/" + name + ".raw, not merged yet) provides the driver", nil},
		{"merged", map[string]string{
			"etc/extensions/" + name + ".raw":                       "squashfs",
			"usr/lib/extension-release.d/extension-release." + name: "ID=flatcar\nVERSION_ID=4230.2.1\nARCHITECTURE=x86-64\n",
		}, "the system extension " + name + " (driver 535.261.03, /usr/lib/extension-release.d/extension-release." + name + ") provides the driver", nil},
		{"other release", map[string]string{"var/lib/extensions/nvidia-driver-535.261.03-flatcar4230.2.0.raw": "squashfs"}, "",
			[]string{"the driver extension /var/lib/extensions/nvidia-driver-535.261.03-flatcar4230.2.0.raw is not used: systemd-sysext refuses it: " +
				"the system extension does not fit the host: nvidia-driver-535.261.03-flatcar4230.2.0: it is for flatcar 4230.2.0, the host runs flatcar 4230.2.1; use the extension built for 4230.2.1"}},
		{"other architecture", map[string]string{"run/extensions/" + name + "/usr/lib/extension-release.d/extension-release." + name: "ID=flatcar\nVERSION_ID=4230.2.1\nARCHITECTURE=arm64\n"}, "",
			[]string{"the driver extension /run/extensions/" + name + " is not used: systemd-sysext refuses it: " +
				"the system extension does not fit the host: " + name + ": it is for architecture arm64, the host is x86-64"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := hosttest.UnpackFile(t, filepath.Join("..", "..", "test", "fixtures", "flatcar-stable-gpu.txtar"))
			for rel, data := range tc.files {
				write(t, dir, rel, data)
			}
			f, err := Detect(hosttest.Roots(t, dir))
			if err != nil {
				t.Fatal(err)
			}
			if (tc.driver == "") != (f.HostDriver == "") || !strings.Contains(f.HostDriver, tc.driver) {
				t.Errorf("host driver %q, want %q", f.HostDriver, tc.driver)
			}
			if !slices.Equal(f.Warnings, tc.warnings) {
				t.Errorf("warnings %q, want %q", f.Warnings, tc.warnings)
			}
		})
	}
}
