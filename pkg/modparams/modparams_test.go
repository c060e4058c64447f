package modparams

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestParseParam(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Param
	}{
		{"NVreg_EnableGpuFirmware=0", Param{Name: "NVreg_EnableGpuFirmware", Value: "0"}},
		{"debug", Param{Name: "debug", Flag: true}},
		{"empty=", Param{Name: "empty"}},
		{`empty=""`, Param{Name: "empty"}},
		{`reg="a b  c"`, Param{Name: "reg", Value: "a b  c"}},
		{`reg="#not a comment"`, Param{Name: "reg", Value: "#not a comment"}},
		{"NVreg_RegistryDwords=RMFoo=1;RMBar=0x2", Param{Name: "NVreg_RegistryDwords", Value: "RMFoo=1;RMBar=0x2"}},
		{"a.b-c_d=x#y", Param{Name: "a.b-c_d", Value: "x#y"}},
		{"0x=1", Param{Name: "0x", Value: "1"}},
		{"_=1", Param{Name: "_", Value: "1"}},
		{"path=/lib/firmware/nvidia/580.1", Param{Name: "path", Value: "/lib/firmware/nvidia/580.1"}},
		{"u=héllo", Param{Name: "u", Value: "héllo"}},
	} {
		got, err := ParseParam(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseParam(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
}

func TestParseParamErrors(t *testing.T) {
	for _, tc := range []struct {
		in      string
		wantErr error
		wantMsg string
	}{
		{"", ErrInvalidName, `invalid parameter name ""`},
		{"=1", ErrInvalidName, `invalid parameter name ""`},
		{"-x=1", ErrInvalidName, `invalid parameter name "-x"`},
		{".x", ErrInvalidName, ""},
		{"a/b=1", ErrInvalidName, ""},
		{"a b=1", ErrInvalidName, ""},
		{"é=1", ErrInvalidName, ""},
		{"x=a\x01", ErrControlChar, "control character in value"},
		{"x=a\x00b", ErrControlChar, "control character in value"},
		{"x=\x7f", ErrControlChar, "control character in value"},
		{"x=\u0085", ErrControlChar, "control character in value"},
		{`x="a` + "\t" + `b"`, ErrControlChar, "control character in value"},
		{"x\x1b=1", ErrControlChar, "control character in name"},
		{"fl\x00g", ErrControlChar, "control character in name"},
		{"x=\xff", ErrInvalidUTF8, "invalid UTF-8 in value"},
		{"\xff=1", ErrInvalidUTF8, "invalid UTF-8 in name"},
		{`x="a`, ErrQuote, "does not end with one"},
		{`x="`, ErrQuote, "does not end with one"},
		{`x=a"b"`, ErrQuote, "in value"},
		{`x="a"b"`, ErrQuote, "in value"},
		{`x=a"`, ErrQuote, "in value"},
		{`"x"=1`, ErrQuote, "in name"},
		{`"x"`, ErrQuote, "in name"},
		{"x=a b", nil, "space in unquoted value"},
	} {
		_, err := ParseParam(tc.in)
		if err == nil {
			t.Errorf("ParseParam(%q) succeeded", tc.in)
			continue
		}
		if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
			t.Errorf("ParseParam(%q): error %q is not %v", tc.in, err, tc.wantErr)
		}
		if !strings.Contains(err.Error(), tc.wantMsg) {
			t.Errorf("ParseParam(%q): error %q does not contain %q", tc.in, err, tc.wantMsg)
		}
	}
}

func TestParamString(t *testing.T) {
	for _, tc := range []struct {
		p    Param
		want string
	}{
		{Param{Name: "a", Value: "1"}, "a=1"},
		{Param{Name: "a", Flag: true}, "a"},
		{Param{Name: "a"}, "a="},
		{Param{Name: "a", Value: "x y"}, `a="x y"`},
		{Param{Name: "a", Value: " "}, `a=" "`},
		{Param{Name: "a", Value: "x#y"}, "a=x#y"},
	} {
		if got := tc.p.String(); got != tc.want {
			t.Errorf("%+v.String() = %q, want %q", tc.p, got, tc.want)
		}
		// What String renders parses back to the same parameter.
		if back, err := ParseParam(tc.want); err != nil || back != tc.p {
			t.Errorf("ParseParam(%q) = %+v, %v; want %+v", tc.want, back, err, tc.p)
		}
	}
}

func TestParamValidate(t *testing.T) {
	for _, tc := range []struct {
		p       Param
		wantMsg string
	}{
		{Param{Name: "a", Value: "x"}, ""},
		{Param{Name: "a", Flag: true}, ""},
		{Param{Name: "a", Value: "x", Flag: true}, `flag "a" has a value`},
		{Param{Name: "a", Value: `x"y`}, "misplaced double quote in value"},
		{Param{Name: "a", Value: "x\ny"}, "control character in value"},
		{Param{Name: "", Value: "x"}, "invalid parameter name"},
	} {
		err := tc.p.Validate()
		if (err == nil) != (tc.wantMsg == "") || (err != nil && !strings.Contains(err.Error(), tc.wantMsg)) {
			t.Errorf("%+v.Validate() = %v, want %q", tc.p, err, tc.wantMsg)
		}
	}
}

func TestParseConf(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want Params
	}{
		{"empty", "", nil},
		{"blank and comments", "\n   \n# comment\n\t# indented comment\n", nil},
		{"one per line", "NVreg_EnableGpuFirmware=0\nNVreg_OpenRmEnableUnsupportedGpus=1\n",
			Params{{Name: "NVreg_EnableGpuFirmware", Value: "0"}, {Name: "NVreg_OpenRmEnableUnsupportedGpus", Value: "1"}}},
		{"several per line, tabs, no final newline", "a=1 b=2\t c=3",
			Params{{Name: "a", Value: "1"}, {Name: "b", Value: "2"}, {Name: "c", Value: "3"}}},
		{"trailing comment", "a=1 # the a parameter\nb=2\t#x",
			Params{{Name: "a", Value: "1"}, {Name: "b", Value: "2"}}},
		{"hash inside value is not a comment", "a=x#y b=\"p # q\"",
			Params{{Name: "a", Value: "x#y"}, {Name: "b", Value: "p # q"}}},
		{"quoted value with spaces", `NVreg_RegistryDwords="RMA=1; RMB=2" c=3`,
			Params{{Name: "NVreg_RegistryDwords", Value: "RMA=1; RMB=2"}, {Name: "c", Value: "3"}}},
		{"bare flag and empty value", "debug empty=",
			Params{{Name: "debug", Flag: true}, {Name: "empty"}}},
		{"CRLF", "a=1\r\nb=2\r\n",
			Params{{Name: "a", Value: "1"}, {Name: "b", Value: "2"}}},
		{"later value wins in place", "a=1 b=2\na=3\nc-x=4 c_x=5",
			Params{{Name: "a", Value: "3"}, {Name: "b", Value: "2"}, {Name: "c_x", Value: "5"}}},
		{"comment may hold quotes", `a=1 # "unbalanced`,
			Params{{Name: "a", Value: "1"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseConf(strings.NewReader(tc.in), "/drivers/nvidia.conf")
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("ParseConf(%q) = %#v, want %#v", tc.in, got, tc.want)
			}
		})
	}
}

