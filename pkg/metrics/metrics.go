// Package metrics serves the agent's Prometheus metrics, /healthz and /readyz from its own
// registry and HTTP server. Every value is read at scrape time from one Snapshot of the agent's
// state, so what /metrics says and what status.json says never disagree.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Snapshot is the agent's state as the metrics see it.
type Snapshot struct {
	AgentVersion  string
	DriverVersion string
	DriverBranch  int
	Flavor        string
	Kernel        string
	OS            string
	InstallPath   string

	Phase  string          // the current phase
	Phases []string        // every phase name, for the state set
	Timing []PhaseDuration // phases run so far
	Ready  bool
	Alive  bool // the agent's loop answered recently

	Modules     []Module
	DeviceNodes int
	GPUs        int
	NVSwitches  int
	Daemons     []Daemon
	FabricState string // empty until fabric manager reports

	DownloadBytes   float64
	DownloadSeconds float64
	BuildSeconds    float64
	CacheHits       float64
	CacheMisses     float64
	Errors          map[string]float64 // by phase
	LastShutdown    string             // result of the previous agent's shutdown on this node
}

// PhaseDuration is how long a phase took (or has taken so far).
type PhaseDuration struct {
	Phase   string
	Seconds float64
}

// Module is a loaded NVIDIA module.
type Module struct{ Name, Version string }

// Daemon is a supervised daemon.
type Daemon struct {
	Name     string
	Up       bool
	Restarts float64
}

// Source provides snapshots.
type Source interface{ Snapshot() Snapshot }

const ns = "driver_agent"

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(ns, "", name), help, labels, nil)
}

// Collector turns a Snapshot into metrics at scrape time.
type Collector struct {
	src                                                                  Source
	buildInfo, phase, phaseDuration, ready, module, deviceNodes, gpus    *prometheus.Desc
	nvswitches, daemonUp, daemonRestarts, fabric, downloadBytes          *prometheus.Desc
	downloadSeconds, buildSeconds, cacheHits, cacheMisses, errorsByPhase *prometheus.Desc
	lastShutdown                                                         *prometheus.Desc
}

// NewCollector returns a collector over src.
func NewCollector(src Source) *Collector {
	return &Collector{
		src:             src,
		buildInfo:       desc("build_info", "Agent and driver identity; always 1.", "agent_version", "driver_version", "driver_branch", "flavor", "kernel_release", "os", "install_path"),
		phase:           desc("phase", "The phase the agent is in (1) and the others (0).", "phase"),
		phaseDuration:   desc("phase_duration_seconds", "How long each phase took, or has taken so far.", "phase"),
		ready:           desc("ready", "1 when the driver is ready (the rule of .driver-daemons-status)."),
		module:          desc("module_loaded", "NVIDIA kernel modules loaded, with their version.", "module", "version"),
		deviceNodes:     desc("device_nodes", "NVIDIA device nodes the agent created."),
		gpus:            desc("gpus", "NVIDIA GPUs found on the PCI bus."),
		nvswitches:      desc("nvswitches", "NVSwitches found on the PCI bus."),
		daemonUp:        desc("daemon_up", "1 while the daemon is running.", "daemon"),
		daemonRestarts:  desc("daemon_restarts_total", "Restarts of the daemon since the agent started.", "daemon"),
		fabric:          desc("fabric_state", "Fabric manager state (1 for the current one).", "state"),
		downloadBytes:   desc("download_bytes_total", "Bytes downloaded (kernel build trees)."),
		downloadSeconds: desc("download_duration_seconds", "Time spent downloading."),
		buildSeconds:    desc("build_duration_seconds", "Time spent building kernel modules."),
		cacheHits:       desc("cache_hits_total", "Module cache hits."),
		cacheMisses:     desc("cache_misses_total", "Module cache misses."),
		errorsByPhase:   desc("errors_total", "Errors, by the phase they happened in.", "phase"),
		lastShutdown:    desc("last_shutdown_info", "How the previous agent on this node shut down; always 1.", "result"),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.buildInfo, c.phase, c.phaseDuration, c.ready, c.module, c.deviceNodes, c.gpus, c.nvswitches,
		c.daemonUp, c.daemonRestarts, c.fabric, c.downloadBytes, c.downloadSeconds, c.buildSeconds, c.cacheHits, c.cacheMisses, c.errorsByPhase, c.lastShutdown} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.src.Snapshot()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	branch := ""
	if s.DriverBranch > 0 {
		branch = strconv.Itoa(s.DriverBranch)
	}
	gauge(c.buildInfo, 1, s.AgentVersion, s.DriverVersion, branch, s.Flavor, s.Kernel, s.OS, s.InstallPath)
	for _, p := range s.Phases {
		gauge(c.phase, b2f(p == s.Phase), p)
	}
	for _, t := range s.Timing {
		gauge(c.phaseDuration, t.Seconds, t.Phase)
	}
	gauge(c.ready, b2f(s.Ready))
	for _, m := range s.Modules {
		gauge(c.module, 1, m.Name, m.Version)
	}
	gauge(c.deviceNodes, float64(s.DeviceNodes))
	gauge(c.gpus, float64(s.GPUs))
	gauge(c.nvswitches, float64(s.NVSwitches))
	for _, d := range s.Daemons {
		gauge(c.daemonUp, b2f(d.Up), d.Name)
		counter(c.daemonRestarts, d.Restarts, d.Name)
	}
	if s.FabricState != "" {
		gauge(c.fabric, 1, s.FabricState)
	}
	counter(c.downloadBytes, s.DownloadBytes)
	gauge(c.downloadSeconds, s.DownloadSeconds)
	gauge(c.buildSeconds, s.BuildSeconds)
	counter(c.cacheHits, s.CacheHits)
	counter(c.cacheMisses, s.CacheMisses)
	for _, p := range s.Phases {
		counter(c.errorsByPhase, s.Errors[p], p)
	}
	if s.LastShutdown != "" {
		gauge(c.lastShutdown, 1, s.LastShutdown)
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// Registry returns a private registry with the Go and process collectors and c.
func Registry(c *Collector) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), c)
	return reg
}

