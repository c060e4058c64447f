package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const committed = "../../images/releases.json"

func loadCommitted(t *testing.T) *Data {
	t.Helper()
	d, err := loadFile(committed)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// The committed data file is valid, and every tag it produces is exactly what the operator
// resolves for a node of that release.
func TestCommittedData(t *testing.T) {
	d := loadCommitted(t)
	n := Naming{Image: "registry.example/team/driver", Plain: true, Prefix: "v1.2.3"}
	refs, err := AllRefs(d, n)
	if err != nil {
		t.Fatal(err)
	}
	for _, drv := range d.Drivers {
		for _, r := range d.Releases() {
			for _, dv := range []string{drv.Version, "v1.2.3-" + drv.Version} {
				want := n.Image + ":" + OperatorTag(dv, "flatcar", r.Version)
				if !slices.Contains(refs, want) {
					t.Errorf("a %s node with driver.version=%s pulls %s, which is not built", r.Version, dv, want)
				}
			}
		}
		if base := n.Image + ":" + drv.Version + "-flatcar"; !slices.Contains(refs, base) {
			t.Errorf("no build image %s", base)
		}
	}
	for _, tl := range d.Talos {
		want := n.Image + ":" + OperatorTag(tl.Driver, "talos", tl.Version)
		if !slices.Contains(refs, want) {
			t.Errorf("a Talos %s node pulls %s, which is not built", tl.Version, want)
		}
	}
}

const good = `{
  "platforms": ["linux/amd64", "linux/arm64"],
  "drivers": [
    {"version": "580.159.04", "precompiled": true, "runSHA256": {"amd64": "` + sum64 + `"}},
    {"version": "570.195.03"}
  ],
  "flatcar": {"stable": ["4593.2.0", "4459.2.4"], "lts": ["4081.3.6"], "beta": []},
  "talos": [{"version": "v1.12.0", "driver": "570.195.03"}]
}`

const sum64 = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func TestLoadRejects(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, old, new, want string
	}{
		{"unknown field", `"platforms":`, `"platfroms":`, `unknown field "platfroms"`},
		{"no platforms", `"platforms": ["linux/amd64", "linux/arm64"]`, `"platforms": []`, "platforms: empty"},
		{"bad platform", `"linux/arm64"]`, `"linux/riscv64"]`, `"linux/riscv64" is not supported`},
		{"duplicate platform", `"linux/arm64"]`, `"linux/amd64"]`, "linux/amd64 listed twice"},
		{"bad driver", `"570.195.03"}`, `"570-195"}`, `"570-195" is not an NVIDIA driver version`},
		{"old branch", `"570.195.03"}`, `"470.256.02"}`, "branch 470 has no open kernel modules"},
		{"duplicate driver", `"570.195.03"}`, `"580.159.04"}`, "580.159.04 listed twice"},
		{"bad sha", sum64, "ABC", "runSHA256[amd64] is not 64 lower-case hex digits"},
		{"bad sha arch", `"amd64": "`, `"x86_64": "`, `runSHA256 key "x86_64"`},
		{"unknown channel", `"beta": []`, `"edge": []`, `unknown channel "edge"`},
		{"wrong channel", `"4459.2.4"`, `"4459.1.4"`, "4459.1.4 is a beta release (minor 1), not stable"},
		{"bad version", `"4459.2.4"`, `"4459.2"`, `"4459.2" is not a Flatcar VERSION_ID`},
		{"duplicate release", `"lts": ["4081.3.6"]`, `"lts": ["4593.2.0"]`, "4593.2.0 listed twice"},
		{"no releases", `{"stable": ["4593.2.0", "4459.2.4"], "lts": ["4081.3.6"], "beta": []}`, `{}`, "flatcar: no releases"},
		{"talos driver", `"driver": "570.195.03"`, `"driver": "535.1.1"`, `driver "535.1.1" is not in drivers`},
		{"talos version", `"v1.12.0"`, `"1.12.0"`, `"1.12.0" is not a Talos VERSION_ID`},
		{"trailing value", "\n}", "\n} {}", "more than one JSON value"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if !strings.Contains(good, tt.old) {
				t.Fatalf("fixture lacks %q", tt.old)
			}
			_, err := Load(strings.NewReader(strings.Replace(good, tt.old, tt.new, 1)))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Load: %v, want an error containing %q", err, tt.want)
			}
		})
	}
	if _, err := Load(strings.NewReader(good)); err != nil {
		t.Fatalf("the good fixture: %v", err)
	}
}

