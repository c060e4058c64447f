// Package precompiled reads, writes and verifies NVIDIA precompiled
// kernel-interface packages, the files that NVIDIA's mkprecompiled tool packs
// and nvidia-installer consumes.
//
// The format is a small fixed header (magic "\aNVIDIA\a", format version 2,
// driver version, description, proc version banner) followed by file records.
// Every integer is an unsigned 32-bit little-endian value and every string is
// a length followed by that many bytes. Each record holds one member: a
// precompiled kernel interface (an object to be linked into a module) or a
// complete kernel module, its CRC-32/MPEG-2 (stored twice) and optionally a
// detached module signature together with the CRC of the linked module the
// signature belongs to.
//
// [Parse] is strict: it accepts exactly the layout mkprecompiled writes, checks
// every length against the bytes that remain before allocating, and rejects
// inconsistent copies, bad CRCs, unknown types or attributes, unsafe member
// paths and trailing bytes. [Package.Marshal] writes the same bytes the tool
// writes, so parsing and marshalling a valid package reproduces it exactly.
package precompiled

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
)

// Sentinel errors. Errors returned by this package wrap one or more of them;
// test with errors.Is.
var (
	// ErrCorrupt means the input is not a well-formed precompiled package.
	ErrCorrupt = errors.New("corrupt precompiled package")
	// ErrInvalid means a Package value cannot be written, or a pack input is
	// unusable.
	ErrInvalid = errors.New("invalid precompiled package")
	// ErrUnsafePath means a member name or directory is empty where a name is
	// required, absolute, contains a ".." element or a NUL byte, or (for a
	// member name) is not a plain file name. It is wrapped together with
	// ErrCorrupt or ErrInvalid.
	ErrUnsafePath = errors.New("unsafe path")
	// ErrTooLarge means the input is larger than MaxPackageSize.
	ErrTooLarge = errors.New("precompiled package too large")
)

// Format constants.
const (
	// Magic is the 8-byte signature every package starts with.
	Magic = "\aNVIDIA\a"
	// FormatVersion is the only format version this package reads and writes.
	FormatVersion = 2
	// HeaderFixedSize is the size of the header without its three strings:
	// magic, version, three string lengths and the file count.
	HeaderFixedSize = 28
	// RecordFixedSize is the size of a file record without its four strings,
	// its data and its signature.
	RecordFixedSize = 60
	// MaxPackageSize bounds what Read and ReadFile accept (1 GiB). Real
	// packages are a few tens of MiB at most.
	MaxPackageSize = 1 << 30
)

const (
	recordStart = "FILE"
	recordEnd   = "END."
)

// FileType is the kind of a package member.
type FileType uint32

// Member types.
const (
	// KernelInterface is a precompiled kernel interface: an object file that
	// is linked with the driver's core object to produce a kernel module.
	KernelInterface FileType = 0
	// KernelModule is a complete precompiled kernel module (.ko).
	KernelModule FileType = 1
)

// String returns the name mkprecompiled --info prints for the type.
func (t FileType) String() string {
	switch t {
	case KernelInterface:
		return "precompiled kernel interface"
	case KernelModule:
		return "precompiled kernel module"
	default:
		return fmt.Sprintf("unknown type %d", uint32(t))
	}
}

// Attr is the attribute bitmask of a package member.
type Attr uint32

// Attribute bits.
const (
	// AttrDetachedSignature: the record carries a detached module signature,
	// to be appended to the module linked from this interface.
	AttrDetachedSignature Attr = 1
	// AttrLinkedModuleCRC: LinkedModuleCRC holds the CRC of the module the
	// signature was made for.
	AttrLinkedModuleCRC Attr = 2
	// AttrEmbeddedSignature: the member is a kernel module that is already
	// signed.
	AttrEmbeddedSignature Attr = 4

	// attrKnown is the union of all defined bits.
	attrKnown = AttrDetachedSignature | AttrLinkedModuleCRC | AttrEmbeddedSignature
)

