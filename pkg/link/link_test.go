package link

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
)

const (
	flatcarBanner = "Linux version 6.12.81-flatcar (build@pony-truck.infra.kinvolk.io) (x86_64-cros-linux-gnu-gcc (Gentoo Hardened 14.3.1 p1) 14.3.1 20250801, GNU ld (Gentoo 2.44 p1) 2.44.0) #1 SMP PREEMPT_DYNAMIC Fri Oct 10 18:05:42 -00 2026"
	debianBanner  = "Linux version 6.1.0-41-amd64 (debian-kernel@lists.debian.org) (gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40) #1 SMP PREEMPT_DYNAMIC Debian 6.1.158-1 (2025-11-09)"
)

// Stand-in sources: the interface calls into the core object, as
// nv-linux.o does into nv-kernel.o_binary.
const (
	ifaceSrc  = "extern int nv_core_answer(void);\nint nv_iface_entry(void) { return nv_core_answer() + 1; }\n"
	coreSrc   = "int nv_core_answer(void) { return 41; }\nint nv_core_private_table[16];\n"
	commonSrc = "const char module_common_marker[] = \"common\";\n"
	ifaceSym  = "nv_iface_entry"
	coreSym   = "nv_core_answer"
	commonSym = "module_common_marker"
)

// objects holds stand-in objects compiled once per test binary.
type objects struct {
	iface, core, common []byte
}

var compileOnce = sync.OnceValues(func() (objects, error) {
	dir, err := os.MkdirTemp("", "link-objects-")
	if err != nil {
		return objects{}, err
	}
	defer os.RemoveAll(dir)
	var o objects
	for _, c := range []struct {
		src string
		dst *[]byte
	}{{ifaceSrc, &o.iface}, {coreSrc, &o.core}, {commonSrc, &o.common}} {
		if *c.dst, err = compile(dir, c.src); err != nil {
			return objects{}, err
		}
	}
	return o, nil
})

// compile compiles C source into a relocatable object with the system gcc.
func compile(dir, src string) ([]byte, error) {
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		return nil, errors.New("gcc not installed: run make deps (apt-get install gcc binutils)")
	}
	f, err := os.CreateTemp(dir, "src-*.c")
	if err != nil {
		return nil, err
	}
	if _, err := f.WriteString(src); err != nil {
		return nil, err
	}
	f.Close()
	obj := strings.TrimSuffix(f.Name(), ".c") + ".o"
	if out, err := exec.Command(gcc, "-c", "-O2", "-fno-pic", "-o", obj, f.Name()).CombinedOutput(); err != nil {
		return nil, errors.New("gcc: " + err.Error() + ": " + string(out))
	}
	return os.ReadFile(obj)
}

func stubs(t *testing.T) objects {
	t.Helper()
	o, err := compileOnce()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("ld"); err != nil {
		t.Fatal("ld not installed: run make deps (apt-get install binutils)")
	}
	return o
}

// coreDir writes the core object where Options.CoreObjectDir expects it.
func coreDir(t *testing.T, o objects) string {
	t.Helper()
	dir := t.TempDir()
	write(t, filepath.Join(dir, "nvidia", "nv-kernel.o_binary"), o.core)
	return dir
}

