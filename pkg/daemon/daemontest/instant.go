package daemontest

import (
	"sync"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
)

// Instant is a daemon.Clock whose timers fire as they are made, moving the clock forward by
// their duration: code that waits in a loop runs through its waits at once, and the test reads
// how long it would have waited. Stop on its timers reports false, as for a fired timer.
type Instant struct {
	mu    sync.Mutex
	now   time.Time
	waits []time.Duration
}

// NewInstant returns an instant clock that reads start.
func NewInstant(start time.Time) *Instant { return &Instant{now: start} }

// Now implements daemon.Clock.
func (c *Instant) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// NewTimer implements daemon.Clock: the clock moves d forward and the timer has fired.
func (c *Instant) NewTimer(d time.Duration) daemon.Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	c.waits = append(c.waits, d)
	ch := make(chan time.Time, 1)
	ch <- c.now
	return firedTimer(ch)
}

// Waits returns the duration of every timer made, in order.
func (c *Instant) Waits() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.waits...)
}

type firedTimer chan time.Time

func (t firedTimer) C() <-chan time.Time { return t }
func (t firedTimer) Stop() bool          { return false }