// Names returns the names of the set bits, in bit order, as mkprecompiled
// --info lists them. Unknown bits are named "unknown attribute 0x..". The
// result is never nil.
func (a Attr) Names() []string {
	names := []string{}
	if a&AttrDetachedSignature != 0 {
		names = append(names, "detached signature")
	}
	if a&AttrLinkedModuleCRC != 0 {
		names = append(names, "linked module crc")
	}
	if a&AttrEmbeddedSignature != 0 {
		names = append(names, "embedded signature")
	}
	if rest := a &^ attrKnown; rest != 0 {
		names = append(names, fmt.Sprintf("unknown attribute %#x", uint32(rest)))
	}
	return names
}

// String returns the attribute names joined with ", " (empty for none).
func (a Attr) String() string { return strings.Join(a.Names(), ", ") }

// Package is a precompiled kernel-interface package.
type Package struct {
	// DriverVersion is the NVIDIA driver version, e.g. "595.71.05". It must
	// not be empty.
	DriverVersion string
	// Description is free text; the driver container stores the kernel
	// release. It may be empty.
	Description string
	// ProcVersion is the kernel banner the package was built for: the first
	// line of /proc/version without its newline. Matching is byte-exact.
	ProcVersion string
	// Files are the members, in package order.
	Files []File
}

// File is one member of a package.
type File struct {
	// Index is the record's stored index; it always equals the member's
	// position in Package.Files.
	Index uint32
	// Type says whether this is a kernel interface or a kernel module.
	Type FileType
	// Attributes is the attribute bitmask.
	Attributes Attr
	// Name is the member's file name (the basename of the packed file).
	Name string
	// LinkedModuleName is the module produced by linking this interface, e.g.
	// "nvidia.ko". Empty for kernel modules.
	LinkedModuleName string
	// CoreObjectName is the driver core object this interface is linked
	// with, relative to the unpack directory, e.g.
	// "nvidia/nv-kernel.o_binary". Empty for kernel modules.
	CoreObjectName string
	// TargetDirectory is where the member is unpacked, relative to the unpack
	// directory; empty when not given.
	TargetDirectory string
	// CRC is the stored CRC of Data: StoredCRC(Data).
	CRC uint32
	// Data is the member's contents.
	Data []byte
	// LinkedModuleCRC is the CRC of the module the detached signature was made
	// for. It is 0 unless AttrLinkedModuleCRC is set.
	LinkedModuleCRC uint32
	// Signature is the detached module signature; empty unless
	// AttrDetachedSignature is set.
	Signature []byte
}

// recordSize returns the encoded size of the record.
func (f *File) recordSize() int64 {
	return RecordFixedSize + int64(len(f.Name)) + int64(len(f.LinkedModuleName)) +
		int64(len(f.CoreObjectName)) + int64(len(f.TargetDirectory)) +
		int64(len(f.Data)) + int64(len(f.Signature))
}

// headerSize returns the encoded size of the header.
func (p *Package) headerSize() int64 {
	return HeaderFixedSize + int64(len(p.DriverVersion)) + int64(len(p.Description)) + int64(len(p.ProcVersion))
}

// Size returns the number of bytes Marshal produces.
func (p *Package) Size() int64 {
	n := p.headerSize()
	for i := range p.Files {
		n += p.Files[i].recordSize()
	}
	return n
}

// Parse decodes a package. It accepts exactly the layout mkprecompiled writes
// and never panics; on failure the error wraps ErrCorrupt (and ErrUnsafePath
// for path problems) and names the byte offset and record concerned. The
// returned package does not share memory with b.
func Parse(b []byte) (*Package, error) {
	return parse(b, false)
}

// parseOwned is Parse for a buffer the caller hands over: the members' data and signatures are
// slices of b instead of copies, so a package costs its size in memory once, not twice.
func parseOwned(b []byte) (*Package, error) {
	return parse(b, true)
}

