package modfile

import (
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"strings"
)

// maxSectionSize bounds how much of one ELF section Info and ReadSymbols read.
// Real .modinfo sections are a few KiB; symbol string sections of the largest
// modules are a few MiB.
const maxSectionSize = 64 << 20

// ErrNoModinfo is returned (wrapped) by Info for an ELF file without a
// .modinfo section, which therefore is not a kernel module.
var ErrNoModinfo = errors.New("no .modinfo section")

// Field is one key=value entry of the .modinfo section.
type Field struct {
	Key   string
	Value string
}

// ParamInfo describes one module parameter, from the parm= and parmtype=
// entries of .modinfo.
type ParamInfo struct {
	// Name is the parameter name.
	Name string
	// Type is the parameter type from parmtype=, such as "int", "uint",
	// "charp", "bool" or "array of int"; empty when not recorded.
	Type string
	// Description is the text of MODULE_PARM_DESC from parm=; empty when not
	// recorded.
	Description string
}

// ModInfo is the parsed .modinfo section of a kernel module.
//
// For single-valued keys (name, version, vermagic, depends, license,
// srcversion, description) the first entry wins, as with the kernel's own
// lookup. All entries, in section order, are in Fields.
type ModInfo struct {
	// Name is the module name (name=), as the kernel will register it.
	Name string
	// Version is MODULE_VERSION (version=).
	Version string
	// Vermagic is the kernel version magic string (vermagic=).
	Vermagic string
	// Depends lists the modules this one needs (depends=, comma separated);
	// nil when there are none.
	Depends []string
	// License is MODULE_LICENSE (license=).
	License string
	// SrcVersion is the checksum of the module's sources (srcversion=).
	SrcVersion string
	// Description is MODULE_DESCRIPTION (description=).
	Description string
	// Firmware lists the firmware files the module declares (firmware=), in
	// order; nil when none.
	Firmware []string
	// Params maps each parameter name to its type and description. A name
	// that appears more than once keeps the last type and description given.
	// Nil when the module declares no parameters.
	Params map[string]ParamInfo
	// Fields holds every key=value entry, in section order.
	Fields []Field
}

// Get returns the value of the first entry with the given key.
func (mi ModInfo) Get(key string) (string, bool) {
	for _, f := range mi.Fields {
		if f.Key == key {
			return f.Value, true
		}
	}
	return "", false
}

// Values returns the values of every entry with the given key, in order (for
// example all alias= entries); nil when there is none.
func (mi ModInfo) Values(key string) []string {
	var vs []string
	for _, f := range mi.Fields {
		if f.Key == key {
			vs = append(vs, f.Value)
		}
	}
	return vs
}

// ParseModinfo parses the raw content of a .modinfo section: NUL-separated
// key=value strings. Empty strings (alignment padding) are skipped, and so
// are strings without '=' or with an empty key, which the kernel's lookup
// never matches either. It accepts any input.
func ParseModinfo(section []byte) ModInfo {
	var mi ModInfo
	seen := map[string]bool{}
	first := func(key string) bool {
		if seen[key] {
			return false
		}
		seen[key] = true
		return true
	}
	for entry := range bytes.SplitSeq(section, []byte{0}) {
		key, value, ok := strings.Cut(string(entry), "=")
		if !ok || key == "" {
			continue
		}
		mi.Fields = append(mi.Fields, Field{Key: key, Value: value})
		switch key {
		case "name":
			if first(key) {
				mi.Name = value
			}
		case "version":
			if first(key) {
				mi.Version = value
			}
		case "vermagic":
			if first(key) {
				mi.Vermagic = value
			}
		case "depends":
			if first(key) {
				mi.Depends = splitDepends(value)
			}
		case "license":
			if first(key) {
				mi.License = value
			}
		case "srcversion":
			if first(key) {
				mi.SrcVersion = value
			}
		case "description":
			if first(key) {
				mi.Description = value
			}
		case "firmware":
			mi.Firmware = append(mi.Firmware, value)
		case "parm", "parmtype":
			name, text, _ := strings.Cut(value, ":")
			if name == "" {
				continue
			}
			if mi.Params == nil {
				mi.Params = map[string]ParamInfo{}
			}
			p := mi.Params[name]
			p.Name = name
			if key == "parm" {
				p.Description = text
			} else {
				p.Type = text
			}
			mi.Params[name] = p
		}
	}
	return mi
}

// splitDepends splits the comma-separated depends= value, dropping empty
// items and surrounding spaces; nil when nothing is left.
func splitDepends(v string) []string {
	var deps []string
	for d := range strings.SplitSeq(v, ",") {
		if d = strings.TrimSpace(d); d != "" {
			deps = append(deps, d)
		}
	}
	return deps
}

// Info parses the ELF image of a kernel module and returns its .modinfo
// section. It never panics, whatever data holds.
func Info(data []byte) (mi ModInfo, err error) {
	f, err := openELF(data)
	if err != nil {
		return ModInfo{}, err
	}
	defer func() {
		// debug/elf is meant to return errors on malformed input; this is a
		// backstop so that a crafted file can never crash the agent.
		if r := recover(); r != nil {
			mi, err = ModInfo{}, fmt.Errorf("%w: %v", ErrMalformed, r)
		}
	}()
	s := f.Section(".modinfo")
	if s == nil {
		return ModInfo{}, fmt.Errorf("%w: not a kernel module", ErrNoModinfo)
	}
	raw, err := sectionData(s)
	if err != nil {
		return ModInfo{}, err
	}
	return ParseModinfo(raw), nil
}

// openELF parses the ELF header and section table of data, converting a
// panic inside debug/elf into an error.
func openELF(data []byte) (f *elf.File, err error) {
	if err := checkELF(data); err != nil {
		return nil, err
	}
	defer func() {
		if r := recover(); r != nil {
			f, err = nil, fmt.Errorf("%w: %v", ErrMalformed, r)
		}
	}()
	f, err = elf.NewFile(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return f, nil
}

// sectionData reads the content of s, at most maxSectionSize bytes.
func sectionData(s *elf.Section) ([]byte, error) {
	if s.Type == elf.SHT_NOBITS {
		return nil, nil
	}
	if s.Size > maxSectionSize {
		return nil, fmt.Errorf("section %s is %d bytes, more than the %d allowed", s.Name, s.Size, maxSectionSize)
	}
	b, err := io.ReadAll(io.LimitReader(s.Open(), maxSectionSize+1))
	if err != nil {
		return nil, fmt.Errorf("read section %s: %w", s.Name, err)
	}
	if len(b) > maxSectionSize {
		return nil, fmt.Errorf("section %s is more than the %d bytes allowed", s.Name, maxSectionSize)
	}
	return b, nil
}
