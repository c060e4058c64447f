package metrics

import (
	"bytes"
	"context"
	"flag"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"
	"go.uber.org/goleak"

	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var update = flag.Bool("update", false, "rewrite testdata/*.golden")

type fixed struct {
	mu sync.Mutex
	s  Snapshot
}

func (f *fixed) Snapshot() Snapshot {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.s
}

func (f *fixed) set(fn func(*Snapshot)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(&f.s)
}

func fixture() Snapshot {
	return Snapshot{
		AgentVersion: "v0.1.0", DriverVersion: "535.309.01", DriverBranch: 535, Flavor: "kernel", Kernel: "6.6.95-flatcar",
		OS: "flatcar 4230.2.1", InstallPath: "precompiled", Phase: "wait",
		Phases: []string{"detect", "load", "wait"},
		Timing: []PhaseDuration{{"detect", 0.012}, {"load", 1.5}, {"wait", 30}},
		Ready:  true, Alive: true,
		Modules:     []Module{{"nvidia", "535.309.01"}, {"nvidia_uvm", "535.309.01"}},
		DeviceNodes: 5, GPUs: 1, NVSwitches: 0,
		Daemons:     []Daemon{{Name: "nvidia-persistenced", Up: true, Restarts: 2}},
		FabricState: "completed", DownloadBytes: 123456, DownloadSeconds: 4.5, BuildSeconds: 170, CacheHits: 1, CacheMisses: 2,
		Errors: map[string]float64{"load": 1}, LastShutdown: "in_use",
	}
}

func agentMetricNames(t *testing.T, exposition string) []string {
	t.Helper()
	var names []string
	for _, line := range strings.Split(exposition, "\n") {
		if name, ok := strings.CutPrefix(line, "# TYPE "); ok {
			names = append(names, strings.Fields(name)[0])
		}
	}
	return names
}

// TestGoldenExposition compares the agent's metrics for a fixture state with testdata/agent.golden
// (regenerate with go test ./pkg/metrics -update).
func TestGoldenExposition(t *testing.T) {
	c := NewCollector(&fixed{s: fixture()})
	golden := "testdata/agent.golden"
	if *update {
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(c)
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
		for _, f := range families {
			if err := enc.Encode(f); err != nil {
				t.Fatal(err)
			}
		}
		hosttest.Must(t, os.WriteFile(golden, buf.Bytes(), 0o644))
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	names := agentMetricNames(t, string(want))
	if len(names) < 15 {
		t.Fatalf("golden file has only %d metric families", len(names))
	}
	if err := testutil.CollectAndCompare(c, strings.NewReader(string(want)), names...); err != nil {
		t.Error(err)
	}
	if lint, err := testutil.CollectAndLint(c); err != nil || len(lint) > 0 {
		t.Errorf("lint: %v %+v", err, lint)
	}
}

// TestEndpoints runs the real server on loopback: /readyz follows readiness, /metrics has the
// phase, the Go and process collectors, and passes promtool check metrics.
func TestEndpoints(t *testing.T) {
	src := &fixed{s: fixture()}
	src.set(func(s *Snapshot) { s.Ready, s.Phase = false, "load" })
	srv, err := Start("127.0.0.1:0", src, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown(context.Background())
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + srv.Addr() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, body := get("/readyz"); code != 503 || !strings.Contains(body, "phase load") {
		t.Errorf("/readyz before ready: %d %q", code, body)
	}
	code, body := get("/metrics")
	if code != 200 || !strings.Contains(body, `driver_agent_phase{phase="load"} 1`) || !strings.Contains(body, "go_goroutines") || !strings.Contains(body, "process_") {
		t.Errorf("/metrics: %d\n%s", code, body)
	}
	promtool(t, []string{"check", "metrics"}, body)
	src.set(func(s *Snapshot) { s.Ready = true })
	if code, _ := get("/readyz"); code != 200 {
		t.Errorf("/readyz when ready: %d", code)
	}
	if code, _ := get("/healthz"); code != 200 {
		t.Errorf("/healthz: %d", code)
	}
	src.set(func(s *Snapshot) { s.Alive = false })
	if code, _ := get("/healthz"); code != 503 {
		t.Errorf("/healthz with a stuck loop: %d", code)
	}
	if code, _ := get("/debug/pprof/"); code != 404 {
		t.Errorf("pprof is served: %d", code)
	}
	if err := srv.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// stuck is a Source whose Snapshot blocks until released: a scrape in flight.
type stuck struct {
	entered chan struct{}
	release chan struct{}
}

func (s *stuck) Snapshot() Snapshot {
	s.entered <- struct{}{}
	<-s.release
	return fixture()
}

// TestShutdownAfterTheDeadline: the teardown may spend its whole deadline on the driver before
// the metrics server's turn; Shutdown with that ended context still stops the server (in about
// the grace, cutting the scrape in flight) and reports no error, since a cut scrape is not a
// failed teardown.
func TestShutdownAfterTheDeadline(t *testing.T) {
	src := &stuck{entered: make(chan struct{}, 1), release: make(chan struct{})}
	defer close(src.release)
	srv, err := Start("127.0.0.1:0", src, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	scraped := make(chan error, 1)
	go func() {
		resp, err := http.Get("http://" + srv.Addr() + "/metrics")
		if err == nil {
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		scraped <- err
	}()
	<-src.entered
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Errorf("Shutdown after the deadline = %v, want nil", err)
	}
	if err := <-scraped; err == nil {
		t.Error("the scrape in flight completed; want it cut when the server closed")
	}
	if _, err := http.Get("http://" + srv.Addr() + "/readyz"); err == nil {
		t.Error("the server still answers after Shutdown")
	}
}

// promtool runs Prometheus's own checker (Debian's prometheus package; make deps installs it).
func promtool(t *testing.T, args []string, stdin string) {
	t.Helper()
	bin, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool not found: run make deps (apt-get install prometheus)")
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdin = strings.NewReader(stdin)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool %v: %v\n%s", args, err, out)
	}
}
