package fabric_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/daemon/daemontest"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/fabric"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// node unpacks testdata/<name>.txtar and returns its roots.
func node(t *testing.T, name string) host.Roots {
	t.Helper()
	return hosttest.Roots(t, hosttest.UnpackFile(t, filepath.Join("testdata", name+".txtar")))
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestDetectNode(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		fixture    string
		kind       fabric.Kind
		switches   int
		management string
		reason     string
	}{
		{"nvswitch", fabric.KindNVSwitch, 2, "", "2 NVSwitch devices in"},
		{"nvlink5", fabric.KindNVLink5, 0, "mlx5_1,mlx5_2", "NVLink5 switch management on mlx5_1, mlx5_2"},
		{"plain", fabric.KindNone, 0, "", "no NVSwitch in"},
	} {
		n, err := fabric.DetectNode(node(t, tc.fixture))
		if err != nil {
			t.Fatalf("%s: %v", tc.fixture, err)
		}
		if n.Kind != tc.kind || len(n.NVSwitches) != tc.switches || strings.Join(n.SwitchManagement, ",") != tc.management ||
			!strings.Contains(n.Reason, tc.reason) {
			t.Errorf("%s: %+v", tc.fixture, n)
		}
	}
	// Nothing at all under proc and sys: no fabric.
	if n, err := fabric.DetectNode(hosttest.Roots(t, t.TempDir())); err != nil || n.Kind != fabric.KindNone {
		t.Errorf("empty tree: %+v, %v", n, err)
	}
}

// NodeOf decides on the switch trays it is given, without reading the VPDs again, and fails only
// when every VPD was unreadable and nothing else classifies the node.
func TestNodeOf(t *testing.T) {
	t.Parallel()
	r := hosttest.Roots(t, t.TempDir())
	n, err := fabric.NodeOf(detect.SwitchTrays{Management: []string{"mlx5_3"}, VPDs: 1}, r)
	if err != nil || n.Kind != fabric.KindNVLink5 || strings.Join(n.SwitchManagement, ",") != "mlx5_3" {
		t.Errorf("NodeOf with a tray = %+v, %v; want NVLink5 on mlx5_3", n, err)
	}
	boom := errors.New("boom")
	if _, err := fabric.NodeOf(detect.SwitchTrays{VPDs: 1, Unreadable: []error{boom}}, r); !errors.Is(err, boom) {
		t.Errorf("NodeOf with every VPD unreadable = %v, want the read error", err)
	}
}

func TestManagementPort(t *testing.T) {
	t.Parallel()
	r := node(t, "nvlink5")
	p, err := fabric.ManagementPort(r.Sys, []string{"mlx5_2", "mlx5_1"})
	if err != nil {
		t.Fatal(err)
	}
	if p.Device != "mlx5_2" || p.Number != 1 || p.GUIDString() != "0xb83fd20300c41a2e" {
		t.Errorf("port %+v (%s): want mlx5_2 port 1, 0xb83fd20300c41a2e (mlx5_1's port has SM disabled)", p, p.GUIDString())
	}

	// Only the SM-disabled port: an error that says why.
	_, err = fabric.ManagementPort(r.Sys, []string{"mlx5_1"})
	if !errors.Is(err, exitcode.ErrDaemon) || !strings.Contains(err.Error(), "mlx5_1 port 1: subnet manager disabled (capability mask 0x2651ec48)") {
		t.Errorf("ManagementPort(mlx5_1) = %v", err)
	}
	// An Ethernet port, a zero GUID, a garbled mask: skipped, each with its reason.
	writeFile(t, r.InSys("class/infiniband/mlx5_3/ports/1/link_layer"), "Ethernet\n")
	writeFile(t, r.InSys("class/infiniband/mlx5_3/ports/2/cap_mask"), "0x2651e848\n")
	writeFile(t, r.InSys("class/infiniband/mlx5_3/ports/2/gids/0"), "fe80:0000:0000:0000:0000:0000:0000:0000\n")
	writeFile(t, r.InSys("class/infiniband/mlx5_3/ports/10/cap_mask"), "zz\n")
	_, err = fabric.ManagementPort(r.Sys, []string{"mlx5_3", "mlx5_9"})
	for _, want := range []string{"mlx5_3 port 1: link layer Ethernet", "mlx5_3 port 2: GUID is zero", `mlx5_3 port 10: capability mask "zz" is not a number`, "mlx5_9: "} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error %v lacks %q", err, want)
		}
	}
	if _, err := fabric.ManagementPort(r.Sys, nil); err == nil {
		t.Error("no devices: no error")
	}
}

