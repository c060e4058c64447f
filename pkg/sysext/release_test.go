package sysext_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/sysext"
)

func TestCheck(t *testing.T) {
	flatcar := sysext.Host{ID: "flatcar", VersionID: "4593.2.0", SysextLevel: "1.0", Architecture: "x86-64"}
	for _, tc := range []struct {
		name string
		ext  sysext.Release
		host sysext.Host
		want string // "" accepted, else part of the refusal
	}{
		{"same release", sysext.Release{ID: "flatcar", VersionID: "4593.2.0", Architecture: "x86-64"}, flatcar, ""},
		{"another release", sysext.Release{ID: "flatcar", VersionID: "4459.2.1", Architecture: "x86-64"}, flatcar,
			"it is for flatcar 4459.2.1, the host runs flatcar 4593.2.0; use the extension built for 4593.2.0"},
		{"another architecture", sysext.Release{ID: "flatcar", VersionID: "4593.2.0", Architecture: "arm64"}, flatcar, "architecture arm64, the host is x86-64"},
		{"any architecture", sysext.Release{ID: "flatcar", VersionID: "4593.2.0", Architecture: "_any"}, flatcar, ""},
		{"another OS", sysext.Release{ID: "ubuntu", VersionID: "4593.2.0"}, flatcar, "it is for OS ubuntu, the host is flatcar"},
		{"any OS", sysext.Release{ID: "_any"}, flatcar, ""},
		{"no ID", sysext.Release{VersionID: "4593.2.0"}, flatcar, "sets no ID"},
		{"level only", sysext.Release{ID: "flatcar", SysextLevel: "1.0"}, flatcar, ""},
		{"level wins over version", sysext.Release{ID: "flatcar", SysextLevel: "1.0", VersionID: "1.2.3"}, flatcar, ""},
		{"other level", sysext.Release{ID: "flatcar", SysextLevel: "2.0"}, flatcar, "SYSEXT_LEVEL 2.0, the host has 1.0"},
		{"neither", sysext.Release{ID: "flatcar"}, flatcar, "neither SYSEXT_LEVEL nor VERSION_ID"},
		{"rolling host", sysext.Release{ID: "arch", VersionID: "1"}, sysext.Host{ID: "arch"}, ""},
		{"level host without version", sysext.Release{ID: "x", VersionID: "1"}, sysext.Host{ID: "x", SysextLevel: "1"}, "no SYSEXT_LEVEL matching the host's 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := sysext.Check("ext", tc.ext, tc.host)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tc.want != "" && (!errors.Is(err, sysext.ErrRefused) || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("error %v, want ErrRefused with %q", err, tc.want)
			}
		})
	}
}

func TestParseRelease(t *testing.T) {
	r, err := sysext.ParseRelease([]byte("# made by driver-agent\nID=flatcar\nVERSION_ID=\"4593.2.0\"\nARCHITECTURE=x86-64\nOTHER=x\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := (sysext.Release{ID: "flatcar", VersionID: "4593.2.0", Architecture: "x86-64"}); r != want {
		t.Errorf("%+v, want %+v", r, want)
	}
	if _, err := sysext.ParseRelease([]byte("ID=flatcar\nnot an assignment\n")); err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Errorf("error %v, want one naming line 2", err)
	}
}

func TestNames(t *testing.T) {
	n := sysext.Name("535.261.03", "4593.2.0")
	if n != "nvidia-driver-535.261.03-flatcar4593.2.0" {
		t.Fatalf("Name: %q", n)
	}
	if d, v, ok := sysext.ParseName(n); !ok || d != "535.261.03" || v != "4593.2.0" {
		t.Errorf("ParseName(%q) = %q %q %v", n, d, v, ok)
	}
	for _, bad := range []string{"nvidia-driver-535.261.03", "nvidia-drivers-535-open", "nvidia-driver-535.261.03-flatcar4593.2.0.raw", "nvidia-driver-x-flatcar1.2.3"} {
		if _, _, ok := sysext.ParseName(bad); ok {
			t.Errorf("ParseName(%q) accepted", bad)
		}
	}
	for in, want := range map[string]string{"amd64-usr": "x86-64", "arm64-usr": "arm64", "amd64": "x86-64"} {
		if got, err := sysext.Architecture(in); err != nil || got != want {
			t.Errorf("Architecture(%q) = %q, %v", in, got, err)
		}
	}
	if _, err := sysext.Architecture("riscv-usr"); err == nil {
		t.Error("Architecture(riscv-usr) accepted")
	}
}