func write(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// newPackage returns a package with the interface nv-linux.o (linked into
// nvidia.ko with nvidia/nv-kernel.o_binary), optionally with a detached
// signature made for linked, followed by extra members.
func newPackage(t *testing.T, banner string, o objects, sig *signature, extra ...precompiled.File) *precompiled.Package {
	t.Helper()
	p := &precompiled.Package{DriverVersion: "595.71.05", Description: "test", ProcVersion: banner}
	f, err := precompiled.NewKernelInterface("nv-linux.o", "nvidia.ko", "nvidia/nv-kernel.o_binary", ".", o.iface)
	if err != nil {
		t.Fatal(err)
	}
	if sig != nil {
		if err := f.SetDetachedSignature(sig.linked, append(slices.Clone(sig.linked), sig.bytes...)); err != nil {
			t.Fatal(err)
		}
	}
	for _, m := range append([]precompiled.File{f}, extra...) {
		if err := p.Append(m); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

type signature struct{ linked, bytes []byte }

func kernelModule(t *testing.T, name string, data []byte, signed bool) precompiled.File {
	t.Helper()
	f, err := precompiled.NewKernelModule(name, ".", data, signed)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// definedSymbols returns the names of the symbols an ELF relocatable object
// defines, after checking that it is one.
func definedSymbols(t *testing.T, path string) []string {
	t.Helper()
	f, err := elf.Open(path)
	if err != nil {
		t.Fatalf("%s is not an ELF file: %v", path, err)
	}
	defer f.Close()
	if f.Type != elf.ET_REL {
		t.Fatalf("%s: ELF type %v, want ET_REL", path, f.Type)
	}
	syms, err := f.Symbols()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range syms {
		if s.Section != elf.SHN_UNDEF && s.Name != "" {
			names = append(names, s.Name)
		}
	}
	return names
}

func TestLinkRealObjects(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	uvm := []byte("\x7fELF stand-in nvidia-uvm.ko")
	peermem := append([]byte("\x7fELF stand-in nvidia-peermem.ko"), "sig"+signatureMarker...)
	p := newPackage(t, debianBanner, o, nil,
		kernelModule(t, "nvidia-uvm.ko", uvm, false),
		kernelModule(t, "nvidia-peermem.ko", peermem, false))
	work := filepath.Join(t.TempDir(), "work")
	log, logs := hosttest.NewLog()
	mods, err := Link(context.Background(), p, work, Options{Procs: host.OSExec{}, CoreObjectDir: coreDir(t, o), Log: log})
	if err != nil {
		t.Fatal(err)
	}
	want := []Module{
		{Name: "nvidia", Path: filepath.Join(work, "nvidia.ko")},
		{Name: "nvidia_uvm", Path: filepath.Join(work, "nvidia-uvm.ko")},
		{Name: "nvidia_peermem", Path: filepath.Join(work, "nvidia-peermem.ko"), Signed: true},
	}
	if !slices.Equal(mods, want) {
		t.Fatalf("modules = %+v\nwant %+v", mods, want)
	}
	syms := definedSymbols(t, mods[0].Path)
	for _, s := range []string{ifaceSym, coreSym, "nv_core_private_table"} {
		if !slices.Contains(syms, s) {
			t.Errorf("linked module lacks %s; defines %v", s, syms)
		}
	}
	if slices.Contains(syms, commonSym) {
		t.Errorf("module-common merged for a 6.1 kernel")
	}
	for i, data := range [][]byte{uvm, peermem} {
		if got, err := os.ReadFile(mods[i+1].Path); err != nil || !bytes.Equal(got, data) {
			t.Errorf("%s not copied as it is: %v", mods[i+1].Path, err)
		}
	}
	if st, err := os.Stat(work); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("work dir mode %v, %v; want 0700", st.Mode(), err)
	}
	if !strings.Contains(logs.String(), "linking kernel module") {
		t.Errorf("no progress logged:\n%s", logs)
	}
}

// plainLink links the stand-in package without a signature and returns the
// linker's output, which later packages sign.
func plainLink(t *testing.T, o objects, core string) []byte {
	t.Helper()
	mods, err := Link(context.Background(), newPackage(t, debianBanner, o, nil), filepath.Join(t.TempDir(), "w"),
		Options{Procs: host.OSExec{}, CoreObjectDir: core})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(mods[0].Path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestLinkSignature(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	core := coreDir(t, o)
	linked := plainLink(t, o, core)
	sig := append([]byte("PKCS#7 stand-in"), signatureMarker...)
	other := append(slices.Clone(linked), 'x') // what a different linker might produce

	tests := []struct {
		name          string
		sig           *signature
		requireSigned bool
		wantErr       error
		wantSigned    bool
		wantLog       string
	}{
		{name: "crc matches: attached", sig: &signature{linked, sig}, wantSigned: true, wantLog: "attached the stored module signature"},
		{name: "crc matches, signature required", sig: &signature{linked, sig}, requireSigned: true, wantSigned: true},
		{name: "crc differs: unsigned with a warning", sig: &signature{other, sig}, wantLog: "level=WARN"},
		{name: "crc differs, signature required", sig: &signature{other, sig}, requireSigned: true, wantErr: ErrUnsigned},
		{name: "no signature", wantLog: ""},
		{name: "no signature, signature required", requireSigned: true, wantErr: ErrUnsigned},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := newPackage(t, debianBanner, o, tc.sig)
			if tc.sig != nil && p.Files[0].LinkedModuleCRC != precompiled.Checksum(tc.sig.linked) {
				t.Fatal("package does not store the crc of the signed module")
			}
			log, logs := hosttest.NewLog()
			mods, err := Link(context.Background(), p, t.TempDir(), Options{Procs: host.OSExec{}, CoreObjectDir: core, RequireSigned: tc.requireSigned, Log: log})
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				t.Log(err)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(mods[0].Path)
			if err != nil {
				t.Fatal(err)
			}
			want := linked
			if tc.wantSigned {
				want = append(slices.Clone(linked), sig...)
			}
			if !bytes.Equal(got, want) || mods[0].Signed != tc.wantSigned {
				t.Errorf("module: %d bytes, signed=%v; want %d bytes, signed=%v", len(got), mods[0].Signed, len(want), tc.wantSigned)
			}
			if !strings.Contains(logs.String(), tc.wantLog) {
				t.Errorf("log lacks %q:\n%s", tc.wantLog, logs)
			}
			if !tc.wantSigned && strings.Contains(logs.String(), "attached") {
				t.Errorf("log claims a signature was attached:\n%s", logs)
			}
		})
	}
}

func TestLinkModuleCommon(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	commonMember := kernelModule(t, ModuleCommonObject, o.common, false)
	tests := []struct {
		name       string
		banner     string
		release    string
		inPackage  bool
		inCoreDir  bool
		wantMerged bool
	}{
		{"6.12 with the package's copy", flatcarBanner, "", true, false, true},
		{"6.12 with the core dir's copy", flatcarBanner, "", false, true, true},
		{"6.12 without any", flatcarBanner, "", false, false, false},
		{"6.1 with the package's copy", debianBanner, "", true, true, false},
		{"release option wins over the banner", debianBanner, "6.13.0", true, false, true},
		{"release 7.0", debianBanner, "7.0.1-custom", false, true, true},
		{"unparsable release", "not a banner", "", true, true, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var extra []precompiled.File
			if tc.inPackage {
				extra = append(extra, commonMember)
			}
			p := newPackage(t, tc.banner, o, nil, extra...)
			core := coreDir(t, o)
			if tc.inCoreDir {
				write(t, filepath.Join(core, ModuleCommonObject), o.common)
			}
			mods, err := Link(context.Background(), p, t.TempDir(), Options{Procs: host.OSExec{}, CoreObjectDir: core, KernelRelease: tc.release})
			if err != nil {
				t.Fatal(err)
			}
			if len(mods) != 1 || mods[0].Name != "nvidia" {
				t.Fatalf("modules = %+v; .module-common.o must not be listed", mods)
			}
			syms := definedSymbols(t, mods[0].Path)
			if got := slices.Contains(syms, commonSym); got != tc.wantMerged {
				t.Errorf("module-common merged = %v, want %v", got, tc.wantMerged)
			}
			if !slices.Contains(syms, ifaceSym) || !slices.Contains(syms, coreSym) {
				t.Errorf("symbols %v lack the interface or the core", syms)
			}
		})
	}
}

func TestReleaseAtLeast(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		rel          string
		newer, valid bool
	}{
		{"6.12", true, true}, {"6.12.81-flatcar", true, true}, {"6.11.9", false, true},
		{"6.1.0-41-amd64", false, true}, {"5.15.0-91-generic", false, true}, {"7.0", true, true},
		{"10.2.3", true, true}, {"6.120", true, true}, {"", false, false}, {"6", false, false},
		{"x.12", false, false}, {"6.x", false, false},
	} {
		newer, ok := releaseAtLeast(tc.rel, 6, 12)
		if newer != tc.newer || ok != tc.valid {
			t.Errorf("releaseAtLeast(%q) = %v, %v; want %v, %v", tc.rel, newer, ok, tc.newer, tc.valid)
		}
	}
}

func TestLinkRejects(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	core := coreDir(t, o)
	data := []byte("module")
	escaping := func(td, name string) *precompiled.Package {
		// Built field by field: the constructors would refuse these paths.
		return &precompiled.Package{DriverVersion: "1", ProcVersion: debianBanner, Files: []precompiled.File{{
			Type: precompiled.KernelModule, Name: name, TargetDirectory: td,
			CRC: precompiled.StoredCRC(data), Data: data,
		}}}
	}
	badLinked := newPackage(t, debianBanner, o, nil)
	badLinked.Files[0].LinkedModuleName = "../nvidia.ko"
	collide := newPackage(t, debianBanner, o, nil, kernelModule(t, "nvidia.ko", data, false))
	dup := newPackage(t, debianBanner, o, nil, kernelModule(t, "nvidia-uvm.ko", data, false))
	dup.Files = append(dup.Files, dup.Files[1])
	dup.Files[2].Index, dup.Files[2].TargetDirectory = 2, "again"
	noCore := newPackage(t, debianBanner, o, nil)
	noCore.Files[0].CoreObjectName = ""

	tests := []struct {
		name    string
		p       *precompiled.Package
		opts    Options
		wantErr error
		want    string
	}{
		{"target directory escapes", escaping("../escape", "x.ko"), Options{Procs: host.OSExec{}}, precompiled.ErrUnsafePath, "escape"},
		{"absolute target directory", escaping("/tmp", "x.ko"), Options{Procs: host.OSExec{}}, precompiled.ErrUnsafePath, "absolute"},
		{"name with a slash", escaping(".", "a/x.ko"), Options{Procs: host.OSExec{}}, precompiled.ErrUnsafePath, "slash"},
		{"linked module escapes", badLinked, Options{Procs: host.OSExec{}, CoreObjectDir: core}, precompiled.ErrUnsafePath, "../nvidia.ko"},
		{"linked module overwrites a member", collide, Options{Procs: host.OSExec{}, CoreObjectDir: core}, precompiled.ErrInvalid, "overwrite"},
		{"two members give one module", dup, Options{Procs: host.OSExec{}, CoreObjectDir: core}, precompiled.ErrInvalid, "nvidia_uvm"},
		{"interface without core object name", noCore, Options{Procs: host.OSExec{}, CoreObjectDir: core}, precompiled.ErrInvalid, "core object name"},
		{"no core object dir", newPackage(t, debianBanner, o, nil), Options{Procs: host.OSExec{}}, precompiled.ErrInvalid, "core object directory"},
		{"missing core object", newPackage(t, debianBanner, o, nil), Options{Procs: host.OSExec{}, CoreObjectDir: t.TempDir()}, os.ErrNotExist, "nv-kernel.o_binary"},
		{"no such linker", newPackage(t, debianBanner, o, nil), Options{Procs: host.OSExec{}, CoreObjectDir: core, LD: "/nonexistent/ld"}, ErrLink, "/nonexistent/ld"},
		{"nil package", nil, Options{Procs: host.OSExec{}}, precompiled.ErrInvalid, "no package"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			parent := t.TempDir()
			work := filepath.Join(parent, "work")
			_, err := Link(context.Background(), tc.p, work, tc.opts)
			if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %v mentioning %q", err, tc.wantErr, tc.want)
			}
			t.Log(err)
			entries, _ := os.ReadDir(parent)
			for _, e := range entries {
				if e.Name() != "work" {
					t.Errorf("%s was written outside the work dir", e.Name())
				}
			}
		})
	}
}

