//go:build vmtest

package vm

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// driverVersion is the DRIVER_VERSION of the tests: the stand-ins' MODULE_VERSION and the
// packages' driver version.
const driverVersion = "580.95.05"

// persistencedMode is how the nvidia-persistenced stand-in starts (guest/nvidia-persistenced):
// "foreground" for an agent that supervises it as a child, "fork" for one that tracks the real
// daemon's PID file. DRIVER_AGENT_VM_PERSISTENCED overrides it.
const persistencedMode = "fork"

// group is one boot: the scenarios it runs, in order (see guest/scenarios.sh).
type group struct {
	name       string
	scenarios  []string
	packages   bool   // ship the precompiled packages (made for the banner learned from a boot)
	compressed bool   // ship the prerequisite modules as .ko.xz and .ko.zst
	bench      bool   // ship guest/bench.sh (make vm-bench)
	benchRuns  int    // VMTEST_BENCH_RUNS
	benchB     string // a second agent the bench runs beside the first (DRIVER_AGENT_VM_BENCH_B)
	memMiB     int    // guest memory; 0 means defaultMemMiB
	timeout    time.Duration
	modules    []string                            // more modules from the kernel image, beside the prerequisites
	extra      func(*testing.T, *harness, *rootfs) // adds the group's own files
}

func groups() []group {
	return []group{
		{name: "kernel", timeout: 3 * time.Minute,
			scenarios: []string{"raw-load", "raw-holders", "raw-link", "raw-enodev"}},
		{name: "lifecycle", packages: true, timeout: 6 * time.Minute,
			scenarios: []string{"banner", "dry-run", "lifecycle", "second-instance", "in-use", "fast-path", "reload-digest", "cache"}},
		{name: "failures", packages: true, compressed: true, timeout: 5 * time.Minute,
			scenarios: []string{"compressed-prereqs", "enodev", "sigterm-during-load", "no-match"}},
		{name: "fabric", packages: true, timeout: 4 * time.Minute,
			scenarios: []string{"fabric-manager", "fabric-manager-dies"}},
		{name: "holders", packages: true, timeout: 4 * time.Minute,
			scenarios: []string{"in-use-at-start", "foreign-holder"}},
		{name: "driver-root", packages: true, timeout: 3 * time.Minute,
			scenarios: []string{"driver-root-modprobe"}},
		sysextGroup(),
	}
}

// prerequisiteModules are the in-kernel modules the agent loads before nvidia (i2c_core is built
// into Debian's kernel); the guest gets them with their modules.dep closure.
func prerequisiteModules() []string { return []string{"ipmi_msghandler", "ipmi_devintf", "video"} }

// harness holds what one `go test` run builds once for a kernel and shares between its boots.
type harness struct {
	tl       *tools
	repo     string
	work     string
	agent    string
	standins map[string]standin
	applets  []string // busybox applet paths, relative to /
	ldFiles  []string // ld.bfd, its loader and libraries
	banner   string   // the guest kernel's /proc/version first line, learned from the first boot
	packages map[string][]byte
	timings  []string
}

// TestVM runs every group on each kernel: TestVM/<kernel>/<group>/<scenario>, e.g.
// TestVM/6.12/lifecycle/cache.
func TestVM(t *testing.T) {
	start := time.Now()
	kernels, err := findKernels()
	if err != nil {
		t.Fatal(err)
	}
	var timings []string
	for _, h := range setup(t, kernels, true) {
		t.Run(h.tl.name, func(t *testing.T) {
			for _, g := range groups() {
				t.Run(g.name, func(t *testing.T) { h.runGroup(t, g) })
			}
			t.Run("vmlinuz-banner", func(t *testing.T) { h.checkVmlinuzBanner(t) })
		})
		timings = append(timings, h.tl.name+" ("+h.tl.abi+"):")
		for _, l := range h.timings {
			timings = append(timings, "  "+l)
		}
	}
	timings = append(timings, fmt.Sprintf("total %s", since(start)))
	t.Logf("timings:\n  %s", strings.Join(timings, "\n  "))
}

func since(t time.Time) string { return time.Since(t).Round(10 * time.Millisecond).String() }