func TestParseGUID(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]uint64{
		"fe80:0000:0000:0000:0002:c903:0029:7de1": 0x0002c90300297de1,
		"fe80:0000:0000:0000:b83f:d203:00c4:1a2e": 0xb83fd20300c41a2e,
		"fe80:0:0:0:1:2:3:4":                      0x0001000200030004,
	} {
		if got, err := fabric.ParseGUID(in); err != nil || got != want {
			t.Errorf("ParseGUID(%q) = %#x, %v", in, got, err)
		}
	}
	for _, bad := range []string{"", "fe80::1", "fe80:0000:0000:0000:0002:c903:0029", "fe80:0000:0000:0000:0002:c903:0029:7de1x", "fe80:0000:0000:0000:0002:c903:0029:-1"} {
		if _, err := fabric.ParseGUID(bad); err == nil {
			t.Errorf("ParseGUID(%q) accepted", bad)
		}
	}
}

// options for Prepare on a fixture, writing the private config under run/.
func options(r host.Roots) fabric.Options {
	return fabric.Options{
		Roots:      r,
		Files:      host.OSFiles{},
		ConfigCopy: r.InRun("nvidia/driver-agent/fabricmanager.cfg"),
		SettleTime: 2 * time.Second,
	}
}

// commandLines renders the plan's daemons with the fixture's directory shown as <node>.
func commandLines(r host.Roots, p fabric.Plan) []string {
	base := filepath.Dir(r.Root)
	var out []string
	for _, d := range p.Daemons {
		out = append(out, d.Name+": "+strings.ReplaceAll(d.CommandLine(), base, "<node>"))
	}
	return out
}

