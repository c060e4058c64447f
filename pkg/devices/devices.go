// Package devices works out and creates the NVIDIA device nodes (/dev/nvidiactl, /dev/nvidia<N>,
// /dev/nvidia-modeset, /dev/nvidia-uvm, /dev/nvidia-uvm-tools) from /proc/devices and
// /proc/driver/nvidia, through host.Mknoder, and removes only the nodes it created.
package devices

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
)

// NVIDIA's fixed character major and the control minors.
const (
	NVIDIAMajor   = 195
	ctlMinor      = 255
	modesetMinor  = 254
	nodePerm      = 0o666
	maxGPUMinor   = 253
	uvmDeviceName = "nvidia-uvm"
)

// Node is a character device node to create.
type Node struct {
	Path  string      `json:"path"`
	Major uint32      `json:"major"`
	Minor uint32      `json:"minor"`
	Mode  os.FileMode `json:"mode"` // permission bits; 0 means 0666
}

func (n Node) perm() os.FileMode {
	if n.Mode == 0 {
		return nodePerm
	}
	return n.Mode.Perm()
}

// ParseProcDevices returns the character device majors by name from /proc/devices.
func ParseProcDevices(r io.Reader) (map[string]uint32, error) {
	majors := map[string]uint32{}
	sc := bufio.NewScanner(r)
	inChar := false
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "":
			continue
		case strings.HasSuffix(line, ":"):
			inChar = line == "Character devices:"
			continue
		case !inChar:
			continue
		}
		f := strings.Fields(line)
		if len(f) != 2 {
			return nil, fmt.Errorf("proc devices line %d: want \"<major> <name>\": %q", n, line)
		}
		major, err := strconv.ParseUint(f[0], 10, 12)
		if err != nil {
			return nil, fmt.Errorf("proc devices line %d: bad major %q", n, f[0])
		}
		majors[f[1]] = uint32(major)
	}
	return majors, sc.Err()
}

// GPUMinors reads "Device Minor:" from <proc>/driver/nvidia/gpus/*/information.
func GPUMinors(proc string) ([]uint32, error) {
	infos, _ := filepath.Glob(filepath.Join(proc, "driver/nvidia/gpus/*/information"))
	var minors []uint32
	for _, p := range infos {
		data, err := kernel.ReadSmall(p)
		if err != nil {
			return nil, err
		}
		m, err := parseMinor(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		minors = append(minors, m)
	}
	sort.Slice(minors, func(i, j int) bool { return minors[i] < minors[j] })
	return minors, nil
}

func parseMinor(data []byte) (uint32, error) {
	for _, line := range bytes.Split(data, []byte("\n")) {
		k, v, ok := bytes.Cut(line, []byte(":"))
		if !ok || strings.TrimSpace(string(k)) != "Device Minor" {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSpace(string(v)), 10, 32)
		if err != nil || n > maxGPUMinor {
			return 0, fmt.Errorf("bad device minor %q", strings.TrimSpace(string(v)))
		}
		return uint32(n), nil
	}
	return 0, errors.New("no \"Device Minor\" line")
}

// Plan lists the nodes the loaded driver needs under r.Dev, from the majors and GPUs in r.Proc.
func Plan(r host.Roots, modeset bool) ([]Node, error) {
	proc, dev := r.Proc, r.Dev
	data, err := kernel.ReadSmall(filepath.Join(proc, "devices"))
	if err != nil {
		return nil, fmt.Errorf("device nodes: %w", err)
	}
	majors, err := ParseProcDevices(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("device nodes: %w", err)
	}
	minors, err := GPUMinors(proc)
	if err != nil {
		return nil, fmt.Errorf("device nodes: %w", err)
	}
	nodes := []Node{{Path: filepath.Join(dev, "nvidiactl"), Major: NVIDIAMajor, Minor: ctlMinor}}
	for _, m := range minors {
		nodes = append(nodes, Node{Path: filepath.Join(dev, "nvidia"+strconv.Itoa(int(m))), Major: NVIDIAMajor, Minor: m})
	}
	if modeset {
		nodes = append(nodes, Node{Path: filepath.Join(dev, "nvidia-modeset"), Major: NVIDIAMajor, Minor: modesetMinor})
	}
	if uvm, ok := majors[uvmDeviceName]; ok {
		nodes = append(nodes,
			Node{Path: filepath.Join(dev, "nvidia-uvm"), Major: uvm, Minor: 0},
			Node{Path: filepath.Join(dev, "nvidia-uvm-tools"), Major: uvm, Minor: 1})
	}
	if capsMajor, ok := majors["nvidia-caps"]; ok {
		caps, err := Capabilities(filepath.Join(proc, "driver/nvidia/capabilities"))
		if err != nil {
			return nil, fmt.Errorf("device nodes: %w", err)
		}
		for _, c := range caps {
			nodes = append(nodes, Node{Path: filepath.Join(dev, "nvidia-caps", "nvidia-cap"+strconv.Itoa(int(c.Minor))), Major: capsMajor, Minor: c.Minor, Mode: c.Mode})
		}
	}
	return nodes, nil
}

// Capability is one NVIDIA capability file (MIG config, monitor, per-instance access).
type Capability struct {
	File  string
	Minor uint32
	Mode  os.FileMode
}

// Capabilities reads every file under dir (/proc/driver/nvidia/capabilities) for its
// "DeviceFileMinor" and "DeviceFileMode" lines.
func Capabilities(dir string) ([]Capability, error) {
	var caps []Capability
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil || d.IsDir() {
			return err
		}
		data, err := kernel.ReadSmall(p)
		if err != nil {
			return err
		}
		c, err := ParseCapability(data)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		c.File = p
		caps = append(caps, c)
		return nil
	})
	return caps, err
}