func parse(b []byte, owned bool) (*Package, error) {
	d := decoder{b: b, rec: -1, owned: owned}
	if len(b) < HeaderFixedSize {
		return nil, d.errorf(len(b), "", "input ends: %d bytes is shorter than the %d-byte fixed header", len(b), HeaderFixedSize)
	}
	if string(b[:len(Magic)]) != Magic {
		return nil, d.errorf(firstDiff(string(b[:len(Magic)]), Magic), "magic", "got % x, want % x (\\aNVIDIA\\a)", b[:len(Magic)], Magic)
	}
	d.off = len(Magic)
	version, _ := d.u32("format version")
	if version != FormatVersion {
		return nil, d.errorf(d.off-4, "format version", "got %d, want %d", version, FormatVersion)
	}
	p := &Package{}
	var err error
	if p.DriverVersion, err = d.str("driver version"); err != nil {
		return nil, err
	}
	if p.DriverVersion == "" {
		return nil, d.errorf(d.off-4, "driver version", "empty")
	}
	if p.Description, err = d.str("description"); err != nil {
		return nil, err
	}
	if p.ProcVersion, err = d.str("proc version"); err != nil {
		return nil, err
	}
	n, err := d.u32("file count")
	if err != nil {
		return nil, err
	}
	if rem := d.remaining(); uint64(n)*RecordFixedSize > uint64(rem) {
		return nil, d.errorf(d.off-4, "file count", "%d records need at least %d bytes, only %d remain",
			n, uint64(n)*RecordFixedSize, rem)
	}
	// Grow with the records actually read rather than trusting n.
	p.Files = make([]File, 0, min(n, 64))
	for i := 0; i < int(n); i++ {
		d.rec = i
		var f File
		if err := d.record(&f); err != nil {
			return nil, err
		}
		p.Files = append(p.Files, f)
	}
	d.rec = -1
	if rem := d.remaining(); rem != 0 {
		return nil, d.errorf(d.off, "", "%d trailing bytes after the last record", rem)
	}
	return p, nil
}

// Read reads a whole package from r (at most MaxPackageSize bytes) and parses
// it.
func Read(r io.Reader) (*Package, error) {
	b, err := readLimited(r, 0, MaxPackageSize)
	if err != nil {
		return nil, err
	}
	return parseOwned(b)
}

// ReadFile reads and parses the package file at path.
func ReadFile(path string) (*Package, error) {
	b, err := readFileLimited(path)
	if err != nil {
		return nil, err
	}
	p, err := parseOwned(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return p, nil
}

// readFileLimited reads the file at path, refusing one over MaxPackageSize: a package, or a file
// that is to become a member of one.
func readFileLimited(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := readSized(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return b, nil
}

// readSized reads all of f, refusing more than MaxPackageSize. The buffer is sized from the
// file's size up front: grown by doubling instead, a package would cost about twice its size in
// copies and garbage before the first byte is checked.
func readSized(f *os.File) ([]byte, error) {
	var hint int64
	if st, err := f.Stat(); err == nil && st.Mode().IsRegular() {
		if st.Size() > MaxPackageSize {
			return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, st.Size(), MaxPackageSize)
		}
		hint = st.Size()
	}
	return readLimited(f, hint, MaxPackageSize)
}

// readLimited reads all of r, failing with ErrTooLarge beyond limit bytes.
// hint, when positive, is the expected size.
func readLimited(r io.Reader, hint, limit int64) ([]byte, error) {
	buf := new(bytes.Buffer)
	if hint > 0 && hint <= limit {
		// Room for EOF's read too, so the buffer is never grown and copied.
		buf = bytes.NewBuffer(make([]byte, 0, int(hint)+bytes.MinRead))
	}
	n, err := buf.ReadFrom(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if n > limit {
		return nil, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, limit)
	}
	return buf.Bytes(), nil
}

// decoder walks the input; rec is the current record index or -1 for the
// header.
type decoder struct {
	b   []byte
	off int
	rec int
	// name of the current record, once known, for messages.
	name string
	// owned: the members may keep slices of b (parseOwned).
	owned bool
}

func (d *decoder) remaining() int { return len(d.b) - d.off }

// errorf builds an ErrCorrupt error for the field at offset off.
func (d *decoder) errorf(off int, field, format string, args ...any) error {
	return fmt.Errorf("%w: %s: %s", ErrCorrupt, d.where(off, field), fmt.Sprintf(format, args...))
}

// where describes offset off: the record (or header) and the field.
func (d *decoder) where(off int, field string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "offset %d", off)
	switch {
	case d.rec >= 0 && d.name != "":
		fmt.Fprintf(&b, " (file record %d %q", d.rec, d.name)
	case d.rec >= 0:
		fmt.Fprintf(&b, " (file record %d", d.rec)
	case field != "":
		b.WriteString(" (header")
	default:
		return b.String()
	}
	if field != "" {
		fmt.Fprintf(&b, ", %s", field)
	}
	b.WriteString(")")
	return b.String()
}

