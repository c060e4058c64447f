package sysext

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/modfile"
)

// ErrInput means the inputs cannot make an extension: a module, binary, library or the firmware
// is missing or unreadable. Nothing is written.
var ErrInput = errors.New("cannot make the system extension")

// UnitName is the systemd unit the extension ships: it loads the modules and runs
// nvidia-persistenced. (Flatcar's own driver setup is nvidia.service; this name does not clash.)
const UnitName = "nvidia-driver.service"

// SumsFile is the checksum file written beside the images, in sha256sum's format.
const SumsFile = "SHA256SUMS"

// loadOrder is the modules the unit loads, in order; the agent loads the same set. The others
// that were built (nvidia-drm, nvidia-peermem, ...) are in the image but left to the operator.
var loadOrder = []string{"nvidia", "nvidia-uvm", "nvidia-modeset"}

// prerequisites are the host modules nvidia needs loaded first where the kernel has them as
// modules (Azure gen2 VMs do not probe i2c_core; IPMI for the SMBus/IPMI features).
var prerequisites = []string{"i2c_core", "ipmi_msghandler", "ipmi_devintf"}

// Module is a built kernel module file.
type Module struct {
	Path string // the .ko file
}

// Options says what goes into the image.
type Options struct {
	DriverVersion  string // the modules' and userspace's driver version
	FlatcarVersion string // the Flatcar VERSION_ID the modules were built for
	Architecture   string // systemd's name: x86-64 or arm64
	KernelRelease  string // the kernel the modules were built for (uname -r)
	// Modules are the built modules; nvidia.ko is required.
	Modules []Module
	// ContainerRoot is the root the userspace is taken from, as the driver root the agent
	// shares would expose it: nvidia-smi and nvidia-persistenced in usr/bin (or bin, usr/sbin,
	// usr/local/bin), the driver's libraries (lib*.so.<driver version> and their links) in the
	// architecture's lib directories, and the GSP firmware in
	// usr/share/driver-agent/firmware/nvidia/<version> or lib/firmware/nvidia/<version>.
	ContainerRoot string
	// OutDir receives Name().raw and SHA256SUMS. It must exist.
	OutDir string
	// Mksquashfs is the mksquashfs program; "" means mksquashfs in PATH.
	Mksquashfs string
	// Procs runs mksquashfs. Required.
	Procs host.Procs
	// Generator names the program in the unit's header comment.
	Generator string
	Log       *slog.Logger
}

// Result is a written extension.
type Result struct {
	Name   string   // the extension's name
	Image  string   // OutDir/Name.raw
	SHA256 string   // the image's digest, as in SHA256SUMS
	Size   int64    // the image's size
	Files  []string // the files in the image, relative to its root, sorted
}

// Build writes the extension image and its line in SHA256SUMS. The tree is staged in a
// temporary directory beside the image, squashed into a temporary file there and renamed into
// place only when complete, and SHA256SUMS is replaced atomically, so a failure leaves OutDir as
// it was. An existing image of the same name is replaced; other lines of SHA256SUMS are kept.
func Build(ctx context.Context, o Options) (Result, error) {
	if err := o.validate(); err != nil {
		return Result{}, err
	}
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	name := Name(o.DriverVersion, o.FlatcarVersion)
	stage, err := os.MkdirTemp(o.OutDir, "."+name+".stage-")
	if err != nil {
		return Result{}, fmt.Errorf("sysext: %w", err)
	}
	defer os.RemoveAll(stage)
	files, err := o.populate(stage, name)
	if err != nil {
		return Result{}, err
	}
	if err := fixModes(stage); err != nil {
		return Result{}, fmt.Errorf("sysext: %w", err)
	}
	tmp, err := o.squash(ctx, stage, name)
	if err != nil {
		return Result{}, err
	}
	defer os.Remove(tmp) // gone after the rename; there on failure
	sum, size, err := digest(tmp)
	if err != nil {
		return Result{}, fmt.Errorf("sysext: %w", err)
	}
	image := filepath.Join(o.OutDir, name+".raw")
	sums, err := mergeSums(filepath.Join(o.OutDir, SumsFile), name+".raw", sum)
	if err != nil {
		return Result{}, err
	}
	if err := os.Rename(tmp, image); err != nil {
		return Result{}, fmt.Errorf("sysext: %w", err)
	}
	if err := host.WriteAtomic(filepath.Join(o.OutDir, SumsFile), sums, 0o644); err != nil {
		os.Remove(image)
		return Result{}, fmt.Errorf("sysext: %w", err)
	}
	log.Info("wrote the system extension", "image", image, "sha256", sum, "bytes", size, "files", len(files))
	return Result{Name: name, Image: image, SHA256: sum, Size: size, Files: files}, nil
}

