package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/host"
)

// commLen is the longest comm the kernel keeps (TASK_COMM_LEN less the NUL).
const commLen = 15

// errNoProcess says a PID names no process.
var errNoProcess = errors.New("no such process")

// notProgramError says a PID runs another program than the one expected.
type notProgramError struct {
	pid        int
	exe, comm  string
	want       string
	readErrors error
}

func (e *notProgramError) Error() string {
	name := e.exe
	if name == "" {
		name = e.comm
	}
	if name == "" {
		return fmt.Sprintf("pid %d: cannot tell which program it runs (%v), so it is not taken for %s", e.pid, e.readErrors, e.want)
	}
	return fmt.Sprintf("pid %d runs %s, not %s", e.pid, name, e.want)
}

// processIdentity reads the base name of pid's executable and its comm under proc. A deleted
// executable (replaced by an image update) keeps its name.
func processIdentity(proc string, pid int) (exe, comm string, err error) {
	dir := filepath.Join(proc, strconv.Itoa(pid))
	link, lerr := os.Readlink(filepath.Join(dir, "exe"))
	if lerr == nil {
		exe = filepath.Base(strings.TrimSuffix(link, " (deleted)"))
	}
	data, cerr := os.ReadFile(filepath.Join(dir, "comm"))
	if cerr == nil {
		comm = strings.TrimRight(string(data), "\n")
	}
	if lerr != nil && cerr != nil {
		err = errors.Join(lerr, cerr)
	}
	return exe, comm, err
}

// isProgram reports whether a process with this executable base name or comm runs program.
func isProgram(program, exe, comm string) bool {
	if program == "" {
		return false
	}
	if exe != "" && exe == program {
		return true
	}
	want := program
	if len(want) > commLen {
		want = want[:commLen]
	}
	return comm != "" && comm == want
}

// readPIDFile returns the PID in path.
func readPIDFile(path string) (int, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, 32)
	n, err := f.Read(buf)
	if err != nil && n == 0 {
		return 0, fmt.Errorf("read %s: %w", path, err)
	}
	s := strings.TrimSpace(string(buf[:n]))
	pid, err := strconv.Atoi(s)
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("PID file %s: %q is not a PID", path, s)
	}
	return pid, nil
}

// tracked is a daemon that is not the agent's child (or was adopted by it), watched by pidfd.
type tracked struct {
	pid     int
	f       *os.File
	exited  chan struct{}
	watcher chan struct{}
	err     error // set before exited is closed when watching failed
}

// adopt opens a pidfd for pid and checks, under the runner's proc root, that it runs the
// daemon's program. Nothing is ever signalled before this check passes.
func (r *Runner) adopt(pid int) (*tracked, error) {
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if errors.Is(err, unix.ESRCH) {
		return nil, errNoProcess
	}
	if err != nil {
		return nil, fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	exe, comm, rerr := processIdentity(r.opts.Proc, pid)
	if !isProgram(r.spec.Program, exe, comm) {
		unix.Close(fd)
		return nil, &notProgramError{pid: pid, exe: exe, comm: comm, want: r.spec.Program, readErrors: rerr}
	}
	// What was read belongs to the pidfd's process only if that process still exists now.
	if err := unix.PidfdSendSignal(fd, 0, nil, 0); err != nil {
		unix.Close(fd)
		return nil, errNoProcess
	}
	return track(fd, pid)
}

// track watches a pidfd through the runtime's poller: it becomes readable when the process exits.
func track(fd, pid int) (*tracked, error) {
	f := os.NewFile(uintptr(fd), fmt.Sprintf("pidfd %d", pid))
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("watch pid %d: %w", pid, err)
	}
	d := &tracked{pid: pid, f: f, exited: make(chan struct{}), watcher: make(chan struct{})}
	go func() {
		defer close(d.watcher)
		err := rc.Read(func(fd uintptr) bool { return pidfdReadable(int(fd)) })
		if errors.Is(err, os.ErrClosed) {
			return
		}
		if err != nil {
			d.err = fmt.Errorf("watch pid %d: %w", pid, err)
		}
		close(d.exited)
	}()
	return d, nil
}

func pidfdReadable(fd int) bool {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0 && fds[0].Revents != 0
}

