package kernel

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
)

// FuzzParseMountPoints checks that any input parses or fails without panicking, and that every
// parsed mount point, written back escaped, parses to itself.
func FuzzParseMountPoints(f *testing.F) {
	f.Add([]byte(mountinfo))
	f.Add([]byte("22 1 8:1 / /\n"))
	f.Add([]byte(`1 2 3:4 / /a\0 rw - x y z` + "\n" + `1 2 3:4 / \400\1 rw - x y z`))
	f.Fuzz(func(t *testing.T, data []byte) {
		points, err := ParseMountPoints(bytes.NewReader(data))
		if err != nil {
			return
		}
		var b strings.Builder
		for _, p := range points {
			var esc strings.Builder
			for i := 0; i < len(p); i++ {
				if c := p[i]; c <= ' ' || c == '\\' || c >= 0x7f {
					fmt.Fprintf(&esc, `\%03o`, c)
				} else {
					esc.WriteByte(c)
				}
			}
			fmt.Fprintf(&b, "1 0 0:1 / %s rw - tmpfs tmpfs rw\n", esc.String())
		}
		again, err := ParseMountPoints(strings.NewReader(b.String()))
		if err != nil || len(again) != len(points) {
			t.Fatalf("escaped mount points do not parse back: %v (%d vs %d)", err, len(again), len(points))
		}
		for i := range points {
			if again[i] != points[i] {
				t.Fatalf("mount point %q parses back as %q", points[i], again[i])
			}
		}
	})
}
