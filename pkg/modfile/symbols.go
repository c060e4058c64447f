package modfile

import (
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Export is a symbol a module exports to other modules (EXPORT_SYMBOL).
type Export struct {
	// Name is the symbol name.
	Name string
	// GPLOnly is true for EXPORT_SYMBOL_GPL symbols, which only modules with
	// a GPL-compatible license may use.
	GPLOnly bool
	// Namespace is the symbol namespace (EXPORT_SYMBOL_NS), empty for none.
	Namespace string
}

// Undefined is a symbol a module needs from the kernel or another module. A
// missing one makes the load fail with "Unknown symbol" and ENOENT.
type Undefined struct {
	// Name is the symbol name.
	Name string
	// Weak is true for a weak reference, which may stay unresolved.
	Weak bool
}

// SymbolVersion is one entry of the module's symbol version table
// (CONFIG_MODVERSIONS): the CRC of the interface of a symbol the module uses,
// compared by the kernel with the exporter's CRC ("disagrees about version of
// symbol").
type SymbolVersion struct {
	Name string
	CRC  uint32
}

// Symbols lists the symbols of a module that matter for loading.
type Symbols struct {
	// Exports are the symbols the module exports, sorted by name.
	Exports []Export
	// Undefined are the symbols the module imports, sorted by name.
	Undefined []Undefined
	// Versions is the symbol version table, in section order; nil when the
	// module was built without CONFIG_MODVERSIONS.
	Versions []SymbolVersion
}

// ExportNames returns the names of the exported symbols, sorted.
func (s Symbols) ExportNames() []string {
	names := make([]string, 0, len(s.Exports))
	for _, e := range s.Exports {
		names = append(names, e.Name)
	}
	return names
}

// UndefinedNames returns the names of the undefined symbols, sorted.
func (s Symbols) UndefinedNames() []string {
	names := make([]string, 0, len(s.Undefined))
	for _, u := range s.Undefined {
		names = append(names, u.Name)
	}
	return names
}

// ReadSymbols parses the ELF image of a kernel module and returns the symbols
// it exports, the symbols it leaves undefined and its symbol version table.
//
// Exports come from the symbols named __ksymtab_<name>; when the symbol table
// has none, they come from the strings of the __ksymtab_strings section,
// which may then also hold namespace names. It never panics, whatever data
// holds.
func ReadSymbols(data []byte) (s Symbols, err error) {
	f, err := openELF(data)
	if err != nil {
		return Symbols{}, err
	}
	defer func() {
		if r := recover(); r != nil {
			s, err = Symbols{}, fmt.Errorf("%w: %v", ErrMalformed, r)
		}
	}()
	for _, sec := range f.Sections {
		if sec.Type == elf.SHT_SYMTAB && sec.Size > maxSectionSize {
			return Symbols{}, fmt.Errorf("section %s is %d bytes, more than the %d allowed", sec.Name, sec.Size, maxSectionSize)
		}
	}
	syms, err := f.Symbols()
	if err != nil && !errors.Is(err, elf.ErrNoSymbols) {
		return Symbols{}, fmt.Errorf("read symbol table: %w", err)
	}

	var strs []byte
	strSec := f.Section("__ksymtab_strings")
	if strSec != nil {
		if strs, err = sectionData(strSec); err != nil {
			return Symbols{}, err
		}
	}

	namespaces := map[string]string{}
	undef := map[string]bool{} // name → weak
	for _, sym := range syms {
		if sym.Name == "" || elf.ST_TYPE(sym.Info) == elf.STT_SECTION || elf.ST_TYPE(sym.Info) == elf.STT_FILE {
			continue
		}
		bind := elf.ST_BIND(sym.Info)
		if sym.Section == elf.SHN_UNDEF {
			if bind != elf.STB_GLOBAL && bind != elf.STB_WEAK {
				continue
			}
			weak := bind == elf.STB_WEAK
			if w, ok := undef[sym.Name]; ok {
				weak = weak && w
			}
			undef[sym.Name] = weak
			continue
		}
		if name, ok := strings.CutPrefix(sym.Name, "__kstrtabns_"); ok && strSec != nil && sectionIndex(f, sym.Section) == strSec {
			namespaces[name] = cString(strs, sym.Value)
			continue
		}
		name, ok := strings.CutPrefix(sym.Name, "__ksymtab_")
		if !ok || name == "" {
			continue
		}
		e := Export{Name: name}
		if sec := sectionIndex(f, sym.Section); sec != nil {
			e.GPLOnly = sec.Name == "__ksymtab_gpl" || strings.HasPrefix(sec.Name, "___ksymtab_gpl+")
		}
		s.Exports = append(s.Exports, e)
	}
	for i := range s.Exports {
		s.Exports[i].Namespace = namespaces[s.Exports[i].Name]
	}
	if len(s.Exports) == 0 && len(strs) > 0 {
		seen := map[string]bool{}
		for b := range bytes.SplitSeq(strs, []byte{0}) {
			if name := string(b); name != "" && !seen[name] {
				seen[name] = true
				s.Exports = append(s.Exports, Export{Name: name})
			}
		}
	}
	slices.SortFunc(s.Exports, func(a, b Export) int { return strings.Compare(a.Name, b.Name) })
	s.Exports = slices.CompactFunc(s.Exports, func(a, b Export) bool { return a.Name == b.Name })

	for name, weak := range undef {
		s.Undefined = append(s.Undefined, Undefined{Name: name, Weak: weak})
	}
	slices.SortFunc(s.Undefined, func(a, b Undefined) int { return strings.Compare(a.Name, b.Name) })

	s.Versions, err = readVersions(f)
	if err != nil {
		return Symbols{}, err
	}
	return s, nil
}

// sectionIndex returns the section with index i, or nil for a special or
// out-of-range index.
func sectionIndex(f *elf.File, i elf.SectionIndex) *elf.Section {
	if i == elf.SHN_UNDEF || i >= elf.SHN_LORESERVE || int(i) >= len(f.Sections) {
		return nil
	}
	return f.Sections[i]
}

// cString returns the NUL-terminated string at offset off of b, or "" when
// off is out of range.
func cString(b []byte, off uint64) string {
	if off >= uint64(len(b)) {
		return ""
	}
	b = b[off:]
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// modversionEntrySize is sizeof(struct modversion_info): an unsigned long
// CRC followed by the name, 64 bytes in all on every architecture.
const modversionEntrySize = 64

// readVersions reads the __versions section, and the __version_ext_names /
// __version_ext_crcs pair of extended modversions (Linux 6.13+) for names too
// long for the fixed-size table.
func readVersions(f *elf.File) ([]SymbolVersion, error) {
	var vs []SymbolVersion
	if sec := f.Section("__versions"); sec != nil {
		raw, err := sectionData(sec)
		if err != nil {
			return nil, err
		}
		crcSize := 8
		if f.Class == elf.ELFCLASS32 {
			crcSize = 4
		}
		for len(raw) >= modversionEntrySize {
			e := raw[:modversionEntrySize]
			raw = raw[modversionEntrySize:]
			var crc uint64
			if crcSize == 8 {
				crc = f.ByteOrder.Uint64(e[:8])
			} else {
				crc = uint64(f.ByteOrder.Uint32(e[:4]))
			}
			name := cString(e[crcSize:], 0)
			if name == "" {
				continue
			}
			vs = append(vs, SymbolVersion{Name: name, CRC: uint32(crc)})
		}
	}
	namesSec, crcsSec := f.Section("__version_ext_names"), f.Section("__version_ext_crcs")
	if namesSec != nil && crcsSec != nil {
		names, err := sectionData(namesSec)
		if err != nil {
			return nil, err
		}
		crcs, err := sectionData(crcsSec)
		if err != nil {
			return nil, err
		}
		for name := range bytes.SplitSeq(names, []byte{0}) {
			if len(name) == 0 {
				continue
			}
			if len(crcs) < 4 {
				break
			}
			vs = append(vs, SymbolVersion{Name: string(name), CRC: f.ByteOrder.Uint32(crcs[:4])})
			crcs = crcs[4:]
		}
	}
	return vs, nil
}
