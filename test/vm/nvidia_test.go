//go:build vmtest && nvidiatest

package vm

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/build"
	"github.com/driver-agent/driver-agent/pkg/cache"
	"github.com/driver-agent/driver-agent/pkg/compile"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/link"
	"github.com/driver-agent/driver-agent/pkg/modfile"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
)

// nvidiaSourcesEnv names the directory scripts/nvidia-sources.sh laid Debian's NVIDIA kernel
// sources out in (<dir>/usr/src/nvidia-<version>/{kernel,kernel-open}); `make nvidia-test` sets it.
const nvidiaSourcesEnv = "DRIVER_AGENT_NVIDIA_SOURCES"

// nvidiaRelease is the Flatcar release the fake release server publishes Debian's headers as.
var nvidiaRelease = &detect.Flatcar{Version: "4152.2.3", Board: "amd64-usr", Channel: "stable"}

// nvidiaSources is NVIDIA's driver source directory as the driver image has it.
type nvidiaSources struct {
	version string
	dir     string // <root>/usr/src/nvidia-<version>
}

func (s nvidiaSources) flavour(f string) string { return filepath.Join(s.dir, f) }

// findNVIDIASources reads the sources of a Debian suite from DRIVER_AGENT_NVIDIA_SOURCES/<suite>;
// unset or missing sources are an error that says how to get them, never a skip.
func findNVIDIASources(suite string) (nvidiaSources, error) {
	base := os.Getenv(nvidiaSourcesEnv)
	if base == "" {
		return nvidiaSources{}, fmt.Errorf("%s is not set; it names the directory whose <suite> directories `scripts/nvidia-sources.sh DIR/<suite> <suite>` laid Debian's nvidia-kernel-source out in. Run `make nvidia-test`, which does both", nvidiaSourcesEnv)
	}
	root := filepath.Join(base, suite)
	dirs, _ := filepath.Glob(filepath.Join(root, "usr/src/nvidia-*"))
	if len(dirs) != 1 {
		return nvidiaSources{}, fmt.Errorf("%s: want exactly one usr/src/nvidia-<version> in it, found %d (%v); run scripts/nvidia-sources.sh %s %s",
			root, len(dirs), dirs, root, suite)
	}
	s := nvidiaSources{version: strings.TrimPrefix(filepath.Base(dirs[0]), "nvidia-"), dir: dirs[0]}
	for _, f := range []string{"kernel/Makefile", "kernel/nvidia/nv-kernel.o_binary", "kernel/nvidia-modeset/nv-modeset-kernel.o_binary",
		"kernel-open/Makefile", "kernel-open/nvidia/nv-kernel.o_binary"} {
		if _, err := os.Stat(filepath.Join(s.dir, f)); err != nil {
			return s, fmt.Errorf("NVIDIA sources incomplete: %w; run scripts/nvidia-sources.sh %s %s again", err, root, suite)
		}
	}
	v, err := build.SourceVersion(s.flavour("kernel"))
	if err != nil {
		return s, err
	}
	if v != s.version {
		return s, fmt.Errorf("%s/kernel/Kbuild says driver %s, the directory says %s", s.dir, v, s.version)
	}
	return s, nil
}

// TestNVIDIA builds NVIDIA's real driver (Debian's nvidia-kernel-source and
// nvidia-open-kernel-source of each kernel's suite: 535 for 6.1, 550 for 6.12) with the agent's
// code on the host, then loads it in a guest of that kernel with no GPU, TestNVIDIA/<kernel>/...:
//
//   - compile: compile.Run downloads the kernel's headers from a fake Flatcar release server (signed
//     with a test key), makes their helpers runnable, builds every module, and the result goes into
//     a cache entry (cache.Store) for the guest's banner; with DRIVER_AGENT_NVIDIA_BENCH set (make
//     nvidia-bench), a bare `make` with the same arguments is timed against it;
//   - precompiled: `driver-agent build` packs nv-linux.o, nv-modeset-linux.o, nvidia-uvm.ko and
//     nvidia-peermem.ko for the guest's banner;
//   - open: the same compile and the same package for kernel-open. On 6.12 both must build; on
//     6.1, where NVIDIA's open 535 sources do not build against Debian's headers, that is
//     reported, not failed;
//   - one boot per kernel (guest/nvidia.sh): the agent links each package with NVIDIA's
//     nv-kernel.o_binary in the guest and loads it, and then each cache entry; nvidia.ko fails
//     with ENODEV each time.
func TestNVIDIA(t *testing.T) {
	start := time.Now()
	kernels, err := findKernels()
	if err != nil {
		t.Fatal(err)
	}
	var timings []string
	for _, h := range setup(t, kernels, false) {
		var nv *nvidiaRun
		t.Run(h.tl.name, func(t *testing.T) { nv = runNVIDIA(t, h) })
		if nv != nil {
			timings = append(timings, h.tl.name+" ("+h.tl.abi+", NVIDIA "+nv.src.version+"):")
			for _, l := range append(h.timings, nv.timings...) {
				timings = append(timings, "  "+l)
			}
		}
	}
	timings = append(timings, "total "+since(start))
	t.Logf("timings:\n  %s", strings.Join(timings, "\n  "))
}

