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

// Load loads images in order and returns the names it loaded. When one fails, every module
// loaded by this call is unloaded again in reverse order and the error says what happened.
func Load(ctx context.Context, h host.Host, log *slog.Logger, images []host.ModuleImage) ([]string, error) {
	var loaded []string
	for _, m := range images {
		if err := ctx.Err(); err != nil {
			return loaded, errors.Join(err, rollback(h, log, loaded))
		}
		log.Info("loading kernel module", "module", m.Name, "path", m.Path, "params", m.Params)
		if err := h.Kernel.LoadModule(m); err != nil {
			lerr := explain(m, err)
			return nil, errors.Join(lerr, rollback(h, log, loaded))
		}
		loaded = append(loaded, m.Name)
	}
	return loaded, nil
}

func rollback(h host.Host, log *slog.Logger, loaded []string) error {
	var errs []error
	for i := len(loaded) - 1; i >= 0; i-- {
		log.Info("rolling back kernel module", "module", loaded[i])
		if err := h.Kernel.UnloadModule(loaded[i]); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("roll back %s: %w", loaded[i], err))
		}
	}
	return errors.Join(errs...)
}

func explain(m host.ModuleImage, err error) error {
	switch {
	case errors.Is(err, unix.ENODEV):
		return fmt.Errorf("%w: load %s: the kernel found no NVIDIA GPU this driver supports: %w", exitcode.ErrNoGPU, m.Name, err)
	case errors.Is(err, unix.ENOEXEC):
		return fmt.Errorf("%w: load %s: invalid module format (built for another kernel?): %w", exitcode.ErrModuleLoad, m.Name, err)
	case errors.Is(err, unix.ENOENT):
		return fmt.Errorf("%w: load %s: unknown symbol (a module it depends on is not loaded): %w", exitcode.ErrModuleLoad, m.Name, err)
	case errors.Is(err, unix.EKEYREJECTED), errors.Is(err, unix.EPERM):
		return fmt.Errorf("%w: load %s: the kernel rejected the module's signature (Secure Boot or lockdown): %w", exitcode.ErrModuleLoad, m.Name, err)
	}
	return fmt.Errorf("%w: load %s: %w", exitcode.ErrModuleLoad, m.Name, err)
}

// Unload removes the named modules and every loaded module that holds them, in holder order.
// EBUSY and EAGAIN are retried with backoff until ctx ends; when the driver stays in use the
// error wraps exitcode.ErrInUse and names the processes that hold /dev/nvidia*. With dryRun the
// order is computed once and handed to h.Kernel (a recorder) without waiting for the result.
func Unload(ctx context.Context, h host.Host, log *slog.Logger, names []string, dryRun bool) error {
	if dryRun {
		order, err := kernel.UnloadOrder(h.Sys, names)
		if err != nil {
			return fmt.Errorf("unload: %w", err)
		}
		for _, name := range order {
			if err := h.Kernel.UnloadModule(name); err != nil {
				return fmt.Errorf("unload %s: %w", name, err)
			}
		}
		return nil
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
		var busy []string
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
		}
		if len(busy) == 0 {
			prev = order // re-read: modules freed by this round may now be removable
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
