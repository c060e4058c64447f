package kernel

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
)

// IsMountPoint reports whether target is a mount point in <proc>/self/mountinfo.
func IsMountPoint(proc, target string) (bool, error) {
	data, err := ReadSmall(filepath.Join(proc, "self/mountinfo"))
	if err != nil {
		return false, fmt.Errorf("mount table: %w", err)
	}
	points, err := ParseMountPoints(bytes.NewReader(data))
	if err != nil {
		return false, err
	}
	return slices.Contains(points, target), nil
}

// ParseMountPoints returns the mount point field of each mountinfo line, unescaped.
func ParseMountPoints(r io.Reader) ([]string, error) {
	var points []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for n := 1; sc.Scan(); n++ {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		if len(f) < 10 {
			return nil, fmt.Errorf("mountinfo line %d: want at least 10 fields, have %d", n, len(f))
		}
		points = append(points, unescapeOctal(f[4]))
	}
	return points, sc.Err()
}

func unescapeOctal(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) && isOctal(s[i+1:i+4]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(s string) bool {
	if len(s) != 3 || s[0] > '3' {
		return false
	}
	for i := 0; i < 3; i++ {
		if s[i] < '0' || s[i] > '7' {
			return false
		}
	}
	return true
}
