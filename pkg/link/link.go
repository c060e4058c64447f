// Package link links NVIDIA kernel interfaces with their core objects into
// loadable modules.
//
// A precompiled package (see package precompiled) carries, for nvidia.ko and
// nvidia-modeset.ko, only the small kernel interface object that was compiled
// against one kernel; the large core object (nvidia/nv-kernel.o_binary,
// nvidia-modeset/nv-modeset-kernel.o_binary) ships in the driver's kernel
// source directory. Link unpacks a package, runs `ld -d -r` for each
// interface, re-attaches the detached module signature stored with it when the
// linked module is byte-identical to the one that was signed, and returns
// the ready modules together with the complete modules the package carries.
package link

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/modfile"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
)

// ModuleCommonObject is the object that kbuild links into every external
// module on kernels 6.12 and newer, next to the module's own objects.
const ModuleCommonObject = ".module-common.o"

// signatureMarker ends every module signed with sign-file.
const signatureMarker = "~Module signature appended~\n"

// Sentinel errors; test with errors.Is.
var (
	// ErrUnsigned means Options.RequireSigned is set and a module would be
	// unsigned: its package stores no signature for it, or the stored
	// signature belongs to a different linked module.
	ErrUnsigned = errors.New("module would be unsigned")
	// ErrLink means the linker failed or its output is unusable.
	ErrLink = errors.New("link failed")
)

// Options configures Link.
type Options struct {
	// CoreObjectDir is the driver's kernel source directory for the flavour
	// in use, <root>/usr/src/nvidia-<version>/<kernel|kernel-open>. Each
	// interface's core object is CoreObjectDir/<core object name>. Required
	// when the package has kernel interfaces.
	CoreObjectDir string
	// LD is the linker to run; "ld" (looked up in PATH) when empty.
	LD string
	// KernelRelease is the release of the kernel the modules are for. It
	// decides whether .module-common.o is merged (6.12 and newer). When
	// empty, the release in the package's proc version is used.
	KernelRelease string
	// RequireSigned makes a module without a valid signature an error
	// (ErrUnsigned) instead of a warning.
	RequireSigned bool
	// Log receives progress and warnings; nil discards them.
	Log *slog.Logger
	// Procs runs the linker (Host.Procs: the agent's reaper, which must be the only code in the
	// process that waits for children). Required.
	Procs host.Procs
	// MaxLinks bounds how many linkers run at once; zero means host.CPUs(), the CPUs
	// the process may use (each ld is one process on one CPU: on one CPU two at once only take
	// turns, and both finish later than one after the other).
	MaxLinks int
}

// Module is a kernel module ready to load.
type Module struct {
	// Name is the kernel's name for the module (dashes become
	// underscores), e.g. "nvidia_modeset".
	Name string
	// Path is the module file.
	Path string
	// Signed reports whether the module carries a signature: a detached
	// signature re-attached by Link, or an embedded one.
	Signed bool
}