// ParseCapability reads a capability file's minor and mode (the mode is decimal, as the driver
// prints it).
func ParseCapability(data []byte) (Capability, error) {
	var c Capability
	var haveMinor, haveMode bool
	for _, line := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch strings.TrimSpace(k) {
		case "DeviceFileMinor":
			n, err := strconv.ParseUint(v, 10, 20)
			if err != nil {
				return c, fmt.Errorf("bad DeviceFileMinor %q", v)
			}
			c.Minor, haveMinor = uint32(n), true
		case "DeviceFileMode":
			n, err := strconv.ParseUint(v, 10, 32)
			if err != nil || n > 0o777 {
				return c, fmt.Errorf("bad DeviceFileMode %q", v)
			}
			c.Mode, haveMode = os.FileMode(n), true
		}
	}
	if !haveMinor || !haveMode {
		return c, errors.New("no DeviceFileMinor or DeviceFileMode line")
	}
	return c, nil
}

// Create makes the nodes. A node that already exists with the right type and numbers is kept;
// anything else at the path is replaced. It returns the paths it created, for Remove.
func Create(h host.Host, nodes []Node) ([]string, error) {
	var created []string
	dirs := map[string]bool{} // made already
	for _, n := range nodes {
		exists, ok, err := matches(n)
		switch {
		case err != nil:
			return created, err
		case ok:
			continue
		case exists:
			if err := h.Files.Remove(n.Path); err != nil {
				return created, fmt.Errorf("replace %s: %w", n.Path, err)
			}
		}
		if dir := filepath.Dir(n.Path); !dirs[dir] {
			if err := h.Files.MkdirAll(dir, 0o755); err != nil {
				return created, err
			}
			dirs[dir] = true
		}
		if err := h.Mknoder.Mknod(n.Path, n.perm(), n.Major, n.Minor); err != nil {
			return created, fmt.Errorf("mknod %s %d:%d: %w", n.Path, n.Major, n.Minor, err)
		}
		created = append(created, n.Path)
	}
	return created, nil
}

// matches says whether something is at n's path, and whether it is n itself.
func matches(n Node) (exists, ok bool, err error) {
	var st unix.Stat_t
	err = unix.Lstat(n.Path, &st)
	if errors.Is(err, fs.ErrNotExist) {
		return false, false, nil
	}
	if err != nil {
		return false, false, fmt.Errorf("stat %s: %w", n.Path, err)
	}
	return true, st.Mode&unix.S_IFMT == unix.S_IFCHR && unix.Major(st.Rdev) == n.Major && unix.Minor(st.Rdev) == n.Minor && os.FileMode(st.Mode).Perm() == n.perm(), nil
}

// Remove removes the given nodes (those Create made), last first.
func Remove(h host.Host, created []string) error {
	var errs []error
	for i := len(created) - 1; i >= 0; i-- {
		errs = append(errs, h.Files.Remove(created[i]))
	}
	return errors.Join(errs...)
}
