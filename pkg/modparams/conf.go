package modparams

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// MaxConfSize is the largest parameter file ParseConf and LoadDir accept:
// 1 MiB, the size limit of a Kubernetes ConfigMap.
const MaxConfSize = 1 << 20

// ParseError describes an invalid line of a parameter file.
type ParseError struct {
	// File is the file name given to ParseConf; may be empty.
	File string
	// Line is the 1-based line number.
	Line int
	// What is "parameter" when Text is one parameter, or "comment" when it
	// is a comment.
	What string
	// Text is the offending parameter or comment, as written.
	Text string
	// Err is what is wrong, one of the package's Err values, possibly
	// wrapped with more detail.
	Err error
}

// Error renders the error as `file:line: parameter "text": problem`.
func (e *ParseError) Error() string {
	where := fmt.Sprintf("line %d", e.Line)
	if e.File != "" {
		where = fmt.Sprintf("%s:%d", e.File, e.Line)
	}
	return fmt.Sprintf("%s: %s %q: %v", where, e.What, e.Text, e.Err)
}

// Unwrap returns the underlying error.
func (e *ParseError) Unwrap() error { return e.Err }

// ParseConf parses a parameter file such as /drivers/nvidia.conf; file names
// it in errors. Each line holds zero or more parameters separated by spaces
// or tabs (see the package comment for their syntax). Blank lines are
// ignored, and so is everything from a '#' at the start of a line or after
// a space or tab, outside double quotes. A final "\r" on a line is dropped.
//
// A parameter set more than once keeps the position of its first occurrence
// and the value of its last, so the result never names a parameter twice.
//
// Every invalid line is reported, as *ParseError values joined with
// errors.Join; the parameters are then nil.
func ParseConf(r io.Reader, file string) (Params, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxConfSize+1))
	if err != nil {
		return nil, fmt.Errorf("%s: read: %w", displayName(file), err)
	}
	if len(data) > MaxConfSize {
		return nil, fmt.Errorf("%s: file %w (more than %d bytes)", displayName(file), ErrTooLong, MaxConfSize)
	}
	var ps Params
	var errs []error
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSuffix(line, "\r")
		tokens, comment, bad := splitLine(line)
		perr := func(what, text string, err error) {
			errs = append(errs, &ParseError{File: file, Line: i + 1, What: what, Text: text, Err: err})
		}
		for _, tok := range tokens {
			p, err := ParseParam(tok)
			if err != nil {
				perr("parameter", tok, err)
				continue
			}
			ps = merge(ps, p)
		}
		if bad != "" {
			perr("parameter", bad, fmt.Errorf("%w: unterminated quoted value", ErrQuote))
		}
		if err := checkText(comment); err != nil {
			perr("comment", comment, fmt.Errorf("%w in comment", err))
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return ps, nil
}

// displayName is file, or a placeholder when it is empty.
func displayName(file string) string {
	if file == "" {
		return "<input>"
	}
	return file
}

// splitLine splits a line into parameter tokens at spaces and tabs outside
// double quotes, and returns the comment (from '#', without it) separately.
// A last token whose quote is never closed is returned as unterminated
// instead of in tokens.
func splitLine(line string) (tokens []string, comment, unterminated string) {
	i := 0
	for i < len(line) {
		c := line[i]
		if c == ' ' || c == '\t' {
			i++
			continue
		}
		if c == '#' {
			return tokens, line[i+1:], ""
		}
		start, inQuote := i, false
		for ; i < len(line); i++ {
			c := line[i]
			if c == '"' {
				inQuote = !inQuote
			} else if !inQuote && (c == ' ' || c == '\t') {
				break
			}
		}
		if inQuote {
			return tokens, "", line[start:]
		}
		tokens = append(tokens, line[start:i])
	}
	return tokens, "", ""
}

// merge adds p to ps, replacing the value of a parameter with the same name
// in place, and returns the result.
func merge(ps Params, p Param) Params {
	for i := range ps {
		if SameName(ps[i].Name, p.Name) {
			ps[i] = p
			return ps
		}
	}
	return append(ps, p)
}

// LoadDir reads <dir>/<module>.conf for each module, for example
// LoadDir("/drivers", []string{"nvidia", "nvidia-uvm", "nvidia-modeset",
// "nvidia-peermem"}). A missing file means the module has no parameters; an
// unreadable or invalid one is an error. All errors are reported, joined;
// the Set is then nil.
func LoadDir(dir string, modules []string) (*Set, error) {
	set := &Set{}
	var errs []error
	for _, m := range modules {
		if !isModule(m) {
			errs = append(errs, fmt.Errorf("module %q: %w", m, ErrInvalidModule))
			continue
		}
		ps, err := loadFile(filepath.Join(dir, m+".conf"))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := set.Add(m, ps...); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return set, nil
}

// loadFile parses one parameter file; a missing file gives no parameters.
func loadFile(path string) (Params, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read module parameters: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("read module parameters: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("read module parameters: %s: not a regular file (%s)", path, st.Mode().Type())
	}
	return ParseConf(f, path)
}
