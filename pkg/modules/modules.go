// Package modules loads and unloads kernel modules through host.Kernel: in order, rolling back
// what it loaded when a load fails, and unloading in the order the kernel's holder graph allows,
// retrying while the kernel says busy, and naming the processes that keep the driver in use.
package modules

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
)

// Loader loads kernel modules and explains the kernel's refusals.
type Loader struct {
	Host    host.Host
	Log     *slog.Logger
	Release string // the running kernel release, for vermagic messages
}

// Load loads files in order and returns the names it loaded (or adopted: a module that is
// already loaded with the same version). When one fails, every module loaded by this call is
// unloaded again in reverse order, and the error says what the kernel objected to, with the
// kernel log lines written since the load started.
func (l Loader) Load(ctx context.Context, files []File) ([]string, error) {
	var loaded []string
	kmsg := OpenKmsg(l.Host.InDev("kmsg"))
	defer kmsg.Close()
	for _, f := range files {
		m := f.Image
		if err := ctx.Err(); err != nil {
			return nil, errors.Join(err, l.rollback(loaded))
		}
		attrs := []any{"module", m.Name, "path", m.Path, "params", m.Params}
		if m.Compressed {
			attrs = append(attrs, "decompressed_by", "kernel")
		}
		l.Log.Info("loading kernel module", attrs...)
		err := l.Host.Kernel.LoadModule(m)
		if errors.Is(err, unix.EEXIST) {
			info := f.fullInfo()
			sm, rerr := kernel.ReadSysModule(l.Host.Sys, m.Name)
			if rerr == nil && sm.Version == info.Version {
				l.Log.Info("kernel module is already loaded with the same version; adopting it", "module", m.Name, "version", sm.Version)
				loaded = append(loaded, m.Name)
				continue
			}
			err = fmt.Errorf("%w (loaded version %q, this one %q)", err, sm.Version, info.Version)
		}
		if err != nil {
			lerr := l.explain(f, err, kmsg.Lines())
			return nil, errors.Join(lerr, l.rollback(loaded))
		}
		loaded = append(loaded, m.Name)
	}
	return loaded, nil
}

func (l Loader) rollback(loaded []string) error {
	var errs []error
	for i := len(loaded) - 1; i >= 0; i-- {
		l.Log.Info("rolling back kernel module", "module", loaded[i])
		if err := l.Host.Kernel.UnloadModule(loaded[i]); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("roll back %s: %w", loaded[i], err))
		}
	}
	return errors.Join(errs...)
}

