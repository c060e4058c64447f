// Package detect gathers the read-only facts the agent decides on: the running kernel, the host
// operating system (and, on Flatcar, its version, board and channel), NVIDIA GPUs, NVSwitches,
// Mellanox devices, NVLink5 switch trays, and the kernel modules already loaded.
package detect

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/osrelease"
	"github.com/driver-agent/driver-agent/pkg/sysext"
)

// PCI vendor IDs.
const (
	VendorNVIDIA   = 0x10de
	VendorMellanox = 0x15b3
)

// Facts is everything detection found.
type Facts struct {
	KernelRelease string            `json:"kernelRelease"`
	Banner        string            `json:"banner"`
	OS            OS                `json:"os"`
	Flatcar       *Flatcar          `json:"flatcar,omitempty"`
	GPUs          []PCIDevice       `json:"gpus"`
	NVSwitches    []PCIDevice       `json:"nvswitches"`
	Mellanox      []PCIDevice       `json:"mellanox"`
	NVLink5       bool              `json:"nvlink5"`
	SwitchTrays   SwitchTrays       `json:"-"`                    // what NVLink5 was decided on
	NVSwitchProc  int               `json:"nvswitchProcDevices"`  // entries in <proc>/driver/nvidia-nvswitch/devices
	Modules       map[string]Loaded `json:"modules"`              // loaded modules by kernel name
	HostDriver    string            `json:"hostDriver,omitempty"` // why the host manages the driver modules, if it does
	Warnings      []string          `json:"warnings,omitempty"`
}

// OS identifies the host operating system.
type OS struct {
	ID          string `json:"id"`
	VersionID   string `json:"versionID"`
	SysextLevel string `json:"sysextLevel,omitempty"` // SYSEXT_LEVEL, which systemd-sysext compares
	PrettyName  string `json:"prettyName,omitempty"`
	Source      string `json:"source"` // the file it was read from
}

// Flatcar is what a Flatcar host says about its release.
type Flatcar struct {
	Version       string `json:"version"`
	Board         string `json:"board"`
	Channel       string `json:"channel"`
	ChannelSource string `json:"channelSource"` // the update.conf it came from, or "version"
}

// PCIDevice is one PCI function from sysfs.
type PCIDevice struct {
	Address string `json:"address"`
	Vendor  uint16 `json:"vendor"`
	Device  uint16 `json:"device"`
	Class   uint32 `json:"class"`
	// SubVendor and SubDevice identify the board (0 when sysfs does not say); NVIDIA's list of
	// supported GPUs has entries for single boards.
	SubVendor uint16 `json:"subsystemVendor,omitempty"`
	SubDevice uint16 `json:"subsystemDevice,omitempty"`
}

// Loaded is a loaded kernel module.
type Loaded struct {
	Version string   `json:"version,omitempty"`
	RefCnt  int      `json:"refcnt"`
	UsedBy  []string `json:"usedBy,omitempty"`
}

// IsGPU reports whether d is an NVIDIA display controller (VGA 0x0300 or 3D 0x0302).
func (d PCIDevice) IsGPU() bool {
	return d.Vendor == VendorNVIDIA && (d.Class>>8 == 0x0300 || d.Class>>8 == 0x0302)
}

// IsNVSwitch reports whether d is an NVIDIA NVSwitch (bridge, "other" subclass 0x0680).
func (d PCIDevice) IsNVSwitch() bool { return d.Vendor == VendorNVIDIA && d.Class>>8 == 0x0680 }

