package precompiled

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// FuzzParse checks that Parse never panics or fails without ErrCorrupt, and
// that everything it accepts is canonical: marshalling gives back exactly
// the input, and the accepted package works with Info, InfoJSON and Explain.
// Seeds: testdata/fuzz/FuzzParse plus the shared vectors under 64 KiB.
func FuzzParse(f *testing.F) {
	if dirs, err := os.ReadDir(vectorDir); err == nil {
		for _, d := range dirs {
			b, err := os.ReadFile(filepath.Join(vectorDir, d.Name(), "package.bin"))
			if err == nil && len(b) <= 64<<10 {
				f.Add(b)
			}
		}
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		h, herr := ReadHeader(bytes.NewReader(in))
		p, err := Parse(in)
		if err == nil && (herr != nil || h.DriverVersion != p.DriverVersion || h.Description != p.Description || h.ProcVersion != p.ProcVersion || h.Files != len(p.Files)) {
			t.Fatalf("ReadHeader = %+v, %v; Parse read %q %q %q with %d files", h, herr, p.DriverVersion, p.Description, p.ProcVersion, len(p.Files))
		}
		if err != nil {
			if p != nil || !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Parse = %v, %v; want nil, ErrCorrupt", p, err)
			}
			return
		}
		out, err := p.Marshal()
		if err != nil {
			t.Fatalf("Marshal of a parsed package: %v", err)
		}
		if !bytes.Equal(out, in) {
			t.Fatalf("Marshal differs from the accepted input at byte %d", firstDiff(string(out), string(in)))
		}
		if err := Info(io.Discard, p); err != nil {
			t.Fatal(err)
		}
		info, err := Describe(p)
		if err != nil {
			t.Fatal(err)
		}
		for i, fi := range info.Files {
			end := fi.DataOffset + int64(fi.Size)
			if end > int64(len(in)) || !bytes.Equal(in[fi.DataOffset:end], p.Files[i].Data) {
				t.Fatalf("file %d: data_offset %d does not locate the data", i, fi.DataOffset)
			}
		}
		_ = Explain(p.ProcVersion, flatcarBanner)
	})
}

// FuzzExplain checks that ParseBanner and Explain never panic and that
// Explain reports a match exactly when the first lines are equal.
func FuzzExplain(f *testing.F) {
	f.Add(flatcarBanner, debianBanner)
	f.Add(ubuntuBanner, ubuntuBanner+"\n")
	f.Add("Linux version 1 ((((", "Linux version 1 (a) #")
	f.Add("boot/vmlinuz-5.15.0-91-generic", "")
	f.Fuzz(func(t *testing.T, stored, running string) {
		_, _ = ParseBanner(stored)
		got := Explain(stored, running)
		same := firstLine(stored) == firstLine(running)
		if strings.HasPrefix(got, "proc versions match") != same {
			t.Fatalf("Explain(%q, %q) = %q", stored, running, got)
		}
	})
}