func TestParseTag(t *testing.T) {
	t.Parallel()
	ok := map[string]Tag{
		"580.159.04-flatcar":                  {Driver: "580.159.04", OS: "flatcar"},
		"580.159.04-flatcar4593.2.0":          {Driver: "580.159.04", OS: "flatcar", OSVersion: "4593.2.0"},
		"v1.2.0-580.159.04-flatcar4081.3.6":   {Prefix: "v1.2.0", Driver: "580.159.04", OS: "flatcar", OSVersion: "4081.3.6"},
		"v1.2.0-rc.1-580.159.04-flatcar":      {Prefix: "v1.2.0-rc.1", Driver: "580.159.04", OS: "flatcar"},
		"edge-570.195.03-talosv1.12.0":        {Prefix: "edge", Driver: "570.195.03", OS: "talos", OSVersion: "v1.12.0"},
		"550.54-flatcar4593.0.0":              {Driver: "550.54", OS: "flatcar", OSVersion: "4593.0.0"},
		"595.71.05-flatcar4628.1.0":           {Driver: "595.71.05", OS: "flatcar", OSVersion: "4628.1.0"},
		"v10.20.30-595.71.05-flatcar4593.2.0": {Prefix: "v10.20.30", Driver: "595.71.05", OS: "flatcar", OSVersion: "4593.2.0"},
	}
	for tag, want := range ok {
		got, err := ParseTag(tag)
		if err != nil || got != want {
			t.Errorf("ParseTag(%q) = %+v, %v; want %+v", tag, got, err, want)
			continue
		}
		if got.String() != tag {
			t.Errorf("%q: String() = %q", tag, got.String())
		}
		if op := OperatorTag(got.DriverVersion(), got.OS, got.OSVersion); op != tag {
			t.Errorf("%q: the operator resolves %q", tag, op)
		}
	}
	bad := map[string]string{
		"":                            "not a valid image tag",
		"580.159.04-ubuntu24.04":      "does not follow",
		"580.159.04-flatcar-4593.2.0": "does not follow",
		"580.159.04-flatcar4593.2":    "does not follow",
		"580.159.04-flatcar4593.7.0":  "not a Flatcar release on a known channel",
		"580-flatcar":                 "does not follow",
		"latest-580.159.04-flatcar":   "does not follow",
		"580.159.04-talos1.12.0":      "does not follow",
		"580.159.04-talos":            "does not follow",
		"-580.159.04-flatcar":         "not a valid image tag",
		strings.Repeat("1", 129):      "not a valid image tag",
		"580.159.04-flatcar4593.2.0 ": "not a valid image tag",
	}
	for tag, want := range bad {
		if _, err := ParseTag(tag); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseTag(%q) = %v, want an error containing %q", tag, err, want)
		}
	}
}

