package fabric

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// Daemon names, as the supervisor, the log and the metrics call them.
const (
	FabricManagerName = "nv-fabricmanager"
	NVLSMName         = "nvlsm"
)

// Paths are where the fabric programs and files are, relative to the container root.
type Paths struct {
	FabricManager string // nv-fabricmanager
	FMConfig      string // fabric manager's configuration, as shipped (only read)
	FMRunDir      string // fabric manager's runtime directory
	NVLSM         string // nvlsm; empty: the first of the usual places that exists
	NVLSMConfig   string // nvlsm's configuration
	NVLSMPIDFile  string // where nvlsm writes its PID
}

// DefaultPaths are the paths of NVIDIA's packages.
func DefaultPaths() Paths {
	return Paths{
		FabricManager: "usr/bin/nv-fabricmanager",
		FMConfig:      "usr/share/nvidia/nvswitch/fabricmanager.cfg",
		FMRunDir:      "var/run/nvidia-fabricmanager",
		NVLSMConfig:   "usr/share/nvidia/nvlsm/nvlsm.conf",
		NVLSMPIDFile:  "var/run/nvidia-fabricmanager/nvlsm.pid",
	}
}

// nvlsmCandidates are where NVIDIA's packages put nvlsm.
func nvlsmCandidates() []string {
	return []string{"opt/nvidia/nvlsm/sbin/nvlsm", "usr/sbin/nvlsm", "usr/bin/nvlsm"}
}

// defaultSMSocket is FM_SM_IPC_INTERFACE's default: the Unix socket nvlsm opens for fabric manager.
const defaultSMSocket = "/var/run/nvidia-fabricmanager/fm_sm_ipc.socket"

// Options are what Prepare needs.
type Options struct {
	// Roots locate the container root (programs, configuration), procfs and sysfs.
	Roots host.Roots
	// Files writes the private fabricmanager.cfg (a recorder in a dry run).
	Files host.Files
	// Log receives what was detected and decided. Nil discards it.
	Log *slog.Logger
	// SwitchTrays is what detection found in the InfiniBand VPDs (detect.Facts.SwitchTrays); nil
	// means read them now.
	SwitchTrays *detect.SwitchTrays
	// Clock times the wait for kernel modules. Nil means the wall clock.
	Clock daemon.Clock
	// Overrides are the NVFM_CONFIG_<KEY>=<value> settings, as KEY -> value.
	Overrides map[string]string
	// ConfigCopy is where the edited fabricmanager.cfg is written (as the agent sees it); the
	// shipped one is never changed. Required when the node needs fabric manager.
	ConfigCopy string
	// Paths locate the programs; empty fields take DefaultPaths.
	Paths Paths
	// PrereqTimeout bounds the wait for mlx5_core and ib_umad on NVLink5 nodes. Zero means 5m.
	PrereqTimeout time.Duration
	// PrereqInterval is how often they are checked. Zero means 5s.
	PrereqInterval time.Duration
	// NoWait checks the NVLink5 prerequisites once instead of waiting (dry runs): missing ones are
	// then warnings in the plan.
	NoWait bool
	// StopTimeout is the daemons' time between SIGTERM and SIGKILL. Zero means the daemon default.
	StopTimeout time.Duration
	// SettleTime is how long nv-fabricmanager must run before it counts as up. Zero means 3s;
	// negative means at once.
	SettleTime time.Duration
	// SocketTimeout bounds the wait for nvlsm's socket for fabric manager. Zero means 60s.
	SocketTimeout time.Duration
}