// setup builds the agent and, with standins, each kernel's stand-in modules (once per
// `go test`), and returns a harness for each kernel, in order.
func setup(t *testing.T, kernels []*tools, standins bool) []*harness {
	t.Helper()
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(repo, "go.mod")); err != nil {
		t.Fatalf("repository root: %v", err)
	}
	work := t.TempDir()
	ctx := context.Background()

	type built struct {
		path string
		err  error
		took time.Duration
	}
	agentDone := make(chan built, 1)
	go func() {
		t0 := time.Now()
		if p := os.Getenv("DRIVER_AGENT_VM_AGENT"); p != "" {
			// A prebuilt static agent, e.g. bin/driver-agent from `make build`.
			static, err := isStatic(p)
			if err == nil && !static {
				err = fmt.Errorf("DRIVER_AGENT_VM_AGENT=%s is not a static executable", p)
			}
			agentDone <- built{p, err, 0}
			return
		}
		p, err := buildAgent(ctx, repo, work)
		agentDone <- built{p, err, time.Since(t0)}
	}()
	var hs []*harness
	for _, tl := range kernels {
		h := &harness{tl: tl, repo: repo, work: filepath.Join(work, tl.name), standins: map[string]standin{}}
		if err := os.Mkdir(h.work, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Logf("kernel %s: %s (%s), headers %s, compiler %s", tl.name, tl.abi, tl.vmlinuz, tl.headers, cmp.Or(tl.cc, "gcc"))
		if standins {
			if err := h.buildStandins(ctx); err != nil {
				<-agentDone
				t.Fatal(err)
			}
		}
		hs = append(hs, h)
	}
	a := <-agentDone
	if a.err != nil {
		t.Fatal(a.err)
	}

	out, err := exec.Command(kernels[0].busybox, "--list-full").Output()
	if err != nil {
		t.Fatalf("%s --list-full: %v", kernels[0].busybox, err)
	}
	var applets []string
	for _, a := range strings.Fields(string(out)) {
		if a != "linuxrc" && !strings.HasSuffix(a, "/init") {
			applets = append(applets, a)
		}
	}
	libs, err := sharedLibraries(kernels[0].ld)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range hs {
		h.agent, h.applets, h.ldFiles = a.path, applets, append([]string{h.tl.ld}, libs...)
		h.timings = append(h.timings, fmt.Sprintf("agent build %s (shared)", a.took.Round(10*time.Millisecond)))
	}
	return hs
}

// buildStandins builds every variant of the stand-ins against the kernel's headers.
func (h *harness) buildStandins(ctx context.Context) error {
	t0 := time.Now()
	var per []string
	for _, spec := range standinSpecs() {
		t1 := time.Now()
		s, err := buildStandin(ctx, h.tl, filepath.Join(h.repo, "test/vm/standin"), h.work, driverVersion, spec)
		if err != nil {
			return fmt.Errorf("kernel %s: %w", h.tl.name, err)
		}
		h.standins[spec.variant] = s
		per = append(per, fmt.Sprintf("%s %s", spec.variant, since(t1)))
	}
	h.timings = append(h.timings, fmt.Sprintf("stand-in module builds %s (%s)", since(t0), strings.Join(per, ", ")))
	return nil
}

// result is a scenario's line.
type result struct {
	pass    bool
	details string
	host    time.Duration // from VMTEST-START to the result line
}

var (
	resultLine = regexp.MustCompile(`VMTEST (\S+) (PASS|FAIL)(?: (.*))?$`)
	startLine  = regexp.MustCompile(`VMTEST-START (\S+)`)
	bannerLine = regexp.MustCompile(`VMTEST-BANNER (.*)$`)
	bootedLine = regexp.MustCompile(`VMTEST-BOOTED uptime=([0-9.]+)`)
)

