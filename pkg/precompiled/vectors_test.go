package precompiled

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// vectorDir holds the shared precompiled-package vectors; CI checks out
// testdata/precompiled at the repository root (copied from shared/testdata/precompiled).
const vectorDir = "../../testdata/precompiled" // a copy of shared/testdata/precompiled, with its README

type expectedVector struct {
	Vector       string `json:"vector"`
	PackageFile  string `json:"package_file"`
	PackageSize  int64  `json:"package_size"`
	PackageSHA   string `json:"package_sha256"`
	ErrorExpect  bool   `json:"error_expected"`
	InfoStdout   string `json:"info_stdout"`
	InfoExitCode int    `json:"info_exit_code"`
	StepOneFile  string `json:"package_before_last_step_file"`
	StepOneSHA   string `json:"package_before_last_step_sha256"`
	Mutation     *struct {
		Kind      string `json:"kind"`
		Offset    int    `json:"offset"`
		NewLength int    `json:"new_length"`
	} `json:"mutation"`
	Steps []struct {
		Argv     []string `json:"argv"`
		ExitCode int      `json:"exit_code"`
	} `json:"steps"`
	Match map[string]struct {
		ProcVersion string `json:"proc_version"`
		Stdout      string `json:"stdout"`
		ExitCode    int    `json:"exit_code"`
	} `json:"match"`
	Unpack []unpackedFile `json:"unpack"`
}

type unpackedFile struct {
	Path   string `json:"path"`
	SHA256 string `json:"sha256"`
	Size   int64  `json:"size"`
	Mode   string `json:"mode"`
}

type inputsFile struct {
	Proc1 string `json:"proc1_version_file"`
	Proc2 string `json:"proc2_version_file"`
	Files []struct {
		Path      string `json:"path"`
		Size      int    `json:"size"`
		SHA256    string `json:"sha256"`
		CRCHex    string `json:"crc_hex"`
		StoredHex string `json:"crc_as_stored_by_tool_hex"`
	} `json:"inputs"`
}

type vector struct {
	name string
	dir  string
	exp  expectedVector
	raw  map[string]any // expected.json, generic
	bin  []byte
}

func loadJSON(t testing.TB, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// loadVectors returns every vector directory, good and corrupt.
func loadVectors(t testing.TB) []vector {
	t.Helper()
	entries, err := os.ReadDir(vectorDir)
	if err != nil {
		t.Fatalf("test vectors missing (want testdata/precompiled at the repository root): %v", err)
	}
	var vs []vector
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		v := vector{name: e.Name(), dir: filepath.Join(vectorDir, e.Name())}
		loadJSON(t, filepath.Join(v.dir, "expected.json"), &v.exp)
		loadJSON(t, filepath.Join(v.dir, "expected.json"), &v.raw)
		if v.bin, err = os.ReadFile(filepath.Join(v.dir, v.exp.PackageFile)); err != nil {
			t.Fatal(err)
		}
		if int64(len(v.bin)) != v.exp.PackageSize || sha(v.bin) != v.exp.PackageSHA {
			t.Fatalf("%s: package.bin does not match expected.json size/sha256", v.name)
		}
		vs = append(vs, v)
	}
	if len(vs) < 8 {
		t.Fatalf("found %d vectors in %s, want at least 8", len(vs), vectorDir)
	}
	return vs
}

func loadInputs(t testing.TB) inputsFile {
	var in inputsFile
	loadJSON(t, filepath.Join(vectorDir, "inputs.json"), &in)
	return in
}

func isCorrupt(v vector) bool { return strings.HasPrefix(v.name, "corrupt-") }

