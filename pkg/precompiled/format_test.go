package precompiled

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"testing"
)

// bitwiseCRC is an independent, bit-at-a-time CRC-32/MPEG-2.
func bitwiseCRC(data []byte) uint32 {
	crc := uint32(0xFFFFFFFF)
	for _, b := range data {
		for i := 7; i >= 0; i-- {
			bit := uint32(b>>i) & 1
			top := crc >> 31
			crc <<= 1
			if top^bit != 0 {
				crc ^= 0x04C11DB7
			}
		}
	}
	return crc
}

func TestChecksum(t *testing.T) {
	t.Parallel()
	if got := Checksum([]byte("123456789")); got != 0x0376E6E7 {
		t.Errorf("Checksum(123456789) = %08x, want 0376e6e7", got)
	}
	if got := Checksum(nil); got != 0xFFFFFFFF {
		t.Errorf("Checksum(nil) = %08x, want ffffffff", got)
	}
	if got := StoredCRC(nil); got != 0 {
		t.Errorf("StoredCRC(nil) = %08x, want 0", got)
	}
	if got := StoredCRC([]byte{0x5A}); got != 0x1915c265 {
		t.Errorf("StoredCRC(5a) = %08x, want 1915c265", got)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for n := range 300 {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		if got, want := Checksum(b), bitwiseCRC(b); got != want {
			t.Fatalf("len %d: table %08x, bitwise %08x", n, got, want)
		}
	}
	// Eight bytes per step: any start and length within a large buffer gives the bitwise result.
	big := make([]byte, 1<<20+13)
	for i := range big {
		big[i] = byte(r.Uint32())
	}
	for _, c := range [][2]int{{0, len(big)}, {1, len(big)}, {3, 1 << 20}, {7, 7 + 8*1000 + 5}, {5, 5 + 16}} {
		b := big[c[0]:c[1]]
		if got, want := Checksum(b), bitwiseCRC(b); got != want {
			t.Errorf("bytes %d..%d: table %08x, bitwise %08x", c[0], c[1], got, want)
		}
	}
}

func BenchmarkChecksum(b *testing.B) {
	data := make([]byte, 1<<20)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		Checksum(data)
	}
}

// raw builds test input: uint32 values little-endian, strings and byte
// slices verbatim, lstr values length-prefixed.
type lstr string

func raw(parts ...any) []byte {
	var b []byte
	for _, p := range parts {
		switch v := p.(type) {
		case uint32:
			b = binary.LittleEndian.AppendUint32(b, v)
		case int:
			b = binary.LittleEndian.AppendUint32(b, uint32(v))
		case string:
			b = append(b, v...)
		case []byte:
			b = append(b, v...)
		case []any:
			b = append(b, raw(v...)...)
		case lstr:
			b = binary.LittleEndian.AppendUint32(b, uint32(len(v)))
			b = append(b, v...)
		default:
			panic("raw: bad part")
		}
	}
	return b
}

// recordFields returns the parts of a valid module record with index 0
// holding "hello"; tests replace parts to corrupt it.
func recordFields() []any {
	data := "hello"
	crc := Checksum([]byte(data))
	return []any{
		"FILE", 0, 1, 0, // tag, index, type, attributes
		lstr("m.ko"), lstr(""), lstr(""), lstr("."), // 4..7: names
		crc, lstr(data), crc, // 8..10
		0, lstr(""), 0, "END.", // 11..14: linked crc, signature, index, end
	}
}

func header(nfiles int) []any {
	return []any{Magic, 2, lstr("1.0"), lstr("desc"), lstr("Linux version x"), nfiles}
}

func pkgWith(records ...[]any) []byte {
	parts := header(len(records))
	for _, r := range records {
		parts = append(parts, r...)
	}
	return raw(parts...)
}

func with(rec []any, i int, v any) []any {
	rec = append([]any(nil), rec...)
	rec[i] = v
	return rec
}