// Detect reads the facts under r. Only a missing kernel identity is an error; everything else
// that cannot be read becomes a warning, because a dry run on an odd machine must still work.
func Detect(r host.Roots) (Facts, error) {
	var f Facts
	var err error
	if f.KernelRelease, err = kernel.Release(r.Proc); err != nil {
		return f, err
	}
	if f.Banner, err = kernel.Banner(r.Proc); err != nil {
		return f, err
	}
	warn := func(format string, args ...any) { f.Warnings = append(f.Warnings, fmt.Sprintf(format, args...)) }

	if f.OS, err = readOS(r); err != nil {
		warn("host OS unknown: %v", err)
	}
	if f.OS.ID == "flatcar" {
		f.Flatcar = readFlatcar(r, f.OS)
	}
	devs, err := PCIDevices(r.Sys)
	if err != nil {
		warn("PCI devices unreadable: %v", err)
	}
	for _, d := range devs {
		switch {
		case d.IsGPU():
			f.GPUs = append(f.GPUs, d)
		case d.IsNVSwitch():
			f.NVSwitches = append(f.NVSwitches, d)
		case d.Vendor == VendorMellanox:
			f.Mellanox = append(f.Mellanox, d)
		}
	}
	f.SwitchTrays = ReadSwitchTrays(r)
	f.NVLink5 = len(f.SwitchTrays.Management) > 0
	if err := errors.Join(f.SwitchTrays.Unreadable...); err != nil && !f.NVLink5 {
		warn("infiniband VPD unreadable: %v", err)
	}
	if entries, err := os.ReadDir(r.InProc("driver/nvidia-nvswitch/devices")); err == nil {
		f.NVSwitchProc = len(entries)
	}
	f.Modules = map[string]Loaded{}
	mods, err := kernel.Loaded(r.Proc)
	if err != nil {
		warn("loaded modules unknown: %v", err)
	}
	for _, m := range mods {
		l := Loaded{RefCnt: m.RefCnt, UsedBy: m.UsedBy}
		if sm, err := kernel.ReadSysModule(r.Sys, m.Name); err == nil {
			l.Version = sm.Version
		}
		f.Modules[m.Name] = l
	}
	f.HostDriver = hostManaged(r, f.OS, f.Flatcar, warn)
	return f, nil
}

