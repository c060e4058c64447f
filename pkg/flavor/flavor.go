// Package flavor decides which kernel module flavour, NVIDIA's proprietary modules ("kernel") or
// the open ones ("kernel-open"), drives the node's GPUs, as nvidia-installer's
// --print-recommended-kernel-module-type does: from the GPUs' PCI IDs and the driver's
// supported-gpus.json, which lists per chip whether the open modules support it ("kernelopen")
// and whether only a legacy branch still drives it.
package flavor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// The two flavours, named by their directory in NVIDIA's package.
const (
	Proprietary = "kernel"
	Open        = "kernel-open"
)

// OpenDefaultBranch is the first branch whose installer picks the open modules when every GPU
// supports both flavours; older branches pick the proprietary ones.
const OpenDefaultBranch = 560

// ErrNoFlavor means no flavour of the driver supports every GPU on the node.
var ErrNoFlavor = errors.New("no kernel module flavour of this driver supports every GPU on the node")

// Chip is one entry of supported-gpus.json.
type Chip struct {
	DevID        uint16
	SubDevID     uint16 // with SubVendorID, set only for entries that apply to one board
	SubVendorID  uint16
	Name         string
	LegacyBranch string // set when only that legacy branch drives the chip
	KernelOpen   bool   // the open modules support it
}

// List is a driver's supported-gpus.json.
type List struct{ Chips []Chip }

// maxChips bounds what Parse accepts; NVIDIA's list has about 2000 entries.
const maxChips = 100000

// Parse reads supported-gpus.json: {"chips":[{"devid":"0x1EB8","subdevid":"0x...",
// "subvendorid":"0x...","name":"...","legacybranch":"470.xx","features":["kernelopen",...]}]}.
// Unknown fields are ignored; an entry without a valid devid is an error.
func Parse(r io.Reader) (List, error) {
	var raw struct {
		Chips *[]struct {
			DevID        string   `json:"devid"`
			SubDevID     string   `json:"subdevid"`
			SubVendorID  string   `json:"subvendorid"`
			Name         string   `json:"name"`
			LegacyBranch string   `json:"legacybranch"`
			Features     []string `json:"features"`
		} `json:"chips"`
	}
	dec := json.NewDecoder(r)
	if err := dec.Decode(&raw); err != nil {
		return List{}, fmt.Errorf("supported GPUs: %w", err)
	}
	if raw.Chips == nil {
		return List{}, errors.New(`supported GPUs: no "chips" list`)
	}
	if len(*raw.Chips) > maxChips {
		return List{}, fmt.Errorf("supported GPUs: %d chips, more than %d", len(*raw.Chips), maxChips)
	}
	var l List
	for i, c := range *raw.Chips {
		dev, err := pciID(c.DevID)
		if err != nil {
			return List{}, fmt.Errorf("supported GPUs: chip %d (%q): devid: %w", i, c.Name, err)
		}
		ch := Chip{DevID: dev, Name: c.Name, LegacyBranch: c.LegacyBranch}
		if c.SubDevID != "" || c.SubVendorID != "" {
			if ch.SubDevID, err = pciID(c.SubDevID); err != nil {
				return List{}, fmt.Errorf("supported GPUs: chip %d (%q): subdevid: %w", i, c.Name, err)
			}
			if ch.SubVendorID, err = pciID(c.SubVendorID); err != nil {
				return List{}, fmt.Errorf("supported GPUs: chip %d (%q): subvendorid: %w", i, c.Name, err)
			}
		}
		for _, f := range c.Features {
			if f == "kernelopen" {
				ch.KernelOpen = true
			}
		}
		l.Chips = append(l.Chips, ch)
	}
	return l, nil
}

func pciID(s string) (uint16, error) {
	h, ok := strings.CutPrefix(strings.ToLower(s), "0x")
	if !ok || h == "" {
		return 0, fmt.Errorf("%q is not a 0x-prefixed hexadecimal ID", s)
	}
	v, err := strconv.ParseUint(h, 16, 16)
	if err != nil {
		return 0, fmt.Errorf("%q is not a 16-bit hexadecimal ID", s)
	}
	return uint16(v), nil
}

// Lookup finds the entry for a GPU: the one for its board (device, subsystem vendor and
// subsystem device) first, then the chip's general entry, then any entry for the device.
func (l List) Lookup(dev, subVendor, subDev uint16) (Chip, bool) {
	var general, other *Chip
	for i := range l.Chips {
		c := &l.Chips[i]
		if c.DevID != dev {
			continue
		}
		switch {
		case c.SubVendorID != 0 && c.SubVendorID == subVendor && c.SubDevID == subDev:
			return *c, true
		case c.SubVendorID == 0 && c.SubDevID == 0 && general == nil:
			general = c
		case other == nil:
			other = c
		}
	}
	if general != nil {
		return *general, true
	}
	if other != nil {
		return *other, true
	}
	return Chip{}, false
}

// GPU is one of the node's NVIDIA GPUs.
type GPU struct {
	Address              string
	Device               uint16
	SubVendor, SubDevice uint16
}

func (g GPU) String() string { return fmt.Sprintf("%s [10de:%04x]", g.Address, g.Device) }