func mustLoad(t *testing.T, s string) *Data {
	t.Helper()
	d, err := Load(strings.NewReader(s))
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestMatrices(t *testing.T) {
	t.Parallel()
	d := mustLoad(t, good)
	n := Naming{Image: "ghcr.io/o/driver", Prefix: "v1.2.0", Plain: true}

	build, _, err := BuildMatrix(d, n)
	if err != nil {
		t.Fatal(err)
	}
	wantBuild := []Entry{
		{"driver": "580.159.04", "platforms": "linux/amd64,linux/arm64", "ref": "ghcr.io/o/driver:v1.2.0-580.159.04-flatcar",
			"tags":         "ghcr.io/o/driver:580.159.04-flatcar\nghcr.io/o/driver:v1.2.0-580.159.04-flatcar",
			"sha256_amd64": sum64, "sha256_arm64": ""},
		{"driver": "570.195.03", "platforms": "linux/amd64,linux/arm64", "ref": "ghcr.io/o/driver:v1.2.0-570.195.03-flatcar",
			"tags":         "ghcr.io/o/driver:570.195.03-flatcar\nghcr.io/o/driver:v1.2.0-570.195.03-flatcar",
			"sha256_amd64": "", "sha256_arm64": ""},
	}
	if !slices.EqualFunc(build.Include, wantBuild, entryEqual) {
		t.Errorf("build matrix:\n%v\nwant\n%v", build.Include, wantBuild)
	}

	pre, _, err := PrecompiledMatrix(d, n)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range pre.Include {
		if e["base"] != "ghcr.io/o/driver:v1.2.0-580.159.04-flatcar" {
			t.Errorf("%s: base %s, want this release's build image", e["ref"], e["base"])
		}
		got = append(got, e["channel"]+" "+e["flatcar"]+" "+e["tags"])
	}
	wantPre := []string{
		"stable 4593.2.0 ghcr.io/o/driver:580.159.04-flatcar4593.2.0\nghcr.io/o/driver:v1.2.0-580.159.04-flatcar4593.2.0",
		"stable 4459.2.4 ghcr.io/o/driver:580.159.04-flatcar4459.2.4\nghcr.io/o/driver:v1.2.0-580.159.04-flatcar4459.2.4",
		"lts 4081.3.6 ghcr.io/o/driver:580.159.04-flatcar4081.3.6\nghcr.io/o/driver:v1.2.0-580.159.04-flatcar4081.3.6",
	}
	if !slices.Equal(got, wantPre) {
		t.Errorf("precompiled matrix:\n%q\nwant\n%q", got, wantPre)
	}

	aliases, _, err := AliasMatrix(d, n)
	if err != nil {
		t.Fatal(err)
	}
	got = nil
	for _, e := range aliases.Include {
		if e["source"] != "ghcr.io/o/driver:v1.2.0-570.195.03-flatcar" {
			t.Errorf("%s: source %s", e["ref"], e["source"])
		}
		got = append(got, e["ref"])
	}
	wantAliases := []string{
		"ghcr.io/o/driver:v1.2.0-570.195.03-flatcar4593.2.0",
		"ghcr.io/o/driver:v1.2.0-570.195.03-flatcar4459.2.4",
		"ghcr.io/o/driver:v1.2.0-570.195.03-flatcar4081.3.6",
		"ghcr.io/o/driver:v1.2.0-570.195.03-talosv1.12.0",
	}
	if !slices.Equal(got, wantAliases) {
		t.Errorf("alias matrix refs %q, want %q", got, wantAliases)
	}

	sx := SysextMatrix(d, n)
	got = nil
	for _, e := range sx.Include {
		if !strings.HasPrefix(e["base"], "ghcr.io/o/driver:v1.2.0-"+e["driver"]+"-flatcar") {
			t.Errorf("%s: base %s, want the driver's build image", e["asset"], e["base"])
		}
		got = append(got, e["channel"]+" "+e["flatcar"]+" "+e["asset"])
	}
	wantSysext := []string{
		"stable 4593.2.0 nvidia-driver-580.159.04-flatcar4593.2.0.raw",
		"stable 4459.2.4 nvidia-driver-580.159.04-flatcar4459.2.4.raw",
		"lts 4081.3.6 nvidia-driver-580.159.04-flatcar4081.3.6.raw",
		"stable 4593.2.0 nvidia-driver-570.195.03-flatcar4593.2.0.raw",
		"stable 4459.2.4 nvidia-driver-570.195.03-flatcar4459.2.4.raw",
		"lts 4081.3.6 nvidia-driver-570.195.03-flatcar4081.3.6.raw",
	}
	if !slices.Equal(got, wantSysext) {
		t.Errorf("sysext matrix:\n%q\nwant\n%q", got, wantSysext)
	}

	refs, err := AllRefs(d, n)
	if err != nil {
		t.Fatal(err)
	}
	// 2 build + 3 precompiled + 4 aliases, each plain and prefixed
	if len(refs) != 18 {
		t.Errorf("%d references, want 18: %q", len(refs), refs)
	}
}

func entryEqual(a, b Entry) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || v != w {
			return false
		}
	}
	return true
}

// A matrix with no jobs is {"include":[]}: the workflows test for exactly that string.
func TestEmptyMatrixJSON(t *testing.T) {
	t.Parallel()
	d := mustLoad(t, strings.Replace(good, `"precompiled": true`, `"precompiled": false`, 1))
	m, _, err := PrecompiledMatrix(d, Naming{Image: "r/d", Plain: true})
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `{"include":[]}` {
		t.Errorf("empty matrix is %s", b)
	}
}

