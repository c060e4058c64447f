// Package modfile reads kernel module files: decompression and the .modinfo
// section.
//
// A module is read whole into memory. A plain .ko can still be loaded with
// finit_module on its file descriptor; a compressed one (.ko.xz, .ko.zst,
// .ko.gz) must be decompressed here and handed to init_module as bytes, since
// the kernel may not be built with in-kernel module decompression.
package modfile

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// DefaultMaxSize is the largest module, after decompression, that Open and
// ReadBytes accept: 1 GiB. The biggest real module (nvidia.ko with debug
// information) is below 200 MiB.
const DefaultMaxSize int64 = 1 << 30

// ErrTooLarge is returned (wrapped) when a module is larger than the size
// limit, before or after decompression.
var ErrTooLarge = errors.New("module too large")

// ErrUnknownExtension is returned (wrapped) for a file name that does not end
// in .ko, .ko.xz, .ko.zst or .ko.gz.
var ErrUnknownExtension = errors.New("unknown module file extension")

// ErrNotELF is returned (wrapped) when the (decompressed) data does not start
// with the ELF magic number.
var ErrNotELF = errors.New("not an ELF file")

// Compression names how a module file is compressed.
type Compression int

// The compression formats the kernel's module installation supports.
const (
	// None is a plain .ko file.
	None Compression = iota
	// XZ is a .ko.xz file.
	XZ
	// Zstd is a .ko.zst file.
	Zstd
	// Gzip is a .ko.gz file.
	Gzip
)

// String returns the file name extension of the compression, without the
// ".ko" part: "", "xz", "zst" or "gz".
func (c Compression) String() string {
	switch c {
	case None:
		return ""
	case XZ:
		return "xz"
	case Zstd:
		return "zst"
	case Gzip:
		return "gz"
	}
	return fmt.Sprintf("Compression(%d)", int(c))
}

// KernelCompression is the compression a kernel built with CONFIG_MODULE_DECOMPRESS names in
// /sys/module/compression ("gzip", "xz" or "zstd", with or without the newline); ok is false for
// anything else.
func KernelCompression(s string) (c Compression, ok bool) {
	switch strings.TrimSpace(s) {
	case "xz":
		return XZ, true
	case "zstd":
		return Zstd, true
	case "gzip":
		return Gzip, true
	}
	return None, false
}

// extensions maps file name suffixes to their compression. It is never
// modified.
var extensions = []struct {
	suffix string
	c      Compression
}{
	{".ko", None},
	{".ko.xz", XZ},
	{".ko.zst", Zstd},
	{".ko.gz", Gzip},
}

// CompressionFor returns the compression implied by the name of a module file.
// It fails with ErrUnknownExtension for any name that is not *.ko, *.ko.xz,
// *.ko.zst or *.ko.gz.
func CompressionFor(path string) (Compression, error) {
	base := filepath.Base(path)
	for _, e := range extensions {
		if strings.HasSuffix(base, e.suffix) && len(base) > len(e.suffix) {
			return e.c, nil
		}
	}
	return None, fmt.Errorf("%s: %w (want .ko, .ko.xz, .ko.zst or .ko.gz)", path, ErrUnknownExtension)
}

// NameFromPath returns the kernel's name for the module stored at path: the
// file's base name without its .ko[.xz|.zst|.gz] extension, with every '-'
// replaced by '_' (so "nvidia-uvm.ko.xz" gives "nvidia_uvm"). Names that do
// not carry a module extension are returned with only the '-' replacement.
func NameFromPath(path string) string {
	base := filepath.Base(path)
	for i := len(extensions) - 1; i >= 0; i-- {
		if s := extensions[i].suffix; strings.HasSuffix(base, s) && len(base) > len(s) {
			base = strings.TrimSuffix(base, s)
			break
		}
	}
	return strings.ReplaceAll(base, "-", "_")
}

// Module is a kernel module file read into memory.
type Module struct {
	// Path is the file the module was read from.
	Path string
	// Compression is the compression format of the file.
	Compression Compression
	// Compressed is true when the file was compressed, so that Data differs
	// from the file's content. A module that is not compressed can be loaded
	// with finit_module on a descriptor of Path; a compressed one must be
	// loaded with init_module and Data.
	Compressed bool
	// Data is the decompressed ELF image of the module.
	Data []byte
}

// Info parses the .modinfo section of the module. When the section has no
// name= entry (kernels before 5.x), Name is derived from the file name with
// NameFromPath.
func (m *Module) Info() (ModInfo, error) {
	mi, err := Info(m.Data)
	if err != nil {
		return ModInfo{}, fmt.Errorf("%s: %w", m.Path, err)
	}
	if mi.Name == "" {
		mi.Name = NameFromPath(m.Path)
	}
	return mi, nil
}

