package build

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
)

// Compiler families.
const (
	GCC   = "gcc"
	Clang = "clang"
)

// Compiler is a C compiler as a kernel banner or `<cc> --version` names it.
type Compiler struct {
	// Family is GCC, Clang, or "" when the text does not say (a compiler
	// called plain "cc", for example).
	Family string
	// Version is the compiler's version, e.g. "12.2.0".
	Version string
	// Major is the first number of Version.
	Major int
	// Text is what the version was read from: the compiler part of the
	// banner, or the first line of --version.
	Text string
}

// String renders the compiler for messages, e.g. `gcc 12.2.0 ("gcc (Debian 12.2.0-14) 12.2.0")`.
func (c Compiler) String() string {
	family := c.Family
	if family == "" {
		family = "compiler"
	}
	return fmt.Sprintf("%s %s (%q)", family, c.Version, c.Text)
}

// ParseCompiler reads a compiler description: the compiler group of a kernel
// banner, such as "gcc (Debian 12.2.0-14) 12.2.0, GNU ld (GNU Binutils for
// Debian) 2.40" or "Debian clang version 16.0.6 (15), Debian LLD 16.0.6", or
// the first line of `<cc> --version`. The linker part after the first ", "
// outside parentheses is ignored. The version is the first dotted number
// outside parentheses ("gcc (GCC) 13.2.1 20230801" gives 13.2.1), else the
// first one anywhere. ok is false when there is no version.
func ParseCompiler(s string) (c Compiler, ok bool) {
	s = strings.TrimSpace(firstLineOf(s))
	depth := 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '(':
			depth++
		case ')':
			if depth > 0 {
				depth--
			}
		case ',':
			if depth == 0 {
				s = strings.TrimSpace(s[:i])
				i = len(s)
			}
		}
	}
	c.Text = s
	lower := strings.ToLower(s)
	switch {
	case strings.Contains(lower, "clang"):
		c.Family = Clang
	case strings.Contains(lower, "gcc"):
		c.Family = GCC
	}
	c.Version = versionOutsideParens(s)
	if c.Version == "" {
		c.Version = firstVersion(s)
	}
	if c.Version == "" {
		return Compiler{}, false
	}
	major, _, _ := strings.Cut(c.Version, ".")
	n, err := strconv.Atoi(major)
	if err != nil {
		return Compiler{}, false
	}
	c.Major = n
	return c, true
}

// CompilerFromBanner returns the compiler a kernel banner (/proc/version) names.
func CompilerFromBanner(banner string) (Compiler, bool) {
	b, ok := precompiled.ParseBanner(banner)
	if !ok || b.Compiler == "" {
		return Compiler{}, false
	}
	return ParseCompiler(b.Compiler)
}

// parseVersionOutput reads `<cc> --version` output: the first line, with the
// family taken from GCC's copyright line when the first line does not say
// (Debian's "cc (Debian 12.2.0-14) 12.2.0").
func parseVersionOutput(out string) (Compiler, bool) {
	c, ok := ParseCompiler(out)
	if ok && c.Family == "" && strings.Contains(out, "Free Software Foundation") {
		c.Family = GCC
	}
	return c, ok
}

func firstLineOf(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// versionOutsideParens returns the first word outside parentheses that is a
// dotted version number (trailing punctuation ignored).
func versionOutsideParens(s string) string {
	depth := 0
	start := -1
	check := func(end int) string {
		if start < 0 {
			return ""
		}
		w := strings.TrimRight(s[start:end], ",;:")
		start = -1
		if isVersion(w) {
			return w
		}
		return ""
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '(':
			if v := check(i); v != "" {
				return v
			}
			depth++
		case c == ')':
			if depth > 0 {
				depth--
			}
		case c == ' ' || c == '\t':
			if v := check(i); v != "" {
				return v
			}
		default:
			if depth == 0 && start < 0 {
				start = i
			}
		}
	}
	return check(len(s))
}

// isVersion reports whether w is digits separated by single dots, with at
// least one dot: "12.2.0", "16.0".
func isVersion(w string) bool {
	parts := strings.Split(w, ".")
	if len(parts) < 2 {
		return false
	}
	for _, p := range parts {
		if p == "" || strings.Trim(p, "0123456789") != "" {
			return false
		}
	}
	return true
}

