package build_test

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/build"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// Compiler strings as kernel banners and --version print them.
var compilerCases = []struct {
	in     string
	family string
	ver    string
	major  int
	text   string
}{
	{"gcc (Debian 12.2.0-14) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40", build.GCC, "12.2.0", 12, "gcc (Debian 12.2.0-14) 12.2.0"},
	{"gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40", build.GCC, "12.2.0", 12, "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0"},
	{"x86_64-cros-linux-gnu-gcc (Gentoo Hardened 13.3.1_p20240614 p17) 13.3.1 20240614, GNU ld (Gentoo 2.42 p6) 2.42", build.GCC, "13.3.1", 13, "x86_64-cros-linux-gnu-gcc (Gentoo Hardened 13.3.1_p20240614 p17) 13.3.1 20240614"},
	{"gcc (GCC) 15.3.0, GNU ld (GNU Binutils) 2.46", build.GCC, "15.3.0", 15, "gcc (GCC) 15.3.0"},
	{"gcc version 4.8.5 20150623 (Red Hat 4.8.5-39) (GCC) ", build.GCC, "4.8.5", 4, "gcc version 4.8.5 20150623 (Red Hat 4.8.5-39) (GCC)"},
	{"gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0, GNU ld (GNU Binutils for Ubuntu) 2.38", build.GCC, "11.4.0", 11, "gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0"},
	{"aarch64-linux-gcc.br_real (Buildroot 2020.08-14-ge5a2a90) 9.3.0, GNU ld (GNU Binutils) 2.33.1", build.GCC, "9.3.0", 9, "aarch64-linux-gcc.br_real (Buildroot 2020.08-14-ge5a2a90) 9.3.0"},
	{"Debian clang version 16.0.6 (15), Debian LLD 16.0.6", build.Clang, "16.0.6", 16, "Debian clang version 16.0.6 (15)"},
	{"clang version 17.0.6 (https://github.com/llvm/llvm-project 6009708b4367171ccdbf4b5905cb6a803753fe18), LLD 17.0.6", build.Clang, "17.0.6", 17, "clang version 17.0.6 (https://github.com/llvm/llvm-project 6009708b4367171ccdbf4b5905cb6a803753fe18)"},
	{"Ubuntu clang version 18.1.3 (1ubuntu1)\nTarget: x86_64-pc-linux-gnu", build.Clang, "18.1.3", 18, "Ubuntu clang version 18.1.3 (1ubuntu1)"},
	{"cc (Debian 12.2.0-14) 12.2.0", "", "12.2.0", 12, "cc (Debian 12.2.0-14) 12.2.0"},
	{"gcc (Debian 12.2.0-14)", build.GCC, "12.2.0", 12, "gcc (Debian 12.2.0-14)"}, // only inside parentheses
	{"gcc (GCC) 14, GNU ld", build.GCC, "", 0, ""}, // no dotted version
	{"", "", "", 0, ""},
	{"GNU ld (GNU Binutils) 2.40", "", "2.40", 2, "GNU ld (GNU Binutils) 2.40"},
}

func TestParseCompiler(t *testing.T) {
	t.Parallel()
	for _, tc := range compilerCases {
		c, ok := build.ParseCompiler(tc.in)
		if ok != (tc.ver != "") {
			t.Errorf("ParseCompiler(%q) ok = %v", tc.in, ok)
			continue
		}
		if !ok {
			continue
		}
		if c.Family != tc.family || c.Version != tc.ver || c.Major != tc.major || c.Text != tc.text {
			t.Errorf("ParseCompiler(%q) = %+v, want %s %s %d %q", tc.in, c, tc.family, tc.ver, tc.major, tc.text)
		}
	}
}