func (o Options) validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("sysext: %w: %s", ErrInput, fmt.Sprintf(format, a...))
	}
	name := Name(o.DriverVersion, o.FlatcarVersion)
	switch _, _, ok := ParseName(name); {
	case !ok:
		return bad("driver version %q and Flatcar version %q do not make an extension name (want like 535.261.03 and 4593.2.0)", o.DriverVersion, o.FlatcarVersion)
	case o.Architecture != "x86-64" && o.Architecture != "arm64":
		return bad("architecture %q: want x86-64 or arm64", o.Architecture)
	case o.KernelRelease == "" || strings.ContainsAny(o.KernelRelease, "/ \t\n'\"\\$%"):
		return bad("kernel release %q is not a release like 6.12.81-flatcar", o.KernelRelease)
	case o.OutDir == "":
		return bad("no output directory")
	}
	if st, err := os.Stat(o.OutDir); err != nil || !st.IsDir() {
		return bad("output directory %s: not a directory (%v)", o.OutDir, err)
	}
	var seen []string
	for _, m := range o.Modules {
		base := filepath.Base(m.Path)
		if !strings.HasPrefix(base, "nvidia") || !strings.HasSuffix(base, ".ko") {
			return bad("module %s: want an nvidia*.ko file", m.Path)
		}
		if slices.Contains(seen, base) {
			return bad("module %s given twice", base)
		}
		seen = append(seen, base)
	}
	if !slices.Contains(seen, "nvidia.ko") {
		return bad("no nvidia.ko among the modules")
	}
	return nil
}

// populate lays the extension's tree out in dir and returns its files, sorted.
func (o Options) populate(dir, name string) ([]string, error) {
	var files []string
	put := func(rel string, data []byte, perm os.FileMode) error {
		p := filepath.Join(dir, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return fmt.Errorf("sysext: %w", err)
		}
		if err := os.WriteFile(p, data, perm); err != nil {
			return fmt.Errorf("sysext: %w", err)
		}
		files = append(files, rel)
		return nil
	}
	link := func(rel, target string) error {
		p := filepath.Join(dir, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return fmt.Errorf("sysext: %w", err)
		}
		if err := os.Symlink(target, p); err != nil {
			return fmt.Errorf("sysext: %w", err)
		}
		files = append(files, rel)
		return nil
	}

	mods, err := o.readModules()
	if err != nil {
		return nil, err
	}
	updates := path.Join("usr/lib/modules", o.KernelRelease, "updates")
	for _, m := range mods {
		if err := put(path.Join(updates, m.file), m.data, 0o644); err != nil {
			return nil, err
		}
	}
	if err := put(path.Join(updates, DepFile), depEntries(mods), 0o644); err != nil {
		return nil, err
	}

	us, err := o.userspace()
	if err != nil {
		return nil, err
	}
	for _, f := range us {
		var err error
		if f.link != "" {
			err = link(f.rel, f.link)
		} else {
			err = copyInto(filepath.Join(dir, filepath.FromSlash(f.rel)), f.src, f.perm)
			files = append(files, f.rel)
		}
		if err != nil {
			return nil, err
		}
	}

	unit := "usr/lib/systemd/system/" + UnitName
	if err := put(unit, o.unit(name, mods), 0o644); err != nil {
		return nil, err
	}
	if err := link("usr/lib/systemd/system/multi-user.target.wants/"+UnitName, "../"+UnitName); err != nil {
		return nil, err
	}
	rel := Release{ID: "flatcar", VersionID: o.FlatcarVersion, Architecture: o.Architecture}
	if err := put(path.Join(ReleaseDir, "extension-release."+name), rel.Format(), 0o644); err != nil {
		return nil, err
	}
	sort.Strings(files)
	return files, nil
}

