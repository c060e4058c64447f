package modfile

import (
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestParseModinfo(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want ModInfo
	}{
		{"empty", "", ModInfo{}},
		{"only padding", "\x00\x00\x00", ModInfo{}},
		{
			"basic",
			"name=nvidia\x00version=580.65.06\x00license=NVIDIA\x00",
			ModInfo{
				Name: "nvidia", Version: "580.65.06", License: "NVIDIA",
				Fields: []Field{{"name", "nvidia"}, {"version", "580.65.06"}, {"license", "NVIDIA"}},
			},
		},
		{
			"no trailing NUL and padding between entries",
			"\x00\x00vermagic=6.8.0 SMP mod_unload \x00\x00\x00\x00srcversion=ABC",
			ModInfo{
				Vermagic: "6.8.0 SMP mod_unload ", SrcVersion: "ABC",
				Fields: []Field{{"vermagic", "6.8.0 SMP mod_unload "}, {"srcversion", "ABC"}},
			},
		},
		{
			"empty depends is nil",
			"depends=\x00",
			ModInfo{Fields: []Field{{"depends", ""}}},
		},
		{
			"depends list",
			"depends=nvidia,drm_kms_helper, drm ,,\x00",
			ModInfo{
				Depends: []string{"nvidia", "drm_kms_helper", "drm"},
				Fields:  []Field{{"depends", "nvidia,drm_kms_helper, drm ,,"}},
			},
		},
		{
			"first single value wins",
			"name=a\x00name=b\x00depends=x\x00depends=y\x00",
			ModInfo{
				Name: "a", Depends: []string{"x"},
				Fields: []Field{{"name", "a"}, {"name", "b"}, {"depends", "x"}, {"depends", "y"}},
			},
		},
		{
			"value with equals signs and colons",
			"description=a=b:c\x00",
			ModInfo{Description: "a=b:c", Fields: []Field{{"description", "a=b:c"}}},
		},
		{
			"entries without = or key are skipped",
			"garbage\x00=value\x00license=GPL\x00",
			ModInfo{License: "GPL", Fields: []Field{{"license", "GPL"}}},
		},
		{
			"params",
			"parmtype=NVreg_X:uint\x00parm=NVreg_X:the X: with colon\x00parm=onlydesc:d\x00parmtype=arr:array of int\x00parm=nodesc\x00parmtype=:int\x00",
			ModInfo{
				Params: map[string]ParamInfo{
					"NVreg_X":  {Name: "NVreg_X", Type: "uint", Description: "the X: with colon"},
					"onlydesc": {Name: "onlydesc", Description: "d"},
					"arr":      {Name: "arr", Type: "array of int"},
					"nodesc":   {Name: "nodesc"},
				},
				Fields: []Field{
					{"parmtype", "NVreg_X:uint"}, {"parm", "NVreg_X:the X: with colon"},
					{"parm", "onlydesc:d"}, {"parmtype", "arr:array of int"},
					{"parm", "nodesc"}, {"parmtype", ":int"},
				},
			},
		},
		{
			"repeated parm keeps last",
			"parm=p:one\x00parm=p:two\x00",
			ModInfo{
				Params: map[string]ParamInfo{"p": {Name: "p", Description: "two"}},
				Fields: []Field{{"parm", "p:one"}, {"parm", "p:two"}},
			},
		},
		{
			"firmware list",
			"firmware=a.bin\x00firmware=b.bin\x00",
			ModInfo{Firmware: []string{"a.bin", "b.bin"}, Fields: []Field{{"firmware", "a.bin"}, {"firmware", "b.bin"}}},
		},
		{
			"non-UTF-8 kept as is",
			"author=\xff\xfe\x00",
			ModInfo{Fields: []Field{{"author", "\xff\xfe"}}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ParseModinfo([]byte(tc.in))
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("ParseModinfo(%q):\n got %#v\nwant %#v", tc.in, got, tc.want)
			}
		})
	}
}

