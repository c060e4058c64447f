package modules

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/daemon/daemontest"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/modfile"
)

type env struct {
	roots  host.Roots
	kernel *hosttest.FakeKernel
	host   host.Host
	dir    string
}

func newEnv(t *testing.T, specs map[string]hosttest.FakeModule) *env {
	t.Helper()
	dir := t.TempDir()
	r := hosttest.Roots(t, dir)
	k := hosttest.NewFakeKernel(r, specs)
	return &env{roots: r, kernel: k, dir: dir, host: host.Host{Roots: r, Kernel: k, Files: host.OSFiles{}}}
}

func (e *env) loader() Loader {
	return Loader{Host: e.host, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Release: "6.1.0-test"}
}

// module writes a stand-in module file and returns it resolved.
func (e *env) module(t *testing.T, name, depends string) File {
	t.Helper()
	path := filepath.Join(e.dir, name+".ko")
	hosttest.Must(t, os.WriteFile(path, hosttest.ModuleELF("name="+name, "version=1.0", "depends="+depends, "vermagic=6.1.0-other SMP mod_unload"), 0o644))
	files, err := Resolve([]host.ModuleImage{{Name: name, Path: path}})
	if err != nil {
		t.Fatal(err)
	}
	return files[0]
}

func TestResolveOrdersAndDecompresses(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		hosttest.Must(t, os.WriteFile(p, data, 0o644))
		return p
	}
	var zbuf bytes.Buffer
	zw, _ := zstd.NewWriter(&zbuf)
	zw.Write(hosttest.ModuleELF("name=nvidia_drm", "depends=nvidia_modeset,drm"))
	zw.Close()
	images := []host.ModuleImage{
		{Name: "nvidia_drm", Path: write("nvidia-drm.ko.zst", zbuf.Bytes())},
		{Name: "nvidia_modeset", Path: write("nvidia-modeset.ko", hosttest.ModuleELF("name=nvidia-modeset", "depends=nvidia"))},
		{Name: "nvidia", Path: write("nvidia.ko", hosttest.ModuleELF("name=nvidia", "depends="))},
	}
	files, err := Resolve(images)
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, f := range files {
		order = append(order, f.Image.Name)
	}
	if !slices.Equal(order, []string{"nvidia", "nvidia_modeset", "nvidia_drm"}) {
		t.Errorf("order %v", order)
	}
	if files[2].Image.Data == nil || files[0].Image.Data != nil {
		t.Error("compressed modules must be decompressed into Data, plain ones loaded by file")
	}
	if _, err := Resolve([]host.ModuleImage{{Name: "nvidia_uvm", Path: images[2].Path}}); err == nil || !strings.Contains(err.Error(), `not "nvidia_uvm"`) {
		t.Errorf("name mismatch: %v", err)
	}
	if _, err := Resolve([]host.ModuleImage{{Name: "x", Path: write("x.ko", []byte("not elf"))}}); err == nil {
		t.Error("a file that is not a module was accepted")
	}
}

func TestRollbackAtEachPosition(t *testing.T) {
	t.Parallel()
	names := []string{"nvidia", "nvidia_uvm", "nvidia_modeset"}
	for fail := range names {
		t.Run(names[fail], func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, map[string]hosttest.FakeModule{names[fail]: {Err: unix.EINVAL}})
			files := []File{e.module(t, "nvidia", ""), e.module(t, "nvidia_uvm", "nvidia"), e.module(t, "nvidia_modeset", "nvidia")}
			_, err := e.loader().Load(context.Background(), files)
			if !errors.Is(err, exitcode.ErrModuleLoad) {
				t.Fatalf("err = %v", err)
			}
			if l := e.kernel.Loaded(); len(l) != 0 {
				t.Errorf("left loaded after rollback: %v", l)
			}
			var want []string
			for i := 0; i <= fail; i++ {
				want = append(want, "load "+names[i])
			}
			for i := fail - 1; i >= 0; i-- {
				want = append(want, "unload "+names[i])
			}
			if got := e.kernel.Calls(); !slices.Equal(got, want) {
				t.Errorf("calls %v, want %v", got, want)
			}
		})
	}
}

