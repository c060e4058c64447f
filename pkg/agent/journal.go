package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/driver-agent/driver-agent/pkg/devices"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/modules"
)

// The journal is how a new agent adopts what a killed one changed on the node. An agent that
// dies by SIGKILL runs no teardown: the prerequisite modules it loaded, the firmware search path it
// set, the firmware files and device nodes it made and the root it mounted stay. The next agent
// would take them for the host's, keep them, and leave them after its own teardown. So before
// each such change an agent writes, atomically, what it is about to do to <run>/nvidia/driver-
// agent/journal.json (host-visible); the next agent, once it holds the lock (so the writer is
// dead), reads it, keeps the entries whose change is still there, and undoes them at its
// teardown as if it had made them. After its teardown it writes what is still there, or removes
// the file when nothing is. A journal that does not parse, or names anything outside what an
// agent changes, is reported and ignored: it never makes the agent unload a module or remove a
// file on its word.

// journalFormat is the journal's format number.
const journalFormat = 1

// journalLimit bounds the journal's size when it is read.
const journalLimit = 64 << 10

// Journal is what agents on this node changed and no teardown has undone yet, each list in the
// order it was done. It is written before each change, so an entry may name a change that never
// happened; the reader checks each against the node.
type Journal struct {
	Format int `json:"format"`
	PID    int `json:"pid"` // the agent that wrote it last
	// Prerequisites are modules loaded that were not loaded before, in load order.
	Prerequisites []string `json:"prerequisites,omitempty"`
	// FirmwarePathBefore is the firmware search path's value before an agent set it.
	FirmwarePathBefore *string `json:"firmwarePathBefore,omitempty"`
	// FirmwareDirs and FirmwareFiles are what the GSP firmware copy made, parents first.
	FirmwareDirs  []string `json:"firmwareDirs,omitempty"`
	FirmwareFiles []string `json:"firmwareFiles,omitempty"`
	// Devices are device nodes made where there were none.
	Devices []string `json:"devices,omitempty"`
	// Mounts are mount points of the shared driver root.
	Mounts []string `json:"mounts,omitempty"`
}

// empty reports whether j names no change.
func (j *Journal) empty() bool {
	return len(j.Prerequisites) == 0 && j.FirmwarePathBefore == nil && len(j.FirmwareDirs) == 0 &&
		len(j.FirmwareFiles) == 0 && len(j.Devices) == 0 && len(j.Mounts) == 0
}

// ParseJournal reads a journal: one JSON object of the current format with no unknown fields,
// module names that are valid (and not NVIDIA's, which the agent finds by name anyway), and
// clean absolute paths.
func ParseJournal(r io.Reader) (*Journal, error) {
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	var j Journal
	if err := dec.Decode(&j); err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("journal: data after the object")
	}
	if j.Format != journalFormat {
		return nil, fmt.Errorf("journal: format %d, want %d", j.Format, journalFormat)
	}
	if j.PID < 0 {
		return nil, fmt.Errorf("journal: pid %d", j.PID)
	}
	for _, m := range j.Prerequisites {
		if !kernel.ValidModuleName(m) || m != kernel.Normalize(m) || slices.Contains(NVIDIAModules(), m) {
			return nil, fmt.Errorf("journal: prerequisite %q is not a module the agent loads", m)
		}
	}
	if p := j.FirmwarePathBefore; p != nil && (len(*p) > 4096 || strings.ContainsRune(*p, 0)) {
		return nil, errors.New("journal: firmwarePathBefore is not a search path")
	}
	for _, list := range [][]string{j.FirmwareDirs, j.FirmwareFiles, j.Devices, j.Mounts} {
		for _, p := range list {
			if !filepath.IsAbs(p) || filepath.Clean(p) != p || strings.ContainsRune(p, 0) {
				return nil, fmt.Errorf("journal: %q is not a clean absolute path", p)
			}
		}
	}
	return &j, nil
}