func TestParseConfErrors(t *testing.T) {
	const file = "/drivers/nvidia.conf"
	for _, tc := range []struct {
		name    string
		in      string
		wantErr error
		want    string // the whole error text
	}{
		{"control character in value", "a=1\n\nb=2 NVreg_X=a\x01\n", ErrControlChar,
			`/drivers/nvidia.conf:3: parameter "NVreg_X=a\x01": control character in value`},
		{"NUL", "a=\x00", ErrControlChar,
			`/drivers/nvidia.conf:1: parameter "a=\x00": control character in value`},
		{"control character in name", "a\x02b=1", ErrControlChar,
			`/drivers/nvidia.conf:1: parameter "a\x02b=1": control character in name`},
		{"carriage return inside a line", "a=1\rb=2\n", ErrControlChar,
			`/drivers/nvidia.conf:1: parameter "a=1\rb=2": control character in value`},
		{"vertical tab separator", "a=1\vb=2", ErrControlChar,
			`/drivers/nvidia.conf:1: parameter "a=1\vb=2": control character in value`},
		{"control character in comment", "a=1 # bad \x07 bell", ErrControlChar,
			`/drivers/nvidia.conf:1: comment " bad \a bell": control character in comment`},
		{"invalid UTF-8", "a=\xc3", ErrInvalidUTF8,
			`/drivers/nvidia.conf:1: parameter "a=\xc3": invalid UTF-8 in value`},
		{"invalid name", "ok=1 -bad=1", ErrInvalidName,
			`/drivers/nvidia.conf:1: parameter "-bad=1": invalid parameter name "-bad" (want letters, digits, '_', '.' and '-', not starting with '.' or '-')`},
		{"slash in name", "a/b=1", ErrInvalidName,
			`/drivers/nvidia.conf:1: parameter "a/b=1": invalid parameter name "a/b" (want letters, digits, '_', '.' and '-', not starting with '.' or '-')`},
		{"empty name", "=1", ErrInvalidName,
			`/drivers/nvidia.conf:1: parameter "=1": invalid parameter name "" (want letters, digits, '_', '.' and '-', not starting with '.' or '-')`},
		{"unterminated quote", `a=1 b="x y`, ErrQuote,
			`/drivers/nvidia.conf:1: parameter "b=\"x y": misplaced double quote: unterminated quoted value`},
		{"quote inside value", `a=x"y z"`, ErrQuote,
			`/drivers/nvidia.conf:1: parameter "a=x\"y z\"": misplaced double quote in value (a value cannot contain '"')`},
		{"text after closing quote", `a="x"y`, ErrQuote,
			`/drivers/nvidia.conf:1: parameter "a=\"x\"y": misplaced double quote: value starts with '"' but does not end with one`},
		{"quoted name", `"a=1"`, ErrQuote,
			`/drivers/nvidia.conf:1: parameter "\"a=1\"": misplaced double quote in name`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ps, err := ParseConf(strings.NewReader(tc.in), file)
			if err == nil {
				t.Fatalf("ParseConf succeeded: %v", ps)
			}
			if ps != nil {
				t.Errorf("ParseConf returned parameters with an error: %v", ps)
			}
			if err.Error() != tc.want {
				t.Errorf("error:\n got %s\nwant %s", err, tc.want)
			}
			if !errors.Is(err, tc.wantErr) {
				t.Errorf("error %q is not %v", err, tc.wantErr)
			}
			var pe *ParseError
			if !errors.As(err, &pe) || pe.File != file {
				t.Errorf("error %q is not a *ParseError for %s", err, file)
			}
		})
	}
}