// runNVIDIA is TestNVIDIA on one kernel, with the NVIDIA sources of its suite.
func runNVIDIA(t *testing.T, h *harness) *nvidiaRun {
	start := time.Now()
	src, err := findNVIDIASources(h.tl.suite)
	if err != nil {
		t.Fatal(err)
	}
	banner := vmlinuzBanner(t, h)
	release, ok := precompiled.ParseBanner(banner)
	if !ok || release.Release != h.tl.abi {
		t.Fatalf("the guest kernel's banner %q is not for the headers' kernel %s", banner, h.tl.abi)
	}
	t.Logf("NVIDIA %s from %s; guest kernel %q", src.version, src.dir, banner)
	nv := &nvidiaRun{h: h, src: src, banner: banner, hostCache: filepath.Join(h.work, "host-cache"), guestCache: filepath.Join(h.work, "guest-cache"),
		// NVIDIA's open 535 sources do not build against Debian's 6.1 headers (pci_resize_resource
		// takes another argument there); the 6.12 run is the one that proves the open flavour.
		openRequired: h.tl.suite == secondSuite}

	compiled := nv.compile(t)
	if os.Getenv("DRIVER_AGENT_NVIDIA_BENCH") != "" {
		nv.bareMake(t, compiled)
	} else {
		nv.timing("no bare make to compare the build with: make nvidia-bench adds one")
	}
	cached := nv.store(t, compiled.Modules, "kernel")
	t.Run("sysext", func(t *testing.T) { nv.sysext(t, compiled.Modules) })
	// driver-agent build and the open flavour's builds are not timed against anything: they run
	// side by side, each filling the others' serial stretches on the two cores.
	var pkg, openPkg string
	var openBuilt bool
	t.Run("build", func(t *testing.T) {
		t.Run("precompiled", func(t *testing.T) { t.Parallel(); pkg = nv.precompiledBuild(t, "kernel") })
		t.Run("open", func(t *testing.T) {
			t.Parallel()
			if openBuilt = nv.open(t, compiled.Tree.Dir); openBuilt {
				openPkg = nv.precompiledBuild(t, "kernel-open")
			}
		})
	})
	if pkg == "" {
		t.Fatal("no precompiled package: the guest scenarios need it")
	}
	scenarios := []string{"nvidia-banner", "nvidia-precompiled", "nvidia-cached"}
	if openBuilt && openPkg != "" {
		scenarios = append(scenarios, "nvidia-open-precompiled", "nvidia-open-cached")
	}

	g := group{name: "nvidia", scenarios: scenarios, memMiB: nvidiaGuestMemMiB, timeout: 20 * time.Minute}
	initrd := filepath.Join(h.work, "nvidia.cpio")
	t0 := time.Now()
	size, err := nv.initramfs(g, initrd, map[string]string{"kernel": pkg, "kernel-open": openPkg}, cached)
	if err != nil {
		t.Fatalf("initramfs: %v", err)
	}
	nv.timing("initramfs %.1f MiB (uncompressed newc) in %s", float64(size)/(1<<20), since(t0))
	res := h.bootInitrd(t, g, initrd)
	h.check(t, g, res)
	nv.guestFigures(t, res)
	nv.timing("%s total %s", h.tl.name, since(start))
	return nv
}

// nvidiaGuestMemMiB is the guest's memory: the initramfs (up to about 450 MiB with both flavours,
// held twice while the kernel unpacks it), the linked nvidia.ko in /tmp and in the agent's cache
// on /run, and the module in kernel memory while it loads.
const nvidiaGuestMemMiB = 3072

// nvidiaRun is what TestNVIDIA builds and measures.
type nvidiaRun struct {
	h          *harness
	src        nvidiaSources
	banner     string
	hostCache  string        // the compile path's cache, as the agent keeps it
	guestCache string        // the entries shipped to the guest, by flavour
	openErr    string        // why the open flavour did not build
	agentMake  time.Duration // the agent's make step, from its log records
	// openRequired makes a failed build of the open flavour a failure instead of a report.
	openRequired bool

	mu      sync.Mutex
	timings []string
}

func (nv *nvidiaRun) timing(format string, a ...any) {
	nv.mu.Lock()
	defer nv.mu.Unlock()
	nv.timings = append(nv.timings, fmt.Sprintf(format, a...))
}

// vmlinuzBanner reads the guest kernel's banner from its image with `driver-agent banner
// --vmlinuz`; the boot's nvidia-banner scenario checks it against /proc/version.
func vmlinuzBanner(t *testing.T, h *harness) string {
	out, err := exec.Command(h.agent, "banner", "--vmlinuz", h.tl.vmlinuz).Output()
	if err != nil {
		t.Fatalf("driver-agent banner --vmlinuz %s: %v", h.tl.vmlinuz, err)
	}
	return strings.TrimSuffix(string(out), "\n")
}

