package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"syscall"

	"golang.org/x/sys/unix"
)

// Real returns the Host that acts on the running machine.
func Real(r Roots) Host {
	return Host{Roots: r, Kernel: LinuxKernel{}, Mounter: LinuxMounter{}, Mknoder: LinuxMknoder{}, Files: OSFiles{}, Exec: OSExec{}}
}

// LinuxKernel loads modules with finit_module/init_module and removes them with delete_module.
type LinuxKernel struct{}

// LoadModule implements Kernel.
func (LinuxKernel) LoadModule(m ModuleImage) error {
	if m.Data != nil {
		return unix.InitModule(m.Data, m.Params)
	}
	flags := 0
	if m.Compressed {
		flags = unix.MODULE_INIT_COMPRESSED_FILE
	}
	if m.File != nil { // the kernel reads it from the start, whatever the file offset
		return unix.FinitModule(int(m.File.Fd()), m.Params, flags)
	}
	f, err := os.Open(m.Path)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.FinitModule(int(f.Fd()), m.Params, flags)
}

// UnloadModule implements Kernel.
func (LinuxKernel) UnloadModule(name string) error {
	return unix.DeleteModule(name, unix.O_NONBLOCK)
}

// LinuxMounter calls mount(2) and umount2(2).
type LinuxMounter struct{}

// Mount implements Mounter.
func (LinuxMounter) Mount(source, target, fstype string, flags uintptr, data string) error {
	return unix.Mount(source, target, fstype, flags, data)
}

// Unmount implements Mounter.
func (LinuxMounter) Unmount(target string, flags int) error { return unix.Unmount(target, flags) }

// LinuxMknoder calls mknod(2).
type LinuxMknoder struct{}

// Mknod implements Mknoder. The mode is applied exactly, whatever the umask.
func (LinuxMknoder) Mknod(path string, perm os.FileMode, major, minor uint32) error {
	if err := unix.Mknod(path, unix.S_IFCHR|uint32(perm.Perm()), int(unix.Mkdev(major, minor))); err != nil {
		return err
	}
	return os.Chmod(path, perm.Perm())
}

// OSExec starts real processes, each in its own process group so a whole tree can be signalled.
type OSExec struct{}

// Start implements Execer. The process is not tied to ctx: stopping it is the caller's decision.
func (OSExec) Start(_ context.Context, c Cmd) (Process, error) {
	cmd := exec.Command(c.Path, c.Args...)
	cmd.Env, cmd.Dir = c.Env, c.Dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", c.Path, err)
	}
	return osProcess{cmd}, nil
}

type osProcess struct{ cmd *exec.Cmd }

func (p osProcess) Pid() int { return p.cmd.Process.Pid }

// Signal signals the whole process group.
func (p osProcess) Signal(sig syscall.Signal) error { return unix.Kill(-p.cmd.Process.Pid, sig) }

func (p osProcess) Wait() error { return p.cmd.Wait() }

// Run implements Runner with os/exec. After the command exits, what is left of its process group
// is killed too, so nothing it started outlives it.
func (OSExec) Run(ctx context.Context, c Cmd, out *os.File) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("run %s: %w", c.Path, err)
	}
	cmd := exec.Command(c.Path, c.Args...)
	cmd.Env, cmd.Dir = c.Env, c.Dir
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", c.Path, err)
	}
	pgid := cmd.Process.Pid
	exited := make(chan struct{})
	watcher := make(chan bool, 1) // whether the watcher killed the group for ctx
	go func() {
		select {
		case <-ctx.Done():
			_ = unix.Kill(-pgid, unix.SIGKILL)
			watcher <- true
		case <-exited:
			watcher <- false
		}
	}()
	// Wait for the leader to exit without reaping it: while it is a zombie its group ID cannot be
	// reused, so what is left of the group can be killed safely before cmd.Wait reaps it.
	var info unix.Siginfo
	for {
		if err := unix.Waitid(unix.P_PID, pgid, &info, unix.WEXITED|unix.WNOWAIT, nil); !errors.Is(err, unix.EINTR) {
			break
		}
	}
	_ = unix.Kill(-pgid, unix.SIGKILL)
	err := cmd.Wait()
	close(exited)
	killed := <-watcher
	if killed {
		return fmt.Errorf("run %s: %w", c.Path, ctx.Err())
	}
	if err != nil {
		return fmt.Errorf("%s: %w", c.Path, err)
	}
	return nil
}

// LowerThreadPriority locks the calling goroutine to its OS thread for the rest of the
// goroutine's life and gives that thread the lowest CPU priority (nice 19; Linux keeps a nice
// value per thread). Work that must end before Ready but is not on the way to it (storing new
// modules in the cache) then takes the CPU the load leaves idle instead of the load's. In a pod
// the scheduler weighs nice values only among the threads of the pod's own cgroup, so other
// workloads on the node do not starve it any more than they would the agent. The
// goroutine must not call runtime.UnlockOSThread: the thread then ends with it, and its
// priority with it, so no other goroutine ever runs at that priority.
//
// Nice only decides between threads that want a CPU; Go code runs only on a thread that holds
// one of GOMAXPROCS Ps. With one P (one CPU, or a CPU limit of one) the locked thread takes the
// only P for each of its turns in the Go scheduler, nice or not, and the other goroutines wait
// for it: so GOMAXPROCS is raised to at least 2, leaving a P for the rest of the agent whenever
// the lowered thread runs Go code, and the kernel then prefers the other thread as nice says.
func LowerThreadPriority() error {
	if runtime.GOMAXPROCS(0) < 2 {
		runtime.GOMAXPROCS(2)
	}
	runtime.LockOSThread()
	if err := unix.Setpriority(unix.PRIO_PROCESS, 0, 19); err != nil {
		return fmt.Errorf("lower the thread's priority: %w", err)
	}
	return nil
}
