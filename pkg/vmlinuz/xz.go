package vmlinuz

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"hash/crc64"
	"io"

	"github.com/ulikunitz/xz/lzma"
)

// The xz container (https://tukaani.org/xz/xz-file-format.txt) is read here rather than with
// github.com/ulikunitz/xz because that reader accepts only a lone LZMA2 filter, and the kernel's
// x86 images are packed with `xz --x86 --lzma2` (scripts/xz_wrap.sh): the BCJ x86 filter before
// LZMA2. The LZMA2 data itself is decoded by github.com/ulikunitz/xz/lzma.

var xzMagic = []byte{0xfd, '7', 'z', 'X', 'Z', 0x00}

// xz filter IDs.
const (
	xzFilterX86   = 0x04
	xzFilterLZMA2 = 0x21
)

// xz check types (the low nibble of the stream flags).
const (
	xzCheckNone   = 0x0
	xzCheckCRC32  = 0x1
	xzCheckCRC64  = 0x4
	xzCheckSHA256 = 0xa
)

var crc64Table = crc64.MakeTable(crc64.ECMA)

// newXZReader returns the decoded contents of the first block of the xz stream in data. The
// block's check is verified when the block has been read to its end. Only the BCJ x86 and LZMA2
// filters are supported; maxWindow bounds the LZMA2 dictionary.
func newXZReader(data []byte, maxWindow int64) (io.Reader, error) {
	if len(data) < 12 || !bytes.Equal(data[:6], xzMagic) {
		return nil, errors.New("xz: no stream header")
	}
	if crc32.ChecksumIEEE(data[6:8]) != binary.LittleEndian.Uint32(data[8:12]) {
		return nil, errors.New("xz: stream header CRC mismatch")
	}
	if data[6] != 0 || data[7]&0xf0 != 0 {
		return nil, fmt.Errorf("xz: unsupported stream flags %#02x%02x", data[6], data[7])
	}
	check := data[7] & 0x0f
	var sum hash.Hash
	checkLen := 0
	switch check {
	case xzCheckNone:
	case xzCheckCRC32:
		sum, checkLen = crc32.NewIEEE(), 4
	case xzCheckCRC64:
		sum, checkLen = crc64.New(crc64Table), 8
	case xzCheckSHA256:
		sum, checkLen = sha256.New(), 32
	default:
		return nil, fmt.Errorf("xz: unsupported check type %#x", check)
	}
	rest := data[12:]
	if len(rest) == 0 || rest[0] == 0 {
		return nil, errors.New("xz: the stream has no block")
	}
	bh, err := parseXZBlockHeader(rest)
	if err != nil {
		return nil, err
	}
	if bh.dictCap > maxWindow {
		return nil, fmt.Errorf("xz: LZMA2 dictionary of %d bytes is larger than the limit of %d", bh.dictCap, maxWindow)
	}
	src := bytes.NewReader(rest[bh.size:]) // an io.ByteReader: the LZMA2 reader does not read ahead
	lz, err := lzma.Reader2Config{DictCap: int(max(bh.dictCap, lzma.MinDictCap))}.NewReader2(src)
	if err != nil {
		return nil, fmt.Errorf("xz: %w", err)
	}
	var r io.Reader = lz
	if bh.x86 {
		r = &bcjX86Reader{r: r, pos: bh.x86Start, prevPos: bh.x86Start - 5}
	}
	return &xzBlockReader{r: r, lz: lz, src: src, sum: sum, checkLen: checkLen, uncompressed: bh.uncompressed}, nil
}

// xzBlockHeader is what newXZReader needs from a block header.
type xzBlockHeader struct {
	size         int   // the header's length in bytes
	dictCap      int64 // LZMA2 dictionary size
	x86          bool  // the BCJ x86 filter comes first
	x86Start     uint32
	uncompressed int64 // -1 when the header does not say
}