// compile runs the agent's compile path: Debian's headers published as a Flatcar release on a
// fake release server, downloaded, verified with the test key, relocated, and NVIDIA's
// proprietary modules built against them. Its log and progress bar go to the test log; the bar
// must reach 100% only at the end.
func (nv *nvidiaRun) compile(t *testing.T) compile.Result {
	t0 := time.Now()
	entries, err := flatcartest.DirEntries(nv.h.tl.published)
	if err != nil {
		t.Fatal(err)
	}
	members := flatcartest.ContainerTree(nv.h.tl.abi, entries)
	if nv.h.tl.sysroot != "" {
		// The tree's helpers need the suite's C library, which Flatcar's tarball carries in
		// usr/lib64: the real one replaces the stand-in loader and libc.
		if members, err = withSysroot(members, entries, nv.h.tl.published, nv.h.tl.sysroot); err != nil {
			t.Fatal(err)
		}
	}
	tarball := filepath.Join(nv.h.work, flatcartest.ContainerImage)
	f, err := os.Create(tarball)
	if err != nil {
		t.Fatal(err)
	}
	if err := flatcartest.WriteTarball(f, members); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	key, err := flatcartest.NewKey("driver-agent nvidia-test signer")
	if err != nil {
		t.Fatal(err)
	}
	srv := flatcartest.NewServer(key)
	t.Cleanup(srv.Close)
	if err := srv.PublishFile(flatcartest.ReleaseDir(nvidiaRelease.Channel, nvidiaRelease.Board, nvidiaRelease.Version), tarball); err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(tarball)
	nv.timing("fake Flatcar release of %s's headers (%s): %.1f MiB tarball in %s", nv.h.tl.abi, nv.h.tl.published, float64(st.Size())/(1<<20), since(t0))

	rec := &records{}
	term := &termLog{t: t}
	o := nv.compileOptions(t, rec, term, "kernel")
	o.Fetch = flatcar.Options{URLs: []string{srv.URLTemplate()}, Keyring: srv.Key.ArmoredPublicKey()}
	t0 = time.Now()
	res, err := compile.Run(context.Background(), o)
	if err != nil {
		t.Fatalf("compile.Run of %s: %v", o.SourceDir, err)
	}
	wall := time.Since(t0)
	if res.Downloaded == 0 || !strings.Contains(res.Tree.From, srv.URL) {
		t.Errorf("the build tree did not come from the release server: %+v (%d bytes)", res.Tree, res.Downloaded)
	}
	if reqs := strings.Join(srv.Requests(), " "); !strings.Contains(reqs, ".DIGESTS.asc") {
		t.Errorf("the agent did not fetch the signed digests (requests: %s)", reqs)
	}
	checkProgress(t, rec.all(), term.last())
	nv.agentMake = makeStep(rec.all())
	want := []string{"nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem"}
	var names []string
	for _, m := range res.Modules {
		names = append(names, m.Name)
	}
	if !slices.Equal(names, want) {
		t.Fatalf("compile.Run built %v, want %v", names, want)
	}
	nv.timing("compile path: %s in all (download %s, %.1f MiB; build %s)", wall.Round(10*time.Millisecond),
		res.DownloadTime.Round(10*time.Millisecond), float64(res.Downloaded)/(1<<20), res.BuildTime.Round(10*time.Millisecond))
	return res
}

// withSysroot replaces the stand-in loader and libc of a ContainerTree with the files of the C
// library the tree's helpers were linked against: the loader they name and the closure of their
// DT_NEEDED libraries, found in the sysroot's usr/lib/x86_64-linux-gnu and put in ./usr/lib64,
// where Flatcar keeps them.
func withSysroot(members, tree []flatcartest.Entry, treeDir, sysroot string) ([]flatcartest.Entry, error) {
	libDir := filepath.Join(sysroot, "usr/lib/x86_64-linux-gnu")
	need := map[string]bool{}
	var queue []string
	add := func(names ...string) {
		for _, n := range names {
			if !need[n] {
				need[n] = true
				queue = append(queue, n)
			}
		}
	}
	for _, e := range tree {
		if e.Type != 0 && e.Type != '0' || e.Mode&0o111 == 0 || e.Source == "" {
			continue
		}
		f, err := elf.Open(e.Source)
		if err != nil {
			continue // not an ELF file: a script
		}
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				b := make([]byte, p.Filesz)
				if _, err := p.ReadAt(b, 0); err == nil {
					add(filepath.Base(strings.TrimRight(string(b), "\x00")))
				}
			}
		}
		libs, _ := f.ImportedLibraries()
		f.Close()
		add(libs...)
	}
	if len(need) == 0 {
		return nil, fmt.Errorf("no dynamically linked helper in %s", treeDir)
	}
	for i := 0; i < len(queue); i++ {
		f, err := elf.Open(filepath.Join(libDir, queue[i]))
		if err != nil {
			return nil, fmt.Errorf("a helper of %s needs %s: %w", treeDir, queue[i], err)
		}
		libs, _ := f.ImportedLibraries()
		f.Close()
		add(libs...)
	}
	var out []flatcartest.Entry
	for _, m := range members {
		if !need[path.Base(m.Name)] || !strings.HasPrefix(m.Name, "./usr/lib64/") {
			out = append(out, m)
		}
	}
	names := slices.Sorted(maps.Keys(need))
	for _, n := range names {
		src, err := filepath.EvalSymlinks(filepath.Join(libDir, n))
		if err != nil {
			return nil, err
		}
		out = append(out, flatcartest.Entry{Name: "./usr/lib64/" + n, Mode: 0o755, Source: src})
	}
	return out, nil
}