// DepFile holds the modules' modules.dep entries (depmod's format, paths relative to
// /usr/lib/modules/<kver>) beside them in updates/. The extension ships no modules.dep* of the
// kernel's own name: merged over /usr it would hide the host's depmod database and every other
// module in it (flatcar/Flatcar#1576); Flatcar runs depmod for merged extensions itself.
const DepFile = "nvidia.modules.dep"

type builtModule struct {
	file    string   // nvidia-uvm.ko
	name    string   // nvidia_uvm
	depends []string // from .modinfo
	data    []byte
}

func (o Options) readModules() ([]builtModule, error) {
	var mods []builtModule
	for _, m := range o.Modules {
		data, err := os.ReadFile(m.Path)
		if err != nil {
			return nil, fmt.Errorf("sysext: %w: %w", ErrInput, err)
		}
		info, err := modfile.Info(data)
		if err != nil {
			return nil, fmt.Errorf("sysext: %w: module %s: %w", ErrInput, m.Path, err)
		}
		if f := strings.Fields(info.Vermagic); len(f) == 0 || f[0] != o.KernelRelease {
			return nil, fmt.Errorf("sysext: %w: module %s has vermagic %q, not for kernel %s", ErrInput, m.Path, info.Vermagic, o.KernelRelease)
		}
		var deps []string // modpost writes the file names (nvidia-modeset); the kernel's names have underscores
		for _, d := range info.Depends {
			deps = append(deps, strings.ReplaceAll(d, "-", "_"))
		}
		mods = append(mods, builtModule{file: filepath.Base(m.Path), name: modfile.NameFromPath(m.Path), depends: deps, data: data})
	}
	sort.Slice(mods, func(i, j int) bool { return mods[i].file < mods[j].file })
	return mods, nil
}