// parseXZBlockHeader reads the block header at the start of b.
func parseXZBlockHeader(b []byte) (xzBlockHeader, error) {
	h := xzBlockHeader{size: (int(b[0]) + 1) * 4, uncompressed: -1}
	if len(b) < h.size {
		return h, errors.New("xz: truncated block header")
	}
	hdr := b[:h.size]
	if crc32.ChecksumIEEE(hdr[:h.size-4]) != binary.LittleEndian.Uint32(hdr[h.size-4:]) {
		return h, errors.New("xz: block header CRC mismatch")
	}
	flags := hdr[1]
	if flags&0x3c != 0 {
		return h, fmt.Errorf("xz: reserved block flags %#02x", flags)
	}
	p := hdr[2 : h.size-4]
	var err error
	if flags&0x40 != 0 {
		if _, p, err = xzVarint(p); err != nil {
			return h, fmt.Errorf("xz: compressed size: %w", err)
		}
	}
	if flags&0x80 != 0 {
		var n uint64
		if n, p, err = xzVarint(p); err != nil {
			return h, fmt.Errorf("xz: uncompressed size: %w", err)
		}
		if n > 1<<62 {
			return h, errors.New("xz: uncompressed size out of range")
		}
		h.uncompressed = int64(n)
	}
	nFilters := int(flags&0x03) + 1
	for i := range nFilters {
		var id, propLen uint64
		if id, p, err = xzVarint(p); err != nil {
			return h, fmt.Errorf("xz: filter %d: %w", i+1, err)
		}
		if propLen, p, err = xzVarint(p); err != nil {
			return h, fmt.Errorf("xz: filter %d: %w", i+1, err)
		}
		if propLen > uint64(len(p)) {
			return h, fmt.Errorf("xz: filter %d: properties run past the block header", i+1)
		}
		props := p[:propLen]
		p = p[propLen:]
		last := i == nFilters-1
		switch {
		case id == xzFilterLZMA2 && last:
			if len(props) != 1 {
				return h, errors.New("xz: LZMA2 properties must be one byte")
			}
			if h.dictCap, err = lzma.DecodeDictCap(props[0]); err != nil {
				return h, fmt.Errorf("xz: %w", err)
			}
		case id == xzFilterX86 && !last && !h.x86:
			switch len(props) {
			case 0:
			case 4:
				h.x86Start = binary.LittleEndian.Uint32(props)
			default:
				return h, errors.New("xz: BCJ x86 properties must be empty or four bytes")
			}
			h.x86 = true
		case last:
			return h, fmt.Errorf("xz: the last filter is %#x, not LZMA2", id)
		default:
			return h, fmt.Errorf("xz: filter %#x is not supported (only BCJ x86 and LZMA2 are)", id)
		}
	}
	for _, c := range p {
		if c != 0 {
			return h, errors.New("xz: non-zero block header padding")
		}
	}
	return h, nil
}

// xzVarint reads an xz multibyte integer (7 bits a byte, least significant first, at most 9
// bytes) and returns the rest of b.
func xzVarint(b []byte) (uint64, []byte, error) {
	var v uint64
	for i := 0; i < 9 && i < len(b); i++ {
		c := b[i]
		v |= uint64(c&0x7f) << (7 * i)
		if c&0x80 == 0 {
			if c == 0 && i > 0 {
				return 0, nil, errors.New("integer is not in its shortest form")
			}
			return v, b[i+1:], nil
		}
	}
	return 0, nil, errors.New("truncated or too long integer")
}

// xzBlockReader hashes what the filters produce and, at the end of the LZMA2 data, checks the
// uncompressed size (when the header gave it) and the block's check.
type xzBlockReader struct {
	r            io.Reader
	lz           *lzma.Reader2
	src          *bytes.Reader
	sum          hash.Hash
	checkLen     int
	uncompressed int64
	n            int64
	err          error
}

func (x *xzBlockReader) Read(p []byte) (int, error) {
	if x.err != nil {
		return 0, x.err
	}
	n, err := x.r.Read(p)
	x.n += int64(n)
	if x.sum != nil {
		x.sum.Write(p[:n])
	}
	if x.uncompressed >= 0 && x.n > x.uncompressed {
		err = fmt.Errorf("xz: the block is longer than its header says (%d bytes)", x.uncompressed)
	}
	if errors.Is(err, io.EOF) {
		err = x.finish()
	}
	if err != nil {
		x.err = err
	}
	return n, err
}

