package hosttest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"github.com/driver-agent/driver-agent/pkg/host"
)

// FakeMounter records mounts and keeps <proc>/self/mountinfo in step with them.
type FakeMounter struct {
	proc  string
	mu    sync.Mutex
	base  string
	mount []string // mount points in order
	calls []string
	// Fail makes Mount of this target fail.
	Fail map[string]error
}

// NewFakeMounter returns a mounter over the roots' proc.
func NewFakeMounter(r host.Roots) *FakeMounter {
	base, _ := os.ReadFile(filepath.Join(r.Proc, "self/mountinfo"))
	return &FakeMounter{proc: r.Proc, base: string(base)}
}

// Mount implements host.Mounter. Propagation changes (no MS_BIND) only record the call.
func (m *FakeMounter) Mount(source, target, fstype string, flags uintptr, data string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls = append(m.calls, fmt.Sprintf("mount %s %s %s", source, target, host.MountFlags(flags)))
	if err := m.Fail[target]; err != nil {
		return err
	}
	if flags&syscall.MS_BIND != 0 {
		m.mount = append(m.mount, target)
	}
	return m.sync()
}

// Unmount implements host.Mounter.
func (m *FakeMounter) Unmount(target string, flags int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls = append(m.calls, "unmount "+target)
	for i := len(m.mount) - 1; i >= 0; i-- {
		if m.mount[i] == target {
			m.mount = append(m.mount[:i], m.mount[i+1:]...)
			return m.sync()
		}
	}
	return syscall.EINVAL
}

// Calls returns the recorded calls.
func (m *FakeMounter) Calls() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]string(nil), m.calls...)
}

// Mounted returns the current bind mounts.
func (m *FakeMounter) Mounted() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]string(nil), m.mount...)
}

func (m *FakeMounter) sync() error {
	var b strings.Builder
	b.WriteString(m.base)
	for i, p := range m.mount {
		fmt.Fprintf(&b, "%d 1 0:1 / %s rw,relatime shared:1 - overlay overlay rw\n", 900+i, strings.ReplaceAll(p, " ", `\040`))
	}
	if err := os.MkdirAll(filepath.Join(m.proc, "self"), 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(m.proc, "self/mountinfo"), []byte(b.String()), 0o644)
}

// FakeMknoder writes a regular file "c <major>:<minor> <perm>" where a device node would be.
type FakeMknoder struct{}

// Mknod implements host.Mknoder.
func (FakeMknoder) Mknod(path string, perm os.FileMode, major, minor uint32) error {
	return os.WriteFile(path, []byte(fmt.Sprintf("c %d:%d %#o\n", major, minor, perm.Perm())), 0o644)
}

// FakeExec starts fake processes that run until signalled (or exit at once when told to).
type FakeExec struct {
	mu    sync.Mutex
	procs []*FakeProcess
	// ExitAtStart makes processes of this path exit immediately with the given error.
	ExitAtStart map[string]error
}

// Start implements host.Execer.
func (e *FakeExec) Start(_ context.Context, c host.Cmd) (host.Process, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	p := &FakeProcess{Cmd: c, pid: 1000 + len(e.procs), done: make(chan struct{})}
	e.procs = append(e.procs, p)
	if err, ok := e.ExitAtStart[c.Path]; ok {
		p.exit(err)
	}
	return p, nil
}

// Processes returns every process started.
func (e *FakeExec) Processes() []*FakeProcess {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*FakeProcess(nil), e.procs...)
}

// FakeProcess is a started fake process.
type FakeProcess struct {
	Cmd  host.Cmd
	pid  int
	once sync.Once
	done chan struct{}
	mu   sync.Mutex
	sigs []syscall.Signal
	err  error
	// IgnoreTERM makes SIGTERM do nothing, so only SIGKILL stops the process.
	IgnoreTERM bool
}

// Pid implements host.Process.
func (p *FakeProcess) Pid() int { return p.pid }

// Signal implements host.Process.
func (p *FakeProcess) Signal(sig syscall.Signal) error {
	p.mu.Lock()
	p.sigs = append(p.sigs, sig)
	ignore := p.IgnoreTERM && sig == syscall.SIGTERM
	p.mu.Unlock()
	if !ignore {
		p.exit(fmt.Errorf("signal: %s", sig))
	}
	return nil
}

// Wait implements host.Process.
func (p *FakeProcess) Wait() error {
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Exit ends the process with err, as a crash would.
func (p *FakeProcess) Exit(err error) { p.exit(err) }

func (p *FakeProcess) exit(err error) {
	p.once.Do(func() {
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(p.done)
	})
}

// Signals returns the signals received.
func (p *FakeProcess) Signals() []syscall.Signal {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]syscall.Signal(nil), p.sigs...)
}

// Running reports whether the process has not exited.
func (p *FakeProcess) Running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}
