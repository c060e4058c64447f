package fabric

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
)

// Kind is which fabric daemons a node needs.
type Kind string

// The kinds of node.
const (
	// KindNone: no NVSwitch fabric to manage; no fabric daemon.
	KindNone Kind = "none"
	// KindNVSwitch: NVSwitches driven by the nvidia-nvswitch driver (NVLink 4 and older, e.g.
	// HGX A100/H100): nv-fabricmanager.
	KindNVSwitch Kind = "nvswitch"
	// KindNVLink5: NVSwitches managed over an InfiniBand switch-management port (NVLink 5, e.g.
	// HGX B200/B300): nvlsm, then nv-fabricmanager with that port's GUID.
	KindNVLink5 Kind = "nvlink5"
)

// isSMDisabled is the IsSMDisabled bit (10) of an InfiniBand port's capability mask: no subnet
// manager may run on such a port.
const isSMDisabled = 1 << 10

// Node is what a node's procfs and sysfs say about its NVSwitch fabric.
type Node struct {
	// Kind says which fabric daemons the node needs.
	Kind Kind
	// Reason says in words why the node is of this kind, for the log and the plan.
	Reason string
	// NVSwitches are the entries of <proc>/driver/nvidia-nvswitch/devices.
	NVSwitches []string
	// SwitchManagement are the InfiniBand devices whose VPD carries SW_MNG (the NVSwitch
	// management functions of an NVLink5 baseboard), sorted.
	SwitchManagement []string
}

// DetectNode reads the node's kind: NVLink5 when an InfiniBand device's VPD
// (<sys>/class/infiniband/*/device/vpd) carries SW_MNG, else NVSwitch when
// <proc>/driver/nvidia-nvswitch/devices is not empty, else none. Unreadable VPDs are an error
// only when no device could be classified.
func DetectNode(r host.Roots) (Node, error) { return NodeOf(detect.ReadSwitchTrays(r), r) }

// NodeOf is DetectNode for switch trays detection already read: only the NVSwitch devices in
// procfs are read, which appear once nvidia is loaded.
func NodeOf(trays detect.SwitchTrays, r host.Roots) (Node, error) {
	n := Node{SwitchManagement: trays.Management}
	if entries, err := os.ReadDir(r.InProc("driver/nvidia-nvswitch/devices")); err == nil {
		for _, e := range entries {
			n.NVSwitches = append(n.NVSwitches, e.Name())
		}
	}
	switch {
	case len(n.SwitchManagement) > 0:
		n.Kind = KindNVLink5
		n.Reason = fmt.Sprintf("NVLink5 switch management on %s (SW_MNG in its InfiniBand VPD): nvlsm and nv-fabricmanager",
			strings.Join(n.SwitchManagement, ", "))
	case len(n.NVSwitches) > 0:
		n.Kind = KindNVSwitch
		n.Reason = fmt.Sprintf("%d NVSwitch devices in %s: nv-fabricmanager", len(n.NVSwitches), r.InProc("driver/nvidia-nvswitch/devices"))
	default:
		if trays.VPDs > 0 && len(trays.Unreadable) == trays.VPDs {
			return n, fmt.Errorf("fabric detection: no InfiniBand VPD is readable: %w", errors.Join(trays.Unreadable...))
		}
		n.Kind = KindNone
		n.Reason = fmt.Sprintf("no NVSwitch in %s and no SW_MNG in %s: no fabric manager needed",
			r.InProc("driver/nvidia-nvswitch/devices"), r.InSys("class/infiniband/*/device/vpd"))
	}
	return n, nil
}

// Port is an InfiniBand port that manages the NVSwitches of an NVLink5 baseboard.
type Port struct {
	Device string // InfiniBand device, e.g. mlx5_0
	Number int    // port number
	GUID   uint64 // port GUID: the low 64 bits of GID 0
}

// GUIDString renders the GUID as nvlsm --guid and nv-fabricmanager --fm-sm-mgmt-port-guid take it.
func (p Port) GUIDString() string { return fmt.Sprintf("0x%016x", p.GUID) }

// ManagementPort picks the switch-management port among devices (DetectNode's SwitchManagement):
// the first port, by device name and then port number, that is InfiniBand, has a GUID, and whose
// capability mask does not say IsSMDisabled. The error lists why each port was skipped.
func ManagementPort(sys string, devices []string) (Port, error) {
	var skipped []string
	devs := append([]string(nil), devices...)
	sort.Strings(devs)
	for _, dev := range devs {
		dir := filepath.Join(sys, "class/infiniband", dev, "ports")
		entries, err := os.ReadDir(dir)
		if err != nil {
			skipped = append(skipped, fmt.Sprintf("%s: %v", dev, err))
			continue
		}
		var nums []int
		for _, e := range entries {
			if n, err := strconv.Atoi(e.Name()); err == nil {
				nums = append(nums, n)
			}
		}
		sort.Ints(nums)
		for _, n := range nums {
			p, why := readPort(filepath.Join(dir, strconv.Itoa(n)))
			if why != "" {
				skipped = append(skipped, fmt.Sprintf("%s port %d: %s", dev, n, why))
				continue
			}
			p.Device, p.Number = dev, n
			return p, nil
		}
		if len(nums) == 0 {
			skipped = append(skipped, dev+": no ports")
		}
	}
	if len(devs) == 0 {
		return Port{}, fmt.Errorf("%w: no switch-management InfiniBand device", exitcode.ErrDaemon)
	}
	return Port{}, fmt.Errorf("%w: no usable switch-management port: %s", exitcode.ErrDaemon, strings.Join(skipped, "; "))
}