// TestErrnoMessages checks the text an operator sees for each kernel refusal.
func TestErrnoMessages(t *testing.T) {
	t.Parallel()
	cases := []struct {
		errno error
		class error
		want  []string
	}{
		{unix.ENODEV, exitcode.ErrNoGPU, []string{"load nvidia: the kernel found no NVIDIA GPU this driver supports", "no such device"}},
		{unix.ENOEXEC, exitcode.ErrModuleLoad, []string{`invalid module format: the module was built for "6.1.0-other SMP mod_unload", the running kernel is 6.1.0-test`}},
		{unix.ENOENT, exitcode.ErrModuleLoad, []string{"unknown symbols drm_gem_object_free, drm_dev_put; it depends on drm, which is not loaded", "kernel log: nvidia: Unknown symbol drm_gem_object_free (err -2)"}},
		{unix.EKEYREJECTED, exitcode.ErrModuleLoad, []string{"refused the module's signature (Secure Boot or lockdown): it is unsigned"}},
		{unix.EPERM, exitcode.ErrModuleLoad, []string{"Secure Boot or lockdown"}},
	}
	for _, c := range cases {
		// The module resolved from its .modinfo, and as Tree.Resolve leaves one it did not read
		// (its name only, no dependencies): the message is the same.
		for _, unread := range []bool{false, true} {
			t.Run(fmt.Sprintf("%v/unread=%v", c.errno, unread), func(t *testing.T) {
				t.Parallel()
				e := newEnv(t, map[string]hosttest.FakeModule{"nvidia": {Err: c.errno}})
				kmsg := filepath.Join(e.roots.Dev, "kmsg")
				hosttest.Must(t, os.WriteFile(kmsg, []byte("6,1,1,-;old line before the load\n"), 0o644))
				e.host.Kernel = kmsgWriter{e.kernel, kmsg}
				f := e.module(t, "nvidia", "drm")
				if unread {
					f = File{Image: f.Image, Info: modfile.ModInfo{Name: f.Image.Name}, partial: true}
				}
				_, err := e.loader().Load(context.Background(), []File{f})
				if !errors.Is(err, c.class) {
					t.Fatalf("err %v is not %v", err, c.class)
				}
				for _, w := range c.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("message\n%v\nlacks\n%s", err, w)
					}
				}
				if strings.Contains(err.Error(), "old line") {
					t.Error("kernel lines from before the load are reported")
				}
			})
		}
	}
}

// kmsgWriter appends kernel log lines as a failing load would.
type kmsgWriter struct {
	*hosttest.FakeKernel
	path string
}

func (k kmsgWriter) LoadModule(m host.ModuleImage) error {
	f, _ := os.OpenFile(k.path, os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("4,2,2,-;nvidia: Unknown symbol drm_gem_object_free (err -2)\n SUBSYSTEM=module\n4,3,3,-;nvidia: Unknown symbol drm_dev_put (err -2)\n")
	f.Close()
	return k.FakeKernel.LoadModule(m)
}

func TestEEXIST(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]hosttest.FakeModule{"nvidia": {Version: "1.0"}})
	if err := e.kernel.Preload("nvidia"); err != nil {
		t.Fatal(err)
	}
	loaded, err := e.loader().Load(context.Background(), []File{e.module(t, "nvidia", "")})
	if err != nil || !slices.Equal(loaded, []string{"nvidia"}) {
		t.Fatalf("same version: loaded %v, %v; want it adopted", loaded, err)
	}
	f := e.module(t, "nvidia", "")
	f.Info.Version = "2.0"
	if _, err := e.loader().Load(context.Background(), []File{f}); err == nil || !strings.Contains(err.Error(), `loaded version "1.0", this one "2.0"`) {
		t.Errorf("other version: %v", err)
	}
}