func TestGoodVectors(t *testing.T) {
	t.Parallel()
	in := loadInputs(t)
	procFiles := map[string]string{"proc1": in.Proc1, "proc2": in.Proc2}
	for _, v := range loadVectors(t) {
		if isCorrupt(v) {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			p, err := Parse(v.bin)
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}

			// Marshal and WriteTo reproduce the tool's bytes.
			out, err := p.Marshal()
			if err != nil {
				t.Fatalf("Marshal: %v", err)
			}
			if !bytes.Equal(out, v.bin) {
				t.Fatalf("Marshal differs from package.bin (%d vs %d bytes, first difference at %d)",
					len(out), len(v.bin), firstDiff(string(out), string(v.bin)))
			}
			var buf bytes.Buffer
			if n, err := p.WriteTo(&buf); err != nil || n != int64(len(v.bin)) || !bytes.Equal(buf.Bytes(), v.bin) {
				t.Fatalf("WriteTo: n=%d err=%v, equal=%v", n, err, bytes.Equal(buf.Bytes(), v.bin))
			}
			if p.Size() != int64(len(v.bin)) {
				t.Errorf("Size = %d, want %d", p.Size(), len(v.bin))
			}

			// ReadFile and Read agree with Parse.
			q, err := ReadFile(filepath.Join(v.dir, "package.bin"))
			if err != nil || !reflect.DeepEqual(p, q) {
				t.Errorf("ReadFile: err=%v, equal=%v", err, reflect.DeepEqual(p, q))
			}
			if q, err = Read(bytes.NewReader(v.bin)); err != nil || !reflect.DeepEqual(p, q) {
				t.Errorf("Read: err=%v, equal=%v", err, reflect.DeepEqual(p, q))
			}

			// --info text.
			var info strings.Builder
			if err := Info(&info, p); err != nil {
				t.Fatal(err)
			}
			if info.String() != v.exp.InfoStdout {
				t.Errorf("Info text:\n%s\nwant:\n%s", info.String(), v.exp.InfoStdout)
			}

			checkInfoJSON(t, p, v)

			// --match against both proc dirs, from the recorded strings and
			// from proc dirs written out from inputs.json.
			if len(v.exp.Match) == 0 {
				t.Fatal("expected.json has no match records")
			}
			for proc, m := range v.exp.Match {
				want := m.ExitCode == 1 && m.Stdout == "kernel interface matches.\n"
				if !want && (m.ExitCode != 0 || m.Stdout != "kernel interface doesn't match.\n") {
					t.Fatalf("%s: unexpected tool result %+v", proc, m)
				}
				if got := Match(p, m.ProcVersion); got != want {
					t.Errorf("Match(%s) = %v, want %v", proc, got, want)
				}
				procDir := filepath.Join(t.TempDir(), proc)
				if err := os.Mkdir(procDir, 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(procDir, "version"), []byte(procFiles[proc]), 0o644); err != nil {
					t.Fatal(err)
				}
				banner, err := ReadBanner(procDir)
				if err != nil {
					t.Fatal(err)
				}
				if banner != m.ProcVersion {
					t.Errorf("ReadBanner(%s) = %q, want %q", proc, banner, m.ProcVersion)
				}
				if got := Match(p, banner); got != want {
					t.Errorf("Match(ReadBanner(%s)) = %v, want %v", proc, got, want)
				}
				if got := Match(p, procFiles[proc]); got != want {
					t.Errorf("Match(whole %s/version) = %v, want %v", proc, got, want)
				}
				expl := Explain(p.ProcVersion, banner)
				if want != strings.HasPrefix(expl, "proc versions match") {
					t.Errorf("Explain(%s) = %q, want match=%v", proc, expl, want)
				}
			}

			// --unpack.
			dir := t.TempDir()
			paths, err := Unpack(p, dir)
			if err != nil {
				t.Fatalf("Unpack: %v", err)
			}
			if len(paths) != len(p.Files) {
				t.Errorf("Unpack returned %d paths for %d files", len(paths), len(p.Files))
			}
			for i, path := range paths {
				if want := filepath.Join(dir, p.Files[i].TargetDirectory, p.Files[i].Name); path != want {
					t.Errorf("Unpack path %d = %s, want %s", i, path, want)
				}
			}
			got := walkUnpacked(t, dir)
			want := slices.Clone(v.exp.Unpack)
			slices.SortFunc(want, func(a, b unpackedFile) int { return strings.Compare(a.Path, b.Path) })
			if !reflect.DeepEqual(got, want) {
				t.Errorf("unpacked files:\n%+v\nwant:\n%+v", got, want)
			}

			// The append vector's first step parses and round-trips too.
			if v.exp.StepOneFile != "" {
				b, err := os.ReadFile(filepath.Join(v.dir, v.exp.StepOneFile))
				if err != nil {
					t.Fatal(err)
				}
				if sha(b) != v.exp.StepOneSHA {
					t.Fatal("step-1 package does not match its recorded sha256")
				}
				p1, err := Parse(b)
				if err != nil {
					t.Fatal(err)
				}
				out, err := p1.Marshal()
				if err != nil || !bytes.Equal(out, b) {
					t.Fatalf("step-1 round trip: err=%v equal=%v", err, bytes.Equal(out, b))
				}
				// Appending the later files to step 1 gives the final package.
				for _, f := range p.Files[len(p1.Files):] {
					if err := p1.Append(f); err != nil {
						t.Fatal(err)
					}
				}
				if out, err = p1.Marshal(); err != nil || !bytes.Equal(out, v.bin) {
					t.Fatalf("step 1 + appended files: err=%v equal=%v", err, bytes.Equal(out, v.bin))
				}
			}
		})
	}
}