// explain turns a load error into what an operator needs to know.
func (l Loader) explain(f File, err error, kmsg []string) error {
	m := f.Image
	var what string
	class := exitcode.ErrModuleLoad
	switch {
	case errors.Is(err, unix.ENODEV):
		class, what = exitcode.ErrNoGPU, "the kernel found no NVIDIA GPU this driver supports"
	case errors.Is(err, unix.ENOEXEC):
		what = fmt.Sprintf("invalid module format: the module was built for %q, the running kernel is %s", f.fullInfo().Vermagic, l.Release)
	case errors.Is(err, unix.ENOENT):
		what = "unknown symbol"
		if syms := unknownSymbols(kmsg); len(syms) > 0 {
			what += "s " + strings.Join(syms, ", ")
		}
		if missing := l.missingDepends(f); len(missing) > 0 {
			what += fmt.Sprintf("; it depends on %s, which %s not loaded", strings.Join(missing, ", "), plural(len(missing), "is", "are"))
		}
	case errors.Is(err, unix.EKEYREJECTED), errors.Is(err, unix.EPERM), errors.Is(err, unix.EKEYEXPIRED), errors.Is(err, unix.ENOKEY):
		what = "the kernel refused the module's signature (Secure Boot or lockdown): "
		if signed(m) {
			what += "it is signed, but not with a key the kernel trusts; enroll that key (MOK or the platform keyring)"
		} else {
			what += "it is unsigned; sign it with a key the kernel trusts, or use modules the host provides signed (Flatcar's NVIDIA sysext)"
		}
	case errors.Is(err, unix.EEXIST):
		what = "another version of the module is already loaded; unload it first"
	default:
		what = "the kernel refused it"
	}
	msg := fmt.Sprintf("load %s: %s: %v", m.Name, what, err)
	if len(kmsg) > 0 {
		msg += "; kernel log: " + strings.Join(kmsg, " | ")
	}
	return fmt.Errorf("%w: %s", class, msg)
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func (l Loader) missingDepends(f File) []string {
	var missing []string
	for _, d := range f.fullInfo().Depends {
		if sm, err := kernel.ReadSysModule(l.Host.Sys, d); err == nil && !sm.Present {
			missing = append(missing, kernel.Normalize(d))
		}
	}
	return missing
}

// unknownSymbols picks the symbol names out of "Unknown symbol X (err -2)" kernel lines.
func unknownSymbols(lines []string) []string {
	var syms []string
	for _, line := range lines {
		_, rest, ok := strings.Cut(line, "Unknown symbol ")
		if !ok {
			continue
		}
		if f := strings.Fields(rest); len(f) > 0 && !slices.Contains(syms, f[0]) {
			syms = append(syms, f[0])
		}
	}
	return syms
}

// signed reports whether the module carries an appended signature.
func signed(m host.ModuleImage) bool {
	const magic = "~Module signature appended~\n"
	tail := m.Data
	if tail == nil {
		f, err := os.Open(m.Path)
		if err != nil {
			return false
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil || st.Size() < int64(len(magic)) {
			return false
		}
		tail = make([]byte, len(magic))
		if _, err := f.ReadAt(tail, st.Size()-int64(len(magic))); err != nil {
			return false
		}
	}
	return strings.HasSuffix(string(tail), magic)
}

// Unload is Unloader{Host: h, Log: log, UnloadForeign: true}.Unload: every holder of names is
// unloaded too, and the retries last until ctx ends.
func Unload(ctx context.Context, h host.Host, log *slog.Logger, names []string) error {
	return Unloader{Host: h, Log: log, UnloadForeign: true}.Unload(ctx, names)
}

// Unloader removes a set of modules and the loaded modules that hold them, in holder order.
type Unloader struct {
	Host host.Host
	Log  *slog.Logger
	// Timeout bounds the wait for the modules to become free; zero means until ctx ends.
	Timeout time.Duration
	// Clock times the retries and Timeout; nil means the wall clock.
	Clock daemon.Clock
	// UnloadForeign also removes holders outside the named set (gdrdrv, nvidia_fs, an
	// nvidia_peermem loaded by a sidecar). Without it such a holder counts as a user of the
	// driver: nothing is removed while it is loaded.
	UnloadForeign bool
	// DryRun looks once, without waiting: when the set is in use (as Unload would find it) it
	// says so and by whom, else it hands the order to Host.Kernel (a recorder), followed by
	// Pretended.
	DryRun bool
	// Pretended are, in a dry run, the modules the dry run only pretended to load: not in
	// /sys/module, they are planned after the loaded ones, in reverse order.
	Pretended []string
}

// Unload removes names and their holders. Nothing is removed while the set is in use from
// outside (a process with /dev/nvidia* open, a holder module outside the set unless
// UnloadForeign, or a reference no holder explains): it retries with backoff, logging each retry
// with what holds the driver, until Timeout or ctx's deadline (less a little for the teardown
// steps after this one), then logs NVIDIA's "Could not unload NVIDIA driver kernel modules,
// driver is in use" and returns an error wrapping exitcode.ErrInUse that names the holders,
// leaving every module loaded, as NVIDIA's script does. EBUSY and EAGAIN from the kernel are
// retried the same way. When ctx is cancelled it returns ctx's error.
func (u Unloader) Unload(ctx context.Context, names []string) error {
	if u.DryRun {
		return u.dryRun(names)
	}
	// Keep a little of the deadline for the teardown steps after this one.
	if deadline, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, deadline.Add(-min(2*time.Second, time.Until(deadline)/5)))
		defer cancel()
	}
	clock := u.Clock
	if clock == nil {
		clock = daemon.WallClock{}
	}
	start := clock.Now()
	backoff := 100 * time.Millisecond
	var prev []string
	for attempt := 1; ; attempt++ {
		order, foreign, err := u.order(names)
		if err != nil {
			return err
		}
		if len(order) == 0 {
			return nil
		}
		if slices.Equal(order, prev) {
			return fmt.Errorf("unload: %s still loaded although the kernel accepted their removal", strings.Join(order, ", "))
		}
		busy, fixed, err := inspect(u.Host.Sys, order, foreign)
		if err != nil {
			return err
		}
		if len(fixed) > 0 {
			return u.cannot(noUnload(u.Host.Sys, fixed))
		}
		if len(busy) == 0 {
			for _, name := range order {
				err := u.Host.Kernel.UnloadModule(name)
				switch {
				case err == nil:
					u.Log.Info("unloaded kernel module", "module", name)
				case errors.Is(err, unix.ENOENT):
				case errors.Is(err, unix.EBUSY), errors.Is(err, unix.EAGAIN):
					busy = append(busy, name)
				case errors.Is(err, unix.ENOSYS):
					return u.cannot(&NoUnloadError{Modules: []string{name}, Evidence: "delete_module: " + err.Error()})
				default:
					return fmt.Errorf("unload %s: %w", name, err)
				}
				if len(busy) > 0 {
					break
				}
			}
		}
		if len(busy) == 0 {
			prev = order // re-read: what this round freed may now be removable
			continue
		}
		prev = nil
		held := u.holders(foreign)
		wait := backoff
		if u.Timeout > 0 {
			left := u.Timeout - clock.Now().Sub(start)
			if left <= 0 {
				return u.inUse(busy, held, clock.Now().Sub(start))
			}
			wait = min(wait, left)
		}
		u.Log.Info("NVIDIA driver kernel modules are in use; retrying", "attempt", attempt, "busy", strings.Join(busy, ","),
			"held_by", held, "retry_in", wait.Round(time.Millisecond), "waited", clock.Now().Sub(start).Round(time.Millisecond))
		t := clock.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return u.inUse(busy, u.holders(foreign), clock.Now().Sub(start))
			}
			return fmt.Errorf("unload: %w", ctx.Err())
		case <-t.C():
		}
		backoff = min(backoff*2, maxUnloadBackoff)
	}
}

