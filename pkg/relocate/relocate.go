// Package relocate makes the ELF build helpers of a kernel build tree from another distribution
// run in this container.
//
// Flatcar's kernel build tree (/usr/lib/modules/<release>/build) carries the helpers kbuild runs
// during a module build (scripts/basic/fixdep, scripts/mod/modpost, tools/objtool/objtool and a
// few more), linked against Flatcar's glibc. In the driver container those binaries do not start:
// their program interpreter (/lib64/ld-linux-x86-64.so.2) is the container's, or missing, and
// their libraries may be too old or absent. Tree points each such binary at Flatcar's own loader
// and libraries, extracted next to the tree (<sysroot>/usr/lib64), with
//
//	patchelf --set-interpreter <sysroot>/usr/lib64/<loader> --force-rpath --set-rpath <sysroot>/usr/lib64 <binary>
//
// (DT_RPATH rather than DT_RUNPATH, so that it also applies to the libraries' own dependencies,
// such as libelf's libz), and then checks that every helper really starts before a build relies
// on it. Static binaries and helpers that already run are left alone.
package relocate

import (
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// Sentinel errors; test with errors.Is.
var (
	// ErrNotRunnable means a build helper does not start, even after relocation.
	ErrNotRunnable = errors.New("build helper cannot run")
	// ErrNoLoader means the sysroot lacks the dynamic loader a helper asks for.
	ErrNoLoader = errors.New("dynamic loader not found")
)

// CheckTimeout bounds one start check; a helper still running then has started, which is all
// the check wants to know.
const CheckTimeout = 10 * time.Second

// maxOutput is how much of a helper's output a check reads.
const maxOutput = 16 << 10

// Options configures Tree.
type Options struct {
	// Sysroot is the directory holding the other distribution's loader and libraries, as
	// extracted from it: <Sysroot>/usr/lib64 (and <Sysroot>/lib64, <Sysroot>/usr/lib,
	// <Sysroot>/lib where present). Required.
	Sysroot string
	// LibDirs are the directories set as the helpers' rpath; nil means those of <Sysroot>/usr/lib64,
	// <Sysroot>/lib64, <Sysroot>/usr/lib and <Sysroot>/lib that exist.
	LibDirs []string
	// Patchelf is the patchelf program, a name looked up in PATH or a path; "" means "patchelf".
	Patchelf string
	// Procs runs patchelf and the helpers' start checks. Required.
	Procs host.Procs
	// Log receives what was relocated or skipped; nil discards it.
	Log *slog.Logger
}

// Result says what Tree did, with paths relative to the tree.
type Result struct {
	// Relocated are the helpers that got the sysroot's loader and libraries.
	Relocated []string
	// Runnable are dynamically linked helpers that already started as they were.
	Runnable []string
	// Static are statically linked helpers, which need nothing.
	Static []string
}

// Tree relocates every dynamically linked ELF executable under tree (regular files with an
// execute bit; symbolic links are not followed) that does not start as it is, and checks that
// each one starts afterwards. A helper that still cannot start (a missing library, a library too
// old for it) is an error wrapping ErrNotRunnable that names the helper and quotes the loader's
// message; every such helper is reported. The binaries are modified in place, so tree must be a
// writable copy.
func Tree(ctx context.Context, tree string, o Options) (Result, error) {
	r := &relocator{o: o, log: o.Log, runner: o.Procs}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	if r.runner == nil {
		return Result{}, errors.New("relocate: no Procs to run patchelf with")
	}
	if o.Sysroot == "" {
		return Result{}, errors.New("relocate: no sysroot given")
	}
	if st, err := os.Stat(o.Sysroot); err != nil || !st.IsDir() {
		return Result{}, fmt.Errorf("relocate: sysroot %s is not a directory (%v)", o.Sysroot, err)
	}
	r.libDirs = o.LibDirs
	if r.libDirs == nil {
		for _, d := range []string{"usr/lib64", "lib64", "usr/lib", "lib"} {
			p := filepath.Join(o.Sysroot, d)
			if st, err := os.Lstat(p); err == nil && st.IsDir() {
				r.libDirs = append(r.libDirs, p)
			}
		}
	}
	if len(r.libDirs) == 0 {
		return Result{}, fmt.Errorf("relocate: %w: %s has no usr/lib64, lib64, usr/lib or lib", ErrNoLoader, o.Sysroot)
	}

	helpers, err := findHelpers(tree)
	if err != nil {
		return Result{}, fmt.Errorf("relocate: %w", err)
	}
	r.scratch, err = os.MkdirTemp("", "relocate-check-")
	if err != nil {
		return Result{}, fmt.Errorf("relocate: %w", err)
	}
	defer os.RemoveAll(r.scratch)

	var res Result
	var errs []error
	for _, h := range helpers {
		rel, _ := filepath.Rel(tree, h.path)
		if h.interp == "" {
			res.Static = append(res.Static, rel)
			continue
		}
		ok, why, err := r.starts(ctx, h.path)
		if err != nil {
			return res, fmt.Errorf("relocate: %w", err)
		}
		if ok {
			res.Runnable = append(res.Runnable, rel)
			r.log.Debug("build helper runs as it is", "helper", rel)
			continue
		}
		if err := r.relocate(ctx, h); err != nil {
			if ctxErr := ctx.Err(); ctxErr != nil {
				return res, fmt.Errorf("relocate: %w", ctxErr)
			}
			errs = append(errs, fmt.Errorf("%s: %w (before: %s)", rel, err, why))
			continue
		}
		ok, why, err = r.starts(ctx, h.path)
		if err != nil {
			return res, fmt.Errorf("relocate: %w", err)
		}
		if !ok {
			errs = append(errs, fmt.Errorf("%w: %s does not start after relocation: %s", ErrNotRunnable, rel, why))
			continue
		}
		res.Relocated = append(res.Relocated, rel)
	}
	if len(res.Relocated) > 0 {
		r.log.Info("relocated the kernel build tree's helpers to the extracted loader and libraries",
			"helpers", strings.Join(res.Relocated, " "), "loader_dirs", strings.Join(r.libDirs, ":"))
	}
	if len(errs) > 0 {
		return res, fmt.Errorf("relocate the build helpers of %s: %w", tree, errors.Join(errs...))
	}
	return res, nil
}

type relocator struct {
	o       Options
	log     *slog.Logger
	runner  host.Procs
	libDirs []string
	scratch string // an empty directory the checks run in
}

// helper is an ELF executable found in the tree.
type helper struct {
	path   string
	interp string // its PT_INTERP; "" for a static binary
}

// findHelpers lists the ELF executables under tree.
func findHelpers(tree string) ([]helper, error) {
	var out []helper
	err := filepath.WalkDir(tree, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if info.Mode().Perm()&0o111 == 0 {
			return nil
		}
		interp, exe, err := inspect(path)
		if err != nil {
			return err
		}
		if exe {
			out = append(out, helper{path: path, interp: interp})
		}
		return nil
	})
	return out, err
}

