// Package host is the agent's only door to the machine: the filesystem roots every path is resolved
// under, and the small interfaces through which every side effect (module load and unload, mounts,
// device nodes, processes, file writes) passes. Each interface has a real Linux implementation, a
// recording one for --dry-run, and stateful fakes in package hosttest. Processes (Procs) are the
// one seam whose real implementation lives elsewhere: the agent's reaper (pkg/daemon), plugged
// into Host by pkg/cli, since it must be the only code in the process that waits for children;
// OSExec (os/exec) serves the build-time subcommands, which run no reaper.
//
// Three kinds of writes stay outside, each for a reason: a package that owns one crash-safe store
// writes it itself (pkg/cache's module cache: temporary directory, fsync, rename; pkg/lock's flock
// on the node lock; pkg/daemon's stale pid files), and none of them writes in a dry run; the
// compile and link path writes only under the run's private work directory, its own scratch
// output, which the run creates and removes; and the build-time subcommands (pkg/cli, pkg/sysext)
// write the output files they are asked for, on a build machine, not a node.
package host

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
)

// Roots are the filesystem roots the agent reads and writes under. Nothing in the agent opens an
// absolute host path except through these, so a test can point the whole agent at a temporary tree.
type Roots struct {
	Root       string // the container's root filesystem ("/")
	HostRoot   string // the host's root filesystem as seen from the container ("/proc/1/root")
	Proc       string // procfs ("/proc")
	Sys        string // sysfs ("/sys")
	Dev        string // devtmpfs ("/dev")
	Run        string // the host-shared run directory ("/run")
	DriversDir string // the operator's configuration directory ("/drivers")
}

// InRoot joins elem under the container root.
func (r Roots) InRoot(elem ...string) string { return join(r.Root, elem) }

// InHost joins elem under the host root.
func (r Roots) InHost(elem ...string) string { return join(r.HostRoot, elem) }

// InProc joins elem under procfs.
func (r Roots) InProc(elem ...string) string { return join(r.Proc, elem) }

// InSys joins elem under sysfs.
func (r Roots) InSys(elem ...string) string { return join(r.Sys, elem) }

// InDev joins elem under /dev.
func (r Roots) InDev(elem ...string) string { return join(r.Dev, elem) }

// InRun joins elem under the run directory.
func (r Roots) InRun(elem ...string) string { return join(r.Run, elem) }

// InDrivers joins elem under the drivers directory.
func (r Roots) InDrivers(elem ...string) string { return join(r.DriversDir, elem) }

func join(root string, elem []string) string {
	return filepath.Join(append([]string{root}, elem...)...)
}

// ModuleImage is one kernel module to load.
type ModuleImage struct {
	Name string // module name as the kernel knows it (underscores), e.g. "nvidia_uvm"
	Path string // the file it comes from
	Data []byte // decompressed image; nil means Path is loaded by file descriptor
	// Compressed says Path is compressed in the format the kernel decompresses itself
	// (/sys/module/compression): finit_module gets MODULE_INIT_COMPRESSED_FILE.
	Compressed bool
	Params     string // parameter string, e.g. "NVreg_EnableGpuFirmware=0 NVreg_X=1"
	// File, when set, is Path already open (a cache entry's module, verified through it):
	// LoadModule loads from this descriptor instead of opening Path again. The caller closes it.
	File *os.File
}

// Kernel loads and unloads kernel modules.
type Kernel interface {
	// LoadModule loads m with finit_module (a plain .ko, or one the kernel decompresses) or
	// init_module (decompressed Data).
	LoadModule(m ModuleImage) error
	// UnloadModule removes the named module without waiting (O_NONBLOCK); EBUSY and EAGAIN
	// are returned as they are.
	UnloadModule(name string) error
}

// Mounter mounts and unmounts filesystems.
type Mounter interface {
	Mount(source, target, fstype string, flags uintptr, data string) error
	Unmount(target string, flags int) error
}

