package fabric_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/fabric"
)

// FuzzParseConfig checks that parsing never fails or panics, that an unedited file renders
// back byte for byte, that Set changes exactly the setting it names (in place or appended) and
// survives a round trip, and that EditConfig's output always carries the forced settings.
func FuzzParseConfig(f *testing.F) {
	f.Add("LOG_LEVEL=4\nDAEMONIZE=1\n", "LOG_LEVEL", "2")
	f.Add("# comment\r\nA=1\r\n", "B", "x y")
	f.Add("no newline at the end=", "NEW", "")
	f.Fuzz(func(t *testing.T, in, key, value string) {
		c := fabric.ParseConfig([]byte(in))
		if got := string(c.Bytes()); got != in {
			t.Fatalf("round trip changed %q into %q", in, got)
		}
		before := map[string]string{}
		for _, k := range c.Keys() {
			v, ok := c.Get(k)
			if !ok {
				t.Fatalf("Keys() lists %q but Get finds nothing", k)
			}
			before[k] = v
		}
		if !validKey(key) || strings.ContainsAny(value, "\n\r\x00") {
			return
		}
		_, had := c.Get(key)
		if existed := c.Set(key, value); existed != had {
			t.Fatalf("Set(%q) reported existed=%v, Get said %v", key, existed, had)
		}
		back := fabric.ParseConfig(c.Bytes())
		if v, ok := back.Get(key); !ok || v != strings.TrimSpace(value) {
			t.Fatalf("after Set(%q, %q) and a round trip: %q, %v", key, value, v, ok)
		}
		for k, v := range before {
			if k == key {
				continue
			}
			if got, ok := back.Get(k); !ok || got != v {
				t.Fatalf("Set(%q) changed %s from %q to %q (%v)", key, k, v, got, ok)
			}
		}
		ed, err := fabric.EditConfig([]byte(in), map[string]string{key: value})
		if err != nil {
			t.Fatalf("EditConfig: %v", err)
		}
		if v, _ := ed.Config.Get("DAEMONIZE"); v != "0" {
			t.Fatalf("DAEMONIZE=%q after EditConfig", v)
		}
		if !bytes.Equal(fabric.ParseConfig(ed.Data).Bytes(), ed.Data) {
			t.Fatal("EditConfig output does not round-trip")
		}
	})
}

func validKey(k string) bool {
	if k == "" {
		return false
	}
	for _, r := range k {
		if (r < 'A' || r > 'Z') && (r < '0' || r > '9') && r != '_' {
			return false
		}
	}
	return true
}

// FuzzParseFabricState checks that the nvidia-smi parser never panics, that what it returns is
// well formed (a GPU per header, single-line trimmed values, a summary that is one of the four
// states and agrees with the GPUs), and that a value put in a Fabric section's State line comes
// back verbatim (trimmed).
func FuzzParseFabricState(f *testing.F) {
	f.Add("GPU 00000000:18:00.0\n    Fabric\n        State : Completed\n        Status : Success\n", "In Progress")
	f.Add("No devices were found\n", "Completed")
	f.Add("GPU a\n\tFabric\n\t\tHealth\n\t\t\tSummary : Unhealthy\n", " N/A ")
	f.Fuzz(func(t *testing.T, in, value string) {
		gpus, err := fabric.ParseFabricState(strings.NewReader(in))
		if err == nil && len(gpus) == 0 {
			t.Fatal("no error and no GPU")
		}
		failed := false
		for _, g := range gpus {
			for _, v := range []string{g.GPU, g.State, g.Status, g.CliqueID, g.ClusterUUID, g.Health} {
				if strings.ContainsAny(v, "\n") || v != strings.TrimSpace(v) {
					t.Fatalf("value %q is not a trimmed single line", v)
				}
			}
			failed = failed || g.Classify() == fabric.StateFailed
		}
		s := fabric.Summarize(gpus)
		switch s.State {
		case fabric.StateCompleted, fabric.StateInProgress, fabric.StateFailed, fabric.StateNotSupported:
		default:
			t.Fatalf("summary state %q", s.State)
		}
		if failed != (s.State == fabric.StateFailed) || s.Detail == "" {
			t.Fatalf("summary %+v disagrees with the GPUs %+v", s, gpus)
		}

		if strings.ContainsAny(value, "\n") {
			return
		}
		doc := "GPU 00000000:18:00.0\n    Fabric\n        State                             : " + value + "\n        Status                            : Success\n"
		gpus, err = fabric.ParseFabricState(strings.NewReader(doc))
		if err != nil || len(gpus) != 1 {
			t.Fatalf("parse %q: %v, %+v", doc, err, gpus)
		}
		if want := strings.TrimSpace(value); gpus[0].State != want || gpus[0].Status != "Success" {
			t.Fatalf("State %q Status %q, want %q and Success", gpus[0].State, gpus[0].Status, want)
		}
	})
}