// requiresOpen reports whether the GPU works only with the open modules: the self-hosted
// (Grace) Hopper and Blackwell parts, by the PCI ID ranges nvidia-installer uses.
func requiresOpen(dev uint16) bool {
	return dev >= 0x2340 && dev <= 0x237f || // GH100 self-hosted
		dev >= 0x2940 && dev <= 0x297f || // GB100 self-hosted
		dev >= 0x31c0 && dev <= 0x31ff || // GB110 self-hosted
		dev == 0x31a1
}

// preTuringRange reports whether a GPU missing from the list is more likely to predate GSP (and
// so the open modules) than not; nvidia-installer assumes so for these IDs.
func preTuringRange(dev uint16) bool { return dev >= 0x1340 && dev < 0x1e00 }

// Choice is the decision and why.
type Choice struct {
	Flavor   string
	Reason   string
	Warnings []string // GPUs the list does not know, or that the chosen flavour cannot drive
}

// Choose implements KERNEL_MODULE_TYPE=auto for the GPUs on the node: the open modules when a
// GPU requires them, the proprietary ones when a GPU lacks open support, otherwise the branch's
// default (open from 560). It returns an error wrapping ErrNoFlavor when one GPU requires the
// open modules and another lacks them, or when a GPU is left to a legacy branch. Without GPUs
// there is nothing to decide on and the branch's default applies.
func Choose(gpus []GPU, l List, branch int) (Choice, error) {
	var c Choice
	def, rule := BranchRule(branch)
	if len(gpus) == 0 {
		c.Flavor = def
		c.Reason = fmt.Sprintf("KERNEL_MODULE_TYPE=auto and no NVIDIA GPU on the PCI bus: the branch rule, %s", rule)
		return c, nil
	}
	var needOpen, lackOpen, legacy []string
	for _, g := range gpus {
		chip, ok := l.Lookup(g.Device, g.SubVendor, g.SubDevice)
		name := g.String()
		if ok && chip.Name != "" {
			name += " " + chip.Name
		}
		switch {
		case ok && chip.LegacyBranch != "":
			legacy = append(legacy, fmt.Sprintf("%s is driven only by the %s legacy branch", name, chip.LegacyBranch))
		case requiresOpen(g.Device):
			needOpen = append(needOpen, name)
		case ok && !chip.KernelOpen:
			lackOpen = append(lackOpen, name)
		case !ok && preTuringRange(g.Device):
			c.Warnings = append(c.Warnings, fmt.Sprintf("%s is not in the driver's list of supported GPUs; its PCI ID is in the pre-Turing range, so it is taken to lack open-module support", name))
			lackOpen = append(lackOpen, name)
		case !ok:
			c.Warnings = append(c.Warnings, fmt.Sprintf("%s is not in the driver's list of supported GPUs; it is taken to support the open modules, as nvidia-installer does", name))
		}
	}
	switch {
	case len(legacy) > 0:
		return c, fmt.Errorf("%w: %s; use a driver image of that branch", ErrNoFlavor, strings.Join(legacy, "; "))
	case len(needOpen) > 0 && len(lackOpen) > 0:
		return c, fmt.Errorf("%w: the open modules are required by %s and not supported by %s; run these GPUs on separate nodes",
			ErrNoFlavor, strings.Join(needOpen, ", "), strings.Join(lackOpen, ", "))
	case len(needOpen) > 0:
		c.Flavor = Open
		c.Reason = fmt.Sprintf("KERNEL_MODULE_TYPE=auto: the open modules are required by %s", strings.Join(needOpen, ", "))
	case len(lackOpen) > 0:
		c.Flavor = Proprietary
		c.Reason = fmt.Sprintf("KERNEL_MODULE_TYPE=auto: the open modules do not support %s (no kernelopen in supported-gpus.json)", strings.Join(lackOpen, ", "))
	default:
		c.Flavor = def
		c.Reason = fmt.Sprintf("KERNEL_MODULE_TYPE=auto: all %d GPU(s) support both flavours, and branch %d defaults to %s", len(gpus), branch, describe(def))
	}
	return c, nil
}

// Check says what is wrong with a flavour the user chose for these GPUs; it never overrides the
// choice.
func Check(flavor string, gpus []GPU, l List) []string {
	var warns []string
	for _, g := range gpus {
		chip, ok := l.Lookup(g.Device, g.SubVendor, g.SubDevice)
		switch {
		case ok && chip.LegacyBranch != "":
			warns = append(warns, fmt.Sprintf("%s %s is driven only by the %s legacy branch, not by this driver", g, chip.Name, chip.LegacyBranch))
		case flavor == Open && ok && !chip.KernelOpen && !requiresOpen(g.Device):
			warns = append(warns, fmt.Sprintf("%s %s does not support the open modules (KERNEL_MODULE_TYPE=open); nvidia will not drive it", g, chip.Name))
		case flavor == Proprietary && requiresOpen(g.Device):
			warns = append(warns, fmt.Sprintf("%s requires the open modules (KERNEL_MODULE_TYPE=proprietary); nvidia will not drive it", g))
		}
	}
	return warns
}

// BranchRule is the flavour chosen without GPU information, and why.
func BranchRule(branch int) (string, string) {
	if branch >= OpenDefaultBranch {
		return Open, fmt.Sprintf("branch %d >= %d defaults to open modules", branch, OpenDefaultBranch)
	}
	return Proprietary, fmt.Sprintf("branch %d < %d defaults to proprietary modules", branch, OpenDefaultBranch)
}

func describe(f string) string {
	if f == Open {
		return "the open modules"
	}
	return "the proprietary modules"
}