func TestParseConfAllErrorsReported(t *testing.T) {
	_, err := ParseConf(strings.NewReader("a=\x01\nok=1\nb=\"x\n"), "")
	want := "line 1: parameter \"a=\\x01\": control character in value\n" +
		"line 3: parameter \"b=\\\"x\": misplaced double quote: unterminated quoted value"
	if err == nil || err.Error() != want {
		t.Errorf("error:\n got %v\nwant %s", err, want)
	}
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("disk on fire") }

func TestParseConfReadErrors(t *testing.T) {
	if _, err := ParseConf(failingReader{}, "f.conf"); err == nil || err.Error() != "f.conf: read: disk on fire" {
		t.Errorf("read error: %v", err)
	}
	big := strings.Repeat("a=1\n", MaxConfSize/4+1)
	if _, err := ParseConf(strings.NewReader(big), ""); !errors.Is(err, ErrTooLong) || !strings.Contains(err.Error(), "<input>: file too long") {
		t.Errorf("big file: %v", err)
	}
	exact := strings.Repeat("a=1\n", MaxConfSize/4)
	if ps, err := ParseConf(strings.NewReader(exact), ""); err != nil || len(ps) != 1 {
		t.Errorf("file of exactly MaxConfSize: %v, %v", ps, err)
	}
}