// maxUnloadBackoff caps the wait between two unload attempts (and so the retry lines logged).
const maxUnloadBackoff = 5 * time.Second

// order is the unload order of names and their holders, and the holders in it that are outside
// names (empty with UnloadForeign, where they are unloaded like the rest).
func (u Unloader) order(names []string) (order, foreign []string, err error) {
	order, err = kernel.UnloadOrder(u.Host.Sys, names)
	if err != nil {
		return nil, nil, fmt.Errorf("unload: %w", err)
	}
	if u.UnloadForeign {
		return order, nil, nil
	}
	own := map[string]bool{}
	for _, n := range names {
		own[kernel.Normalize(n)] = true
	}
	for _, m := range order {
		if !own[m] {
			foreign = append(foreign, m)
		}
	}
	return order, foreign, nil
}

func (u Unloader) dryRun(names []string) error {
	order, foreign, err := u.order(names)
	if err != nil {
		return err
	}
	busy, fixed, err := inspect(u.Host.Sys, order, foreign)
	if err != nil {
		return err
	}
	if len(fixed) > 0 {
		return noUnload(u.Host.Sys, fixed)
	}
	if len(busy) > 0 || len(foreign) > 0 {
		wait := "until the deadline"
		if u.Timeout > 0 {
			wait = "for up to " + u.Timeout.String()
		}
		return fmt.Errorf("%w: could not unload NVIDIA driver kernel modules now, driver is in use: %s busy; held by: %s; a real run retries %s, then leaves every module loaded",
			exitcode.ErrInUse, strings.Join(busy, ", "), u.holders(foreign), wait)
	}
	for i := len(u.Pretended) - 1; i >= 0; i-- {
		if name := kernel.Normalize(u.Pretended[i]); !slices.Contains(order, name) {
			order = append(order, name)
		}
	}
	for _, name := range order {
		if err := u.Host.Kernel.UnloadModule(name); err != nil {
			return fmt.Errorf("unload %s: %w", name, err)
		}
	}
	return nil
}

// holders describes the foreign holder modules and the processes that hold the driver.
func (u Unloader) holders(foreign []string) string {
	var parts []string
	for _, m := range foreign {
		parts = append(parts, "module "+m+" (not loaded by driver-agent: stop what uses it, or set --unload-foreign-holders to unload it)")
	}
	users := Users(u.Host.Roots)
	if len(users) > 0 || len(parts) == 0 {
		parts = append(parts, describe(users))
	}
	return strings.Join(parts, "; ")
}

// cannot logs, as inUse does for a driver in use, that the kernel cannot unload the modules.
func (u Unloader) cannot(err error) error {
	u.Log.Error("Could not unload NVIDIA driver kernel modules, the kernel cannot unload modules", "error", err)
	return err
}