// Link makes loadable modules from p in workDir.
//
// workDir must not exist or be an empty directory; Link creates it (or
// restricts it) with mode 0700 and unpacks every member into it with
// precompiled.Unpack, which refuses member paths that would escape it. For
// each kernel-interface member it runs
//
//	<LD> -d -r -o <workDir>/<linked module name> <interface> <CoreObjectDir>/<core object name> [.module-common.o]
//
// in its own process group, killed when ctx is cancelled; the links run at the same time (up
// to Options.MaxLinks), and the first failure (in package order) cancels the others. .module-common.o is
// merged for kernels 6.12 and newer: the package's member of that name if it
// carries one, else CoreObjectDir/.module-common.o if that exists.
//
// A stored detached signature is appended to the linked module only when the
// CRC (precompiled.Checksum) of the linked module equals the stored linked
// module CRC, that is, when this linker produced exactly the module that was
// signed. Otherwise the module stays unsigned with a warning, or Link fails
// with ErrUnsigned when opts.RequireSigned is set. With RequireSigned every
// module must end up signed: an interface without a stored signature, or a
// kernel-module member that is neither marked --signed nor ends with the
// kernel's module-signature marker, is an error too.
//
// Kernel-module members (complete modules such as nvidia-uvm.ko) are used as
// unpacked. The result lists the modules in package order; the
// .module-common.o member is not a module and is not listed.
func Link(ctx context.Context, p *precompiled.Package, workDir string, opts Options) ([]Module, error) {
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if p == nil {
		return nil, fmt.Errorf("link: %w: no package", precompiled.ErrInvalid)
	}
	if err := prepareWorkDir(workDir); err != nil {
		return nil, err
	}
	paths, err := precompiled.Unpack(p, workDir)
	if err != nil {
		return nil, fmt.Errorf("link: %w", err)
	}
	outputs, err := planOutputs(p, workDir, paths)
	if err != nil {
		return nil, err
	}
	release := opts.KernelRelease
	if release == "" {
		if b, ok := precompiled.ParseBanner(p.ProcVersion); ok {
			release = b.Release
		}
	}
	common, err := moduleCommon(p, paths, opts.CoreObjectDir, release, log)
	if err != nil {
		return nil, err
	}
	if opts.Procs == nil {
		return nil, errors.New("link: no Procs to run the linker with")
	}
	ld := opts.LD
	if ld == "" {
		ld = "ld"
	}

	// Names and complete modules first: an invalid package, or an unsigned module when signatures
	// are required, is found before any ld runs; the complete modules need no link.
	mods := make([]Module, len(p.Files))
	seen := map[string]string{}
	for i := range p.Files {
		f := &p.Files[i]
		if f.Name == ModuleCommonObject {
			continue
		}
		name := modfile.NameFromPath(f.LinkedModuleName)
		if f.Type == precompiled.KernelModule {
			name = modfile.NameFromPath(f.Name)
			mods[i] = Module{Name: name, Path: paths[i], Signed: signedModule(f)}
		}
		if prev, ok := seen[name]; ok {
			return nil, fmt.Errorf("link: %w: members %q and %q both give module %s", precompiled.ErrInvalid, prev, f.Name, name)
		}
		seen[name] = f.Name
		if f.Type == precompiled.KernelModule && opts.RequireSigned && !mods[i].Signed {
			return nil, fmt.Errorf("link: %s: %w: the package's module carries no signature", f.Name, ErrUnsigned)
		}
	}
	// The interfaces are linked at the same time, up to MaxLinks at once; the first failure in
	// package order is returned, and it cancels the links still running or waiting.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	slots := opts.MaxLinks
	if slots <= 0 {
		slots = host.CPUs()
	}
	free := make(chan struct{}, slots)
	errs := make([]error, len(p.Files))
	var wg sync.WaitGroup
	for i := range p.Files {
		f := &p.Files[i]
		if f.Name == ModuleCommonObject || f.Type == precompiled.KernelModule {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case free <- struct{}{}:
				defer func() { <-free }()
			case <-ctx.Done():
				errs[i] = fmt.Errorf("link %s: %w", f.LinkedModuleName, ctx.Err())
				return
			}
			if mods[i], errs[i] = linkInterface(ctx, f, paths[i], outputs[i], ld, common, opts, log); errs[i] != nil {
				cancel()
			}
		}()
	}
	wg.Wait()
	if err := firstErr(errs); err != nil {
		return nil, err
	}
	var out []Module
	for i := range p.Files {
		if p.Files[i].Name != ModuleCommonObject {
			out = append(out, mods[i])
		}
	}
	return out, nil
}

// signedModule reports whether a complete-module member carries a signature.
func signedModule(f *precompiled.File) bool {
	return f.Attributes&precompiled.AttrEmbeddedSignature != 0 || bytes.HasSuffix(f.Data, []byte(signatureMarker))
}

// firstErr returns the first non-nil error in package order that is not a link cancelled
// because another one failed, or the first non-nil one when all are.
func firstErr(errs []error) error {
	var first error
	for _, err := range errs {
		if err == nil {
			continue
		}
		if first == nil {
			first = err
		}
		if !errors.Is(err, context.Canceled) {
			return err
		}
	}
	return first
}

