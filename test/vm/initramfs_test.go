//go:build vmtest

package vm

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
)

// Mode bits of a newc cpio entry (as in stat(2)).
const (
	modeDir     = 0o040000
	modeFile    = 0o100000
	modeSymlink = 0o120000
	modeChar    = 0o020000
)

// entry is one file of the guest's root filesystem.
type entry struct {
	mode         uint32 // type and permission bits
	data         []byte // contents (files) or target (symlinks), unless src is set
	src          string // a host file whose contents to use
	major, minor uint32 // device numbers (character devices)
}

// rootfs is an initramfs under construction: paths are relative to / ("bin/busybox").
type rootfs struct {
	entries map[string]entry
}

func newRootfs() *rootfs { return &rootfs{entries: map[string]entry{}} }

func clean(p string) string { return strings.TrimPrefix(path.Clean("/"+p), "/") }

func (r *rootfs) dir(p string) { r.entries[clean(p)] = entry{mode: modeDir | 0o755} }

func (r *rootfs) file(p string, perm uint32, src string) {
	r.entries[clean(p)] = entry{mode: modeFile | perm, src: src}
}

func (r *rootfs) bytes(p string, perm uint32, data []byte) {
	r.entries[clean(p)] = entry{mode: modeFile | perm, data: data}
}

func (r *rootfs) symlink(p, target string) {
	r.entries[clean(p)] = entry{mode: modeSymlink | 0o777, data: []byte(target)}
}

func (r *rootfs) chardev(p string, perm, major, minor uint32) {
	r.entries[clean(p)] = entry{mode: modeChar | perm, major: major, minor: minor}
}

// has reports whether p is already an entry.
func (r *rootfs) has(p string) bool {
	_, ok := r.entries[clean(p)]
	return ok
}

// writeFile writes the archive to file in the "newc" cpio format the kernel unpacks, parents
// before children, uncompressed (the kernel accepts that, and it is the fastest to unpack).
func (r *rootfs) writeFile(file string) (int64, error) {
	f, err := os.Create(file)
	if err != nil {
		return 0, err
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	cw := &cpioWriter{w: bw}
	werr := r.write(cw)
	if err := bw.Flush(); werr == nil {
		werr = err
	}
	if err := f.Close(); werr == nil {
		werr = err
	}
	return cw.n, werr
}

func (r *rootfs) write(cw *cpioWriter) error {
	all := map[string]entry{}
	for p, e := range r.entries {
		all[p] = e
		for d := path.Dir(p); d != "." && d != "/"; d = path.Dir(d) {
			if _, ok := all[d]; !ok {
				if _, ok := r.entries[d]; !ok {
					all[d] = entry{mode: modeDir | 0o755}
				}
			}
		}
	}
	names := make([]string, 0, len(all))
	for p := range all {
		names = append(names, p)
	}
	sort.Strings(names) // "a" sorts before "a/b"
	for _, p := range names {
		e := all[p]
		data := e.data
		if e.src != "" {
			b, err := os.ReadFile(e.src)
			if err != nil {
				return fmt.Errorf("initramfs %s: %w", p, err)
			}
			data = b
		}
		if err := cw.add(p, e, data); err != nil {
			return err
		}
	}
	return cw.add("TRAILER!!!", entry{}, nil)
}

// cpioWriter writes newc ("070701") records.
type cpioWriter struct {
	w   io.Writer
	n   int64
	ino uint32
	err error
}

func (c *cpioWriter) put(b []byte) {
	if c.err != nil {
		return
	}
	n, err := c.w.Write(b)
	c.n += int64(n)
	c.err = err
}

func (c *cpioWriter) pad() {
	if r := c.n % 4; r != 0 {
		c.put(make([]byte, 4-r))
	}
}

func (c *cpioWriter) add(name string, e entry, data []byte) error {
	c.ino++
	nlink := uint32(1)
	if e.mode&0o170000 == modeDir {
		nlink = 2
	}
	if name == "TRAILER!!!" {
		c.ino, nlink = 0, 1
	}
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, e.mode, 0, 0, nlink, 0, len(data), 0, 0, e.major, e.minor, len(name)+1, 0)
	c.put([]byte(hdr))
	c.put(append([]byte(name), 0))
	c.pad()
	c.put(data)
	c.pad()
	return c.err
}