func (u Unloader) inUse(busy []string, held string, waited time.Duration) error {
	u.Log.Error("Could not unload NVIDIA driver kernel modules, driver is in use", "busy", strings.Join(busy, ","), "held_by", held,
		"waited", waited.Round(time.Millisecond))
	return fmt.Errorf("%w: could not unload NVIDIA driver kernel modules, driver is in use: %s busy after %s; held by: %s",
		exitcode.ErrInUse, strings.Join(busy, ", "), waited.Round(time.Second), held)
}

// NoUnloadError is the refusal of a kernel that cannot unload modules at all: one built without
// CONFIG_MODULE_UNLOAD (no refcnt in /sys/module; delete_module says ENOSYS), where waiting does
// not help. It is an exitcode.ErrInUse: the modules stay loaded.
type NoUnloadError struct {
	Modules  []string
	Evidence string // what shows it
}

func (e *NoUnloadError) Error() string {
	return fmt.Sprintf("%v: %s cannot be unloaded: the running kernel was built without module unloading (CONFIG_MODULE_UNLOAD; %s), so %s loaded until the node reboots",
		exitcode.ErrInUse, strings.Join(e.Modules, ", "), e.Evidence, plural(len(e.Modules), "it stays", "they stay"))
}

func (e *NoUnloadError) Unwrap() error { return exitcode.ErrInUse }

func noUnload(sys string, fixed []string) error {
	return &NoUnloadError{Modules: fixed, Evidence: filepath.Join(sys, "module", fixed[0]) + " has no refcnt"}
}

// inspect reads each module of order once and lists those whose reference count is more than
// their holders in the set explain (something outside the set, an open device or another
// subsystem, uses them) or that a foreign holder module holds (busy), and those the running
// kernel cannot unload (fixed).
func inspect(sys string, order, foreign []string) (busy, fixed []string, err error) {
	for _, name := range order {
		if slices.Contains(foreign, name) {
			continue
		}
		m, err := kernel.ReadSysModule(sys, name)
		if err != nil {
			return nil, nil, err
		}
		if !m.Loaded {
			continue // gone since the order was read
		}
		if !m.Unloadable {
			fixed = append(fixed, name)
			continue
		}
		held := slices.ContainsFunc(m.Holders, func(h string) bool { return slices.Contains(foreign, h) })
		if m.RefCnt > len(m.Holders) || held {
			busy = append(busy, name)
		}
	}
	return busy, fixed, nil
}

// User is a process that holds an NVIDIA device open.
type User struct {
	PID     int
	Command string
	Device  string
	Cgroup  string
}

func describe(users []User) string {
	if len(users) == 0 {
		return "no process has /dev/nvidia* open (a kernel module holds a reference)"
	}
	var parts []string
	for _, u := range users {
		s := fmt.Sprintf("pid %d (%s) has %s open", u.PID, u.Command, u.Device)
		if u.Cgroup != "" {
			s += " in " + u.Cgroup
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, "; ")
}

// Users scans r.Proc/*/fd for open NVIDIA device nodes (under /dev or r.Dev).
func Users(r host.Roots) []User {
	proc, dev := r.Proc, r.Dev
	pids, _ := os.ReadDir(proc)
	var users []User
	for _, p := range pids {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		fds, _ := os.ReadDir(filepath.Join(proc, p.Name(), "fd"))
		for _, fd := range fds {
			target, err := os.Readlink(filepath.Join(proc, p.Name(), "fd", fd.Name()))
			if err != nil {
				continue
			}
			base := filepath.Base(target)
			if !strings.HasPrefix(base, "nvidia") || !(strings.HasPrefix(target, "/dev/") || strings.HasPrefix(target, dev+"/")) {
				continue
			}
			u := User{PID: pid, Device: target}
			if comm, err := kernel.ReadSmall(filepath.Join(proc, p.Name(), "comm")); err == nil {
				u.Command = strings.TrimSpace(string(comm))
			}
			if cg, err := kernel.ReadSmall(filepath.Join(proc, p.Name(), "cgroup")); err == nil {
				u.Cgroup = strings.TrimSpace(strings.SplitN(string(cg), "\n", 2)[0])
			}
			users = append(users, u)
			break
		}
	}
	sort.Slice(users, func(i, j int) bool { return users[i].PID < users[j].PID })
	return users
}
