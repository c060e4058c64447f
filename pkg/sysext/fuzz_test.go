package sysext_test

import (
	"errors"
	"regexp"
	"slices"
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

// FuzzNameMatchesRegexp: ParseName returns the groups of the regexp it replaced, and fails where
// the regexp does not match.
func FuzzNameMatchesRegexp(f *testing.F) {
	re := regexp.MustCompile(`^nvidia-driver-([0-9]+(?:\.[0-9]+)+)-flatcar([0-9]+\.[0-9]+\.[0-9]+)$`)
	for _, s := range []string{"", "nvidia-driver-", "nvidia-driver-580.95.05-flatcar4593.2.0", "nvidia-driver-580-flatcar4593.2.0",
		"nvidia-driver-1.2.3.4.5-flatcar1.2.3", "nvidia-driver-580.95-flatcar1.2", "nvidia-driver-580.95-flatcar1.2.3.4",
		"nvidia-driver-580.95-flatcar1.2.3\n", " nvidia-driver-580.95-flatcar1.2.3", "nvidia-driver-580.95-flatcar-flatcar1.2.3",
		"nvidia-driver-580..95-flatcar1.2.3", "nvidia-driver-.580-flatcar1.2.3", "nvidia-driver-580.-flatcar1.2.3",
		"nvidia-driver-580.95-flatcar1.2.3.raw", "nvidia-driver-٥.٥-flatcar1.2.3", "nvidia-driver-5.5-flatcar1.2.3\xff"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		var want []string
		if m := re.FindStringSubmatch(name); m != nil {
			want = m[1:]
		}
		driver, flatcar, ok := sysext.ParseName(name)
		if got := []string{driver, flatcar}; ok != (want != nil) || ok && !slices.Equal(got, want) || !ok && got[0]+got[1] != "" {
			t.Fatalf("ParseName(%q) = %q, %v; the regexp gives %q", name, got, ok, want)
		}
	})
}
