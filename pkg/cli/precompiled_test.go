package cli_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/cli"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
)

// vectorDir holds the packages made by NVIDIA's mkprecompiled, with what the
// tool printed (a copy of shared/testdata/precompiled).
const vectorDir = "../../testdata/precompiled"

// vector is one directory of vectorDir; exp is its expected.json.
type vector struct {
	name, dir string
	bin       []byte
	exp       map[string]any
}

type toolResult struct {
	Stdout   string `json:"stdout"`
	ExitCode int    `json:"exit_code"`
}

// vectorRecord is the part of expected.json the tests read as typed values.
type vectorRecord struct {
	InfoStdout string                `json:"info_stdout"`
	Match      map[string]toolResult `json:"match"`
	MatchProc1 *toolResult           `json:"match_proc1"`
	Steps      []struct {
		Argv     []string `json:"argv"`
		ExitCode int      `json:"exit_code"`
	} `json:"steps"`
	StepOneSHA string `json:"package_before_last_step_sha256"`
	Unpack     []struct {
		Path   string `json:"path"`
		SHA256 string `json:"sha256"`
		Size   int64  `json:"size"`
		Mode   string `json:"mode"`
	} `json:"unpack"`
	ErrorExpected bool `json:"error_expected"`
}

type inputs struct {
	Proc1 string `json:"proc1_version_file"`
	Proc2 string `json:"proc2_version_file"`
	Files []struct {
		Path   string `json:"path"`
		Size   int    `json:"size"`
		SHA256 string `json:"sha256"`
		CRCHex string `json:"crc_hex"`
	} `json:"inputs"`
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

func loadVectors(t *testing.T) []vector {
	t.Helper()
	des, err := os.ReadDir(vectorDir)
	if err != nil {
		t.Fatalf("test vectors missing: %v", err)
	}
	var vs []vector
	for _, de := range des {
		if !de.IsDir() {
			continue
		}
		v := vector{name: de.Name(), dir: filepath.Join(vectorDir, de.Name())}
		readJSON(t, filepath.Join(v.dir, "expected.json"), &v.exp)
		if v.bin, err = os.ReadFile(filepath.Join(v.dir, "package.bin")); err != nil {
			t.Fatal(err)
		}
		vs = append(vs, v)
	}
	if len(vs) < 8 {
		t.Fatalf("%d vectors in %s, want at least 8", len(vs), vectorDir)
	}
	return vs
}

func (v vector) record(t *testing.T) vectorRecord {
	t.Helper()
	var r vectorRecord
	readJSON(t, filepath.Join(v.dir, "expected.json"), &r)
	return r
}

func (v vector) corrupt() bool { return strings.HasPrefix(v.name, "corrupt-") }

// run runs `driver-agent precompiled args...` through cli.Main.
func run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	argv := append([]string{"driver-agent", "precompiled"}, args...)
	code = cli.Main(context.Background(), argv, nil, &out, &errOut)
	return code, out.String(), errOut.String()
}

func sum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// procDirs writes proc1/version and proc2/version from inputs.json.
func procDirs(t *testing.T, dir string) map[string]string {
	t.Helper()
	var in inputs
	readJSON(t, filepath.Join(vectorDir, "inputs.json"), &in)
	dirs := map[string]string{}
	for name, content := range map[string]string{"proc1": in.Proc1, "proc2": in.Proc2} {
		d := filepath.Join(dir, name)
		writeFile(t, filepath.Join(d, "version"), []byte(content))
		dirs[name] = d
	}
	return dirs
}

func writeFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestPrecompiledInfo(t *testing.T) {
	t.Parallel()
	for _, v := range loadVectors(t) {
		if v.corrupt() {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			pkg := filepath.Join(v.dir, "package.bin")
			code, out, errOut := run(t, "info", pkg)
			if code != 0 || errOut != "" {
				t.Fatalf("info: exit %d, stderr %q", code, errOut)
			}
			if want := v.record(t).InfoStdout; out != want {
				t.Errorf("info text:\n%s\nwant (mkprecompiled --info):\n%s", out, want)
			}

			code, out, errOut = run(t, "info", "--json", pkg)
			if code != 0 || errOut != "" {
				t.Fatalf("info --json: exit %d, stderr %q", code, errOut)
			}
			var got map[string]any
			if err := json.Unmarshal([]byte(out), &got); err != nil {
				t.Fatalf("info --json output is not JSON: %v\n%s", err, out)
			}
			compareInfo(t, got, v.exp)
			if code, out2, _ := run(t, "info", pkg, "--json"); code != 0 || out2 != out {
				t.Error("info PKG --json differs from info --json PKG")
			}
		})
	}
}

