package cli

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/lock"
	"github.com/driver-agent/driver-agent/pkg/status"
)

func TestStatusCommand(t *testing.T) {
	run := t.TempDir()
	w := status.Writer{Files: host.OSFiles{}, Paths: status.Paths{Run: run}}
	w.Write(status.Status{Phase: "wait", Ready: true, InstallPath: "precompiled", DriverVersion: "535.309.01",
		Phases:  []status.Timing{{Name: "load", Result: "ok"}},
		Daemons: []status.Daemon{{Name: "nvidia-persistenced", State: "up"}}})
	var out, errOut strings.Builder
	if code := Main(context.Background(), []string{"nvidia-driver", "status", "--run", run}, nil, &out, &errOut); code != 0 {
		t.Fatalf("exit %d: %s", code, errOut.String())
	}
	for _, want := range []string{"phase:          wait (ready: true)", "install path:   precompiled", "daemon nvidia-persistenced: up"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("status output lacks %q:\n%s", want, out.String())
		}
	}
	out.Reset()
	if code := Main(context.Background(), []string{"driver-agent", "status", "--json", "--run", run}, nil, &out, &errOut); code != 0 {
		t.Fatalf("--json exit %d", code)
	}
	var s status.Status
	if err := json.Unmarshal([]byte(out.String()), &s); err != nil || s.Phase != "wait" || !s.Ready {
		t.Errorf("--json: %v %+v", err, s)
	}
	if code := Main(context.Background(), []string{"driver-agent", "status", "--run", t.TempDir()}, nil, &out, &errOut); code != 1 || !strings.Contains(errOut.String(), "no status at") {
		t.Errorf("no agent: exit %d, %q", code, errOut.String())
	}
}

func TestProbePeermemCommand(t *testing.T) {
	sys := t.TempDir()
	var out, errOut strings.Builder
	if code := Main(context.Background(), []string{"nvidia-driver", "probe_nvidia_peermem", "--sys", sys}, nil, &out, &errOut); code != 0 || !strings.Contains(out.String(), "MOFED drivers are not ready") {
		t.Errorf("without MOFED: exit %d, %q %q", code, out.String(), errOut.String())
	}
	hosttest.Must(t, os.MkdirAll(filepath.Join(sys, "module/mlx5_core"), 0o755))
	hosttest.Must(t, os.WriteFile(filepath.Join(sys, "module/mlx5_core/refcnt"), []byte("0\n"), 0o644))
	if code := Main(context.Background(), []string{"nvidia-driver", "probe_nvidia_peermem", "--sys", sys}, nil, &out, &errOut); code != 1 {
		t.Errorf("MOFED up, peermem missing: exit %d, want 1", code)
	}
}

// TestUnloadDryRun: unload --dry-run plans the real unloader's order with nothing removed and no
// lock taken; with the driver held it names the holder instead, and while init holds the lock
// it says a real unload would refuse.
func TestUnloadDryRun(t *testing.T) {
	dir := t.TempDir()
	r := hosttest.Roots(t, dir)
	k := hosttest.NewFakeKernel(r, map[string]hosttest.FakeModule{"nvidia_uvm": {Deps: []string{"nvidia"}}, "nvidia_modeset": {Deps: []string{"nvidia"}}})
	hosttest.Must(t, k.Preload("nvidia", "nvidia_uvm", "nvidia_modeset"))
	before := hosttest.Snapshot(t, dir)
	unload := func(extra ...string) string {
		t.Helper()
		var out, errOut strings.Builder
		args := append([]string{"driver-agent", "unload", "--dry-run", "--proc", r.Proc, "--sys", r.Sys, "--dev", r.Dev, "--run", r.Run}, extra...)
		if code := Main(context.Background(), args, nil, &out, &errOut); code != 0 {
			t.Fatalf("exit %d: %s", code, errOut.String())
		}
		if diff := hosttest.DiffSnapshots(before, hosttest.Snapshot(t, dir)); diff != "" {
			t.Fatalf("the dry run changed the tree:\n%s", diff)
		}
		if calls := k.Calls(); len(calls) != 0 {
			t.Fatalf("kernel calls %v", calls)
		}
		return out.String()
	}
	plan := unload()
	want := "  unload-module nvidia_modeset\n  unload-module nvidia_uvm\n  unload-module nvidia\n  remove " + filepath.Join(r.Run, "nvidia/nvidia-driver.state") + "\n"
	if !strings.HasPrefix(plan, "driver-agent unload plan (dry run: nothing was changed)\n") || !strings.Contains(plan, want) || strings.Contains(plan, "Note:") {
		t.Errorf("plan:\n%s\nwant the holders first, then nvidia and the digest:\n%s", plan, want)
	}

	k.Use("nvidia", 1)
	hosttest.Must(t, os.MkdirAll(filepath.Join(r.Proc, "4242/fd"), 0o755))
	hosttest.Must(t, os.Symlink("/dev/nvidia0", filepath.Join(r.Proc, "4242/fd/3")))
	hosttest.Must(t, os.WriteFile(filepath.Join(r.Proc, "4242/comm"), []byte("python3\n"), 0o644))
	before = hosttest.Snapshot(t, dir)
	plan = unload("--output", "json")
	var p unloadPlan
	if err := json.Unmarshal([]byte(plan), &p); err != nil {
		t.Fatalf("%v: %s", err, plan)
	}
	if len(p.Actions) != 0 || len(p.Notes) != 1 || !strings.Contains(p.Notes[0], "would fail: driver in use: could not unload NVIDIA driver kernel modules now") ||
		!strings.Contains(p.Notes[0], "pid 4242 (python3) has /dev/nvidia0 open") || !strings.Contains(p.Notes[0], "retries for up to 25s") {
		t.Errorf("held driver: %+v", p)
	}

	l, err := lock.Acquire(filepath.Join(r.Run, "nvidia/nvidia-driver.pid"), 777)
	hosttest.Must(t, err)
	defer l.Release()
	before = hosttest.Snapshot(t, dir)
	if plan := unload(); !strings.Contains(plan, "Note: would refuse to unload: ") || !strings.Contains(plan, "pid 777") || strings.Contains(plan, "unload-module") {
		t.Errorf("with init running:\n%s", plan)
	}
}

// TestReloadPeermemHasNoDryRun: a command that cannot plan refuses --dry-run before doing anything.
func TestReloadPeermemHasNoDryRun(t *testing.T) {
	var out, errOut strings.Builder
	code := Main(context.Background(), []string{"nvidia-driver", "reload_nvidia_peermem", "--dry-run", "--sys", t.TempDir()}, nil, &out, &errOut)
	if code != 2 || !strings.Contains(errOut.String(), "reload_nvidia_peermem has no dry run") {
		t.Errorf("exit %d, %q", code, errOut.String())
	}
}
