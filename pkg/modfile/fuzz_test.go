package modfile

import (
	"bytes"
	"reflect"
	"strings"
	"testing"
)

// FuzzParseModinfo checks that ParseModinfo accepts any input and that its
// result is consistent: re-encoding the fields and parsing again gives the
// same ModInfo.
func FuzzParseModinfo(f *testing.F) {
	f.Add([]byte("name=nvidia\x00version=580.65.06\x00depends=drm,video\x00"))
	f.Add([]byte("parm=NVreg_X:desc\x00parmtype=NVreg_X:int\x00\x00\x00"))
	f.Fuzz(func(t *testing.T, data []byte) {
		mi := ParseModinfo(data)
		var enc bytes.Buffer
		for _, fld := range mi.Fields {
			if fld.Key == "" || strings.ContainsAny(fld.Key, "=\x00") {
				t.Fatalf("bad key %q", fld.Key)
			}
			if strings.Contains(fld.Value, "\x00") {
				t.Fatalf("NUL in value %q", fld.Value)
			}
			enc.WriteString(fld.Key + "=" + fld.Value + "\x00")
		}
		for _, d := range mi.Depends {
			if d == "" || strings.Contains(d, ",") || strings.TrimSpace(d) != d {
				t.Fatalf("bad depends item %q in %q", d, mi.Depends)
			}
		}
		if v, _ := mi.Get("name"); v != mi.Name {
			t.Fatalf("Name %q, first name= entry %q", mi.Name, v)
		}
		for name, p := range mi.Params {
			if name == "" || p.Name != name {
				t.Fatalf("param %q has Name %q", name, p.Name)
			}
		}
		if again := ParseModinfo(enc.Bytes()); !reflect.DeepEqual(again, mi) {
			t.Fatalf("re-parse differs:\n got %#v\nwant %#v", again, mi)
		}
	})
}

// FuzzInfo checks that Info and ReadSymbols never panic on arbitrary bytes.
func FuzzInfo(f *testing.F) {
	f.Add([]byte("\x7fELF"))
	f.Add([]byte("\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00\x3e\x00"))
	f.Fuzz(func(t *testing.T, data []byte) {
		mi, err := Info(data)
		if err == nil && !IsELF(data) {
			t.Fatalf("Info accepted non-ELF data: %+v", mi)
		}
		s, err := ReadSymbols(data)
		if err == nil {
			for i := 1; i < len(s.Exports); i++ {
				if s.Exports[i-1].Name >= s.Exports[i].Name {
					t.Fatalf("exports not sorted and unique: %v", s.Exports)
				}
			}
		}
	})
}
