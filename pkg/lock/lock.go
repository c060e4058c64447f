// Package lock holds the single-instance lock: an exclusive flock on <run>/nvidia/nvidia-driver.pid,
// taken before the file is truncated, with the holder's PID written only once the lock is held.
package lock

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
)

// Lock is a held lock.
type Lock struct {
	f    *os.File
	path string
}

// Acquire takes the lock at path without blocking. When another process holds it the error wraps
// exitcode.ErrLockHeld and names the holder's PID as recorded in the file.
func Acquire(path string, pid int) (*Lock, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	// No O_TRUNC: a losing instance must not wipe the winner's PID.
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder := readPID(f)
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: an instance of the NVIDIA driver is already running (pid %s holds %s), aborting", exitcode.ErrLockHeld, holder, path)
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	if err := f.Truncate(0); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	if _, err := f.WriteAt([]byte(strconv.Itoa(pid)+"\n"), 0); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return &Lock{f: f, path: path}, nil
}

func readPID(f *os.File) string {
	data, err := io.ReadAll(io.LimitReader(f, 32))
	if s := strings.TrimSpace(string(data)); err == nil && s != "" {
		return s
	}
	return "unknown"
}

// Release removes the PID file while still holding the lock, then drops the lock.
func (l *Lock) Release() error {
	rerr := os.Remove(l.path)
	if errors.Is(rerr, os.ErrNotExist) {
		rerr = nil
	}
	return errors.Join(rerr, l.f.Close())
}

// Check looks at the lock at path without taking it or creating anything: when another process
// holds it the error wraps exitcode.ErrLockHeld and names the holder's PID, as Acquire's does.
func Check(path string) error {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("%w: an instance of the NVIDIA driver is running (pid %s holds %s)", exitcode.ErrLockHeld, readPID(f), path)
		}
		return fmt.Errorf("lock %s: %w", path, err)
	}
	return nil // closing the file drops the shared lock
}