// prepareWorkDir creates workDir with mode 0700, or checks that an existing
// one is an empty directory (not a symbolic link) and sets its mode to 0700.
func prepareWorkDir(dir string) error {
	switch err := os.Mkdir(dir, 0o700); {
	case err == nil:
		return nil
	case !errors.Is(err, fs.ErrExist):
		return fmt.Errorf("link: work dir: %w", err)
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("link: work dir: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("link: work dir %s is not a directory", dir)
	}
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("link: work dir: %w", err)
	}
	names, err := f.Readdirnames(1)
	f.Close()
	if len(names) > 0 {
		return fmt.Errorf("link: work dir %s is not empty", dir)
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("link: work dir: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("link: work dir: %w", err)
	}
	return nil
}

// planOutputs returns, for each interface member, the path of the module it
// links into, checking that every output stays inside workDir and overwrites
// neither an unpacked member nor another output.
func planOutputs(p *precompiled.Package, workDir string, unpacked []string) (map[int]string, error) {
	taken := map[string]string{}
	for i, path := range unpacked {
		taken[path] = "member " + strconv.Quote(p.Files[i].Name)
	}
	outputs := map[int]string{}
	for i := range p.Files {
		f := &p.Files[i]
		if f.Type != precompiled.KernelInterface || f.Name == ModuleCommonObject {
			continue
		}
		if f.LinkedModuleName == "" || f.CoreObjectName == "" {
			return nil, fmt.Errorf("link: %w: kernel interface %q has no linked module name or core object name",
				precompiled.ErrInvalid, f.Name)
		}
		if !filepath.IsLocal(f.LinkedModuleName) || !filepath.IsLocal(f.CoreObjectName) {
			return nil, fmt.Errorf("link: %w: kernel interface %q: %w: linked module %q, core object %q",
				precompiled.ErrInvalid, f.Name, precompiled.ErrUnsafePath, f.LinkedModuleName, f.CoreObjectName)
		}
		out := filepath.Join(workDir, f.LinkedModuleName)
		if by, ok := taken[out]; ok {
			return nil, fmt.Errorf("link: %w: module %s linked from %q would overwrite %s",
				precompiled.ErrInvalid, f.LinkedModuleName, f.Name, by)
		}
		taken[out] = "the module linked from " + strconv.Quote(f.Name)
		outputs[i] = out
	}
	return outputs, nil
}

// moduleCommon returns the .module-common.o to merge, or "" when the kernel
// is older than 6.12 or there is none.
func moduleCommon(p *precompiled.Package, unpacked []string, coreDir, release string, log *slog.Logger) (string, error) {
	newer, ok := releaseAtLeast(release, 6, 12)
	if !ok {
		log.Debug("kernel release unknown; not merging "+ModuleCommonObject, "release", release)
		return "", nil
	}
	if !newer {
		return "", nil
	}
	for i := range p.Files {
		if p.Files[i].Name == ModuleCommonObject {
			return unpacked[i], nil
		}
	}
	if coreDir != "" {
		path := filepath.Join(coreDir, ModuleCommonObject)
		st, err := os.Stat(path)
		switch {
		case err == nil && st.Mode().IsRegular():
			return path, nil
		case err != nil && !errors.Is(err, fs.ErrNotExist):
			return "", fmt.Errorf("link: %w", err)
		}
	}
	log.Debug("no "+ModuleCommonObject+" in the package or the core object directory; linking without it",
		"release", release)
	return "", nil
}

// releaseAtLeast reports whether the kernel release (e.g. "6.12.81-flatcar")
// is major.minor or newer; ok is false when release does not start with
// <major>.<minor>.
func releaseAtLeast(release string, major, minor int) (newer, ok bool) {
	majS, rest, found := strings.Cut(release, ".")
	if !found {
		return false, false
	}
	end := 0
	for end < len(rest) && rest[end] >= '0' && rest[end] <= '9' {
		end++
	}
	maj, err1 := strconv.Atoi(majS)
	mnr, err2 := strconv.Atoi(rest[:end])
	if err1 != nil || err2 != nil {
		return false, false
	}
	return maj > major || maj == major && mnr >= minor, true
}

// linkInterface links one kernel interface and attaches its signature.
func linkInterface(ctx context.Context, f *precompiled.File, iface, out, ld, common string, opts Options, log *slog.Logger) (Module, error) {
	if opts.CoreObjectDir == "" {
		return Module{}, fmt.Errorf("link %s: %w: no core object directory given", f.LinkedModuleName, precompiled.ErrInvalid)
	}
	core := filepath.Join(opts.CoreObjectDir, f.CoreObjectName)
	if st, err := os.Stat(core); err != nil {
		return Module{}, fmt.Errorf("link %s: core object: %w", f.LinkedModuleName, err)
	} else if !st.Mode().IsRegular() {
		return Module{}, fmt.Errorf("link %s: core object %s is not a regular file", f.LinkedModuleName, core)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return Module{}, fmt.Errorf("link %s: %w", f.LinkedModuleName, err)
	}
	args := []string{"-d", "-r", "-o", out, iface, core}
	if common != "" {
		args = append(args, common)
	}
	log.Info("linking kernel module", "module", f.LinkedModuleName, "interface", f.Name, "core_object", core,
		"module_common", common)
	path, err := exec.LookPath(ld) // Procs executes a path, not a name to search for
	if err != nil {
		return Module{}, fmt.Errorf("link %s: %w: %w", f.LinkedModuleName, ErrLink, err)
	}
	if _, err := opts.Procs.Output(ctx, host.Cmd{Path: path, Args: args}); err != nil {
		return Module{}, fmt.Errorf("link %s: %w: %s %s: %w", f.LinkedModuleName, ErrLink, ld, strings.Join(args, " "), err)
	}
	if st, err := os.Stat(out); err != nil {
		return Module{}, fmt.Errorf("link %s: %w", f.LinkedModuleName, err)
	} else if st.Size() == 0 {
		return Module{}, fmt.Errorf("link %s: %w: %s wrote an empty file", f.LinkedModuleName, ErrLink, ld)
	}
	m := Module{Name: modfile.NameFromPath(f.LinkedModuleName), Path: out}

	hasSig := f.Attributes&precompiled.AttrDetachedSignature != 0 && len(f.Signature) > 0
	hasCRC := f.Attributes&precompiled.AttrLinkedModuleCRC != 0
	var crc uint32
	if hasSig && hasCRC { // only a stored signature needs the linked module's CRC
		linked, err := os.ReadFile(out)
		if err != nil {
			return Module{}, fmt.Errorf("link %s: %w", f.LinkedModuleName, err)
		}
		crc = precompiled.Checksum(linked)
	}
	switch {
	case hasSig && hasCRC && crc == f.LinkedModuleCRC:
		if err := appendFile(out, f.Signature); err != nil {
			return Module{}, fmt.Errorf("link %s: attach signature: %w", f.LinkedModuleName, err)
		}
		m.Signed = true
		log.Info("attached the stored module signature", "module", f.LinkedModuleName, "crc", fmt.Sprintf("%08x", crc),
			"signature_bytes", len(f.Signature))
	case hasSig:
		why := fmt.Sprintf("the linked module's crc %08x differs from the signed module's %08x", crc, f.LinkedModuleCRC)
		if !hasCRC {
			why = "the package stores no crc of the signed module"
		}
		if opts.RequireSigned {
			return Module{}, fmt.Errorf("link %s: %w: %s", f.LinkedModuleName, ErrUnsigned, why)
		}
		log.Warn("not attaching the stored module signature: "+why+"; the module stays unsigned",
			"module", f.LinkedModuleName)
	case opts.RequireSigned:
		return Module{}, fmt.Errorf("link %s: %w: the package stores no signature for it", f.LinkedModuleName, ErrUnsigned)
	}
	return m, nil
}

// appendFile appends data to the file at path.
func appendFile(path string, data []byte) (err error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, f.Close()) }()
	_, err = f.Write(data)
	return err
}