func TestCompilerFromBanner(t *testing.T) {
	t.Parallel()
	c, ok := build.CompilerFromBanner("Linux version 6.12.81-flatcar (build@pony-truck.infra.kinvolk.io) (x86_64-cros-linux-gnu-gcc (Gentoo Hardened 14.2.1_p20241221 p7) 14.2.1 20241221, GNU ld (Gentoo 2.44 p1) 2.44.0) #1 SMP PREEMPT_DYNAMIC Tue Apr  1 19:04:31 -00 2025")
	if !ok || c.Family != build.GCC || c.Version != "14.2.1" || c.Major != 14 {
		t.Errorf("CompilerFromBanner = %+v, %v", c, ok)
	}
	if got := c.String(); got != `gcc 14.2.1 ("x86_64-cros-linux-gnu-gcc (Gentoo Hardened 14.2.1_p20241221 p7) 14.2.1 20241221")` {
		t.Errorf("String() = %s", got)
	}
	for _, b := range []string{"", "Linux version 6.1.0 (me@host)", "not a banner (gcc (GCC) 12.2.0)"} {
		if c, ok := build.CompilerFromBanner(b); ok {
			t.Errorf("CompilerFromBanner(%q) = %+v", b, c)
		}
	}
}

func TestJobsFor(t *testing.T) {
	t.Parallel()
	const gib = 1 << 30
	for _, tc := range []struct {
		cpus int
		mem  uint64
		want int
	}{
		{16, 64 * gib, 16},
		{16, 12 * gib, 8},
		{2, 23 * gib, 2},
		{8, gib, 1}, // never 0
		{4, 0, 4},   // memory unknown
		{0, 0, 1},
		{4096, 1 << 50, 1024},
	} {
		if got := build.JobsFor(tc.cpus, tc.mem); got != tc.want {
			t.Errorf("JobsFor(%d, %d) = %d, want %d", tc.cpus, tc.mem, got, tc.want)
		}
	}
}

