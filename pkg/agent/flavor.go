package agent

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/flavor"
	"github.com/driver-agent/driver-agent/pkg/kernel"
)

// supportedGPUsPaths are where the image keeps the driver's supported-gpus.json: beside the
// kernel sources (Dockerfile.build copies it there from the .run), or where nvidia-installer puts
// the driver's documentation.
func (r *run) supportedGPUsPaths() []string {
	return []string{
		r.Host.InRoot("usr/src", "nvidia-"+r.Config.DriverVersion, "supported-gpus/supported-gpus.json"),
		r.Host.InRoot("usr/share/doc/NVIDIA_GLX-1.0/supported-gpus/supported-gpus.json"),
	}
}

// chooseFlavor decides the kernel module flavour. KERNEL_MODULE_TYPE=open or proprietary is
// taken as given (with a warning for GPUs it cannot drive); auto decides from the node's GPUs
// and the driver's supported-gpus.json, and from the branch when there are no GPUs or no list.
func (r *run) chooseFlavor() (string, string, error) {
	var gpus []flavor.GPU
	for _, g := range r.facts.GPUs {
		gpus = append(gpus, flavor.GPU{Address: g.Address, Device: g.Device, SubVendor: g.SubVendor, SubDevice: g.SubDevice})
	}
	warn := func(msg string) {
		r.Log.Warn(msg)
		r.notes = append(r.notes, "flavour: "+msg)
	}
	switch r.Config.KernelModuleType {
	case "open", "proprietary":
		f := flavor.Open
		if r.Config.KernelModuleType == "proprietary" {
			f = flavor.Proprietary
		}
		if list, _, err := r.supportedGPUs(); err == nil {
			for _, w := range flavor.Check(f, gpus, list) {
				warn(w)
			}
		}
		return f, "KERNEL_MODULE_TYPE=" + r.Config.KernelModuleType, nil
	}
	if r.Config.DriverBranch == 0 { // a dry run without DRIVER_VERSION
		return flavor.Proprietary, "KERNEL_MODULE_TYPE=auto without a driver version: proprietary assumed", nil
	}
	if len(gpus) == 0 {
		c, err := flavor.Choose(nil, flavor.List{}, r.Config.DriverBranch)
		return c.Flavor, c.Reason, err
	}
	list, path, err := r.supportedGPUs()
	if errors.Is(err, fs.ErrNotExist) {
		f, why := flavor.BranchRule(r.Config.DriverBranch)
		warn(fmt.Sprintf("the image has no supported-gpus.json (looked for %s); choosing the flavour by the branch, not by the GPUs", path))
		return f, "KERNEL_MODULE_TYPE=auto without the driver's list of supported GPUs: " + why, nil
	}
	if err != nil {
		return "", "", fmt.Errorf("%s: %w; set KERNEL_MODULE_TYPE=open or proprietary to choose without it", path, err)
	}
	c, err := flavor.Choose(gpus, list, r.Config.DriverBranch)
	for _, w := range c.Warnings {
		warn(w)
	}
	if err != nil {
		return "", "", fmt.Errorf("%w: driver %s: %w", exitcode.ErrNoGPU, r.Config.DriverVersion, err)
	}
	return c.Flavor, c.Reason + " (" + path + ")", nil
}

// supportedGPUs reads the first supported-gpus.json there is; its error wraps fs.ErrNotExist,
// naming the first path, when there is none.
func (r *run) supportedGPUs() (flavor.List, string, error) {
	paths := r.supportedGPUsPaths()
	for _, p := range paths {
		data, err := kernel.ReadLimit(p, 64<<20)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return flavor.List{}, p, err
		}
		l, err := flavor.Parse(bytes.NewReader(data))
		return l, p, err
	}
	return flavor.List{}, paths[0], fs.ErrNotExist
}