func TestUnloadRetriesBusy(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]hosttest.FakeModule{"nvidia_uvm": {Deps: []string{"nvidia"}}})
	hosttest.Must(t, e.kernel.Preload("nvidia", "nvidia_uvm"))
	e.kernel.BusyFor("nvidia", 2)
	if err := Unload(context.Background(), e.host, slog.New(slog.NewTextHandler(io.Discard, nil)), []string{"nvidia"}); err != nil {
		t.Fatal(err)
	}
	calls := e.kernel.Calls()
	if !slices.Equal(calls, []string{"unload nvidia_uvm", "unload nvidia", "unload nvidia", "unload nvidia"}) {
		t.Errorf("calls %v", calls)
	}
}

func TestInUseNamesTheHolder(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]hosttest.FakeModule{"nvidia_uvm": {Deps: []string{"nvidia"}}})
	hosttest.Must(t, e.kernel.Preload("nvidia", "nvidia_uvm"))
	e.kernel.Use("nvidia", 1)
	proc := e.roots.Proc
	hosttest.Must(t, os.MkdirAll(filepath.Join(proc, "4242/fd"), 0o755))
	hosttest.Must(t, os.Symlink("/dev/nvidia0", filepath.Join(proc, "4242/fd/3")))
	hosttest.Must(t, os.Symlink("/dev/null", filepath.Join(proc, "4242/fd/0")))
	hosttest.Must(t, os.WriteFile(filepath.Join(proc, "4242/comm"), []byte("python3\n"), 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(proc, "4242/cgroup"), []byte("0::/kubepods/besteffort/pod1234/cri-containerd-abc\n"), 0o644))
	hosttest.Must(t, os.MkdirAll(filepath.Join(proc, "77/fd"), 0o755))
	hosttest.Must(t, os.Symlink("/dev/null", filepath.Join(proc, "77/fd/1")))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err := Unload(ctx, e.host, slog.New(slog.NewTextHandler(io.Discard, nil)), []string{"nvidia"})
	if !errors.Is(err, exitcode.ErrInUse) {
		t.Fatalf("err = %v", err)
	}
	for _, want := range []string{"driver is in use", "nvidia busy", "pid 4242 (python3) has /dev/nvidia0 open in 0::/kubepods/besteffort/pod1234/cri-containerd-abc"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%v\nlacks %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "pid 77") {
		t.Error("a process without NVIDIA devices is named")
	}
	if got := e.kernel.Loaded(); !slices.Equal(got, []string{"nvidia", "nvidia_uvm"}) {
		t.Errorf("loaded %v: nothing may be removed while the driver is in use", got)
	}
}

func TestParseDepAndClosure(t *testing.T) {
	t.Parallel()
	dep := "kernel/drivers/gpu/drm/drm.ko.xz: kernel/drivers/video/fbdev/core/fb.ko.xz kernel/drivers/i2c/i2c-core.ko.xz\nkernel/drivers/video/fbdev/core/fb.ko.xz:\nkernel/drivers/i2c/i2c-core.ko.xz:\n"
	paths, deps, err := ParseDep(strings.NewReader(dep), nil)
	if err != nil {
		t.Fatal(err)
	}
	if paths["drm"] != "kernel/drivers/gpu/drm/drm.ko.xz" || !slices.Equal(deps["drm"], []string{"fb", "i2c_core"}) {
		t.Errorf("paths %v deps %v", paths, deps)
	}
	tree := &Tree{Dir: "/m", Paths: paths, Deps: deps, Builtin: map[string]bool{"video": true}}
	images, ok := tree.Closure("drm", map[string]bool{"fb": true})
	if !ok || len(images) != 2 || images[0].Name != "i2c_core" || images[1].Name != "drm" || images[1].Path != "/m/kernel/drivers/gpu/drm/drm.ko.xz" {
		t.Errorf("closure %+v", images)
	}
	if images, ok := tree.Closure("video", nil); !ok || images != nil {
		t.Error("a built-in module must count as present")
	}
	if _, ok := tree.Closure("nope", nil); ok {
		t.Error("unknown module reported as known")
	}
	for _, bad := range []string{"no colon here\n", "/abs/path.ko:\n", "a.ko: ../../etc/x.ko\n"} {
		if _, _, err := ParseDep(strings.NewReader(bad), nil); err == nil {
			t.Errorf("no error for %q", bad)
		}
	}
}