// within checks that every path in j is one the agent makes under its roots: firmware under
// <root>/lib/firmware, device nodes named nvidia* in <dev> or <dev>/nvidia-caps, the mount at
// <run>/nvidia/driver.
func (r *run) within(j *Journal) error {
	fw := r.Host.InRoot("lib/firmware")
	for _, p := range append(slices.Clone(j.FirmwareDirs), j.FirmwareFiles...) {
		if p != fw && !strings.HasPrefix(p, fw+"/") {
			return fmt.Errorf("journal: %s is not under %s", p, fw)
		}
	}
	for _, p := range j.Devices {
		if d := filepath.Dir(p); (d != r.Host.Dev && d != r.Host.InDev("nvidia-caps")) || !strings.HasPrefix(filepath.Base(p), "nvidia") {
			return fmt.Errorf("journal: %s is not an NVIDIA device node in %s", p, r.Host.Dev)
		}
	}
	for _, p := range j.Mounts {
		if p != r.Host.InRun("nvidia/driver") {
			return fmt.Errorf("journal: %s is not the driver root's mount point", p)
		}
	}
	return nil
}

// journal is a run's side of the journal file: what is outstanding, its own changes and those it
// adopted.
type journal struct {
	mu       sync.Mutex
	j        Journal
	firmware bool // the firmware search path was adopted from an earlier agent
}

func (r *run) journalPath() string { return r.Host.InRun("nvidia/driver-agent/journal.json") }

// adoptJournal reads an earlier agent's journal (the lock is held, so that agent is dead), keeps
// what is still on the node, and registers its undo. It changes nothing on the node itself.
func (r *run) adoptJournal() {
	path := r.journalPath()
	data, err := kernel.ReadLimit(path, journalLimit)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	var j *Journal
	if err == nil {
		j, err = ParseJournal(bytes.NewReader(data))
	}
	if err == nil {
		err = r.within(j)
	}
	if err != nil {
		r.Log.Warn("ignoring an earlier agent's journal; what it changed on the node is left as it is", "path", path, "error", err)
		return
	}
	left := r.stillThere(*j)
	if left.empty() {
		return
	}
	r.notes = append(r.notes, fmt.Sprintf("adopts what the agent %d left (%s) and undoes it at teardown: %s", j.PID, path, describe(left)))
	r.Log.Info("adopting what an earlier agent left; this run undoes it at teardown", "pid", j.PID, "journal", path, "left", describe(left))
	r.jr.mu.Lock()
	r.jr.j = left
	r.jr.firmware = left.FirmwarePathBefore != nil
	r.jr.mu.Unlock()
	r.pushAdopted(left)
}

// describe lists a journal's entries for a log line.
func describe(j Journal) string {
	var parts []string
	add := func(what string, list []string) {
		if len(list) > 0 {
			parts = append(parts, what+" "+strings.Join(list, " "))
		}
	}
	add("prerequisites", j.Prerequisites)
	if j.FirmwarePathBefore != nil {
		parts = append(parts, fmt.Sprintf("firmware search path (was %q)", strings.TrimSpace(*j.FirmwarePathBefore)))
	}
	add("firmware", j.FirmwareFiles)
	add("devices", j.Devices)
	add("mounts", j.Mounts)
	return strings.Join(parts, "; ")
}

// stillThere keeps the entries of j whose change is still on the node.
func (r *run) stillThere(j Journal) Journal {
	out := Journal{Format: journalFormat, PID: j.PID}
	if mods, err := kernel.Loaded(r.Host.Proc); err == nil { // unreadable: none is trusted as ours
		loaded := map[string]bool{}
		for _, m := range mods {
			loaded[m.Name] = true
		}
		out.Prerequisites = slices.DeleteFunc(slices.Clone(j.Prerequisites), func(m string) bool { return !loaded[m] })
	}
	if j.FirmwarePathBefore != nil && r.firmwarePathIsOurs() {
		out.FirmwarePathBefore = j.FirmwarePathBefore
	}
	exists := func(p string) bool { _, err := os.Lstat(p); return err == nil }
	out.FirmwareDirs = slices.DeleteFunc(slices.Clone(j.FirmwareDirs), func(p string) bool { return !exists(p) })
	out.FirmwareFiles = slices.DeleteFunc(slices.Clone(j.FirmwareFiles), func(p string) bool { return !exists(p) })
	out.Devices = slices.DeleteFunc(slices.Clone(j.Devices), func(p string) bool { return !exists(p) })
	out.Mounts = slices.DeleteFunc(slices.Clone(j.Mounts), func(p string) bool {
		mounted, err := kernel.IsMountPoint(r.Host.Proc, p)
		return err != nil || !mounted
	})
	return out
}

