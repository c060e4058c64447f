package precompiled

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// writePackage packs one kernel module into a package with the given header
// and writes it to dir/name.
func writePackage(t *testing.T, dir, name, driverVersion, banner string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	writeModulePackage(t, path, driverVersion, banner, []byte("module for "+name))
	return path
}

// writeModulePackage writes a package of one kernel module, nvidia-uvm.ko holding data, to path.
func writeModulePackage(tb testing.TB, path, driverVersion, banner string, data []byte) {
	tb.Helper()
	p := &Package{DriverVersion: driverVersion, Description: "test", ProcVersion: banner}
	f, err := NewKernelModule("nvidia-uvm.ko", ".", data, false)
	if err != nil {
		tb.Fatal(err)
	}
	if err := p.Append(f); err != nil {
		tb.Fatal(err)
	}
	b, err := p.Marshal()
	if err != nil {
		tb.Fatal(err)
	}
	writeFile(tb, path, b)
}

func TestScan(t *testing.T) {
	t.Parallel()
	const ver = "595.71.05"
	type skip struct {
		name string
		kind SkipKind
		has  string // substring of Reason
	}
	tests := []struct {
		name   string
		setup  func(t *testing.T, dir string)
		banner string
		want   string // chosen file relative to dir, "" for none
		skips  []skip
	}{
		{
			name: "flat: matching chosen over non-matching, other version and corrupt skipped",
			setup: func(t *testing.T, dir string) {
				writePackage(t, dir, "a-debian", ver, debianBanner)
				writePackage(t, dir, "b-old-driver", "580.95.05", flatcarBanner)
				writeFile(t, filepath.Join(dir, "c-corrupt"), []byte("\aNVIDIa\a garbage"))
				writePackage(t, dir, "d-match", ver, flatcarBanner)
				writePackage(t, dir, "e-match-too", ver, flatcarBanner)
				writeFile(t, filepath.Join(dir, ".hidden"), []byte("ignored"))
			},
			banner: flatcarBanner,
			want:   "d-match",
			skips: []skip{
				{"a-debian", SkipBanner, "release differs"},
				{"b-old-driver", SkipDriverVersion, `driver version "580.95.05", want "595.71.05"`},
				{"c-corrupt", SkipCorrupt, "corrupt precompiled package: offset 16"},
				{"e-match-too", SkipDuplicate, "d-match"},
			},
		},
		{
			name: "kver sub-directory layout",
			setup: func(t *testing.T, dir string) {
				writePackage(t, filepath.Join(dir, "6.1.0-41-amd64"), "nvidia-modules-6.1.0", ver, debianBanner)
				writePackage(t, filepath.Join(dir, "6.12.81-flatcar"), "nvidia-modules-6.12.81", ver, flatcarBanner)
			},
			banner: flatcarBanner + "\n",
			want:   "6.12.81-flatcar/nvidia-modules-6.12.81",
			skips:  []skip{{"6.1.0-41-amd64", SkipOtherKernel, `"6.1.0-41-amd64"`}},
		},
		{
			name: "flat and sub-directory together: flat first",
			setup: func(t *testing.T, dir string) {
				writePackage(t, filepath.Join(dir, "6.1.0-41-amd64"), "sub", ver, debianBanner)
				writePackage(t, dir, "flat", ver, debianBanner)
			},
			banner: debianBanner,
			want:   "flat",
			skips:  []skip{{"6.1.0-41-amd64/sub", SkipDuplicate, "flat"}},
		},
		{
			name: "only corrupt and mismatching packages: nothing chosen",
			setup: func(t *testing.T, dir string) {
				good := writePackage(t, dir, "good", ver, flatcarBanner)
				b, err := os.ReadFile(good)
				if err != nil {
					t.Fatal(err)
				}
				writeFile(t, filepath.Join(dir, "truncated"), b[:len(b)-3])
				p, err := Parse(b)
				if err != nil {
					t.Fatal(err)
				}
				info, err := Describe(p)
				if err != nil {
					t.Fatal(err)
				}
				b[info.Files[0].DataOffset] ^= 0xff // the data no longer has the stored crc
				writeFile(t, filepath.Join(dir, "flipped"), b)
				writeFile(t, filepath.Join(dir, "empty"), nil)
				if err := os.Remove(good); err != nil {
					t.Fatal(err)
				}
				writePackage(t, dir, "ubuntu", ver, ubuntuBanner)
			},
			banner: flatcarBanner,
			skips: []skip{
				{"empty", SkipCorrupt, "28-byte fixed header"},
				{"flipped", SkipCorrupt, "data bytes have crc"},
				{"truncated", SkipCorrupt, "truncated"},
				{"ubuntu", SkipBanner, "proc version mismatch"},
			},
		},
		{
			name:   "missing directory",
			setup:  func(t *testing.T, dir string) { os.Remove(dir) },
			banner: flatcarBanner,
		},
		{
			name: "banner that is not a Linux banner: every sub-directory is read",
			setup: func(t *testing.T, dir string) {
				writePackage(t, filepath.Join(dir, "x"), "p", ver, "boot/vmlinuz-5.15.0-91-generic")
			},
			banner: "boot/vmlinuz-5.15.0-91-generic",
			want:   "x/p",
		},
		{
			name: "not a regular file",
			setup: func(t *testing.T, dir string) {
				if err := os.Symlink("nowhere", filepath.Join(dir, "dangling")); err != nil {
					t.Fatal(err)
				}
			},
			banner: flatcarBanner,
			skips:  []skip{{"dangling", SkipUnreadable, "no such file"}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := filepath.Join(t.TempDir(), "precompiled")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			tc.setup(t, dir)
			res := Scan(dir, tc.banner, ver)
			for _, s := range res.Skipped {
				t.Logf("skipped %s (%s): %s", s.Path, s.Kind, s.Reason)
			}
			if tc.want == "" {
				if res.Found() || res.Path != "" {
					t.Errorf("chose %s, want nothing", res.Path)
				}
			} else {
				if want := filepath.Join(dir, tc.want); res.Path != want || !res.Found() {
					t.Errorf("chose %q, want %q", res.Path, want)
				} else if res.Package.ProcVersion != firstLine(tc.banner) || res.Package.DriverVersion != ver {
					t.Errorf("chosen package header %q/%q", res.Package.DriverVersion, res.Package.ProcVersion)
				}
			}
			if len(res.Skipped) != len(tc.skips) {
				t.Fatalf("skipped %d entries, want %d", len(res.Skipped), len(tc.skips))
			}
			for i, want := range tc.skips {
				got := res.Skipped[i]
				if got.Path != filepath.Join(dir, want.name) || got.Kind != want.kind || !strings.Contains(got.Reason, want.has) {
					t.Errorf("skipped[%d] = %s %v %q, want %s %v containing %q",
						i, got.Path, got.Kind, got.Reason, want.name, want.kind, want.has)
				}
				if (got.Kind == SkipBanner) != (got.Explain != "") {
					t.Errorf("skipped[%d]: Explain %q for kind %v", i, got.Explain, got.Kind)
				}
				if strings.Contains(got.Reason, "\n") {
					t.Errorf("skipped[%d]: reason spans lines: %q", i, got.Reason)
				}
			}
		})
	}
}

