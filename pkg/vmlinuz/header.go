package vmlinuz

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
)

// Offsets and values of the x86 boot protocol's setup header (Documentation/arch/x86/boot.rst).
const (
	sectorSize       = 512
	offSetupSects    = 0x1f1 // u8: setup sectors after the boot sector; 0 means 4
	offBootFlag      = 0x1fe // u16: 0xAA55
	offHeaderMagic   = 0x202 // "HdrS" (protocol 2.00 and later)
	offVersion       = 0x206 // u16: boot protocol version
	offKernelVersion = 0x20e // u16: pointer to kernel_version, minus 0x200
	offPayloadOffset = 0x248 // u32: payload offset from the protected-mode code (2.08+)
	offPayloadLength = 0x24c // u32: payload length (2.08+)
	headerEnd        = 0x250 // the header fields read here end before this offset

	bootFlag = 0xaa55
	// protocolPayload is the first boot protocol version with payload_offset/payload_length.
	protocolPayload = 0x0208
	// maxKernelVersion bounds the kernel_version string (it is UTS_RELEASE, the build host and
	// UTS_VERSION: well under this).
	maxKernelVersion = 512
)

// ErrNotBzImage means the file has no x86 boot sector and setup header.
var ErrNotBzImage = errors.New("not an x86 bzImage (no boot sector with a HdrS setup header)")

// Header is what an x86 bzImage's setup header says about the kernel it holds.
type Header struct {
	// Protocol is the boot protocol version, e.g. 0x020f for 2.15.
	Protocol uint16
	// SetupSectors is the number of 512-byte setup sectors after the boot sector.
	SetupSectors int
	// KernelVersion is the setup code's kernel_version string:
	// "<release> (<user>@<host>) <version>", the kernel banner without the "Linux version "
	// prefix and the compiler. Empty when the header does not point at one.
	KernelVersion string
	// PayloadOffset and PayloadLength locate the compressed kernel in the file (absolute
	// offset); both are 0 before protocol 2.08.
	PayloadOffset, PayloadLength int64
}

// ParseHeader reads the setup header of an x86 bzImage. It checks the boot flag and the HdrS
// magic, and that the setup sectors, the kernel_version string and the payload lie inside data;
// it returns ErrNotBzImage (wrapped) for anything that is not a bzImage.
func ParseHeader(data []byte) (Header, error) {
	if len(data) < headerEnd {
		return Header{}, fmt.Errorf("%w: %d bytes is shorter than a setup header", ErrNotBzImage, len(data))
	}
	if binary.LittleEndian.Uint16(data[offBootFlag:]) != bootFlag || string(data[offHeaderMagic:offHeaderMagic+4]) != "HdrS" {
		return Header{}, ErrNotBzImage
	}
	h := Header{Protocol: binary.LittleEndian.Uint16(data[offVersion:]), SetupSectors: int(data[offSetupSects])}
	if h.SetupSectors == 0 {
		h.SetupSectors = 4
	}
	setupEnd := int64(h.SetupSectors+1) * sectorSize
	if setupEnd > int64(len(data)) {
		return Header{}, fmt.Errorf("%w: %d setup sectors run past the end of the file (%d bytes)", ErrNotBzImage, h.SetupSectors, len(data))
	}
	if p := binary.LittleEndian.Uint16(data[offKernelVersion:]); p != 0 {
		start := int64(p) + 0x200
		if start >= setupEnd {
			return Header{}, fmt.Errorf("bzImage: kernel_version pointer %#x is outside the setup code (%d bytes)", p, setupEnd)
		}
		s := data[start:min(setupEnd, start+maxKernelVersion)]
		end := bytes.IndexByte(s, 0)
		if end < 0 {
			return Header{}, fmt.Errorf("bzImage: the kernel_version string at %#x has no end within %d bytes", start, len(s))
		}
		if !printable(s[:end]) {
			return Header{}, fmt.Errorf("bzImage: the kernel_version string at %#x is not text: %q", start, s[:end])
		}
		h.KernelVersion = string(s[:end])
	}
	if h.Protocol >= protocolPayload {
		off := int64(binary.LittleEndian.Uint32(data[offPayloadOffset:]))
		length := int64(binary.LittleEndian.Uint32(data[offPayloadLength:]))
		start := setupEnd + off
		if length == 0 || start+length > int64(len(data)) {
			return Header{}, fmt.Errorf("bzImage: payload at %d+%d bytes does not lie inside the file (%d bytes)", start, length, len(data))
		}
		h.PayloadOffset, h.PayloadLength = start, length
	}
	return h, nil
}

// printable reports whether b is non-empty text without control characters.
func printable(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		if c < 0x20 || c == 0x7f {
			return false
		}
	}
	return true
}
