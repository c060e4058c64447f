package main

import (
	"errors"
	"fmt"
	gobuild "go/build"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/config"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
)

// repoRoot is the repository root, seen from this package's directory.
const repoRoot = "../.."

// TestREADME keeps the README true: its flag table is config.Options, its exit-code table is
// exitcode.Table, its Layout lists exactly the repository's packages and directories (see
// layoutDirs), every relative link and path in the repository's markdown stays inside the
// repository and resolves, docs/ARCHITECTURE.md's layers and import table are the packages'
// imports, and .ci/run runs the README's test command.
func TestREADME(t *testing.T) {
	readme := readText(t, filepath.Join(repoRoot, "README.md"))
	dirs, err := layoutDirs(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	docs, err := markdownFiles(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	var problems []string
	problems = append(problems, flagTableProblems(readme)...)
	problems = append(problems, exitTableProblems(readme)...)
	problems = append(problems, layoutProblems(readme, dirs)...)
	problems = append(problems, linkProblems(docs)...)
	imports, err := moduleImports(repoRoot, dirs)
	if err != nil {
		t.Fatal(err)
	}
	problems = append(problems, architectureProblems(docs["docs/ARCHITECTURE.md"], imports)...)
	for _, p := range problems {
		t.Error(p)
	}
	ci, err := os.ReadFile(filepath.Join(repoRoot, ".ci/run"))
	if err != nil || !strings.Contains(string(ci), "\nmake ci\n") || !strings.Contains(readme, "\nmake ci\n") {
		t.Error(".ci/run must run exactly the README's test command, make ci")
	}
}

// TestREADMEChecks shows that each of TestREADME's checks fails on a wrong row, a missing row
// and an extra row (or entry, or link), so that a green TestREADME means the tables are equal.
func TestREADMEChecks(t *testing.T) {
	readme := readText(t, filepath.Join(repoRoot, "README.md"))
	dirs, err := layoutDirs(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	flagRow := tableLine(t, readme, flagHeader, 0)
	flagRow2 := tableLine(t, readme, flagHeader, 1)
	exitRow := tableLine(t, readme, exitHeader, 4)
	layoutLine := "\npkg/agent/ "
	lastOption := config.Options()[len(config.Options())-1]
	cases := []struct {
		name     string
		old, new string
		check    func(readme string) []string
	}{
		{"flag: wrong default", flagRow, strings.Replace(flagRow, "| `/` |", "| `/x` |", 1), flagTableProblems},
		{"flag: wrong environment", flagRow, strings.Replace(flagRow, "DRIVER_AGENT_ROOT", "DRIVER_AGENT_ROOTS", 1), flagTableProblems},
		{"flag: wrong meaning", flagRow, strings.Replace(flagRow, "filesystem", "file system", 1), flagTableProblems},
		{"flag: missing row", flagRow + "\n", "", flagTableProblems},
		{"flag: missing last row", "| `--" + lastOption.Flag + "` |", "| `--x-" + lastOption.Flag + "` |", flagTableProblems},
		{"flag: extra row", flagRow + "\n", flagRow + "\n| `--bogus` | `DRIVER_AGENT_BOGUS` | — | not an option |\n", flagTableProblems},
		{"flag: duplicate row", flagRow + "\n", flagRow + "\n" + flagRow + "\n", flagTableProblems},
		{"flag: order", flagRow + "\n" + flagRow2 + "\n", flagRow2 + "\n" + flagRow + "\n", flagTableProblems},
		{"flag: wrong NVFM row", "| `NVFM_CONFIG_<KEY>` |", "| `NVFM_<KEY>` |", flagTableProblems},
		{"exit: wrong meaning", exitRow, strings.Replace(exitRow, "another", "a second", 1), exitTableProblems},
		{"exit: wrong code", exitRow, strings.Replace(exitRow, "| 4 |", "| 40 |", 1), exitTableProblems},
		{"exit: missing row", exitRow + "\n", "", exitTableProblems},
		{"exit: extra row", exitRow + "\n", exitRow + "\n| 13 | not a code |\n", exitTableProblems},
		{"layout: missing entry", layoutLine, "\npkg/agentx/ ", func(r string) []string { return layoutProblems(r, dirs) }},
		{"layout: extra entry", layoutLine, "\npkg/nosuch/ x\npkg/agent/ ", func(r string) []string { return layoutProblems(r, dirs) }},
		{"layout: duplicate entry", layoutLine, "\npkg/agent/ x\npkg/agent/ ", func(r string) []string { return layoutProblems(r, dirs) }},
		{"layout: missing directory", "", "", func(r string) []string { return layoutProblems(r, append(slices.Clip(dirs), "pkg/new")) }},
		{"link: missing file", "## Guides\n", "## Guides\n[x](docs/nosuch.md)\n", readmeLinkProblems},
		{"link: missing heading", "## Guides\n", "## Guides\n[x](docs/modules.md#no-such-heading)\n", readmeLinkProblems},
		{"link: outside the repository", "## Guides\n", "## Guides\n[x](../shared/reference/notes.md)\n", readmeLinkProblems},
		{"path: outside the repository", "## Guides\n", "## Guides\nsee `../shared/reference/`\n", readmeLinkProblems},
	}
	if len(flagTableProblems(readme))+len(exitTableProblems(readme))+len(layoutProblems(readme, dirs))+len(readmeLinkProblems(readme)) > 0 {
		t.Fatal("the README itself fails the checks (see TestREADME)")
	}
	arch := readText(t, filepath.Join(repoRoot, "docs/ARCHITECTURE.md"))
	imports, err := moduleImports(repoRoot, dirs)
	if err != nil {
		t.Fatal(err)
	}
	archCheck := func(doc string) []string { return architectureProblems(doc, imports) }
	if len(archCheck(arch)) > 0 {
		t.Fatal("docs/ARCHITECTURE.md itself fails the checks (see TestREADME)")
	}
	archRow := tableLine(t, arch, archHeader, 0)
	archCases := []struct {
		name, old, new string
	}{
		{"architecture: wrong imports", archRow, strings.Replace(archRow, "| cli |", "| cli agent |", 1)},
		{"architecture: missing row", archRow + "\n", ""},
		{"architecture: extra row", archRow + "\n", archRow + "\n| nosuch | host |\n"},
		{"architecture: package in a higher box", "\n| cli ", "\n| host   cli "},
		{"architecture: package missing from the drawing", "\n| cli ", "\n|     "},
		{"architecture: package twice in the drawing", "\n| cli ", "\n| cli cli "},
	}
	for _, c := range archCases {
		t.Run(c.name, func(t *testing.T) {
			mutated := strings.Replace(arch, c.old, c.new, 1)
			if mutated == arch {
				t.Fatalf("replacing %q changes nothing", c.old)
			}
			if got := archCheck(mutated); len(got) == 0 {
				t.Errorf("the check passes an ARCHITECTURE.md with %s", c.name)
			} else {
				t.Logf("caught: %s", strings.Join(got, "; "))
			}
		})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			mutated := readme
			if c.old != "" {
				mutated = strings.Replace(readme, c.old, c.new, 1)
				if mutated == readme {
					t.Fatalf("replacing %q changes nothing", c.old)
				}
			}
			if got := c.check(mutated); len(got) == 0 {
				t.Errorf("the check passes a README with %s", c.name)
			} else {
				t.Logf("caught: %s", strings.Join(got, "; "))
			}
		})
	}
}

func readText(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// tableLine is the text of row i (0 is the first after the separator) of the table under header.
func tableLine(t *testing.T, doc, header string, i int) string {
	t.Helper()
	rows, ok := table(doc, header)
	if !ok || i >= len(rows) {
		t.Fatalf("no row %d in the table %q", i, header)
	}
	return rows[i].line
}

const (
	flagHeader = "| flag | environment | default | meaning |"
	exitHeader = "| code | meaning |"
)

type row struct {
	line  string
	cells []string
}

// table returns the rows of the markdown table whose header line is header. A cell's `\|` is a
// literal bar.
func table(doc, header string) ([]row, bool) {
	lines := strings.Split(doc, "\n")
	start := slices.Index(lines, header)
	if start < 0 || start+1 >= len(lines) || !strings.HasPrefix(lines[start+1], "|---") {
		return nil, false
	}
	var rows []row
	for _, l := range lines[start+2:] {
		if !strings.HasPrefix(l, "|") {
			break
		}
		inner := strings.TrimSuffix(strings.TrimPrefix(l, "|"), "|")
		parts := strings.Split(strings.ReplaceAll(inner, `\|`, "\x00"), "|")
		cells := make([]string, len(parts))
		for i, p := range parts {
			cells[i] = strings.ReplaceAll(strings.TrimSpace(p), "\x00", "|")
		}
		rows = append(rows, row{line: l, cells: cells})
	}
	return rows, true
}

// plain is a cell's text without markdown code marks, as the code's strings have it.
func plain(cell string) string { return strings.ReplaceAll(cell, "`", "") }

// compareTable reports every difference between the table under header in doc and want, keyed by
// each row's first cell: rows missing, rows extra or twice, cells that differ, and the order.
func compareTable(doc, header, what string, want [][]string) []string {
	rows, ok := table(doc, header)
	if !ok {
		return []string{fmt.Sprintf("README has no %s table with the header %q", what, header)}
	}
	var problems []string
	wantByKey := map[string][]string{}
	var wantOrder, gotOrder []string
	for _, w := range want {
		wantByKey[w[0]] = w
		wantOrder = append(wantOrder, w[0])
	}
	seen := map[string]bool{}
	for _, r := range rows {
		key := r.cells[0]
		w, known := wantByKey[key]
		switch {
		case !known:
			problems = append(problems, fmt.Sprintf("README's %s table has a row the code lacks: %s", what, r.line))
			continue
		case seen[key]:
			problems = append(problems, fmt.Sprintf("README's %s table has the row %s twice", what, key))
			continue
		}
		seen[key] = true
		gotOrder = append(gotOrder, key)
		if len(r.cells) != len(w) {
			problems = append(problems, fmt.Sprintf("README's %s row %s has %d cells, want %d", what, key, len(r.cells), len(w)))
			continue
		}
		for i := 1; i < len(w); i++ {
			if got := plain(r.cells[i]); got != plain(w[i]) {
				problems = append(problems, fmt.Sprintf("README's %s row %s, column %d: %q, want %q", what, key, i+1, r.cells[i], w[i]))
			}
		}
	}
	for _, key := range wantOrder {
		if !seen[key] {
			problems = append(problems, fmt.Sprintf("README's %s table lacks the row %s", what, key))
		}
	}
	if len(problems) == 0 && !slices.Equal(gotOrder, wantOrder) {
		problems = append(problems, fmt.Sprintf("README's %s rows are in the order %q, want the code's %q", what, gotOrder, wantOrder))
	}
	return problems
}

// flagTableProblems compares the README's flag table with config.Options (flag, environment
// variable, default, and the meaning equal to the option's usage text, code marks aside), and
// with the one setting that is not an option, NVFM_CONFIG_<KEY>.
func flagTableProblems(readme string) []string {
	var want [][]string
	for _, o := range config.Options() {
		def := "—"
		if o.Default != "" {
			def = "`" + o.Default + "`"
		}
		want = append(want, []string{"`--" + o.Flag + "`", "`" + o.Env + "`", def, o.Usage})
	}
	want = append(want, []string{"—", "`NVFM_CONFIG_<KEY>`", "—", config.NVFMUsage})
	return compareTable(readme, flagHeader, "flag", want)
}

// exitTableProblems compares the README's exit-code table with exitcode.Table.
func exitTableProblems(readme string) []string {
	var want [][]string
	for _, e := range exitcode.Table() {
		want = append(want, []string{strconv.Itoa(e.Code), e.Meaning})
	}
	return compareTable(readme, exitHeader, "exit-code", want)
}

// layoutDirs lists what the README's Layout must show, as slash paths from root: every directory
// that holds Go files outside testdata (a package or a command), and every other directory of
// files at most two levels down that is not inside a package (docs/, images/monitoring/,
// test/fixtures/, ...). Hidden directories and bin/ (build output) are left out.
func layoutDirs(root string) ([]string, error) {
	var dirs, pkgs []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() || p == root {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if strings.HasPrefix(d.Name(), ".") || rel == "bin" {
			return filepath.SkipDir
		}
		entries, err := os.ReadDir(p)
		if err != nil {
			return err
		}
		hasGo, hasFile := false, false
		for _, e := range entries {
			if e.Type().IsRegular() {
				hasFile = true
				hasGo = hasGo || strings.HasSuffix(e.Name(), ".go")
			}
		}
		inTestdata := slices.Contains(strings.Split(rel, "/"), "testdata")
		inPkg := slices.ContainsFunc(pkgs, func(pkg string) bool { return strings.HasPrefix(rel, pkg+"/") })
		switch {
		case hasGo && !inTestdata:
			dirs = append(dirs, rel)
			pkgs = append(pkgs, rel)
		case hasFile && !inPkg && strings.Count(rel, "/") <= 1:
			dirs = append(dirs, rel)
		}
		return nil
	})
	return dirs, err
}

// layoutEntries are the paths in the code block under the README's "## Layout": the first word of
// each line, without a trailing slash.
func layoutEntries(readme string) ([]string, bool) {
	_, after, ok := strings.Cut(readme, "\n## Layout\n")
	if !ok {
		return nil, false
	}
	_, block, ok := strings.Cut(after, "```\n")
	if !ok {
		return nil, false
	}
	block, _, ok = strings.Cut(block, "```")
	if !ok {
		return nil, false
	}
	var entries []string
	for _, l := range strings.Split(block, "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			entries = append(entries, strings.TrimSuffix(f[0], "/"))
		}
	}
	return entries, true
}