// inspect reports whether path is an ELF executable and its program interpreter; see
// inspectELF.
func inspect(path string) (interp string, exe bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", false, err
	}
	defer f.Close()
	interp, exe, err = inspectELF(f)
	if err != nil {
		return "", false, fmt.Errorf("%s: %w", path, err)
	}
	return interp, exe, nil
}

// inspectELF reports whether r holds an ELF executable (a position-dependent or
// position-independent program, not a shared library or an object file) and its program
// interpreter ("" when static). Data that is not ELF is not an executable.
func inspectELF(r io.ReaderAt) (interp string, exe bool, err error) {
	var magic [4]byte
	if _, err := r.ReadAt(magic[:], 0); err != nil || string(magic[:]) != elf.ELFMAG {
		return "", false, nil
	}
	ef, err := elf.NewFile(r)
	if err != nil {
		return "", false, err
	}
	if ef.Type != elf.ET_EXEC && ef.Type != elf.ET_DYN {
		return "", false, nil
	}
	for _, p := range ef.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		if p.Filesz == 0 || p.Filesz > 4096 {
			return "", false, fmt.Errorf("program interpreter of %d bytes", p.Filesz)
		}
		b := make([]byte, p.Filesz)
		if _, err := p.ReadAt(b, 0); err != nil {
			return "", false, fmt.Errorf("program interpreter: %w", err)
		}
		interp = strings.TrimRight(string(b), "\x00")
		if interp == "" {
			return "", false, errors.New("empty program interpreter")
		}
		return interp, true, nil
	}
	// No interpreter: a static program, unless it is a shared library (it has a soname).
	if ef.Type == elf.ET_DYN {
		if soname, err := ef.DynString(elf.DT_SONAME); err == nil && len(soname) > 0 {
			return "", false, nil
		}
	}
	return "", true, nil
}

