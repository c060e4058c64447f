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
		l.Log.Info("loading kernel module", "module", m.Name, "path", m.Path, "params", m.Params)
		err := l.Host.Kernel.LoadModule(m)
		if errors.Is(err, unix.EEXIST) {
			sm, rerr := kernel.ReadSysModule(l.Host.Sys, m.Name)
			if rerr == nil && sm.Version == f.Info.Version {
				l.Log.Info("kernel module is already loaded with the same version; adopting it", "module", m.Name, "version", sm.Version)
				loaded = append(loaded, m.Name)
				continue
			}
			err = fmt.Errorf("%w (loaded version %q, this one %q)", err, sm.Version, f.Info.Version)
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
		what = fmt.Sprintf("invalid module format: the module was built for %q, the running kernel is %s", f.Info.Vermagic, l.Release)
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
	for _, d := range f.Info.Depends {
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

// Unload removes the named modules and every loaded module that holds them, in holder order.
// Nothing is removed while the set is in use from outside (a process with /dev/nvidia* open, or a
// reference no holder explains): the agent waits with backoff until ctx is nearly over, then
// returns an error wrapping exitcode.ErrInUse that names the processes, leaving every module
// loaded, as NVIDIA's script does. EBUSY and EAGAIN from the kernel are retried the same way.
// With dryRun the order is computed once and handed to h.Kernel (a recorder); the named modules
// that are not loaded (the dry run only pretended to load them) follow in reverse order.
func Unload(ctx context.Context, h host.Host, log *slog.Logger, names []string, dryRun bool) error {
	if dryRun {
		order, err := kernel.UnloadOrder(h.Sys, names)
		if err != nil {
			return fmt.Errorf("unload: %w", err)
		}
		for i := len(names) - 1; i >= 0; i-- {
			if name := kernel.Normalize(names[i]); !slices.Contains(order, name) {
				order = append(order, name)
			}
		}
		for _, name := range order {
			if err := h.Kernel.UnloadModule(name); err != nil {
				return fmt.Errorf("unload %s: %w", name, err)
			}
		}
		return nil
	}
	// Keep a little of the deadline for the teardown steps after this one.
	if deadline, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, deadline.Add(-min(2*time.Second, time.Until(deadline)/5)))
		defer cancel()
	}
	backoff := 50 * time.Millisecond
	var prev []string
	for {
		order, err := kernel.UnloadOrder(h.Sys, names)
		if err != nil {
			return fmt.Errorf("unload: %w", err)
		}
		if len(order) == 0 {
			return nil
		}
		if slices.Equal(order, prev) {
			return fmt.Errorf("unload: %s still loaded although the kernel accepted their removal", strings.Join(order, ", "))
		}
		busy, err := externalUsers(h.Sys, order)
		if err != nil {
			return err
		}
		if len(busy) == 0 {
			for _, name := range order {
				err := h.Kernel.UnloadModule(name)
				switch {
				case err == nil:
					log.Info("unloaded kernel module", "module", name)
				case errors.Is(err, unix.ENOENT):
				case errors.Is(err, unix.EBUSY), errors.Is(err, unix.EAGAIN):
					busy = append(busy, name)
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
		select {
		case <-ctx.Done():
			users := Users(h.Proc, h.Dev)
			return fmt.Errorf("%w: could not unload NVIDIA driver kernel modules, driver is in use: %s busy; held by: %s",
				exitcode.ErrInUse, strings.Join(busy, ", "), describe(users))
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, time.Second)
	}
}

// externalUsers lists the modules of order whose reference count is more than their holders in
// the set explain: something outside the set (an open device, another subsystem) uses them.
func externalUsers(sys string, order []string) ([]string, error) {
	var busy []string
	for _, name := range order {
		m, err := kernel.ReadSysModule(sys, name)
		if err != nil {
			return nil, err
		}
		if m.RefCnt > len(m.Holders) {
			busy = append(busy, name)
		}
	}
	return busy, nil
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

// Users scans <proc>/*/fd for open NVIDIA device nodes.
func Users(proc, dev string) []User {
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