// compareInfo checks every field of info --json against expected.json: each
// header field it writes, and each file field expected.json records (except
// input_file, the name of the tool's input).
func compareInfo(t *testing.T, got, exp map[string]any) {
	t.Helper()
	for k, g := range got {
		if k == "files" {
			continue
		}
		w, ok := exp[k]
		if !ok {
			t.Errorf("field %q is not in expected.json", k)
		} else if !reflect.DeepEqual(g, w) {
			t.Errorf("%s = %v, want %v", k, g, w)
		}
	}
	for _, k := range []string{"format_version", "driver_version", "description", "proc_version", "num_files",
		"package_size", "package_sha256"} {
		if _, ok := got[k]; !ok {
			t.Errorf("info --json lacks %q", k)
		}
	}
	gotFiles, _ := got["files"].([]any)
	wantFiles, _ := exp["files"].([]any)
	if len(gotFiles) != len(wantFiles) || len(wantFiles) == 0 {
		t.Fatalf("%d files, expected.json has %d", len(gotFiles), len(wantFiles))
	}
	for i := range wantFiles {
		g, w := gotFiles[i].(map[string]any), wantFiles[i].(map[string]any)
		for k, wv := range w {
			if k == "input_file" {
				continue
			}
			if gv, ok := g[k]; !ok {
				t.Errorf("file %d lacks %q", i, k)
			} else if !reflect.DeepEqual(gv, wv) {
				t.Errorf("file %d: %s = %v, want %v", i, k, gv, wv)
			}
		}
		for k := range g {
			if _, ok := w[k]; !ok {
				t.Errorf("file %d: field %q is not in expected.json", i, k)
			}
		}
	}
}

func TestPrecompiledMatch(t *testing.T) {
	t.Parallel()
	procs := procDirs(t, t.TempDir())
	for _, v := range loadVectors(t) {
		if v.corrupt() {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			pkg := filepath.Join(v.dir, "package.bin")
			rec := v.record(t)
			if len(rec.Match) != 2 {
				t.Fatalf("expected.json has %d match records, want 2", len(rec.Match))
			}
			for proc, tool := range rec.Match {
				// mkprecompiled exits 1 on a match, 0 otherwise; we exit 0 and 1.
				matches := tool.Stdout == "kernel interface matches.\n"
				if matches != (tool.ExitCode == 1) {
					t.Fatalf("%s: unexpected tool result %+v", proc, tool)
				}
				wantCode := 1
				if matches {
					wantCode = 0
				}
				for _, args := range [][]string{
					{"match", pkg, "--proc", procs[proc]},
					{"match", "--proc", procs[proc], pkg},
					{"match", "--proc-mount-point=" + procs[proc], pkg},
				} {
					code, out, errOut := run(t, args...)
					if code != wantCode || out != tool.Stdout || errOut != "" {
						t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit %d, stdout %q",
							args, code, out, errOut, wantCode, tool.Stdout)
					}
				}
				code, out, _ := run(t, "match", pkg, "--proc", procs[proc], "-v")
				if code != wantCode || !strings.HasPrefix(out, tool.Stdout) {
					t.Errorf("match -v: exit %d, stdout %q", code, out)
				}
				if !matches {
					// The two banners differ in release first.
					for _, s := range []string{"proc version mismatch: release differs", "6.12.81-flatcar", "6.1.0-41-amd64", "* release"} {
						if !strings.Contains(out, s) {
							t.Errorf("match -v output lacks %q:\n%s", s, out)
						}
					}
				} else if out != tool.Stdout {
					t.Errorf("match -v on a match printed more: %q", out)
				}
			}
		})
	}
}

