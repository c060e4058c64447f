package host

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
)

// Action is one side effect the agent would perform.
type Action struct {
	Kind   string `json:"kind"`   // load-module, unload-module, mount, unmount, mknod, write, mkdir, remove, remove-all, copy, link, touch, exec, signal
	Target string `json:"target"` // what it acts on
	Detail string `json:"detail,omitempty"`
}

func (a Action) String() string {
	if a.Detail == "" {
		return a.Kind + " " + a.Target
	}
	return a.Kind + " " + a.Target + " (" + a.Detail + ")"
}

// Recorder implements every side-effect seam by recording what would be done and doing nothing.
// It is what --dry-run runs the real decision logic with.
type Recorder struct {
	mu      sync.Mutex
	actions []Action
}

// DryRun returns a Host whose seams only record into rec.
func DryRun(r Roots, rec *Recorder) Host {
	return Host{Roots: r, Kernel: rec, Mounter: rec, Mknoder: rec, Files: rec, Procs: rec}
}

func (r *Recorder) add(kind, target, detail string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.actions = append(r.actions, Action{Kind: kind, Target: target, Detail: detail})
}

// Actions returns a copy of what was recorded, in order.
func (r *Recorder) Actions() []Action {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Action(nil), r.actions...)
}

// LoadModule implements Kernel.
func (r *Recorder) LoadModule(m ModuleImage) error {
	how := "finit_module " + m.Path
	switch {
	case m.Compressed:
		how += " (decompressed by the kernel)"
	case m.Data != nil:
		how = fmt.Sprintf("init_module %s (%d bytes decompressed)", m.Path, len(m.Data))
	}
	if m.Params != "" {
		how += " params: " + m.Params
	}
	r.add("load-module", m.Name, how)
	return nil
}

// UnloadModule implements Kernel.
func (r *Recorder) UnloadModule(name string) error { r.add("unload-module", name, ""); return nil }

// Mount implements Mounter.
func (r *Recorder) Mount(source, target, fstype string, flags uintptr, data string) error {
	r.add("mount", target, strings.TrimSpace(fmt.Sprintf("source=%q fstype=%q flags=%s %s", source, fstype, MountFlags(flags), data)))
	return nil
}

// Unmount implements Mounter.
func (r *Recorder) Unmount(target string, flags int) error {
	r.add("unmount", target, fmt.Sprintf("flags=%#x", flags))
	return nil
}

// Mknod implements Mknoder.
func (r *Recorder) Mknod(path string, perm os.FileMode, major, minor uint32) error {
	r.add("mknod", path, fmt.Sprintf("c %d:%d %#o", major, minor, perm.Perm()))
	return nil
}

// WriteFile implements Files.
func (r *Recorder) WriteFile(path string, data []byte, _ os.FileMode, _ bool) error {
	content := strings.TrimSpace(string(data))
	if len(content) > 80 || strings.Contains(content, "\n") {
		content = fmt.Sprintf("%d bytes", len(data))
	}
	r.add("write", path, content)
	return nil
}

// MkdirAll implements Files.
func (r *Recorder) MkdirAll(path string, _ os.FileMode) error { r.add("mkdir", path, ""); return nil }

// Remove implements Files.
func (r *Recorder) Remove(path string) error { r.add("remove", path, ""); return nil }

// RemoveAll implements Files.
func (r *Recorder) RemoveAll(path string) error { r.add("remove-all", path, ""); return nil }

// CopyFile implements Files.
func (r *Recorder) CopyFile(src, dst string, perm os.FileMode) error {
	r.add("copy", dst, fmt.Sprintf("from %s %#o", src, perm.Perm()))
	return nil
}

// Touch implements Files.
func (r *Recorder) Touch(path string) error { r.add("touch", path, ""); return nil }

// Link implements Files.
func (r *Recorder) Link(src, dst string) error { r.add("link", dst, "to "+src); return nil }

// Start implements Procs; the recorded process runs until it is signalled.
func (r *Recorder) Start(_ context.Context, c Cmd, _ StartOptions) (Process, error) {
	r.add("exec", c.Path, strings.Join(c.Args, " "))
	return &recordedProcess{r: r, path: c.Path, done: make(chan struct{})}, nil
}

// Output implements Procs: it records the command line and returns no output.
func (r *Recorder) Output(_ context.Context, c Cmd) ([]byte, error) {
	r.add("exec", c.Path, strings.Join(c.Args, " "))
	return nil, nil
}

// Run implements Procs: it records the command line.
func (r *Recorder) Run(_ context.Context, c Cmd, _ *os.File) error {
	r.add("exec", c.Path, strings.Join(c.Args, " "))
	return nil
}

type recordedProcess struct {
	r    *Recorder
	path string
	once sync.Once
	done chan struct{}
}

func (p *recordedProcess) Pid() int { return 0 }

func (p *recordedProcess) Signal(sig syscall.Signal) error {
	p.r.add("signal", p.path, sig.String())
	p.once.Do(func() { close(p.done) })
	return nil
}

func (p *recordedProcess) Done() <-chan struct{} { return p.done }

func (p *recordedProcess) Wait() error { <-p.done; return nil }

// MountFlags renders mount flags for people.
func MountFlags(flags uintptr) string {
	names := []struct {
		bit  uintptr
		name string
	}{{syscall.MS_BIND, "bind"}, {syscall.MS_REC, "rec"}, {syscall.MS_PRIVATE, "private"}, {syscall.MS_UNBINDABLE, "unbindable"}, {syscall.MS_SLAVE, "slave"}, {syscall.MS_SHARED, "shared"}, {syscall.MS_RDONLY, "ro"}}
	var out []string
	for _, n := range names {
		if flags&n.bit != 0 {
			out = append(out, n.name)
			flags &^= n.bit
		}
	}
	if flags != 0 {
		out = append(out, fmt.Sprintf("%#x", flags))
	}
	if len(out) == 0 {
		return "0"
	}
	return strings.Join(out, ",")
}