// signal sends sig through the pidfd: it cannot reach another process that reused the PID.
func (d *tracked) signal(sig syscall.Signal) error {
	rc, err := d.f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.PidfdSendSignal(int(fd), sig, nil, 0) }); err != nil {
		return err
	}
	if errors.Is(serr, unix.ESRCH) {
		return os.ErrProcessDone
	}
	if serr != nil {
		return fmt.Errorf("signal pid %d: %w", d.pid, serr)
	}
	return nil
}

// describeExit says how the process ended when the agent is its parent (it was adopted as an
// orphan): from the zombie, or from the reaper when it was reaped already; "exited" otherwise.
func (d *tracked) describeExit(procs host.Procs) string {
	if d.err != nil {
		return d.err.Error()
	}
	desc := ""
	if rc, err := d.f.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) {
			if ci, err := peekChild(unix.P_PIDFD, int(fd)); err == nil && ci.pid != 0 {
				desc = ci.describe()
			}
		})
	}
	if desc != "" {
		return desc
	}
	if r, ok := procs.(*Reaper); ok {
		if ws, ok := r.orphanExit(d.pid); ok {
			return describeStatus(ws)
		}
	}
	return "exited"
}

// sweep reaps, when procs is a Reaper, a daemon that exited after it was adopted as an orphan.
func sweep(procs host.Procs) {
	if r, ok := procs.(*Reaper); ok {
		r.sweep()
	}
}

func (d *tracked) close() {
	d.f.Close()
	<-d.watcher
}

// runForking runs one life of a daemon that forks into the background and writes PIDFile. It
// returns why the daemon ended on its own (crash), or nil with the error of stopping it.
func (r *Runner) runForking(ctx context.Context) (crash, stopErr error) {
	if err := r.prepare(); err != nil {
		return err, nil
	}
	if err := r.clearPIDFile(); err != nil {
		return err, nil
	}
	out, err := newCapture(r.log, r.tail)
	if err != nil {
		return fmt.Errorf("start: %w", err), nil
	}
	launcher, err := r.opts.Procs.Start(context.Background(), r.spec.Cmd, host.StartOptions{Stdout: out.stdout, Stderr: out.stderr})
	out.closeWriters()
	if err != nil {
		out.finish(0)
		return err, nil
	}
	defer out.finish(drainTimeout)
	defer killLeft(launcher)
	r.setState(StateStarting, launcher.Pid())
	r.log.Info("started daemon", "pid", launcher.Pid(), "command", r.spec.CommandLine(), "pid_file", r.spec.PIDFile)

	deadline := r.opts.Clock.NewTimer(r.spec.StartTimeout)
	defer deadline.Stop()
	select {
	case <-launcher.Done():
	case <-ctx.Done():
		return nil, errors.Join(r.stopChild(launcher), r.stopFromPIDFile())
	case <-deadline.C():
		err := fmt.Errorf("did not go into the background within %s", r.spec.StartTimeout)
		return errors.Join(err, r.stopChild(launcher), r.stopFromPIDFile()), nil
	}
	if err := launcher.Wait(); err != nil {
		return fmt.Errorf("exited before going into the background: %w", err), nil
	}
	d, err := r.awaitPIDFile(ctx, deadline)
	if errors.Is(err, errCancelled) {
		return nil, r.stopFromPIDFile()
	}
	if err != nil {
		return err, nil
	}
	defer d.close()
	r.setState(StateUp, d.pid)
	r.log.Info("daemon is up", "pid", d.pid)
	select {
	case <-d.exited:
		crash = fmt.Errorf("pid %d %s", d.pid, d.describeExit(r.opts.Procs))
		sweep(r.opts.Procs) // reap it now when it was adopted as an orphan
		return crash, nil
	case <-ctx.Done():
		r.setState(StateStopping, d.pid)
		err := r.terminate(d.pid, d.signal, d.exited)
		sweep(r.opts.Procs)
		return nil, err
	}
}