// compileOptions are the compile path's options for a flavour ("kernel" or "kernel-open"): a
// host root without a build tree, the guest's kernel, a Flatcar host; the log goes to the test
// log and rec, the bar to term.
func (nv *nvidiaRun) compileOptions(t *testing.T, rec *records, term io.Writer, flavour string) compile.Options {
	hostRoot := filepath.Join(nv.h.work, "empty-host-"+flavour)
	if err := os.MkdirAll(hostRoot, 0o755); err != nil {
		t.Fatal(err)
	}
	lw := &lineLog{t: t, prefix: "agent " + flavour + ": "}
	log := slog.New(rec.handler(slog.NewTextHandler(lw, &slog.HandlerOptions{Level: slog.LevelDebug})))
	return compile.Options{
		Roots: host.Roots{HostRoot: hostRoot}, KernelRelease: nv.h.tl.abi, Banner: nv.banner,
		DriverVersion: nv.src.version, Flatcar: nvidiaRelease, SourceDir: nv.src.flavour(flavour),
		WorkDir: filepath.Join(nv.h.work, "compile-"+flavour), Log: log, Terminal: term,
		CC:    nv.h.tl.cc, // the image's compiler for the kernel's generation ("" is gcc)
		Procs: host.OSExec{},
	}
}

// checkProgress asserts that the build's progress records climbed to 100% and reached it only in
// the last one, and that the bar drawn on the terminal ended full.
func checkProgress(t *testing.T, recs []slog.Record, lastBar string) {
	t.Helper()
	var pcts []int64
	for _, r := range recs {
		if r.Message != build.ProgressMessage {
			continue
		}
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "percent" {
				pcts = append(pcts, a.Value.Int64())
			}
			return true
		})
	}
	switch {
	case len(pcts) < 2:
		t.Errorf("%d progress records (%v), want at least a first and a final one", len(pcts), pcts)
	case pcts[len(pcts)-1] != 100:
		t.Errorf("the last progress record says %d%%, want 100%% (all: %v)", pcts[len(pcts)-1], pcts)
	case slices.Contains(pcts[:len(pcts)-1], 100):
		t.Errorf("a progress record said 100%% before the build finished: %v", pcts)
	case !slices.IsSorted(pcts):
		t.Errorf("progress went backwards: %v", pcts)
	}
	if !strings.HasSuffix(lastBar, "100%") {
		t.Errorf("the terminal's last bar is %q, want it at 100%%", lastBar)
	}
	t.Logf("progress records: %v%%; the terminal's last bar: %q", pcts, lastBar)
}

// makeStep is the time from the agent's "building the NVIDIA kernel modules" record (make starts)
// to its "built the NVIDIA kernel modules" one (make and the checks of its output are done).
func makeStep(recs []slog.Record) time.Duration {
	var start, end time.Time
	for _, r := range recs {
		switch r.Message {
		case "building the NVIDIA kernel modules":
			start = r.Time
		case "built the NVIDIA kernel modules":
			end = r.Time
		}
	}
	if start.IsZero() || end.IsZero() {
		return 0
	}
	return end.Sub(start)
}

// makeLine is build.Modules' log line for its make command: "$ cd <dir> && <make> <args>" (after
// the compiler check's "$ <cc> --version" and its output).
var makeLine = regexp.MustCompile(`^\$ cd (\S+) && (\S+) (.*)$`)

