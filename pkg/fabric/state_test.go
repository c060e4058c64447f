package fabric_test

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/fabric"
)

func TestParseFabricState(t *testing.T) {
	t.Parallel()
	ok := func(gpu string) fabric.GPUFabric {
		return fabric.GPUFabric{GPU: gpu, State: "Completed", Status: "Success"}
	}
	cases := []struct {
		file       string
		want       []fabric.GPUFabric
		state      fabric.State
		detail     string
		unhealthy  int
		wantErrNil bool
	}{
		{file: "h100-completed.txt", want: []fabric.GPUFabric{ok("00000000:18:00.0"), ok("00000000:2A:00.0")},
			state: fabric.StateCompleted, detail: "2 GPUs Completed/Success"},
		{file: "h100-in-progress.txt", want: []fabric.GPUFabric{ok("00000000:18:00.0"), {GPU: "00000000:2A:00.0", State: "In Progress", Status: "N/A"}},
			state: fabric.StateInProgress, detail: "1 of 2 GPUs: GPU 00000000:2A:00.0: In Progress/N/A"},
		{file: "h100-not-started.txt", want: []fabric.GPUFabric{{GPU: "00000000:18:00.0", State: "Not Started", Status: "N/A"}, {GPU: "00000000:2A:00.0", State: "Not Started", Status: "N/A"}},
			state: fabric.StateInProgress, detail: "2 of 2 GPUs: GPU 00000000:18:00.0: Not Started/N/A; GPU 00000000:2A:00.0: Not Started/N/A"},
		{file: "h100-insufficient-resources.txt", want: []fabric.GPUFabric{ok("00000000:18:00.0"),
			{GPU: "00000000:2A:00.0", State: "Completed", Status: "Insufficient Resources", CliqueID: "0", ClusterUUID: "00000000-0000-0000-0000-000000000000"}},
			state: fabric.StateFailed, detail: "1 of 2 GPUs: GPU 00000000:2A:00.0: Completed/Insufficient Resources"},
		{file: "pcie-na.txt", want: []fabric.GPUFabric{{GPU: "00000000:3B:00.0", State: "N/A", Status: "N/A"}},
			state: fabric.StateNotSupported, detail: "1 GPU N/A/N/A"},
		{file: "not-supported.txt", want: []fabric.GPUFabric{
			{GPU: "00000008:01:00.0", State: "Not Supported", Status: "Success", CliqueID: "0", ClusterUUID: "N/A", Health: "Not Supported"},
			{GPU: "00000009:01:00.0", State: "Not Supported", Status: "Success", CliqueID: "0", ClusterUUID: "N/A", Health: "Not Supported"}},
			state: fabric.StateNotSupported, detail: "2 GPUs Not Supported/Success"},
		{file: "gb200-health.txt", want: []fabric.GPUFabric{
			{GPU: "00000008:01:00.0", State: "Completed", Status: "Success", CliqueID: "4026", ClusterUUID: "9c6f5af3-53bf-49b5-a436-b66766c413c3", Health: "Healthy"},
			{GPU: "00000009:01:00.0", State: "Completed", Status: "Success", CliqueID: "2", ClusterUUID: "dc6e40c4-d722-4357-9ba6-5291dd461278", Health: "Unhealthy"}},
			state: fabric.StateCompleted, detail: "2 GPUs Completed/Success", unhealthy: 1},
		{file: "old-driver-no-fabric.txt", want: []fabric.GPUFabric{{GPU: "00000000:18:00.0"}},
			state: fabric.StateNotSupported, detail: "1 GPU N/A/N/A"},
	}
	for _, c := range cases {
		t.Run(c.file, func(t *testing.T) {
			f, err := os.Open(filepath.Join("testdata/nvidia-smi", c.file))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			got, err := fabric.ParseFabricState(f)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, c.want) {
				t.Fatalf("parsed\n%+v\nwant\n%+v", got, c.want)
			}
			s := fabric.Summarize(got)
			if s.State != c.state || s.Detail != c.detail {
				t.Errorf("summary %s %q, want %s %q", s.State, s.Detail, c.state, c.detail)
			}
			if n := len(s.Unhealthy()); n != c.unhealthy {
				t.Errorf("%d unhealthy GPUs, want %d", n, c.unhealthy)
			}
		})
	}
}