func (d *decoder) u32(field string) (uint32, error) {
	if d.remaining() < 4 {
		return 0, d.errorf(d.off, field, "truncated: need 4 bytes, %d remain", d.remaining())
	}
	v := binary.LittleEndian.Uint32(d.b[d.off:])
	d.off += 4
	return v, nil
}

// bytes reads a length-prefixed field and returns a slice of the input.
func (d *decoder) bytes(field string) ([]byte, error) {
	n, err := d.u32(field + " length")
	if err != nil {
		return nil, err
	}
	if uint64(n) > uint64(d.remaining()) {
		return nil, d.errorf(d.off-4, field, "length %d exceeds the %d bytes remaining", n, d.remaining())
	}
	v := d.b[d.off : d.off+int(n)]
	d.off += int(n)
	return v, nil
}

// keep returns v for the package to hold: v itself when the decoder owns its input, else a copy.
func (d *decoder) keep(v []byte) []byte {
	if d.owned {
		return v[:len(v):len(v)] // an append to a member never writes into the next
	}
	return bytes.Clone(v)
}

func (d *decoder) str(field string) (string, error) {
	v, err := d.bytes(field)
	return string(v), err
}

func (d *decoder) tag(field, want string) error {
	if d.remaining() < len(want) {
		return d.errorf(d.off, field, "truncated: need %d bytes, %d remain", len(want), d.remaining())
	}
	if got := d.b[d.off : d.off+len(want)]; string(got) != want {
		return d.errorf(d.off, field, "got %q, want %q", got, want)
	}
	d.off += len(want)
	return nil
}

// pathField reads a length-prefixed path and checks it with check.
func (d *decoder) pathField(field string, check func(string) error) (string, error) {
	start := d.off
	s, err := d.str(field)
	if err != nil {
		return "", err
	}
	if err := check(s); err != nil {
		return "", fmt.Errorf("%w: %s: %w", ErrCorrupt, d.where(start, field), err)
	}
	return s, nil
}

