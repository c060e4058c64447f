// Package osrelease parses os-release(5) style KEY=value files: /etc/os-release,
// Flatcar's /usr/share/flatcar/release and update.conf.
package osrelease

import (
	"bufio"
	"fmt"
	"io"
	"strings"
)

// Parse reads KEY=value lines. Values may be unquoted, 'single' or "double" quoted; in double
// quotes the backslash escapes \" \\ \$ \` are honoured. Blank lines and # comments are skipped.
// A line that is not an assignment is an error naming the line.
func Parse(r io.Reader) (map[string]string, error) {
	vars := map[string]string{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 64<<10)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		key, val, ok := strings.Cut(line, "=")
		key = strings.TrimSpace(key)
		if !ok || !validKey(key) {
			return nil, fmt.Errorf("line %d: not a KEY=value assignment: %q", n, line)
		}
		v, err := unquote(strings.TrimSpace(val))
		if err != nil {
			return nil, fmt.Errorf("line %d: %s: %w", n, key, err)
		}
		vars[key] = v
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return vars, nil
}

func validKey(k string) bool {
	if k == "" {
		return false
	}
	for i, c := range k {
		if c == '_' || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (i > 0 && c >= '0' && c <= '9') {
			continue
		}
		return false
	}
	return true
}

func unquote(v string) (string, error) {
	if v == "" {
		return "", nil
	}
	switch q := v[0]; q {
	case '\'':
		if len(v) < 2 || v[len(v)-1] != '\'' || strings.ContainsRune(v[1:len(v)-1], '\'') {
			return "", fmt.Errorf("unterminated single quote in %q", v)
		}
		return v[1 : len(v)-1], nil
	case '"':
		var b strings.Builder
		for i := 1; i < len(v); i++ {
			c := v[i]
			switch {
			case c == '\\' && i+1 < len(v) && strings.IndexByte("\"\\$`", v[i+1]) >= 0:
				i++
				b.WriteByte(v[i])
			case c == '"':
				if i != len(v)-1 {
					return "", fmt.Errorf("text after closing quote in %q", v)
				}
				return b.String(), nil
			default:
				b.WriteByte(c)
			}
		}
		return "", fmt.Errorf("unterminated double quote in %q", v)
	}
	if strings.ContainsAny(v, "\"'` \t") {
		return "", fmt.Errorf("unquoted value with quotes or spaces: %q", v)
	}
	return v, nil
}
