package modparams

import (
	"reflect"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// FuzzParseConf checks that ParseConf never panics, that what it accepts is
// valid and free of duplicates, and that rendering the result and parsing
// it again gives the same parameters.
func FuzzParseConf(f *testing.F) {
	f.Add("NVreg_EnableGpuFirmware=0 NVreg_OpenRmEnableUnsupportedGpus=1\n")
	f.Add("# comment\na=\"x y\" b # trailing\r\n")
	f.Fuzz(func(t *testing.T, in string) {
		ps, err := ParseConf(strings.NewReader(in), "f.conf")
		if err != nil {
			if ps != nil {
				t.Fatalf("parameters %v returned with error %v", ps, err)
			}
			if !strings.HasPrefix(err.Error(), "f.conf") {
				t.Fatalf("error %q does not start with the file name", err)
			}
			return
		}
		for i, p := range ps {
			if err := p.Validate(); err != nil {
				t.Fatalf("accepted invalid %+v: %v", p, err)
			}
			for _, q := range ps[:i] {
				if SameName(p.Name, q.Name) {
					t.Fatalf("duplicate %q and %q in %v", q.Name, p.Name, ps)
				}
			}
		}
		rendered := ps.String()
		back, err := ParseConf(strings.NewReader(rendered), "")
		if err != nil {
			t.Fatalf("rendered %q does not parse: %v", rendered, err)
		}
		if !reflect.DeepEqual(back, ps) {
			t.Fatalf("round trip of %q: got %#v, want %#v", rendered, back, ps)
		}
		if conf := string(ModprobeConf("nvidia", ps)); conf != "" {
			body, ok := strings.CutSuffix(conf, "\n")
			if !ok || strings.IndexFunc(body, unicode.IsControl) >= 0 {
				t.Fatalf("modprobe.d content %q is not one clean line", conf)
			}
		}
		var s Set
		if err := s.Add("nvidia", ps...); err != nil {
			t.Fatalf("Set.Add rejected parsed parameters: %v", err)
		}
	})
}

// fuzzMatchesRegexp checks that match accepts exactly what the regexp pattern accepts, from seeds
// and a few edge cases common to every pattern.
func fuzzMatchesRegexp(f *testing.F, pattern string, match func(string) bool, seeds ...string) {
	re := regexp.MustCompile(pattern)
	for _, s := range append(seeds, "", " ", "\n", "\xff", "é", "\x00") {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := match(s), re.MatchString(s); got != want {
			t.Fatalf("%q: matcher says %v, %s says %v", s, got, pattern, want)
		}
	})
}

func FuzzNameMatchesRegexp(f *testing.F) {
	fuzzMatchesRegexp(f, `^[A-Za-z0-9_][A-Za-z0-9_.-]*$`, isName,
		"NVreg_EnableGpuFirmware", "a", "_", "9.x-y", ".a", "-a", "a.", "a-", "a b", "a\n", "a=1", "aé", "a\xff")
}

func FuzzModuleMatchesRegexp(f *testing.F) {
	fuzzMatchesRegexp(f, `^[A-Za-z0-9_-]+$`, isModule,
		"nvidia", "nvidia-uvm", "nvidia_drm", "-", "_", "a.b", "nvidia\n", " nvidia", "nvidiaé", "a/b")
}