func (d *decoder) record(f *File) error {
	d.name = ""
	start := d.off
	if err := d.tag("record start", recordStart); err != nil {
		return err
	}
	idx, err := d.u32("index")
	if err != nil {
		return err
	}
	if idx != uint32(d.rec) {
		return d.errorf(d.off-4, "index", "got %d, want %d (record at offset %d)", idx, d.rec, start)
	}
	f.Index = idx
	typ, err := d.u32("type")
	if err != nil {
		return err
	}
	if FileType(typ) != KernelInterface && FileType(typ) != KernelModule {
		return d.errorf(d.off-4, "type", "unknown type %d", typ)
	}
	f.Type = FileType(typ)
	attr, err := d.u32("attributes")
	if err != nil {
		return err
	}
	if unknown := Attr(attr) &^ attrKnown; unknown != 0 {
		return d.errorf(d.off-4, "attributes", "unknown attribute bits %#x in %#x", uint32(unknown), attr)
	}
	f.Attributes = Attr(attr)
	if f.Name, err = d.pathField("name", checkName); err != nil {
		return err
	}
	d.name = f.Name
	if f.LinkedModuleName, err = d.pathField("linked module name", checkRelPath); err != nil {
		return err
	}
	if f.CoreObjectName, err = d.pathField("core object name", checkRelPath); err != nil {
		return err
	}
	if f.TargetDirectory, err = d.pathField("target directory", checkRelPath); err != nil {
		return err
	}
	crcOff := d.off
	if f.CRC, err = d.u32("crc"); err != nil {
		return err
	}
	data, err := d.bytes("data")
	if err != nil {
		return err
	}
	crc2, err := d.u32("second crc copy")
	if err != nil {
		return err
	}
	if crc2 != f.CRC {
		return d.errorf(d.off-4, "second crc copy", "%08x differs from the first copy %08x at offset %d", crc2, f.CRC, crcOff)
	}
	if want := StoredCRC(data); f.CRC != want {
		return d.errorf(crcOff, "crc", "stored crc %08x, but the %d data bytes have crc %08x", f.CRC, len(data), want)
	}
	if f.LinkedModuleCRC, err = d.u32("linked module crc"); err != nil {
		return err
	}
	if f.LinkedModuleCRC != 0 && f.Attributes&AttrLinkedModuleCRC == 0 {
		return d.errorf(d.off-4, "linked module crc", "%08x set without the linked module crc attribute", f.LinkedModuleCRC)
	}
	sigOff := d.off
	sig, err := d.bytes("signature")
	if err != nil {
		return err
	}
	if len(sig) != 0 && f.Attributes&AttrDetachedSignature == 0 {
		return d.errorf(sigOff, "signature", "%d signature bytes without the detached signature attribute", len(sig))
	}
	idx2, err := d.u32("second index copy")
	if err != nil {
		return err
	}
	if idx2 != idx {
		return d.errorf(d.off-4, "second index copy", "got %d, want %d", idx2, idx)
	}
	if err := d.tag("record end", recordEnd); err != nil {
		return err
	}
	if len(data) > 0 {
		f.Data = d.keep(data)
	}
	if len(sig) > 0 {
		f.Signature = d.keep(sig)
	}
	return nil
}

// checkName checks a member name: a non-empty plain file name.
func checkName(s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%w: empty name", ErrUnsafePath)
	case s == "." || s == "..":
		return fmt.Errorf("%w: name %q is not a file name", ErrUnsafePath, s)
	case strings.ContainsRune(s, '/'):
		return fmt.Errorf("%w: name %q contains a slash", ErrUnsafePath, s)
	}
	return checkRelPath(s)
}

// checkRelPath checks a relative path: empty, or relative without ".."
// elements or NUL bytes. It does not clean the path.
func checkRelPath(s string) error {
	switch {
	case s == "":
		return nil
	case strings.ContainsRune(s, 0):
		return fmt.Errorf("%w: %q contains a NUL byte", ErrUnsafePath, s)
	case strings.HasPrefix(s, "/"):
		return fmt.Errorf("%w: %q is absolute", ErrUnsafePath, s)
	}
	for elem := range strings.SplitSeq(s, "/") {
		if elem == ".." {
			return fmt.Errorf("%w: %q has a \"..\" element", ErrUnsafePath, s)
		}
	}
	return nil
}

// Validate reports whether p can be written: everything Parse checks, with
// indices equal to positions and CRCs equal to StoredCRC of the data. Errors
// wrap ErrInvalid (and ErrUnsafePath for path problems).
func (p *Package) Validate() error { return p.validate(true) }

