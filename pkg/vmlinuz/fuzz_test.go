package vmlinuz

import (
	"bytes"
	"testing"
)

// FuzzParseHeader: any input either fails or gives a header whose payload and kernel_version lie
// inside the input.
func FuzzParseHeader(f *testing.F) {
	f.Add(bzImage(0, testKernelVersion, []byte("payload"), 7))
	f.Add(bzImage(1, "", []byte{0x1f, 0x8b, 0x08, 0}, 100))
	f.Add(bzImage(3, testKernelVersion, []byte{0xfd, '7', 'z', 'X', 'Z', 0}, 1<<20)[:0x300])
	f.Add(make([]byte, headerEnd))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := ParseHeader(data)
		if err != nil {
			return
		}
		if h.SetupSectors < 1 || h.SetupSectors > 255 {
			t.Fatalf("setup sectors %d", h.SetupSectors)
		}
		if h.PayloadOffset < 0 || h.PayloadLength < 0 || h.PayloadOffset+h.PayloadLength > int64(len(data)) {
			t.Fatalf("payload %d+%d outside %d bytes", h.PayloadOffset, h.PayloadLength, len(data))
		}
		if h.KernelVersion != "" && (!printable([]byte(h.KernelVersion)) || !bytes.Contains(data, []byte(h.KernelVersion+"\x00"))) {
			t.Fatalf("kernel version %q", h.KernelVersion)
		}
	})
}

// FuzzBanner: any input, with small limits, ends without a panic, and a banner found is a
// printable line starting "Linux version ".
func FuzzBanner(f *testing.F) {
	k := fakeKernel(9, 8<<10, 1000, testBanner)
	f.Add(bzImage(1, testKernelVersion, gzipped(f, k), len(k)))
	f.Add(bzImage(1, testKernelVersion, zstded(f, k), len(k)))
	f.Add(bzImage(1, testKernelVersion, lz4Legacy(f, k), len(k)))
	f.Add(bzImage(1, "", xzPlain(f, k, 1<<16), len(k)))
	f.Add(lzmaed(f, k))
	f.Add(k)
	f.Fuzz(func(t *testing.T, data []byte) {
		res, err := Banner(data, Options{MaxOutput: 1 << 20, MaxWindow: 1 << 20})
		if err != nil {
			return
		}
		if !bytes.HasPrefix([]byte(res.Banner), bannerPrefix) || !printable([]byte(res.Banner)) || len(res.Banner) > maxBanner {
			t.Fatalf("banner %q", res.Banner)
		}
	})
}