func TestNamingCheck(t *testing.T) {
	t.Parallel()
	bad := map[string]Naming{
		"-image is empty":        {Plain: true},
		"without tag or digest":  {Image: "r/d@sha256:00", Plain: true},
		"without tag":            {Image: "localhost:5000/d:latest", Plain: true},
		"use edge or an agent":   {Image: "r/d", Prefix: "nightly", Plain: true},
		"-plain=false needs":     {Image: "r/d"},
		"use edge or an agent r": {Image: "r/d", Prefix: "v1.2"},
	}
	for want, n := range bad {
		if err := n.check(); err == nil || !strings.Contains(err.Error(), strings.TrimSuffix(want, " r")) {
			t.Errorf("%+v: %v, want %q", n, err, want)
		}
	}
	for _, n := range []Naming{{Image: "localhost:5000/d", Plain: true}, {Image: "r/d", Prefix: "edge"}, {Image: "r/d", Prefix: "v1.2.0-rc.3", Plain: true}} {
		if err := n.check(); err != nil {
			t.Errorf("%+v: %v", n, err)
		}
	}
}

// A prefix-only run pushes no plain tag, so it cannot move what users pull.
func TestPrefixOnly(t *testing.T) {
	t.Parallel()
	refs, err := AllRefs(mustLoad(t, good), Naming{Image: "r/d", Prefix: "edge"})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range refs {
		if !strings.HasPrefix(r, "r/d:edge-") {
			t.Errorf("%s pushed by an edge build", r)
		}
	}
}

func TestAdd(t *testing.T) {
	t.Parallel()
	d := mustLoad(t, good)
	if err := d.Add("alpha=4650.0.0, stable=4593.2.0,beta=4628.1.0,"); err != nil {
		t.Fatal(err)
	}
	got := fmt.Sprint(d.Releases())
	want := "[{alpha 4650.0.0} {beta 4628.1.0} {stable 4593.2.0} {stable 4459.2.4} {lts 4081.3.6}]"
	if got != want {
		t.Errorf("releases %s, want %s", got, want)
	}
	if err := mustLoad(t, good).Add("stable=4628.1.0"); err == nil || !strings.Contains(err.Error(), "is a beta release") {
		t.Errorf("a beta release added as stable: %v", err)
	}
	if err := mustLoad(t, good).Add("4628.1.0"); err == nil || !strings.Contains(err.Error(), "not channel=version") {
		t.Errorf("a pair without channel: %v", err)
	}
}

func versionServer(t *testing.T, files map[string]string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, ok := files[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, body)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestCurrent(t *testing.T) {
	t.Parallel()
	files := map[string]string{
		"/alpha/version.txt":  "FLATCAR_BUILD=4650\nFLATCAR_VERSION=4650.0.0\nFLATCAR_VERSION_ID=4650.0.0\n",
		"/beta/version.txt":   "FLATCAR_VERSION=4628.1.0\n",
		"/stable/version.txt": "# comment\nFLATCAR_VERSION_ID=\"4593.2.0\"\nFLATCAR_SDK_VERSION=4593.0.0\n",
		"/lts/version.txt":    "FLATCAR_VERSION_ID=4081.3.6\r\n",
	}
	srv := versionServer(t, files)
	got, err := Current(context.Background(), srv.Client(), srv.URL+"/{channel}/version.txt")
	if err != nil {
		t.Fatal(err)
	}
	if want := "alpha=4650.0.0,beta=4628.1.0,stable=4593.2.0,lts=4081.3.6"; got != want {
		t.Errorf("Current = %s, want %s", got, want)
	}

	files["/lts/version.txt"] = "FLATCAR_VERSION_ID=4593.2.0\n"
	if _, err := Current(context.Background(), srv.Client(), srv.URL+"/{channel}/version.txt"); err == nil || !strings.Contains(err.Error(), "not a lts release") {
		t.Errorf("a stable release on lts: %v", err)
	}
	delete(files, "/beta/version.txt")
	if _, err := Current(context.Background(), srv.Client(), srv.URL+"/{channel}/version.txt"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("a missing version.txt: %v", err)
	}
}

func TestParseVersionTxt(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"FLATCAR_VERSION=4593.2.0":                                  "4593.2.0",
		"FLATCAR_VERSION=4593.2.0+dev\nFLATCAR_VERSION_ID=4593.2.0": "4593.2.0",
		" FLATCAR_VERSION_ID='4081.3.6' ":                           "4081.3.6",
	} {
		if got, err := ParseVersionTxt(strings.NewReader(in)); err != nil || got != want {
			t.Errorf("%q: %q, %v; want %q", in, got, err, want)
		}
	}
	for in, want := range map[string]string{
		"":                          "no FLATCAR_VERSION_ID",
		"FLATCAR_BUILD=4593":        "no FLATCAR_VERSION_ID",
		"FLATCAR_VERSION=4593.2":    "not a Flatcar VERSION_ID",
		"FLATCAR_VERSION=../../etc": "not a Flatcar VERSION_ID",
	} {
		if _, err := ParseVersionTxt(strings.NewReader(in)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want %q", in, err, want)
		}
	}
}