// validate is Validate, with the members' CRCs recomputed only when crc is set.
func (p *Package) validate(crc bool) error {
	if p.DriverVersion == "" {
		return fmt.Errorf("%w: empty driver version", ErrInvalid)
	}
	for _, s := range []struct{ field, v string }{
		{"driver version", p.DriverVersion}, {"description", p.Description}, {"proc version", p.ProcVersion},
	} {
		if len(s.v) > math.MaxUint32 {
			return fmt.Errorf("%w: %s is %d bytes, over the 4 GiB field limit", ErrInvalid, s.field, len(s.v))
		}
	}
	if len(p.Files) > math.MaxUint32 {
		return fmt.Errorf("%w: %d files", ErrInvalid, len(p.Files))
	}
	for i := range p.Files {
		if err := p.Files[i].validate(i, crc); err != nil {
			return err
		}
	}
	return nil
}

func (f *File) validate(i int, crc bool) error {
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w: file %d (%q): %s", ErrInvalid, i, f.Name, fmt.Sprintf(format, args...))
	}
	failPath := func(field string, err error) error {
		return fmt.Errorf("%w: file %d (%q): %s: %w", ErrInvalid, i, f.Name, field, err)
	}
	if uint64(f.Index) != uint64(i) {
		return fail("index %d does not match its position", f.Index)
	}
	if f.Type != KernelInterface && f.Type != KernelModule {
		return fail("unknown type %d", uint32(f.Type))
	}
	if unknown := f.Attributes &^ attrKnown; unknown != 0 {
		return fail("unknown attribute bits %#x", uint32(unknown))
	}
	for _, c := range []struct {
		field, v string
		check    func(string) error
	}{
		{"name", f.Name, checkName},
		{"linked module name", f.LinkedModuleName, checkRelPath},
		{"core object name", f.CoreObjectName, checkRelPath},
		{"target directory", f.TargetDirectory, checkRelPath},
	} {
		if err := c.check(c.v); err != nil {
			return failPath(c.field, err)
		}
		if len(c.v) > math.MaxUint32 {
			return fail("%s is %d bytes, over the 4 GiB field limit", c.field, len(c.v))
		}
	}
	if len(f.Data) > math.MaxUint32 || len(f.Signature) > math.MaxUint32 {
		return fail("data or signature over the 4 GiB field limit")
	}
	if crc {
		if want := StoredCRC(f.Data); f.CRC != want {
			return fail("crc %08x does not match the data's crc %08x", f.CRC, want)
		}
	}
	if f.LinkedModuleCRC != 0 && f.Attributes&AttrLinkedModuleCRC == 0 {
		return fail("linked module crc %08x set without the linked module crc attribute", f.LinkedModuleCRC)
	}
	if len(f.Signature) != 0 && f.Attributes&AttrDetachedSignature == 0 {
		return fail("signature set without the detached signature attribute")
	}
	return nil
}