func readOS(r host.Roots) (OS, error) {
	var errs []error
	for _, p := range []string{r.InRoot("host-etc/os-release"), r.InHost("etc/os-release"), r.InHost("usr/lib/os-release")} {
		vars, err := readVars(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		return OS{ID: vars["ID"], VersionID: vars["VERSION_ID"], SysextLevel: vars["SYSEXT_LEVEL"], PrettyName: vars["PRETTY_NAME"], Source: p}, nil
	}
	return OS{ID: "unknown"}, errors.Join(errs...)
}

func readVars(path string) (map[string]string, error) {
	data, err := kernel.ReadSmall(path)
	if err != nil {
		return nil, err
	}
	vars, err := osrelease.Parse(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return vars, nil
}

func readFlatcar(r host.Roots, o OS) *Flatcar {
	fc := &Flatcar{Version: o.VersionID}
	if vars, err := readVars(o.Source); err == nil {
		fc.Board = vars["FLATCAR_BOARD"]
	}
	if fc.Board == "" {
		if vars, err := readVars(r.InHost("usr/share/flatcar/release")); err == nil {
			fc.Board = vars["FLATCAR_RELEASE_BOARD"]
		}
	}
	if fc.Board == "" {
		fc.Board = runtime.GOARCH + "-usr"
	}
	for _, p := range []string{r.InHost("etc/flatcar/update.conf"), r.InHost("usr/share/flatcar/update.conf")} {
		if vars, err := readVars(p); err == nil && vars["GROUP"] != "" {
			fc.Channel, fc.ChannelSource = strings.ToLower(vars["GROUP"]), p
			return fc
		}
	}
	fc.Channel, fc.ChannelSource = ChannelFromVersion(fc.Version), "version"
	return fc
}

// ChannelFromVersion maps a Flatcar version's minor number to its channel: 0 alpha, 1 beta,
// 2 stable, 3 lts. It returns "" when the version does not say.
func ChannelFromVersion(v string) string {
	parts := strings.Split(v, ".")
	if len(parts) < 2 {
		return ""
	}
	switch parts[1] {
	case "0":
		return "alpha"
	case "1":
		return "beta"
	case "2":
		return "stable"
	case "3":
		return "lts"
	}
	return ""
}

// PCIDevices lists the NVIDIA and Mellanox devices of <sys>/bus/pci/devices, sorted by address.
// Each device's vendor is read first and the other attributes only for those two vendors: a node
// can have hundreds of PCI devices, and reading five attributes of each was most of detection's
// time in the bench's guest.
func PCIDevices(sys string) ([]PCIDevice, error) {
	dir := filepath.Join(sys, "bus/pci/devices")
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var devs []PCIDevice
	var errs []error
	for _, e := range entries {
		attr := func(name string) string { return filepath.Join(dir, e.Name(), name) }
		vendor, err := readHex(attr("vendor"), 16)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if vendor != VendorNVIDIA && vendor != VendorMellanox {
			continue
		}
		d := PCIDevice{Address: e.Name(), Vendor: uint16(vendor)}
		device, err1 := readHex(attr("device"), 16)
		class, err2 := readHex(attr("class"), 24)
		if err := errors.Join(err1, err2); err != nil {
			errs = append(errs, err)
			continue
		}
		d.Device, d.Class = uint16(device), uint32(class)
		if sv, err := readHex(attr("subsystem_vendor"), 16); err == nil {
			d.SubVendor = uint16(sv)
		}
		if sd, err := readHex(attr("subsystem_device"), 16); err == nil {
			d.SubDevice = uint16(sd)
		}
		devs = append(devs, d)
	}
	sort.Slice(devs, func(i, j int) bool { return devs[i].Address < devs[j].Address })
	return devs, errors.Join(errs...)
}

func readHex(path string, bits int) (uint64, error) {
	data, err := kernel.ReadAttr(path)
	if err != nil {
		return 0, err
	}
	s := strings.TrimPrefix(strings.TrimSpace(string(data)), "0x")
	v, err := strconv.ParseUint(s, 16, bits)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	return v, nil
}

// SwitchTrays is what the InfiniBand devices' VPDs say about NVLink5 switch trays.
type SwitchTrays struct {
	// Management are the InfiniBand devices whose VPD (<sys>/class/infiniband/*/device/vpd)
	// carries SW_MNG, sorted: the NVSwitch management functions of an NVLink5 baseboard.
	Management []string
	// VPDs is how many VPDs there are; Unreadable are the errors of those that could not be read.
	VPDs       int
	Unreadable []error
}

// ReadSwitchTrays reads every InfiniBand device's VPD for SW_MNG: the one NVLink5 detection.
func ReadSwitchTrays(r host.Roots) SwitchTrays {
	vpds, _ := filepath.Glob(r.InSys("class/infiniband/*/device/vpd"))
	sort.Strings(vpds)
	t := SwitchTrays{VPDs: len(vpds)}
	for _, p := range vpds {
		data, err := kernel.ReadSmall(p)
		if err != nil {
			t.Unreadable = append(t.Unreadable, err)
			continue
		}
		if bytes.Contains(data, []byte("SW_MNG")) {
			t.Management = append(t.Management, filepath.Base(filepath.Dir(filepath.Dir(p))))
		}
	}
	return t
}

// hostManaged says why the host, not the agent, owns the NVIDIA modules, or "" when it does not:
// Talos; on Flatcar, a driver extension made by `driver-agent sysext` or Flatcar's own NVIDIA
// driver extension, merged or waiting in /etc/extensions (and the like), or enabled in
// /etc/flatcar/enabled-sysext.conf. A driver extension that systemd-sysext refuses on this host
// (made for another release) is warned about and does not count.
func hostManaged(r host.Roots, o OS, fc *Flatcar, warn func(string, ...any)) string {
	if o.ID == "talos" {
		return "Talos loads kernel modules only from system extensions"
	}
	if o.ID != "flatcar" {
		return ""
	}
	h := sysext.Host{ID: o.ID, VersionID: o.VersionID, SysextLevel: o.SysextLevel}
	if fc != nil {
		h.Architecture, _ = sysext.Architecture(fc.Board)
	}
	found, err := sysext.Find(r.HostRoot, h)
	if err != nil {
		warn("system extensions: %v", err)
	}
	var waiting string
	for _, e := range found {
		switch {
		case e.Refused != nil:
			warn("the driver extension %s is not used: systemd-sysext refuses it: %v", e.Where, e.Refused)
		case e.Merged:
			return fmt.Sprintf("the system extension %s (driver %s, %s) provides the driver", e.Name, e.DriverVersion, e.Where)
		case waiting == "":
			waiting = fmt.Sprintf("the system extension %s (driver %s, %s, not merged yet) provides the driver", e.Name, e.DriverVersion, e.Where)
		}
	}
	if m, _ := filepath.Glob(r.InHost("usr/lib/extension-release.d/extension-release.nvidia-drivers*")); len(m) > 0 {
		return "the Flatcar NVIDIA driver sysext " + strings.TrimPrefix(filepath.Base(m[0]), "extension-release.") + " is merged"
	}
	if waiting != "" {
		return waiting
	}
	if data, err := kernel.ReadSmall(r.InHost("etc/flatcar/enabled-sysext.conf")); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if name := strings.TrimSpace(line); strings.HasPrefix(name, "nvidia-drivers") {
				return "the Flatcar NVIDIA driver sysext " + name + " is enabled in /etc/flatcar/enabled-sysext.conf"
			}
		}
	}
	return ""
}