func TestPrecompiledUnpack(t *testing.T) {
	t.Parallel()
	for _, v := range loadVectors(t) {
		if v.corrupt() {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			out := filepath.Join(t.TempDir(), "unpacked")
			code, stdout, stderr := run(t, "unpack", filepath.Join(v.dir, "package.bin"), "-o", out)
			if code != 0 || stdout != "" || stderr != "" {
				t.Fatalf("unpack: exit %d, stdout %q, stderr %q", code, stdout, stderr)
			}
			type file struct {
				Path, SHA256, Mode string
				Size               int64
			}
			var got []file
			err := filepath.WalkDir(out, func(path string, d fs.DirEntry, err error) error {
				if err != nil || d.IsDir() {
					return err
				}
				b, err := os.ReadFile(path)
				if err != nil {
					return err
				}
				st, err := d.Info()
				if err != nil {
					return err
				}
				rel, _ := filepath.Rel(out, path)
				got = append(got, file{filepath.ToSlash(rel), sum(b), fmt.Sprintf("%04o", st.Mode().Perm()), st.Size()})
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			var want []file
			for _, u := range v.record(t).Unpack {
				want = append(want, file{u.Path, u.SHA256, u.Mode, u.Size})
			}
			slices.SortFunc(want, func(a, b file) int { return strings.Compare(a.Path, b.Path) })
			if len(want) == 0 || !reflect.DeepEqual(got, want) {
				t.Errorf("unpacked:\n%+v\nwant:\n%+v", got, want)
			}
		})
	}
}

// crcPoly is CRC-32/MPEG-2's polynomial.
const crcPoly = 0x04C11DB7

// withCRC returns data with its last four bytes replaced so that its
// precompiled.Checksum is want. That CRC has no final XOR, so the register
// after the prefix can be steered to any value by the last 32 bits: run the
// 32 shift steps backwards from want to find the register value those bits
// must produce.
func withCRC(data []byte, want uint32) []byte {
	reg := want
	for range 32 {
		if reg&1 != 0 { // the step that produced it shifted out a 1 and XORed the polynomial
			reg = (reg^crcPoly)>>1 | 1<<31
		} else {
			reg >>= 1
		}
	}
	out := slices.Clone(data)
	prefix := out[:len(out)-4]
	binary.BigEndian.PutUint32(out[len(out)-4:], reg^precompiled.Checksum(prefix))
	return out
}

// materialize writes the pack inputs a vector's commands name into dir,
// taking member bytes from the vectors' packages (found by sha256 from
// inputs.json). --linked-module is not recoverable from a package, which keeps
// only its size-independent CRC; a stand-in of the recorded size and CRC
// is made instead, and --signed-module is that stand-in followed by the
// signature the package stores.
func materialize(t *testing.T, dir string, vs []vector, argv []string) {
	t.Helper()
	var in inputs
	readJSON(t, filepath.Join(vectorDir, "inputs.json"), &in)
	byHash := map[string][]byte{}
	var signature []byte
	for _, v := range vs {
		if v.corrupt() {
			continue
		}
		p, err := precompiled.Parse(v.bin)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range p.Files {
			byHash[sum(f.Data)] = f.Data
			if len(f.Signature) > 0 {
				signature = f.Signature
			}
		}
	}
	byPath := map[string]int{}
	for i, f := range in.Files {
		byPath[f.Path] = i
	}
	input := func(path string) (int, []byte) {
		i, ok := byPath[path]
		if !ok {
			t.Fatalf("%s is not in inputs.json", path)
		}
		return in.Files[i].Size, byHash[in.Files[i].SHA256]
	}
	var linked []byte
	for i := 0; i < len(argv)-1; i++ {
		path := argv[i+1]
		switch argv[i] {
		case "--kernel-interface", "--kernel-module":
			size, data := input(path)
			if data == nil && size != 0 {
				t.Fatalf("input %s is in no vector's package", path)
			}
			writeFile(t, filepath.Join(dir, path), data)
		case "--linked-module":
			size, _ := input(path)
			crc, err := strconv.ParseUint(in.Files[byPath[path]].CRCHex, 16, 32)
			if err != nil {
				t.Fatal(err)
			}
			linked = withCRC(bytes.Repeat([]byte{0x5a}, size), uint32(crc))
			writeFile(t, filepath.Join(dir, path), linked)
		case "--signed-module":
			if linked == nil || signature == nil {
				t.Fatal("--signed-module needs a --linked-module before it and a stored signature")
			}
			writeFile(t, filepath.Join(dir, path), append(slices.Clone(linked), signature...))
		}
	}
}

// TestPrecompiledPack replays every vector's mkprecompiled --pack commands
// as `driver-agent precompiled pack` and compares the result with the tool's
// package byte for byte.
func TestPrecompiledPack(t *testing.T) {
	t.Parallel()
	vs := loadVectors(t)
	for _, v := range vs {
		if v.corrupt() {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			procDirs(t, dir)
			rec := v.record(t)
			if len(rec.Steps) == 0 {
				t.Fatal("no recorded steps")
			}
			var pkg string
			for i, step := range rec.Steps {
				argv := step.Argv
				if len(argv) < 3 || argv[0] != "mkprecompiled" || argv[1] != "--pack" || step.ExitCode != 0 {
					t.Fatalf("step %d is not a successful mkprecompiled --pack: %q", i, argv)
				}
				materialize(t, dir, vs, argv)
				// The tool ran in dir; give every file argument as a path in dir.
				args := []string{"pack", filepath.Join(dir, argv[2])}
				for j := 3; j < len(argv); j++ {
					args = append(args, argv[j])
					switch argv[j] {
					case "--kernel-interface", "--kernel-module", "--linked-module", "--signed-module", "--proc-mount-point":
						j++
						args = append(args, filepath.Join(dir, argv[j]))
					}
				}
				code, stdout, stderr := run(t, args...)
				if code != 0 || stdout != "" || stderr != "" {
					t.Fatalf("step %d: exit %d, stdout %q, stderr %q", i, code, stdout, stderr)
				}
				pkg = args[1]
				if i == len(rec.Steps)-2 && rec.StepOneSHA != "" {
					b, _ := os.ReadFile(pkg)
					if sum(b) != rec.StepOneSHA {
						t.Errorf("after step %d: sha256 %s, want %s", i, sum(b), rec.StepOneSHA)
					}
				}
			}
			got, err := os.ReadFile(pkg)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, v.bin) {
				n := 0
				for n < min(len(got), len(v.bin)) && got[n] == v.bin[n] {
					n++
				}
				t.Fatalf("packed %d bytes, package.bin has %d; first difference at byte %d", len(got), len(v.bin), n)
			}
			if st, err := os.Stat(pkg); err != nil || st.Mode().Perm() != 0o644 {
				t.Errorf("package mode %v, %v", st.Mode(), err)
			}
		})
	}
}

