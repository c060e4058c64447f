// Package hosttest provides fixture trees and stateful fakes of the host seams for tests: a fake
// kernel that keeps <proc>/modules and <sys>/module/* up to date so the real parsers read the
// result, a mounter that keeps <proc>/self/mountinfo, a mknoder, and minimal module objects.
// Daemon tests use real fake processes through pkg/daemon's reaper instead.
package hosttest

import (
	"bufio"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host"
)

// Unpack writes a txtar-style archive ("-- path --" lines followed by the file's content) into a
// new temporary directory and returns it. A path ending in "/" makes an empty directory; a file
// whose content is "-> target" becomes a symlink.
func Unpack(t testing.TB, archive string) string {
	t.Helper()
	dir := t.TempDir()
	var name string
	var body strings.Builder
	flush := func() {
		if name == "" {
			return
		}
		full := filepath.Join(dir, name)
		if strings.HasSuffix(name, "/") {
			Must(t, os.MkdirAll(full, 0o755))
			return
		}
		Must(t, os.MkdirAll(filepath.Dir(full), 0o755))
		content := body.String()
		if target, ok := strings.CutPrefix(strings.TrimSpace(content), "-> "); ok {
			Must(t, os.Symlink(target, full))
			return
		}
		Must(t, os.WriteFile(full, []byte(content), 0o644))
	}
	sc := bufio.NewScanner(strings.NewReader(archive))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "-- ") && strings.HasSuffix(line, " --") && len(line) > 6 {
			flush()
			name, body = strings.TrimSpace(line[3:len(line)-3]), strings.Builder{}
			continue
		}
		if name != "" {
			body.WriteString(line + "\n")
		}
	}
	flush()
	return dir
}

// UnpackFile unpacks the archive file at path.
func UnpackFile(t testing.TB, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	Must(t, err)
	return Unpack(t, string(data))
}

// Roots returns the roots of a fixture tree laid out as container/, host/, proc/, sys/, dev/,
// run/ and drivers/ under dir. Missing ones are created.
func Roots(t testing.TB, dir string) host.Roots {
	t.Helper()
	r := host.Roots{
		Root: filepath.Join(dir, "container"), HostRoot: filepath.Join(dir, "host"), Proc: filepath.Join(dir, "proc"),
		Sys: filepath.Join(dir, "sys"), Dev: filepath.Join(dir, "dev"), Run: filepath.Join(dir, "run"), DriversDir: filepath.Join(dir, "drivers"),
	}
	for _, p := range []string{r.Root, r.HostRoot, r.Proc, r.Sys, r.Dev, r.Run, r.DriversDir} {
		Must(t, os.MkdirAll(p, 0o755))
	}
	return r
}

// Snapshot lists every path under dir with its content (symlinks as "-> target"), for
// comparing a tree before and after a run.
func Snapshot(t testing.TB, dir string) map[string]string {
	t.Helper()
	snap := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		switch {
		case d.Type()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			snap[rel] = "-> " + target
		case d.IsDir():
			snap[rel+"/"] = ""
		default:
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			snap[rel] = string(data)
		}
		return nil
	})
	Must(t, err)
	return snap
}

// DiffSnapshots describes how after differs from before, or returns "".
func DiffSnapshots(before, after map[string]string) string {
	var out []string
	for p, v := range before {
		if w, ok := after[p]; !ok {
			out = append(out, "removed "+p)
		} else if v != w {
			out = append(out, "changed "+p+": "+quoteShort(v)+" -> "+quoteShort(w))
		}
	}
	for p := range after {
		if _, ok := before[p]; !ok {
			out = append(out, "added "+p)
		}
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

func quoteShort(s string) string {
	if len(s) > 60 {
		s = s[:60] + "..."
	}
	return "\"" + strings.ReplaceAll(s, "\n", "\\n") + "\""
}

// Must fails the test at once when a setup step failed: Must(t, os.WriteFile(...)).
func Must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