// depEntries writes modules.dep lines for mods: each module with the others of mods it needs,
// transitively, in depmod's order (a module before the ones it needs: modprobe loads the list
// from the end). Dependencies on the host's modules have no path here; the unit loads those with
// modprobe.
func depEntries(mods []builtModule) []byte {
	byName := map[string]builtModule{}
	for _, m := range mods {
		byName[m.name] = m
	}
	var b bytes.Buffer
	for _, m := range mods {
		fmt.Fprintf(&b, "updates/%s:", m.file)
		load := loadOrderOf(m, byName)
		for i := len(load) - 1; i >= 0; i-- {
			fmt.Fprintf(&b, " updates/%s", byName[load[i]].file)
		}
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// loadOrderOf returns the modules of byName that m needs, transitively, each after the ones it
// needs itself.
func loadOrderOf(m builtModule, byName map[string]builtModule) []string {
	var out []string
	seen := map[string]bool{m.name: true}
	var visit func(builtModule)
	visit = func(x builtModule) {
		for _, d := range x.depends {
			dm, ok := byName[d]
			if !ok || seen[d] {
				continue
			}
			seen[d] = true
			visit(dm)
			out = append(out, d)
		}
	}
	visit(m)
	return out
}

// unit is the systemd unit: the host modules the driver needs (modprobe, failures ignored as on
// kernels that build them in), then each module of loadOrder that was built, by path and only
// when not loaded yet (insmod; the image's modules are not in the host's depmod database), then
// nvidia-persistenced. Each load command is `/bin/sh -c '...'` with no systemd specifiers or
// variables, so that it reads the same to systemd and to a shell.
func (o Options) unit(name string, mods []builtModule) []byte {
	byName := map[string]builtModule{}
	for _, m := range mods {
		byName[m.name] = m
	}
	host := slices.Clone(prerequisites)
	var order []string
	for _, want := range loadOrder {
		m, ok := byName[modfile.NameFromPath(want+".ko")]
		if !ok {
			continue
		}
		for _, d := range m.depends {
			if _, ours := byName[d]; !ours && !slices.Contains(host, d) {
				host = append(host, d)
			}
		}
		order = append(order, m.file)
	}
	var b strings.Builder
	gen := o.Generator
	if gen == "" {
		gen = "driver-agent sysext"
	}
	fmt.Fprintf(&b, "# Made by %s: the NVIDIA driver %s for Flatcar %s (%s, kernel %s).\n", gen, o.DriverVersion, o.FlatcarVersion, o.Architecture, o.KernelRelease)
	fmt.Fprintf(&b, "[Unit]\nDescription=NVIDIA driver %s (system extension %s)\n", o.DriverVersion, name)
	b.WriteString("After=systemd-modules-load.service\nBefore=containerd.service docker.service kubelet.service\n\n")
	b.WriteString("[Service]\nType=forking\n")
	fmt.Fprintf(&b, "ExecStartPre=-/bin/sh -c 'modprobe -a %s'\n", strings.Join(host, " "))
	for _, f := range order {
		fmt.Fprintf(&b, "ExecStartPre=/bin/sh -c 'test -d /sys/module/%s || insmod /usr/lib/modules/%s/updates/%s'\n",
			modfile.NameFromPath(f), o.KernelRelease, f)
	}
	b.WriteString("ExecStart=/usr/bin/nvidia-persistenced --persistence-mode\n")
	b.WriteString("PIDFile=/run/nvidia-persistenced/nvidia-persistenced.pid\n\n")
	b.WriteString("[Install]\nWantedBy=multi-user.target\n")
	return []byte(b.String())
}

// LoadCommands returns the shell commands of a unit's ExecStartPre= lines of the form
// `/bin/sh -c '...'`, with whether systemd ignores their failure (a leading "-").
func LoadCommands(unit []byte) (cmds []string, ignoreFailure []bool, err error) {
	for n, line := range strings.Split(string(unit), "\n") {
		v, ok := strings.CutPrefix(strings.TrimSpace(line), "ExecStartPre=")
		if !ok {
			continue
		}
		ignore := strings.HasPrefix(v, "-")
		v = strings.TrimPrefix(v, "-")
		sh, ok := strings.CutPrefix(v, "/bin/sh -c '")
		if !ok || !strings.HasSuffix(sh, "'") || strings.Contains(sh[:len(sh)-1], "'") {
			return nil, nil, fmt.Errorf("unit line %d: %q is not /bin/sh -c '<command>'", n+1, line)
		}
		cmds = append(cmds, sh[:len(sh)-1])
		ignoreFailure = append(ignoreFailure, ignore)
	}
	if len(cmds) == 0 {
		return nil, nil, errors.New("the unit has no ExecStartPre= load commands")
	}
	return cmds, ignoreFailure, nil
}

// userFile is a userspace file to copy (src) or a link to make (link) at rel in the image.
type userFile struct {
	rel, src, link string
	perm           os.FileMode
}

var (
	requiredBins = []string{"nvidia-smi", "nvidia-persistenced"}
	optionalBins = []string{"nvidia-debugdump", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"}
	binDirs      = []string{"usr/bin", "bin", "usr/sbin", "usr/local/bin"}
)

// userspace finds what the driver root shares: the binaries, the driver's libraries with their
// links, and the GSP firmware.
func (o Options) userspace() ([]userFile, error) {
	missing := func(what string) error {
		return fmt.Errorf("sysext: %w: %s (is %s the driver image's root, with the userspace of driver %s?)", ErrInput, what, o.ContainerRoot, o.DriverVersion)
	}
	var out []userFile
	for _, bin := range append(slices.Clone(requiredBins), optionalBins...) {
		found := false
		for _, d := range binDirs {
			src := filepath.Join(o.ContainerRoot, d, bin)
			if st, err := os.Stat(src); err == nil && st.Mode().IsRegular() {
				out = append(out, userFile{rel: "usr/bin/" + bin, src: src, perm: 0o755})
				found = true
				break
			}
		}
		if !found && slices.Contains(requiredBins, bin) {
			return nil, missing(bin + " is in none of " + strings.Join(binDirs, ", "))
		}
	}

	libs, err := o.libraries()
	if err != nil {
		return nil, err
	}
	if !slices.ContainsFunc(libs, func(f userFile) bool { return path.Base(f.rel) == "libnvidia-ml.so."+o.DriverVersion }) {
		return nil, missing("no libnvidia-ml.so." + o.DriverVersion + " (nvidia-smi needs it)")
	}
	out = append(out, libs...)

	fw := ""
	for _, d := range []string{"usr/share/driver-agent/firmware/nvidia", "lib/firmware/nvidia", "usr/lib/firmware/nvidia"} {
		p := filepath.Join(o.ContainerRoot, d, o.DriverVersion)
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			fw = p
			break
		}
	}
	if fw == "" {
		return nil, missing("no GSP firmware directory nvidia/" + o.DriverVersion)
	}
	ents, err := os.ReadDir(fw)
	if err != nil {
		return nil, fmt.Errorf("sysext: %w: %w", ErrInput, err)
	}
	n := 0
	for _, e := range ents {
		if e.Type().IsRegular() {
			out = append(out, userFile{rel: path.Join("usr/lib/firmware/nvidia", o.DriverVersion, e.Name()), src: filepath.Join(fw, e.Name()), perm: 0o644})
			n++
		}
	}
	if n == 0 {
		return nil, missing("the GSP firmware directory " + fw + " is empty")
	}
	return out, nil
}

// libDirs are where a Debian/Ubuntu-based driver image keeps libraries, per architecture.
func (o Options) libDirs() []string {
	triplet := "x86_64-linux-gnu"
	if o.Architecture == "arm64" {
		triplet = "aarch64-linux-gnu"
	}
	return []string{"usr/lib/" + triplet, "lib/" + triplet, "usr/lib64", "usr/lib"}
}

// libraries returns the driver's libraries (regular files named lib*.so.<driver version>) in the
// first lib directory that has them, with the links there that lead to them (libcuda.so.1,
// libcuda.so), all to go into usr/lib64, Flatcar's library directory.
func (o Options) libraries() ([]userFile, error) {
	suffix := ".so." + o.DriverVersion
	for _, d := range o.libDirs() {
		dir := filepath.Join(o.ContainerRoot, d)
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		var out []userFile
		have := map[string]bool{}
		for _, e := range ents {
			if n := e.Name(); e.Type().IsRegular() && strings.HasPrefix(n, "lib") && strings.HasSuffix(n, suffix) {
				out = append(out, userFile{rel: "usr/lib64/" + n, src: filepath.Join(dir, n), perm: 0o755})
				have[n] = true
			}
		}
		if len(out) == 0 {
			continue
		}
		// Links, possibly chained (libcuda.so -> libcuda.so.1 -> libcuda.so.535.261.03), kept
		// when they end at one of the libraries.
		for _, e := range ents {
			if e.Type()&fs.ModeSymlink == 0 {
				continue
			}
			target, ok := endsAt(dir, e.Name(), have)
			if ok {
				t, _ := os.Readlink(filepath.Join(dir, e.Name()))
				if strings.Contains(t, "/") {
					t = target // an absolute or relative-path link becomes a plain name in usr/lib64
				}
				out = append(out, userFile{rel: "usr/lib64/" + e.Name(), link: t})
			}
		}
		return out, nil
	}
	return nil, nil
}

// endsAt follows the link dir/name within dir (up to 8 steps) and reports the library of have
// it ends at.
func endsAt(dir, name string, have map[string]bool) (string, bool) {
	for range 8 {
		t, err := os.Readlink(filepath.Join(dir, name))
		if err != nil {
			return "", have[name]
		}
		name = filepath.Base(t)
		if have[name] {
			return name, true
		}
	}
	return "", false
}

func copyInto(dst, src string, perm os.FileMode) (err error) {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return fmt.Errorf("sysext: %w", err)
	}
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("sysext: %w: %w", ErrInput, err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return fmt.Errorf("sysext: %w", err)
	}
	defer func() {
		if cerr := out.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("sysext: %w", cerr)
		}
	}()
	if _, err := io.Copy(out, in); err != nil {
		return fmt.Errorf("sysext: copy %s: %w", src, err)
	}
	return nil
}