// TestPrecompiledCorrupt runs info, match and unpack on the corrupt vectors:
// each exits 2 with one line on stderr naming the file and the reason.
func TestPrecompiledCorrupt(t *testing.T) {
	t.Parallel()
	procs := procDirs(t, t.TempDir())
	reasons := map[string]string{
		"corrupt-bad-magic":         "magic",
		"corrupt-crc-copies-differ": "second crc copy",
		"corrupt-truncated-20":      "28-byte fixed header",
	}
	seen := 0
	for _, v := range loadVectors(t) {
		if !v.corrupt() {
			continue
		}
		seen++
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			rec := v.record(t)
			if !rec.ErrorExpected || rec.MatchProc1 == nil {
				t.Fatal("expected.json does not record a rejected corrupt package")
			}
			reason, ok := reasons[v.name]
			if !ok {
				t.Fatalf("no expected reason for the new vector %s", v.name)
			}
			pkg := filepath.Join(v.dir, "package.bin")
			for _, args := range [][]string{
				{"info", pkg},
				{"info", "--json", pkg},
				{"match", pkg, "--proc", procs["proc1"]},
				{"match", pkg, "--proc", procs["proc2"], "-v"},
				{"unpack", pkg, "-o", filepath.Join(t.TempDir(), "out")},
				{"pack", pkg, "--kernel-module", pkg},
			} {
				code, stdout, stderr := run(t, args...)
				if code != 2 || stdout != "" {
					t.Errorf("%v: exit %d, stdout %q; want exit 2 and no output", args, code, stdout)
				}
				if !strings.Contains(stderr, pkg+": corrupt precompiled package") || !strings.Contains(stderr, reason) ||
					strings.Count(stderr, "\n") != 1 || strings.Count(stderr, pkg) != 1 {
					t.Errorf("%v: stderr %q; want one line naming %s and %q", args, stderr, pkg, reason)
				}
			}
			if b, _ := os.ReadFile(pkg); !bytes.Equal(b, v.bin) {
				t.Fatal("pack modified a corrupt package")
			}
		})
	}
	if seen != len(reasons) {
		t.Errorf("saw %d corrupt vectors, want %d", seen, len(reasons))
	}
}

func TestPrecompiledErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	procs := procDirs(t, dir)
	good := filepath.Join(vectorDir, "flatcar-canonical", "package.bin")
	mod := filepath.Join(dir, "nvidia-uvm.ko")
	writeFile(t, mod, []byte("module"))
	missing := filepath.Join(dir, "missing.bin")
	tests := []struct {
		name   string
		args   []string
		code   int
		stderr string
	}{
		{"no command", nil, 2, "Usage:"},
		{"unknown command", []string{"frob"}, 2, `unknown command "frob"`},
		{"info without package", []string{"info"}, 2, "no package file given"},
		{"info with two packages", []string{"info", good, good}, 2, "one package file expected"},
		{"unknown flag", []string{"info", "--xml", good}, 2, "flag provided but not defined: -xml"},
		{"missing package", []string{"info", missing}, 2, missing + ": no such file or directory"},
		{"directory as package", []string{"match", dir, "--proc", procs["proc1"]}, 2, dir + ":"},
		{"unreadable proc", []string{"match", good, "--proc", filepath.Join(dir, "noproc")}, 2, "proc version"},
		{"unpack without -o", []string{"unpack", good}, 2, "-o DIR"},
		{"pack without members", []string{"pack", filepath.Join(dir, "p1"), "-v", "1"}, 2, "nothing to pack"},
		{"pack without driver version", []string{"pack", filepath.Join(dir, "p2"), "--kernel-module", mod}, 2, "--driver-version"},
		{"pack member option first", []string{"pack", filepath.Join(dir, "p3"), "--target-directory", ".", "--kernel-module", mod}, 2, "must follow"},
		{"pack interface option on a module", []string{"pack", filepath.Join(dir, "p4"), "-v", "1", "--kernel-module", mod, "--linked-module-name", "x.ko"}, 2, "must follow a --kernel-interface"},
		{"pack --signed on an interface", []string{"pack", filepath.Join(dir, "p5"), "-v", "1", "--kernel-interface", mod, "--signed"}, 2, "--signed must follow a --kernel-module"},
		{"pack interface without names", []string{"pack", filepath.Join(dir, "p6"), "-v", "1", "--kernel-interface", mod}, 2, "--linked-module-name and --core-object-name"},
		{"pack half a signature", []string{"pack", filepath.Join(dir, "p7"), "-v", "1", "--kernel-interface", mod, "--linked-module-name", "a.ko", "--core-object-name", "c.o", "--linked-module", mod}, 2, "together"},
		{"pack option twice", []string{"pack", filepath.Join(dir, "p8"), "-v", "1", "--kernel-module", mod, "--target-directory", ".", "--target-directory", "x"}, 2, "given twice"},
		{"pack two proc sources", []string{"pack", filepath.Join(dir, "p9"), "-v", "1", "-P", "x", "--proc-mount-point", dir, "--kernel-module", mod}, 2, "not both"},
		{"pack unknown option", []string{"pack", filepath.Join(dir, "p10"), "--frob", "x"}, 2, "unknown option --frob"},
		{"pack option without value", []string{"pack", filepath.Join(dir, "p11"), "--kernel-module"}, 2, "needs a value"},
		{"pack missing input", []string{"pack", filepath.Join(dir, "p12"), "-v", "1", "-P", "x", "--kernel-module", missing}, 1, "missing.bin"},
		{"pack unsafe target directory", []string{"pack", filepath.Join(dir, "p13"), "-v", "1", "-P", "x", "--kernel-module", mod, "--target-directory", "../up"}, 1, "unsafe path"},
		{"pack without proc", []string{"pack", filepath.Join(dir, "p14"), "-v", "1", "--proc-mount-point", filepath.Join(dir, "noproc"), "--kernel-module", mod}, 1, "proc version"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, stdout, stderr := run(t, tc.args...)
			if code != tc.code || !strings.Contains(stderr, tc.stderr) {
				t.Errorf("exit %d, stderr %q; want exit %d and %q", code, stderr, tc.code, tc.stderr)
			}
			if stdout != "" {
				t.Errorf("stdout %q", stdout)
			}
		})
	}
	for _, args := range [][]string{{"help"}, {"info", "-h"}, {"pack", "--help"}} {
		if code, stdout, _ := run(t, args...); code != 0 || !strings.Contains(stdout, "precompiled <command>") {
			t.Errorf("%v: exit %d, stdout %q", args, code, stdout)
		}
	}
	var out bytes.Buffer
	if cli.Main(context.Background(), []string{"driver-agent", "help"}, nil, &out, &out); !strings.Contains(out.String(), "precompiled") {
		t.Error("the command list does not mention precompiled")
	}
}

