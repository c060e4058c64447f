package devices

import (
	"strings"
	"testing"
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