func TestKmsgSkipsOldRecords(t *testing.T) {
	t.Parallel()
	p := filepath.Join(t.TempDir(), "kmsg")
	hosttest.Must(t, os.WriteFile(p, []byte("6,1,1,-;before\n"), 0o644))
	k := OpenKmsg(p)
	defer k.Close()
	f, _ := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("3,2,2,-;NVRM: No NVIDIA GPU found.\n DEVICE=+pci:0\n")
	f.Close()
	if got := k.Lines(); !slices.Equal(got, []string{"NVRM: No NVIDIA GPU found."}) {
		t.Errorf("lines %q", got)
	}
	if (*Kmsg)(nil).Lines() != nil || OpenKmsg(filepath.Join(t.TempDir(), "none")) != nil {
		t.Error("a missing kmsg must read as nothing")
	}
}

func FuzzParseDep(f *testing.F) {
	f.Add("kernel/a.ko: kernel/b.ko\nkernel/b.ko:\n")
	f.Add("x.ko.zst:\n\n")
	f.Fuzz(func(t *testing.T, in string) {
		paths, deps, err := ParseDep(strings.NewReader(in), nil)
		if err != nil {
			return
		}
		for name, p := range paths {
			if strings.HasPrefix(p, "/") || strings.Contains(p, "..") || name == "" && p == "" {
				t.Fatalf("accepted %q -> %q", name, p)
			}
		}
		for _, ds := range deps {
			for _, d := range ds {
				if strings.Contains(d, "/") {
					t.Fatalf("dependency name %q has a slash", d)
				}
			}
		}
	})
}

func FuzzParseKmsg(f *testing.F) {
	f.Add([]byte("6,1,1,-;hello\n SUBSYSTEM=x\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, l := range ParseKmsg(data) {
			if strings.Contains(l, "\n") || l == "" {
				t.Fatalf("bad line %q", l)
			}
		}
	})
}

// With the host root falling back to the container's, FindTree's error names each directory once.
func TestFindTreeErrorNamesEachDirOnce(t *testing.T) {
	dir := t.TempDir()
	_, err := FindTree(host.Roots{Root: dir, HostRoot: dir}, "6.6.95-flatcar", []string{"nvidia"})
	if err == nil {
		t.Fatal("FindTree found a tree in an empty directory")
	}
	for _, rel := range []string{"usr/lib/modules", "lib/modules", "usr/lib64/modules"} {
		if n := strings.Count(err.Error(), filepath.Join(dir, rel, "6.6.95-flatcar")+"/"); n != 1 {
			t.Errorf("%s named %d times in %q", rel, n, err)
		}
	}
}