// layoutProblems compares the README's Layout with dirs.
func layoutProblems(readme string, dirs []string) []string {
	entries, ok := layoutEntries(readme)
	if !ok {
		return []string{"README has no Layout code block under \"## Layout\""}
	}
	var problems []string
	seen := map[string]bool{}
	for _, e := range entries {
		if seen[e] {
			problems = append(problems, fmt.Sprintf("README's Layout lists %s twice", e))
		}
		seen[e] = true
		if !slices.Contains(dirs, e) {
			problems = append(problems, fmt.Sprintf("README's Layout lists %s, which is not a package or directory of the repository", e))
		}
	}
	for _, d := range dirs {
		if !seen[d] {
			problems = append(problems, fmt.Sprintf("README's Layout lacks %s/", d))
		}
	}
	return problems
}

// markdownFiles reads every .md file of the repository (hidden directories and bin/ aside), keyed
// by its slash path from root.
func markdownFiles(root string) (map[string]string, error) {
	docs := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			if p != root && (strings.HasPrefix(d.Name(), ".") || rel == "bin") {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(d.Name(), ".md") {
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			docs[rel] = string(data)
		}
		return nil
	})
	return docs, err
}

var (
	mdLink   = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	upPath   = regexp.MustCompile("`(\\.\\./[^`\\s]*)`")
	mdHeader = regexp.MustCompile(`(?m)^#{1,6} (.+)$`)
	notSlug  = regexp.MustCompile(`[^\p{L}\p{N} _-]`)
)

