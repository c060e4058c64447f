package precompiled

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// forgeCRC returns prefix followed by four bytes chosen so that the Checksum
// of the result is target. A CRC with a non-zero initial value and no final
// XOR is an invertible function of its register, so running the register 32
// bit-steps backwards from target gives the word to XOR in.
func forgeCRC(prefix []byte, target uint32) []byte {
	v := target
	for range 32 {
		if v&1 != 0 {
			v = (v^crcPoly)>>1 | 0x80000000
		} else {
			v >>= 1
		}
	}
	out := append(bytes.Clone(prefix), 0, 0, 0, 0)
	binary.BigEndian.PutUint32(out[len(prefix):], v^Checksum(prefix))
	return out
}

func TestForgeCRC(t *testing.T) {
	t.Parallel()
	for _, target := range []uint32{0, 1, 0x392f66e6, 0xffffffff} {
		for _, prefix := range [][]byte{nil, []byte("x"), make([]byte, 100)} {
			if got := Checksum(forgeCRC(prefix, target)); got != target {
				t.Errorf("forgeCRC(%d bytes, %08x) has crc %08x", len(prefix), target, got)
			}
		}
	}
}

// materializeInputs writes every file of inputs.json, and the two proc
// dirs, into dir. Member bytes come from a generator where inputs.json
// describes them exactly, otherwise from the vectors' packages (matched by
// sha256). linked/nvidia.ko is not recoverable; the package only depends on
// its size and CRC, so a stand-in with the same size and CRC is forged, and
// signed/nvidia.ko is that stand-in plus the signature stored in the
// detached-signature vector.
func materializeInputs(t *testing.T, dir string, vs []vector) {
	t.Helper()
	in := loadInputs(t)
	byHash := map[string][]byte{}
	var signature []byte
	for _, v := range vs {
		if isCorrupt(v) {
			continue
		}
		p, err := Parse(v.bin)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range p.Files {
			byHash[sha(f.Data)] = f.Data
			if len(f.Signature) > 0 {
				signature = f.Signature
			}
		}
	}
	drm := append(bytes.Repeat([]byte{0xAA, 0x55}, 300), make([]byte, 13)...)
	generated := map[string][]byte{
		"empty.ko":      {},
		"ff-7.o":        bytes.Repeat([]byte{0xFF}, 7),
		"one-byte.ko":   {0x5A},
		"zeros-4096.o":  make([]byte, 4096),
		"nvidia-drm.ko": drm,
	}
	var linked []byte
	for _, f := range in.Files {
		wantCRC, _ := strconv.ParseUint(f.CRCHex, 16, 32)
		wantStored, _ := strconv.ParseUint(f.StoredHex, 16, 32)
		var data []byte
		exact := true
		switch {
		case generated[f.Path] != nil:
			data = generated[f.Path]
		case byHash[f.SHA256] != nil:
			data = byHash[f.SHA256]
		case f.Path == "linked/nvidia.ko":
			data = forgeCRC(make([]byte, f.Size-4), uint32(wantCRC))
			linked, exact = data, false
		case f.Path == "signed/nvidia.ko":
			if linked == nil || signature == nil {
				t.Fatal("signed/nvidia.ko needs linked/nvidia.ko (listed first) and a stored signature")
			}
			data, exact = append(bytes.Clone(linked), signature...), false
		default:
			t.Logf("input %s not recoverable; skipped", f.Path)
			continue
		}
		if len(data) != f.Size {
			t.Fatalf("input %s: %d bytes, want %d", f.Path, len(data), f.Size)
		}
		if exact {
			if sha(data) != f.SHA256 {
				t.Fatalf("input %s: sha256 %s, want %s", f.Path, sha(data), f.SHA256)
			}
			if Checksum(data) != uint32(wantCRC) || StoredCRC(data) != uint32(wantStored) {
				t.Errorf("input %s: Checksum %08x StoredCRC %08x, want %s %s", f.Path,
					Checksum(data), StoredCRC(data), f.CRCHex, f.StoredHex)
			}
		} else if f.Path == "linked/nvidia.ko" && Checksum(data) != uint32(wantCRC) {
			t.Fatalf("forged %s has crc %08x", f.Path, Checksum(data))
		}
		writeFile(t, filepath.Join(dir, f.Path), data)
	}
	writeFile(t, filepath.Join(dir, "proc1", "version"), []byte(in.Proc1))
	writeFile(t, filepath.Join(dir, "proc2", "version"), []byte(in.Proc2))
}

func writeFile(tb testing.TB, path string, data []byte) {
	tb.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		tb.Fatal(err)
	}
}

