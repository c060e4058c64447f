package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

func TestTerminationLog(t *testing.T) {
	path := filepath.Join(t.TempDir(), "termination-log")
	WriteTerminationLog(path, errors.New("x"))
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatal("the termination log must not be created when Kubernetes did not provide it")
	}
	hosttest.Must(t, os.WriteFile(path, []byte("old content that is longer\n"), 0o644))
	WriteTerminationLog(path, fmt.Errorf("load: %w: load nvidia: no GPU\nsecond line", exitcode.ErrNoGPU))
	if got, _ := os.ReadFile(path); string(got) != "driver-agent exit 5: load: no NVIDIA GPU found: load nvidia: no GPU second line\n" {
		t.Errorf("termination log = %q", got)
	}
	WriteTerminationLog(path, nil)
	if got, _ := os.ReadFile(path); string(got) != "driver-agent stopped cleanly\n" {
		t.Errorf("termination log = %q", got)
	}
}