// slug is the anchor GitHub gives a heading.
func slug(heading string) string {
	return strings.ReplaceAll(notSlug.ReplaceAllString(strings.ToLower(strings.TrimSpace(heading)), ""), " ", "-")
}

// linkProblems checks every markdown file's relative links: the target stays inside the
// repository and exists, and a #fragment into a markdown file names one of its headings. A path
// in code marks that starts with ../ must stay inside the repository too.
func linkProblems(docs map[string]string) []string {
	var problems []string
	inside := func(from, target string) (string, bool) {
		p := filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(from), target)))
		return p, p != ".." && !strings.HasPrefix(p, "../")
	}
	for _, name := range slices.Sorted(maps.Keys(docs)) {
		text := docs[name]
		for _, m := range upPath.FindAllStringSubmatch(text, -1) {
			if _, ok := inside(name, m[1]); !ok {
				problems = append(problems, fmt.Sprintf("%s names %s, outside the repository", name, m[1]))
			}
		}
		for _, m := range mdLink.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, frag, _ := strings.Cut(target, "#")
			path := name
			if file != "" {
				p, ok := inside(name, file)
				if !ok {
					problems = append(problems, fmt.Sprintf("%s links to %s, outside the repository", name, target))
					continue
				}
				if _, err := os.Stat(filepath.Join(repoRoot, filepath.FromSlash(p))); err != nil {
					problems = append(problems, fmt.Sprintf("%s links to %s, which does not exist", name, target))
					continue
				}
				path = p
			}
			if frag == "" || !strings.HasSuffix(path, ".md") {
				continue
			}
			var anchors []string
			for _, h := range mdHeader.FindAllStringSubmatch(docs[path], -1) {
				anchors = append(anchors, slug(h[1]))
			}
			if !slices.Contains(anchors, frag) {
				problems = append(problems, fmt.Sprintf("%s links to %s, but %s has no heading #%s", name, target, path, frag))
			}
		}
	}
	return problems
}

