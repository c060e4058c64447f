package osrelease

import (
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	t.Parallel()
	in := `# Flatcar
NAME="Flatcar Container Linux by Kinvolk"
ID=flatcar
VERSION_ID=4081.2.0
PRETTY_NAME='Flatcar 4081.2.0'
FLATCAR_BOARD="amd64-usr"

ESCAPED="a \"b\" \$c"
EMPTY=
`
	got, err := Parse(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"NAME": "Flatcar Container Linux by Kinvolk", "ID": "flatcar", "VERSION_ID": "4081.2.0",
		"PRETTY_NAME": "Flatcar 4081.2.0", "FLATCAR_BOARD": "amd64-usr", "ESCAPED": `a "b" $c`, "EMPTY": ""}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	if len(got) != len(want) {
		t.Errorf("got %d keys, want %d: %v", len(got), len(want), got)
	}
}

func TestParseErrors(t *testing.T) {
	t.Parallel()
	for _, in := range []string{"garbage", "1KEY=x", `A="open`, "A='x", `A="x"y`, "A=two words", "=x"} {
		if _, err := Parse(strings.NewReader(in)); err == nil {
			t.Errorf("Parse(%q): no error", in)
		} else if !strings.Contains(err.Error(), "line 1") {
			t.Errorf("Parse(%q): %v does not name the line", in, err)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add("ID=flatcar\nVERSION_ID=\"4081.2.0\"\n")
	f.Add("A='b'\n# c\nD=\"e\\\"f\"")
	f.Fuzz(func(t *testing.T, in string) {
		vars, err := Parse(strings.NewReader(in))
		if err != nil {
			return
		}
		for k := range vars {
			if !validKey(k) {
				t.Fatalf("accepted bad key %q", k)
			}
		}
	})
}
