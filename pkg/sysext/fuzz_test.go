package sysext_test

import (
	"errors"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/sysext"
)

// FuzzRelease: parsing never panics; what parses and is formatted parses back the same; Check
// either accepts or refuses with ErrRefused, and accepts an extension made for the host itself.
func FuzzRelease(f *testing.F) {
	for _, s := range []string{
		"ID=flatcar\nVERSION_ID=4593.2.0\nARCHITECTURE=x86-64\n",
		"ID=flatcar\nSYSEXT_LEVEL=1.0\n",
		"ID=_any\n",
		"ID='flatcar'\nVERSION_ID=\"4593.2.0\"\n# comment\n\n",
		"ID=\"unterminated\n",
		"=x\n",
	} {
		f.Add([]byte(s), "flatcar", "4593.2.0", "1.0", "x86-64")
	}
	f.Fuzz(func(t *testing.T, data []byte, id, version, level, arch string) {
		r, err := sysext.ParseRelease(data)
		if err != nil {
			return
		}
		back, err := sysext.ParseRelease(r.Format())
		if err == nil && back != r {
			t.Fatalf("Format/Parse changed %+v into %+v", r, back)
		}
		h := sysext.Host{ID: id, VersionID: version, SysextLevel: level, Architecture: arch}
		if err := sysext.Check("x", r, h); err != nil && !errors.Is(err, sysext.ErrRefused) {
			t.Fatalf("Check: %v is not ErrRefused", err)
		}
		if id != "" {
			self := sysext.Release{ID: id, VersionID: version, SysextLevel: level, Architecture: arch}
			if err := sysext.Check("x", self, h); err != nil {
				t.Fatalf("the host's own release %+v refused: %v", self, err)
			}
		}
	})
}