// makeCommand returns the make program and arguments the agent logged in its build log.
func makeCommand(logFile string) (string, []string, error) {
	f, err := os.Open(logFile)
	if err != nil {
		return "", nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if m := makeLine.FindStringSubmatch(sc.Text()); m != nil {
			return m[2], strings.Fields(m[3]), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", nil, err
	}
	return "", nil, fmt.Errorf("the agent's build log %s has no \"$ cd <dir> && <make> <args>\" line", logFile)
}

// bareMake builds the same sources with the same make arguments (jobs, SYSSRC, SYSOUT, CC and
// targets, read from the agent's build log) and environment (without the outer make's MAKEFLAGS;
// IGNORE_CC_MISMATCH=1 and LC_ALL=C, as the agent sets them) in a fresh copy, and prints the
// agent's build time against it. No timed assertion: the machine is shared.
func (nv *nvidiaRun) bareMake(t *testing.T, res compile.Result) {
	makeProg, args, err := makeCommand(res.LogFile)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(nv.h.work, "bare-make")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := build.CopyTree(context.Background(), nv.src.flavour("kernel"), dir); err != nil {
		t.Fatal(err)
	}
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); !slices.Contains([]string{"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "LC_ALL", "IGNORE_CC_MISMATCH"}, k) {
			env = append(env, kv)
		}
	}
	cmd := exec.Command(makeProg, args...)
	cmd.Dir, cmd.Env = dir, append(env, "LC_ALL=C", "IGNORE_CC_MISMATCH=1")
	logFile := filepath.Join(nv.h.work, "bare-make.log")
	out, err := os.Create(logFile)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	t.Logf("bare make: cd %s && %s %s", dir, makeProg, strings.Join(args, " "))
	t0 := time.Now()
	err = cmd.Run()
	bare := time.Since(t0)
	out.Close()
	if err != nil {
		tail, _ := exec.Command("tail", "-n", "30", logFile).Output()
		t.Fatalf("bare make failed: %v\n%s", err, tail)
	}
	for _, mod := range res.Modules {
		if _, err := os.Stat(filepath.Join(dir, filepath.Base(mod.Path))); err != nil {
			t.Errorf("the bare make did not make %s: %v", filepath.Base(mod.Path), err)
		}
	}
	nv.timing("build time: agent (build.Modules: copy, make, checks) %s, of which its make step %s (from its log), bare `make %s` %s: ratio %.3f (target within 1.05)",
		res.BuildTime.Round(10*time.Millisecond), nv.agentMake.Round(10*time.Millisecond), strings.Join(args, " "), bare.Round(10*time.Millisecond), res.BuildTime.Seconds()/bare.Seconds())
	if err := os.RemoveAll(dir); err != nil {
		t.Log(err)
	}
}

// store puts modules into the cache with cache.Store under the guest's banner, as the agent does
// after a compile (flavour "kernel" or "kernel-open", the agent's names), and checks the entry's
// modules: vermagic and version. The guest gets its own entry, which cache.Store makes from
// copies without debug information (strip --strip-debug): nvidia-uvm.ko is mostly debug
// information, and the guest reads each module it loads through its checksum under TCG. It returns
// the guest's entry.
func (nv *nvidiaRun) store(t *testing.T, mods []link.Module, flavour string) cache.Entry {
	key := cache.Key{Banner: nv.banner, DriverVersion: nv.src.version, Flavor: flavour}
	t0 := time.Now()
	entry := nv.storeIn(t, filepath.Join(nv.hostCache, flavour), key, mods)
	nv.timing("cache entry %s (%s): %s; stored in %s", flavour, filepath.Base(entry.Dir), moduleSizes(t, entry), since(t0))

	stripped := filepath.Join(nv.h.work, "stripped-"+flavour)
	if err := os.MkdirAll(stripped, 0o755); err != nil {
		t.Fatal(err)
	}
	var small []link.Module
	for _, m := range mods {
		out := filepath.Join(stripped, filepath.Base(m.Path))
		if b, err := exec.Command("strip", "--strip-debug", "-o", out, m.Path).CombinedOutput(); err != nil {
			t.Fatalf("strip --strip-debug %s: %v\n%s", m.Path, err, b)
		}
		small = append(small, link.Module{Name: m.Name, Path: out})
	}
	ge := nv.storeIn(t, filepath.Join(nv.guestCache, flavour), key, small)
	nv.timing("  the guest's entry, made from copies without debug information: %s", moduleSizes(t, ge))
	return ge
}

// storeIn stores mods in the cache dir under key, looks the entry up again, and checks that each
// module's vermagic names the guest kernel and that nvidia.ko has the driver's version.
func (nv *nvidiaRun) storeIn(t *testing.T, dir string, key cache.Key, mods []link.Module) cache.Entry {
	entry, err := cache.Store(dir, key, mods)
	if err != nil {
		t.Fatalf("cache.Store: %v", err)
	}
	back, ok, err := cache.Lookup(dir, key)
	if err != nil || !ok || back.Dir != entry.Dir {
		t.Fatalf("cache.Lookup after Store: %v %v %+v", ok, err, back)
	}
	for _, m := range entry.Modules {
		data, err := os.ReadFile(m.Path)
		if err != nil {
			t.Fatal(err)
		}
		info, err := modfile.Info(data)
		if err != nil {
			t.Fatalf("%s: %v", m.Path, err)
		}
		if got, _, _ := strings.Cut(info.Vermagic, " "); got != nv.h.tl.abi {
			t.Errorf("cached %s has vermagic %q, want the guest kernel's release %s", m.Path, info.Vermagic, nv.h.tl.abi)
		}
		if m.Name == "nvidia" {
			t.Logf("cached %s: vermagic %q, version %s, depends %v", m.Path, info.Vermagic, info.Version, info.Depends)
			if info.Version != nv.src.version {
				t.Errorf("cached %s has version %q, want %s", m.Path, info.Version, nv.src.version)
			}
		}
	}
	return entry
}

