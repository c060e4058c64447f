// Package vmlinuz reads the kernel banner out of a kernel image: the "Linux version ..." line that
// the booted kernel shows as the first line of /proc/version, and that NVIDIA's precompiled
// packages are matched against. It parses an x86 bzImage's setup header, finds the compressed
// kernel (gzip, xz with or without the BCJ x86 filter, zstd, lz4, lzma or bzip2), decompresses it
// with bounded memory and output, and finds the banner string in it, cross-checked against the
// setup code's own kernel_version string. Other images (a raw compressed kernel, an uncompressed
// vmlinux) are searched by scanning for compression magics.
package vmlinuz

import (
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"unicode/utf8"

	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
	"github.com/ulikunitz/xz/lzma"
)

// Defaults for Options.
const (
	// DefaultMaxImage bounds the image file that is read (bzImages are tens of MiB).
	DefaultMaxImage = 256 << 20
	// DefaultMaxOutput bounds how much decompressed kernel is searched for each candidate payload.
	DefaultMaxOutput = 1 << 30
	// DefaultMaxWindow bounds an xz, lzma or zstd window: the kernel's x86 xz uses 32 MiB, its
	// zstd -22 --ultra (Debian's 6.12 images) declares 128 MiB.
	DefaultMaxWindow = 128 << 20
	// maxCandidates bounds how many compression magics found by scanning are tried.
	maxCandidates = 64
	// maxBanner bounds the length of a banner line.
	maxBanner = 1024
)

// Compression names, as Result.Compression reports them.
const (
	CompressionNone  = "none"
	CompressionGzip  = "gzip"
	CompressionXZ    = "xz"
	CompressionZstd  = "zstd"
	CompressionLZ4   = "lz4"
	CompressionLZMA  = "lzma"
	CompressionBzip2 = "bzip2"
)

var bannerPrefix = []byte("Linux version ")

// ErrNoBanner means no kernel banner was found in the image.
var ErrNoBanner = errors.New("no Linux kernel banner found")

// Options bound the work; zero fields take the defaults.
type Options struct {
	// MaxImage bounds the size of the image file (BannerFile). Zero means DefaultMaxImage.
	MaxImage int64
	// MaxOutput bounds the decompressed bytes searched per payload. Zero means DefaultMaxOutput.
	MaxOutput int64
	// MaxWindow bounds a decompressor's dictionary or window. Zero means DefaultMaxWindow.
	MaxWindow int64
}

func (o Options) withDefaults() Options {
	if o.MaxImage <= 0 {
		o.MaxImage = DefaultMaxImage
	}
	if o.MaxOutput <= 0 {
		o.MaxOutput = DefaultMaxOutput
	}
	if o.MaxWindow <= 0 {
		o.MaxWindow = DefaultMaxWindow
	}
	return o
}

// Result is the banner and where it was found.
type Result struct {
	// Banner is the line as the first line of /proc/version shows it, without the newline:
	// "Linux version <release> (<user>@<host>) (<compiler>) <version>".
	Banner string
	// Compression is how the kernel was packed (one of the Compression* names).
	Compression string
	// Offset is where the payload the banner came from starts in the image.
	Offset int64
	// Header is the bzImage setup header; nil when the image is not a bzImage.
	Header *Header
}

// BannerFile reads the image at path (at most o.MaxImage bytes) and returns its banner.
func BannerFile(path string, o Options) (Result, error) {
	o = o.withDefaults()
	f, err := os.Open(path)
	if err != nil {
		return Result{}, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, o.MaxImage+1))
	if err != nil {
		return Result{}, fmt.Errorf("read %s: %w", path, err)
	}
	if int64(len(data)) > o.MaxImage {
		return Result{}, fmt.Errorf("%s is larger than %d bytes: not a kernel image", path, o.MaxImage)
	}
	res, err := Banner(data, o)
	if err != nil {
		return res, fmt.Errorf("%s: %w", path, err)
	}
	return res, nil
}