// firmwarePathIsOurs reports whether the firmware search path is the one agents set.
func (r *run) firmwarePathIsOurs() bool {
	cur, err := os.ReadFile(r.Host.InSys("module/firmware_class/parameters/path"))
	return err == nil && strings.TrimSpace(string(cur)) == firmwareSearchPath
}

// nvidiaLoaded reports whether the nvidia module is in the kernel.
func (r *run) nvidiaLoaded() bool {
	_, err := os.Stat(r.Host.InSys("module/nvidia"))
	return err == nil
}

// pushAdopted registers the undo of an earlier agent's changes. They were made before this
// run's, so they are undone after its own: the mount first, then, once nvidia is gone, the
// device nodes and firmware, the firmware search path, and the prerequisites last. While nvidia
// stays loaded (in use) all but the mount stay, and the journal keeps them for the next agent.
func (r *run) pushAdopted(j Journal) {
	if len(j.Prerequisites) > 0 {
		r.push("adopted", func(context.Context) error {
			if r.nvidiaLoaded() {
				r.Log.Info("nvidia is still loaded; leaving the prerequisite modules an earlier agent loaded", "modules", j.Prerequisites)
				return nil
			}
			for i := len(j.Prerequisites) - 1; i >= 0; i-- {
				if err := r.Host.Kernel.UnloadModule(j.Prerequisites[i]); err != nil {
					r.Log.Info("leaving prerequisite module loaded", "module", j.Prerequisites[i], "loaded_by", "an earlier agent", "reason", err)
				}
			}
			return nil
		})
	}
	if j.FirmwarePathBefore != nil {
		before := []byte(*j.FirmwarePathBefore)
		r.push("adopted", func(context.Context) error {
			if !r.firmwarePathIsOurs() || r.nvidiaLoaded() {
				return nil
			}
			return r.Host.Files.WriteFile(r.Host.InSys("module/firmware_class/parameters/path"), before, 0o644, false)
		})
	}
	if files := append(slices.Clone(j.FirmwareFiles), j.Devices...); len(files) > 0 || len(j.FirmwareDirs) > 0 {
		r.push("adopted", func(context.Context) error {
			if r.nvidiaLoaded() {
				r.Log.Info("nvidia is still loaded; leaving the device nodes and firmware an earlier agent made", "files", files)
				return nil
			}
			var errs []error
			for _, p := range files {
				errs = append(errs, r.Host.Files.Remove(p))
			}
			for i := len(j.FirmwareDirs) - 1; i >= 0; i-- {
				errs = append(errs, host.RemoveIfEmpty(r.Host.Files, j.FirmwareDirs[i]))
			}
			return errors.Join(errs...)
		})
	}
	for _, target := range j.Mounts {
		r.push("adopted", func(context.Context) error {
			if mounted, err := kernel.IsMountPoint(r.Host.Proc, target); err != nil || !mounted {
				return err
			}
			r.Log.Info("Unmounting the NVIDIA driver rootfs an earlier agent mounted...", "target", target)
			return r.Host.Mounter.Unmount(target, unix.MNT_DETACH)
		})
	}
}

// record adds a change to the journal and writes it before the change is made; the change must
// not be made when this fails.
func (r *run) record(add func(j *Journal)) error {
	r.jr.mu.Lock()
	defer r.jr.mu.Unlock()
	next := r.jr.j
	add(&next)
	next.Format, next.PID = journalFormat, os.Getpid()
	if err := r.writeJournal(next); err != nil {
		return err
	}
	r.jr.j = next
	return nil
}

func (r *run) writeJournal(j Journal) error {
	data, err := json.MarshalIndent(j, "", "  ")
	if err != nil {
		return err
	}
	path := r.journalPath()
	if err := r.own.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	if err := r.own.WriteFile(path, append(data, '\n'), 0o644, true); err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	return nil
}

