package build_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/build"
)

func FuzzParseCompiler(f *testing.F) {
	for _, tc := range compilerCases {
		f.Add(tc.in)
	}
	f.Add("Linux version 6.1.0 (a@b) (gcc (GCC) 12.2.0, GNU ld 2.40) #1 SMP")
	f.Add("((((1.2.3")
	f.Add("1..2 3.4. .5.6 7.8")
	f.Fuzz(func(t *testing.T, s string) {
		c, ok := build.ParseCompiler(s)
		if !ok {
			if c != (build.Compiler{}) {
				t.Fatalf("not ok but %+v", c)
			}
			return
		}
		if !strings.Contains(s, c.Version) || !strings.Contains(s, c.Text) {
			t.Fatalf("%+v: not taken from %q", c, s)
		}
		major, _, _ := strings.Cut(c.Version, ".")
		if n, err := strconv.Atoi(major); err != nil || n != c.Major || !strings.Contains(c.Version, ".") {
			t.Fatalf("%+v: version and major disagree", c)
		}
		if c.Family != "" && c.Family != build.GCC && c.Family != build.Clang {
			t.Fatalf("family %q", c.Family)
		}
		build.CompilerFromBanner(s)
	})
}

func FuzzParseMemTotal(f *testing.F) {
	f.Add("MemTotal:       24522012 kB\nMemFree: 3 kB\n")
	f.Add("MemTotal: 12 B")
	f.Add("MemTotal: 99999999999999999999 kB")
	f.Fuzz(func(t *testing.T, s string) {
		n, ok := build.ParseMemTotal(strings.NewReader(s))
		if !ok && n != 0 {
			t.Fatalf("not ok but %d", n)
		}
		if ok && !strings.Contains(s, "MemTotal:") {
			t.Fatalf("%d from %q", n, s)
		}
		if j := build.JobsFor(4, n); j < 1 || j > 4 {
			t.Fatalf("JobsFor(4, %d) = %d", n, j)
		}
	})
}

func FuzzParseMemoryLimit(f *testing.F) {
	f.Add("4294967296\n")
	f.Add("max\n")
	f.Add("9223372036854771712")
	f.Fuzz(func(t *testing.T, s string) {
		n, ok := build.ParseMemoryLimit(s)
		if ok != (n != 0) {
			t.Fatalf("ParseMemoryLimit(%q) = %d, %v", s, n, ok)
		}
		if j := build.JobsFor(4, n); j < 1 || j > 4 {
			t.Fatalf("JobsFor(4, %d) = %d", n, j)
		}
	})
}

func FuzzParseUTSRelease(f *testing.F) {
	f.Add("#define UTS_RELEASE \"6.1.0-57-amd64\"\n")
	f.Add("#define UTS_RELEASE \"\\\"\"\n")
	f.Fuzz(func(t *testing.T, s string) {
		r, ok := build.ParseUTSRelease(s)
		if ok && (r == "" || !strings.Contains(s, `"`+r+`"`) || strings.ContainsAny(r, "\"\\ \t\n")) {
			t.Fatalf("%q from %q", r, s)
		}
	})
}

func FuzzParseVersionString(f *testing.F) {
	f.Add("ccflags-y += -DNV_VERSION_STRING=\\\"535.261.03\\\"\n")
	f.Add("-DNV_VERSION_STRING=\"x\" # c")
	f.Fuzz(func(t *testing.T, s string) {
		v, ok := build.ParseVersionString(s)
		if ok && (v == "" || !strings.Contains(s, v) || strings.ContainsAny(v, "\"\\ \t\n/")) {
			t.Fatalf("%q from %q", v, s)
		}
	})
}

func FuzzIncludedMakefileDir(f *testing.F) {
	f.Add("include /usr/src/linux-headers-6.1.0-57-common/Makefile\n")
	f.Add("export KBUILD_OUTPUT = .\ninclude /src/linux/Makefile")
	f.Fuzz(func(t *testing.T, s string) {
		dir, ok := build.IncludedMakefileDir(s)
		if ok && (!strings.HasPrefix(dir, "/") || !strings.Contains(s, "include")) {
			t.Fatalf("%q from %q", dir, s)
		}
	})
}
