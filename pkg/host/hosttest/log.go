package hosttest

import (
	"bytes"
	"log/slog"
	"sync"
)

// LogBuffer is a log sink that one goroutine may write while another reads it.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write implements io.Writer.
func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// NewLog returns a debug-level text logger that writes into a new LogBuffer.
func NewLog() (*slog.Logger, *LogBuffer) {
	b := &LogBuffer{}
	return slog.New(slog.NewTextHandler(b, &slog.HandlerOptions{Level: slog.LevelDebug})), b
}