// parse reads the protocol lines of a boot.
func parse(lines []consoleLine) (results map[string]result, banner string, booted time.Duration, ended bool) {
	results = map[string]result{}
	starts := map[string]time.Duration{}
	for _, l := range lines {
		if m := startLine.FindStringSubmatch(l.text); m != nil {
			starts[m[1]] = l.at
		} else if m := resultLine.FindStringSubmatch(l.text); m != nil {
			results[m[1]] = result{pass: m[2] == "PASS", details: m[3], host: l.at - starts[m[1]]}
		} else if m := bannerLine.FindStringSubmatch(l.text); m != nil && banner == "" {
			banner = m[1]
		} else if bootedLine.MatchString(l.text) && booted == 0 {
			booted = l.at
		} else if strings.Contains(l.text, "VMTEST-END") {
			ended = true
		}
	}
	return results, banner, booted, ended
}

// kernelBanner returns the guest kernel's banner, booting a guest with no scenarios to read it
// when no boot has printed it yet.
func (h *harness) kernelBanner(t *testing.T) string {
	t.Helper()
	if h.banner != "" {
		return h.banner
	}
	res := h.boot(t, group{name: "probe", timeout: 3 * time.Minute})
	_, banner, _, _ := parse(res.lines)
	if banner == "" {
		t.Fatalf("the probe boot printed no banner (%v); console:\n%s", res.err, res.log())
	}
	h.banner = banner
	return banner
}

// boot assembles the initramfs for g and boots it.
func (h *harness) boot(t *testing.T, g group) bootResult {
	t.Helper()
	initrd := filepath.Join(h.work, g.name+".cpio")
	t0 := time.Now()
	size, err := h.initramfs(t, g, initrd)
	if err != nil {
		t.Fatalf("initramfs for %s: %v", g.name, err)
	}
	t.Logf("initramfs %s: %.1f MiB in %s", g.name, float64(size)/(1<<20), since(t0))
	return h.bootInitrd(t, g, initrd)
}

// bootInitrd boots the initramfs file for g, with qemu arguments added to qemuArgs' (a disk).
func (h *harness) bootInitrd(t *testing.T, g group, initrd string, qemu ...string) bootResult {
	t.Helper()
	var live func(consoleLine)
	if os.Getenv("DRIVER_AGENT_VM_CONSOLE") != "" {
		live = func(l consoleLine) { fmt.Fprintf(os.Stderr, "[%s %6.2fs] %s\n", g.name, l.at.Seconds(), l.text) }
	}
	cpus, err := vmCPUs()
	if err != nil {
		t.Fatal(err)
	}
	args := append(qemuArgs(h.tl.vmlinuz, initrd, g.memMiB, cpus), qemu...)
	res := bootArgs(context.Background(), h.tl.qemu, args, g.timeout, live)
	if dir := os.Getenv("DRIVER_AGENT_VM_LOGDIR"); dir != "" {
		if err := os.WriteFile(filepath.Join(dir, "vm-"+h.tl.name+"-"+g.name+".log"), []byte(res.log()), 0o644); err != nil {
			t.Logf("writing the console log: %v", err)
		}
	}
	return res
}

func (h *harness) runGroup(t *testing.T, g group) {
	if g.packages {
		h.kernelBanner(t)
	}
	h.check(t, g, h.boot(t, g))
}

// check turns the result lines of g's boot into subtests, one per scenario; a missing line or a
// failed boot fails the test and logs the whole console.
func (h *harness) check(t *testing.T, g group, res bootResult) {
	results, banner, booted, ended := parse(res.lines)
	if h.banner == "" {
		h.banner = banner
	}
	h.timings = append(h.timings, fmt.Sprintf("boot %s: console to /init %s, powered off after %s", g.name,
		booted.Round(10*time.Millisecond), res.wall.Round(10*time.Millisecond)))
	failed := res.err != nil || !ended
	if res.err != nil {
		t.Errorf("boot %s: %v", g.name, res.err)
	} else if !ended {
		t.Errorf("boot %s: the guest stopped before VMTEST-END (did /init die?)", g.name)
	}
	for _, sc := range g.scenarios {
		r, ok := results[sc]
		switch {
		case !ok:
			failed = true
			t.Run(sc, func(t *testing.T) { t.Errorf("no result line for %s: see the guest log", sc) })
		case !r.pass:
			failed = true
			t.Run(sc, func(t *testing.T) { t.Errorf("FAIL %s", r.details) })
		default:
			t.Run(sc, func(t *testing.T) { t.Logf("PASS %s", r.details) })
		}
		if ok {
			h.timings = append(h.timings, fmt.Sprintf("  %s/%s %s (%s)", g.name, sc, r.host.Round(10*time.Millisecond), guestMS(r.details)))
		}
	}
	if failed {
		t.Logf("guest console of %s:\n%s", g.name, res.log())
	}
}

