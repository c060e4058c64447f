package flatcar

import (
	"reflect"
	"regexp"
	"testing"
)

func FuzzVersionMatchesRegexp(f *testing.F) {
	re := regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+$`)
	for _, s := range []string{"", "4593.2.0", "1.2", "1.2.3.4", "1..2", ".1.2.3", "1.2.3.", "1.2.3\n", " 1.2.3", "1.2.3\xff", "١.٢.٣", "1.2.a"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := isVersion(s), re.MatchString(s); got != want {
			t.Fatalf("isVersion(%q) = %v, the regexp %v", s, got, want)
		}
	})
}

func FuzzBoardMatchesRegexp(f *testing.F) {
	re := regexp.MustCompile(`^[a-z0-9_]+-usr$`)
	for _, s := range []string{"", "-usr", "amd64-usr", "arm64-usr", "a-usr-usr", "AMD64-usr", "amd64-usr\n", " amd64-usr", "amd64", "é-usr", "a\xff-usr", "a_b-usr", "a-b-usr"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := isBoard(s), re.MatchString(s); got != want {
			t.Fatalf("isBoard(%q) = %v, the regexp %v", s, got, want)
		}
	})
}

func FuzzPlaceholderMatchesRegexp(f *testing.F) {
	re := regexp.MustCompile(`\{[^{}]*\}`)
	for _, s := range []string{"", "{}", "{", "}", "}{", "a{b{c}d}", "{{x}}", "{a}{b}", "{a}}{b", "https://{channel}.release/{board}/{version}/",
		"{\n}", "{\xff}", "{é}x{", "{{{", "}}}", "{a{b}c{d}e}"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := placeholders(s), re.FindAllString(s, -1); !reflect.DeepEqual(got, want) {
			t.Fatalf("placeholders(%q) = %q, the regexp %q", s, got, want)
		}
		if got, want := blankPlaceholders(s), re.ReplaceAllString(s, "x"); got != want {
			t.Fatalf("blankPlaceholders(%q) = %q, the regexp %q", s, got, want)
		}
	})
}