// appendNew appends to list the items it does not hold yet.
func appendNew(list []string, items ...string) []string {
	for _, it := range items {
		if !slices.Contains(list, it) {
			list = append(list, it)
		}
	}
	return list
}

// recordPrerequisites notes the prerequisite modules about to be loaded.
func (r *run) recordPrerequisites(names []string) error {
	for i, n := range names {
		names[i] = kernel.Normalize(n)
	}
	return r.record(func(j *Journal) { j.Prerequisites = appendNew(j.Prerequisites, names...) })
}

// recordFirmwarePath notes the firmware search path's value before it is set.
func (r *run) recordFirmwarePath(before []byte) error {
	return r.record(func(j *Journal) {
		if j.FirmwarePathBefore == nil { // an earlier value is the older one
			s := string(before)
			j.FirmwarePathBefore = &s
		}
	})
}

// recordFirmware notes the directories and files the GSP firmware copy is about to make. Of the
// directories, those above <root>/lib/firmware are left out: a next agent removes only what is
// under it.
func (r *run) recordFirmware(dirs, files []string) error {
	fw := r.Host.InRoot("lib/firmware")
	dirs = slices.DeleteFunc(dirs, func(d string) bool { return d != fw && !strings.HasPrefix(d, fw+"/") })
	return r.record(func(j *Journal) {
		j.FirmwareDirs = appendNew(j.FirmwareDirs, dirs...)
		j.FirmwareFiles = appendNew(j.FirmwareFiles, files...)
	})
}

// recordDevices notes the device nodes about to be made where there are none.
func (r *run) recordDevices(paths []string) error {
	var missing []string
	for _, p := range paths {
		if _, err := os.Lstat(p); errors.Is(err, fs.ErrNotExist) {
			missing = append(missing, p)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	return r.record(func(j *Journal) { j.Devices = appendNew(j.Devices, missing...) })
}

// recordMount notes the driver root's mount about to be made.
func (r *run) recordMount(target string) error {
	return r.record(func(j *Journal) { j.Mounts = appendNew(j.Mounts, target) })
}

// closeJournal runs after the teardown: the journal keeps what is still on the node (a driver in
// use, a prerequisite something else holds) for the next agent, and goes when nothing is.
// A dry run never gets here: it prints the plan after its teardown instead.
func (r *run) closeJournal() {
	r.jr.mu.Lock()
	defer r.jr.mu.Unlock()
	left := r.stillThere(r.jr.j)
	if left.empty() {
		if err := r.own.Remove(r.journalPath()); err != nil {
			r.Log.Warn("could not remove the journal", "path", r.journalPath(), "error", err)
			return
		}
		// status.json went first, while the journal was still beside it; the directory goes
		// now, unless something is left in it (a failed run's status, the module cache).
		if err := host.RemoveIfEmpty(r.own, filepath.Dir(r.journalPath())); err != nil {
			r.Log.Warn("could not remove the agent's directory", "path", filepath.Dir(r.journalPath()), "error", err)
		}
		return
	}
	left.PID = os.Getpid()
	r.Log.Info("left on the node for the next agent to undo", "journal", r.journalPath(), "left", describe(left))
	if err := r.writeJournal(left); err != nil {
		r.Log.Warn("could not write the journal", "error", err)
	}
}

// missingDirs lists dir and its parents that do not exist, parents first.
func missingDirs(dir string) []string {
	var missing []string
	for d := dir; d != filepath.Dir(d); d = filepath.Dir(d) {
		if _, err := os.Stat(d); err == nil {
			break
		}
		missing = append(missing, d)
	}
	slices.Reverse(missing)
	return missing
}

// fileNames are the module names of files.
func fileNames(files []modules.File) []string {
	var names []string
	for _, f := range files {
		names = append(names, f.Image.Name)
	}
	return names
}

// nodePaths are the paths of nodes.
func nodePaths(nodes []devices.Node) []string {
	var paths []string
	for _, n := range nodes {
		paths = append(paths, n.Path)
	}
	return paths
}