// firstVersion returns the first run of the form digits.digits[.digits...] in s.
func firstVersion(s string) string {
	for i := 0; i < len(s); i++ {
		if !isDigit(s[i]) || i > 0 && (isDigit(s[i-1]) || s[i-1] == '.') {
			continue
		}
		j := i
		dots := 0
		for j < len(s) {
			k := j
			for k < len(s) && isDigit(s[k]) {
				k++
			}
			if k == j {
				break
			}
			j = k
			if j+1 < len(s) && s[j] == '.' && isDigit(s[j+1]) {
				j++
				dots++
				continue
			}
			break
		}
		if dots > 0 {
			return s[i:j]
		}
	}
	return ""
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// checkCompiler compares the compiler the kernel was built with (from the
// banner) with the one the build will use (cc --version, run through run).
//
// A different family (gcc against clang) is an error (ErrCompilerMismatch):
// the kernel's configuration selects compiler-specific flags, and the build
// fails in ways that do not name the cause. A different major version is a
// warning: NVIDIA's own conftest (cc_version_check) only warns about it, the
// driver container scripts set IGNORE_CC_MISMATCH=1 to silence even that, and
// kbuild itself only warns; modules built that way load and run in practice,
// but a subtle ABI difference is possible, so the warning names both
// compilers and the --cc option. A difference below the major version is
// logged at info level.
func (b *builder) checkCompiler(ctx context.Context) error {
	log, cc := b.log, b.cc
	kernel, ok := CompilerFromBanner(b.o.Banner)
	if !ok {
		log.Debug("the kernel banner names no compiler version; not comparing compilers", "banner", b.o.Banner)
		return nil
	}
	start, err := b.logFile.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("build log: %w", err)
	}
	fmt.Fprintf(b.logFile, "$ %s --version\n", b.ccPath)
	runErr := b.runner.Run(ctx, host.Cmd{Path: b.ccPath, Args: []string{"--version"}, Env: b.env}, b.logFile)
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("compiler check: %w", ctxErr)
	}
	out, err := readFrom(b.logFile.Name(), start, 64<<10)
	if err != nil {
		return fmt.Errorf("build log: %w", err)
	}
	_, out, _ = strings.Cut(out, "\n") // the "$ cc --version" line
	if runErr != nil {
		return fmt.Errorf("%w: %s --version: %w: %s; set --cc to a C compiler in the image",
			ErrCompiler, cc, runErr, strings.TrimSpace(out))
	}
	used, ok := parseVersionOutput(out)
	if !ok {
		log.Warn("cannot read the compiler's version; not comparing it with the kernel's", "cc", cc,
			"output", strings.TrimSpace(firstLineOf(out)))
		return nil
	}
	switch {
	case kernel.Family != "" && used.Family != "" && kernel.Family != used.Family:
		return fmt.Errorf("%w: the kernel was built with %s, the build would use %s (%s): set --cc to a %s compiler in the image",
			ErrCompilerMismatch, kernel, used, cc, kernel.Family)
	case kernel.Major != used.Major:
		log.Warn("the compiler's major version differs from the kernel's; the modules may not work correctly: set --cc to a matching compiler if the image has one",
			"kernel_compiler", kernel.Text, "kernel_compiler_version", kernel.Version,
			"cc", cc, "cc_version", used.Version, "cc_text", used.Text)
	case kernel.Version != used.Version:
		log.Info("the compiler's version differs from the kernel's below the major version",
			"kernel_compiler_version", kernel.Version, "cc", cc, "cc_version", used.Version)
	default:
		log.Debug("the compiler matches the kernel's", "cc", cc, "version", used.Version)
	}
	return nil
}

// readFrom reads at most limit bytes of path from offset off.
func readFrom(path string, off, limit int64) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	b := make([]byte, limit)
	n, err := f.ReadAt(b, off)
	if err != nil && n == 0 && !errors.Is(err, io.EOF) {
		return "", err
	}
	return string(b[:n]), nil
}