func (o Options) withDefaults() Options {
	d := DefaultPaths()
	for _, f := range []struct{ p, def *string }{
		{&o.Paths.FabricManager, &d.FabricManager}, {&o.Paths.FMConfig, &d.FMConfig}, {&o.Paths.FMRunDir, &d.FMRunDir},
		{&o.Paths.NVLSMConfig, &d.NVLSMConfig}, {&o.Paths.NVLSMPIDFile, &d.NVLSMPIDFile},
	} {
		if *f.p == "" {
			*f.p = *f.def
		}
	}
	if o.Paths.NVLSM == "" {
		o.Paths.NVLSM = nvlsmCandidates()[0]
		for _, c := range nvlsmCandidates() {
			if _, err := os.Stat(o.Roots.InRoot(c)); err == nil {
				o.Paths.NVLSM = c
				break
			}
		}
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.PrereqTimeout <= 0 {
		o.PrereqTimeout = 5 * time.Minute
	}
	if o.PrereqInterval <= 0 {
		o.PrereqInterval = 5 * time.Second
	}
	switch {
	case o.SettleTime == 0:
		o.SettleTime = 3 * time.Second
	case o.SettleTime < 0:
		o.SettleTime = 0
	}
	if o.SocketTimeout <= 0 {
		o.SocketTimeout = time.Minute
	}
	return o
}

// Plan is what a node needs for its NVSwitch fabric.
type Plan struct {
	// Node is what detection found.
	Node Node
	// Port is the NVLink5 switch-management port (nil on other nodes).
	Port *Port
	// ConfigPath is the edited fabricmanager.cfg the daemons use ("" when none).
	ConfigPath string
	// ResetGPUs says FABRIC_MODE=1 (shared NVSwitch): NVIDIA's script resets the GPUs
	// (nvidia-smi -r) after fabric manager starts, to clear stale partitions.
	ResetGPUs bool
	// Daemons are the specs to start, in order (nvlsm before nv-fabricmanager); none when the
	// node needs no fabric manager (Node.Reason says why).
	Daemons []daemon.Spec
	// Warnings are what the log got as warnings (overrides appended or ignored, missing files).
	Warnings []string
}

// Prepare finds out what the node needs and gets it ready: on an NVLink5 node it waits (bounded)
// for mlx5_core and ib_umad and finds the switch-management port; on NVLink5 and NVSwitch nodes
// it writes the private fabricmanager.cfg. It returns the daemons to start. Errors wrap
// exitcode.ErrDaemon (or exitcode.ErrConfig for bad overrides).
func Prepare(ctx context.Context, o Options) (Plan, error) {
	o = o.withDefaults()
	log := o.Log
	var node Node
	var err error
	if o.SwitchTrays != nil {
		node, err = NodeOf(*o.SwitchTrays, o.Roots)
	} else {
		node, err = DetectNode(o.Roots)
	}
	if err != nil {
		return Plan{}, err
	}
	plan := Plan{Node: node}
	warn := func(msg string) {
		plan.Warnings = append(plan.Warnings, msg)
		log.Warn(msg)
	}
	switch node.Kind {
	case KindNone:
		log.Info("fabric manager is not needed", "reason", node.Reason)
		return plan, nil
	case KindNVSwitch:
		log.Info("Detected NVSwitch system", "nvswitches", len(node.NVSwitches), "reason", node.Reason)
	case KindNVLink5:
		log.Info("Detected NVLink5+ system", "devices", node.SwitchManagement, "reason", node.Reason)
		mods := []string{"mlx5_core", "ib_umad"}
		if o.NoWait {
			missing, err := missingModules(o.Roots, mods)
			if err != nil {
				return plan, err
			}
			if len(missing) > 0 {
				warn(fmt.Sprintf("kernel modules %s are not loaded; init would wait up to %s for them", strings.Join(missing, ", "), o.PrereqTimeout))
			}
		} else if err := WaitModules(ctx, o.Roots, mods, o.PrereqTimeout, o.PrereqInterval, o.Clock, log); err != nil {
			return plan, err
		}
		port, err := ManagementPort(o.Roots.Sys, node.SwitchManagement)
		if err != nil {
			return plan, err
		}
		plan.Port = &port
		log.Info("NVSwitch management port", "device", port.Device, "port", port.Number, "guid", port.GUIDString())
	}
	if err := ValidateOverrides(o.Overrides); err != nil {
		return plan, err
	}
	if o.ConfigCopy == "" {
		return plan, errors.New("fabric manager: no path for the private fabricmanager.cfg")
	}
	ed, err := WriteConfig(o.Files, o.Roots.InRoot(o.Paths.FMConfig), o.ConfigCopy, o.Overrides)
	if err != nil {
		return plan, err
	}
	for _, w := range ed.Warnings {
		warn(w)
	}
	plan.ConfigPath = o.ConfigCopy
	if mode, _ := ed.Config.Get("FABRIC_MODE"); mode == "1" {
		plan.ResetGPUs = true
	}
	runDir := o.Roots.InRoot(o.Paths.FMRunDir)
	mkRunDir := func() error { return o.Files.MkdirAll(runDir, 0o755) }

	fmArgs := []string{"-c", o.ConfigCopy}
	if plan.Port != nil {
		guid := plan.Port.GUIDString()
		socket := smSocket(o.Roots, ed.Config)
		nvlsm := daemon.Spec{
			Name: NVLSMName,
			Cmd: host.Cmd{Path: o.Roots.InRoot(o.Paths.NVLSM), Args: []string{
				"--config", o.Roots.InRoot(o.Paths.NVLSMConfig), "--guid", guid,
				"--pid_file", o.Roots.InRoot(o.Paths.NVLSMPIDFile), "--log_file", "stdout",
			}},
			Required:     true,
			StopTimeout:  o.StopTimeout,
			StartTimeout: o.SocketTimeout,
		}
		pidDir := filepath.Dir(o.Roots.InRoot(o.Paths.NVLSMPIDFile))
		nvlsm.Prepare = func() error {
			for _, dir := range []string{runDir, pidDir} {
				if err := o.Files.MkdirAll(dir, 0o755); err != nil {
					return err
				}
			}
			if socket == "" {
				return nil
			}
			// A socket left by an earlier nvlsm would pass the readiness check at once.
			if err := o.Files.MkdirAll(filepath.Dir(socket), 0o755); err != nil {
				return err
			}
			return o.Files.Remove(socket)
		}
		if socket != "" {
			nvlsm.Ready = socketReady(socket)
		} else {
			nvlsm.UpAfter = o.SettleTime
		}
		plan.Daemons = append(plan.Daemons, nvlsm)
		fmArgs = append(fmArgs, "--fm-sm-mgmt-port-guid", guid)
	}
	plan.Daemons = append(plan.Daemons, daemon.Spec{
		Name:        FabricManagerName,
		Cmd:         host.Cmd{Path: o.Roots.InRoot(o.Paths.FabricManager), Args: fmArgs},
		Required:    true,
		Prepare:     mkRunDir,
		UpAfter:     o.SettleTime,
		StopTimeout: o.StopTimeout,
	})
	for _, d := range plan.Daemons {
		log.Info("fabric daemon planned", "daemon", d.Name, "command", d.CommandLine())
	}
	return plan, nil
}

// smSocket is the Unix socket where nvlsm serves fabric manager, from FM_SM_IPC_INTERFACE, under
// the container root; "" when the interface is a TCP address.
func smSocket(r host.Roots, c *Config) string {
	v, _ := c.Get("FM_SM_IPC_INTERFACE")
	v = strings.TrimPrefix(v, "unix:")
	if v == "" {
		v = defaultSMSocket
	}
	if !strings.HasPrefix(v, "/") {
		return ""
	}
	return r.InRoot(filepath.Clean(v))
}

// socketReady is nvlsm's readiness: its socket for fabric manager exists.
func socketReady(path string) func(context.Context) error {
	return func(context.Context) error {
		fi, err := os.Stat(path)
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("no socket %s yet", path)
		}
		if err != nil {
			return err
		}
		if fi.Mode().Type() != fs.ModeSocket {
			return fmt.Errorf("%s is not a socket", path)
		}
		return nil
	}
}