// holdDevice makes pid 4242 (python3) hold /dev/nvidia0 in the fake procfs, with a reference on
// nvidia as the open device gives it.
func (e *env) holdDevice(t *testing.T) {
	t.Helper()
	e.kernel.Use("nvidia", 1)
	proc := e.roots.Proc
	if err := os.MkdirAll(filepath.Join(proc, "4242/fd"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/dev/nvidia0", filepath.Join(proc, "4242/fd/3")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(proc, "4242/comm"), []byte("python3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// The wait for a driver in use is bounded by Timeout on the injected clock, every retry is logged
// with the holder, and the end is the script's line: nothing is unloaded.
func TestUnloadTimeoutLogsEachRetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]hosttest.FakeModule{"nvidia_uvm": {Deps: []string{"nvidia"}}})
	hosttest.Must(t, e.kernel.Preload("nvidia", "nvidia_uvm"))
	e.holdDevice(t)
	var logBuf bytes.Buffer
	clock := daemontest.NewInstant(time.Unix(1000, 0))
	u := Unloader{Host: e.host, Log: slog.New(slog.NewTextHandler(&logBuf, nil)), Timeout: time.Minute, Clock: clock}
	err := u.Unload(context.Background(), []string{"nvidia_uvm", "nvidia"})
	if !errors.Is(err, exitcode.ErrInUse) || !strings.Contains(err.Error(), "pid 4242 (python3) has /dev/nvidia0 open") || !strings.Contains(err.Error(), "after 1m0s") {
		t.Fatalf("err = %v", err)
	}
	if waited := clock.Now().Sub(time.Unix(1000, 0)); waited != time.Minute {
		t.Errorf("waited %s on the clock, want the timeout, 1m0s", waited)
	}
	waits := clock.Waits()
	retries := strings.Count(logBuf.String(), `msg="NVIDIA driver kernel modules are in use; retrying"`)
	if retries != len(waits) || retries < 10 || retries > 30 {
		t.Errorf("%d retry lines for %d waits (%v)", retries, len(waits), waits)
	}
	if n := strings.Count(logBuf.String(), `held_by="pid 4242 (python3) has /dev/nvidia0 open"`); n != retries+1 {
		t.Errorf("%d of %d lines name the holder:\n%s", n, retries+1, logBuf.String())
	}
	if !strings.Contains(logBuf.String(), `level=ERROR msg="Could not unload NVIDIA driver kernel modules, driver is in use" busy=nvidia`) {
		t.Errorf("no line of its own with the script's message:\n%s", logBuf.String())
	}
	if calls := e.kernel.Calls(); len(calls) != 0 {
		t.Errorf("calls %v: nothing may be removed while the driver is in use", calls)
	}
	// The dry run looks once: it names the holder and the wait a real run would make, waits for
	// nothing and removes nothing.
	before, nwaits := clock.Now(), len(clock.Waits())
	u.DryRun = true
	err = u.Unload(context.Background(), []string{"nvidia_uvm", "nvidia"})
	if !errors.Is(err, exitcode.ErrInUse) || !strings.Contains(err.Error(), "nvidia busy; held by: pid 4242 (python3) has /dev/nvidia0 open") ||
		!strings.Contains(err.Error(), "retries for up to 1m0s") {
		t.Errorf("dry run: err = %v", err)
	}
	if !clock.Now().Equal(before) || len(clock.Waits()) != nwaits || len(e.kernel.Calls()) != 0 {
		t.Errorf("dry run: clock moved %s, %d waits, calls %v", clock.Now().Sub(before), len(clock.Waits())-nwaits, e.kernel.Calls())
	}
}

// A holder module the caller did not name (gdrdrv, loaded by a sidecar) is a user of the driver:
// nothing is removed and the error names it, unless UnloadForeign.
func TestUnloadLeavesForeignHolders(t *testing.T) {
	t.Parallel()
	specs := map[string]hosttest.FakeModule{"nvidia_uvm": {Deps: []string{"nvidia"}}, "gdrdrv": {Deps: []string{"nvidia"}}}
	e := newEnv(t, specs)
	hosttest.Must(t, e.kernel.Preload("nvidia", "nvidia_uvm", "gdrdrv"))
	u := Unloader{Host: e.host, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: 10 * time.Second, Clock: daemontest.NewInstant(time.Unix(0, 0))}
	err := u.Unload(context.Background(), []string{"nvidia_uvm", "nvidia"})
	if !errors.Is(err, exitcode.ErrInUse) || !strings.Contains(err.Error(), "nvidia busy") || !strings.Contains(err.Error(), "module gdrdrv (not loaded by driver-agent") ||
		!strings.Contains(err.Error(), "--unload-foreign-holders") || strings.Contains(err.Error(), "no process") {
		t.Fatalf("err = %v", err)
	}
	if calls := e.kernel.Calls(); len(calls) != 0 {
		t.Errorf("calls %v: nothing may be removed while a foreign module holds the driver", calls)
	}
	u.DryRun = true
	if err := u.Unload(context.Background(), []string{"nvidia_uvm", "nvidia"}); !errors.Is(err, exitcode.ErrInUse) || len(e.kernel.Calls()) != 0 {
		t.Errorf("dry run: %v, calls %v", err, e.kernel.Calls())
	}
	u.DryRun, u.UnloadForeign = false, true
	if err := u.Unload(context.Background(), []string{"nvidia_uvm", "nvidia"}); err != nil {
		t.Fatal(err)
	}
	if calls := e.kernel.Calls(); !slices.Equal(calls, []string{"unload gdrdrv", "unload nvidia_uvm", "unload nvidia"}) {
		t.Errorf("with UnloadForeign: calls %v", calls)
	}
}