// awaitPIDFile waits until the PID file names a running process of the daemon's program. It
// checks again whenever something is written in the file's directory (inotify), and every
// ProbeInterval besides (a process to verify may still be starting, or inotify is unavailable).
// The directory is watched only after a first look: a daemon's launcher has mostly written
// the file by the time it exits.
func (r *Runner) awaitPIDFile(ctx context.Context, deadline Timer) (*tracked, error) {
	var w *dirWatch
	defer func() { w.close() }()
	var lastErr error
	warned := false
	for first := true; ; first = false {
		pid, err := readPIDFile(r.spec.PIDFile)
		if err == nil {
			d, aerr := r.adopt(pid)
			if aerr == nil {
				return d, nil
			}
			err = aerr
			var np *notProgramError
			if errors.As(aerr, &np) && !warned {
				warned = true
				r.log.Warn("the PID file names another program; not touching that process, waiting", "pid_file", r.spec.PIDFile, "error", aerr)
			}
		}
		lastErr = err
		if first {
			// Look again at once: the file may have been written before the watch began.
			w = watchDir(filepath.Dir(r.spec.PIDFile), r.log)
			continue
		}
		t := r.opts.Clock.NewTimer(r.spec.ProbeInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, errCancelled
		case <-deadline.C():
			t.Stop()
			return nil, fmt.Errorf("no running %s in %s within %s: %w", r.spec.Program, r.spec.PIDFile, r.spec.StartTimeout, lastErr)
		case <-w.events():
			t.Stop()
		case <-t.C():
		}
	}
}

// dirWatch tells, through inotify, that something in a directory was created, written or
// renamed into it. A nil *dirWatch (no inotify, or the directory cannot be watched) never does.
type dirWatch struct {
	f       *os.File
	changed chan struct{} // one pending notice; more are merged
	done    chan struct{}
}

// watchDir starts watching dir; it returns nil, after a debug record, when it cannot.
func watchDir(dir string, log *slog.Logger) *dirWatch {
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		log.Debug("no inotify; checking the PID file at the probe interval only", "error", err)
		return nil
	}
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_CREATE|unix.IN_MOVED_TO|unix.IN_CLOSE_WRITE|unix.IN_MODIFY); err != nil {
		unix.Close(fd)
		log.Debug("cannot watch the PID file's directory; checking at the probe interval only", "dir", dir, "error", err)
		return nil
	}
	// Non-blocking, so the runtime's poller waits for events and Close ends a pending Read.
	w := &dirWatch{f: os.NewFile(uintptr(fd), "inotify "+dir), changed: make(chan struct{}, 1), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		buf := make([]byte, 4096)
		for {
			if _, err := w.f.Read(buf); err != nil {
				return
			}
			select {
			case w.changed <- struct{}{}:
			default:
			}
		}
	}()
	return w
}

// events returns the channel that receives a notice after changes; nil for a nil watch.
func (w *dirWatch) events() <-chan struct{} {
	if w == nil {
		return nil
	}
	return w.changed
}

func (w *dirWatch) close() {
	if w == nil {
		return
	}
	w.f.Close()
	<-w.done
}

// clearPIDFile handles a PID file left by an earlier run before a start: a process of the
// daemon's program is stopped; any other process is left alone; the file is removed.
func (r *Runner) clearPIDFile() error {
	path := r.spec.PIDFile
	pid, err := readPIDFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		r.log.Warn("removing an unreadable PID file", "pid_file", path, "error", err)
		return removePIDFile(path)
	}
	d, err := r.adopt(pid)
	var np *notProgramError
	switch {
	case err == nil:
		r.log.Warn("stopping the daemon an earlier run left", "pid", pid, "pid_file", path)
		terr := r.terminate(pid, d.signal, d.exited)
		d.close()
		sweep(r.opts.Procs)
		if terr != nil {
			return fmt.Errorf("stop the %s an earlier run left: %w", r.spec.Program, terr)
		}
	case errors.Is(err, errNoProcess):
		r.log.Info("removing a stale PID file: its process is gone", "pid", pid, "pid_file", path)
	case errors.As(err, &np):
		r.log.Warn("removing a stale PID file that names another program; that process is left alone", "pid_file", path, "error", err)
	default:
		r.log.Warn("removing a PID file whose process cannot be verified; that process is left alone", "pid_file", path, "error", err)
	}
	return removePIDFile(path)
}

// stopFromPIDFile stops the daemon a cancelled start may already have put in the background.
func (r *Runner) stopFromPIDFile() error {
	pid, err := readPIDFile(r.spec.PIDFile)
	if err != nil {
		return nil
	}
	d, err := r.adopt(pid)
	if err != nil {
		return nil
	}
	defer d.close()
	r.setState(StateStopping, pid)
	err = r.terminate(pid, d.signal, d.exited)
	sweep(r.opts.Procs)
	return err
}

func removePIDFile(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove stale PID file: %w", err)
	}
	return nil
}
