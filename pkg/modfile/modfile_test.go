package modfile

import (
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// buildFakeModule compiles testdata/fakemod.c into a relocatable ELF object
// (what a .ko is) and returns its bytes. extra holds additional gcc flags.
func buildFakeModule(t testing.TB, extra ...string) []byte {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Fatal("gcc not installed: run make deps (apt-get install gcc)")
	}
	out := filepath.Join(t.TempDir(), "fakemod.o")
	args := append([]string{"-c", "-O2", "-fno-pic", "-fno-toplevel-reorder", "-o", out}, extra...)
	args = append(args, filepath.Join("testdata", "fakemod.c"))
	cmd := exec.Command(gcc, args...)
	if msg, err := cmd.CombinedOutput(); err != nil {
		if len(extra) > 0 {
			t.Fatalf("gcc %v failed: %v\n%s", extra, err, msg)
		}
		t.Fatalf("gcc failed: %v\n%s", err, msg)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func compressXZ(t testing.TB, data []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	// The kernel's Makefile.modinst uses "xz --check=crc32 --lzma2=dict=1MiB".
	w, err := xz.WriterConfig{CheckSum: xz.CRC32, DictCap: 1 << 20}.NewWriter(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func compressZstd(t testing.TB, data []byte) []byte {
	t.Helper()
	enc, err := zstd.NewWriter(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer enc.Close()
	return enc.EncodeAll(data, nil)
}

func compressGzip(t testing.TB, data []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := gzip.NewWriter(&buf)
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func writeFile(t testing.TB, dir, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func wantFakeInfo() ModInfo {
	return ModInfo{
		Name:        "nvidia",
		Version:     "535.309.01",
		Vermagic:    "6.1.0-57-amd64 SMP preempt mod_unload modversions ",
		Depends:     []string{"drm", "video"},
		License:     "Dual MIT/GPL",
		SrcVersion:  "0123456789ABCDEF0123456",
		Description: "Fake NVIDIA module",
		Firmware:    []string{"nvidia/535.309.01/gsp_ga10x.bin", "nvidia/535.309.01/gsp_tu10x.bin"},
		Params: map[string]ParamInfo{
			"NVreg_EnableGpuFirmware": {Name: "NVreg_EnableGpuFirmware", Type: "int", Description: "Enable GSP firmware (0 = off)"},
			"NVreg_RegistryDwords":    {Name: "NVreg_RegistryDwords", Type: "charp"},
			"debug":                   {Name: "debug", Type: "bool", Description: "Enable debug output: yes or no"},
		},
		Fields: []Field{
			{"version", "535.309.01"},
			{"license", "Dual MIT/GPL"},
			{"description", "Fake NVIDIA module"},
			{"firmware", "nvidia/535.309.01/gsp_ga10x.bin"},
			{"firmware", "nvidia/535.309.01/gsp_tu10x.bin"},
			{"parm", "NVreg_EnableGpuFirmware:Enable GSP firmware (0 = off)"},
			{"parmtype", "NVreg_EnableGpuFirmware:int"},
			{"parmtype", "NVreg_RegistryDwords:charp"},
			{"parm", "debug:Enable debug output: yes or no"},
			{"parmtype", "debug:bool"},
			{"alias", "pci:v000010DEd*sv*sd*bc03sc00i00*"},
			{"alias", "pci:v000010DEd*sv*sd*bc03sc02i00*"},
			{"depends", "drm,video"},
			{"srcversion", "0123456789ABCDEF0123456"},
			{"name", "nvidia"},
			{"vermagic", "6.1.0-57-amd64 SMP preempt mod_unload modversions "},
		},
	}
}

func TestInfoFakeModule(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags []string
	}{
		{"amd64", nil},
		{"i386", []string{"-m32"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			data := buildFakeModule(t, tc.flags...)
			got, err := Info(data)
			if err != nil {
				t.Fatal(err)
			}
			if want := wantFakeInfo(); !reflect.DeepEqual(got, want) {
				t.Errorf("Info:\n got %#v\nwant %#v", got, want)
			}
			if v, ok := got.Get("alias"); !ok || v != "pci:v000010DEd*sv*sd*bc03sc00i00*" {
				t.Errorf("Get(alias) = %q, %v", v, ok)
			}
			if _, ok := got.Get("author"); ok {
				t.Error("Get(author) found a value")
			}
			if n := len(got.Values("alias")); n != 2 {
				t.Errorf("Values(alias) has %d entries, want 2", n)
			}
		})
	}
}

func TestReadSymbolsFakeModule(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags []string
	}{
		{"amd64", nil},
		{"i386", []string{"-m32"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			data := buildFakeModule(t, tc.flags...)
			got, err := ReadSymbols(data)
			if err != nil {
				t.Fatal(err)
			}
			want := Symbols{
				Exports: []Export{
					{Name: "nv_fake_export"},
					{Name: "nv_fake_gpl_export", GPLOnly: true, Namespace: "NVIDIA_NS"},
				},
				Undefined: []Undefined{
					{Name: "_printk"},
					{Name: "drm_gem_object_free"},
					{Name: "optional_hook", Weak: true},
				},
				Versions: []SymbolVersion{
					{Name: "_printk", CRC: 0x92997ed8},
					{Name: "drm_gem_object_free", CRC: 0x1c7f9b1a},
					{Name: "_RNvNtCs1234_6kernel5print11call_printk", CRC: 0xdeadbeef},
					{Name: "drm_gem_object_free", CRC: 0x1c7f9b1a},
				},
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("ReadSymbols:\n got %+v\nwant %+v", got, want)
			}
			if n := got.ExportNames(); !reflect.DeepEqual(n, []string{"nv_fake_export", "nv_fake_gpl_export"}) {
				t.Errorf("ExportNames = %q", n)
			}
			if n := got.UndefinedNames(); !reflect.DeepEqual(n, []string{"_printk", "drm_gem_object_free", "optional_hook"}) {
				t.Errorf("UndefinedNames = %q", n)
			}
		})
	}
}

func TestReadSymbolsStringsFallback(t *testing.T) {
	data := buildFakeModule(t)
	dir := t.TempDir()
	in := writeFile(t, dir, "in.o", data)
	out := filepath.Join(dir, "out.o")
	objcopy, err := exec.LookPath("objcopy")
	if err != nil {
		t.Fatal("objcopy not installed: run make deps (apt-get install binutils)")
	}
	// Without a symbol table the exports can only come from
	// __ksymtab_strings, which also holds the namespace names.
	if msg, err := exec.Command(objcopy, "--strip-all", in, out).CombinedOutput(); err != nil {
		t.Fatalf("objcopy: %v\n%s", err, msg)
	}
	stripped, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ReadSymbols(stripped)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"NVIDIA_NS", "nv_fake_export", "nv_fake_gpl_export"}; !reflect.DeepEqual(got.ExportNames(), want) {
		t.Errorf("ExportNames = %q, want %q", got.ExportNames(), want)
	}
	if got.Undefined != nil {
		t.Errorf("Undefined = %v, want none", got.Undefined)
	}
}

func TestOpenCompressed(t *testing.T) {
	raw := buildFakeModule(t)
	want := wantFakeInfo()
	dir := t.TempDir()
	for _, tc := range []struct {
		file string
		data []byte
		c    Compression
	}{
		{"nvidia.ko", raw, None},
		{"nvidia.ko.xz", compressXZ(t, raw), XZ},
		{"nvidia.ko.zst", compressZstd(t, raw), Zstd},
		{"nvidia.ko.gz", compressGzip(t, raw), Gzip},
	} {
		t.Run(tc.file, func(t *testing.T) {
			p := writeFile(t, dir, tc.file, tc.data)
			m, err := Open(p)
			if err != nil {
				t.Fatal(err)
			}
			if m.Path != p || m.Compression != tc.c || m.Compressed != (tc.c != None) {
				t.Errorf("Open = {Path %q, Compression %v, Compressed %v}", m.Path, m.Compression, m.Compressed)
			}
			if !bytes.Equal(m.Data, raw) {
				t.Fatalf("Open data differs from the original (%d vs %d bytes)", len(m.Data), len(raw))
			}
			mi, err := m.Info()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(mi, want) {
				t.Errorf("Info:\n got %#v\nwant %#v", mi, want)
			}
			syms, err := m.Symbols()
			if err != nil || len(syms.Exports) != 2 {
				t.Errorf("Symbols = %+v, %v", syms, err)
			}
			b, err := ReadBytes(p)
			if err != nil || !bytes.Equal(b, raw) {
				t.Errorf("ReadBytes: %d bytes, %v", len(b), err)
			}
		})
	}
}

// TestOpenSystemCompressors checks files made by the xz and zstd command line
// tools, with the options the kernel's module installation uses.
func TestOpenSystemCompressors(t *testing.T) {
	raw := buildFakeModule(t)
	dir := t.TempDir()
	for _, tc := range []struct {
		tool string
		args []string
		ext  string
	}{
		{"xz", []string{"--check=crc32", "--lzma2=dict=1MiB", "-f"}, ".xz"},
		{"zstd", []string{"-T0", "-q", "-f", "--rm"}, ".zst"},
		{"gzip", []string{"-9", "-n", "-f"}, ".gz"},
	} {
		t.Run(tc.tool, func(t *testing.T) {
			bin, err := exec.LookPath(tc.tool)
			if err != nil {
				t.Fatalf("%s not installed: run make deps", tc.tool)
			}
			p := writeFile(t, dir, "nvidia-uvm.ko", raw)
			if msg, err := exec.Command(bin, append(tc.args, p)...).CombinedOutput(); err != nil {
				t.Fatalf("%s: %v\n%s", tc.tool, err, msg)
			}
			m, err := Open(p + tc.ext)
			if err != nil {
				t.Fatal(err)
			}
			if !m.Compressed || !bytes.Equal(m.Data, raw) {
				t.Errorf("Open: Compressed %v, data equal %v", m.Compressed, bytes.Equal(m.Data, raw))
			}
		})
	}
}

func TestModuleInfoNameFallback(t *testing.T) {
	raw := buildFakeModule(t)
	// Rename "name=" to "nome=" so the section has no name entry.
	patched := bytes.Replace(raw, []byte("\x00name=nvidia\x00"), []byte("\x00nome=nvidia\x00"), 1)
	if bytes.Equal(patched, raw) {
		t.Fatal("name entry not found in object")
	}
	p := writeFile(t, t.TempDir(), "nvidia-peermem.ko", patched)
	m, err := Open(p)
	if err != nil {
		t.Fatal(err)
	}
	mi, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	if mi.Name != "nvidia_peermem" {
		t.Errorf("Name = %q, want nvidia_peermem", mi.Name)
	}
}

func TestOpenErrors(t *testing.T) {
	raw := buildFakeModule(t)
	dir := t.TempDir()
	xzData := compressXZ(t, raw)
	gzData := compressGzip(t, raw)
	zstData := compressZstd(t, raw)
	if err := os.Mkdir(filepath.Join(dir, "adir.ko"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		file    string
		data    []byte // nil: do not create
		limit   int64
		wantErr error
		wantMsg string
	}{
		{"unknown extension", "nvidia.ko.bz2", raw, 0, ErrUnknownExtension, "unknown module file extension"},
		{"no extension", "nvidia", raw, 0, ErrUnknownExtension, ""},
		{"bare extension", ".ko", raw, 0, ErrUnknownExtension, ""},
		{"missing", "missing.ko", nil, 0, os.ErrNotExist, "open module"},
		{"directory", "adir.ko", nil, 0, nil, "not a regular file"},
		{"not ELF", "text.ko", []byte("hello, world"), 0, ErrNotELF, "not an ELF file"},
		{"empty", "empty.ko", []byte{}, 0, ErrNotELF, ""},
		{"plain too large", "big.ko", raw, 100, ErrTooLarge, "limit 100 bytes"},
		{"xz too large", "big.ko.xz", xzData, int64(len(xzData)), ErrTooLarge, "decompressed size"},
		{"gz too large", "big.ko.gz", gzData, int64(len(gzData)), ErrTooLarge, "decompressed size"},
		{"zst too large", "big.ko.zst", zstData, int64(len(zstData)), ErrTooLarge, "decompressed size"},
		{"xz corrupt", "bad.ko.xz", []byte("\xfd7zXZ\x00garbage"), 0, nil, "xz"},
		{"xz truncated", "trunc.ko.xz", xzData[:len(xzData)/2], 0, nil, "xz"},
		{"gz corrupt", "bad.ko.gz", []byte("not gzip"), 0, nil, "gzip"},
		{"gz truncated", "trunc.ko.gz", gzData[:len(gzData)/2], 0, io.ErrUnexpectedEOF, "gz"},
		{"zst corrupt", "bad.ko.zst", []byte("\x28\xb5\x2f\xfdgarbage garbage"), 0, nil, "zst"},
		{"zst truncated", "trunc.ko.zst", zstData[:len(zstData)/2], 0, nil, "zst"},
		{"xz of text", "text.ko.xz", compressXZ(t, []byte("text")), 0, ErrNotELF, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, tc.file)
			if tc.data != nil {
				p = writeFile(t, dir, tc.file, tc.data)
			}
			m, err := OpenLimit(p, tc.limit)
			if err == nil {
				t.Fatalf("OpenLimit succeeded: %d bytes", len(m.Data))
			}
			if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Errorf("error %q is not %v", err, tc.wantErr)
			}
			if !strings.Contains(err.Error(), tc.wantMsg) {
				t.Errorf("error %q does not contain %q", err, tc.wantMsg)
			}
			if !strings.Contains(err.Error(), tc.file) {
				t.Errorf("error %q does not name the file", err)
			}
		})
	}
}

func TestDecompressLimit(t *testing.T) {
	zeros := make([]byte, 1<<20)
	for _, tc := range []struct {
		c    Compression
		data []byte
	}{
		{None, zeros},
		{XZ, compressXZ(t, zeros)},
		{Zstd, compressZstd(t, zeros)},
		{Gzip, compressGzip(t, zeros)},
	} {
		t.Run(tc.c.String(), func(t *testing.T) {
			if _, err := Decompress(bytes.NewReader(tc.data), tc.c, 1<<20-1); !errors.Is(err, ErrTooLarge) {
				t.Errorf("limit one below: error %v, want ErrTooLarge", err)
			}
			got, err := Decompress(bytes.NewReader(tc.data), tc.c, 1<<20)
			if err != nil || !bytes.Equal(got, zeros) {
				t.Errorf("exact limit: %d bytes, %v", len(got), err)
			}
			got, err = Decompress(bytes.NewReader(tc.data), tc.c, 0)
			if err != nil || !bytes.Equal(got, zeros) {
				t.Errorf("default limit: %d bytes, %v", len(got), err)
			}
		})
	}
	if _, err := Decompress(bytes.NewReader(nil), Compression(42), 0); err == nil || !strings.Contains(err.Error(), "Compression(42)") {
		t.Errorf("unknown compression: error %v", err)
	}
}

func TestCompressionFor(t *testing.T) {
	for _, tc := range []struct {
		path string
		want Compression
		ok   bool
	}{
		{"/lib/modules/6.1.0/kernel/drivers/video/nvidia.ko", None, true},
		{"nvidia-uvm.ko.xz", XZ, true},
		{"nvidia.ko.zst", Zstd, true},
		{"nvidia.ko.gz", Gzip, true},
		{"nvidia.ko.bz2", None, false},
		{"nvidia.o", None, false},
		{"nvidia.KO", None, false},
		{"/x/.ko.xz", None, false},
		{"nvidia.ko/", None, true}, // filepath.Base drops the trailing slash
		{"", None, false},
	} {
		got, err := CompressionFor(tc.path)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("CompressionFor(%q) = %v, %v; want %v, ok=%v", tc.path, got, err, tc.want, tc.ok)
		}
	}
}

func TestCompressionString(t *testing.T) {
	for c, want := range map[Compression]string{None: "", XZ: "xz", Zstd: "zst", Gzip: "gz", 9: "Compression(9)"} {
		if got := c.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", int(c), got, want)
		}
	}
}

