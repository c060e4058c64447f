package build

import (
	"regexp"
	"testing"
)

// progressSeeds returns lines for the fuzz tests of the progress matchers.
func progressSeeds() []string {
	return []string{"", "CC [M]", "CC [M] ", "CC [M]x", "CC [M] x", "  CC [M]  /p/nvidia/nv.o\n", "\t\f\r\nCC [M]\tnv.o y",
		"CC [M]  nv.o\tz", "\vCC [M] x", " CC [M]\vx", "CC [M] \xffé.o", "CC [M] é", "CC [M]\u00a0x", "CC  [M] x", "cc [m] x",
		"CONFTEST: ", " CONFTEST: drm/drm_drv.h", "\tCONFTEST:\t", "CONFTEST:", "\vCONFTEST: x", "\u00a0CONFTEST: x", "\n\nCONFTEST: \n"}
}

func FuzzCompiledObjectMatchesRegexp(f *testing.F) {
	re := regexp.MustCompile(`^\s*CC \[M\]\s+(\S+)`)
	for _, s := range progressSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		want := ""
		m := re.FindStringSubmatch(line)
		if m != nil {
			want = m[1]
		}
		if got, ok := compiledObject(line); ok != (m != nil) || got != want {
			t.Fatalf("compiledObject(%q) = %q, %v; the regexp gives %q", line, got, ok, m)
		}
	})
}

func FuzzConftestMatchesRegexp(f *testing.F) {
	re := regexp.MustCompile(`^\s*CONFTEST: `)
	for _, s := range progressSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		if got, want := isConftest(line), re.MatchString(line); got != want {
			t.Fatalf("isConftest(%q) = %v, the regexp %v", line, got, want)
		}
	})
}