// member is one --kernel-interface or --kernel-module with its options.
type member struct {
	iface                          bool
	path, linkedName, coreName, td string
	linked, signed                 string
	embeddedSig                    bool
}

// mkprecompiledPack carries out an `mkprecompiled --pack` argv in dir with
// this package's API, the way the driver-agent CLI is expected to.
func mkprecompiledPack(dir string, argv []string) error {
	if len(argv) < 3 || argv[0] != "mkprecompiled" || argv[1] != "--pack" {
		return fmt.Errorf("not an mkprecompiled --pack command: %q", argv)
	}
	out := filepath.Join(dir, argv[2])
	var driverVersion, description, procString, procDir string
	var members []*member
	cur := func(opt string) (*member, error) {
		if len(members) == 0 {
			return nil, fmt.Errorf("%s before any --kernel-interface/--kernel-module", opt)
		}
		return members[len(members)-1], nil
	}
	for i := 3; i < len(argv); i++ {
		opt := argv[i]
		if opt == "--signed" {
			m, err := cur(opt)
			if err != nil {
				return err
			}
			m.embeddedSig = true
			continue
		}
		if i+1 >= len(argv) {
			return fmt.Errorf("%s needs an argument", opt)
		}
		i++
		arg := argv[i]
		switch opt {
		case "--driver-version", "-v":
			driverVersion = arg
		case "--description", "-d":
			description = arg
		case "--proc-version", "-P":
			procString = arg
		case "--proc-mount-point":
			procDir = arg
		case "--kernel-interface":
			members = append(members, &member{iface: true, path: arg})
		case "--kernel-module":
			members = append(members, &member{path: arg})
		case "--linked-module-name", "--core-object-name", "--linked-module", "--signed-module", "--target-directory":
			m, err := cur(opt)
			if err != nil {
				return err
			}
			*map[string]*string{
				"--linked-module-name": &m.linkedName, "--core-object-name": &m.coreName,
				"--linked-module": &m.linked, "--signed-module": &m.signed, "--target-directory": &m.td,
			}[opt] = arg
		default:
			return fmt.Errorf("unsupported option %s", opt)
		}
	}
	join := func(p string) string {
		if p == "" || filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	var p *Package
	if _, err := os.Stat(out); err == nil {
		// An existing package keeps its header; new files are appended.
		if p, err = ReadFile(out); err != nil {
			return err
		}
	} else {
		if procString == "" {
			if procDir == "" {
				procDir = "/proc"
			}
			var err error
			if procString, err = ReadBanner(join(procDir)); err != nil {
				return err
			}
		}
		p = &Package{DriverVersion: driverVersion, Description: description, ProcVersion: procString}
	}
	for _, m := range members {
		var err error
		if m.iface {
			err = p.AddKernelInterface(join(m.path), m.linkedName, m.coreName, m.td, join(m.linked), join(m.signed))
		} else {
			err = p.AddKernelModule(join(m.path), m.td, m.embeddedSig)
		}
		if err != nil {
			return err
		}
	}
	b, err := p.Marshal()
	if err != nil {
		return err
	}
	return os.WriteFile(out, b, 0o644)
}

// TestBuildFromInputs replays every vector's recorded mkprecompiled commands
// against input files rebuilt from inputs.json and compares the result with
// the tool's package byte for byte.
func TestBuildFromInputs(t *testing.T) {
	t.Parallel()
	vs := loadVectors(t)
	for _, v := range vs {
		if isCorrupt(v) {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			materializeInputs(t, dir, vs)
			if len(v.exp.Steps) == 0 {
				t.Fatal("no steps recorded")
			}
			var out string
			for i, step := range v.exp.Steps {
				if step.ExitCode != 0 {
					t.Fatalf("step %d: tool exit code %d", i, step.ExitCode)
				}
				if err := mkprecompiledPack(dir, step.Argv); err != nil {
					t.Fatalf("step %d (%s): %v", i, strings.Join(step.Argv, " "), err)
				}
				out = filepath.Join(dir, step.Argv[2])
				if i == len(v.exp.Steps)-2 && v.exp.StepOneFile != "" {
					got, err := os.ReadFile(out)
					if err != nil {
						t.Fatal(err)
					}
					if sha(got) != v.exp.StepOneSHA {
						t.Errorf("after step %d: sha256 %s, want %s", i, sha(got), v.exp.StepOneSHA)
					}
				}
			}
			got, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, v.bin) {
				t.Fatalf("built package differs from package.bin (%d vs %d bytes, first difference at byte %d)",
					len(got), len(v.bin), firstDiff(string(got), string(v.bin)))
			}
		})
	}
}
