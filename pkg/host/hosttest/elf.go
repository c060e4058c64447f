package hosttest

import (
	"encoding/binary"
	"strings"
)

// ModuleELF returns a minimal relocatable x86-64 ELF object whose .modinfo section holds fields
// ("name=nvidia", "version=535.309.01", "depends=", ...): enough for the agent's modinfo reader
// and for FakeKernel, which reads the name, version and depends of what it is asked to load.
func ModuleELF(fields ...string) []byte {
	modinfo := []byte(strings.Join(fields, "\x00") + "\x00")
	shstrtab := []byte("\x00.modinfo\x00.shstrtab\x00")
	const ehsize, shentsize = 64, 64
	infoOff := uint64(ehsize)
	strOff := infoOff + uint64(len(modinfo))
	shOff := (strOff + uint64(len(shstrtab)) + 7) &^ 7
	out := make([]byte, shOff+3*shentsize)
	le := binary.LittleEndian
	copy(out, []byte{0x7f, 'E', 'L', 'F', 2, 1, 1})
	le.PutUint16(out[16:], 1)  // ET_REL
	le.PutUint16(out[18:], 62) // EM_X86_64
	le.PutUint32(out[20:], 1)  // EV_CURRENT
	le.PutUint64(out[40:], shOff)
	le.PutUint16(out[52:], ehsize)
	le.PutUint16(out[58:], shentsize)
	le.PutUint16(out[60:], 3) // sections: null, .modinfo, .shstrtab
	le.PutUint16(out[62:], 2) // section name table index
	copy(out[infoOff:], modinfo)
	copy(out[strOff:], shstrtab)
	section := func(i int, name, typ uint32, flags, off, size uint64) {
		sh := out[shOff+uint64(i)*shentsize:]
		le.PutUint32(sh[0:], name)
		le.PutUint32(sh[4:], typ)
		le.PutUint64(sh[8:], flags)
		le.PutUint64(sh[24:], off)
		le.PutUint64(sh[32:], size)
		le.PutUint64(sh[48:], 1) // alignment
	}
	section(1, 1, 1, 2, infoOff, uint64(len(modinfo)))  // .modinfo: PROGBITS, ALLOC
	section(2, 10, 3, 0, strOff, uint64(len(shstrtab))) // .shstrtab: STRTAB
	return out
}
