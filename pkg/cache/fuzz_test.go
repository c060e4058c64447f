package cache

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
)

// FuzzReadManifest checks that ReadManifest never panics, fails only with
// ErrCorrupt, and that whatever it accepts survives a write and a re-read
// unchanged. Seeds: testdata/fuzz/FuzzReadManifest plus the manifest of a
// real entry.
func FuzzReadManifest(f *testing.F) {
	m := &Manifest{Format: ManifestFormat, Key: testKey(),
		Modules: []ModuleSum{{Name: "nvidia", File: "nvidia.ko", Size: 3, XXH64: strings.Repeat("a", 16), Signed: true}}}
	b, err := m.marshal()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	m.Format, m.Modules[0].XXH64, m.Modules[0].SHA256 = sha256Format, "", strings.Repeat("a", 64)
	if b, err = m.marshal(); err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := ReadManifest(bytes.NewReader(in))
		if err != nil {
			if m != nil || !errors.Is(err, ErrCorrupt) {
				t.Fatalf("ReadManifest = %v, %v; want nil, ErrCorrupt", m, err)
			}
			return
		}
		out, err := m.marshal()
		if err != nil {
			t.Fatal(err)
		}
		again, err := ReadManifest(bytes.NewReader(out))
		if err != nil {
			t.Fatalf("re-reading a written manifest: %v\n%s", err, out)
		}
		if !reflect.DeepEqual(normalize(m), normalize(again)) {
			t.Fatalf("manifest changed on a round trip:\n%+v\n%+v", m, again)
		}
		if m.Key.Name() != again.Key.Name() || !m.Key.Equal(again.Key) {
			t.Fatal("key changed on a round trip")
		}
	})
}

// normalize makes nil and empty build parameters compare equal.
func normalize(m *Manifest) *Manifest {
	c := *m
	if len(c.Key.BuildParams) == 0 {
		c.Key.BuildParams = nil
	}
	return &c
}

func TestReadManifest(t *testing.T) {
	t.Parallel()
	good := func() *Manifest {
		return &Manifest{Format: ManifestFormat, Key: testKey(),
			Modules: []ModuleSum{
				{Name: "nvidia", File: "nvidia.ko", Size: 3, XXH64: strings.Repeat("a", 16), Signed: true},
				{Name: "nvidia_uvm", File: "nvidia-uvm.ko", Size: 0, XXH64: strings.Repeat("b", 16)},
			}}
	}
	tests := []struct {
		name  string
		edit  func(m *Manifest)
		raw   string // used instead of the edited manifest when set
		error string // "" for accepted
	}{
		{name: "good", edit: func(*Manifest) {}},
		{name: "no build params", edit: func(m *Manifest) { m.Key.BuildParams = nil }},
		{name: "format 1 (package.bin besides modules/)", edit: func(m *Manifest) { m.Format = 1 }, error: "format 1"},
		{name: "format 4", edit: func(m *Manifest) { m.Format = 4 }, error: "format 4"},
		{name: "format 2 (sha256)", edit: func(m *Manifest) {
			m.Format = 2
			for i := range m.Modules {
				m.Modules[i].XXH64, m.Modules[i].SHA256 = "", strings.Repeat("c", 64)
			}
		}},
		{name: "format 2 with an xxh64", edit: func(m *Manifest) { m.Format = 2 }, error: "an xxh64 in a format 2"},
		{name: "sha256 besides the xxh64", edit: func(m *Manifest) { m.Modules[1].SHA256 = strings.Repeat("c", 64) }, error: "a sha256 in a format 3"},
		{name: "sha256 instead of the xxh64", edit: func(m *Manifest) { m.Modules[1].XXH64, m.Modules[1].SHA256 = "", strings.Repeat("c", 64) }, error: "a sha256 in a format 3"},
		{name: "no sum", edit: func(m *Manifest) { m.Modules[0].XXH64 = "" }, error: "invalid xxh64"},
		{name: "empty banner", edit: func(m *Manifest) { m.Key.Banner = "" }, error: "banner"},
		{name: "no modules", edit: func(m *Manifest) { m.Modules = nil }, error: "0 modules"},
		{name: "file escapes", edit: func(m *Manifest) { m.Modules[0].File = "../nvidia.ko" }, error: "file name"},
		{name: "hidden file", edit: func(m *Manifest) { m.Modules[0].File = ".nvidia.ko" }, error: "file name"},
		{name: "module name with a dash", edit: func(m *Manifest) { m.Modules[1].Name = "nvidia-uvm" }, error: "module name"},
		{name: "duplicate name", edit: func(m *Manifest) { m.Modules[1].Name = "nvidia" }, error: "twice"},
		{name: "duplicate file", edit: func(m *Manifest) { m.Modules[1].File = "nvidia.ko" }, error: "twice"},
		{name: "upper-case sum", edit: func(m *Manifest) { m.Modules[0].XXH64 = strings.Repeat("A", 16) }, error: "xxh64"},
		{name: "short sum", edit: func(m *Manifest) { m.Modules[1].XXH64 = "00" }, error: "xxh64"},
		{name: "a sha256's length", edit: func(m *Manifest) { m.Modules[1].XXH64 = strings.Repeat("b", 64) }, error: "xxh64"},
		{name: "negative size", edit: func(m *Manifest) { m.Modules[0].Size = -1 }, error: "negative"},
		{name: "the package of format 1", raw: `{"format":2,"package":{"file":"package.bin","sha256":"00"}}`, error: "unknown field"},
		{name: "unknown field", raw: `{"format":2,"extra":true}`, error: "unknown field"},
		{name: "trailing data", raw: `{"format":1}{}`, error: "after the JSON object"},
		{name: "not JSON", raw: "format = 1", error: "invalid character"},
		{name: "empty", raw: "", error: "EOF"},
		{name: "too large", raw: `{"format":1,"key":{"banner":"` + strings.Repeat("x", maxManifestSize) + `"}}`, error: "over"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			in := []byte(tc.raw)
			if tc.edit != nil {
				m := good()
				tc.edit(m)
				var err error
				if in, err = m.marshal(); err != nil {
					t.Fatal(err)
				}
			}
			m, err := ReadManifest(bytes.NewReader(in))
			switch {
			case tc.error == "" && err != nil:
				t.Fatalf("rejected: %v", err)
			case tc.error != "" && (!errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.error)):
				t.Fatalf("err = %v, want ErrCorrupt mentioning %q", err, tc.error)
			case tc.error == "" && (m.Key.Banner != flatcarBanner || len(m.Modules) != 2):
				t.Fatalf("decoded %+v", m)
			}
		})
	}
}
