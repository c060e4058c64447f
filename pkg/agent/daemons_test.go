package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/status"
)

// fakeForkingDaemon behaves like nvidia-gridd and nvidia-topologyd: it logs how it was started
// (its arguments and LD_LIBRARY_PATH), forks into the background, the child writes
// /var/run/<name>/<name>.pid and runs until SIGTERM, removing its PID file as it exits.
const fakeForkingDaemon = `#!/bin/sh
name="$(basename "$0")"
dir="$(dirname "$0")/../../var/run/$name"
echo "$name start [$*] LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >> "$FAKE_DAEMONS_LOG"
(
  trap 'rm -f "$dir/$name.pid"; echo "$name stop" >> "$FAKE_DAEMONS_LOG"; exit 0' TERM
  sh -c 'echo $PPID' > "$dir/$name.pid"
  while :; do sleep 0.05; done
) &
exit 0
`

// fakeFabricManager runs in the foreground until SIGTERM, as nv-fabricmanager does with DAEMONIZE=0.
const fakeFabricManager = `#!/bin/sh
echo "nv-fabricmanager start [$*]" >> "$FAKE_DAEMONS_LOG"
trap 'echo "nv-fabricmanager stop" >> "$FAKE_DAEMONS_LOG"; exit 0' TERM
while :; do sleep 0.05; done
`

// fakeNvidiaSMI prints canned "nvidia-smi -q" output: $FAKE_SMI_DIR/<n>.txt on its n-th call
// when that file exists, else $FAKE_SMI_DIR/last.txt.
const fakeNvidiaSMI = `#!/bin/sh
[ "$1" = "-q" ] || { echo "unexpected arguments: $*" >&2; exit 2; }
n=$(( $(cat "$FAKE_SMI_DIR/calls" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$FAKE_SMI_DIR/calls"
if [ -f "$FAKE_SMI_DIR/$n.txt" ]; then cat "$FAKE_SMI_DIR/$n.txt"; else cat "$FAKE_SMI_DIR/last.txt"; fi
`

// writeTree writes files (path relative to the fixture dir -> content; mode 0755 for usr/bin)
// and takes a new "before" snapshot, so that assertClean checks what the run adds.
func (w *world) writeTree(t *testing.T, tree map[string]string) {
	t.Helper()
	for rel, content := range tree {
		p := filepath.Join(w.dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		mode := os.FileMode(0o644)
		if strings.Contains(rel, "/usr/bin/") {
			mode = 0o755
		}
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
	}
	w.before = files(hosttest.Snapshot(t, w.dir))
}

// daemonsLog returns the lines the fake daemons of this file logged.
func daemonsLog(t *testing.T) []string {
	t.Helper()
	data, _ := os.ReadFile(os.Getenv("FAKE_DAEMONS_LOG"))
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

func setDaemonsLog(t *testing.T) {
	t.Setenv("FAKE_DAEMONS_LOG", filepath.Join(t.TempDir(), "daemons.log"))
}

// vgpuFiles are a vGPU guest image and the operator's licensing ConfigMap (mounted the way a
// ConfigMap volume is: the token through ..data).
func vgpuFiles() map[string]string {
	return map[string]string{
		"container/usr/bin/nvidia-gridd":                                        fakeForkingDaemon,
		"container/usr/bin/nvidia-topologyd":                                    fakeForkingDaemon,
		"drivers/gridd.conf":                                                    "ServerAddress=\nFeatureType=1\n",
		"drivers/ClientConfigToken/..2024_10_15/client_configuration_token.tok": "token-data",
	}
}

func TestVGPUGuestStartsGriddAndTopologyd(t *testing.T) {
	w := newWorld(t)
	setDaemonsLog(t)
	w.writeTree(t, vgpuFiles())
	tokDir := w.roots.InDrivers("ClientConfigToken")
	hosttest.Must(t, os.Symlink("..2024_10_15", filepath.Join(tokDir, "..data")))
	hosttest.Must(t, os.Symlink("..data/client_configuration_token.tok", filepath.Join(tokDir, "client_configuration_token.tok")))
	w.before = files(hosttest.Snapshot(t, w.dir))

	a := w.agent(t, "--driver-type", "vgpu")
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)

	arch := map[string]string{"amd64": "x86_64", "arm64": "aarch64"}[runtime.GOARCH]
	lib := w.roots.InRoot("usr/lib", arch+"-linux-gnu/nvidia/gridd")
	if got, want := daemonsLog(t), []string{
		"nvidia-gridd start [] LD_LIBRARY_PATH=" + lib,
		"nvidia-topologyd start [] LD_LIBRARY_PATH=",
	}; !slices.Equal(got, want) {
		t.Errorf("vGPU daemons started as\n%q\nwant\n%q", got, want)
	}
	if ev := w.daemonEvents(t); !slices.Equal(ev, []string{"start", "--persistence-mode", "|"}) {
		t.Errorf("persistenced events %v", ev)
	}
	if got := w.read(t, "container/etc/nvidia/gridd.conf"); got != "ServerAddress=\nFeatureType=1\n" {
		t.Errorf("gridd.conf = %q", got)
	}
	if got := w.read(t, "container/etc/nvidia/ClientConfigToken/client_configuration_token.tok"); got != "token-data" {
		t.Errorf("token = %q", got)
	}
	if entries, _ := os.ReadDir(w.roots.InRoot("etc/nvidia/ClientConfigToken")); len(entries) != 1 {
		t.Errorf("ClientConfigToken holds %v: only the token, not ..data", entries)
	}
	for _, name := range []string{"nvidia-gridd", "nvidia-topologyd"} {
		if pid := w.read(t, "container/var/run/"+name+"/"+name+".pid"); !strings.HasSuffix(pid, "\n") {
			t.Errorf("%s PID file = %q", name, pid)
		}
	}
	st := w.readStatus(t)
	for _, want := range []string{"nvidia-gridd", "nvidia-topologyd"} {
		if !slices.ContainsFunc(st.Daemons, func(d status.Daemon) bool { return d.Name == want }) {
			t.Errorf("status.json lacks the daemon %s: %+v", want, st.Daemons)
		}
	}

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run after SIGTERM = %v", err)
	}
	got := daemonsLog(t)
	if want := []string{"nvidia-topologyd stop", "nvidia-gridd stop"}; !slices.Equal(got[2:], want) {
		t.Errorf("stops %q, want %q (reverse start order)", got[2:], want)
	}
	w.assertClean(t) // the copies are removed again, and /etc/nvidia with them
	if _, err := os.Stat(w.roots.InRoot("etc/nvidia")); !os.IsNotExist(err) {
		t.Errorf("/etc/nvidia left behind: %v", err)
	}
}