func TestParseFabricStateNoGPU(t *testing.T) {
	t.Parallel()
	for _, in := range []string{"", "No devices were found\n", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"} {
		if _, err := fabric.ParseFabricState(strings.NewReader(in)); !errors.Is(err, fabric.ErrNoGPU) {
			t.Errorf("%q: error %v, want ErrNoGPU", in, err)
		}
	}
}

// TestParseFabricStateSections checks the section rules on small inputs: keys outside the Fabric
// section or in its subsections are not the fabric's, tabs and CRLF are indentation like spaces,
// and a Fabric section before any GPU header belongs to no GPU.
func TestParseFabricStateSections(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, in string
		want     []fabric.GPUFabric
	}{
		{"other sections' State and Status", "GPU 0000:01:00.0\n    GPU Reset Status\n        State : Pending\n    Fabric\n        State : In Progress\n        Status : N/A\n    Conf Compute\n        Status : Success\n",
			[]fabric.GPUFabric{{GPU: "0000:01:00.0", State: "In Progress", Status: "N/A"}}},
		{"nested Status stays nested", "GPU a\n    Fabric\n        State : Completed\n        Health\n            Summary : Unhealthy\n            Status : Timeout\n        Status : Success\n",
			[]fabric.GPUFabric{{GPU: "a", State: "Completed", Status: "Success", Health: "Unhealthy"}}},
		{"tabs and CRLF", "GPU b\r\n\tFabric\r\n\t\tState\t\t: Completed\r\n\t\tStatus\t\t: Timeout\r\n",
			[]fabric.GPUFabric{{GPU: "b", State: "Completed", Status: "Timeout"}}},
		{"Fabric before any GPU", "    Fabric\n        State : Completed\nGPU c\n    Fabric\n        State : Not Started\n",
			[]fabric.GPUFabric{{GPU: "c", State: "Not Started"}}},
		{"section ends at a shallower line", "GPU d\n    Fabric\n        State : Completed\n    Processes : None\n    State : Bogus\n",
			[]fabric.GPUFabric{{GPU: "d", State: "Completed"}}},
		{"value with colons", "GPU e\n    Fabric\n        ClusterUUID : a:b:c\n        Clique ID : 7\n",
			[]fabric.GPUFabric{{GPU: "e", ClusterUUID: "a:b:c", CliqueID: "7"}}},
	}
	for _, c := range cases {
		got, err := fabric.ParseFabricState(strings.NewReader(c.in))
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: got %+v, want %+v", c.name, got, c.want)
		}
	}
}

func TestClassify(t *testing.T) {
	t.Parallel()
	cases := []struct {
		state, status string
		want          fabric.State
	}{
		{"Completed", "Success", fabric.StateCompleted},
		{"Completed", "N/A", fabric.StateCompleted},
		{"completed", "", fabric.StateCompleted},
		{"Completed", "Insufficient Resources", fabric.StateFailed},
		{"Completed", "Timeout", fabric.StateFailed},
		{"Completed", "Unknown Error", fabric.StateFailed},
		{"In Progress", "N/A", fabric.StateInProgress},
		{"In  Progress", "", fabric.StateInProgress},
		{"Not Started", "N/A", fabric.StateInProgress},
		{"Not Supported", "Success", fabric.StateNotSupported},
		{"N/A", "N/A", fabric.StateNotSupported},
		{"", "", fabric.StateNotSupported},
		{"Degraded", "Success", fabric.StateFailed},
	}
	for _, c := range cases {
		if got := (fabric.GPUFabric{State: c.state, Status: c.status}).Classify(); got != c.want {
			t.Errorf("%q/%q: %s, want %s", c.state, c.status, got, c.want)
		}
	}
	if s := fabric.Summarize(nil); s.State != fabric.StateNotSupported || s.Detail != "no GPU" {
		t.Errorf("no GPUs: %+v", s)
	}
	mixed := fabric.Summarize([]fabric.GPUFabric{{GPU: "a", State: "Completed", Status: "Success"}, {GPU: "b", State: "In Progress"}, {GPU: "c", State: "Completed", Status: "Timeout"}})
	if mixed.State != fabric.StateFailed || mixed.Detail != "1 of 3 GPUs: GPU c: Completed/Timeout" {
		t.Errorf("a failure wins over in progress: %+v", mixed)
	}
}