func moduleSizes(t *testing.T, e cache.Entry) string {
	var sizes []string
	for _, m := range e.Modules {
		st, err := os.Stat(m.Path)
		if err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, fmt.Sprintf("%s %.1f MiB", m.Name, float64(st.Size())/(1<<20)))
	}
	return strings.Join(sizes, ", ")
}

// precompiledBuild runs `driver-agent build` (the binary) for a flavour ("kernel" or
// "kernel-open") against the kernel's headers for the guest's banner, with the kernel's compiler,
// and checks the package: NVIDIA's two kernel interfaces and the two complete modules.
func (nv *nvidiaRun) precompiledBuild(t *testing.T, flavour string) string {
	bannerFile := filepath.Join(nv.h.work, "banner-"+flavour)
	if err := os.WriteFile(bannerFile, []byte(nv.banner+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	pkg := filepath.Join(nv.h.work, "package-"+flavour, "nvidia-modules-"+nv.h.tl.abi)
	workDir := filepath.Join(nv.h.work, "agent-build-"+flavour)
	for _, d := range []string{workDir, filepath.Dir(pkg)} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	args := []string{"build", "--kernel-banner", bannerFile, "--kernel-build-tree", nv.h.tl.headers,
		"--source", nv.src.flavour(flavour), "--work-dir", workDir, "-o", pkg}
	if nv.h.tl.cc != "" {
		args = append(args, "--cc", nv.h.tl.cc)
	}
	cmd := exec.Command(nv.h.agent, args...)
	var stdout bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &lineLog{t: t, prefix: "driver-agent build " + flavour + ": "}
	t0 := time.Now()
	err := cmd.Run()
	took := time.Since(t0)
	if err != nil {
		t.Fatalf("driver-agent build of %s: %v\n%s", flavour, err, stdout.String())
	}
	t.Logf("driver-agent build:\n%s", stdout.String())
	p, err := precompiled.ReadFile(pkg)
	if err != nil {
		t.Fatal(err)
	}
	var members []string
	for _, f := range p.Files {
		if f.Type == precompiled.KernelInterface {
			members = append(members, fmt.Sprintf("%s->%s+%s", f.Name, f.LinkedModuleName, f.CoreObjectName))
		} else {
			members = append(members, f.Name)
		}
	}
	want := []string{"nv-linux.o->nvidia.ko+nvidia/nv-kernel.o_binary", "nv-modeset-linux.o->nvidia-modeset.ko+nvidia-modeset/nv-modeset-kernel.o_binary",
		"nvidia-uvm.ko", "nvidia-peermem.ko"}
	if !slices.Equal(members, want) {
		t.Errorf("package members %v, want %v", members, want)
	}
	if p.ProcVersion != nv.banner || p.DriverVersion != nv.src.version || !precompiled.Match(p, nv.banner) {
		t.Errorf("package: banner %q, driver %q; want %q, %s", p.ProcVersion, p.DriverVersion, nv.banner, nv.src.version)
	}
	st, _ := os.Stat(pkg)
	nv.timing("precompiled %s: driver-agent build %s (side by side with the other builds), package %.1f MiB", flavour, took.Round(10*time.Millisecond), float64(st.Size())/(1<<20))
	return pkg
}

// open compiles the open flavour against the tree the proprietary build used (already downloaded
// and made runnable; given as --kernel-build-tree). It reports whether it built. Where the open
// flavour is not required, a failing build of NVIDIA's own sources is reported and the stage
// carries on; any other error, and any failure where it is required, fails the test.
func (nv *nvidiaRun) open(t *testing.T, tree string) bool {
	o := nv.compileOptions(t, &records{}, nil, "kernel-open")
	o.KernelBuildTree = tree
	t0 := time.Now()
	res, err := compile.Run(context.Background(), o)
	var be *build.Error
	switch {
	case errors.As(err, &be) && errors.Is(err, build.ErrBuild):
		if len(be.Errors) == 0 {
			t.Errorf("the failed open build's error carries no first error lines: %v", err)
		}
		why := strings.ReplaceAll(strings.Join(be.Errors[:min(3, len(be.Errors))], " | "), filepath.Join(o.WorkDir, "build")+"/", "")
		nv.openErr = fmt.Sprintf("NVIDIA's open sources %s do not build against %s (%s): %s", nv.src.version, nv.h.tl.abi, since(t0), why)
		if nv.openRequired {
			t.Fatalf("OPEN FLAVOUR NOT BUILT: %s; the full log is %s", nv.openErr, be.Log)
		}
		t.Logf("OPEN FLAVOUR NOT BUILT (not a failure on this kernel): %s; the full log is %s", nv.openErr, be.Log)
		return false
	case err != nil:
		t.Fatalf("compile.Run of the open flavour: %v", err)
	}
	nv.timing("open flavour: compile path built it in %s", res.BuildTime.Round(10*time.Millisecond))
	nv.store(t, res.Modules, "kernel-open")
	return true
}

// initramfs is the guest for the NVIDIA scenarios: the harness's base (busybox, agent, ld), each
// flavour's package (pkgs: flavour -> file, "" when it was not built) with NVIDIA's core objects
// where the agent looks for them, the cache entries under /vmtest/nvcache/<flavour>/, and the
// prerequisites the NVIDIA modules need with their modules.dep closure (drm for nvidia.ko, video
// for nvidia-modeset.ko).
func (nv *nvidiaRun) initramfs(g group, file string, pkgs map[string]string, cached cache.Entry) (int64, error) {
	r := nv.h.baseRootfs(g, nv.src.version)
	delete(r.entries, clean("drivers/nvidia.conf")) // the stand-ins' parameters
	r.file("vmtest/nvidia.sh", 0o644, filepath.Join(nv.h.repo, "test/vm/guest/nvidia.sh"))
	r.bytes("vmtest/banner", 0o644, []byte(nv.banner+"\n"))
	for flavour, pkg := range pkgs {
		if pkg == "" {
			continue
		}
		kdir := "usr/src/nvidia-" + nv.src.version + "/" + flavour + "/"
		r.file(kdir+"precompiled/"+filepath.Base(pkg), 0o644, pkg)
		for _, core := range []string{"nvidia/nv-kernel.o_binary", "nvidia-modeset/nv-modeset-kernel.o_binary"} {
			r.file(kdir+core, 0o644, filepath.Join(nv.src.flavour(flavour), core))
		}
	}
	err := filepath.WalkDir(nv.guestCache, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(nv.guestCache, p)
		if err != nil {
			return err
		}
		r.file("vmtest/nvcache/"+rel, 0o644, p)
		return nil
	})
	if err != nil {
		return 0, err
	}
	prereqs, err := nv.prerequisites(cached)
	if err != nil {
		return 0, err
	}
	if err := nv.h.addPrerequisites(r, false, prereqs); err != nil {
		return 0, err
	}
	nv.timing("initramfs: largest files %s", strings.Join(r.largest(6), ", "))
	return nv.h.writeRootfs(r, file)
}

// largest returns the n largest files of r with their sizes.
func (r *rootfs) largest(n int) []string {
	type file struct {
		path string
		size int64
	}
	var files []file
	for p, e := range r.entries {
		size := int64(len(e.data))
		if e.src != "" {
			if st, err := os.Stat(e.src); err == nil {
				size = st.Size()
			}
		}
		files = append(files, file{p, size})
	}
	slices.SortFunc(files, func(a, b file) int { return cmp.Compare(b.size, a.size) })
	var out []string
	for _, f := range files[:min(n, len(files))] {
		out = append(out, fmt.Sprintf("/%s %.1f MiB", f.path, float64(f.size)/(1<<20)))
	}
	return out
}

// prerequisites are the in-kernel modules the agent loads before NVIDIA's: the harness's usual
// ones and whatever nvidia, nvidia-modeset and nvidia-uvm name in depends= outside their set.
func (nv *nvidiaRun) prerequisites(e cache.Entry) ([]string, error) {
	set := []string{"nvidia", "nvidia_modeset", "nvidia_uvm"}
	names := prerequisiteModules()
	for _, m := range e.Modules {
		if !slices.Contains(set, m.Name) {
			continue
		}
		data, err := os.ReadFile(m.Path)
		if err != nil {
			return nil, err
		}
		info, err := modfile.Info(data)
		if err != nil {
			return nil, err
		}
		for _, d := range info.Depends {
			if d = strings.ReplaceAll(d, "-", "_"); !slices.Contains(set, d) && !slices.Contains(names, d) {
				names = append(names, d)
			}
		}
	}
	if !slices.Contains(names, "drm") {
		return nil, fmt.Errorf("nvidia.ko does not depend on drm on this kernel (prerequisites %v): the scenarios check that the agent loads drm", names)
	}
	return names, nil
}

var (
	ldLine    = regexp.MustCompile(`^VMTEST-LD (\S+) ([0-9.]+) ([0-9.]+) (\d+) `)
	logLine   = regexp.MustCompile(`^VMTEST-LOG (\S+) time=(\S+) .*?msg=("[^"]*"|\S+)(.*)$`)
	phaseAttr = regexp.MustCompile(` phase=(\S+) result=\S+ duration=(\S+)`)
	storeAttr = regexp.MustCompile(` seconds=([0-9.e+-]+)`)
)

// agentTimes is what one scenario's agent log and ld calls say about its timing.
type agentTimes struct {
	relink, lastLink time.Time // the "Relinking" record, the last "linking kernel module" one
	ld               []float64 // the ld calls' durations (s), in order
	phases           []string  // "name duration" of each finished phase, in order
	phase            map[string]time.Duration
	store            string // the cache store's duration, from its record
}

// guestFigures prints the guest's timings: for the precompiled path the link, from the agent's
// "Relinking" record to the end of its last ld -d -r (the start of the last link is a log record,
// its length comes from the ld wrapper), and each agent run's phases as it logged them.
func (nv *nvidiaRun) guestFigures(t *testing.T, res bootResult) {
	times := map[string]*agentTimes{}
	get := func(sc string) *agentTimes {
		if times[sc] == nil {
			times[sc] = &agentTimes{phase: map[string]time.Duration{}}
		}
		return times[sc]
	}
	for _, l := range res.lines {
		if m := ldLine.FindStringSubmatch(l.text); m != nil {
			a, _ := strconv.ParseFloat(m[2], 64)
			b, _ := strconv.ParseFloat(m[3], 64)
			get(m[1]).ld = append(get(m[1]).ld, b-a)
			continue
		}
		m := logLine.FindStringSubmatch(l.text)
		if m == nil {
			continue
		}
		ts, err := time.Parse(time.RFC3339Nano, m[2])
		if err != nil {
			continue
		}
		at := get(m[1])
		switch msg := strings.Trim(m[3], `"`); msg {
		case "Relinking NVIDIA driver kernel modules...":
			at.relink = ts
		case "linking kernel module":
			at.lastLink = ts
		case "stored the modules in the host cache":
			if a := storeAttr.FindStringSubmatch(m[4]); a != nil {
				if sec, err := strconv.ParseFloat(a[1], 64); err == nil {
					at.store = time.Duration(sec * float64(time.Second)).Round(10 * time.Millisecond).String()
				}
			}
		case "phase finished":
			if p := phaseAttr.FindStringSubmatch(m[4]); p != nil {
				if d, err := time.ParseDuration(p[2]); err == nil {
					at.phase[p[1]] = d
					at.phases = append(at.phases, p[1]+" "+d.Round(10*time.Millisecond).String())
				}
			}
		}
	}
	p := times["nvidia-precompiled"]
	if p == nil || p.relink.IsZero() || p.lastLink.IsZero() || len(p.ld) != 2 {
		t.Errorf("the precompiled scenario's log has no Relinking and linking records, or not two ld calls, to time the link by")
	} else {
		link := p.lastLink.Sub(p.relink) + time.Duration(p.ld[1]*float64(time.Second))
		nv.timing("guest link (precompiled path): %s from the agent's Relinking record to the end of its last ld (ld -d -r: nvidia.ko %.2fs, nvidia-modeset.ko %.2fs); its prepare phase %s; storing the linked modules in the cache, alongside the load, %s",
			link.Round(10*time.Millisecond), p.ld[0], p.ld[1], p.phase["prepare"].Round(10*time.Millisecond), cmp.Or(p.store, "(no record)"))
	}
	for _, sc := range []string{"nvidia-precompiled", "nvidia-cached", "nvidia-open-precompiled", "nvidia-open-cached"} {
		if at := times[sc]; at != nil {
			nv.timing("  %s phases: %s", sc, strings.Join(at.phases, ", "))
		}
	}
	if nv.openErr != "" {
		nv.timing("open flavour: %s", nv.openErr)
	}
}

// records keeps the log records of a run.
type records struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (r *records) handler(next slog.Handler) slog.Handler { return recordingHandler{next: next, r: r} }

func (r *records) all() []slog.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.recs)
}