// finish verifies the block after its last byte: size, padding and check.
func (x *xzBlockReader) finish() error {
	if !x.lz.EOS() {
		return errors.New("xz: the LZMA2 data ends without an end marker")
	}
	if x.uncompressed >= 0 && x.n != x.uncompressed {
		return fmt.Errorf("xz: the block holds %d bytes, its header says %d", x.n, x.uncompressed)
	}
	consumed := int64(x.src.Size()) - int64(x.src.Len())
	for ; consumed%4 != 0; consumed++ {
		c, err := x.src.ReadByte()
		if err != nil || c != 0 {
			return errors.New("xz: bad block padding")
		}
	}
	want := make([]byte, x.checkLen)
	if _, err := io.ReadFull(x.src, want); err != nil {
		return errors.New("xz: truncated block check")
	}
	if x.sum != nil {
		got := x.sum.Sum(nil)
		if x.checkLen == 4 || x.checkLen == 8 { // CRCs are stored little-endian
			for i, j := 0, len(got)-1; i < j; i, j = i+1, j-1 {
				got[i], got[j] = got[j], got[i]
			}
		}
		if !bytes.Equal(got, want) {
			return errors.New("xz: block check mismatch: the data is corrupt")
		}
	}
	return io.EOF
}

// bcjX86Reader undoes the BCJ x86 filter: the encoder turned the relative targets of CALL (E8)
// and JMP (E9) instructions into absolute ones to make them compress better; this turns them
// back. It keeps up to four unconverted bytes between reads, since converting a byte may need
// the four after it.
type bcjX86Reader struct {
	r        io.Reader
	buf      [1 << 16]byte
	start    int // buf[start:ready] is converted and not yet returned
	ready    int
	end      int    // buf[ready:end] is read and not converted yet
	pos      uint32 // the stream position of buf[ready]
	prevPos  uint32 // position of the last E8/E9 byte seen
	prevMask uint32 // which of the bytes before it were E8/E9 (see code)
	eof      bool
	err      error
	empty    int // reads in a row that returned nothing
}

func (b *bcjX86Reader) Read(p []byte) (int, error) {
	for b.start == b.ready {
		if b.eof {
			if b.ready < b.end { // the last bytes are never converted
				b.ready = b.end
				continue
			}
			return 0, b.err
		}
		copy(b.buf[:], b.buf[b.ready:b.end])
		b.end -= b.ready
		b.start, b.ready = 0, 0
		n, err := b.r.Read(b.buf[b.end:])
		b.end += n
		if b.empty = b.empty + 1; n > 0 {
			b.empty = 0
		}
		if err == nil && b.empty >= 100 {
			err = io.ErrNoProgress
		}
		if err != nil {
			b.eof, b.err = true, err
		}
		done := b.convert(b.buf[:b.end])
		b.pos += uint32(done)
		b.ready = done
	}
	n := copy(p, b.buf[b.start:b.ready])
	b.start += n
	return n, nil
}

// x86 BCJ decoding tables: for a mask of recent E8/E9 positions, whether a conversion is allowed
// and which byte of the target decides whether to convert again.
var (
	bcjAllowed = [8]bool{true, true, true, false, true, false, false, false}
	bcjBit     = [8]uint32{0, 1, 2, 2, 3, 3, 3, 3}
)

func bcjMSByte(c byte) bool { return c == 0x00 || c == 0xff }

// convert decodes buf in place, buf[0] being at stream position b.pos, and returns how many bytes
// are final (the rest need more data after them).
func (b *bcjX86Reader) convert(buf []byte) int {
	if len(buf) < 5 {
		return 0
	}
	if b.pos-b.prevPos > 5 {
		b.prevPos = b.pos - 5
	}
	limit := len(buf) - 5
	i := 0
	for i <= limit {
		if buf[i] != 0xe8 && buf[i] != 0xe9 {
			i++
			continue
		}
		here := b.pos + uint32(i)
		gap := here - b.prevPos
		b.prevPos = here
		if gap > 5 {
			b.prevMask = 0
		} else {
			for range gap {
				b.prevMask &= 0x77
				b.prevMask <<= 1
			}
		}
		c := buf[i+4]
		if !bcjMSByte(c) || !bcjAllowed[(b.prevMask>>1)&7] || b.prevMask>>1 >= 0x10 {
			i++
			b.prevMask |= 1
			if bcjMSByte(c) {
				b.prevMask |= 0x10
			}
			continue
		}
		src := binary.LittleEndian.Uint32(buf[i+1:])
		var dest uint32
		for {
			dest = src - (here + 5)
			if b.prevMask == 0 {
				break
			}
			shift := bcjBit[b.prevMask>>1] * 8
			if !bcjMSByte(byte(dest >> (24 - shift))) {
				break
			}
			src = dest ^ (1<<(32-shift) - 1)
		}
		dest &= 0x01ffffff
		if dest&0x01000000 != 0 {
			dest |= 0xff000000
		}
		binary.LittleEndian.PutUint32(buf[i+1:], dest)
		i += 5
		b.prevMask = 0
	}
	return i
}
