package depmod

import (
	"bytes"
	"testing"
)

func FuzzParse(f *testing.F) {
	f.Add(Dep(nvidiaEntries))
	f.Add([]byte("kernel/a.ko:\n\n  \nkernel/b.ko.zst: kernel/a.ko\tkernel/c.ko\n"))
	f.Add([]byte("no colon\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		entries, err := Parse(bytes.NewReader(data))
		if err != nil {
			return
		}
		again, err := Parse(bytes.NewReader(Dep(entries)))
		if err != nil || len(again) != len(entries) {
			t.Fatalf("Dep(Parse(x)) does not parse back: %v (%d vs %d entries)", err, len(again), len(entries))
		}
		bin, err := DepBin(entries)
		if err != nil {
			return
		}
		for _, e := range entries {
			if _, ok := lookup(t, bin, e.Name()); !ok && e.Name() != "" {
				t.Fatalf("%s not in the index", e.Name())
			}
		}
	})
}
