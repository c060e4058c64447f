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