// readmeLinkProblems checks the links of readme in place of README.md, the other files as they are.
func readmeLinkProblems(readme string) []string {
	docs, err := markdownFiles(repoRoot)
	if err != nil {
		return []string{err.Error()}
	}
	docs["README.md"] = readme
	return linkProblems(docs)
}

// modulePath is the main module's import path.
const modulePath = "github.com/driver-agent/driver-agent/"

// moduleImports maps each package under cmd/ and pkg/ (by its ARCHITECTURE.md name: the path
// without pkg/) to the packages of the module its non-test files import, by the same names.
func moduleImports(root string, dirs []string) (map[string][]string, error) {
	out := map[string][]string{}
	for _, d := range dirs {
		if !strings.HasPrefix(d, "cmd/") && !strings.HasPrefix(d, "pkg/") {
			continue
		}
		p, err := gobuild.ImportDir(filepath.Join(root, filepath.FromSlash(d)), 0)
		var noGo *gobuild.NoGoError
		if errors.As(err, &noGo) {
			continue // test files only
		}
		if err != nil {
			return nil, err
		}
		var imps []string
		for _, imp := range p.Imports {
			if rest, ok := strings.CutPrefix(imp, modulePath); ok {
				imps = append(imps, archName(rest))
			}
		}
		out[archName(d)] = imps
	}
	return out, nil
}