// Symbols reads the exported, undefined and versioned symbols of the module.
func (m *Module) Symbols() (Symbols, error) {
	s, err := ReadSymbols(m.Data)
	if err != nil {
		return Symbols{}, fmt.Errorf("%s: %w", m.Path, err)
	}
	return s, nil
}

// Open reads the module file at path, decompressing it according to its
// extension, with a size limit of DefaultMaxSize. It checks that the result
// is an ELF file.
func Open(path string) (*Module, error) {
	return OpenLimit(path, DefaultMaxSize)
}

// OpenLimit is Open with an explicit limit, in bytes, on both the file size
// and the decompressed size. A limit of zero or less means DefaultMaxSize.
func OpenLimit(path string, limit int64) (*Module, error) {
	if limit <= 0 {
		limit = DefaultMaxSize
	}
	c, err := CompressionFor(path)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open module: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("open module: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("open module %s: not a regular file (%s)", path, st.Mode().Type())
	}
	if st.Size() > limit {
		return nil, fmt.Errorf("open module %s: file is %d bytes: %w (limit %d bytes)", path, st.Size(), ErrTooLarge, limit)
	}
	var data []byte
	if c == None {
		data = make([]byte, st.Size())
		if _, err := io.ReadFull(f, data); err != nil {
			return nil, fmt.Errorf("read module %s: %w", path, err)
		}
	} else {
		data, err = decompress(f, c, limit, st.Size())
		if err != nil {
			return nil, fmt.Errorf("read module %s: %w", path, err)
		}
	}
	if !IsELF(data) {
		return nil, fmt.Errorf("read module %s: %w", path, ErrNotELF)
	}
	return &Module{Path: path, Compression: c, Compressed: c != None, Data: data}, nil
}

// ReadBytes returns the decompressed content of the module file at path. It
// is Open(path).Data.
func ReadBytes(path string) ([]byte, error) {
	m, err := Open(path)
	if err != nil {
		return nil, err
	}
	return m.Data, nil
}

// Decompress reads all of r, decompressing it as c, and fails with
// ErrTooLarge if the result would exceed limit bytes (zero or less means
// DefaultMaxSize). With None it only copies, under the same limit.
func Decompress(r io.Reader, c Compression, limit int64) ([]byte, error) {
	if limit <= 0 {
		limit = DefaultMaxSize
	}
	return decompress(r, c, limit, 0)
}

// decompress implements Decompress; sizeHint is the compressed size when
// known, used to pre-size the output buffer.
func decompress(r io.Reader, c Compression, limit, sizeHint int64) ([]byte, error) {
	var dec io.Reader
	switch c {
	case None:
		dec = r
	case XZ:
		xr, err := xz.NewReader(r)
		if err != nil {
			return nil, fmt.Errorf("xz: %w", err)
		}
		dec = xr
	case Zstd:
		zr, err := zstd.NewReader(r,
			zstd.WithDecoderConcurrency(1),
			zstd.WithDecoderMaxMemory(uint64(limit)))
		if err != nil {
			return nil, fmt.Errorf("zstd: %w", err)
		}
		defer zr.Close()
		dec = zr
	case Gzip:
		gr, err := gzip.NewReader(r)
		if err != nil {
			return nil, fmt.Errorf("gzip: %w", err)
		}
		defer gr.Close()
		dec = gr
	default:
		return nil, fmt.Errorf("unsupported compression %v", c)
	}
	var buf bytes.Buffer
	if sizeHint > 0 {
		// Kernel modules typically compress 3-5x; start there and grow.
		buf.Grow(int(min(sizeHint*4, limit)))
	}
	n, err := buf.ReadFrom(io.LimitReader(dec, limit+1))
	if errors.Is(err, zstd.ErrDecoderSizeExceeded) || errors.Is(err, zstd.ErrWindowSizeExceeded) {
		return nil, fmt.Errorf("decompressed size: %w (limit %d bytes): %v", ErrTooLarge, limit, err)
	}
	if err != nil {
		if c == None {
			return nil, err
		}
		return nil, fmt.Errorf("%v: %w", c, err)
	}
	if n > limit {
		return nil, fmt.Errorf("decompressed size: %w (limit %d bytes)", ErrTooLarge, limit)
	}
	return buf.Bytes(), nil
}

// IsELF reports whether data starts with the ELF magic number.
func IsELF(data []byte) bool {
	return len(data) >= 4 && string(data[:4]) == "\x7fELF"
}