// readPort reads one port's attributes; why says why it cannot be used.
func readPort(dir string) (Port, string) {
	if ll, err := kernel.ReadSmall(filepath.Join(dir, "link_layer")); err == nil {
		if l := strings.TrimSpace(string(ll)); l != "InfiniBand" {
			return Port{}, "link layer " + l
		}
	}
	cm, err := kernel.ReadSmall(filepath.Join(dir, "cap_mask"))
	if err != nil {
		return Port{}, "no capability mask: " + err.Error()
	}
	mask, err := strconv.ParseUint(strings.TrimPrefix(strings.TrimSpace(string(cm)), "0x"), 16, 32)
	if err != nil {
		return Port{}, fmt.Sprintf("capability mask %q is not a number", strings.TrimSpace(string(cm)))
	}
	if mask&isSMDisabled != 0 {
		return Port{}, fmt.Sprintf("subnet manager disabled (capability mask %#08x)", mask)
	}
	gid, err := kernel.ReadSmall(filepath.Join(dir, "gids/0"))
	if err != nil {
		return Port{}, "no GID 0: " + err.Error()
	}
	guid, err := ParseGUID(strings.TrimSpace(string(gid)))
	if err != nil {
		return Port{}, err.Error()
	}
	if guid == 0 {
		return Port{}, "GUID is zero"
	}
	return Port{GUID: guid}, ""
}

// ParseGUID returns the port GUID in a GID as sysfs prints it (eight groups of four hex digits,
// e.g. fe80:0000:0000:0000:b83f:d203:00c4:1a2e): its low 64 bits.
func ParseGUID(gid string) (uint64, error) {
	groups := strings.Split(gid, ":")
	if len(groups) != 8 {
		return 0, fmt.Errorf("GID %q: want 8 groups of hex digits", gid)
	}
	var guid uint64
	for _, g := range groups[4:] {
		if len(g) == 0 || len(g) > 4 {
			return 0, fmt.Errorf("GID %q: bad group %q", gid, g)
		}
		v, err := strconv.ParseUint(g, 16, 16)
		if err != nil {
			return 0, fmt.Errorf("GID %q: bad group %q", gid, g)
		}
		guid = guid<<16 | v
	}
	return guid, nil
}

// missingModules returns which of names are neither in <proc>/modules nor built in
// (<sys>/module/<name>).
func missingModules(r host.Roots, names []string) ([]string, error) {
	loaded := map[string]bool{}
	mods, err := kernel.Loaded(r.Proc)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	for _, m := range mods {
		loaded[m.Name] = true
	}
	var missing []string
	for _, n := range names {
		if loaded[n] {
			continue
		}
		if _, err := os.Stat(r.InSys("module", n)); err == nil {
			continue
		}
		missing = append(missing, n)
	}
	return missing, nil
}

// WaitModules waits until every module in names is loaded (or built in), checking every interval
// on clock (nil: the wall clock), for at most timeout. It logs what it waits for once, and again
// at most every minute. The error names the modules still missing and wraps exitcode.ErrDaemon.
func WaitModules(ctx context.Context, r host.Roots, names []string, timeout, interval time.Duration, clock daemon.Clock, log *slog.Logger) error {
	if clock == nil {
		clock = daemon.WallClock{}
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	deadline := clock.NewTimer(timeout)
	defer deadline.Stop()
	var lastLog time.Time
	for {
		missing, err := missingModules(r, names)
		if err != nil {
			return fmt.Errorf("%w: %w", exitcode.ErrDaemon, err)
		}
		if len(missing) == 0 {
			if !lastLog.IsZero() {
				log.Info("kernel modules loaded", "modules", names)
			}
			return nil
		}
		if now := clock.Now(); lastLog.IsZero() || now.Sub(lastLog) >= time.Minute {
			lastLog = now
			log.Info(fmt.Sprintf("waiting for the %s kernel modules to be loaded", strings.Join(names, " and ")),
				"missing", missing, "timeout", timeout)
		}
		t := clock.NewTimer(interval)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w: waiting for kernel modules %s: %w", exitcode.ErrDaemon, strings.Join(missing, ", "), ctx.Err())
		case <-deadline.C():
			t.Stop()
			return fmt.Errorf("%w: kernel modules %s not loaded within %s (NVLink5 needs them for nvlsm; load them on the host)",
				exitcode.ErrDaemon, strings.Join(missing, ", "), timeout)
		case <-t.C():
		}
	}
}
