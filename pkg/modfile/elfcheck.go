package modfile

import (
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
)

// ErrMalformed is returned (wrapped) for data that starts like an ELF file
// but whose headers are inconsistent or truncated.
var ErrMalformed = errors.New("malformed ELF file")

// checkELF validates the ELF header and section header table of data before
// debug/elf sees them, much as the kernel's module loader does: every
// section header, and the content of every section that occupies file
// space, must lie inside data. This keeps the work and memory of parsing
// bounded by the size of data, whatever the header fields claim.
func checkELF(data []byte) error {
	if !IsELF(data) {
		return ErrNotELF
	}
	if len(data) < 6 {
		return fmt.Errorf("%w: truncated identification", ErrMalformed)
	}
	var bo binary.ByteOrder
	switch elf.Data(data[elf.EI_DATA]) {
	case elf.ELFDATA2LSB:
		bo = binary.LittleEndian
	case elf.ELFDATA2MSB:
		bo = binary.BigEndian
	default:
		return fmt.Errorf("%w: unknown data encoding %d", ErrMalformed, data[elf.EI_DATA])
	}
	var (
		hdrSize, shentWant int
		shoff              uint64
		shentsize, shnum   int
		shstrndx           int
		phoff              uint64
		phentsize, phnum   int
		readSection        func(b []byte) (typ elf.SectionType, off, size uint64)
		u16                = func(off int) int { return int(bo.Uint16(data[off:])) }
	)
	switch elf.Class(data[elf.EI_CLASS]) {
	case elf.ELFCLASS32:
		hdrSize, shentWant = 52, 40
		if len(data) < hdrSize {
			return fmt.Errorf("%w: truncated header", ErrMalformed)
		}
		phoff, shoff = uint64(bo.Uint32(data[28:])), uint64(bo.Uint32(data[32:]))
		phentsize, phnum = u16(42), u16(44)
		shentsize, shnum, shstrndx = u16(46), u16(48), u16(50)
		readSection = func(b []byte) (elf.SectionType, uint64, uint64) {
			return elf.SectionType(bo.Uint32(b[4:])), uint64(bo.Uint32(b[16:])), uint64(bo.Uint32(b[20:]))
		}
	case elf.ELFCLASS64:
		hdrSize, shentWant = 64, 64
		if len(data) < hdrSize {
			return fmt.Errorf("%w: truncated header", ErrMalformed)
		}
		phoff, shoff = bo.Uint64(data[32:]), bo.Uint64(data[40:])
		phentsize, phnum = u16(54), u16(56)
		shentsize, shnum, shstrndx = u16(58), u16(60), u16(62)
		readSection = func(b []byte) (elf.SectionType, uint64, uint64) {
			return elf.SectionType(bo.Uint32(b[4:])), bo.Uint64(b[24:]), bo.Uint64(b[32:])
		}
	default:
		return fmt.Errorf("%w: unknown class %d", ErrMalformed, data[elf.EI_CLASS])
	}
	n := uint64(len(data))
	if phnum > 0 && !inside(phoff, uint64(phnum)*uint64(phentsize), n) {
		return fmt.Errorf("%w: program headers outside the file", ErrMalformed)
	}
	if shnum == 0 {
		return fmt.Errorf("%w: no section headers", ErrMalformed)
	}
	if shentsize != shentWant {
		return fmt.Errorf("%w: section header size %d, want %d", ErrMalformed, shentsize, shentWant)
	}
	if shstrndx >= shnum {
		return fmt.Errorf("%w: section name table index %d out of range", ErrMalformed, shstrndx)
	}
	if !inside(shoff, uint64(shnum)*uint64(shentsize), n) {
		return fmt.Errorf("%w: section headers outside the file", ErrMalformed)
	}
	for i := range shnum {
		hdr := data[shoff+uint64(i*shentsize):]
		typ, off, size := readSection(hdr)
		if typ == elf.SHT_NOBITS || typ == elf.SHT_NULL {
			continue
		}
		if !inside(off, size, n) {
			return fmt.Errorf("%w: section %d outside the file", ErrMalformed, i)
		}
	}
	return nil
}

// inside reports whether [off, off+size) lies within [0, n), without
// overflow.
func inside(off, size, n uint64) bool {
	return off <= n && size <= n-off
}
