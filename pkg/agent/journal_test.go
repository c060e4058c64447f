package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// killAfterLoad ends the agent's goroutine right after the kernel loaded the named module, as a
// SIGKILL while nvidia's init runs leaves it: loaded, and the agent gone before it knew.
type killAfterLoad struct {
	*hosttest.FakeKernel
	name string
	kill func()
}

func (k killAfterLoad) LoadModule(m host.ModuleImage) error {
	err := k.FakeKernel.LoadModule(m)
	if m.Name == k.name {
		k.kill()
	}
	return err
}

// killed runs a until the hook that crash installs calls kill: the agent's goroutine ends there
// with runtime.Goexit, so no teardown runs, as with SIGKILL. Its deferred lock release runs (the
// kernel drops a dead process's flock too); killed returns once that goroutine has ended, so
// nothing of the killed agent still changes the files. Metrics are off: their server would
// outlive it.
func (w *world) killed(t *testing.T, crash func(a *Agent, kill func())) {
	t.Helper()
	a := w.agent(t, "--metrics-address", "")
	hit := false
	crash(a, func() { hit = true; runtime.Goexit() })
	ended := make(chan error, 1)
	go func() {
		defer close(ended) // runs after Run's own deferred calls, under Goexit too
		ended <- a.Run(context.Background())
	}()
	if err, returned := <-ended; returned || !hit {
		t.Fatalf("the agent ended before the crash point: %v", err)
	}
}