func TestPassthroughStartsNoVGPUDaemons(t *testing.T) {
	w := newWorld(t)
	setDaemonsLog(t)
	w.writeTree(t, vgpuFiles())
	a := w.agent(t) // DRIVER_TYPE defaults to passthrough
	cancel, done := startAgent(a)
	defer cancel()
	w.waitReady(t, done)
	if got := daemonsLog(t); !slices.Equal(got, []string{""}) {
		t.Errorf("a passthrough node started %q", got)
	}
	if _, err := os.Stat(w.roots.InRoot("etc/nvidia/gridd.conf")); !os.IsNotExist(err) {
		t.Errorf("gridd.conf copied on a passthrough node: %v", err)
	}
	st := w.readStatus(t)
	if slices.ContainsFunc(st.Daemons, func(d status.Daemon) bool {
		return strings.Contains(d.Name, "gridd") || strings.Contains(d.Name, "topologyd")
	}) || st.Fabric != "" || st.FabricDetail != "" {
		t.Errorf("status.json on a passthrough node without NVSwitches: daemons %+v, fabric %q (%q)", st.Daemons, st.Fabric, st.FabricDetail)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	w.assertClean(t)
}

// nvswitchWorld is newWorld with NVSwitches, fabric manager and, when smi is set, an
// nvidia-smi whose -q output is smi[0] on the first call, smi[1] on the second, ... and the last
// one from then on (each a file under pkg/fabric/testdata/nvidia-smi).
func nvswitchWorld(t *testing.T, smi ...string) *world {
	t.Helper()
	w := newWorld(t)
	setDaemonsLog(t)
	tree := map[string]string{
		"proc/driver/nvidia-nvswitch/devices/0000:05:00.0/information": "Fabric ID: 0\n",
		"container/usr/share/nvidia/nvswitch/fabricmanager.cfg":        "LOG_LEVEL=4\nLOG_FILE_NAME=/var/log/fabricmanager.log\nDAEMONIZE=1\nFABRIC_MODE=0\n",
		"container/usr/bin/nv-fabricmanager":                           fakeFabricManager,
	}
	if len(smi) > 0 {
		tree["container/usr/bin/nvidia-smi"] = fakeNvidiaSMI
		dir := t.TempDir()
		t.Setenv("FAKE_SMI_DIR", dir)
		for i, name := range smi {
			data, err := os.ReadFile(filepath.Join("../fabric/testdata/nvidia-smi", name))
			if err != nil {
				t.Fatal(err)
			}
			hosttest.Must(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("%d.txt", i+1)), data, 0o644))
			if i == len(smi)-1 {
				hosttest.Must(t, os.WriteFile(filepath.Join(dir, "last.txt"), data, 0o644))
			}
		}
	}
	w.writeTree(t, tree)
	return w
}