func TestParseSmallValid(t *testing.T) {
	t.Parallel()
	b := pkgWith(recordFields())
	p, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Files) != 1 || string(p.Files[0].Data) != "hello" || p.Files[0].Name != "m.ko" {
		t.Fatalf("parsed %+v", p)
	}
	out, err := p.Marshal()
	if err != nil || !bytes.Equal(out, b) {
		t.Fatalf("round trip: %v", err)
	}
	var u Package
	if err := u.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if mb, err := u.MarshalBinary(); err != nil || !bytes.Equal(mb, b) {
		t.Fatalf("MarshalBinary round trip: %v", err)
	}
	// The parsed package does not alias the input.
	b[len(b)-30] ^= 0xFF
	if string(p.Files[0].Data) != "hello" {
		t.Fatal("Parse result aliases its input")
	}
	// An empty member stores CRC 0.
	empty := pkgWith(with(with(with(recordFields(), 8, 0), 9, lstr("")), 10, 0))
	if _, err := Parse(empty); err != nil {
		t.Fatalf("empty member with crc 0: %v", err)
	}
	ff := uint32(0xFFFFFFFF)
	if _, err := Parse(pkgWith(with(with(with(recordFields(), 8, ff), 9, lstr("")), 10, ff))); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("empty member with crc ffffffff: %v", err)
	}
	// Zero files is a valid package.
	if _, err := Parse(pkgWith()); err != nil {
		t.Fatal(err)
	}
}

func TestParseRejects(t *testing.T) {
	t.Parallel()
	rec := recordFields()
	crc := Checksum([]byte("hello"))
	huge := uint32(0xFFFFFFFF)
	// Offsets: header is 28 + 3 + 4 + 15 = 50 bytes, so the record starts at
	// 50; name length at 66.
	tests := []struct {
		name   string
		in     []byte
		unsafe bool
		want   []string
	}{
		{"empty input", nil, false, []string{"0 bytes", "28-byte"}},
		{"bad magic", raw("\aNVIDIA!", 2, lstr("1"), lstr(""), lstr(""), 0), false, []string{"offset 7", "magic"}},
		{"version 3", raw(Magic, 3, lstr("1"), lstr(""), lstr(""), 0), false, []string{"offset 8", "format version", "got 3"}},
		{"empty driver version", raw(Magic, 2, lstr(""), lstr(""), lstr("p"), 0, 0), false, []string{"driver version", "empty"}},
		{"driver version overflow", raw(Magic, 2, huge, strings.Repeat("x", 20)), false, []string{"offset 12", "driver version", "length 4294967295 exceeds"}},
		{"file count overflow", raw(header(0)[:5], huge), false, []string{"file count", "4294967295 records"}},
		{"file count one too many", pkgWith(rec)[:len(pkgWith(rec))-len(raw(rec...))], false, []string{"1 records need at least 60 bytes, only 0 remain"}},
		{"trailing byte", append(pkgWith(rec), 0), false, []string{"1 trailing bytes"}},
		{"truncated record", pkgWith(rec)[:len(pkgWith(rec))-1], false, []string{"record end", "truncated"}},
		{"bad FILE", pkgWith(with(rec, 0, "FILF")), false, []string{"offset 50", "record start", "FILF"}},
		{"bad END", pkgWith(with(rec, 14, "END!")), false, []string{"record end", "END!"}},
		{"index", pkgWith(with(rec, 1, 1)), false, []string{"offset 54", "index", "got 1, want 0"}},
		{"second index", pkgWith(with(rec, 13, 7)), false, []string{"second index copy", "got 7"}},
		{"unknown type", pkgWith(with(rec, 2, 2)), false, []string{"offset 58", "unknown type 2"}},
		{"unknown attribute", pkgWith(with(rec, 3, 8)), false, []string{"offset 62", "attributes", "unknown attribute bits 0x8"}},
		{"crc copies differ", pkgWith(with(rec, 10, crc^1)), false, []string{"second crc copy", "differs from the first copy"}},
		{"crc wrong", pkgWith(with(with(rec, 8, crc^1), 10, crc^1)), false, []string{"stored crc", "the 5 data bytes have crc"}},
		{"data overflow", pkgWith(with(rec, 9, huge)), false, []string{"data", "length 4294967295 exceeds"}},
		{"linked crc without attribute", pkgWith(with(rec, 11, 5)), false, []string{"linked module crc", "without the linked module crc attribute"}},
		{"signature without attribute", pkgWith(with(rec, 12, lstr("sig"))), false, []string{"signature", "without the detached signature attribute"}},
		{"signature overflow", pkgWith(with(with(rec, 3, 1), 12, huge)), false, []string{"signature", "exceeds"}},
		{"empty name", pkgWith(with(rec, 4, lstr(""))), true, []string{"offset 66", "name", "empty name"}},
		{"dotdot name", pkgWith(with(rec, 4, lstr(".."))), true, []string{"not a file name"}},
		{"slash name", pkgWith(with(rec, 4, lstr("a/b.ko"))), true, []string{"contains a slash"}},
		{"absolute name", pkgWith(with(rec, 4, lstr("/etc/x"))), true, []string{"slash"}},
		{"NUL name", pkgWith(with(rec, 4, lstr("a\x00b"))), true, []string{"NUL"}},
		{"absolute target", pkgWith(with(rec, 7, lstr("/lib/modules"))), true, []string{"target directory", "is absolute"}},
		{"dotdot target", pkgWith(with(rec, 7, lstr("a/../../b"))), true, []string{"target directory", `".." element`}},
		{"dotdot target only", pkgWith(with(rec, 7, lstr(".."))), true, []string{`".." element`}},
		{"NUL target", pkgWith(with(rec, 7, lstr("a\x00"))), true, []string{"NUL"}},
		{"dotdot core object", pkgWith(with(rec, 6, lstr("../nv-kernel.o"))), true, []string{"core object name"}},
		{"absolute linked module", pkgWith(with(rec, 5, lstr("/nvidia.ko"))), true, []string{"linked module name", "absolute"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse(tc.in)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Parse error = %v, want ErrCorrupt", err)
			}
			if errors.Is(err, ErrUnsafePath) != tc.unsafe {
				t.Errorf("errors.Is(ErrUnsafePath) = %v, want %v: %v", !tc.unsafe, tc.unsafe, err)
			}
			for _, s := range tc.want {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not mention %q", err, s)
				}
			}
		})
	}
}

