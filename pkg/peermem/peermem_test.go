package peermem

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/cache"
	"github.com/driver-agent/driver-agent/pkg/daemon/daemontest"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/link"
	"github.com/driver-agent/driver-agent/pkg/status"
)

const banner = "Linux version 6.6.95-flatcar (build@pony) #1 SMP"

func setup(t *testing.T, withPeermem bool) (Options, *hosttest.FakeKernel) {
	t.Helper()
	dir := hosttest.Unpack(t, "-- proc/version --\n"+banner+"\n-- proc/sys/kernel/osrelease --\n6.6.95-flatcar\n-- proc/modules --\n")
	r := hosttest.Roots(t, dir)
	k := hosttest.NewFakeKernel(r, nil)
	if err := k.Preload("nvidia"); err != nil {
		t.Fatal(err)
	}
	st := status.Writer{Files: host.OSFiles{}, Paths: status.Paths{Run: r.Run}}
	st.Write(status.Status{Phase: "wait", DriverVersion: "535.309.01", Flavor: "kernel"})
	src := t.TempDir()
	var mods []link.Module
	names := []string{"nvidia"}
	if withPeermem {
		names = append(names, "nvidia-peermem")
	}
	for _, n := range names {
		p := filepath.Join(src, n+".ko")
		hosttest.Must(t, os.WriteFile(p, hosttest.ModuleELF("name="+strings.ReplaceAll(n, "-", "_"), "depends="), 0o644))
		mods = append(mods, link.Module{Name: strings.ReplaceAll(n, "-", "_"), Path: p})
	}
	cacheDir := filepath.Join(r.Run, "nvidia/driver-agent/cache")
	if _, err := cache.Store(cacheDir, cache.Key{Banner: banner, DriverVersion: "535.309.01", Flavor: "kernel"}, mods); err != nil {
		t.Fatal(err)
	}
	hosttest.Must(t, os.WriteFile(r.InDrivers("nvidia-peermem.conf"), []byte("peerdirect_support=1\n"), 0o644))
	h := host.Host{Roots: r, Kernel: k, Files: host.OSFiles{}}
	return Options{Host: h, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), CacheDir: cacheDir, Wait: 2 * time.Second, Poll: 20 * time.Millisecond}, k
}

func markReady(t *testing.T, r host.Roots) {
	t.Helper()
	for _, p := range []string{r.InRun("nvidia/validations/.driver-ctr-ready"), r.InRun("mellanox/drivers/.driver-ready")} {
		hosttest.Must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		hosttest.Must(t, os.WriteFile(p, nil, 0o644))
	}
}

func TestReloadWaitsLoadsAndUnloads(t *testing.T) {
	o, k := setup(t, true)
	clock := daemontest.NewClock(time.Unix(1_800_000_000, 0))
	o.Clock = clock
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Reload(ctx, o) }()
	poll := clock.Next(t) // Reload looked once, found nothing ready, and waits a poll
	if poll.D != o.Poll {
		t.Errorf("Reload polls every %s, want %s", poll.D, o.Poll)
	}
	if slices.Contains(k.Loaded(), "nvidia_peermem") {
		t.Fatal("loaded before MOFED and the driver were ready")
	}
	markReady(t, o.Host.Roots)
	clock.Advance(o.Poll)
	deadline := time.Now().Add(2 * time.Second)
	for !slices.Contains(k.Loaded(), "nvidia_peermem") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got, _ := os.ReadFile(o.Host.InSys("module/nvidia_peermem/parameters/peerdirect_support")); string(got) != "1\n" {
		t.Errorf("parameter from nvidia-peermem.conf = %q", got)
	}
	if msg, err := Probe(o.Host.Roots); err != nil || msg != "MOFED drivers are not ready, skipping probe to avoid container restarts..." {
		t.Errorf("probe without mlx5_core: %q %v", msg, err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if slices.Contains(k.Loaded(), "nvidia_peermem") {
		t.Error("nvidia_peermem left loaded after SIGTERM")
	}
}

func TestReloadGivesUp(t *testing.T) {
	o, _ := setup(t, true)
	start := time.Unix(1_800_000_000, 0)
	clock := daemontest.NewInstant(start)
	o.Clock = clock
	err := Reload(context.Background(), o)
	if !errors.Is(err, ErrNotReady) || !strings.Contains(err.Error(), ".driver-ready does not exist") {
		t.Errorf("Reload = %v", err)
	}
	if waited := clock.Now().Sub(start); waited < o.Wait || waited > o.Wait+o.Poll {
		t.Errorf("Reload gave up after %s on its clock, want %s (polling every %s)", waited, o.Wait, o.Poll)
	}
}

func TestReloadWithoutPeermemInThePackage(t *testing.T) {
	o, _ := setup(t, false)
	markReady(t, o.Host.Roots)
	err := Reload(context.Background(), o)
	if err == nil || !strings.Contains(err.Error(), "do not include nvidia-peermem") {
		t.Errorf("Reload = %v", err)
	}
}

func TestProbeFailsOnlyWhenMOFEDIsUpAndPeermemIsNot(t *testing.T) {
	o, k := setup(t, true)
	if err := k.Preload("mlx5_core"); err != nil {
		t.Fatal(err)
	}
	if _, err := Probe(o.Host.Roots); err == nil {
		t.Error("probe passed with mlx5_core loaded and nvidia_peermem missing")
	}
	k.Preload("nvidia_peermem")
	if msg, err := Probe(o.Host.Roots); err != nil || msg != "nvidia-peermem is loaded" {
		t.Errorf("probe = %q, %v", msg, err)
	}
}