func TestInfoErrors(t *testing.T) {
	raw := buildFakeModule(t)
	noModinfo := stripSection(t, raw, ".modinfo")
	for _, tc := range []struct {
		name    string
		data    []byte
		wantErr error
		wantMsg string
	}{
		{"nil", nil, ErrNotELF, "not an ELF file"},
		{"text", []byte("#!/bin/sh\n"), ErrNotELF, ""},
		{"magic only", []byte("\x7fELF"), ErrMalformed, "truncated identification"},
		{"truncated header", raw[:40], ErrMalformed, "truncated header"},
		{"truncated sections", raw[:len(raw)/2], ErrMalformed, "outside the file"},
		{"unknown class", patch(raw, 4, 3), ErrMalformed, "unknown class 3"},
		{"unknown encoding", patch(raw, 5, 0), ErrMalformed, "unknown data encoding 0"},
		{"bad version", patch(raw, 6, 2), ErrMalformed, "unknown ELF version"},
		{"no section headers", patch(raw, 60, 0, 0), ErrMalformed, "no section headers"},
		{"huge section count", patch(raw, 60, 0xff, 0xff), ErrMalformed, ""},
		{"bad section header size", patch(raw, 58, 0x30, 0), ErrMalformed, "section header size 48"},
		{"bad name table index", patch(raw, 62, 0xfe, 0xff), ErrMalformed, "section name table index 65534"},
		{"section headers past end", patch(raw, 40, 0xff, 0xff, 0xff, 0), ErrMalformed, "section headers outside the file"},
		{"program headers past end", patch(patch(raw, 32, 0xff, 0xff, 0xff), 56, 1, 0), ErrMalformed, "program headers outside the file"},
		{"section data past end", patchSectionSize(t, raw, 1, 1<<40), ErrMalformed, "section 1 outside the file"},
		{"no .modinfo", noModinfo, ErrNoModinfo, "not a kernel module"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Info(tc.data)
			if err == nil {
				t.Fatal("Info succeeded")
			}
			if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Errorf("error %q is not %v", err, tc.wantErr)
			}
			if !strings.Contains(err.Error(), tc.wantMsg) {
				t.Errorf("error %q does not contain %q", err, tc.wantMsg)
			}
		})
	}
	if _, err := ReadSymbols([]byte("nope")); !errors.Is(err, ErrNotELF) {
		t.Errorf("ReadSymbols(text): %v", err)
	}
	s, err := ReadSymbols(noModinfo)
	if err != nil || len(s.Exports) != 2 {
		t.Errorf("ReadSymbols(no .modinfo) = %+v, %v", s, err)
	}
}

// patch returns a copy of data with the bytes at off replaced by b.
func patch(data []byte, off int, b ...byte) []byte {
	out := append([]byte(nil), data...)
	copy(out[off:], b)
	return out
}

// patchSectionSize returns a copy of a 64-bit little-endian ELF object with
// the size of section i set to size.
func patchSectionSize(t testing.TB, data []byte, i int, size uint64) []byte {
	t.Helper()
	if data[4] != 2 || data[5] != 1 {
		t.Skip("not a 64-bit little-endian object")
	}
	shoff := binary.LittleEndian.Uint64(data[40:])
	out := append([]byte(nil), data...)
	binary.LittleEndian.PutUint64(out[shoff+uint64(i)*64+32:], size)
	return out
}

// stripSection returns data without the named section, removed with
// objcopy; the test is skipped when objcopy is missing.
func stripSection(t testing.TB, data []byte, section string) []byte {
	t.Helper()
	objcopy, err := exec.LookPath("objcopy")
	if err != nil {
		t.Fatal("objcopy not installed: run make deps (apt-get install binutils)")
	}
	dir := t.TempDir()
	in, out := filepath.Join(dir, "in.o"), filepath.Join(dir, "out.o")
	if err := os.WriteFile(in, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if msg, err := exec.Command(objcopy, "--remove-section", section, in, out).CombinedOutput(); err != nil {
		t.Fatalf("objcopy: %v\n%s", err, msg)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