func TestRun(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	data := filepath.Join(dir, "releases.json")
	if err := os.WriteFile(data, []byte(good), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		args        []string
		code        int
		out, errOut string
	}{
		{[]string{"-data", data, "check"}, 0, "2 drivers, 3 Flatcar releases, 1 Talos releases, 9 references: ok", ""},
		{[]string{"-data", data, "-image", "r/d", "-prefix", "edge", "-plain=false", "precompiled"}, 0, `"ref":"r/d:edge-580.159.04-flatcar4081.3.6"`, ""},
		{[]string{"-data", data, "-image", "r/d", "-add", "beta=4628.1.0", "tags"}, 0, "r/d:580.159.04-flatcar4628.1.0\n", ""},
		{[]string{"-data", data, "-add", "stable=4628.1.0", "tags"}, 1, "", "is a beta release"},
		{[]string{"-data", data, "-image", "r/d:latest", "build"}, 1, "", "without tag"},
		{[]string{"-data", filepath.Join(dir, "missing.json"), "build"}, 1, "", "run from the repository root"},
		{[]string{"check-tag", "580.159.04-flatcar4593.2.0"}, 0, "driver.version=580.159.04 on flatcar4593.2.0", ""},
		{[]string{"check-tag", "580.159.04-flatcar4593.2.0", "580.159.04-rhel9"}, 1, "", `"580.159.04-rhel9" does not follow`},
		{[]string{"check-tag"}, 2, "", "give one or more tags"},
		{[]string{"deploy"}, 2, "", `unknown command "deploy"`},
		{[]string{}, 2, "", "name a command"},
		{[]string{"-data", data, "build", "extra"}, 2, "", "unexpected arguments"},
	}
	for _, tt := range tests {
		var out, errOut bytes.Buffer
		code := run(context.Background(), tt.args, &out, &errOut, http.DefaultClient)
		if code != tt.code || !strings.Contains(out.String(), tt.out) || !strings.Contains(errOut.String(), tt.errOut) {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want %d, %q, %q", tt.args, code, out.String(), errOut.String(), tt.code, tt.out, tt.errOut)
		}
	}
}

func FuzzParseTag(f *testing.F) {
	for _, s := range []string{"580.159.04-flatcar", "v1.2.0-580.159.04-flatcar4593.2.0", "edge-570.195.03-talosv1.12.0", "x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tag, err := ParseTag(s)
		if err != nil {
			return
		}
		if tag.String() != s || OperatorTag(tag.DriverVersion(), tag.OS, tag.OSVersion) != s {
			t.Fatalf("%q parsed as %+v, which renders differently", s, tag)
		}
	})
}

func FuzzParseVersionTxt(f *testing.F) {
	f.Add("FLATCAR_VERSION=4593.2.0\n")
	f.Add("FLATCAR_VERSION_ID=\"4081.3.6\"\r\nX=1")
	f.Fuzz(func(t *testing.T, s string) {
		v, err := ParseVersionTxt(strings.NewReader(s))
		if err == nil && !flatcarRe.MatchString(v) {
			t.Fatalf("%q gave %q", s, v)
		}
	})
}

// Whatever Load accepts yields tags that all follow the scheme, none twice.
func FuzzLoad(f *testing.F) {
	f.Add(good)
	if b, err := os.ReadFile(committed); err == nil {
		f.Add(string(b))
	}
	f.Fuzz(func(t *testing.T, s string) {
		d, err := Load(strings.NewReader(s))
		if err != nil {
			return
		}
		for _, n := range []Naming{{Image: "r/d", Plain: true}, {Image: "r/d", Prefix: "v1.0.0", Plain: true}} {
			if _, err := AllRefs(d, n); err != nil {
				t.Fatalf("accepted data gives bad tags: %v", err)
			}
		}
	})
}