// Mknoder creates device nodes.
type Mknoder interface {
	// Mknod creates a character device node at path with the given permission bits.
	Mknod(path string, perm os.FileMode, major, minor uint32) error
}

// Files writes and removes files in the host-visible trees (run, sys, dev, the container root).
type Files interface {
	// WriteFile replaces path atomically (temporary file and rename) when atomic is true, and
	// writes in place otherwise (sysfs attributes cannot be renamed over).
	WriteFile(path string, data []byte, perm os.FileMode, atomic bool) error
	// MkdirAll creates path and its parents.
	MkdirAll(path string, perm os.FileMode) error
	// Remove removes a file or an empty directory; a missing path is not an error.
	Remove(path string) error
	// RemoveAll removes path and everything under it; a missing path is not an error.
	RemoveAll(path string) error
	// CopyFile replaces dst atomically with a copy of the regular file src, with mode perm: the
	// copy is written beside dst and renamed over it, so no reader sees part of it. It is not
	// synced: after a crash of the node dst may be missing or short. The next start copies
	// the container root's modules again, and the GSP firmware when its size differs; a sync
	// would wait for the disk on every start.
	CopyFile(src, dst string, perm os.FileMode) error
	// Link makes dst a hard link to src; dst must not exist.
	Link(src, dst string) error
	// Touch sets path's access and modification times to now.
	Touch(path string) error
}

// Cmd describes a process to start.
type Cmd struct {
	Path string   // executable
	Args []string // arguments after the program name
	Env  []string // environment; nil inherits the agent's
	Dir  string
}

// Process is a started child process.
type Process interface {
	// Pid is its process ID, which is also its process group ID.
	Pid() int
	// Signal signals its process group; after it has been reaped it returns os.ErrProcessDone.
	Signal(sig syscall.Signal) error
	// Done is closed once it has exited and been reaped.
	Done() <-chan struct{}
	// Wait waits for it to exit and returns its exit error (nil for status 0).
	Wait() error
}

// StartOptions say where a started child's output goes and what happens to its process group.
type StartOptions struct {
	// Stdout and Stderr receive the child's output; nil means /dev/null.
	Stdout, Stderr *os.File
	// KillGroup kills what is left of the child's process group when the child exits, so that
	// nothing it started outlives it. Leave it off for a launcher that forks a daemon into the
	// background.
	KillGroup bool
}

// Procs is the one way the agent runs processes. c.Path is executed as given (no PATH search),
// stdin is /dev/null, a nil c.Env inherits the agent's environment, and every child runs in a
// process group of its own.
//
// The real one is pkg/daemon's Reaper, the one place where the agent waits for children (os/exec
// would race it for exit statuses), plugged in by pkg/cli; OSExec is for the build-time
// subcommands, which run no reaper; the Recorder records the command lines of a dry run; package
// hosttest has a fake that answers from a script.
type Procs interface {
	// Start starts c and returns at once: the daemon runner supervises what it starts. The
	// process is not tied to ctx: stopping it is the caller's decision.
	Start(ctx context.Context, c Cmd, o StartOptions) (Process, error)
	// Output runs c to completion and returns its stdout; its stderr is logged and its last
	// lines are part of the error when it fails.
	Output(ctx context.Context, c Cmd) ([]byte, error)
	// Run runs c to completion, as a build step does, with stdout and stderr both going to out.
	// When ctx ends first, the whole group is killed with SIGKILL and ctx's error is returned
	// (wrapped). A command that exits non-zero gives an error that says how it ended; one that
	// cannot be started gives the start error (ENOENT, ENOEXEC, EACCES, wrapped).
	Run(ctx context.Context, c Cmd, out *os.File) error
}

// Host bundles the roots and every side-effect seam the agent uses.
type Host struct {
	Roots
	Kernel  Kernel
	Mounter Mounter
	Mknoder Mknoder
	Files   Files
	Procs   Procs
}