func TestReadTooLarge(t *testing.T) {
	t.Parallel()
	if _, err := readLimited(bytes.NewReader(make([]byte, 101)), 0, 100); !errors.Is(err, ErrTooLarge) {
		t.Errorf("readLimited over the limit: %v", err)
	}
	if b, err := readLimited(bytes.NewReader(make([]byte, 100)), 100, 100); err != nil || len(b) != 100 {
		t.Errorf("readLimited at the limit: %d bytes, %v", len(b), err)
	}
	if _, err := ReadFile(t.TempDir() + "/missing"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("ReadFile missing: %v", err)
	}
	if _, err := Read(io.LimitReader(bytes.NewReader(pkgWith(recordFields())), 40)); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Read truncated: %v", err)
	}
}

// allocBytes returns the heap bytes allocated while running f.
func allocBytes(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// TestParseAllocationBounded parses 1 MiB inputs whose length fields claim
// up to 4 GiB and checks that nothing close to that is allocated.
func TestParseAllocationBounded(t *testing.T) {
	// Not parallel: allocation counting must not see other tests.
	const size = 1 << 20
	const limit = 64 << 20
	pad := func(b []byte) []byte { return append(b, make([]byte, size-len(b))...) }
	huge := uint32(0xFFFFFFFF)
	rec := recordFields()
	inputs := map[string][]byte{
		"driver version length": pad(raw(Magic, 2, huge)),
		"file count":            pad(raw(header(0)[:5], huge)),
		"file count fits":       pad(raw(header(0)[:5], (size-100)/RecordFixedSize)),
		"data length":           pad(pkgWith(with(rec, 9, huge))),
		"data length near end":  pad(raw(append(header(1), rec[:9]...), uint32(size))),
		"signature length":      pad(pkgWith(with(with(rec, 3, 1), 12, huge))),
	}
	for name, in := range inputs {
		if len(in) != size {
			t.Fatalf("%s: input is %d bytes", name, len(in))
		}
		var err error
		n := allocBytes(func() { _, err = Parse(in) })
		if err == nil {
			t.Errorf("%s: parsed", name)
		}
		if n > limit {
			t.Errorf("%s: parsing allocated %d bytes, limit %d", name, n, limit)
		}
		t.Logf("%s: %d bytes allocated: %v", name, n, err)
	}
	// A real 1 MiB package costs about one copy of itself.
	for _, v := range loadVectors(t) {
		if v.name != "one-mib-member" {
			continue
		}
		n := allocBytes(func() {
			if _, err := Parse(v.bin); err != nil {
				t.Error(err)
			}
		})
		if n > 4*uint64(len(v.bin)) {
			t.Errorf("parsing %s allocated %d bytes", v.name, n)
		}
		t.Logf("%s: %d bytes allocated for %d input bytes", v.name, n, len(v.bin))
	}
}

func TestMarshalValidates(t *testing.T) {
	t.Parallel()
	good := func() *Package {
		f, err := NewKernelModule("m.ko", ".", []byte("hello"), false)
		if err != nil {
			t.Fatal(err)
		}
		return &Package{DriverVersion: "1", Files: []File{f}}
	}
	tests := []struct {
		name   string
		mod    func(p *Package)
		unsafe bool
	}{
		{"empty driver version", func(p *Package) { p.DriverVersion = "" }, false},
		{"index", func(p *Package) { p.Files[0].Index = 3 }, false},
		{"type", func(p *Package) { p.Files[0].Type = 9 }, false},
		{"attribute", func(p *Package) { p.Files[0].Attributes = 16 }, false},
		{"crc", func(p *Package) { p.Files[0].Data = []byte("hellO") }, false},
		{"linked crc", func(p *Package) { p.Files[0].LinkedModuleCRC = 1 }, false},
		{"signature", func(p *Package) { p.Files[0].Signature = []byte{1} }, false},
		{"name", func(p *Package) { p.Files[0].Name = "../m.ko" }, true},
		{"target", func(p *Package) { p.Files[0].TargetDirectory = "/tmp" }, true},
	}
	if _, err := good().Marshal(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range tests {
		p := good()
		tc.mod(p)
		_, err := p.Marshal()
		if !errors.Is(err, ErrInvalid) || errors.Is(err, ErrUnsafePath) != tc.unsafe {
			t.Errorf("%s: Marshal error = %v", tc.name, err)
		}
		var buf bytes.Buffer
		if _, err := p.WriteTo(&buf); !errors.Is(err, ErrInvalid) || buf.Len() != 0 {
			t.Errorf("%s: WriteTo error = %v after %d bytes", tc.name, err, buf.Len())
		}
	}
}

func TestPackHelpers(t *testing.T) {
	t.Parallel()
	linked := []byte("linked module bytes")
	signed := append(bytes.Clone(linked), "SIGNATURE"...)
	f, err := NewKernelInterface("nv-linux.o", "nvidia.ko", "nvidia/nv-kernel.o_binary", ".", []byte("obj"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.SetDetachedSignature(linked, signed); err != nil {
		t.Fatal(err)
	}
	if f.Attributes != AttrDetachedSignature|AttrLinkedModuleCRC || string(f.Signature) != "SIGNATURE" ||
		f.LinkedModuleCRC != Checksum(linked) {
		t.Fatalf("after SetDetachedSignature: %+v", f)
	}
	g := f
	if err := g.SetDetachedSignature(linked, linked); !errors.Is(err, ErrInvalid) {
		t.Errorf("signed == linked: %v", err)
	}
	if err := g.SetDetachedSignature(linked, append([]byte("X"), signed...)); !errors.Is(err, ErrInvalid) {
		t.Errorf("signed not starting with linked: %v", err)
	}
	m, err := NewKernelModule("nvidia-signed.ko", "", []byte("ko"), true)
	if err != nil || m.Attributes != AttrEmbeddedSignature {
		t.Fatalf("NewKernelModule signed: %+v %v", m, err)
	}
	if err := m.SetDetachedSignature(linked, signed); !errors.Is(err, ErrInvalid) {
		t.Errorf("detached signature on a module: %v", err)
	}
	if _, err := NewKernelInterface("x.o", "", "core", "", nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("interface without linked module name: %v", err)
	}
	if _, err := NewKernelModule("../x.ko", "", nil, false); !errors.Is(err, ErrUnsafePath) {
		t.Errorf("module with unsafe name: %v", err)
	}
	p := &Package{DriverVersion: "595.71.05"}
	if err := p.Append(f); err != nil {
		t.Fatal(err)
	}
	if err := p.Append(m); err != nil {
		t.Fatal(err)
	}
	if p.Files[1].Index != 1 {
		t.Errorf("Append index = %d", p.Files[1].Index)
	}
	b, err := p.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	q, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	var info strings.Builder
	if err := Info(&info, q); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"attributes: detached signature, linked module crc\n", "signature size: 9\n", "attributes: embedded signature\n"} {
		if !strings.Contains(info.String(), s) {
			t.Errorf("Info lacks %q:\n%s", s, info.String())
		}
	}
	// Path-based helpers.
	dir := t.TempDir()
	writeFile(t, dir+"/a.o", []byte("obj"))
	writeFile(t, dir+"/l.ko", linked)
	writeFile(t, dir+"/s.ko", signed)
	if err := p.AddKernelInterface(dir+"/a.o", "a.ko", "a/core.o", "", dir+"/l.ko", ""); !errors.Is(err, ErrInvalid) {
		t.Errorf("linked module without signed module: %v", err)
	}
	if err := p.AddKernelInterface(dir+"/a.o", "a.ko", "a/core.o", "", dir+"/l.ko", dir+"/s.ko"); err != nil {
		t.Fatal(err)
	}
	if got := p.Files[2]; got.Name != "a.o" || string(got.Signature) != "SIGNATURE" || got.Index != 2 {
		t.Errorf("AddKernelInterface: %+v", got)
	}
	if err := p.AddKernelModule(dir+"/missing.ko", "", false); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("AddKernelModule missing file: %v", err)
	}
}

func TestReadHeaderReadsOnlyTheHeader(t *testing.T) {
	p := &Package{DriverVersion: "535.261.03", Description: "6.1.0-57-amd64", ProcVersion: "Linux version 6.1.0-57-amd64 (x) #1 SMP",
		Files: []File{{Type: KernelModule, Name: "nvidia.ko", TargetDirectory: "modules", Data: bytes.Repeat([]byte{1}, 2<<20)}}}
	p.Files[0].CRC = StoredCRC(p.Files[0].Data)
	b, err := p.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	r := bytes.NewReader(b)
	h, err := ReadHeader(r)
	if err != nil {
		t.Fatal(err)
	}
	if h != (Header{DriverVersion: p.DriverVersion, Description: p.Description, ProcVersion: p.ProcVersion, Files: 1}) {
		t.Errorf("header %+v", h)
	}
	if r.Len() != len(b)-maxHeaderSize {
		t.Errorf("ReadHeader consumed %d bytes, want %d", len(b)-r.Len(), maxHeaderSize)
	}
	for _, bad := range [][]byte{nil, b[:HeaderFixedSize-1], append([]byte("\aNVIDIX\a"), b[8:64]...), b[:40]} {
		if _, err := ReadHeader(bytes.NewReader(bad)); err == nil {
			t.Errorf("ReadHeader(%q) accepted a broken header", bad)
		}
	}
}
