package flavor

import (
	"bytes"
	"os"
	"testing"
)

func FuzzParse(f *testing.F) {
	seed, err := os.ReadFile("testdata/supported-gpus.json")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(seed)
	f.Add([]byte(`{"chips":[]}`))
	f.Add([]byte(`{"chips":[{"devid":"0x2BB1","subdevid":"0x204B","subvendorid":"0x10DE","features":["kernelopen"]}]}`))
	f.Add([]byte(`{"chips":[{"devid":"0xZZ"}]}`))
	f.Add([]byte(`{"chips":null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		l, err := Parse(bytes.NewReader(data))
		if err != nil {
			return
		}
		for _, c := range l.Chips {
			got, ok := l.Lookup(c.DevID, c.SubVendorID, c.SubDevID)
			if !ok || got.DevID != c.DevID {
				t.Fatalf("Lookup of a parsed chip %+v = %+v, %v", c, got, ok)
			}
		}
		var gpus []GPU
		for _, c := range l.Chips {
			gpus = append(gpus, GPU{Device: c.DevID, SubVendor: c.SubVendorID, SubDevice: c.SubDevID})
		}
		if c, err := Choose(gpus, l, 580); err == nil && c.Flavor != Open && c.Flavor != Proprietary {
			t.Fatalf("Choose gave flavour %q", c.Flavor)
		}
	})
}