// guestMS pulls "ms=N" out of a result's details.
func guestMS(details string) string {
	f := strings.Fields(details)
	if len(f) > 0 && strings.HasPrefix(f[0], "ms=") {
		if n, err := strconv.Atoi(strings.TrimPrefix(f[0], "ms=")); err == nil {
			return fmt.Sprintf("guest %s", (time.Duration(n) * time.Millisecond).String())
		}
	}
	return "guest ?"
}

// initramfs writes the guest's root filesystem for g to file and returns its size.
func (h *harness) initramfs(t *testing.T, g group, file string) (int64, error) {
	r := h.baseRootfs(g, driverVersion)
	std := h.standins["standard"]
	for _, m := range []string{"nvidia.ko", "nvidia-uvm.ko", "nvidia-modeset.ko", "nvswitch-standin.ko", "gdrdrv.ko"} {
		r.file("vmtest/ko/standard/"+m, 0o644, std.path(m))
	}
	r.file("vmtest/ko/enodev/nvidia.ko", 0o644, h.standins["enodev"].path("nvidia.ko"))
	for _, m := range []string{nvInterface, nvCore, modesetInterface, modesetCore} {
		r.file("vmtest/split/"+m, 0o644, std.path(m))
	}
	if err := h.addPrerequisites(r, g.compressed, append(prerequisiteModules(), g.modules...)); err != nil {
		return 0, err
	}
	if g.packages {
		if err := h.addPackages(r); err != nil {
			return 0, err
		}
	}
	if g.extra != nil {
		g.extra(t, h, r)
	}
	return h.writeRootfs(r, file)
}

// baseRootfs is what every guest has: busybox, /init and the scenario scripts, the fake
// daemons, /vmtest/config (for the driver version given), the agent, and ld with its libraries.
func (h *harness) baseRootfs(g group, version string) *rootfs {
	r := newRootfs()
	for _, d := range []string{"proc", "sys", "dev", "run", "tmp", "root", "etc", "var/lib", "usr/local/bin", "usr/sbin", "sbin"} {
		r.dir(d)
	}
	r.symlink("var/run", "/run")
	r.chardev("dev/console", 0o600, 5, 1)
	r.file("bin/busybox", 0o755, h.tl.busybox)

	guest := filepath.Join(h.repo, "test/vm/guest")
	r.file("init", 0o755, filepath.Join(guest, "init"))
	r.file("vmtest/lib.sh", 0o644, filepath.Join(guest, "lib.sh"))
	r.file("vmtest/scenarios.sh", 0o644, filepath.Join(guest, "scenarios.sh"))
	r.file("usr/bin/nvidia-persistenced", 0o755, filepath.Join(guest, "nvidia-persistenced"))
	r.file("usr/bin/nv-fabricmanager", 0o755, filepath.Join(guest, "nv-fabricmanager"))
	r.file("usr/bin/nvidia-smi", 0o755, filepath.Join(guest, "nvidia-smi"))
	r.file("usr/share/nvidia/nvswitch/fabricmanager.cfg", 0o644, filepath.Join(guest, "fabricmanager.cfg"))
	r.file("vmtest/fabricmanager.cfg", 0o644, filepath.Join(guest, "fabricmanager.cfg"))
	if g.bench {
		r.file("vmtest/bench.sh", 0o644, filepath.Join(guest, "bench.sh"))
		if g.benchB != "" {
			r.file("usr/local/bin/driver-agent-b", 0o755, g.benchB)
		}
	}
	mode := persistencedMode
	if m := os.Getenv("DRIVER_AGENT_VM_PERSISTENCED"); m != "" {
		mode = m
	}
	r.bytes("vmtest/persistenced-mode", 0o644, []byte(mode+"\n"))
	r.file("drivers/nvidia.conf", 0o644, filepath.Join(guest, "nvidia.conf"))
	r.file("etc/os-release", 0o644, filepath.Join(guest, "os-release"))
	benchB := ""
	if g.benchB != "" {
		benchB = "driver-agent-b"
	}
	r.bytes("vmtest/config", 0o644, []byte(fmt.Sprintf("VMTEST_DRIVER_VERSION=%s\nVMTEST_KERNEL_RELEASE=%s\nVMTEST_SCENARIOS=%q\nVMTEST_BENCH_RUNS=%d\nVMTEST_BENCH_B=%s\n",
		version, h.tl.abi, strings.Join(g.scenarios, " "), g.benchRuns, benchB)))

	r.file("usr/local/bin/driver-agent", 0o755, h.agent)
	r.symlink("usr/local/bin/nvidia-driver", "driver-agent")
	for _, f := range h.ldFiles {
		r.file(f, 0o755, f)
	}
	r.symlink("usr/bin/ld", filepath.Base(h.tl.ld))
	return r
}

