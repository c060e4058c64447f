package flavor

import (
	"errors"
	"os"
	"strings"
	"testing"
)

func testList(t *testing.T) List {
	t.Helper()
	f, err := os.Open("testdata/supported-gpus.json")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	l, err := Parse(f)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestParse(t *testing.T) {
	l := testList(t)
	if len(l.Chips) != 9 {
		t.Fatalf("%d chips, want 9", len(l.Chips))
	}
	if c := l.Chips[0]; c.DevID != 0x1023 || c.LegacyBranch != "470.xx" || c.KernelOpen {
		t.Errorf("K40m = %+v", c)
	}
	if c := l.Chips[3]; c.DevID != 0x1eb8 || c.Name != "Tesla T4" || !c.KernelOpen || c.SubVendorID != 0 {
		t.Errorf("T4 = %+v", c)
	}
	if c := l.Chips[8]; c.SubVendorID != 0x1028 || c.SubDevID != 0x204b {
		t.Errorf("board entry = %+v", c)
	}
	for _, bad := range []string{``, `[]`, `{}`, `{"chips":[{"name":"x"}]}`, `{"chips":[{"devid":"1EB8"}]}`, `{"chips":[{"devid":"0x12345"}]}`,
		`{"chips":[{"devid":"0x1EB8","subdevid":"0x1"}]}`, `{"chips":[{"devid":"0x1EB8","features":"kernelopen"}]}`, `{"chips":[`} {
		if _, err := Parse(strings.NewReader(bad)); err == nil {
			t.Errorf("Parse(%q) accepted it", bad)
		}
	}
}

func TestLookup(t *testing.T) {
	l := testList(t)
	if c, ok := l.Lookup(0x2bb1, 0x1028, 0x204b); !ok || c.SubVendorID != 0x1028 {
		t.Errorf("board match = %+v %v", c, ok)
	}
	if c, ok := l.Lookup(0x2bb1, 0x17aa, 0x9999); !ok || c.DevID != 0x2bb1 {
		t.Errorf("a board the list does not name falls back to the device's entries: %+v %v", c, ok)
	}
	if _, ok := l.Lookup(0x2901, 0, 0); ok {
		t.Error("found a GPU the list does not have")
	}
}

func TestChoose(t *testing.T) {
	l := testList(t)
	v100 := GPU{Address: "0000:3b:00.0", Device: 0x1db4}
	t4 := GPU{Address: "0000:5e:00.0", Device: 0x1eb8}
	h100 := GPU{Address: "0000:86:00.0", Device: 0x2330}
	gh200 := GPU{Address: "0009:01:00.0", Device: 0x2342}
	k40 := GPU{Address: "0000:04:00.0", Device: 0x1023}
	for _, tc := range []struct {
		name   string
		gpus   []GPU
		branch int
		want   string
		reason string
		err    string
	}{
		{"pre-Turing", []GPU{v100}, 580, Proprietary, "the open modules do not support 0000:3b:00.0 [10de:1db4] Tesla V100-PCIE-16GB", ""},
		{"Turing+", []GPU{t4, h100}, 580, Open, "all 2 GPU(s) support both flavours, and branch 580 defaults to the open modules", ""},
		{"Turing+ on an old branch", []GPU{t4}, 550, Proprietary, "branch 550 defaults to the proprietary modules", ""},
		{"mixed", []GPU{h100, v100}, 580, Proprietary, "the open modules do not support 0000:3b:00.0 [10de:1db4] Tesla V100-PCIE-16GB", ""},
		{"self-hosted", []GPU{gh200}, 535, Open, "the open modules are required by 0009:01:00.0 [10de:2342] NVIDIA GH200 120GB", ""},
		{"self-hosted and pre-Turing", []GPU{gh200, v100}, 580, "", "", "the open modules are required by 0009:01:00.0 [10de:2342] NVIDIA GH200 120GB and not supported by 0000:3b:00.0 [10de:1db4] Tesla V100-PCIE-16GB"},
		{"legacy", []GPU{t4, k40}, 580, "", "", "0000:04:00.0 [10de:1023] Tesla K40m is driven only by the 470.xx legacy branch; use a driver image of that branch"},
		{"no GPU, new branch", nil, 580, Open, "no NVIDIA GPU on the PCI bus: the branch rule, branch 580 >= 560 defaults to open modules", ""},
		{"no GPU, old branch", nil, 535, Proprietary, "branch 535 < 560 defaults to proprietary modules", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Choose(tc.gpus, l, tc.branch)
			if tc.err != "" {
				if !errors.Is(err, ErrNoFlavor) || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Choose = %+v, %v; want ErrNoFlavor with %q", c, err, tc.err)
				}
				return
			}
			if err != nil || c.Flavor != tc.want || !strings.Contains(c.Reason, tc.reason) {
				t.Fatalf("Choose = %+v, %v; want %s because %q", c, err, tc.want, tc.reason)
			}
		})
	}
}

func TestChooseUnknownGPUs(t *testing.T) {
	l := testList(t)
	c, err := Choose([]GPU{{Address: "a", Device: 0x2901}}, l, 580)
	if err != nil || c.Flavor != Open || len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], "not in the driver's list") {
		t.Errorf("an unknown Turing+ ID = %+v, %v; want open with a warning", c, err)
	}
	c, err = Choose([]GPU{{Address: "a", Device: 0x1b80}}, l, 580)
	if err != nil || c.Flavor != Proprietary || len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], "pre-Turing range") {
		t.Errorf("an unknown ID in the pre-Turing range = %+v, %v; want proprietary with a warning", c, err)
	}
}

func TestCheck(t *testing.T) {
	l := testList(t)
	if w := Check(Open, []GPU{{Address: "a", Device: 0x1db4}}, l); len(w) != 1 || !strings.Contains(w[0], "does not support the open modules") {
		t.Errorf("open on a V100: %q", w)
	}
	if w := Check(Proprietary, []GPU{{Address: "a", Device: 0x2342}}, l); len(w) != 1 || !strings.Contains(w[0], "requires the open modules") {
		t.Errorf("proprietary on a GH200: %q", w)
	}
	if w := Check(Open, []GPU{{Address: "a", Device: 0x2330}}, l); len(w) != 0 {
		t.Errorf("open on an H100: %q", w)
	}
}