func TestParamsLookup(t *testing.T) {
	ps := Params{
		{Name: "NVreg_EnableGpuFirmware", Value: "0"},
		{Name: "debug", Flag: true},
		{Name: "x-y", Value: "1"},
	}
	for _, tc := range []struct {
		name string
		has  bool
	}{
		{"NVreg_EnableGpuFirmware", true},
		{"NVreg-EnableGpuFirmware", true},
		{"nvreg_enablegpufirmware", false},
		{"debug", true},
		{"x_y", true},
		{"x-y", true},
		{"z", false},
	} {
		if got := ps.Has(tc.name); got != tc.has {
			t.Errorf("Has(%q) = %v", tc.name, got)
		}
	}
	if !ps.Is("NVreg_EnableGpuFirmware", "0") || ps.Is("NVreg_EnableGpuFirmware", "1") {
		t.Error("Is(NVreg_EnableGpuFirmware) wrong")
	}
	if ps.Is("debug", "") || ps.Is("missing", "") {
		t.Error("Is matched a flag or a missing parameter")
	}
	// Lookup returns the last one when a list (not built by this package)
	// holds a name twice, as the kernel applies the last one.
	dup := Params{{Name: "a", Value: "1"}, {Name: "a", Value: "2"}}
	if p, ok := dup.Lookup("a"); !ok || p.Value != "2" {
		t.Errorf("Lookup on duplicates = %+v, %v", p, ok)
	}
	if _, ok := Params(nil).Lookup("a"); ok {
		t.Error("Lookup on nil found something")
	}
}

func TestParamsStringAndModprobeConf(t *testing.T) {
	ps := Params{
		{Name: "NVreg_CoherentGPUMemoryMode", Value: "driver"},
		{Name: "NVreg_RegistryDwords", Value: "A=1; B=2"},
		{Name: "debug", Flag: true},
		{Name: "e"},
	}
	const want = `NVreg_CoherentGPUMemoryMode=driver NVreg_RegistryDwords="A=1; B=2" debug e=`
	if got := ps.String(); got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if got := string(ModprobeConf("nvidia", ps)); got != "options nvidia "+want+"\n" {
		t.Errorf("ModprobeConf = %q", got)
	}
	if got := ModprobeConf("nvidia", nil); got != nil {
		t.Errorf("ModprobeConf(no params) = %q, want nil", got)
	}
	if got := Params(nil).String(); got != "" {
		t.Errorf("empty String() = %q", got)
	}
	// What String renders parses back.
	back, err := ParseConf(strings.NewReader(ps.String()), "")
	if err != nil || !reflect.DeepEqual(back, ps) {
		t.Errorf("round trip = %#v, %v", back, err)
	}
}