// freshLayer puts the container root back as the fixture had it: the killed agent's container
// is gone with its writable layer (modules.dep, modprobe.d), and a new container starts with a
// fresh one. What the agent changed outside the container root stays, and so does its
// /lib/firmware, the operator's hostPath volume.
func (w *world) freshLayer(t *testing.T) {
	t.Helper()
	rel, err := filepath.Rel(w.dir, w.roots.Root)
	if err != nil {
		t.Fatal(err)
	}
	for p, content := range files(hosttest.Snapshot(t, w.dir)) {
		if !strings.HasPrefix(p, rel+"/") || strings.HasPrefix(p, rel+"/lib/firmware/") {
			continue
		}
		old, ok := w.before[p]
		switch {
		case !ok:
			err = os.Remove(filepath.Join(w.dir, p))
		case old != content:
			err = os.WriteFile(filepath.Join(w.dir, p), []byte(old), 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

func (w *world) journal(t *testing.T) *Journal {
	t.Helper()
	data, err := os.ReadFile(w.roots.InRun("nvidia/driver-agent/journal.json"))
	if err != nil {
		t.Fatal(err)
	}
	j, err := ParseJournal(bytes.NewReader(data))
	if err != nil {
		t.Fatalf("%v\n%s", err, data)
	}
	return j
}

// crashPoints are where TestKilledAgentIsAdopted kills the first agent.
var crashPoints = []struct {
	name  string
	crash func(a *Agent, kill func())
	// devices: device nodes were made before the kill.
	devices bool
}{
	{"prerequisites loaded", func(a *Agent, kill func()) {
		a.Host.Kernel = loadHook{a.Host.Kernel.(*hosttest.FakeKernel), func(name string) {
			if name == "nvidia" {
				kill()
			}
		}}
	}, false},
	{"nvidia coming", func(a *Agent, kill func()) {
		a.Host.Kernel = killAfterLoad{a.Host.Kernel.(*hosttest.FakeKernel), "nvidia", kill}
	}, false},
	{"loaded, before device nodes", func(a *Agent, kill func()) {
		a.BeforePhase = func(p string) {
			if p == PhaseDevices {
				kill()
			}
		}
	}, false},
	{"device nodes made", func(a *Agent, kill func()) {
		a.BeforePhase = func(p string) {
			if p == PhaseDaemons {
				kill()
			}
		}
	}, true},
}

// TestKilledAgentIsAdopted: an agent killed after it loaded prerequisites and set the firmware
// search path has journaled them first; the next agent reaches Ready, and its teardown leaves the
// node as it was before either ran: prerequisites unloaded, firmware path reset, device nodes
// gone, journal removed.
func TestKilledAgentIsAdopted(t *testing.T) {
	for _, tc := range crashPoints {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			gsp := w.roots.InRoot(imageFirmwareDir, testVersion, "gsp_ga10x.bin")
			os.MkdirAll(filepath.Dir(gsp), 0o755)
			os.WriteFile(gsp, []byte("gsp"), 0o644)
			w.before = files(hosttest.Snapshot(t, w.dir))
			w.killed(t, tc.crash)
			j := w.journal(t)
			copied := w.roots.InRoot("lib/firmware/nvidia", testVersion, "gsp_ga10x.bin")
			if !slices.Equal(j.FirmwareFiles, []string{copied}) || len(j.FirmwareDirs) == 0 {
				t.Errorf("journal firmware %v in %v, want %s", j.FirmwareFiles, j.FirmwareDirs, copied)
			}
			if !slices.Equal(j.Prerequisites, []string{"i2c_core", "ipmi_devintf"}) {
				t.Errorf("journal prerequisites %v, want i2c_core ipmi_devintf (ipmi_msghandler was loaded before)", j.Prerequisites)
			}
			if j.FirmwarePathBefore == nil || *j.FirmwarePathBefore != "\n" {
				t.Errorf("journal firmware path before = %v, want the empty value", j.FirmwarePathBefore)
			}
			if got := len(j.Devices) > 0; got != tc.devices {
				t.Errorf("journal devices %v, want some: %v", j.Devices, tc.devices)
			}
			if got := w.read(t, "sys/module/firmware_class/parameters/path"); got != firmwareSearchPath {
				t.Fatalf("the killed agent left firmware path %q", got)
			}

			w.freshLayer(t)
			var log messages
			a := w.agent(t)
			a.Log = slog.New(&log)
			cancel, done := startAgent(a)
			defer cancel()
			w.waitReady(t, done)
			if !slices.Contains(log.msgs, "adopting what an earlier agent left; this run undoes it at teardown") {
				t.Errorf("no adoption logged: %v", log.msgs)
			}
			if j := w.journal(t); !slices.Contains(j.Prerequisites, "i2c_core") || j.FirmwarePathBefore == nil {
				t.Errorf("the new agent's journal dropped what it adopted: %+v", j)
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			w.assertClean(t)
		})
	}
}

// TestKilledAgentWithoutJournal: the same crash with the journal gone shows what the journal
// is for: the next agent takes the prerequisites and the firmware path for the host's and
// leaves them.
func TestKilledAgentWithoutJournal(t *testing.T) {
	w := newWorld(t)
	w.killed(t, crashPoints[2].crash)
	w.freshLayer(t)
	if err := os.Remove(w.roots.InRun("nvidia/driver-agent/journal.json")); err != nil {
		t.Fatal(err)
	}
	cancel, done := startAgent(w.agent(t))
	defer cancel()
	w.waitReady(t, done)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := w.kernel.Loaded(); !slices.Equal(got, []string{"i2c_core", "ipmi_devintf"}) {
		t.Errorf("loaded after the teardown: %v, want the killed agent's prerequisites left", got)
	}
	if got := w.read(t, "sys/module/firmware_class/parameters/path"); got != firmwareSearchPath {
		t.Errorf("firmware path %q, want the killed agent's left", got)
	}
}

// writeJournal writes j as an earlier agent's journal.
func (w *world) writeJournal(t *testing.T, j string) {
	t.Helper()
	p := w.roots.InRun("nvidia/driver-agent/journal.json")
	os.MkdirAll(filepath.Dir(p), 0o755)
	if err := os.WriteFile(p, []byte(j), 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestAdoptedChangesUndoneWhenTheRunFails: what the journal names (a mount, device nodes, GSP
// firmware, the firmware path, a prerequisite) is undone by a run that fails before it makes any
// of these itself, and an entry whose change is gone is dropped, not undone.
func TestAdoptedChangesUndoneWhenTheRunFails(t *testing.T) {
	w := newWorld(t)
	target := w.roots.InRun("nvidia/driver")
	os.MkdirAll(target, 0o755)
	if err := w.mounter.Mount(w.roots.Root, target, "", syscall.MS_BIND|syscall.MS_REC, ""); err != nil {
		t.Fatal(err)
	}
	fwDir := w.roots.InRoot("lib/firmware/nvidia", testVersion)
	os.MkdirAll(fwDir, 0o755)
	fw := filepath.Join(fwDir, "gsp_ga10x.bin")
	os.WriteFile(fw, []byte("gsp"), 0o644)
	devs := []string{w.roots.InDev("nvidiactl"), w.roots.InDev("nvidia0")}
	for _, d := range devs {
		hosttest.FakeMknoder{}.Mknod(d, 0o666, 195, 0)
	}
	os.WriteFile(w.roots.InSys("module/firmware_class/parameters/path"), []byte(firmwareSearchPath), 0o644)
	if err := w.kernel.Preload("i2c_core"); err != nil {
		t.Fatal(err)
	}
	before := "\n"
	w.writeJournal(t, mustJSON(t, Journal{Format: journalFormat, PID: 4242,
		Prerequisites:      []string{"i2c_core", "ipmi_devintf"}, // ipmi_devintf never got loaded
		FirmwarePathBefore: &before, FirmwareDirs: []string{fwDir}, FirmwareFiles: []string{fw},
		Devices: append(devs, w.roots.InDev("nvidia-uvm")), Mounts: []string{target}}))

	a := w.agent(t)
	a.Source = fakeSource{dir: t.TempDir(), err: exitcode.ErrNoInstallPath}
	err := a.Run(context.Background())
	if !errors.Is(err, exitcode.ErrNoInstallPath) {
		t.Fatalf("Run = %v, want no install path", err)
	}
	if m := w.mounter.Mounted(); len(m) != 0 {
		t.Errorf("still mounted: %v", m)
	}
	for _, p := range append(devs, fw, fwDir) {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s left", p)
		}
	}
	if got := w.read(t, "sys/module/firmware_class/parameters/path"); got != "\n" {
		t.Errorf("firmware path %q, want reset", got)
	}
	if l := w.kernel.Loaded(); len(l) != 0 {
		t.Errorf("still loaded: %v", l)
	}
	if calls := w.kernel.Calls(); !slices.Equal(calls, []string{"unload i2c_core"}) {
		t.Errorf("kernel calls %v, want i2c_core unloaded and nothing else", calls)
	}
	if _, err := os.Stat(w.roots.InRun("nvidia/driver-agent/journal.json")); err == nil {
		t.Error("journal left after a teardown that undid everything")
	}
}

// TestJournalNotTrusted: a journal that does not parse, or names what agents do not change, is
// reported and ignored: the host's module stays loaded and the named files stay.
func TestJournalNotTrusted(t *testing.T) {
	for _, tc := range []struct{ name, journal string }{
		{"garbage", "{\"format\": 1, \"prerequisites\": [\"i2c_core\""},
		{"unknown field", `{"format": 1, "prerequisites": ["i2c_core"], "modules": ["nvidia"]}`},
		{"other format", `{"format": 2, "prerequisites": ["i2c_core"]}`},
		{"device outside /dev", `{"format": 1, "prerequisites": ["i2c_core"], "devices": ["@ETC@/hosts"]}`},
		{"not an NVIDIA device", `{"format": 1, "prerequisites": ["i2c_core"], "devices": ["@DEV@/sda"]}`},
		{"firmware elsewhere", `{"format": 1, "prerequisites": ["i2c_core"], "firmwareFiles": ["@ETC@/hosts"]}`},
		{"another mount", `{"format": 1, "prerequisites": ["i2c_core"], "mounts": ["@ETC@"]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t)
			if err := w.kernel.Preload("i2c_core"); err != nil { // the host's
				t.Fatal(err)
			}
			hosts := w.roots.InRoot("etc/hosts")
			os.MkdirAll(filepath.Dir(hosts), 0o755)
			os.WriteFile(hosts, []byte("127.0.0.1 localhost\n"), 0o644)
			sda := w.roots.InDev("sda")
			os.WriteFile(sda, []byte("disk"), 0o644)
			w.writeJournal(t, strings.NewReplacer("@ETC@", w.roots.InRoot("etc"), "@DEV@", w.roots.Dev).Replace(tc.journal))
			var log messages
			a := w.agent(t)
			a.Log = slog.New(&log)
			a.Source = fakeSource{dir: t.TempDir(), err: exitcode.ErrNoInstallPath}
			if err := a.Run(context.Background()); !errors.Is(err, exitcode.ErrNoInstallPath) {
				t.Fatalf("Run = %v", err)
			}
			if !slices.Contains(log.msgs, "ignoring an earlier agent's journal; what it changed on the node is left as it is") {
				t.Errorf("not reported: %v", log.msgs)
			}
			if !slices.Equal(w.kernel.Loaded(), []string{"i2c_core"}) || len(w.kernel.Calls()) != 0 {
				t.Errorf("loaded %v, calls %v: want the host's i2c_core left alone", w.kernel.Loaded(), w.kernel.Calls())
			}
			for _, p := range []string{hosts, sda} {
				if _, err := os.Stat(p); err != nil {
					t.Errorf("%s: %v", p, err)
				}
			}
		})
	}
}

// TestJournalKeepsWhatStays: a teardown that cannot unload a driver in use leaves what the driver
// needs (device nodes, prerequisites, the firmware search path) and the journal naming them, and
// the next agent undoes them once the driver goes.
func TestJournalKeepsWhatStays(t *testing.T) {
	w := newWorld(t)
	cancel, done := startAgent(w.agent(t))
	defer cancel()
	w.waitReady(t, done)
	w.kernel.Use("nvidia_uvm", 1)
	cancel()
	if err := <-done; !errors.Is(err, exitcode.ErrInUse) {
		t.Fatalf("Run = %v, want in use", err)
	}
	j := w.journal(t)
	if !slices.Contains(j.Devices, w.roots.InDev("nvidia0")) {
		t.Errorf("journal devices %v, want the nodes left with the driver in use", j.Devices)
	}
	if len(j.Prerequisites) == 0 || j.FirmwarePathBefore == nil {
		t.Errorf("journal %+v, want the prerequisites and the firmware search path the driver in use still has", j)
	}
	if got := w.read(t, "sys/module/firmware_class/parameters/path"); got != firmwareSearchPath {
		t.Errorf("firmware search path %q with the driver in use, want %q kept", got, firmwareSearchPath)
	}
	for _, m := range j.Prerequisites {
		if !slices.Contains(w.kernel.Loaded(), m) {
			t.Errorf("prerequisite %s unloaded under the driver in use", m)
		}
	}
	if len(j.Mounts) != 0 {
		t.Errorf("journal keeps the mount the teardown undid: %+v", j)
	}
	w.kernel.Use("nvidia_uvm", -1)
	cancel2, done2 := startAgent(w.agent(t, "--metrics-address", ""))
	defer cancel2()
	w.waitReady(t, done2)
	cancel2()
	if err := <-done2; err != nil {
		t.Fatal(err)
	}
	w.assertClean(t)
}

// TestDryRunReportsTheJournal: a dry run says what it would adopt, plans its undo, and leaves
// the journal.
func TestDryRunReportsTheJournal(t *testing.T) {
	w := newWorld(t)
	if err := w.kernel.Preload("i2c_core"); err != nil {
		t.Fatal(err)
	}
	j := mustJSON(t, Journal{Format: journalFormat, PID: 4242, Prerequisites: []string{"i2c_core"}})
	w.writeJournal(t, j)
	p, err := w.dryRunPlan(t, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(p.Notes, func(n string) bool {
		return strings.Contains(n, "adopts what the agent 4242 left") && strings.Contains(n, "i2c_core")
	}) {
		t.Errorf("notes %v", p.Notes)
	}
	if !slices.Contains(p.Teardown, host.Action{Kind: "unload-module", Target: "i2c_core"}) {
		t.Errorf("the plan's teardown does not unload the adopted i2c_core: %v", p.Teardown)
	}
	if got := w.read(t, "run/nvidia/driver-agent/journal.json"); got != j {
		t.Errorf("journal changed: %s", got)
	}
}

func TestParseJournal(t *testing.T) {
	t.Parallel()
	empty := ""
	for _, tc := range []struct {
		name, in string
		want     *Journal
	}{
		{"full", `{"format":1,"pid":7,"prerequisites":["i2c_core","ipmi_devintf"],"firmwarePathBefore":"","firmwareDirs":["/lib/firmware/nvidia/1"],"firmwareFiles":["/lib/firmware/nvidia/1/gsp.bin"],"devices":["/dev/nvidiactl"],"mounts":["/run/nvidia/driver"]}`,
			&Journal{Format: 1, PID: 7, Prerequisites: []string{"i2c_core", "ipmi_devintf"}, FirmwarePathBefore: &empty,
				FirmwareDirs: []string{"/lib/firmware/nvidia/1"}, FirmwareFiles: []string{"/lib/firmware/nvidia/1/gsp.bin"}, Devices: []string{"/dev/nvidiactl"}, Mounts: []string{"/run/nvidia/driver"}}},
		{"nothing", `{"format":1,"pid":7}`, &Journal{Format: 1, PID: 7}},
		{"no format", `{"pid":7}`, nil},
		{"negative pid", `{"format":1,"pid":-1}`, nil},
		{"unknown field", `{"format":1,"x":1}`, nil},
		{"two objects", `{"format":1}{"format":1}`, nil},
		{"an NVIDIA module", `{"format":1,"prerequisites":["nvidia_uvm"]}`, nil},
		{"a dashed name", `{"format":1,"prerequisites":["ipmi-devintf"]}`, nil},
		{"not a name", `{"format":1,"prerequisites":["../x"]}`, nil},
		{"relative path", `{"format":1,"devices":["dev/nvidia0"]}`, nil},
		{"unclean path", `{"format":1,"devices":["/dev/../etc/nvidia0"]}`, nil},
		{"array", `[]`, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseJournal(strings.NewReader(tc.in))
			if tc.want == nil {
				if err == nil {
					t.Fatalf("ParseJournal = %+v, want an error", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

// FuzzParseJournal: ParseJournal never panics, and a journal it accepts survives a write and a
// re-read unchanged.
func FuzzParseJournal(f *testing.F) {
	f.Add([]byte(`{"format":1,"pid":7,"prerequisites":["i2c_core"],"firmwarePathBefore":"\n","devices":["/dev/nvidia0"],"mounts":["/run/nvidia/driver"]}`))
	f.Add([]byte(`{"format":1}`))
	f.Add([]byte(`{"format":1,"prerequisites":["nvidia"]}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		j, err := ParseJournal(bytes.NewReader(in))
		if err != nil {
			return
		}
		out, err := json.Marshal(j)
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseJournal(bytes.NewReader(out))
		if err != nil {
			t.Fatalf("re-reading a written journal: %v\n%s", err, out)
		}
		if !reflect.DeepEqual(j, again) {
			t.Fatalf("journal changed on a round trip:\n%+v\n%+v", j, again)
		}
	})
}
