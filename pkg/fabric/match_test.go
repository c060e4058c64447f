package fabric

import (
	"regexp"
	"testing"
)

func FuzzSettingKeyMatchesRegexp(f *testing.F) {
	re := regexp.MustCompile(`^[A-Za-z0-9_]+$`)
	for _, s := range []string{"", "FABRIC_MODE", "a", "_", "9", "A-B", "A.B", "A B", "KEY\n", " KEY", "é", "KEY\xff", "\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := isSettingKey(s), re.MatchString(s); got != want {
			t.Fatalf("%q: isSettingKey says %v, the regexp %v", s, got, want)
		}
	})
}
