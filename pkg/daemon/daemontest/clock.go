// Package daemontest provides a fake daemon.Clock whose timers fire only when a test says so,
// so that backoff, start and stop timeouts are asserted without sleeping.
package daemontest

import (
	"sync"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon"
)

// waitLimit bounds, in real time, how long Next waits for code under test to create a timer.
const waitLimit = 20 * time.Second

// Clock is a fake daemon.Clock. Time moves only through Advance and Timer.Fire.
type Clock struct {
	mu      sync.Mutex
	now     time.Time
	pending []*Timer
	created chan *Timer
}

// NewClock returns a clock that reads start.
func NewClock(start time.Time) *Clock {
	return &Clock{now: start, created: make(chan *Timer, 4096)}
}

// Now implements daemon.Clock.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// NewTimer implements daemon.Clock. Every timer is also queued for Next, in creation order.
func (c *Clock) NewTimer(d time.Duration) daemon.Timer {
	c.mu.Lock()
	t := &Timer{c: c, D: d, At: c.now.Add(d), ch: make(chan time.Time, 1)}
	c.pending = append(c.pending, t)
	c.mu.Unlock()
	c.created <- t
	return t
}

// Next returns the next timer created, in creation order, waiting for it in real time; the test
// fails when none comes within 20s.
func (c *Clock) Next(tb testing.TB) *Timer {
	tb.Helper()
	select {
	case t := <-c.created:
		return t
	case <-time.After(waitLimit):
		tb.Fatalf("no timer was created within %s", waitLimit)
		return nil
	}
}

// Advance moves the clock forward by d and fires every pending timer that is due.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	now := c.now
	var due []*Timer
	keep := c.pending[:0]
	for _, t := range c.pending {
		if !t.At.After(now) {
			due = append(due, t)
		} else {
			keep = append(keep, t)
		}
	}
	c.pending = keep
	c.mu.Unlock()
	for _, t := range due {
		t.send(now)
	}
}

func (c *Clock) remove(t *Timer) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, p := range c.pending {
		if p == t {
			c.pending = append(c.pending[:i], c.pending[i+1:]...)
			return true
		}
	}
	return false
}

// Timer is a fake timer.
type Timer struct {
	c  *Clock
	ch chan time.Time
	D  time.Duration // the duration the timer was made with
	At time.Time     // when it is due

	mu      sync.Mutex
	stopped bool
	fired   bool
}

// C implements daemon.Timer.
func (t *Timer) C() <-chan time.Time { return t.ch }

// Stop implements daemon.Timer.
func (t *Timer) Stop() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped || t.fired {
		return false
	}
	t.stopped = true
	t.c.remove(t)
	return true
}

// Stopped reports whether the timer was stopped before it fired.
func (t *Timer) Stopped() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.stopped
}

// Fire moves the clock to the timer's due time (when that is later) and fires it. It reports
// false when the timer had been stopped or had fired already.
func (t *Timer) Fire() bool {
	t.c.mu.Lock()
	if t.At.After(t.c.now) {
		t.c.now = t.At
	}
	now := t.c.now
	t.c.mu.Unlock()
	if !t.c.remove(t) {
		return false
	}
	return t.send(now)
}

func (t *Timer) send(now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped || t.fired {
		return false
	}
	t.fired = true
	t.ch <- now
	return true
}
