package lock

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

func TestContention(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "nvidia", "nvidia-driver.pid")
	first, err := Acquire(path, 111)
	if err != nil {
		t.Fatal(err)
	}
	_, err = Acquire(path, 222)
	if !errors.Is(err, exitcode.ErrLockHeld) || !strings.Contains(err.Error(), "pid 111") {
		t.Fatalf("second Acquire = %v, want ErrLockHeld naming pid 111", err)
	}
	if data, _ := os.ReadFile(path); string(data) != "111\n" {
		t.Fatalf("loser changed the PID file to %q", data)
	}
	if err := Check(path); !errors.Is(err, exitcode.ErrLockHeld) || !strings.Contains(err.Error(), "pid 111") {
		t.Fatalf("Check = %v, want ErrLockHeld naming pid 111", err)
	}
	if err := first.Release(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("PID file left after release: %v", err)
	}
	if err := Check(path); err != nil {
		t.Fatalf("Check after release: %v", err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Check made the PID file: %v", err)
	}
	again, err := Acquire(path, 333)
	if err != nil {
		t.Fatalf("Acquire after release: %v", err)
	}
	again.Release()
}

func TestStalePIDFileIsTaken(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "nvidia-driver.pid")
	hosttest.Must(t, os.WriteFile(path, []byte("99999999 stale and longer\n"), 0o644))
	l, err := Acquire(path, 42)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if data, _ := os.ReadFile(path); string(data) != "42\n" {
		t.Fatalf("PID file = %q, want 42", data)
	}
}