func TestSet(t *testing.T) {
	var s Set
	if s.Modules() == nil || len(s.Modules()) != 0 || s.String() != "" || s.Params("nvidia") != nil {
		t.Fatal("zero Set is not empty")
	}
	mustAdd := func(module string, ps ...Param) {
		t.Helper()
		if err := s.Add(module, ps...); err != nil {
			t.Fatal(err)
		}
	}
	mustAdd("nvidia-uvm", Param{Name: "uvm_debug", Value: "1"})
	mustAdd("nvidia", Param{Name: "a", Value: "1"}, Param{Name: "b", Value: "2"})
	mustAdd("nvidia_uvm", Param{Name: "uvm-debug", Value: "2"}, Param{Name: "z", Flag: true})
	mustAdd("nvidia", Param{Name: "a", Value: "3"})
	mustAdd("nvidia-modeset") // nothing to add: no entry

	if got, want := s.Modules(), []string{"nvidia-uvm", "nvidia"}; !reflect.DeepEqual(got, want) {
		t.Errorf("Modules() = %q, want %q", got, want)
	}
	if got, want := s.Params("nvidia_uvm").String(), "uvm-debug=2 z"; got != want {
		t.Errorf("Params(nvidia_uvm) = %q, want %q", got, want)
	}
	if got, want := s.Params("nvidia").String(), "a=3 b=2"; got != want {
		t.Errorf("Params(nvidia) = %q, want %q", got, want)
	}
	if got, want := s.String(), "nvidia-uvm.uvm-debug=2 nvidia-uvm.z nvidia.a=3 nvidia.b=2"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	// Params returns a copy.
	p := s.Params("nvidia")
	p[0].Value = "changed"
	if s.Params("nvidia")[0].Value != "3" {
		t.Error("Params does not return a copy")
	}

	// Invalid input adds nothing.
	if err := s.Add("nvidia", Param{Name: "c", Value: "1"}, Param{Name: "bad name"}); !errors.Is(err, ErrInvalidName) {
		t.Errorf("Add(invalid name) = %v", err)
	}
	if err := s.Add("nvidia", Param{Name: "c", Value: "a\x00"}); !errors.Is(err, ErrControlChar) ||
		err.Error() != `module nvidia: parameter "c=a\x00": control character in value` {
		t.Errorf("Add(control char) = %v", err)
	}
	if err := s.Add("../etc/x", Param{Name: "c", Value: "1"}); !errors.Is(err, ErrInvalidModule) {
		t.Errorf("Add(bad module) = %v", err)
	}
	if s.Params("nvidia").Has("c") {
		t.Error("a failed Add changed the set")
	}

	// Merge: later source wins, new keys appended, new modules appended.
	var later Set
	if err := later.Add("nvidia", Param{Name: "b", Value: "9"}, Param{Name: "c", Value: "4"}); err != nil {
		t.Fatal(err)
	}
	if err := later.Add("nvidia-peermem", Param{Name: "peerdirect_support", Value: "1"}); err != nil {
		t.Fatal(err)
	}
	s.Merge(&later)
	s.Merge(nil)
	if got, want := s.String(), "nvidia-uvm.uvm-debug=2 nvidia-uvm.z nvidia.a=3 nvidia.b=9 nvidia.c=4 nvidia-peermem.peerdirect_support=1"; got != want {
		t.Errorf("after Merge: %q, want %q", got, want)
	}
	var nilSet *Set
	if nilSet.Params("x") != nil || nilSet.Modules() != nil || nilSet.String() != "" {
		t.Error("nil Set is not empty")
	}
}

