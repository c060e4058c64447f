package precompiled

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"unicode/utf8"
)

// maxBannerFile bounds how much of <proc>/version ReadBanner reads.
const maxBannerFile = 64 << 10

// firstLine returns s up to its first newline.
func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// Match reports whether p was built for the running kernel: whether its
// stored proc version equals procVersion byte for byte, where procVersion is
// the first line of <proc>/version (anything from the first newline on is
// ignored, so the whole file may be passed). This is mkprecompiled --match;
// note that the tool exits 1 on a match and 0 otherwise.
func Match(p *Package, procVersion string) bool {
	return p.ProcVersion == firstLine(procVersion)
}

// ReadBanner returns the first line of procDir/version without its newline,
// the string mkprecompiled stores as a package's proc version and compares
// with --match. procDir is normally "/proc". At most 64 KiB are read.
func ReadBanner(procDir string) (string, error) {
	f, err := os.Open(filepath.Join(procDir, "version"))
	if err != nil {
		return "", err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxBannerFile))
	if err != nil {
		return "", fmt.Errorf("read %s: %w", f.Name(), err)
	}
	return firstLine(string(b)), nil
}

// Banner is a Linux kernel banner (/proc/version) split into its fields:
//
//	Linux version <release> (<build host>) (<compiler>) #<build number> <flags> <date>
type Banner struct {
	// Release is the kernel release, as uname -r prints it.
	Release string
	// BuildHost is the builder, normally user@host.
	BuildHost string
	// Compiler describes the compiler and, on newer kernels, the linker.
	Compiler string
	// BuildNumber is the build counter after '#', e.g. "1" or "72-Ubuntu".
	BuildNumber string
	// Flags are the upper-case build flags after the build number, e.g.
	// "SMP PREEMPT_DYNAMIC".
	Flags string
	// Date is the rest: normally the build date, sometimes preceded by a
	// distribution version ("Debian 6.1.158-1 (2025-11-09)").
	Date string
}

// fields returns the banner's fields as (name, value) pairs, in banner order.
func (b *Banner) fields() [6][2]string {
	return [6][2]string{
		{"release", b.Release},
		{"build host", b.BuildHost},
		{"compiler", b.Compiler},
		{"build number", b.BuildNumber},
		{"flags", b.Flags},
		{"date", b.Date},
	}
}

// ParseBanner splits the first line of s into a Banner. It reports false if
// the line does not start with "Linux version <release> (<build host>)". It
// never panics.
func ParseBanner(s string) (Banner, bool) {
	var b Banner
	rest, ok := strings.CutPrefix(firstLine(s), "Linux version ")
	if !ok {
		return Banner{}, false
	}
	b.Release, rest, _ = strings.Cut(rest, " ")
	if b.Release == "" {
		return Banner{}, false
	}
	b.BuildHost, rest, ok = parenGroup(rest)
	if !ok {
		return Banner{}, false
	}
	if c, r, ok := parenGroup(rest); ok {
		b.Compiler, rest = c, r
	}
	rest = strings.TrimLeft(rest, " ")
	if after, ok := strings.CutPrefix(rest, "#"); ok {
		b.BuildNumber, rest, _ = strings.Cut(after, " ")
	}
	var flags []string
	for {
		rest = strings.TrimLeft(rest, " ")
		tok, after, _ := strings.Cut(rest, " ")
		if !isFlag(tok) {
			break
		}
		flags = append(flags, tok)
		rest = after
	}
	b.Flags = strings.Join(flags, " ")
	b.Date = rest
	return b, true
}

// parenGroup reads a balanced "(...)" group after optional spaces and
// returns its contents and what follows.
func parenGroup(s string) (inner, rest string, ok bool) {
	s = strings.TrimLeft(s, " ")
	if !strings.HasPrefix(s, "(") {
		return "", s, false
	}
	depth := 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '(':
			depth++
		case ')':
			depth--
			if depth == 0 {
				return s[1:i], s[i+1:], true
			}
		}
	}
	return "", s, false
}

// isFlag reports whether tok looks like a kernel build flag such as SMP or
// PREEMPT_DYNAMIC: upper-case letters, digits and underscores, with a letter.
func isFlag(tok string) bool {
	letter := false
	for i := 0; i < len(tok); i++ {
		switch c := tok[i]; {
		case c >= 'A' && c <= 'Z':
			letter = true
		case c >= '0' && c <= '9', c == '_':
		default:
			return false
		}
	}
	return letter
}

// Explain describes why a package's stored proc version (stored) does not
// match the running kernel's banner (running); only the first line of each is
// considered. When both are Linux banners it names the first differing field
// (release, build host, compiler, build number, flags or date) and prints
// every field of both side by side, marking the differing ones with '*'.
// Otherwise it gives the first differing byte offset and both strings. It
// never panics.
func Explain(stored, running string) string {
	stored, running = firstLine(stored), firstLine(running)
	if stored == running {
		return "proc versions match\n"
	}
	at := firstDiff(stored, running)
	var sb strings.Builder
	sp, okS := ParseBanner(stored)
	rp, okR := ParseBanner(running)
	if !okS || !okR {
		which := "package's proc version is"
		switch {
		case !okS && !okR:
			which = "package's and running proc versions are"
		case !okR:
			which = "running proc version is"
		}
		fmt.Fprintf(&sb, "proc version mismatch: the %s not a Linux kernel banner; first difference at byte %d\n", which, at)
		fmt.Fprintf(&sb, "  package: %s\n", show(stored))
		fmt.Fprintf(&sb, "  running: %s\n", show(running))
		return sb.String()
	}
	sf, rf := sp.fields(), rp.fields()
	var differ []string
	for i := range sf {
		if sf[i][1] != rf[i][1] {
			differ = append(differ, sf[i][0])
		}
	}
	switch len(differ) {
	case 0:
		fmt.Fprintf(&sb, "proc version mismatch: the banner fields agree but the strings differ at byte %d (spacing or punctuation)\n", at)
	case 1:
		fmt.Fprintf(&sb, "proc version mismatch: %s differs (first difference at byte %d)\n", differ[0], at)
	default:
		fmt.Fprintf(&sb, "proc version mismatch: %s differs, and also %s (first difference at byte %d)\n",
			differ[0], strings.Join(differ[1:], ", "), at)
	}
	tw := tabwriter.NewWriter(&sb, 0, 8, 2, ' ', 0)
	fmt.Fprintf(tw, "  field\tpackage\trunning\n")
	for i := range sf {
		a, b := sf[i][1], rf[i][1]
		mark := " "
		if a != b {
			mark = "*"
		}
		fmt.Fprintf(tw, "%s %s\t%s\t%s\n", mark, sf[i][0], show(a), show(b))
	}
	tw.Flush()
	if len(differ) == 0 {
		fmt.Fprintf(&sb, "  package: %s\n", show(stored))
		fmt.Fprintf(&sb, "  running: %s\n", show(running))
	}
	return sb.String()
}

// firstDiff returns the offset of the first differing byte of a and b.
func firstDiff(a, b string) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// show returns s for display: quoted if empty or if it holds anything other
// than printable UTF-8 (tabs included), so that columns stay aligned.
func show(s string) string {
	if s == "" || !utf8.ValidString(s) {
		return strconv.Quote(s)
	}
	for _, r := range s {
		if !strconv.IsPrint(r) {
			return strconv.Quote(s)
		}
	}
	return s
}
