package hosttest

import (
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