func TestDefaults(t *testing.T) {
	for _, tc := range []struct {
		branch int
		want   string
	}{
		{0, ""},
		{535, ""},
		{579, ""},
		{580, "nvidia.NVreg_CoherentGPUMemoryMode=driver"},
		{590, "nvidia.NVreg_CoherentGPUMemoryMode=driver"},
	} {
		if got := Defaults(tc.branch).String(); got != tc.want {
			t.Errorf("Defaults(%d) = %q, want %q", tc.branch, got, tc.want)
		}
	}

	// Not set by the user: added first.
	var s Set
	if err := s.Add("nvidia", Param{Name: "NVreg_EnableGpuFirmware", Value: "0"}); err != nil {
		t.Fatal(err)
	}
	s.AddDefaults(Defaults(580))
	if got, want := s.Params("nvidia").String(), "NVreg_CoherentGPUMemoryMode=driver NVreg_EnableGpuFirmware=0"; got != want {
		t.Errorf("AddDefaults = %q, want %q", got, want)
	}
	// Applying twice changes nothing.
	s.AddDefaults(Defaults(580))
	if got := len(s.Params("nvidia")); got != 2 {
		t.Errorf("AddDefaults twice: %d params", got)
	}

	// Set by the user, in the other spelling: the user's value stays.
	var u Set
	if err := u.Add("nvidia", Param{Name: "NVreg-CoherentGPUMemoryMode", Value: "disabled"}); err != nil {
		t.Fatal(err)
	}
	u.AddDefaults(Defaults(590))
	if got, want := u.String(), "nvidia.NVreg-CoherentGPUMemoryMode=disabled"; got != want {
		t.Errorf("AddDefaults over a user value = %q, want %q", got, want)
	}

	// No nvidia entry yet: one is created.
	var e Set
	e.AddDefaults(Defaults(580))
	e.AddDefaults(nil)
	if got, want := e.String(), "nvidia.NVreg_CoherentGPUMemoryMode=driver"; got != want {
		t.Errorf("AddDefaults on empty = %q, want %q", got, want)
	}
	// The defaults are copied, not shared.
	d := Defaults(580)
	e.AddDefaults(d)
	var again Set
	again.AddDefaults(d)
	_ = again.Add("nvidia", Param{Name: "NVreg_CoherentGPUMemoryMode", Value: "x"})
	if d.String() != "nvidia.NVreg_CoherentGPUMemoryMode=driver" {
		t.Errorf("Defaults changed through a Set: %q", d.String())
	}
}

func TestFlag(t *testing.T) {
	fs := flag.NewFlagSet("driver-agent", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var f Flag
	fs.Var(&f, "module-param", "module.name=value")
	err := fs.Parse([]string{
		"--module-param", "nvidia.NVreg_EnableGpuFirmware=0",
		"--module-param=nvidia-uvm.uvm_perf_prefetch_enable=1",
		"--module-param", `nvidia.NVreg_RegistryDwords="A=1; B=2"`,
		"--module-param", "nvidia.debug",
		"--module-param", "nvidia.NVreg_EnableGpuFirmware=1",
		"--module-param", "nvidia_uvm.opt.with.dots=x",
	})
	if err != nil {
		t.Fatal(err)
	}
	want := `nvidia.NVreg_EnableGpuFirmware=1 nvidia.NVreg_RegistryDwords="A=1; B=2" nvidia.debug nvidia-uvm.uvm_perf_prefetch_enable=1 nvidia-uvm.opt.with.dots=x`
	if got := f.String(); got != want {
		t.Errorf("String() = %q\nwant %q", got, want)
	}
	if got := f.Params.Params("nvidia").String(); got != `NVreg_EnableGpuFirmware=1 NVreg_RegistryDwords="A=1; B=2" debug` {
		t.Errorf("nvidia params = %q", got)
	}
	var nilFlag *Flag
	if nilFlag.String() != "" {
		t.Error("nil Flag String() not empty")
	}
}

func TestFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		in      string
		wantErr error
		want    string
	}{
		{"nvidia", nil, `module parameter "nvidia": want module.name=value`},
		{".x=1", nil, `module parameter ".x=1": want module.name=value`},
		{"nvidia.", nil, `module parameter "nvidia.": want module.name=value`},
		{"nv/idia.x=1", ErrInvalidModule, `module parameter "nv/idia.x=1": invalid module name "nv/idia"`},
		{"nvidia.x=a\x01", ErrControlChar, `module parameter "nvidia.x=a\x01": control character in value`},
		{"nvidia.-x=1", ErrInvalidName, `module parameter "nvidia.-x=1": invalid parameter name "-x" (want letters, digits, '_', '.' and '-', not starting with '.' or '-')`},
		{"nvidia.x=a b", nil, `module parameter "nvidia.x=a b": space in unquoted value (quote the value: x="...")`},
		{`nvidia.x="a`, ErrQuote, `module parameter "nvidia.x=\"a": misplaced double quote: value starts with '"' but does not end with one`},
	} {
		var f Flag
		err := f.Set(tc.in)
		if err == nil {
			t.Errorf("Set(%q) succeeded", tc.in)
			continue
		}
		if err.Error() != tc.want {
			t.Errorf("Set(%q):\n got %s\nwant %s", tc.in, err, tc.want)
		}
		if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
			t.Errorf("Set(%q): error %q is not %v", tc.in, err, tc.wantErr)
		}
		if len(f.Params.Modules()) != 0 {
			t.Errorf("Set(%q) failed but added %v", tc.in, f.Params.String())
		}
	}
}

