package daemon

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"
)

const (
	// maxLine is the longest line logged as one record; longer lines are split.
	maxLine = 4096
	// tailLineBytes bounds each line kept for error messages.
	tailLineBytes = 512
	// drainTimeout is how long the output of an exited process is still read, for what a
	// grandchild that escaped the process group may keep writing.
	drainTimeout = 200 * time.Millisecond
)

// tail keeps the last lines a daemon printed, bounded in count and length.
type tail struct {
	mu    sync.Mutex
	max   int
	lines []string
}

func newTail(n int) *tail { return &tail{max: n} }

func (t *tail) add(line string) {
	if t == nil || t.max <= 0 {
		return
	}
	if len(line) > tailLineBytes {
		line = line[:tailLineBytes] + "..."
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.lines) == t.max {
		copy(t.lines, t.lines[1:])
		t.lines = t.lines[:t.max-1]
	}
	t.lines = append(t.lines, line)
}

// Lines returns a copy of the kept lines, oldest first.
func (t *tail) Lines() []string {
	if t == nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]string(nil), t.lines...)
}

// reader is a goroutine draining one pipe.
type reader struct {
	f    *os.File
	done chan struct{}
}

// readLines reads f line by line and hands each non-blank line to emit until EOF or finish.
func readLines(f *os.File, emit func(string)) *reader {
	rd := &reader{f: f, done: make(chan struct{})}
	go func() {
		defer close(rd.done)
		br := bufio.NewReaderSize(f, maxLine)
		for {
			b, err := br.ReadSlice('\n')
			if len(b) > 0 {
				line := strings.TrimRight(string(b), "\r\n")
				if strings.TrimSpace(line) != "" {
					emit(strings.ToValidUTF8(line, "\uFFFD"))
				}
			}
			if err != nil && !errors.Is(err, bufio.ErrBufferFull) {
				return
			}
		}
	}()
	return rd
}

// readAll copies at most limit bytes of f into buf (the rest is read and dropped).
func readAll(f *os.File, buf *bytes.Buffer, limit int64) *reader {
	rd := &reader{f: f, done: make(chan struct{})}
	go func() {
		defer close(rd.done)
		_, _ = io.Copy(buf, io.LimitReader(f, limit))
		_, _ = io.Copy(io.Discard, f)
	}()
	return rd
}

// finish lets the reader run for at most drain more, then stops it and closes the pipe.
func (rd *reader) finish(drain time.Duration) {
	_ = rd.f.SetReadDeadline(time.Now().Add(drain))
	<-rd.done
	_ = rd.f.Close()
}

// capture is a child's stdout and stderr, each line logged and kept in a tail.
type capture struct {
	stdout, stderr *os.File // write ends, for the child
	readers        []*reader
}

// newCapture makes the pipes for a child's stdout and stderr. Each line becomes an Info record
// of log with stream=stdout or stream=stderr, and is added to t.
func newCapture(log *slog.Logger, t *tail) (*capture, error) {
	c := &capture{}
	for _, stream := range []string{"stdout", "stderr"} {
		r, w, err := os.Pipe()
		if err != nil {
			c.closeWriters()
			c.finish(0)
			return nil, err
		}
		if stream == "stdout" {
			c.stdout = w
		} else {
			c.stderr = w
		}
		c.readers = append(c.readers, readLines(r, func(line string) {
			t.add(line)
			log.Info(line, "stream", stream)
		}))
	}
	return c, nil
}

// closeWriters closes the agent's copies of the write ends once the child holds its own.
func (c *capture) closeWriters() {
	for _, f := range []*os.File{c.stdout, c.stderr} {
		if f != nil {
			_ = f.Close()
		}
	}
}

// finish stops the readers after at most drain and closes the pipes.
func (c *capture) finish(drain time.Duration) {
	for _, rd := range c.readers {
		rd.finish(drain)
	}
	c.readers = nil
}
