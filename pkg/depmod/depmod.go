// Package depmod writes what modprobe reads to find a module and what it depends on, natively:
// modules.dep (busybox's modprobe reads it) and its binary index modules.dep.bin (kmod's
// modprobe reads only that), in the formats depmod writes, for a small set of modules such as the
// NVIDIA ones the agent installs into the shared driver root.
package depmod

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/modfile"
)

// Entry is one line of modules.dep: a module's path, relative to /lib/modules/<kver>, and the
// paths of the modules it needs, those loaded first listed last, as depmod writes them.
type Entry struct {
	Path    string
	Depends []string
}

// Name is the module name modprobe looks the entry up by: the file name without .ko (and a
// compression suffix), dashes made underscores.
func (e Entry) Name() string { return modfile.NameFromPath(e.Path) }

// maxLine bounds one modules.dep line.
const maxLine = 1 << 20

// Parse reads modules.dep. Blank lines are skipped; any other line must be "path:" followed by
// space-separated paths.
func Parse(r io.Reader) ([]Entry, error) {
	var out []Entry
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxLine)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		p, deps, ok := strings.Cut(line, ":")
		if !ok || p == "" || strings.ContainsAny(p, " \t") {
			return nil, fmt.Errorf("modules.dep line %d: want \"path: dependencies\", have %q", n, line)
		}
		out = append(out, Entry{Path: p, Depends: strings.Fields(deps)})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("modules.dep: %w", err)
	}
	return out, nil
}

func (e Entry) line() string {
	if len(e.Depends) == 0 {
		return e.Path + ":"
	}
	return e.Path + ": " + strings.Join(e.Depends, " ")
}

// Dep renders modules.dep.
func Dep(entries []Entry) []byte {
	var b bytes.Buffer
	for _, e := range entries {
		b.WriteString(e.line())
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// The binary index format of kmod (libkmod-index): a header, then a trie whose nodes may carry
// a prefix, children for the characters first..last, and values.
const (
	indexMagic   = 0xB007F457
	indexVersion = 0x00020001
	nodePrefix   = 0x80000000
	nodeValues   = 0x40000000
	nodeChilds   = 0x20000000
	childMax     = 128
)

type value struct {
	priority uint32
	s        string
}

type node struct {
	prefix   string
	children map[byte]*node
	values   []value
}

// DepBin renders modules.dep.bin: each module's name maps to its modules.dep line.
func DepBin(entries []Entry) ([]byte, error) {
	root := &node{children: map[byte]*node{}}
	for i, e := range entries {
		name := e.Name()
		for j := 0; j < len(name); j++ {
			if name[j] == 0 || name[j] >= childMax {
				return nil, fmt.Errorf("modules.dep.bin: module name %q has a byte kmod's index cannot hold", name)
			}
		}
		n := root
		for j := 0; j < len(name); j++ {
			c := n.children[name[j]]
			if c == nil {
				c = &node{children: map[byte]*node{}}
				n.children[name[j]] = c
			}
			n = c
		}
		n.values = append(n.values, value{uint32(i), e.line()})
	}
	compress(root)
	var b bytes.Buffer
	b.Write(make([]byte, 12)) // header, root offset filled in last
	off := write(&b, root)
	hdr := b.Bytes()
	binary.BigEndian.PutUint32(hdr[0:], indexMagic)
	binary.BigEndian.PutUint32(hdr[4:], indexVersion)
	binary.BigEndian.PutUint32(hdr[8:], off)
	return hdr, nil
}

// compress folds chains of nodes without values and with one child into prefixes.
func compress(n *node) {
	for len(n.values) == 0 && len(n.children) == 1 {
		for c, child := range n.children {
			n.prefix += string(c) + child.prefix
			n.children, n.values = child.children, child.values
		}
	}
	for _, c := range n.children {
		compress(c)
	}
}

// write writes n's children and then n, returning n's offset with its flags, as depmod does.
func write(b *bytes.Buffer, n *node) uint32 {
	var keys []byte
	for c := range n.children {
		keys = append(keys, c)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i] < keys[j] })
	var childOff []uint32
	if len(keys) > 0 {
		childOff = make([]uint32, int(keys[len(keys)-1])-int(keys[0])+1)
		for _, c := range keys {
			childOff[int(c)-int(keys[0])] = write(b, n.children[c])
		}
	}
	off := uint32(b.Len())
	if n.prefix != "" {
		b.WriteString(n.prefix)
		b.WriteByte(0)
		off |= nodePrefix
	}
	if len(keys) > 0 {
		b.WriteByte(keys[0])
		b.WriteByte(keys[len(keys)-1])
		for _, o := range childOff {
			binary.Write(b, binary.BigEndian, o)
		}
		off |= nodeChilds
	}
	if len(n.values) > 0 {
		sort.SliceStable(n.values, func(i, j int) bool { return n.values[i].priority < n.values[j].priority })
		binary.Write(b, binary.BigEndian, uint32(len(n.values)))
		for _, v := range n.values {
			binary.Write(b, binary.BigEndian, v.priority)
			b.WriteString(v.s)
			b.WriteByte(0)
		}
		off |= nodeValues
	}
	return off
}