// TestPrecompiledPackRoundTrip packs with every option form, appends, and
// reads the result back through info --json, match and unpack.
func TestPrecompiledPackRoundTrip(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	procs := procDirs(t, dir)
	iface := filepath.Join(dir, "nv-linux.o")
	writeFile(t, iface, []byte("interface object"))
	linked := filepath.Join(dir, "linked.ko")
	writeFile(t, linked, []byte("linked module"))
	signed := filepath.Join(dir, "signed.ko")
	writeFile(t, signed, []byte("linked module+signature"))
	uvm := filepath.Join(dir, "nvidia-uvm.ko")
	writeFile(t, uvm, []byte("uvm~Module signature appended~\n"))
	pkg := filepath.Join(dir, "pkg")

	code, _, stderr := run(t, "pack", pkg, "--driver-version=1.2.3", "-d", "desc", "--proc-mount-point", procs["proc2"],
		"--kernel-interface", iface, "--linked-module-name", "nvidia.ko", "--core-object-name=nvidia/nv-kernel.o_binary",
		"--linked-module", linked, "--signed-module", signed, "--target-directory", "sub/dir")
	if code != 0 {
		t.Fatalf("pack: exit %d: %s", code, stderr)
	}
	// Appending keeps the header; header options are reported as ignored.
	code, _, stderr = run(t, "pack", pkg, "-v", "9.9", "--kernel-module", uvm, "--signed")
	if code != 0 || !strings.Contains(stderr, "ignoring --driver-version") {
		t.Fatalf("append: exit %d, stderr %q", code, stderr)
	}
	p, err := precompiled.ReadFile(pkg)
	if err != nil {
		t.Fatal(err)
	}
	if p.DriverVersion != "1.2.3" || p.Description != "desc" || len(p.Files) != 2 {
		t.Fatalf("package %q %q with %d files", p.DriverVersion, p.Description, len(p.Files))
	}
	f0, f1 := p.Files[0], p.Files[1]
	if f0.Attributes != precompiled.AttrDetachedSignature|precompiled.AttrLinkedModuleCRC || string(f0.Signature) != "+signature" ||
		f0.LinkedModuleCRC != precompiled.Checksum([]byte("linked module")) || f0.TargetDirectory != "sub/dir" {
		t.Errorf("interface record: %+v", f0)
	}
	if f1.Type != precompiled.KernelModule || f1.Attributes != precompiled.AttrEmbeddedSignature || f1.Index != 1 {
		t.Errorf("module record: %+v", f1)
	}
	if code, out, _ := run(t, "match", pkg, "--proc", procs["proc2"]); code != 0 || out != "kernel interface matches.\n" {
		t.Errorf("match: %d %q", code, out)
	}
	out := filepath.Join(dir, "out")
	if code, _, stderr := run(t, "unpack", pkg, "--output", out); code != 0 {
		t.Fatalf("unpack: %d %s", code, stderr)
	}
	if b, err := os.ReadFile(filepath.Join(out, "sub", "dir", "nv-linux.o")); err != nil || string(b) != "interface object" {
		t.Errorf("unpacked interface: %q, %v", b, err)
	}
	// -P stores the string exactly as given.
	pkg2 := filepath.Join(dir, "pkg2")
	if code, _, stderr := run(t, "pack", pkg2, "-v", "1", "-P", "boot/vmlinuz-5.15.0-91-generic", "--kernel-module", uvm); code != 0 {
		t.Fatalf("pack -P: %d %s", code, stderr)
	}
	if p, err := precompiled.ReadFile(pkg2); err != nil || p.ProcVersion != "boot/vmlinuz-5.15.0-91-generic" {
		t.Errorf("pack -P: %v", err)
	}
}