func TestNameFromPath(t *testing.T) {
	for path, want := range map[string]string{
		"/lib/modules/x/nvidia.ko":  "nvidia",
		"nvidia-uvm.ko.xz":          "nvidia_uvm",
		"nvidia-modeset.ko.zst":     "nvidia_modeset",
		"nvidia-peermem.ko.gz":      "nvidia_peermem",
		"nvidia_drm.ko":             "nvidia_drm",
		"weird-name":                "weird_name",
		"a.ko.bz2":                  "a.ko.bz2",
		"/lib/modules/x/i2c-dev.ko": "i2c_dev",
	} {
		if got := NameFromPath(path); got != want {
			t.Errorf("NameFromPath(%q) = %q, want %q", path, got, want)
		}
	}
}

func TestIsELF(t *testing.T) {
	for in, want := range map[string]bool{"\x7fELF": true, "\x7fELF\x02\x01": true, "\x7fEL": false, "": false, "ELF\x7f": false} {
		if got := IsELF([]byte(in)); got != want {
			t.Errorf("IsELF(%q) = %v", in, got)
		}
	}
}

func TestKernelCompression(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Compression
		ok   bool
	}{
		{"xz\n", XZ, true}, {"zstd\n", Zstd, true}, {"gzip", Gzip, true},
		{"", None, false}, {"zst\n", None, false}, {"XZ\n", None, false}, {"xz zstd\n", None, false},
	} {
		if got, ok := KernelCompression(tc.in); got != tc.want || ok != tc.ok {
			t.Errorf("KernelCompression(%q) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}