func TestLinkWorkDir(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	p := newPackage(t, debianBanner, o, nil)
	opts := Options{Procs: host.OSExec{}, CoreObjectDir: coreDir(t, o)}

	nonEmpty := t.TempDir()
	write(t, filepath.Join(nonEmpty, "old"), nil)
	if _, err := Link(context.Background(), p, nonEmpty, opts); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Errorf("non-empty work dir: err = %v", err)
	}
	file := filepath.Join(t.TempDir(), "file")
	write(t, file, nil)
	if _, err := Link(context.Background(), p, file, opts); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Errorf("file as work dir: err = %v", err)
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	if _, err := Link(context.Background(), p, link, opts); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Errorf("symlink as work dir: err = %v", err)
	}
	if _, err := Link(context.Background(), p, filepath.Join(t.TempDir(), "a", "b"), opts); err == nil {
		t.Error("work dir with a missing parent: no error")
	}
	empty := t.TempDir() // exists and is empty: used, and made private
	if err := os.Chmod(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := Link(context.Background(), p, empty, opts); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(empty); st.Mode().Perm() != 0o700 {
		t.Errorf("work dir mode %v, want 0700", st.Mode().Perm())
	}
}

// fakeLD writes a shell script standing in for ld.
func fakeLD(t *testing.T, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fake-ld")
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestLinkerFailure(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	ld := fakeLD(t, `echo "fake-ld: undefined reference to nv_core_answer" >&2; exit 1`+"\n")
	_, err := Link(context.Background(), newPackage(t, debianBanner, o, nil), t.TempDir(), Options{Procs: host.OSExec{}, CoreObjectDir: coreDir(t, o), LD: ld})
	if !errors.Is(err, ErrLink) || !strings.Contains(err.Error(), "undefined reference to nv_core_answer") ||
		!strings.Contains(err.Error(), "exit status 1") || !strings.Contains(err.Error(), "link nvidia.ko") {
		t.Fatalf("err = %v", err)
	}
	empty := fakeLD(t, `while [ "$1" != -o ]; do shift; done; : > "$2"`+"\n")
	_, err = Link(context.Background(), newPackage(t, debianBanner, o, nil), t.TempDir(), Options{Procs: host.OSExec{}, CoreObjectDir: coreDir(t, o), LD: empty})
	if !errors.Is(err, ErrLink) || !strings.Contains(err.Error(), "empty") {
		t.Fatalf("empty output: err = %v", err)
	}
}

// TestLinkCancel cancels a linker that hangs: Link returns promptly with the
// context's error and the linker's whole process group is gone.
func TestLinkCancel(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	dir := t.TempDir()
	pids := filepath.Join(dir, "pids")
	// The script starts a child that would outlive a kill of the script alone.
	ld := fakeLD(t, `sleep 300 & echo "$$ $!" > `+pids+".tmp; mv "+pids+".tmp "+pids+"; wait\n")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := Link(ctx, newPackage(t, debianBanner, o, nil), filepath.Join(dir, "work"), Options{Procs: host.OSExec{}, CoreObjectDir: coreDir(t, o), LD: ld})
		done <- err
	}()
	var ids []int
	deadline := time.Now().Add(10 * time.Second)
	for {
		if b, err := os.ReadFile(pids); err == nil {
			for _, f := range strings.Fields(string(b)) {
				id, err := strconv.Atoi(f)
				if err != nil {
					t.Fatal(err)
				}
				ids = append(ids, id)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("fake ld did not start")
		}
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
		t.Logf("returned %v after cancel: %v", time.Since(start).Round(time.Millisecond), err)
	case <-time.After(10 * time.Second):
		t.Fatal("Link did not return after cancel")
	}
	for _, id := range ids {
		waitGone(t, id)
	}
}

// waitGone waits until process id no longer runs (it may linger as a zombie
// until its new parent reaps it).
func waitGone(t *testing.T, id int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(id) + "/stat")
		if err != nil || zombie(string(b)) {
			return
		}
		if time.Now().After(deadline) {
			syscall.Kill(id, syscall.SIGKILL)
			t.Fatalf("process %d survived the cancel: %s", id, b)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// zombie reports whether a /proc/<pid>/stat line is for a zombie.
func zombie(stat string) bool {
	i := strings.LastIndexByte(stat, ')')
	return i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}

func TestLinkThroughProcs(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	procs := &hosttest.FakeProcs{Handle: host.OSExec{}.Output}
	mods, err := Link(context.Background(), newPackage(t, debianBanner, o, nil), filepath.Join(t.TempDir(), "work"), Options{CoreObjectDir: coreDir(t, o), Procs: procs})
	if err != nil {
		t.Fatal(err)
	}
	cmds := procs.Cmds()
	if len(cmds) == 0 || !filepath.IsAbs(cmds[0].Path) || cmds[0].Args[0] != "-d" {
		t.Fatalf("commands %+v: want ld by absolute path with -d -r", cmds)
	}
	if len(mods) == 0 {
		t.Fatal("no modules")
	}
}

// barrierRunner runs each linker only once want of them have started, so a Link that runs
// them one after the other never gets its first one through.
type barrierRunner struct {
	host.OSExec
	want    int
	mu      sync.Mutex
	started int
	all     chan struct{}
}

func (r *barrierRunner) Output(ctx context.Context, c host.Cmd) ([]byte, error) {
	r.mu.Lock()
	r.started++
	if r.started == r.want {
		close(r.all)
	}
	r.mu.Unlock()
	select {
	case <-r.all:
	case <-time.After(20 * time.Second):
		return nil, errors.New("this linker ran alone: the other one did not start beside it")
	}
	return r.OSExec.Output(ctx, c)
}

// twoInterfaces is a package with nvidia.ko's and nvidia-modeset.ko's interfaces, and the
// core object directory for both.
func twoInterfaces(t *testing.T, o objects) (*precompiled.Package, string) {
	t.Helper()
	p := newPackage(t, debianBanner, o, nil)
	f, err := precompiled.NewKernelInterface("nv-modeset-linux.o", "nvidia-modeset.ko", "nvidia-modeset/nv-modeset-kernel.o_binary", ".", o.iface)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Append(f); err != nil {
		t.Fatal(err)
	}
	core := coreDir(t, o)
	write(t, filepath.Join(core, "nvidia-modeset", "nv-modeset-kernel.o_binary"), o.core)
	return p, core
}

// TestLinkRunsInterfacesTogether: both interfaces are linked at the same time, and the modules
// come back in package order.
func TestLinkRunsInterfacesTogether(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	p, core := twoInterfaces(t, o)
	runner := &barrierRunner{want: 2, all: make(chan struct{})}
	work := filepath.Join(t.TempDir(), "work")
	mods, err := Link(context.Background(), p, work, Options{CoreObjectDir: core, Procs: runner, MaxLinks: 2})
	if err != nil {
		t.Fatal(err)
	}
	if len(mods) != 2 || mods[0].Name != "nvidia" || mods[1].Name != "nvidia_modeset" ||
		mods[0].Path != filepath.Join(work, "nvidia.ko") || mods[1].Path != filepath.Join(work, "nvidia-modeset.ko") {
		t.Fatalf("modules %+v", mods)
	}
	for _, m := range mods {
		definedSymbols(t, m.Path)
	}
}

// failingRunner fails the link of nvidia-modeset.ko at once and holds nvidia.ko's until its
// context ends (or fails it after 20 s).
type failingRunner struct{ host.OSExec }

func (failingRunner) Output(ctx context.Context, c host.Cmd) ([]byte, error) {
	if strings.Contains(strings.Join(c.Args, " "), "nv-modeset-linux.o") {
		return nil, errors.New("exit status 1: undefined reference to nv_modeset_core")
	}
	select {
	case <-ctx.Done():
		return nil, errors.Join(errors.New("killed"), ctx.Err())
	case <-time.After(20 * time.Second):
		return nil, errors.New("nvidia.ko's link was not cancelled")
	}
}

// TestLinkFailureCancelsTheOther: when one link fails, the one still running is cancelled and
// Link returns the failure, not the cancellation.
func TestLinkFailureCancelsTheOther(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	p, core := twoInterfaces(t, o)
	_, err := Link(context.Background(), p, filepath.Join(t.TempDir(), "work"), Options{CoreObjectDir: core, Procs: failingRunner{}, MaxLinks: 2})
	if !errors.Is(err, ErrLink) || errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "link nvidia-modeset.ko") ||
		!strings.Contains(err.Error(), "nv_modeset_core") {
		t.Fatalf("err = %v; want nvidia-modeset.ko's link failure", err)
	}
}

// overlapRunner records the most linkers it ran at once.
type overlapRunner struct {
	host.OSExec
	mu            sync.Mutex
	running, most int
}

func (r *overlapRunner) Output(ctx context.Context, c host.Cmd) ([]byte, error) {
	r.mu.Lock()
	r.running++
	r.most = max(r.most, r.running)
	r.mu.Unlock()
	time.Sleep(50 * time.Millisecond) // long enough for a second link to start beside it
	out, err := r.OSExec.Output(ctx, c)
	r.mu.Lock()
	r.running--
	r.mu.Unlock()
	return out, err
}

// TestLinkOneAtATime: with MaxLinks 1 (a process on one CPU) the links run one after the other,
// and both modules come back in package order.
func TestLinkOneAtATime(t *testing.T) {
	t.Parallel()
	o := stubs(t)
	p, core := twoInterfaces(t, o)
	runner := &overlapRunner{}
	mods, err := Link(context.Background(), p, filepath.Join(t.TempDir(), "work"), Options{CoreObjectDir: core, Procs: runner, MaxLinks: 1})
	if err != nil {
		t.Fatal(err)
	}
	if runner.most != 1 || len(mods) != 2 || mods[0].Name != "nvidia" || mods[1].Name != "nvidia_modeset" {
		t.Fatalf("%d links at once, modules %+v; want one at a time, nvidia then nvidia_modeset", runner.most, mods)
	}
}