// fixModes makes the staged tree's modes what the image must have whatever the umask:
// directories 0755, executables 0755, other files 0644.
func fixModes(dir string) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return os.Chmod(p, 0o755)
		case d.Type().IsRegular():
			st, err := d.Info()
			if err != nil {
				return err
			}
			mode := os.FileMode(0o644)
			if st.Mode()&0o100 != 0 {
				mode = 0o755
			}
			return os.Chmod(p, mode)
		}
		return nil
	})
}

// squash makes the squashfs image of dir in a temporary file beside the final one: files owned
// by root, timestamps zero and no extended attributes, so the same inputs make the same image.
func (o Options) squash(ctx context.Context, dir, name string) (string, error) {
	if o.Procs == nil {
		return "", errors.New("sysext: no Procs to run mksquashfs with")
	}
	prog := o.Mksquashfs
	if prog == "" {
		prog = "mksquashfs"
	}
	resolved, err := exec.LookPath(prog)
	if err != nil {
		return "", fmt.Errorf("sysext: %w: %s not found (install squashfs-tools): %w", ErrInput, prog, err)
	}
	f, err := os.CreateTemp(o.OutDir, "."+name+".raw.tmp-")
	if err != nil {
		return "", fmt.Errorf("sysext: %w", err)
	}
	tmp := f.Name()
	f.Close()
	logf, err := os.CreateTemp(o.OutDir, "."+name+".mksquashfs.log-")
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("sysext: %w", err)
	}
	defer os.Remove(logf.Name())
	defer logf.Close()
	cmd := host.Cmd{Path: resolved, Args: []string{dir, tmp, "-noappend", "-all-root", "-no-xattrs",
		"-mkfs-time", "0", "-all-time", "0", "-comp", "gzip", "-no-progress", "-quiet"}}
	if err := o.Procs.Run(ctx, cmd, logf); err != nil {
		os.Remove(tmp)
		out, _ := os.ReadFile(logf.Name())
		return "", fmt.Errorf("sysext: mksquashfs: %w: %s", err, strings.TrimSpace(lastLines(string(out), 10)))
	}
	return tmp, nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func digest(p string) (string, int64, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// mergeSums returns the SHA256SUMS file at p with the line for file set to sum, the other lines
// kept, sorted by file name.
func mergeSums(p, file, sum string) ([]byte, error) {
	lines := map[string]string{file: sum}
	old, err := os.ReadFile(p)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("sysext: %w", err)
	}
	for n, line := range strings.Split(string(old), "\n") {
		if line == "" {
			continue
		}
		s, f, ok := strings.Cut(line, "  ")
		if !ok || len(s) != 64 || f == "" {
			return nil, fmt.Errorf("sysext: %s line %d is not `<sha256>  <file>`; move the file away", p, n+1)
		}
		if f != file {
			lines[f] = s
		}
	}
	names := make([]string, 0, len(lines))
	for f := range lines {
		names = append(names, f)
	}
	sort.Strings(names)
	var b bytes.Buffer
	for _, f := range names {
		fmt.Fprintf(&b, "%s  %s\n", lines[f], f)
	}
	return b.Bytes(), nil
}