// checkInfoJSON compares InfoJSON's output with expected.json: every header
// field InfoJSON writes, and every per-file field except input_file.
func checkInfoJSON(t *testing.T, p *Package, v vector) {
	t.Helper()
	var buf bytes.Buffer
	if err := InfoJSON(&buf, p); err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	for k, g := range got {
		if k == "files" {
			continue
		}
		w, ok := v.raw[k]
		if !ok {
			t.Errorf("InfoJSON field %q is not in expected.json", k)
			continue
		}
		if !reflect.DeepEqual(g, w) {
			t.Errorf("InfoJSON %s = %v, want %v", k, g, w)
		}
	}
	gotFiles, _ := got["files"].([]any)
	wantFiles, _ := v.raw["files"].([]any)
	if len(gotFiles) != len(wantFiles) || len(wantFiles) == 0 {
		t.Fatalf("InfoJSON has %d files, expected.json %d", len(gotFiles), len(wantFiles))
	}
	for i := range wantFiles {
		g, w := gotFiles[i].(map[string]any), wantFiles[i].(map[string]any)
		for k, wv := range w {
			if k == "input_file" {
				continue
			}
			gv, ok := g[k]
			if !ok {
				t.Errorf("file %d: InfoJSON lacks %q", i, k)
				continue
			}
			if !reflect.DeepEqual(gv, wv) {
				t.Errorf("file %d: InfoJSON %s = %v, want %v", i, k, gv, wv)
			}
		}
		for k := range g {
			if _, ok := w[k]; !ok {
				t.Errorf("file %d: InfoJSON field %q is not in expected.json", i, k)
			}
		}
	}
}

// walkUnpacked lists the regular files under dir like expected.json's
// unpack[], sorted by path.
func walkUnpacked(t *testing.T, dir string) []unpackedFile {
	t.Helper()
	var files []unpackedFile
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		st, err := d.Info()
		if err != nil {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		files = append(files, unpackedFile{Path: filepath.ToSlash(rel), SHA256: sha(b), Size: st.Size(),
			Mode: fmt.Sprintf("%04o", st.Mode().Perm())})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

func TestCorruptVectors(t *testing.T) {
	t.Parallel()
	want := map[string][]string{
		"corrupt-bad-magic":         {"offset 1", "magic"},
		"corrupt-crc-copies-differ": {"offset 4457", "file record 0 \"nv-linux.o\"", "second crc copy", "519a17e8", "519a17e9"},
		"corrupt-truncated-20":      {"offset 20", "20 bytes", "28-byte fixed header"},
	}
	seen := 0
	for _, v := range loadVectors(t) {
		if !isCorrupt(v) {
			continue
		}
		seen++
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			if !v.exp.ErrorExpect {
				t.Fatal("expected.json says the tool accepts this corrupt vector; update the test")
			}
			_, err := Parse(v.bin)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Parse error = %v, want ErrCorrupt", err)
			}
			msg := err.Error()
			subs, ok := want[v.name]
			if !ok {
				t.Fatalf("no expectations for new corrupt vector %s: %v", v.name, err)
			}
			for _, s := range subs {
				if !strings.Contains(msg, s) {
					t.Errorf("error %q does not mention %q", msg, s)
				}
			}
			if v.exp.Mutation != nil && v.exp.Mutation.Kind == "overwrite" &&
				!strings.Contains(msg, fmt.Sprintf("offset %d", v.exp.Mutation.Offset)) {
				t.Errorf("error %q does not name the mutated offset %d", msg, v.exp.Mutation.Offset)
			}
			if _, err := ReadFile(filepath.Join(v.dir, "package.bin")); !errors.Is(err, ErrCorrupt) ||
				!strings.Contains(err.Error(), "package.bin") {
				t.Errorf("ReadFile error = %v, want ErrCorrupt naming the file", err)
			}
			t.Log(err)
		})
	}
	if seen != len(want) {
		t.Errorf("saw %d corrupt vectors, want %d", seen, len(want))
	}
}