// writeRootfs adds busybox's applet links where nothing else is and writes the archive to file.
func (h *harness) writeRootfs(r *rootfs, file string) (int64, error) {
	for _, a := range h.applets {
		if !r.has(a) {
			r.symlink(a, "/bin/busybox")
		}
	}
	return r.writeFile(file)
}

// addPackages installs the standard precompiled package where the agent looks for it
// (/usr/src/nvidia-<version>/kernel/precompiled/, core objects under kernel/nvidia and
// kernel/nvidia-modeset) and every variant under /vmtest/packages/<variant>/ for the scenarios
// to swap in.
func (h *harness) addPackages(r *rootfs) error {
	if h.packages == nil {
		h.packages = map[string][]byte{}
		std := h.standins["standard"]
		mismatch := strings.Replace(h.banner, " #", " #999", 1)
		if mismatch == h.banner {
			mismatch = h.banner + " (another build)"
		}
		for _, v := range []struct{ name, from, banner string }{
			{"standard", "standard", h.banner}, {"enodev", "enodev", h.banner}, {"slow", "slow", h.banner}, {"mismatch", "standard", mismatch},
		} {
			b, err := makePackage(driverVersion, h.tl.abi, v.banner, h.standins[v.from], std)
			if err != nil {
				return fmt.Errorf("package %s: %w", v.name, err)
			}
			h.packages[v.name] = b
		}
	}
	pkgName := "nvidia-modules-" + h.tl.abi
	kdir := "usr/src/nvidia-" + driverVersion + "/kernel"
	std := h.standins["standard"]
	r.bytes(kdir+"/precompiled/"+pkgName, 0o644, h.packages["standard"])
	r.file(kdir+"/nvidia/"+nvCore, 0o644, std.path(nvCore))
	r.file(kdir+"/nvidia-modeset/"+modesetCore, 0o644, std.path(modesetCore))
	r.bytes("vmtest/banner", 0o644, []byte(h.banner+"\n"))
	for v, b := range h.packages {
		from := h.standins[v]
		if v == "mismatch" {
			from = std
		}
		r.bytes("vmtest/packages/"+v+"/"+pkgName, 0o644, b)
		r.file("vmtest/packages/"+v+"/"+nvCore, 0o644, from.path(nvCore))
	}
	return nil
}