// Marshal returns the package in the byte layout mkprecompiled writes. It
// fails, wrapping ErrInvalid, if p does not pass Validate.
func (p *Package) Marshal() ([]byte, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	size := p.Size()
	if size > math.MaxInt {
		return nil, fmt.Errorf("%w: %d bytes", ErrTooLarge, size)
	}
	var buf bytes.Buffer
	buf.Grow(int(size))
	if _, err := p.encode(&buf); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// MarshalBinary implements encoding.BinaryMarshaler; it is Marshal.
func (p *Package) MarshalBinary() ([]byte, error) { return p.Marshal() }

// UnmarshalBinary implements encoding.BinaryUnmarshaler; it is Parse.
func (p *Package) UnmarshalBinary(b []byte) error {
	q, err := Parse(b)
	if err != nil {
		return err
	}
	*p = *q
	return nil
}

// WriteTo writes the package to w in the layout mkprecompiled writes,
// implementing io.WriterTo. It fails, wrapping ErrInvalid, before writing
// anything if p does not pass Validate.
func (p *Package) WriteTo(w io.Writer) (int64, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	bw := bufio.NewWriterSize(w, 64<<10)
	n, err := p.encode(bw)
	if err != nil {
		return n, err
	}
	// encode counts bytes handed to bw; a failed flush means not all of them
	// reached w, so report what bw says is still buffered.
	if err := bw.Flush(); err != nil {
		return n - int64(bw.Buffered()), err
	}
	return n, nil
}

// encode writes the validated package to w and returns the bytes written.
func (p *Package) encode(w io.Writer) (int64, error) {
	e := encoder{w: w}
	e.raw([]byte(Magic))
	e.u32(FormatVersion)
	e.str(p.DriverVersion)
	e.str(p.Description)
	e.str(p.ProcVersion)
	e.u32(uint32(len(p.Files)))
	for i := range p.Files {
		f := &p.Files[i]
		e.raw([]byte(recordStart))
		e.u32(uint32(i))
		e.u32(uint32(f.Type))
		e.u32(uint32(f.Attributes))
		e.str(f.Name)
		e.str(f.LinkedModuleName)
		e.str(f.CoreObjectName)
		e.str(f.TargetDirectory)
		e.u32(f.CRC)
		e.u32(uint32(len(f.Data)))
		e.raw(f.Data)
		e.u32(f.CRC)
		e.u32(f.LinkedModuleCRC)
		e.u32(uint32(len(f.Signature)))
		e.raw(f.Signature)
		e.u32(uint32(i))
		e.raw([]byte(recordEnd))
	}
	return e.n, e.err
}

// encoder writes to w, remembering the first error.
type encoder struct {
	w       io.Writer
	n       int64
	err     error
	scratch [4]byte
}

func (e *encoder) raw(b []byte) {
	if e.err != nil || len(b) == 0 {
		return
	}
	n, err := e.w.Write(b)
	e.n += int64(n)
	e.err = err
}

func (e *encoder) u32(v uint32) {
	binary.LittleEndian.PutUint32(e.scratch[:], v)
	e.raw(e.scratch[:])
}

func (e *encoder) str(s string) {
	e.u32(uint32(len(s)))
	if e.err == nil && s != "" {
		n, err := io.WriteString(e.w, s)
		e.n += int64(n)
		e.err = err
	}
}

// Header is a package's header: everything before the first record.
type Header struct {
	DriverVersion, Description, ProcVersion string
	// Files is the number of records the header announces.
	Files int
}

// maxHeaderSize bounds the header ReadHeader accepts.
const maxHeaderSize = 1 << 20

// ReadHeader reads only the header of the package in r, leaving the records unread (at most
// 1 MiB of r is consumed), for callers that must not hold a large package in memory.
func ReadHeader(r io.Reader) (Header, error) {
	b := make([]byte, maxHeaderSize)
	n, err := io.ReadFull(r, b)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) {
		if errors.Is(err, io.EOF) {
			return Header{}, errors.New("empty package")
		}
		return Header{}, err
	}
	b = b[:n]
	d := decoder{b: b, rec: -1}
	if len(b) < HeaderFixedSize {
		return Header{}, d.errorf(len(b), "", "input ends: %d bytes is shorter than the %d-byte fixed header", len(b), HeaderFixedSize)
	}
	if string(b[:len(Magic)]) != Magic {
		return Header{}, d.errorf(0, "magic", "got % x, want % x (\\aNVIDIA\\a)", b[:len(Magic)], Magic)
	}
	d.off = len(Magic)
	if version, _ := d.u32("format version"); version != FormatVersion {
		return Header{}, d.errorf(d.off-4, "format version", "got %d, want %d", version, FormatVersion)
	}
	var h Header
	if h.DriverVersion, err = d.str("driver version"); err != nil {
		return Header{}, err
	}
	if h.Description, err = d.str("description"); err != nil {
		return Header{}, err
	}
	if h.ProcVersion, err = d.str("proc version"); err != nil {
		return Header{}, err
	}
	count, err := d.u32("file count")
	if err != nil {
		return Header{}, err
	}
	h.Files = int(count)
	return h, nil
}
