package modules

import (
	"bytes"
	"errors"
	"io"
	"strings"

	"golang.org/x/sys/unix"
)

// Kmsg reads the kernel log records written after it was opened. A nil *Kmsg (no /dev/kmsg, or
// not readable) reads nothing. It reads the raw descriptor: through os.File, Go's poller would
// turn "no more records" (EAGAIN) into waiting for the next one.
type Kmsg struct{ fd int }

// OpenKmsg opens path (/dev/kmsg) without blocking and skips the records already there.
func OpenKmsg(path string) *Kmsg {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	if _, err := unix.Seek(fd, 0, io.SeekEnd); err != nil {
		unix.Close(fd)
		return nil
	}
	return &Kmsg{fd: fd}
}

// Lines returns the messages of the records written since the last call (at most 200).
func (k *Kmsg) Lines() []string {
	if k == nil {
		return nil
	}
	var lines []string
	buf := make([]byte, 8192) // /dev/kmsg returns one record per read
	for len(lines) < 200 {
		n, err := unix.Read(k.fd, buf)
		if n > 0 {
			lines = append(lines, ParseKmsg(buf[:n])...)
		}
		if errors.Is(err, unix.EPIPE) || errors.Is(err, unix.EINTR) { // records overwritten while we read: keep going
			continue
		}
		if err != nil || n <= 0 {
			break
		}
	}
	return lines
}

// Close closes the reader.
func (k *Kmsg) Close() {
	if k != nil {
		unix.Close(k.fd)
	}
}

// ParseKmsg returns the message text of each record in data ("<prio>,<seq>,<usec>,<flags>;text"),
// skipping the " KEY=value" continuation lines.
func ParseKmsg(data []byte) []string {
	var out []string
	for _, line := range bytes.Split(data, []byte("\n")) {
		if len(line) == 0 || line[0] == ' ' {
			continue
		}
		_, text, ok := bytes.Cut(line, []byte(";"))
		if !ok {
			continue
		}
		if t := strings.TrimSpace(string(text)); t != "" {
			out = append(out, t)
		}
	}
	return out
}
