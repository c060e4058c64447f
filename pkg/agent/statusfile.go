package agent

import (
	"sync"
	"time"

	"github.com/driver-agent/driver-agent/pkg/status"
)

// statusEvery is how often at most status.json is written for the steps of a run: each write
// is a synced file renamed into place, and a cached start passes a dozen steps (phases, daemon
// changes) in a few hundred milliseconds. A step after a write waits for the next one, at most
// statusEvery later; Ready, a failure and the teardown are written at once (writeStatus).
// Real time, not the run's clock: the file is for people and scripts looking at the node, for
// whom a second is soon enough, and a start that gets Ready within it writes twice.
const statusEvery = time.Second

// statusFile serialises the writes of status.json and holds the one that is due.
type statusFile struct {
	mu     sync.Mutex
	last   time.Time   // when the last write began
	due    *time.Timer // the write a step asked for, nil when none is waiting
	closed bool        // the run has removed the file: no step writes it again
}

// writeStatus writes status.json from the current status now, in place of any write that is
// due. Writes are serialised and each takes its snapshot inside, so the file never goes back
// to an older state.
func (r *run) writeStatus() {
	r.sf.mu.Lock()
	defer r.sf.mu.Unlock()
	r.cancelDue()
	r.writeLocked()
}

// noteStatus has status.json show the current status: at once when the last write is
// statusEvery old, or else by a write due when it will be.
func (r *run) noteStatus() {
	r.sf.mu.Lock()
	defer r.sf.mu.Unlock()
	if r.sf.closed || r.sf.due != nil {
		return // the write that is due takes its snapshot when it runs
	}
	wait := statusEvery - time.Since(r.sf.last)
	if wait <= 0 {
		r.writeLocked()
		return
	}
	var t *time.Timer
	t = time.AfterFunc(wait, func() {
		r.sf.mu.Lock()
		defer r.sf.mu.Unlock()
		if r.sf.due != t {
			return // written or cancelled meanwhile
		}
		r.sf.due = nil
		r.writeLocked()
	})
	r.sf.due = t
}

// closeStatus ends the steps' writes before the run removes status.json, so that none brings
// it back; writeStatus still writes (a failed run keeps the file with its error).
func (r *run) closeStatus() {
	r.sf.mu.Lock()
	defer r.sf.mu.Unlock()
	r.sf.closed = true
	r.cancelDue()
}

func (r *run) cancelDue() {
	if r.sf.due != nil {
		r.sf.due.Stop()
		r.sf.due = nil
	}
}

func (r *run) writeLocked() {
	r.sf.last = time.Now()
	r.mu.Lock()
	r.status.Updated = r.clock.Now()
	s := r.status
	s.Phases = append([]status.Timing(nil), r.status.Phases...)
	s.Daemons = append([]status.Daemon(nil), r.status.Daemons...)
	r.mu.Unlock()
	if err := r.report.Write(s); err != nil {
		r.Log.Warn("could not write status file", "error", err)
	}
}
