package vmlinuz

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
	"github.com/ulikunitz/xz"
	"github.com/ulikunitz/xz/lzma"
)

var update = flag.Bool("update", false, "regenerate testdata/*.xz and *.bz2 with the xz and bzip2 tools")

const (
	testRelease = "6.6.95-flatcar"
	testHost    = "builder@localhost"
	testVersion = "#1 SMP PREEMPT_DYNAMIC Fri Jul 11 12:34:56 -00 2025"
	testBanner  = "Linux version " + testRelease + " (" + testHost + ") (x86_64-cros-linux-gnu-gcc (Gentoo 13.3.1_p20240614 p17) 13.3.1 20240614, GNU ld (Gentoo 2.42 p6) 2.42.0) " + testVersion
	// testKernelVersion is what arch/x86/boot/version.c puts in the setup code.
	testKernelVersion = testRelease + " (" + testHost + ") " + testVersion
)

// fakeKernel is a stand-in for vmlinux.bin: an ELF magic, pseudo x86 code (with CALL/JMP
// opcodes for the BCJ filter to work on), the banner as the C string linux_banner, more code.
func fakeKernel(seed uint64, size, bannerAt int, banner string) []byte {
	b := x86ish(seed, size)
	copy(b, "\x7fELF\x02\x01\x01")
	s := banner + "\n\x00"
	copy(b[bannerAt:], s)
	return b
}

// x86ish returns size bytes that compress well and are full of E8/E9 followed by 32-bit
// displacements whose top byte is 0x00 or 0xff (what the BCJ filter converts), or not.
func x86ish(seed uint64, size int) []byte {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	ops := [][]byte{{0x55}, {0x48, 0x89, 0xe5}, {0x5d}, {0xc3}, {0x90}, {0x0f, 0x1f, 0x44, 0x00, 0x00}, {0x31, 0xc0}, {0xe8}, {0xe9}, {0xe8, 0xe8}, {0xe9, 0xe8, 0x00}}
	var out bytes.Buffer
	for out.Len() < size {
		op := ops[rng.IntN(len(ops))]
		out.Write(op)
		if op[len(op)-1] == 0xe8 || op[len(op)-1] == 0xe9 {
			var d [4]byte
			binary.LittleEndian.PutUint32(d[:], uint32(rng.IntN(1<<16))*16)
			switch rng.IntN(4) {
			case 0:
				d[3] = 0xff
			case 1:
				d[3] = byte(rng.IntN(256))
			}
			out.Write(d[:rng.IntN(5)])
		}
	}
	return out.Bytes()[:size]
}

// bzImage wraps payload in an x86 boot sector and setup header: setupSects sectors of setup
// code holding kernelVersion ("" for none), protocol 2.15, payload after a 64-byte prefix of the
// protected-mode code, followed by the uncompressed size as the kernel appends it.
func bzImage(setupSects int, kernelVersion string, payload []byte, size int) []byte {
	n := setupSects
	if n == 0 {
		n = 4
	}
	setupEnd := (n + 1) * sectorSize
	img := make([]byte, setupEnd+64)
	img[offSetupSects] = byte(setupSects)
	binary.LittleEndian.PutUint16(img[offBootFlag:], bootFlag)
	copy(img[offHeaderMagic:], "HdrS")
	binary.LittleEndian.PutUint16(img[offVersion:], 0x020f)
	if kernelVersion != "" {
		at := 0x300 // after the setup header, inside the first setup sector
		copy(img[at:], kernelVersion+"\x00")
		binary.LittleEndian.PutUint16(img[offKernelVersion:], uint16(at-0x200))
	}
	binary.LittleEndian.PutUint32(img[offPayloadOffset:], 64)
	binary.LittleEndian.PutUint32(img[offPayloadLength:], uint32(len(payload)+4))
	img = append(img, payload...)
	return binary.LittleEndian.AppendUint32(img, uint32(size))
}