// Server is the agent's HTTP endpoint.
type Server struct {
	srv *http.Server
	ln  net.Listener
	log *slog.Logger
	err chan error

	once    sync.Once
	stopErr error
}

// Handler serves /metrics, /healthz and /readyz for src. The registry is made at the first
// scrape: making the Go and process collectors costs milliseconds, which the first scrape pays
// instead of every start of the agent.
func Handler(src Source, log *slog.Logger) http.Handler {
	scrape := sync.OnceValue(func() http.Handler {
		return promhttp.HandlerFor(Registry(NewCollector(src)), promhttp.HandlerOpts{
			ErrorHandling:       promhttp.ContinueOnError,
			ErrorLog:            slog.NewLogLogger(log.Handler(), slog.LevelError),
			MaxRequestsInFlight: 4,
			Timeout:             10 * time.Second,
		})
	})
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) { scrape().ServeHTTP(w, req) }))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if !src.Snapshot().Alive {
			http.Error(w, "agent loop not responding", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		s := src.Snapshot()
		if !s.Ready {
			http.Error(w, "not ready: phase "+s.Phase, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	return mux
}

// Start listens on addr and serves in the background.
func Start(addr string, src Source, log *slog.Logger) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen %s: %w", addr, err)
	}
	s := &Server{
		srv: &http.Server{Handler: Handler(src, log), ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
			WriteTimeout: 30 * time.Second, IdleTimeout: 60 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)},
		ln: ln, log: log, err: make(chan error, 1),
	}
	go func() { s.err <- s.srv.Serve(ln) }()
	log.Info("serving metrics", "address", ln.Addr().String())
	return s, nil
}

// Addr is the address the server listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// shutdownGrace is how long Shutdown lets scrapes in flight finish when its context has already
// ended: the teardown may have spent its whole deadline on the driver.
const shutdownGrace = time.Second

// Shutdown stops the server: it stops listening, lets the scrapes in flight finish until ctx ends
// (or for shutdownGrace when it has ended already), and then closes what is left. A scrape cut
// short is not a failure of the teardown; the error is only the server's own. Later calls return
// the first call's result.
func (s *Server) Shutdown(ctx context.Context) error {
	s.once.Do(func() {
		if ctx.Err() != nil {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), shutdownGrace)
			defer cancel()
		}
		if err := s.srv.Shutdown(ctx); err != nil {
			s.log.Debug("closing the metrics connections still open", "error", err)
			s.srv.Close()
		}
		if serr := <-s.err; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
			s.stopErr = serr
		}
	})
	return s.stopErr
}