func assertLines(t *testing.T, got, want []string) {
	t.Helper()
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("daemons:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestPrepareNVSwitch(t *testing.T) {
	t.Parallel()
	r := node(t, "nvswitch")
	o := options(r)
	o.Overrides = map[string]string{"FABRIC_MODE": "1", "LOG_LEVEL": "3"}
	p, err := fabric.Prepare(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	assertLines(t, commandLines(r, p), []string{
		"nv-fabricmanager: <node>/container/usr/bin/nv-fabricmanager -c <node>/run/nvidia/driver-agent/fabricmanager.cfg",
	})
	if p.Node.Kind != fabric.KindNVSwitch || p.Port != nil || !p.ResetGPUs || p.ConfigPath != o.ConfigCopy {
		t.Errorf("plan %+v", p)
	}
	fm := p.Daemons[0]
	if !fm.Required || fm.UpAfter != 2*time.Second || fm.PIDFile != "" {
		t.Errorf("fabric manager spec %+v", fm)
	}
	got, err := os.ReadFile(o.ConfigCopy)
	if err != nil {
		t.Fatal(err)
	}
	if want := "# shipped settings\nLOG_LEVEL=3\nLOG_FILE_NAME=\nDAEMONIZE=0\nFABRIC_MODE=1\nLOG_USE_SYSLOG=0\n"; string(got) != want {
		t.Errorf("written config %q, want %q", got, want)
	}
	if err := fm.Prepare(); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(r.InRoot("var/run/nvidia-fabricmanager")); err != nil || !fi.IsDir() {
		t.Errorf("fabric manager's run directory: %v", err)
	}
}

func TestPrepareNVLink5(t *testing.T) {
	t.Parallel()
	r := node(t, "nvlink5")
	p, err := fabric.Prepare(context.Background(), options(r))
	if err != nil {
		t.Fatal(err)
	}
	assertLines(t, commandLines(r, p), []string{
		"nvlsm: <node>/container/opt/nvidia/nvlsm/sbin/nvlsm --config <node>/container/usr/share/nvidia/nvlsm/nvlsm.conf" +
			" --guid 0xb83fd20300c41a2e --pid_file <node>/container/var/run/nvidia-fabricmanager/nvlsm.pid --log_file stdout",
		"nv-fabricmanager: <node>/container/usr/bin/nv-fabricmanager -c <node>/run/nvidia/driver-agent/fabricmanager.cfg" +
			" --fm-sm-mgmt-port-guid 0xb83fd20300c41a2e",
	})
	if p.Port == nil || p.Port.Device != "mlx5_2" || p.ResetGPUs {
		t.Errorf("plan %+v", p)
	}

	// nvlsm is up when its socket for fabric manager exists; a stale one is removed before a start.
	nvlsm := p.Daemons[0]
	socket := r.InRoot("var/run/nvidia-fabricmanager/fm_sm_ipc.socket")
	if nvlsm.Ready == nil || nvlsm.Prepare == nil {
		t.Fatal("nvlsm has no readiness check or preparation")
	}
	if err := nvlsm.Prepare(); err != nil {
		t.Fatal(err)
	}
	if err := nvlsm.Ready(context.Background()); err == nil {
		t.Error("ready before the socket exists")
	}
	l, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := nvlsm.Ready(context.Background()); err != nil {
		t.Errorf("not ready with the socket there: %v", err)
	}
	l.Close()
	if err := nvlsm.Prepare(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stale socket not removed: %v", err)
	}
}

// Without ib_umad the wait is bounded; it succeeds when the module shows up in time.
func TestPrepareNVLink5WaitsForIBUmad(t *testing.T) {
	t.Parallel()
	for _, appears := range []bool{false, true} {
		r := node(t, "nvlink5")
		modules, err := os.ReadFile(r.InProc("modules"))
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, r.InProc("modules"), strings.Replace(string(modules), "ib_umad 45056 0 - Live 0x0000000000000000\n", "", 1))
		clock := daemontest.NewClock(time.Unix(0, 0))
		o := options(r)
		o.Clock, o.PrereqTimeout, o.PrereqInterval = clock, 2*time.Minute, 5*time.Second
		type result struct {
			p   fabric.Plan
			err error
		}
		res := make(chan result, 1)
		go func() {
			p, err := fabric.Prepare(context.Background(), o)
			res <- result{p, err}
		}()
		deadline := clock.Next(t)
		tick := clock.Next(t)
		if deadline.D != 2*time.Minute || tick.D != 5*time.Second {
			t.Fatalf("timers %s and %s", deadline.D, tick.D)
		}
		if appears {
			writeFile(t, r.InProc("modules"), string(modules))
			tick.Fire()
		} else {
			deadline.Fire()
		}
		got := <-res
		if appears {
			if got.err != nil || len(got.p.Daemons) != 2 {
				t.Errorf("ib_umad appeared: %+v, %v", got.p, got.err)
			}
			continue
		}
		if !errors.Is(got.err, exitcode.ErrDaemon) || !strings.Contains(got.err.Error(), "kernel modules ib_umad not loaded within 2m0s") {
			t.Errorf("Prepare = %v", got.err)
		}
		if len(got.p.Daemons) != 0 {
			t.Errorf("daemons planned without ib_umad: %v", commandLines(r, got.p))
		}
		if _, err := os.Stat(o.ConfigCopy); !errors.Is(err, os.ErrNotExist) {
			t.Error("config written although the node is not ready for it")
		}
	}
}

// A dry run does not wait: the missing module is a warning and the plan is complete.
func TestPrepareNoWait(t *testing.T) {
	t.Parallel()
	r := node(t, "nvlink5")
	writeFile(t, r.InProc("modules"), "mlx5_core 2293760 0 - Live 0x0000000000000000\n")
	o := options(r)
	o.NoWait = true
	rec := &host.Recorder{}
	o.Files = rec
	p, err := fabric.Prepare(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Daemons) != 2 || len(p.Warnings) == 0 || !strings.Contains(p.Warnings[0], "kernel modules ib_umad are not loaded; init would wait up to 5m0s") {
		t.Errorf("plan %+v", p)
	}
	if _, err := os.Stat(o.ConfigCopy); !errors.Is(err, os.ErrNotExist) {
		t.Error("a dry run wrote the config")
	}
	if len(rec.Actions()) == 0 {
		t.Error("the config write was not recorded")
	}
}

func TestPreparePlainNode(t *testing.T) {
	t.Parallel()
	r := node(t, "plain")
	o := options(r)
	o.Overrides = map[string]string{"FABRIC_MODE": "1"}
	p, err := fabric.Prepare(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if p.Node.Kind != fabric.KindNone || len(p.Daemons) != 0 || p.ConfigPath != "" || !strings.Contains(p.Node.Reason, "no fabric manager needed") {
		t.Errorf("plan %+v", p)
	}
	if _, err := os.Stat(o.ConfigCopy); !errors.Is(err, os.ErrNotExist) {
		t.Error("config written on a node without NVSwitches")
	}
}

func TestPrepareBadOverrides(t *testing.T) {
	t.Parallel()
	o := options(node(t, "nvswitch"))
	o.Overrides = map[string]string{"log_level": "4"}
	if _, err := fabric.Prepare(context.Background(), o); !errors.Is(err, exitcode.ErrConfig) {
		t.Fatalf("Prepare = %v", err)
	}
}

// The specs run under the supervisor as they are: their defaults validate.
func TestPlanSpecsAreValid(t *testing.T) {
	t.Parallel()
	r := node(t, "nvlink5")
	p, err := fabric.Prepare(context.Background(), options(r))
	if err != nil {
		t.Fatal(err)
	}
	reaper, err := daemon.NewReaper(daemon.ReaperOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer reaper.Close()
	for _, s := range p.Daemons {
		if _, err := daemon.NewRunner(s, daemon.Options{Procs: reaper}); err != nil {
			t.Errorf("%s: %v", s.Name, err)
		}
	}
}
