package devices

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

const procDevices = `Character devices:
  1 mem
195 nvidia-frontend
236 nvidia-caps
510 nvidia-uvm

Block devices:
  8 sd
259 blkext
`

func TestParseProcDevices(t *testing.T) {
	t.Parallel()
	m, err := ParseProcDevices(strings.NewReader(procDevices))
	if err != nil {
		t.Fatal(err)
	}
	if m["nvidia-uvm"] != 510 || m["nvidia-frontend"] != 195 || m["mem"] != 1 {
		t.Errorf("majors = %v", m)
	}
	if _, ok := m["sd"]; ok {
		t.Error("block devices must not be read as character devices")
	}
	for _, bad := range []string{"Character devices:\nxx nvidia\n", "Character devices:\n1 a b\n", "Character devices:\n99999 big\n"} {
		if _, err := ParseProcDevices(strings.NewReader(bad)); err == nil {
			t.Errorf("no error for %q", bad)
		}
	}
}

func TestParseMinor(t *testing.T) {
	t.Parallel()
	m, err := parseMinor([]byte("Model: \t\t NVIDIA H100\nIRQ: 1\nDevice Minor: \t 3\n"))
	if err != nil || m != 3 {
		t.Errorf("parseMinor = %d, %v", m, err)
	}
	for _, bad := range []string{"Model: x\n", "Device Minor: 254\n", "Device Minor: -1\n"} {
		if _, err := parseMinor([]byte(bad)); err == nil {
			t.Errorf("no error for %q", bad)
		}
	}
}

func FuzzParseProcDevices(f *testing.F) {
	f.Add(procDevices)
	f.Add("Character devices:\n 1 a\nBlock devices:\n 2 b\n")
	f.Fuzz(func(t *testing.T, in string) {
		m, err := ParseProcDevices(strings.NewReader(in))
		if err != nil {
			return
		}
		for name, major := range m {
			if major >= 1<<12 || name == "" {
				t.Fatalf("accepted %q=%d", name, major)
			}
		}
	})
}

func TestCapabilitiesAndPlan(t *testing.T) {
	t.Parallel()
	dir := hosttest.Unpack(t, `
-- proc/devices --
Character devices:
195 nvidia-frontend
236 nvidia-caps
510 nvidia-uvm
-- proc/driver/nvidia/gpus/0000:3b:00.0/information --
Device Minor: 	 1
-- proc/driver/nvidia/capabilities/mig/config --
DeviceFileMinor: 1
DeviceFileMode: 256
DeviceFileModify: 1
-- proc/driver/nvidia/capabilities/mig/monitor --
DeviceFileMinor: 2
DeviceFileMode: 292
DeviceFileModify: 1
`)
	r := hosttest.Roots(t, dir)
	nodes, err := Plan(r, true)
	if err != nil {
		t.Fatal(err)
	}
	want := []Node{
		{Path: r.InDev("nvidiactl"), Major: 195, Minor: 255},
		{Path: r.InDev("nvidia1"), Major: 195, Minor: 1},
		{Path: r.InDev("nvidia-modeset"), Major: 195, Minor: 254},
		{Path: r.InDev("nvidia-uvm"), Major: 510, Minor: 0},
		{Path: r.InDev("nvidia-uvm-tools"), Major: 510, Minor: 1},
		{Path: r.InDev("nvidia-caps/nvidia-cap1"), Major: 236, Minor: 1, Mode: 0o400},
		{Path: r.InDev("nvidia-caps/nvidia-cap2"), Major: 236, Minor: 2, Mode: 0o444},
	}
	if !reflect.DeepEqual(nodes, want) {
		t.Errorf("plan\n%+v\nwant\n%+v", nodes, want)
	}
	h := host.Host{Roots: r, Mknoder: hosttest.FakeMknoder{}, Files: host.OSFiles{}}
	created, err := Create(h, nodes)
	if err != nil || len(created) != len(nodes) {
		t.Fatalf("created %v, %v", created, err)
	}
	if data, _ := os.ReadFile(r.InDev("nvidia-caps/nvidia-cap1")); string(data) != "c 236:1 0400\n" {
		t.Errorf("cap1 = %q", data)
	}
	if err := Remove(h, created); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		if _, err := os.Stat(n.Path); !os.IsNotExist(err) {
			t.Errorf("%s left: %v", n.Path, err)
		}
	}
	for _, bad := range []string{"DeviceFileMinor: x\nDeviceFileMode: 256\n", "DeviceFileMinor: 1\n", "DeviceFileMinor: 1\nDeviceFileMode: 9999\n"} {
		if _, err := ParseCapability([]byte(bad)); err == nil {
			t.Errorf("no error for %q", bad)
		}
	}
}

// TestRealNodesKeptOrReplaced uses real mknod (the test runs as root in CI): a correct existing
// node is kept, a wrong one replaced.
func TestRealNodesKeptOrReplaced(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for mknod; CI runs as root")
	}
	dev := t.TempDir()
	h := host.Host{Mknoder: host.LinuxMknoder{}, Files: host.OSFiles{}}
	nodes := []Node{{Path: filepath.Join(dev, "nvidiactl"), Major: 195, Minor: 255}, {Path: filepath.Join(dev, "nvidia0"), Major: 195, Minor: 0}}
	if err := h.Mknoder.Mknod(nodes[0].Path, 0o666, 195, 255); err != nil {
		t.Skipf("mknod not permitted here: %v", err)
	}
	hosttest.Must(t, os.WriteFile(nodes[1].Path, []byte("not a device"), 0o644))
	created, err := Create(h, nodes)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(created, []string{nodes[1].Path}) {
		t.Errorf("created %v: the correct nvidiactl must be kept, the wrong nvidia0 replaced", created)
	}
	for _, n := range nodes {
		if _, ok, err := matches(n); !ok || err != nil {
			t.Errorf("%s does not match after Create: %v", n.Path, err)
		}
	}
}

// TestCreateWhereNothingIs: a node that is not there is made without removing anything first,
// and each directory is made once.
func TestCreateWhereNothingIs(t *testing.T) {
	dev := t.TempDir()
	rec := &host.Recorder{}
	h := host.Host{Mknoder: rec, Files: rec}
	nodes := []Node{
		{Path: filepath.Join(dev, "nvidiactl"), Major: 195, Minor: 255},
		{Path: filepath.Join(dev, "nvidia0"), Major: 195, Minor: 0},
		{Path: filepath.Join(dev, "nvidia-caps", "nvidia-cap1"), Major: 236, Minor: 1},
	}
	created, err := Create(h, nodes)
	if err != nil {
		t.Fatal(err)
	}
	if len(created) != 3 {
		t.Errorf("created %v, want all three", created)
	}
	var got []string
	for _, a := range rec.Actions() {
		got = append(got, a.Kind+" "+strings.TrimPrefix(a.Target, dev))
	}
	want := []string{"mkdir ", "mknod /nvidiactl", "mknod /nvidia0", "mkdir /nvidia-caps", "mknod /nvidia-caps/nvidia-cap1"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("actions %q, want %q", got, want)
	}
}

func FuzzParseCapability(f *testing.F) {
	f.Add([]byte("DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseCapability(data)
		if err == nil && c.Mode > 0o777 {
			t.Fatalf("mode %o accepted", c.Mode)
		}
	})
}