func smiCalls(t *testing.T) string {
	t.Helper()
	data, _ := os.ReadFile(filepath.Join(os.Getenv("FAKE_SMI_DIR"), "calls"))
	return strings.TrimSpace(string(data))
}

func fabricAgent(t *testing.T, w *world) *Agent {
	t.Helper()
	a := w.agent(t)
	a.FabricSettle, a.FabricPoll, a.FabricTimeout = 50*time.Millisecond, 20*time.Millisecond, time.Minute
	return a
}

// TestFabricStateGatesReadiness runs fabric manager on an NVSwitch node and reads the fabric
// state from a fake nvidia-smi: in progress then completed is Ready with the state in status.json
// and the metrics; no nvidia-smi is Ready with the state unknown.
func TestFabricStateGatesReadiness(t *testing.T) {
	cases := []struct {
		name         string
		smi          []string
		calls        string
		fabric       string // status.json's fabric
		fabricDetail string // and fabricDetail
		metric       string
	}{
		{name: "in progress, then completed", smi: []string{"h100-in-progress.txt", "h100-completed.txt"}, calls: "2",
			fabric: "completed", fabricDetail: "2 GPUs Completed/Success", metric: `driver_agent_fabric_state{state="completed"} 1`},
		{name: "no nvidia-smi in the image",
			fabric: "unknown", fabricDetail: "nvidia-smi is not in the image"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := nvswitchWorld(t, c.smi...)
			a := fabricAgent(t, w)
			var mu sync.Mutex
			var addr string
			a.OnListen = func(s string) { mu.Lock(); addr = s; mu.Unlock() }
			cancel, done := startAgent(a)
			defer cancel()
			w.waitReady(t, done)

			if got := daemonsLog(t); !slices.Equal(got, []string{"nv-fabricmanager start [-c " + w.roots.InRun("nvidia/driver-agent/fabricmanager.cfg") + "]"}) {
				t.Errorf("fabric manager started as %q", got)
			}
			if got := smiCalls(t); got != c.calls {
				t.Errorf("nvidia-smi -q ran %q times, want %q", got, c.calls)
			}
			if st := w.readStatus(t); st.Fabric != c.fabric || st.FabricDetail != c.fabricDetail {
				t.Errorf("status.json: fabric %q (%q), want %q (%q)", st.Fabric, st.FabricDetail, c.fabric, c.fabricDetail)
			}
			mu.Lock()
			resp, err := http.Get("http://" + addr + "/metrics")
			mu.Unlock()
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if c.metric != "" && !strings.Contains(string(body), c.metric) {
				t.Errorf("metrics lack %s", c.metric)
			}
			if c.metric == "" && strings.Contains(string(body), "driver_agent_fabric_state{") {
				t.Errorf("a fabric state metric although the state is unknown")
			}

			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if got := daemonsLog(t); got[len(got)-1] != "nv-fabricmanager stop" {
				t.Errorf("fabric manager not stopped with SIGTERM: %q", got)
			}
			w.assertClean(t)
		})
	}
}

// captureFiles is the real filesystem that also keeps what was written to each file name.
type captureFiles struct {
	host.OSFiles
	mu     sync.Mutex
	writes map[string]string
}

func (f *captureFiles) WriteFile(path string, data []byte, perm os.FileMode, atomic bool) error {
	f.mu.Lock()
	if f.writes == nil {
		f.writes = map[string]string{}
	}
	f.writes[filepath.Base(path)] = string(data)
	f.mu.Unlock()
	return f.OSFiles.WriteFile(path, data, perm, atomic)
}

func (f *captureFiles) last(name string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.writes[name]
}