// A cancelled context (a signal while waiting at start) ends the wait with its own error, not
// as "in use".
func TestUnloadCancelled(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	hosttest.Must(t, e.kernel.Preload("nvidia"))
	e.holdDevice(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := Unloader{Host: e.host, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: time.Hour}.Unload(ctx, []string{"nvidia"})
	if !errors.Is(err, context.Canceled) || errors.Is(err, exitcode.ErrInUse) {
		t.Errorf("err = %v", err)
	}
}

// TestResolveReadsTheOpenFile: a module open already (a cache entry's, verified through its
// descriptor) has its .modinfo read through that descriptor, not from its path, and stays open.
func TestResolveReadsTheOpenFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "nvidia-uvm.ko")
	hosttest.Must(t, os.WriteFile(path, hosttest.ModuleELF("name=nvidia_uvm", "depends=nvidia", "version=580.95.05"), 0o644))
	f, err := os.Open(path)
	hosttest.Must(t, err)
	defer f.Close()
	// What the path names now is another file: only the descriptor has the verified bytes.
	hosttest.Must(t, os.Remove(path))
	hosttest.Must(t, os.WriteFile(path, hosttest.ModuleELF("name=nvidia_uvm", "depends=other", "version=1"), 0o644))
	files, err := Resolve([]host.ModuleImage{{Name: "nvidia_uvm", Path: path, File: f}})
	if err != nil {
		t.Fatal(err)
	}
	if info := files[0].Info; info.Version != "580.95.05" || !slices.Equal(info.Depends, []string{"nvidia"}) {
		t.Errorf("modinfo %+v, want the open file's (version 580.95.05, depends nvidia)", info)
	}
	if _, err := f.Stat(); err != nil {
		t.Errorf("the file was closed: %v", err)
	}
}

