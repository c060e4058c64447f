package flatcar

import (
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// barInterval is how often the terminal progress bar is redrawn.
const barInterval = 250 * time.Millisecond

// progress counts downloaded bytes and reports them: a log record every
// interval, and a one-line bar on a terminal.
type progress struct {
	url   string
	total int64 // -1 when unknown
	start time.Time
	done  atomic.Int64

	log      *slog.Logger
	interval time.Duration
	bar      io.Writer

	stop chan struct{}
	wg   sync.WaitGroup
}

func startProgress(log *slog.Logger, url string, total int64, interval time.Duration, bar io.Writer) *progress {
	p := &progress{url: url, total: total, start: time.Now(), log: log, interval: interval, bar: bar, stop: make(chan struct{})}
	p.wg.Add(1)
	go p.run()
	return p
}

// Write counts bytes; the progress sits in a tee after the hash.
func (p *progress) Write(b []byte) (int, error) {
	p.done.Add(int64(len(b)))
	return len(b), nil
}

func (p *progress) run() {
	defer p.wg.Done()
	var logC, barC <-chan time.Time
	if p.interval > 0 {
		t := time.NewTicker(p.interval)
		defer t.Stop()
		logC = t.C
	}
	if p.bar != nil {
		t := time.NewTicker(barInterval)
		defer t.Stop()
		barC = t.C
	}
	for {
		select {
		case <-p.stop:
			return
		case <-logC:
			p.logLine("downloading")
		case <-barC:
			p.drawBar(false)
		}
	}
}

// finish stops the reporting; ok draws the bar at its final state.
func (p *progress) finish(ok bool) {
	close(p.stop)
	p.wg.Wait()
	if p.bar != nil {
		if ok {
			p.drawBar(true)
		}
		fmt.Fprintln(p.bar)
	}
}

func (p *progress) stats() (done int64, elapsed time.Duration, rate float64) {
	done = p.done.Load()
	elapsed = time.Since(p.start)
	if s := elapsed.Seconds(); s > 0 {
		rate = float64(done) / s
	}
	return done, elapsed, rate
}

func (p *progress) logLine(msg string) {
	done, elapsed, rate := p.stats()
	attrs := []any{"url", p.url, "bytes", done, "elapsed", elapsed.Round(time.Second), "rate", mib(rate) + "/s"}
	if p.total > 0 {
		attrs = append(attrs, "total", p.total, "percent", done*100/p.total)
		if rate > 0 && done < p.total {
			attrs = append(attrs, "eta", eta(p.total-done, rate))
		}
	}
	p.log.Info(msg, attrs...)
}

// drawBar writes "\r[#####     ]  45% 170.0/377.0 MiB 35.2 MiB/s ETA 6s".
func (p *progress) drawBar(final bool) {
	done, _, rate := p.stats()
	const width = 30
	var line string
	if p.total > 0 {
		frac := min(float64(done)/float64(p.total), 1)
		n := int(frac * width)
		left := "--"
		if final {
			left = "0s"
		} else if rate > 0 {
			left = eta(p.total-done, rate).String()
		}
		line = fmt.Sprintf("[%s%s] %3d%% %s/%s %s/s ETA %s", strings.Repeat("#", n), strings.Repeat(" ", width-n),
			int(frac*100), mib(float64(done)), mib(float64(p.total)), mib(rate), left)
	} else {
		line = fmt.Sprintf("%s %s/s", mib(float64(done)), mib(rate))
	}
	fmt.Fprintf(p.bar, "\r%s\x1b[K", line)
}

// eta is the time left for bytes at rate bytes per second.
func eta(bytes int64, rate float64) time.Duration {
	return time.Duration(float64(bytes) / rate * float64(time.Second)).Round(time.Second)
}

func mib(b float64) string { return fmt.Sprintf("%.1f MiB", b/(1<<20)) }