func TestDefaultJobs(t *testing.T) {
	t.Parallel()
	cpus := min(runtime.GOMAXPROCS(0), 1024)
	write := func(dir, name, data string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	proc, sys := t.TempDir(), t.TempDir()
	write(proc, "meminfo", "MemTotal:        1610613 kB\nMemFree: 1 kB\n")
	if got := build.DefaultJobs(host.Roots{Proc: proc, Sys: sys}); got != 1 { // 1.5 GiB + a little: one job whatever the CPUs
		t.Errorf("DefaultJobs = %d, want 1", got)
	}
	if got := build.DefaultJobs(host.Roots{Proc: t.TempDir(), Sys: t.TempDir()}); got != cpus {
		t.Errorf("DefaultJobs without meminfo = %d, want the CPU count %d", got, cpus)
	}

	// A container limited to 1.5 GiB on a large machine: one job, v2 or v1.
	big := t.TempDir()
	write(big, "meminfo", "MemTotal: 1073741824 kB\n") // 1 TiB
	v2, v1 := t.TempDir(), t.TempDir()
	write(v2, "fs/cgroup/memory.max", "1610612736\n")
	write(v1, "fs/cgroup/memory/memory.limit_in_bytes", "1610612736\n")
	for _, sys := range []string{v2, v1} {
		if got := build.DefaultJobs(host.Roots{Proc: big, Sys: sys}); got != 1 {
			t.Errorf("DefaultJobs with a 1.5 GiB cgroup limit (%s) = %d, want 1", sys, got)
		}
	}
	// No limit ("max", v1's huge number) leaves MemTotal to decide.
	unlimited := t.TempDir()
	write(unlimited, "fs/cgroup/memory.max", "max\n")
	if got := build.DefaultJobs(host.Roots{Proc: big, Sys: unlimited}); got != cpus {
		t.Errorf("DefaultJobs with memory.max = max: %d, want %d", got, cpus)
	}
	write(v1, "fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
	if got := build.DefaultJobs(host.Roots{Proc: big, Sys: v1}); got != cpus {
		t.Errorf("DefaultJobs with v1's unlimited value: %d, want %d", got, cpus)
	}
}

func TestParseMemoryLimit(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]uint64{"4294967296\n": 4 << 30, "max\n": 0, "": 0, "0": 0, "-1": 0, "12 34": 0} {
		got, ok := build.ParseMemoryLimit(in)
		if got != want || ok != (want != 0) {
			t.Errorf("ParseMemoryLimit(%q) = %d, %v; want %d", in, got, ok, want)
		}
	}
}

func TestParseMemTotal(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"MemTotal:       24522012 kB\nMemFree: 3 kB\n", 24522012 * 1024, true},
		{"MemFree: 3 kB\nMemTotal: 2048 B\n", 2048, true},
		{"MemTotal: 12\n", 12, true},
		{"MemTotal: 12 MB\n", 0, false},
		{"MemTotal: x kB\n", 0, false},
		{"MemTotal: 18446744073709551615 kB\n", 0, false},
		{"MemTotal:\n", 0, false},
		{"MemFree: 3 kB\n", 0, false},
	} {
		got, ok := build.ParseMemTotal(strings.NewReader(tc.in))
		if got != tc.want || ok != tc.ok {
			t.Errorf("ParseMemTotal(%q) = %d, %v; want %d, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

func TestParseUTSRelease(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in, want string
		ok       bool
	}{
		{"#define UTS_RELEASE \"6.1.0-57-amd64\"\n", "6.1.0-57-amd64", true},
		{"/* x */\n#define  UTS_RELEASE\t\"6.12.81-flatcar\"", "6.12.81-flatcar", true},
		{"#define UTS_RELEASE \"\"\n", "", false},
		{"#define UTS_RELEASE \"a\"b\"\n", "", false},
		{"#define UTS_RELEASE 6.1\n", "", false},
		{"#define UTS_VERSION \"#1 SMP\"\n", "", false},
	} {
		got, ok := build.ParseUTSRelease(tc.in)
		if got != tc.want || ok != tc.ok {
			t.Errorf("ParseUTSRelease(%q) = %q, %v", tc.in, got, ok)
		}
	}
}

func TestParseVersionString(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in, want string
		ok       bool
	}{
		{"ccflags-y += -D__KERNEL__ -DMODULE -DNVRM\nccflags-y += -DNV_VERSION_STRING=\\\"535.261.03\\\"\n", "535.261.03", true},
		{"EXTRA_CFLAGS += -DNV_VERSION_STRING=\"580.95.05\" -Wall", "580.95.05", true},
		{"# ccflags-y += -DNV_VERSION_STRING=\\\"1.2\\\"\nccflags-y += -DNV_VERSION_STRING=\\\"3.4\\\"", "3.4", true},
		{"ccflags-y += -DNV_VERSION_STRING=\\\"\\\"", "", false},
		{"ccflags-y += -DNV_VERSION_STRING=$(shell cat version)", "", false},
		{"ccflags-y += -DNVRM", "", false},
	} {
		got, ok := build.ParseVersionString(tc.in)
		if got != tc.want || ok != tc.ok {
			t.Errorf("ParseVersionString(%q) = %q, %v", tc.in, got, ok)
		}
	}
	dir := t.TempDir()
	if _, err := build.SourceVersion(dir); err == nil {
		t.Error("SourceVersion without a Kbuild succeeded")
	}
	if err := os.WriteFile(filepath.Join(dir, "Kbuild"), []byte("ccflags-y += -DNV_VERSION_STRING=\\\"535.261.03\\\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if v, err := build.SourceVersion(dir); err != nil || v != "535.261.03" {
		t.Errorf("SourceVersion = %q, %v", v, err)
	}
}

func TestIncludedMakefileDir(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in, want string
		ok       bool
	}{
		{"include /usr/src/linux-headers-6.1.0-57-common/Makefile\n", "/usr/src/linux-headers-6.1.0-57-common", true},
		{"# Automatically generated by /src/linux/Makefile: don't edit\nexport KBUILD_OUTPUT = .\ninclude /src/linux/Makefile\n", "/src/linux", true},
		{"include ../common/Makefile\n", "", false},
		{"include $(srctree)/Makefile\n", "", false},
		{"include /src/linux/Kbuild\n", "", false},
		{"VERSION = 6\nPATCHLEVEL = 1\n", "", false},
	} {
		got, ok := build.IncludedMakefileDir(tc.in)
		if got != tc.want || ok != tc.ok {
			t.Errorf("IncludedMakefileDir(%q) = %q, %v", tc.in, got, ok)
		}
	}
}