// TestTreeResolveLeavesTheKernelsFormat: modules of the tree in the format the kernel decompresses
// go to it as files (no Data, dependencies from modules.dep, Compressed); the others are
// decompressed here; the fake kernel, like the real one, decompresses what it is handed, and a
// refusal still reads the module's own .modinfo for its message.
func TestTreeResolveLeavesTheKernelsFormat(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	var xzbuf, zbuf bytes.Buffer
	xw, err := xz.NewWriter(&xzbuf)
	if err != nil {
		t.Fatal(err)
	}
	xw.Write(hosttest.ModuleELF("name=ipmi_devintf", "version=39.2", "depends=ipmi_msghandler", "vermagic=6.12.0-other SMP"))
	hosttest.Must(t, xw.Close())
	zw, _ := zstd.NewWriter(&zbuf)
	zw.Write(hosttest.ModuleELF("name=ipmi_msghandler", "version=39.2", "depends="))
	zw.Close()
	dir := filepath.Join(e.dir, "lib/modules/6.12.0")
	hosttest.Must(t, os.MkdirAll(filepath.Join(dir, "kernel"), 0o755))
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "kernel/ipmi_devintf.ko.xz"), xzbuf.Bytes(), 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "kernel/ipmi_msghandler.ko.zst"), zbuf.Bytes(), 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "modules.dep"), []byte("kernel/ipmi_devintf.ko.xz: kernel/ipmi_msghandler.ko.zst\nkernel/ipmi_msghandler.ko.zst:\n"), 0o644))
	tree, err := ReadTree(dir, []string{"ipmi_devintf"})
	if err != nil {
		t.Fatal(err)
	}
	images, _ := tree.Closure("ipmi_devintf", nil)

	hosttest.Must(t, os.MkdirAll(e.roots.InSys("module"), 0o755))
	hosttest.Must(t, os.WriteFile(e.roots.InSys("module/compression"), []byte("xz\n"), 0o444))
	if got := KernelDecompresses(e.roots); got != modfile.XZ {
		t.Fatalf("KernelDecompresses = %v, want xz", got)
	}
	files, err := tree.Resolve(images, KernelDecompresses(e.roots))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2 || files[0].Image.Name != "ipmi_msghandler" || files[1].Image.Name != "ipmi_devintf" {
		t.Fatalf("files %+v, want ipmi_msghandler then ipmi_devintf", files)
	}
	if f := files[0]; f.Image.Compressed || f.Image.Data == nil {
		t.Errorf("the .ko.zst on an xz kernel: Compressed %v, %d bytes: want it decompressed here", f.Image.Compressed, len(f.Image.Data))
	}
	if f := files[1]; !f.Image.Compressed || f.Image.Data != nil || !slices.Equal(f.Info.Depends, []string{"ipmi_msghandler"}) {
		t.Errorf("the .ko.xz on an xz kernel: Compressed %v, %d bytes, depends %v: want the file for the kernel, modules.dep's dependencies", f.Image.Compressed, len(f.Image.Data), f.Info.Depends)
	}
	loaded, err := e.loader().Load(context.Background(), files)
	if err != nil || !slices.Equal(loaded, []string{"ipmi_msghandler", "ipmi_devintf"}) {
		t.Fatalf("Load = %v, %v", loaded, err)
	}
	if v, _ := os.ReadFile(e.roots.InSys("module/ipmi_devintf/version")); strings.TrimSpace(string(v)) != "39.2" {
		t.Errorf("the kernel loaded ipmi_devintf with version %q, want its own 39.2", v)
	}
	// Loaded again: adopted by the version of its own .modinfo, read now.
	if loaded, err := e.loader().Load(context.Background(), files[1:]); err != nil || !slices.Equal(loaded, []string{"ipmi_devintf"}) {
		t.Errorf("reload of the same version: %v, %v", loaded, err)
	}

	hosttest.Must(t, os.Remove(e.roots.InSys("module/compression")))
	if files, err := tree.Resolve(images, KernelDecompresses(e.roots)); err != nil || files[1].Image.Compressed || files[1].Image.Data == nil {
		t.Errorf("a kernel that decompresses nothing: %+v, %v; want every file decompressed here", files, err)
	}

	e2 := newEnv(t, map[string]hosttest.FakeModule{"ipmi_devintf": {Err: unix.ENOEXEC}})
	_, err = e2.loader().Load(context.Background(), files[1:])
	if err == nil || !strings.Contains(err.Error(), `built for "6.12.0-other SMP"`) {
		t.Errorf("refused: %v, want the vermagic of the module's own .modinfo", err)
	}
}

