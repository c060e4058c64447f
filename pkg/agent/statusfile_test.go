package agent

import (
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/status"
)

// countingFiles counts the files written through it.
type countingFiles struct {
	host.Files
	mu     sync.Mutex
	writes int
}

func (f *countingFiles) WriteFile(path string, data []byte, perm os.FileMode, atomic bool) error {
	f.mu.Lock()
	f.writes++
	f.mu.Unlock()
	return f.Files.WriteFile(path, data, perm, atomic)
}

func (f *countingFiles) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.writes
}

func newStatusRun(t *testing.T) (*run, *countingFiles, status.Paths) {
	paths := status.Paths{Run: t.TempDir()}
	files := &countingFiles{Files: host.OSFiles{}}
	r := &run{Agent: &Agent{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}, clock: daemon.WallClock{}, report: status.Writer{Files: files, Paths: paths}}
	return r, files, paths
}

func phaseOnDisk(t *testing.T, p status.Paths) string {
	t.Helper()
	s, err := status.Read(p)
	if err != nil {
		t.Fatal(err)
	}
	return s.Phase
}

// Steps close together are written together: the first at once, the rest by one write that
// shows the last of them, statusEvery later.
func TestStatusStepsCoalesce(t *testing.T) {
	r, files, paths := newStatusRun(t)
	start := time.Now()
	r.enterPhase("detect")
	if n := files.count(); n != 1 {
		t.Fatalf("%d writes after the first step, want 1 (at once)", n)
	}
	for _, p := range []string{"decide", "prepare", "load", "devices"} {
		r.enterPhase(p)
	}
	if n, since := files.count(), time.Since(start); n != 1 && since < statusEvery {
		t.Fatalf("%d writes for 5 steps within %s, want 1 until statusEvery (%s) has passed", n, since, statusEvery)
	}
	deadline := time.Now().Add(10 * statusEvery)
	for phaseOnDisk(t, paths) != "devices" {
		if time.Now().After(deadline) {
			t.Fatalf("status.json still says %q %s after the last step", phaseOnDisk(t, paths), 10*statusEvery)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if n := files.count(); n != 2 {
		t.Errorf("%d writes for 5 steps in one interval, want 2", n)
	}
}

// A write at once (Ready, a failure) takes the place of the one that is due, and after
// closeStatus no step writes the file again, while writeStatus still does.
func TestStatusWriteNowAndClose(t *testing.T) {
	r, files, paths := newStatusRun(t)
	r.enterPhase("detect")
	r.enterPhase("decide") // due
	r.setPhase(PhaseReady)
	if got := phaseOnDisk(t, paths); got != PhaseReady {
		t.Fatalf("status.json says %q right after setPhase(ready)", got)
	}
	r.enterPhase(PhaseWait) // due
	r.closeStatus()
	if err := r.report.Remove(); err != nil {
		t.Fatal(err)
	}
	r.enterPhase(PhaseTeardown)
	time.Sleep(3 * statusEvery)
	if _, err := os.Stat(paths.StatusJSON()); !os.IsNotExist(err) {
		t.Fatalf("status.json came back after closeStatus and its removal: %v", err)
	}
	if n := files.count(); n != 2 {
		t.Errorf("%d writes, want 2 (detect at once, ready at once)", n)
	}
	r.setPhase(PhaseTeardown) // a failed run keeps the file with its error
	if got := phaseOnDisk(t, paths); got != PhaseTeardown {
		t.Errorf("status.json says %q after setPhase(teardown) on a closed run", got)
	}
}