// Banner returns the kernel banner of the image in data. For a bzImage it decompresses the
// payload the setup header points at, and accepts only a banner that agrees with the header's
// kernel_version string. When that finds nothing, or data is not a bzImage, it searches data
// itself (an uncompressed kernel) and then every compressed stream it can find by its magic.
func Banner(data []byte, o Options) (Result, error) {
	o = o.withDefaults()
	var res Result
	h, herr := ParseHeader(data)
	if herr != nil && !errors.Is(herr, ErrNotBzImage) {
		return res, herr
	}
	if herr == nil {
		res.Header = &h
	}
	var tried []string
	try := func(off int64, format string) (bool, error) {
		banner, err := decodeAndFind(data[off:], format, res.Header, o)
		if err == nil {
			res.Banner, res.Compression, res.Offset = banner, format, off
			return true, nil
		}
		var mismatch *mismatchError
		if errors.As(err, &mismatch) {
			return false, err
		}
		tried = append(tried, fmt.Sprintf("%s at %d: %v", format, off, err))
		return false, nil
	}
	if res.Header != nil && h.PayloadLength > 0 {
		payload := data[h.PayloadOffset : h.PayloadOffset+h.PayloadLength]
		format, ok := sniff(payload)
		if !ok {
			tried = append(tried, fmt.Sprintf("the payload at %d (magic % x) is in no format this reads (gzip, xz, zstd, lz4, lzma, bzip2)",
				h.PayloadOffset, payload[:min(len(payload), 8)]))
		} else if found, err := try(h.PayloadOffset, format); found || err != nil {
			return res, err
		}
	}
	if found, err := try(0, CompressionNone); found || err != nil {
		return res, err
	}
	for _, c := range scanMagics(data) {
		if res.Header != nil && c.off == h.PayloadOffset {
			continue // tried above
		}
		if found, err := try(c.off, c.format); found || err != nil {
			return res, err
		}
	}
	if len(tried) == 0 {
		return res, ErrNoBanner
	}
	return res, fmt.Errorf("%w: %s", ErrNoBanner, strings.Join(tried, "; "))
}

// mismatchError says banners were found but none agrees with the setup header.
type mismatchError struct {
	kernelVersion string
	found         []string
}

func (e *mismatchError) Error() string {
	return fmt.Sprintf("the banners found (%q) do not agree with the setup header's kernel version %q; refusing to guess",
		e.found, e.kernelVersion)
}

// Magics of the formats sniff and scanMagics know.
var (
	gzipMagic     = []byte{0x1f, 0x8b, 0x08}
	zstdMagic     = []byte{0x28, 0xb5, 0x2f, 0xfd}
	lz4LegacyMagc = []byte{0x02, 0x21, 0x4c, 0x18}
	lz4FrameMagic = []byte{0x04, 0x22, 0x4d, 0x18}
	bzip2Magic    = []byte("BZh")
	lzoMagic      = []byte{0x89, 'L', 'Z', 'O', 0x00, '\r', '\n', 0x1a, '\n'}
)

// sniff names the format of a payload from its first bytes.
func sniff(b []byte) (string, bool) {
	switch {
	case bytes.HasPrefix(b, gzipMagic):
		return CompressionGzip, true
	case bytes.HasPrefix(b, xzMagic):
		return CompressionXZ, true
	case bytes.HasPrefix(b, zstdMagic):
		return CompressionZstd, true
	case bytes.HasPrefix(b, lz4LegacyMagc), bytes.HasPrefix(b, lz4FrameMagic):
		return CompressionLZ4, true
	case isBzip2(b):
		return CompressionBzip2, true
	case isLZMA(b):
		return CompressionLZMA, true
	}
	return "", false
}

// isBzip2 checks "BZh" + block size digit + the block magic (pi).
func isBzip2(b []byte) bool {
	return len(b) >= 10 && bytes.HasPrefix(b, bzip2Magic) && b[3] >= '1' && b[3] <= '9' &&
		bytes.Equal(b[4:10], []byte{0x31, 0x41, 0x59, 0x26, 0x53, 0x59})
}

// isLZMA checks the .lzma header the kernel's `lzma -9` writes: properties 0x5d and a dictionary
// size that is a power of two or 2^n + 2^(n-1).
func isLZMA(b []byte) bool {
	if len(b) < 13 || b[0] != 0x5d {
		return false
	}
	d := binary.LittleEndian.Uint32(b[1:5])
	for n := 12; n < 31; n++ {
		if d == 1<<n || d == 1<<n|1<<(n-1) {
			return true
		}
	}
	return false
}

type candidate struct {
	off    int64
	format string
}

// scanMagics finds the compressed streams in data by their magic numbers, in file order, at most
// maxCandidates of them. lzma is left out: its header is too weak to find by scanning.
func scanMagics(data []byte) []candidate {
	var out []candidate
	for i := 0; i+4 <= len(data) && len(out) < maxCandidates; i++ {
		switch data[i] {
		case 0x1f, 0xfd, 0x28, 0x02, 0x04, 'B':
		default:
			continue
		}
		if f, ok := sniff(data[i:]); ok && f != CompressionLZMA {
			out = append(out, candidate{int64(i), f})
		}
	}
	return out
}

// decodeAndFind decompresses b as format (CompressionNone: as it is) and returns the banner in
// it that agrees with h (any banner when h is nil or has no kernel_version).
func decodeAndFind(b []byte, format string, h *Header, o Options) (string, error) {
	r, closeFn, err := decompressor(b, format, o)
	if err != nil {
		return "", err
	}
	defer closeFn()
	kv := ""
	if h != nil {
		kv = h.KernelVersion
	}
	return findBanner(io.LimitReader(r, o.MaxOutput), kv)
}