func archName(dir string) string { return strings.TrimPrefix(dir, "pkg/") }

// testHelper reports whether a package exists for tests only (hosttest, buildtest, ...).
func testHelper(name string) bool { return strings.HasSuffix(path.Base(name), "test") }

const archHeader = "| package | imports |"

// architectureLayers reads the drawing under "## Packages and their layers": each box (the "|"
// lines between two "+" lines) is one layer, the top first.
func architectureLayers(doc string) ([][]string, bool) {
	_, after, ok := strings.Cut(doc, "\n## Packages and their layers\n")
	if !ok {
		return nil, false
	}
	_, block, ok := strings.Cut(after, "```\n")
	if !ok {
		return nil, false
	}
	block, _, ok = strings.Cut(block, "```")
	if !ok {
		return nil, false
	}
	var layers [][]string
	var cur []string
	for _, l := range strings.Split(block, "\n") {
		switch {
		case strings.HasPrefix(l, "+"):
			if cur != nil {
				layers = append(layers, cur)
			}
			cur = nil
		case strings.HasPrefix(l, "|"):
			cur = append(cur, strings.Fields(strings.ReplaceAll(l, "|", " "))...)
			if cur == nil {
				cur = []string{}
			}
		}
	}
	return layers, len(layers) > 0
}

