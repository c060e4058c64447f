package status

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// TestAtomicWrites checks that a reader racing many writers only ever sees a complete document.
func TestAtomicWrites(t *testing.T) {
	t.Parallel()
	p := Paths{Run: t.TempDir()}
	w := Writer{Files: host.OSFiles{}, Paths: p}
	if err := w.Write(Status{Phase: "detect"}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			s := Status{Phase: "load", LastError: strings.Repeat("x", i%5000)}
			if err := w.Write(s); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for i := 0; i < 300; i++ {
		if _, err := Read(p); err != nil {
			t.Fatalf("read %d saw a partial file: %v", i, err)
		}
	}
	close(stop)
	wg.Wait()
	entries, _ := os.ReadDir(filepath.Dir(p.StatusJSON()))
	if len(entries) != 1 {
		t.Errorf("temporary files left behind: %v", entries)
	}
	if err := w.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Dir(p.StatusJSON())); !os.IsNotExist(err) {
		t.Errorf("status dir left after Remove: %v", err)
	}
}

func TestOperatorFiles(t *testing.T) {
	t.Parallel()
	p := Paths{Run: t.TempDir()}
	w := Writer{Files: host.OSFiles{}, Paths: p}
	for _, step := range []struct {
		ready bool
		want  string
	}{{false, "NotReady"}, {true, "Ready"}} {
		if err := w.SetReady(step.ready); err != nil {
			t.Fatal(err)
		}
		if got, _ := os.ReadFile(p.DaemonsStatus()); string(got) != step.want {
			t.Errorf("daemons status = %q, want %q", got, step.want)
		}
	}
	w.StoreDigest("abc123")
	if got, _ := os.ReadFile(p.State()); string(got) != "abc123" {
		t.Errorf("state = %q", got)
	}
	out := Format(Status{Phase: "wait", Ready: true, Phases: []Timing{{Name: "load", Result: "ok", Duration: 1500 * time.Millisecond}}})
	if !strings.Contains(out, "load") || !strings.Contains(out, "1.5s") || strings.Contains(out, "fabric") {
		t.Errorf("Format = %q", out)
	}
	out = Format(Status{Phase: "wait", Fabric: "completed", FabricDetail: "8 GPUs Completed/Success"})
	if !strings.Contains(out, "fabric:         completed (8 GPUs Completed/Success)\n") {
		t.Errorf("Format with a fabric state = %q", out)
	}
}

func TestRemoveKeepsOtherContent(t *testing.T) {
	t.Parallel()
	p := Paths{Run: t.TempDir()}
	w := Writer{Files: host.OSFiles{}, Paths: p}
	hosttest.Must(t, w.Write(Status{Phase: "wait"}))
	cache := filepath.Join(filepath.Dir(p.StatusJSON()), "cache")
	hosttest.Must(t, os.MkdirAll(cache, 0o755))
	if err := w.Remove(); err != nil {
		t.Fatalf("Remove with the cache beside it: %v", err)
	}
	if _, err := os.Stat(p.StatusJSON()); !os.IsNotExist(err) {
		t.Error("status.json left")
	}
	if _, err := os.Stat(cache); err != nil {
		t.Error("the cache beside status.json was removed")
	}
}