type recordingHandler struct {
	next slog.Handler
	r    *records
}

func (h recordingHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.next.Enabled(ctx, l)
}

func (h recordingHandler) Handle(ctx context.Context, rec slog.Record) error {
	h.r.mu.Lock()
	h.r.recs = append(h.r.recs, rec.Clone())
	h.r.mu.Unlock()
	return h.next.Handle(ctx, rec)
}

func (h recordingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return recordingHandler{next: h.next.WithAttrs(as), r: h.r}
}

func (h recordingHandler) WithGroup(name string) slog.Handler {
	return recordingHandler{next: h.next.WithGroup(name), r: h.r}
}

// lineLog writes each line it gets to the test log.
type lineLog struct {
	t      *testing.T
	prefix string
	mu     sync.Mutex
	buf    []byte
}

func (w *lineLog) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			return len(p), nil
		}
		w.t.Log(w.prefix + string(w.buf[:i]))
		w.buf = w.buf[i+1:]
	}
}

// termLog is the build's terminal: it keeps the last bar drawn and logs the bar each time it
// passes another tenth.
type termLog struct {
	t      *testing.T
	mu     sync.Mutex
	bar    string
	decile int
}

var barPercent = regexp.MustCompile(`(\d+)%$`)

func (w *termLog) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := string(p)
	if i := strings.LastIndexByte(s, '\r'); i >= 0 {
		s = s[i+1:]
	}
	if s = strings.TrimSpace(s); s == "" {
		return len(p), nil
	}
	w.bar = s
	if m := barPercent.FindStringSubmatch(s); m != nil {
		if pct, _ := strconv.Atoi(m[1]); pct/10 > w.decile {
			w.decile = pct / 10
			w.t.Log("terminal: " + s)
		}
	}
	return len(p), nil
}

func (w *termLog) last() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.bar
}