// On a kernel that cannot unload modules the unloader says so at once, real run or dry run:
// no wait, no delete_module.
func TestUnloadWithoutModuleUnload(t *testing.T) {
	t.Parallel()
	e := newEnv(t, map[string]hosttest.FakeModule{"nvidia_uvm": {Deps: []string{"nvidia"}}})
	hosttest.Must(t, e.kernel.Preload("nvidia", "nvidia_uvm"))
	hosttest.Must(t, e.kernel.WithoutModuleUnload())
	for _, dry := range []bool{false, true} {
		clock := daemontest.NewInstant(time.Unix(0, 0))
		u := Unloader{Host: e.host, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: time.Minute, Clock: clock, DryRun: dry}
		err := u.Unload(context.Background(), []string{"nvidia_uvm", "nvidia"})
		if !errors.Is(err, exitcode.ErrInUse) || !strings.Contains(err.Error(), "nvidia, nvidia_uvm cannot be unloaded: the running kernel was built without module unloading (CONFIG_MODULE_UNLOAD") ||
			!strings.Contains(err.Error(), "they stay loaded until the node reboots") {
			t.Errorf("dry run %v: err = %v", dry, err)
		}
		if len(clock.Waits()) != 0 || len(e.kernel.Calls()) != 0 {
			t.Errorf("dry run %v: waits %v, calls %v", dry, clock.Waits(), e.kernel.Calls())
		}
	}
}

// noUnloadKernel is a kernel whose delete_module is not implemented.
type noUnloadKernel struct{ *hosttest.FakeKernel }

func (noUnloadKernel) UnloadModule(string) error { return unix.ENOSYS }

// A kernel that shows counts but answers ENOSYS to delete_module is explained the same way.
func TestUnloadENOSYS(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	hosttest.Must(t, e.kernel.Preload("nvidia"))
	e.host.Kernel = noUnloadKernel{e.kernel}
	u := Unloader{Host: e.host, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: time.Minute, Clock: daemontest.NewInstant(time.Unix(0, 0))}
	err := u.Unload(context.Background(), []string{"nvidia"})
	if !errors.Is(err, exitcode.ErrInUse) || !strings.Contains(err.Error(), "nvidia cannot be unloaded: the running kernel was built without module unloading (CONFIG_MODULE_UNLOAD; delete_module: function not implemented), so it stays") {
		t.Errorf("err = %v", err)
	}
}

// A plain module of the tree is not read by Tree.Resolve: modules.dep gives its dependencies, and
// the kernel reads the file. Its .modinfo is read only when a refusal needs it (fullInfo).
func TestTreeResolveLeavesPlainModulesUnread(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	hosttest.Must(t, os.MkdirAll(filepath.Join(dir, "kernel"), 0o755))
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "kernel/a.ko"), hosttest.ModuleELF("name=a", "version=1.0", "depends=b"), 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "kernel/b.ko"), []byte("not an ELF file"), 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(dir, "modules.dep"), []byte("kernel/a.ko: kernel/b.ko\nkernel/b.ko:\n"), 0o644))
	tree, err := ReadTree(dir, []string{"a"})
	if err != nil {
		t.Fatal(err)
	}
	images, _ := tree.Closure("a", nil)
	if _, err := Resolve(images); err == nil {
		t.Fatal("Resolve read b.ko, which is not an ELF file, without an error; the test below would prove nothing")
	}
	files, err := tree.Resolve(images, modfile.None)
	if err != nil {
		t.Fatalf("Tree.Resolve read the plain modules: %v", err)
	}
	if len(files) != 2 || files[0].Image.Name != "b" || files[1].Image.Name != "a" {
		t.Fatalf("files %+v, want b then a", files)
	}
	if f := files[1]; f.Image.Compressed || f.Image.Data != nil || !slices.Equal(f.Info.Depends, []string{"b"}) || f.Info.Version != "" {
		t.Errorf("a: Compressed %v, %d bytes, info %+v: want the file for the kernel and modules.dep's dependencies only", f.Image.Compressed, len(f.Image.Data), f.Info)
	}
	if v := files[1].fullInfo().Version; v != "1.0" {
		t.Errorf("fullInfo of a: version %q, want 1.0 from its .modinfo", v)
	}
	if got := files[0].fullInfo(); got.Name != "b" {
		t.Errorf("fullInfo of the unreadable b = %+v, want what modules.dep gave", got)
	}
}