// decompressor returns a reader of b's decompressed contents.
func decompressor(b []byte, format string, o Options) (io.Reader, func(), error) {
	nop := func() {}
	switch format {
	case CompressionNone:
		return bytes.NewReader(b), nop, nil
	case CompressionGzip:
		zr, err := gzip.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil, nop, fmt.Errorf("gzip: %w", err)
		}
		zr.Multistream(false) // the kernel appends its size after the stream
		return zr, nop, nil
	case CompressionXZ:
		r, err := newXZReader(b, o.MaxWindow)
		return r, nop, err
	case CompressionZstd:
		zr, err := zstd.NewReader(bytes.NewReader(b), zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
			zstd.WithDecoderMaxWindow(uint64(o.MaxWindow)), zstd.WithDecoderMaxMemory(uint64(o.MaxOutput)))
		if err != nil {
			return nil, nop, fmt.Errorf("zstd: %w", err)
		}
		return zr, zr.Close, nil
	case CompressionLZ4:
		zr := lz4.NewReader(bytes.NewReader(b))
		if err := zr.Apply(lz4.ConcurrencyOption(1)); err != nil {
			return nil, nop, fmt.Errorf("lz4: %w", err)
		}
		return zr, nop, nil
	case CompressionLZMA:
		zr, err := lzma.ReaderConfig{DictCap: int(o.MaxWindow)}.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil, nop, fmt.Errorf("lzma: %w", err)
		}
		return zr, nop, nil
	case CompressionBzip2:
		return bzip2.NewReader(bytes.NewReader(b)), nop, nil
	}
	if bytes.HasPrefix(b, lzoMagic) {
		return nil, nop, errors.New("lzo-compressed kernels are not supported")
	}
	return nil, nop, fmt.Errorf("unknown compression %q", format)
}

// findBanner reads r and returns the first banner line that agrees with kernelVersion (the first
// banner line when kernelVersion is empty). A banner line is "Linux version " and printable text
// up to a newline that is followed by a NUL (the end of the C string linux_banner), at most
// maxBanner bytes long. Decompression errors after a banner was found do not matter: the
// banner is returned as soon as it is seen.
func findBanner(r io.Reader, kernelVersion string) (string, error) {
	var found []string
	window := make([]byte, 0, 64<<10+maxBanner+1)
	chunk := make([]byte, 64<<10)
	eof := false
	var readErr error
	for !eof {
		n, err := r.Read(chunk)
		window = append(window, chunk[:n]...)
		if err != nil {
			eof = true
			if !errors.Is(err, io.EOF) {
				readErr = err
			}
		}
		keep := len(window) // from where the window must be kept for the next round
		for i := 0; ; {
			j := bytes.Index(window[i:], bannerPrefix)
			if j < 0 {
				keep = min(keep, max(i, len(window)-len(bannerPrefix)+1))
				break
			}
			start := i + j
			line, complete := bannerAt(window[start:], eof)
			if !complete {
				keep = min(keep, start)
				break
			}
			if line != "" {
				if agrees(line, kernelVersion) {
					return line, nil
				}
				found = append(found, line)
			}
			i = start + 1
		}
		window = append(window[:0], window[keep:]...)
	}
	if len(found) > 0 {
		return "", &mismatchError{kernelVersion: kernelVersion, found: found}
	}
	if readErr != nil {
		return "", readErr
	}
	return "", ErrNoBanner
}

// bannerAt looks at b, which starts with bannerPrefix, and returns the banner line there ("" if
// it is not one). complete is false when b is too short to tell and more data may follow.
func bannerAt(b []byte, eof bool) (line string, complete bool) {
	nl := bytes.IndexByte(b[:min(len(b), maxBanner+1)], '\n')
	if nl < 0 {
		return "", eof || len(b) > maxBanner
	}
	if nl+1 == len(b) && !eof {
		return "", false // the NUL after the newline is not here yet
	}
	text := b[:nl]
	if nl+1 < len(b) && b[nl+1] != 0 || !printable(text) || !utf8.Valid(text) {
		return "", true
	}
	return string(text), true
}

// agrees reports whether banner fits the setup header's kernel_version
// ("<release> (<user>@<host>) <version>"): the banner is
// "Linux version <release> (<user>@<host>) (<compiler>) <version>".
func agrees(banner, kernelVersion string) bool {
	if kernelVersion == "" {
		return true
	}
	release, rest, ok := strings.Cut(kernelVersion, " (")
	if !ok {
		return false
	}
	host, version, ok := strings.Cut(rest, ") ")
	if !ok {
		return false
	}
	head := string(bannerPrefix) + release + " (" + host + ") ("
	return strings.HasPrefix(banner, head) && strings.HasSuffix(banner[len(head):], ") "+version)
}