// TestFabricFailureIsNotReady: a fabric that reports a failure, or stays in progress past the
// timeout, with fabric manager up ends init with exit code 9 and the GPUs named; status.json says
// so while the agent tears down, Ready is never written and everything is undone.
func TestFabricFailureIsNotReady(t *testing.T) {
	cases := []struct {
		name    string
		smi     []string
		timeout time.Duration // generous where the test must not depend on the machine's speed
		want    []string
		fabric  string // in the last status.json written
	}{
		{name: "a GPU reports an error", smi: []string{"h100-in-progress.txt", "h100-insufficient-resources.txt"}, timeout: time.Minute,
			want:   []string{"the NVSwitch fabric reports a failure although nv-fabricmanager is running", "1 of 2 GPUs: GPU 00000000:2A:00.0: Completed/Insufficient Resources"},
			fabric: "failed"},
		{name: "in progress past the timeout", smi: []string{"h100-not-started.txt", "h100-in-progress.txt"}, timeout: 300 * time.Millisecond,
			want:   []string{"the NVSwitch fabric is still in progress 300ms after nv-fabricmanager came up", "GPU 00000000:2A:00.0: "}, // Not Started or In Progress, by the machine's speed
			fabric: "in_progress"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := nvswitchWorld(t, c.smi...)
			a := fabricAgent(t, w)
			a.FabricTimeout = c.timeout
			var phases []string
			a.BeforePhase = func(p string) { phases = append(phases, p) }
			files := &captureFiles{}
			a.Host.Files = files
			err := a.Run(context.Background())
			if !errors.Is(err, exitcode.ErrDaemon) || exitcode.Code(err) != 9 {
				t.Fatalf("Run = %v (code %d), want a daemon failure (9)", err, exitcode.Code(err))
			}
			for _, want := range c.want {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q lacks %q", err, want)
				}
			}
			if slices.Contains(phases, PhaseReady) || slices.Contains(phases, PhaseShareRoot) {
				t.Errorf("phases %v ran past the daemons", phases)
			}
			if got := daemonsLog(t); got[len(got)-1] != "nv-fabricmanager stop" {
				t.Errorf("fabric manager not stopped: %q", got)
			}
			var last status.Status
			if err := json.Unmarshal([]byte(files.last("status.json")), &last); err != nil || last.Fabric != c.fabric {
				t.Errorf("the last status.json written says fabric %q (%v), want %q:\n%s", last.Fabric, err, c.fabric, files.last("status.json"))
			}
			// The failed run leaves only status.json, with its error, for `driver-agent status`
			// and for the next start's previous-shutdown figure.
			if got := previousShutdown(status.Paths{Run: w.roots.Run}); got != "error" {
				t.Errorf("the next start would see the previous shutdown as %q, want error; status.json:\n%s", got, w.read(t, "run/nvidia/driver-agent/status.json"))
			}
			os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
			w.assertClean(t)
		})
	}
}

// TestDryRunPlansVGPUAndFabric: the plan of a vGPU guest on an NVSwitch node names the copies,
// the vGPU daemons and the fabric-state check, and changes nothing.
func TestDryRunPlansVGPUAndFabric(t *testing.T) {
	w := nvswitchWorld(t, "h100-completed.txt")
	w.writeTree(t, vgpuFiles())
	a := w.agent(t, "--dry-run", "--driver-type", "vgpu")
	rec := &host.Recorder{}
	a.Recorder, a.Host = rec, host.DryRun(w.roots, rec)
	var out strings.Builder
	a.Out = &out
	if err := a.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.assertClean(t)
	plan := out.String()
	for _, want := range []string{
		w.roots.InRoot("etc/nvidia/gridd.conf"),
		"exec " + w.roots.InRoot("usr/bin/nvidia-gridd"),
		"exec " + w.roots.InRoot("usr/bin/nvidia-topologyd"),
		"exec " + w.roots.InRoot("usr/bin/nv-fabricmanager"),
		"would read the fabric state with " + w.roots.InRoot("usr/bin/nvidia-smi") + " -q",
	} {
		if !strings.Contains(plan, want) {
			t.Errorf("plan lacks %q:\n%s", want, plan)
		}
	}
	if data, _ := os.ReadFile(filepath.Join(os.Getenv("FAKE_SMI_DIR"), "calls")); len(data) != 0 {
		t.Error("a dry run ran nvidia-smi")
	}
}