func gzipped(t testing.TB, b []byte) []byte {
	var buf bytes.Buffer
	w, _ := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	w.Write(b)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func xzPlain(t testing.TB, b []byte, dictCap int) []byte {
	var buf bytes.Buffer
	w, err := xz.WriterConfig{CheckSum: xz.CRC32, DictCap: dictCap}.NewWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(b)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// zstdWindow rewrites the window descriptor of a zstd frame without the single-segment flag to
// declare a window of 2^log bytes (a larger window than the data needs is valid).
func zstdWindow(t testing.TB, b []byte, log int) []byte {
	t.Helper()
	if len(b) < 6 || b[4]&0x20 != 0 {
		t.Fatalf("not a zstd frame with a window descriptor: % x", b[:min(len(b), 6)])
	}
	b = bytes.Clone(b)
	b[5] = byte(log-10) << 3
	return b
}

func zstded(t testing.TB, b []byte, opts ...zstd.EOption) []byte {
	enc, err := zstd.NewWriter(nil, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer enc.Close()
	return enc.EncodeAll(b, nil)
}

// lz4Legacy packs b as the kernel's `lz4 -l` does: the legacy frame format.
func lz4Legacy(t testing.TB, b []byte) []byte {
	var buf bytes.Buffer
	w := lz4.NewWriter(&buf)
	if err := w.Apply(lz4.LegacyOption(true)); err != nil {
		t.Fatal(err)
	}
	w.Write(b)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func lzmaed(t testing.TB, b []byte) []byte {
	var buf bytes.Buffer
	w, err := lzma.WriterConfig{DictCap: 1 << 20, Size: int64(len(b))}.NewWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(b)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// Fixtures made by the real tools (see testdata/README.md): the payload is fixturePayload().
const (
	fixtureX86XZ = "testdata/x86-bcj.xz" // xz --format=xz --check=crc32 --x86 --lzma2=preset=6
	fixtureBzip2 = "testdata/kernel.bz2" // bzip2 -9
)

func fixturePayload() []byte { return fakeKernel(7, 96<<10, 70000, testBanner) }

// TestFixtures checks (or with -update, rewrites) the fixtures made with xz and bzip2.
func TestFixtures(t *testing.T) {
	payload := fixturePayload()
	for _, f := range []struct {
		path string
		cmd  []string
		pkg  string
	}{
		{fixtureX86XZ, []string{"xz", "--format=xz", "--check=crc32", "--x86", "--lzma2=preset=6", "--stdout"}, "xz-utils"},
		{fixtureBzip2, []string{"bzip2", "-9", "--stdout"}, "bzip2"},
	} {
		if *update {
			if _, err := exec.LookPath(f.cmd[0]); err != nil {
				t.Fatalf("-update needs %s: apt-get install -y %s", f.cmd[0], f.pkg)
			}
			cmd := exec.Command(f.cmd[0], f.cmd[1:]...)
			cmd.Stdin = bytes.NewReader(payload)
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("%s: %v", f.cmd[0], err)
			}
			if err := os.WriteFile(f.path, out, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := os.Stat(f.path); err != nil {
			t.Fatalf("fixture %s: %v (regenerate with go test -run TestFixtures -update)", f.path, err)
		}
	}
}

func readFixture(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (regenerate with go test -run TestFixtures -update)", err)
	}
	return b
}

// TestXZBCJ decodes a stream made by `xz --x86` whole: the BCJ x86 decoding must give back the
// payload byte for byte, and the block's CRC32 (over the decoded data) must match.
func TestXZBCJ(t *testing.T) {
	packed := readFixture(t, fixtureX86XZ)
	bh, err := parseXZBlockHeader(packed[12:])
	if err != nil {
		t.Fatal(err)
	}
	if !bh.x86 {
		t.Fatalf("%s has no BCJ x86 filter: regenerate it", fixtureX86XZ)
	}
	r, err := newXZReader(packed, DefaultMaxWindow)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	want := fixturePayload()
	if !bytes.Equal(got, want) {
		i := 0
		for i < min(len(got), len(want)) && got[i] == want[i] {
			i++
		}
		t.Fatalf("decoded %d bytes, want %d; first difference at %d", len(got), len(want), i)
	}
	// The filter had work to do: the stream without BCJ decoding differs from the payload.
	lz, err := lzma.Reader2Config{DictCap: int(bh.dictCap)}.NewReader2(bytes.NewReader(packed[12+bh.size:]))
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(lz)
	if bytes.Equal(raw, want) {
		t.Fatal("the fixture's BCJ filter changed nothing: the test proves nothing")
	}
}

// TestXZCorrupt: a damaged stream is an error, not wrong data.
func TestXZCorrupt(t *testing.T) {
	packed := readFixture(t, fixtureX86XZ)
	for name, c := range map[string]struct {
		mutate func(b []byte)
		want   string
	}{
		"check": {func(b []byte) {
			// The block's CRC32 is the 4 bytes before the index; the footer says how long that is.
			index := (int(binary.LittleEndian.Uint32(b[len(b)-8:])) + 1) * 4
			b[len(b)-12-index-4] ^= 1
		}, "block check mismatch"},
		"stream flags": {func(b []byte) { b[7] = 0x03 }, "stream header CRC"},
		"block header": {func(b []byte) { b[13] ^= 0x40 }, "block header CRC"},
		"truncated":    {func(b []byte) { clear(b[len(b)/2:]) }, ""},
	} {
		t.Run(name, func(t *testing.T) {
			b := bytes.Clone(packed)
			c.mutate(b)
			r, err := newXZReader(b, DefaultMaxWindow)
			if err == nil {
				_, err = io.ReadAll(r)
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err %v, want one saying %q", err, c.want)
			}
		})
	}
}

func TestBannerCompressions(t *testing.T) {
	kernel := fakeKernel(1, 200<<10, 150000, testBanner)
	fixture := fixturePayload()
	cases := []struct {
		format  string
		payload []byte
		size    int
	}{
		{CompressionGzip, gzipped(t, kernel), len(kernel)},
		{CompressionXZ, xzPlain(t, kernel, 1<<20), len(kernel)},
		{CompressionXZ, readFixture(t, fixtureX86XZ), len(fixture)},
		{CompressionZstd, zstded(t, kernel), len(kernel)},
		// The 128 MiB window that x86 images made with the kernel's zstd -22 --ultra declare
		// (Debian's 6.12).
		{CompressionZstd, zstdWindow(t, zstded(t, kernel, zstd.WithSingleSegment(false)), 27), len(kernel)},
		{CompressionLZ4, lz4Legacy(t, kernel), len(kernel)},
		{CompressionLZMA, lzmaed(t, kernel), len(kernel)},
		{CompressionBzip2, readFixture(t, fixtureBzip2), len(fixture)},
	}
	for i, c := range cases {
		t.Run(fmt.Sprintf("%d-%s", i, c.format), func(t *testing.T) {
			img := bzImage(3, testKernelVersion, c.payload, c.size)
			res, err := Banner(img, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if res.Banner != testBanner {
				t.Errorf("banner %q\nwant   %q", res.Banner, testBanner)
			}
			if res.Compression != c.format {
				t.Errorf("compression %q, want %q", res.Compression, c.format)
			}
			if res.Header == nil || res.Header.KernelVersion != testKernelVersion || res.Offset != res.Header.PayloadOffset {
				t.Errorf("header %+v, offset %d", res.Header, res.Offset)
			}
		})
	}
}

// TestBannerAcrossChunks puts the banner across the 64 KiB read boundary at every offset.
func TestBannerAcrossChunks(t *testing.T) {
	for at := 65536 - len(testBanner) - 3; at <= 65536+1; at += 7 {
		k := fakeKernel(2, 140<<10, at, testBanner)
		res, err := Banner(bzImage(1, testKernelVersion, gzipped(t, k), len(k)), Options{})
		if err != nil || res.Banner != testBanner {
			t.Fatalf("banner at %d: %q, %v", at, res.Banner, err)
		}
	}
}

// TestBannerPicksTheOneThatAgrees: a placeholder banner (another version string) before the
// real one is passed over; with only disagreeing banners the answer is an error, not a guess.
func TestBannerPicksTheOneThatAgrees(t *testing.T) {
	placeholder := strings.Replace(testBanner, testVersion, "#1 SMP (placeholder)", 1)
	k := fakeKernel(3, 120<<10, 30000, placeholder)
	copy(k[90000:], testBanner+"\n\x00")
	res, err := Banner(bzImage(1, testKernelVersion, gzipped(t, k), len(k)), Options{})
	if err != nil || res.Banner != testBanner {
		t.Fatalf("got %q, %v; want the second banner", res.Banner, err)
	}

	only := fakeKernel(3, 120<<10, 30000, placeholder)
	_, err = Banner(bzImage(1, testKernelVersion, gzipped(t, only), len(only)), Options{})
	if err == nil || !strings.Contains(err.Error(), "refusing to guess") {
		t.Fatalf("only a disagreeing banner: err %v, want a refusal", err)
	}

	// Without a kernel_version in the header, the first banner line is taken.
	res, err = Banner(bzImage(1, "", gzipped(t, k), len(k)), Options{})
	if err != nil || res.Banner != placeholder {
		t.Fatalf("no kernel_version: got %q, %v; want the first banner", res.Banner, err)
	}
}

// TestBannerNotCString: "Linux version " text that is not a whole C string line is not a banner.
func TestBannerNotCString(t *testing.T) {
	for name, s := range map[string]string{
		"no NUL after the newline": testBanner + "\nmore",
		"control character":        "Linux version 6.6\x01 (x) (y) #1\n\x00",
		"no newline":               "Linux version " + strings.Repeat("x", maxBanner+10) + "\n\x00",
		"printf format":            "Linux version %s (%s) %s\n\x00",
	} {
		t.Run(name, func(t *testing.T) {
			k := x86ish(4, 100<<10)
			copy(k[5000:], s)
			_, err := Banner(bzImage(1, testKernelVersion, gzipped(t, k), len(k)), Options{})
			if !errors.Is(err, ErrNoBanner) && !strings.Contains(fmt.Sprint(err), "refusing to guess") {
				t.Fatalf("err %v, want no banner", err)
			}
		})
	}
}

// TestBannerWithoutSetupHeader: a raw compressed kernel and an uncompressed one are searched too.
func TestBannerWithoutSetupHeader(t *testing.T) {
	k := fakeKernel(5, 100<<10, 60000, testBanner)
	for name, c := range map[string]struct {
		data   []byte
		format string
		offset int64
	}{
		"uncompressed":         {k, CompressionNone, 0},
		"zstd after junk":      {append(bytes.Repeat([]byte{0x28, 0xb5}, 500), zstded(t, k)...), CompressionZstd, 1000},
		"gzip after a decoy":   {append(append([]byte{0x1f, 0x8b, 0x08, 0, 0, 0}, make([]byte, 100)...), gzipped(t, k)...), CompressionGzip, 106},
		"bzImage, bad payload": {bzImage(1, testKernelVersion, append([]byte("junk"), gzipped(t, k)...), len(k)), CompressionGzip, 2*512 + 64 + 4},
	} {
		t.Run(name, func(t *testing.T) {
			res, err := Banner(c.data, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if res.Banner != testBanner || res.Compression != c.format || res.Offset != c.offset {
				t.Fatalf("got %q %s at %d, want %s at %d", res.Banner, res.Compression, res.Offset, c.format, c.offset)
			}
		})
	}
}

// TestBannerLimits: the window and output bounds are enforced; an lzo payload gets a clear error.
func TestBannerLimits(t *testing.T) {
	k := fakeKernel(6, 300<<10, 250000, testBanner)
	img := bzImage(1, testKernelVersion, xzPlain(t, k, 8<<20), len(k))
	_, err := Banner(img, Options{MaxWindow: 1 << 20})
	if err == nil || !strings.Contains(err.Error(), "larger than the limit") {
		t.Errorf("xz dictionary over the limit: err %v", err)
	}
	img = bzImage(1, testKernelVersion, gzipped(t, k), len(k))
	if _, err := Banner(img, Options{MaxOutput: 200000}); !errors.Is(err, ErrNoBanner) {
		t.Errorf("banner past MaxOutput: err %v, want ErrNoBanner", err)
	}
	if res, err := Banner(img, Options{MaxOutput: 300 << 10}); err != nil || res.Banner != testBanner {
		t.Errorf("banner within MaxOutput: %q, %v", res.Banner, err)
	}
	lzo := append(bytes.Clone(lzoMagic), make([]byte, 100)...)
	_, err = Banner(bzImage(1, testKernelVersion, lzo, 1000), Options{})
	if err == nil || !strings.Contains(err.Error(), "in no format this reads") {
		t.Errorf("lzo payload: err %v", err)
	}
}

func TestParseHeader(t *testing.T) {
	good := bzImage(0, testKernelVersion, []byte("payload"), 7)
	h, err := ParseHeader(good)
	if err != nil {
		t.Fatal(err)
	}
	want := Header{Protocol: 0x020f, SetupSectors: 4, KernelVersion: testKernelVersion, PayloadOffset: 5*512 + 64, PayloadLength: 11}
	if h != want {
		t.Fatalf("header %+v\nwant   %+v", h, want)
	}
	for name, c := range map[string]struct {
		mutate  func([]byte) []byte
		notBz   bool
		errText string
	}{
		"short":             {func(b []byte) []byte { return b[:0x200] }, true, "shorter"},
		"no boot flag":      {func(b []byte) []byte { b[offBootFlag] = 0; return b }, true, ""},
		"no HdrS":           {func(b []byte) []byte { b[offHeaderMagic] = 'h'; return b }, true, ""},
		"setup past end":    {func(b []byte) []byte { b[offSetupSects] = 200; return b }, true, "setup sectors"},
		"payload past end":  {func(b []byte) []byte { binary.LittleEndian.PutUint32(b[offPayloadLength:], 1<<20); return b }, false, "payload"},
		"version pointer":   {func(b []byte) []byte { binary.LittleEndian.PutUint16(b[offKernelVersion:], 0x9000); return b }, false, "outside"},
		"version unended":   {func(b []byte) []byte { copy(b[0x300:], bytes.Repeat([]byte("x"), 0x600)); return b }, false, "no end"},
		"version not text":  {func(b []byte) []byte { b[0x301] = 0x07; return b }, false, "not text"},
		"empty version":     {func(b []byte) []byte { b[0x300] = 0; return b }, false, "not text"},
		"zero payload size": {func(b []byte) []byte { binary.LittleEndian.PutUint32(b[offPayloadLength:], 0); return b }, false, "payload"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := ParseHeader(c.mutate(bytes.Clone(good)))
			if err == nil {
				t.Fatal("no error")
			}
			if errors.Is(err, ErrNotBzImage) != c.notBz || !strings.Contains(err.Error(), c.errText) {
				t.Fatalf("err %v (ErrNotBzImage %v, want %v, text %q)", err, errors.Is(err, ErrNotBzImage), c.notBz, c.errText)
			}
		})
	}
	// Before protocol 2.08 there is no payload field: the header still parses.
	old := bytes.Clone(good)
	binary.LittleEndian.PutUint16(old[offVersion:], 0x0206)
	if h, err := ParseHeader(old); err != nil || h.PayloadLength != 0 || h.KernelVersion != testKernelVersion {
		t.Fatalf("protocol 2.06: %+v, %v", h, err)
	}
}

func TestBannerFile(t *testing.T) {
	k := fakeKernel(8, 100<<10, 50000, testBanner)
	path := filepath.Join(t.TempDir(), "vmlinuz")
	if err := os.WriteFile(path, bzImage(2, testKernelVersion, zstded(t, k), len(k)), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := BannerFile(path, Options{})
	if err != nil || res.Banner != testBanner {
		t.Fatalf("%q, %v", res.Banner, err)
	}
	if _, err := BannerFile(path, Options{MaxImage: 1000}); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Fatalf("image over MaxImage: %v", err)
	}
	if _, err := BannerFile(filepath.Join(t.TempDir(), "missing"), Options{}); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
}