func TestSameName(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want bool
	}{
		{"nvidia-uvm", "nvidia_uvm", true},
		{"nvidia_uvm", "nvidia_uvm", true},
		{"a-b_c", "a_b-c", true},
		{"nvidia", "nvidia-uvm", false},
		{"Nvidia", "nvidia", false},
	} {
		if got := SameName(tc.a, tc.b); got != tc.want {
			t.Errorf("SameName(%q, %q) = %v", tc.a, tc.b, got)
		}
	}
}

func TestLoadDir(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("nvidia.conf", "# operator config\nNVreg_EnableGpuFirmware=0 NVreg_OpenRmEnableUnsupportedGpus=1\n")
	write("nvidia-uvm.conf", "uvm_perf_prefetch_enable=0")
	write("nvidia-modeset.conf", "\n# nothing\n")
	modules := []string{"nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-peermem"}

	s, err := LoadDir(dir, modules)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := s.Modules(), []string{"nvidia", "nvidia-uvm"}; !reflect.DeepEqual(got, want) {
		t.Errorf("Modules() = %q, want %q", got, want)
	}
	if !s.Params("nvidia").Is("NVreg_EnableGpuFirmware", "0") {
		t.Error("NVreg_EnableGpuFirmware=0 not found on a shared line")
	}
	if got, want := s.String(), "nvidia.NVreg_EnableGpuFirmware=0 nvidia.NVreg_OpenRmEnableUnsupportedGpus=1 nvidia-uvm.uvm_perf_prefetch_enable=0"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}

	// A missing directory is no parameters at all.
	s, err = LoadDir(filepath.Join(dir, "missing"), modules)
	if err != nil || len(s.Modules()) != 0 {
		t.Errorf("LoadDir(missing dir) = %v, %v", s, err)
	}
}

func TestLoadDirErrors(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "nvidia.conf"), []byte("ok=1\nbad=\x1b[31m\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "nvidia-uvm.conf"), 0o755); err != nil {
		t.Fatal(err)
	}
	s, err := LoadDir(dir, []string{"nvidia", "nvidia-uvm", "../x", ""})
	if s != nil {
		t.Errorf("LoadDir returned a set with an error: %v", s)
	}
	if err == nil {
		t.Fatal("LoadDir succeeded")
	}
	for _, want := range []string{
		filepath.Join(dir, "nvidia.conf") + `:2: parameter "bad=\x1b[31m": control character in value`,
		filepath.Join(dir, "nvidia-uvm.conf") + ": not a regular file",
		`module "../x": invalid module name`,
		`module "": invalid module name`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
	if !errors.Is(err, ErrControlChar) || !errors.Is(err, ErrInvalidModule) {
		t.Errorf("error %q does not wrap the causes", err)
	}

	// An unreadable file is an error (skipped as root, who can read it).
	if os.Geteuid() != 0 {
		locked := t.TempDir()
		p := filepath.Join(locked, "nvidia.conf")
		if err := os.WriteFile(p, []byte("a=1"), 0o000); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadDir(locked, []string{"nvidia"}); !errors.Is(err, os.ErrPermission) {
			t.Errorf("unreadable file: %v", err)
		}
	}
}