// architectureProblems compares docs/ARCHITECTURE.md with imports: every package but the test
// helpers is drawn once, each imports only packages in lower boxes, the import table lists
// exactly each package's imports, and no package imports a test helper.
func architectureProblems(doc string, imports map[string][]string) []string {
	var problems []string
	layers, ok := architectureLayers(doc)
	if !ok {
		return []string{"docs/ARCHITECTURE.md has no layer drawing under \"## Packages and their layers\""}
	}
	layerOf := map[string]int{}
	for i, layer := range layers {
		for _, p := range layer {
			if _, known := imports[p]; !known {
				problems = append(problems, fmt.Sprintf("docs/ARCHITECTURE.md draws %s, which is not a package under cmd/ or pkg/", p))
			}
			if _, twice := layerOf[p]; twice {
				problems = append(problems, fmt.Sprintf("docs/ARCHITECTURE.md draws %s twice", p))
			}
			layerOf[p] = i
		}
	}
	for _, p := range slices.Sorted(maps.Keys(imports)) {
		for _, imp := range imports[p] {
			if testHelper(imp) {
				problems = append(problems, fmt.Sprintf("%s imports the test helper %s outside its tests", p, imp))
			}
		}
		if testHelper(p) {
			continue
		}
		l, drawn := layerOf[p]
		if !drawn {
			problems = append(problems, fmt.Sprintf("docs/ARCHITECTURE.md's drawing lacks %s", p))
			continue
		}
		for _, imp := range imports[p] {
			if li, ok := layerOf[imp]; ok && li <= l {
				problems = append(problems, fmt.Sprintf("docs/ARCHITECTURE.md draws %s at or above %s, which imports it", imp, p))
			}
		}
	}
	var want [][]string
	var leaves []string
	for _, p := range slices.Sorted(maps.Keys(imports)) {
		if testHelper(p) {
			continue
		}
		if len(imports[p]) == 0 {
			leaves = append(leaves, p)
			continue
		}
		want = append(want, []string{p, strings.Join(slices.Sorted(slices.Values(imports[p])), " ")})
	}
	want = append(want, []string{strings.Join(leaves, ", "), "—"})
	// The table's order is the drawing's, top first; compare it as a set.
	rows, ok := table(doc, archHeader)
	if !ok {
		return append(problems, fmt.Sprintf("docs/ARCHITECTURE.md has no table with the header %q", archHeader))
	}
	got := map[string]string{}
	for _, r := range rows {
		if len(r.cells) != 2 {
			problems = append(problems, fmt.Sprintf("docs/ARCHITECTURE.md's import row %q has %d cells, want 2", r.line, len(r.cells)))
			continue
		}
		if _, twice := got[r.cells[0]]; twice {
			problems = append(problems, fmt.Sprintf("docs/ARCHITECTURE.md's import table has %s twice", r.cells[0]))
		}
		got[r.cells[0]] = r.cells[1]
	}
	for _, w := range want {
		g, ok := got[w[0]]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("docs/ARCHITECTURE.md's import table lacks the row %s | %s", w[0], w[1]))
		case g != w[1]:
			problems = append(problems, fmt.Sprintf("docs/ARCHITECTURE.md says %s imports %q; it imports %q", w[0], g, w[1]))
		}
		delete(got, w[0])
	}
	for p := range got {
		problems = append(problems, fmt.Sprintf("docs/ARCHITECTURE.md's import table has a row for %s, which imports nothing of the module or is no package", p))
	}
	return problems
}
