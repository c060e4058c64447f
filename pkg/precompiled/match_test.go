package precompiled

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const (
	flatcarBanner = "Linux version 6.12.81-flatcar (build@pony-truck.infra.kinvolk.io) (x86_64-cros-linux-gnu-gcc (Gentoo Hardened 14.3.1 p1) 14.3.1 20250801, GNU ld (Gentoo 2.44 p1) 2.44.0) #1 SMP PREEMPT_DYNAMIC Fri Oct 10 18:05:42 -00 2026"
	debianBanner  = "Linux version 6.1.0-41-amd64 (debian-kernel@lists.debian.org) (gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40) #1 SMP PREEMPT_DYNAMIC Debian 6.1.158-1 (2025-11-09)"
	ubuntuBanner  = "Linux version 5.4.0-64-generic (buildd@lcy01-amd64-010) (gcc version 9.3.0 (Ubuntu 9.3.0-17ubuntu1~20.04)) #72-Ubuntu SMP Wed Jan 20 17:27:05 UTC 2021"
)

func TestParseBanner(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in   string
		want Banner
	}{
		{flatcarBanner, Banner{
			Release:     "6.12.81-flatcar",
			BuildHost:   "build@pony-truck.infra.kinvolk.io",
			Compiler:    "x86_64-cros-linux-gnu-gcc (Gentoo Hardened 14.3.1 p1) 14.3.1 20250801, GNU ld (Gentoo 2.44 p1) 2.44.0",
			BuildNumber: "1", Flags: "SMP PREEMPT_DYNAMIC", Date: "Fri Oct 10 18:05:42 -00 2026",
		}},
		{debianBanner + "\n", Banner{
			Release:     "6.1.0-41-amd64",
			BuildHost:   "debian-kernel@lists.debian.org",
			Compiler:    "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40",
			BuildNumber: "1", Flags: "SMP PREEMPT_DYNAMIC", Date: "Debian 6.1.158-1 (2025-11-09)",
		}},
		{ubuntuBanner, Banner{
			Release: "5.4.0-64-generic", BuildHost: "buildd@lcy01-amd64-010",
			Compiler:    "gcc version 9.3.0 (Ubuntu 9.3.0-17ubuntu1~20.04)",
			BuildNumber: "72-Ubuntu", Flags: "SMP", Date: "Wed Jan 20 17:27:05 UTC 2021",
		}},
		{"Linux version 6.6.0 (a@b) #3 PREEMPT_RT Mon Jan 1 00:00:00 UTC 2024", Banner{
			Release: "6.6.0", BuildHost: "a@b", BuildNumber: "3", Flags: "PREEMPT_RT", Date: "Mon Jan 1 00:00:00 UTC 2024",
		}},
	}
	for _, tc := range tests {
		got, ok := ParseBanner(tc.in)
		if !ok || got != tc.want {
			t.Errorf("ParseBanner(%q) = %+v, %v\nwant %+v", tc.in, got, ok, tc.want)
		}
	}
	for _, bad := range []string{"", "boot/vmlinuz-5.15.0-91-generic", "5.15.0-91-generic", "Linux version ",
		"Linux version 6.1 ", "Linux version 6.1 (unbalanced", "Linux version 6.1 no-parens"} {
		if b, ok := ParseBanner(bad); ok {
			t.Errorf("ParseBanner(%q) = %+v, want failure", bad, b)
		}
	}
}

func TestExplain(t *testing.T) {
	t.Parallel()
	replace := func(old, new string) string { return strings.Replace(flatcarBanner, old, new, 1) }
	tests := []struct {
		name, stored, running string
		want                  []string
	}{
		{"identical", flatcarBanner, flatcarBanner + "\n", []string{"proc versions match"}},
		{"release", flatcarBanner, debianBanner, []string{
			"proc version mismatch: release differs, and also build host, compiler, date (first difference at byte 17)",
			"* release       6.12.81-flatcar",
			"  build number  1",
			"6.1.0-41-amd64",
		}},
		{"build host", flatcarBanner, replace("pony-truck", "other-host"), []string{"build host differs (first difference", "* build host", "build@other-host.infra.kinvolk.io", "  release"}},
		{"compiler", flatcarBanner, replace("14.3.1 20250801", "14.3.1 20250901"), []string{"compiler differs", "* compiler"}},
		{"build number", flatcarBanner, replace("#1 ", "#2 "), []string{": build number differs", "* build number  1", "2\n"}},
		{"flags", flatcarBanner, replace("PREEMPT_DYNAMIC", "PREEMPT_RT"), []string{"flags differs"}},
		{"date", flatcarBanner, replace("18:05:42", "18:05:43"), []string{"date differs", "* date", "Fri Oct 10 18:05:43 -00 2026"}},
		{"spacing", flatcarBanner, replace(" #1", "  #1"), []string{"fields agree", "spacing", "running: "}},
		{"ubuntu vmlinuz string", "boot/vmlinuz-5.15.0-91-generic", debianBanner, []string{"package's proc version is not a Linux kernel banner", "byte 0", "package: boot/vmlinuz"}},
		{"running garbage", flatcarBanner, "\x00\t", []string{"running proc version is not", `running: "\x00\t"`}},
		{"both garbage", "a", "b", []string{"package's and running proc versions are not"}},
		{"empty stored", "", flatcarBanner, []string{`package: ""`}},
	}
	for _, tc := range tests {
		got := Explain(tc.stored, tc.running)
		for _, s := range tc.want {
			if !strings.Contains(got, s) {
				t.Errorf("%s: Explain output lacks %q:\n%s", tc.name, s, got)
			}
		}
	}
	t.Log("\n" + Explain(flatcarBanner, debianBanner))
}

func TestMatchAndReadBanner(t *testing.T) {
	t.Parallel()
	p := &Package{DriverVersion: "1", ProcVersion: flatcarBanner}
	if !Match(p, flatcarBanner) || !Match(p, flatcarBanner+"\nsecond line") {
		t.Error("Match rejects the same banner")
	}
	for _, s := range []string{flatcarBanner + " ", " " + flatcarBanner, debianBanner, "", strings.ToLower(flatcarBanner)} {
		if Match(p, s) {
			t.Errorf("Match(%q) = true", s)
		}
	}
	dir := t.TempDir()
	if _, err := ReadBanner(dir); err == nil {
		t.Error("ReadBanner without a version file succeeded")
	}
	for content, want := range map[string]string{
		flatcarBanner + "\n":       flatcarBanner,
		flatcarBanner:              flatcarBanner,
		"first\r\nsecond\n":        "first\r",
		"":                         "",
		strings.Repeat("x", 70000): strings.Repeat("x", 64<<10),
	} {
		if err := os.WriteFile(filepath.Join(dir, "version"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		got, err := ReadBanner(dir)
		if err != nil || got != want {
			t.Errorf("ReadBanner(%.20q) = %.20q, %v; want %.20q", content, got, err, want)
		}
	}
}