// addPrerequisites puts the modules named and their dependencies from the kernel image into
// /lib/modules/<abi>/ with a modules.dep listing just them (and the image's modules.builtin).
// With compress, they alternate between .ko.xz and .ko.zst.
func (h *harness) addPrerequisites(r *rootfs, compress bool, names []string) error {
	paths, deps, err := readModulesDep(filepath.Join(h.tl.modules, "modules.dep"))
	if err != nil {
		return err
	}
	var order []string
	seen := map[string]bool{}
	var visit func(string) error
	visit = func(name string) error {
		if seen[name] {
			return nil
		}
		seen[name] = true
		if _, ok := paths[name]; !ok {
			return fmt.Errorf("prerequisite %s is not in %s/modules.dep", name, h.tl.modules)
		}
		for _, d := range deps[name] {
			if err := visit(d); err != nil {
				return err
			}
		}
		order = append(order, name)
		return nil
	}
	for _, m := range names {
		if err := visit(m); err != nil {
			return err
		}
	}
	dir := "lib/modules/" + h.tl.abi + "/"
	newPath := map[string]string{}
	for i, name := range order {
		src := filepath.Join(h.tl.modules, paths[name])
		p := paths[name]
		if !compress {
			r.file(dir+p, 0o644, src)
			newPath[name] = p
			continue
		}
		data, err := os.ReadFile(src)
		if err != nil {
			return err
		}
		p, data, err = decompressModule(p, data) // trixie ships its modules as .ko.xz
		if err != nil {
			return err
		}
		ext, packed, err := compressModule(data, i%2 == 0)
		if err != nil {
			return fmt.Errorf("compress %s: %w", p, err)
		}
		newPath[name] = p + ext
		r.bytes(dir+p+ext, 0o644, packed)
	}
	var dep bytes.Buffer
	for _, name := range order {
		fmt.Fprintf(&dep, "%s:", newPath[name])
		for _, d := range deps[name] {
			fmt.Fprintf(&dep, " %s", newPath[d])
		}
		dep.WriteString("\n")
	}
	r.bytes(dir+"modules.dep", 0o644, dep.Bytes())
	r.file(dir+"modules.builtin", 0o644, filepath.Join(h.tl.modules, "modules.builtin"))
	return nil
}

// decompressModule returns a .ko.xz or .ko.zst module's path without that suffix and its
// contents decompressed; any other module as it is.
func decompressModule(p string, data []byte) (string, []byte, error) {
	var r io.Reader
	switch {
	case strings.HasSuffix(p, ".ko.xz"):
		xr, err := xz.NewReader(bytes.NewReader(data))
		if err != nil {
			return "", nil, fmt.Errorf("%s: %w", p, err)
		}
		r = xr
	case strings.HasSuffix(p, ".ko.zst"):
		zr, err := zstd.NewReader(bytes.NewReader(data))
		if err != nil {
			return "", nil, fmt.Errorf("%s: %w", p, err)
		}
		defer zr.Close()
		r = zr
	default:
		return p, data, nil
	}
	raw, err := io.ReadAll(r)
	if err != nil {
		return "", nil, fmt.Errorf("decompress %s: %w", p, err)
	}
	return strings.TrimSuffix(p, filepath.Ext(p)), raw, nil
}

// compressModule returns the module compressed with xz (CRC32 check, as kmod writes it) or zstd.
func compressModule(data []byte, useXZ bool) (string, []byte, error) {
	var buf bytes.Buffer
	if useXZ {
		w, err := xz.WriterConfig{CheckSum: xz.CRC32}.NewWriter(&buf)
		if err != nil {
			return "", nil, err
		}
		if _, err := w.Write(data); err != nil {
			return "", nil, err
		}
		if err := w.Close(); err != nil {
			return "", nil, err
		}
		return ".xz", buf.Bytes(), nil
	}
	enc, err := zstd.NewWriter(nil)
	if err != nil {
		return "", nil, err
	}
	defer enc.Close()
	return ".zst", enc.EncodeAll(data, nil), nil
}

// readModulesDep parses modules.dep into module name -> path and name -> dependency names.
func readModulesDep(file string) (map[string]string, map[string][]string, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	paths, deps := map[string]string{}, map[string][]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		mod, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		name := moduleName(mod)
		paths[name] = strings.TrimSpace(mod)
		for _, d := range strings.Fields(rest) {
			deps[name] = append(deps[name], moduleName(d))
		}
	}
	return paths, deps, sc.Err()
}

// moduleName turns "kernel/drivers/acpi/video.ko[.xz]" into "video" (dashes as underscores).
func moduleName(p string) string {
	b := filepath.Base(strings.TrimSpace(p))
	if i := strings.Index(b, ".ko"); i >= 0 {
		b = b[:i]
	}
	return strings.ReplaceAll(b, "-", "_")
}
