package hosttest_test

import (
	"strings"
	"sync"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// TestLogBuffer: records written from several goroutines while another reads all arrive whole
// (run under -race, it also shows the reads and writes do not race).
func TestLogBuffer(t *testing.T) {
	log, buf := hosttest.NewLog()
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			log.Debug("record", "writer", i)
		}()
	}
	for range 8 {
		_ = buf.String()
	}
	wg.Wait()
	if got := strings.Count(buf.String(), "level=DEBUG msg=record writer="); got != 8 {
		t.Errorf("%d whole records, want 8:\n%s", got, buf.String())
	}
}