// relocate sets the helper's interpreter and rpath to the sysroot's.
func (r *relocator) relocate(ctx context.Context, h helper) error {
	loader, err := r.findLoader(filepath.Base(h.interp))
	if err != nil {
		return err
	}
	patchelf := r.o.Patchelf
	if patchelf == "" {
		patchelf = "patchelf"
	}
	path, err := exec.LookPath(patchelf)
	if err != nil {
		return fmt.Errorf("%w; install patchelf in the image (apt-get install -y patchelf)", err)
	}
	out, err := os.CreateTemp(r.scratch, "patchelf-")
	if err != nil {
		return err
	}
	defer out.Close()
	args := []string{"--set-interpreter", loader, "--force-rpath", "--set-rpath", strings.Join(r.libDirs, ":"), h.path}
	if err := r.runner.Run(ctx, host.Cmd{Path: path, Args: args, Env: []string{"LC_ALL=C"}}, out); err != nil {
		msg, _ := readLimited(out.Name(), maxOutput)
		return fmt.Errorf("patchelf %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(msg))
	}
	r.log.Debug("relocated a build helper", "helper", h.path, "interpreter", loader, "was", h.interp)
	return nil
}

// findLoader returns the sysroot's dynamic loader called name, with symbolic links resolved
// inside the sysroot.
func (r *relocator) findLoader(name string) (string, error) {
	for _, d := range r.libDirs {
		p, err := resolveIn(r.o.Sysroot, filepath.Join(d, name))
		if err != nil {
			continue
		}
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: no %s in %s", ErrNoLoader, name, strings.Join(r.libDirs, ", "))
}

// resolveIn resolves the symbolic links of path, which lies inside root, the way they resolve
// on the system root is taken from: absolute targets are taken relative to root. The result
// stays inside root.
func resolveIn(root, path string) (string, error) {
	for range 40 {
		st, err := os.Lstat(path)
		if err != nil {
			return "", err
		}
		if st.Mode()&fs.ModeSymlink == 0 {
			return path, nil
		}
		target, err := os.Readlink(path)
		if err != nil {
			return "", err
		}
		if filepath.IsAbs(target) {
			path = filepath.Join(root, target)
		} else {
			path = filepath.Join(filepath.Dir(path), target)
		}
		if rel, err := filepath.Rel(root, path); err != nil || !filepath.IsLocal(rel) {
			return "", fmt.Errorf("%s leads out of %s", target, root)
		}
	}
	return "", fmt.Errorf("%s: %w", path, syscall.ELOOP)
}

// loaderMessages are what the dynamic loader prints when it cannot run a program.
var loaderMessages = []string{
	"error while loading shared libraries",
	"cannot open shared object file",
	"not found (required by",
	"symbol lookup error",
	"Inconsistency detected by ld.so",
	"cannot execute binary file",
}

// starts runs the helper without arguments in an empty directory and reports whether it
// started: a clean exit and a usage error both count; a failed exec (ENOENT for a missing
// interpreter, ENOEXEC, EACCES), a loader error or a crash does not, and why says what happened.
// err is set only when ctx ends.
func (r *relocator) starts(ctx context.Context, path string) (ok bool, why string, err error) {
	out, err := os.CreateTemp(r.scratch, "check-")
	if err != nil {
		return false, "", err
	}
	defer os.Remove(out.Name())
	defer out.Close()
	cctx, cancel := context.WithTimeout(ctx, CheckTimeout)
	defer cancel()
	runErr := r.runner.Run(cctx, host.Cmd{Path: path, Env: []string{"LC_ALL=C", "PATH=/usr/bin:/bin"}, Dir: r.scratch}, out)
	if ctxErr := ctx.Err(); ctxErr != nil {
		return false, "", ctxErr
	}
	if runErr == nil || errors.Is(cctx.Err(), context.DeadlineExceeded) {
		return true, "", nil
	}
	text, _ := readLimited(out.Name(), maxOutput)
	text = strings.TrimSpace(text)
	for _, errno := range []syscall.Errno{syscall.ENOENT, syscall.ENOEXEC, syscall.EACCES, syscall.ELIBBAD} {
		if errors.Is(runErr, errno) {
			return false, fmt.Sprintf("exec: %v", runErr), nil
		}
	}
	if i := slices.IndexFunc(loaderMessages, func(m string) bool { return strings.Contains(text, m) }); i >= 0 {
		return false, fmt.Sprintf("%v: %s", runErr, lineWith(text, loaderMessages[i])), nil
	}
	if signaled(runErr) {
		return false, fmt.Sprintf("%v: %s", runErr, text), nil
	}
	return true, "", nil // a usage error: it ran
}

// signaled reports whether a runner's error is a process killed by a signal.
func signaled(err error) bool {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok {
			return ws.Signaled()
		}
	}
	var de *daemon.ExitError
	return errors.As(err, &de) && de.Status.Signaled()
}

// lineWith returns the line of text containing s.
func lineWith(text, s string) string {
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, s) {
			return strings.TrimSpace(l)
		}
	}
	return text
}

// readLimited reads at most limit bytes of the file at path.
func readLimited(path string, limit int64) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit))
	return string(b), err
}