// A path that is not a directory cannot be listed: reported, not fatal.
func TestScanNotADirectory(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	writeFile(t, file, []byte("x"))
	res := Scan(file, flatcarBanner, "1")
	if res.Found() || len(res.Skipped) != 1 || res.Skipped[0].Kind != SkipUnreadable {
		t.Fatalf("Scan(file) = %+v, want one unreadable entry", res)
	}
}

func TestSkipKindString(t *testing.T) {
	t.Parallel()
	for k := SkipUnreadable; k <= SkipDuplicate; k++ {
		if s := k.String(); s == "" || strings.HasPrefix(s, "SkipKind(") {
			t.Errorf("%d has no name", int(k))
		}
	}
	if s := SkipKind(99).String(); s != "SkipKind(99)" {
		t.Errorf("SkipKind(99) = %q", s)
	}
}

// bigPackage writes a package whose one module is size bytes and returns its directory.
func bigPackage(tb testing.TB, banner string, size int) string {
	tb.Helper()
	dir := tb.TempDir()
	writeModulePackage(tb, filepath.Join(dir, "nvidia-modules-6.1.0"), "595.71.05", banner, make([]byte, size))
	return dir
}

// TestScanAllocatesThePackageOnce: the package is read into one buffer of its size, not one grown
// by doubling (which allocates about twice the package and copies it on every step).
func TestScanAllocatesThePackageOnce(t *testing.T) {
	const banner, size = "Linux version 6.1.0 (x@y) #1 SMP", 16 << 20
	dir := bigPackage(t, banner, size)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	res := Scan(dir, banner, "595.71.05")
	runtime.ReadMemStats(&after)
	if !res.Found() {
		t.Fatalf("no package chosen: %+v", res.Skipped)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > size*5/4 {
		t.Errorf("Scan of a %d-byte package allocated %d bytes (%.2fx); want at most 1.25x", size, got, float64(got)/size)
	}
}

// BenchmarkScan reads and checks a package of 64 MiB, about an open-module package's size.
func BenchmarkScan(b *testing.B) {
	const banner, size = "Linux version 6.1.0 (x@y) #1 SMP", 64 << 20
	dir := bigPackage(b, banner, size)
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		if res := Scan(dir, banner, "595.71.05"); !res.Found() {
			b.Fatal("no package chosen")
		}
	}
}
