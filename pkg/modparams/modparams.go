// Package modparams handles kernel module parameters: the operator's
// /drivers/<module>.conf files, --module-param flags, and modprobe.d output.
//
// The accepted syntax is a strict subset of what the kernel's parse_args
// accepts, so that every parameter this package lets through reaches the
// module exactly as written:
//
//	name             a bare name (a flag; only bool parameters accept it)
//	name=value       value without spaces, quotes or control characters
//	name="a value"   a double-quoted value, which may hold spaces
//
// Names are compared the way the kernel compares them: '-' and '_' are the
// same character. Module names are compared the same way.
package modparams

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Errors that describe what is wrong with a parameter. They are wrapped by
// ParseError and by the errors of ParseParam, Set.Add and Flag.Set, so
// errors.Is can test for them.
var (
	// ErrControlChar reports a control character (other than a tab between
	// parameters) or a NUL byte.
	ErrControlChar = errors.New("control character")
	// ErrInvalidUTF8 reports bytes that are not valid UTF-8.
	ErrInvalidUTF8 = errors.New("invalid UTF-8")
	// ErrInvalidName reports a parameter name that does not match
	// ^[A-Za-z0-9_][A-Za-z0-9_.-]*$.
	ErrInvalidName = errors.New("invalid parameter name")
	// ErrQuote reports a double quote that does not enclose a whole value,
	// or a quote that is never closed.
	ErrQuote = errors.New("misplaced double quote")
	// ErrInvalidModule reports a module name that is not made of letters,
	// digits, '_' and '-'.
	ErrInvalidModule = errors.New("invalid module name")
	// ErrTooLong reports a parameter file larger than MaxConfSize.
	ErrTooLong = errors.New("too long")
)

// moduleBytes are the bytes of a module name, [A-Za-z0-9_-].
const moduleBytes = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"

// isName reports whether s, a parameter name, matches ^[A-Za-z0-9_][A-Za-z0-9_.-]*$.
func isName(s string) bool {
	return s != "" && s[0] != '.' && s[0] != '-' && strings.Trim(s, moduleBytes+".") == ""
}

// isModule reports whether s, a module name, matches ^[A-Za-z0-9_-]+$.
func isModule(s string) bool { return s != "" && strings.Trim(s, moduleBytes) == "" }

// Param is one module parameter.
type Param struct {
	// Name is the parameter name, as written.
	Name string
	// Value is the value without surrounding quotes; empty for a flag.
	Value string
	// Flag is true for a bare name without "=", which the kernel passes to
	// the parameter's setter with no value (a bool parameter then becomes
	// true). "name=" is not a flag: it has an empty value.
	Flag bool
}

// String renders p as the kernel parses it: "name", "name=value", or
// name="value" when the value contains a space or a tab.
func (p Param) String() string {
	if p.Flag {
		return p.Name
	}
	if strings.ContainsAny(p.Value, " \t") {
		return p.Name + `="` + p.Value + `"`
	}
	return p.Name + "=" + p.Value
}

// Validate checks the name and the value of p: the name must match
// ^[A-Za-z0-9_][A-Za-z0-9_.-]*$; the value must be valid UTF-8 without
// control characters or double quotes; a flag must have an empty value.
func (p Param) Validate() error {
	if err := checkText(p.Name); err != nil {
		return fmt.Errorf("%w in name", err)
	}
	if !isName(p.Name) {
		return fmt.Errorf("%w %q (want letters, digits, '_', '.' and '-', not starting with '.' or '-')", ErrInvalidName, p.Name)
	}
	if p.Flag && p.Value != "" {
		return fmt.Errorf("flag %q has a value", p.Name)
	}
	if err := checkText(p.Value); err != nil {
		return fmt.Errorf("%w in value", err)
	}
	if strings.Contains(p.Value, `"`) {
		return fmt.Errorf("%w in value (a value cannot contain '\"')", ErrQuote)
	}
	return nil
}

// checkText reports invalid UTF-8 and control characters (C0, DEL and C1,
// tab included) in s.
func checkText(s string) error {
	for i, r := range s {
		if r == utf8.RuneError {
			if _, size := utf8.DecodeRuneInString(s[i:]); size <= 1 {
				return ErrInvalidUTF8
			}
		}
		if unicode.IsControl(r) {
			return ErrControlChar
		}
	}
	return nil
}

// ParseParam parses one parameter: "name", "name=value" or name="value".
// The value of the unquoted form may not contain spaces; the quoted form
// may.
func ParseParam(s string) (Param, error) {
	name, value, hasValue := strings.Cut(s, "=")
	if !hasValue {
		p := Param{Name: name, Flag: true}
		if strings.Contains(name, `"`) {
			return Param{}, fmt.Errorf("%w in name", ErrQuote)
		}
		if err := p.Validate(); err != nil {
			return Param{}, err
		}
		return p, nil
	}
	if err := checkText(name); err != nil {
		return Param{}, fmt.Errorf("%w in name", err)
	}
	if strings.Contains(name, `"`) {
		return Param{}, fmt.Errorf("%w in name", ErrQuote)
	}
	quoted := strings.HasPrefix(value, `"`)
	if quoted {
		inner, ok := strings.CutSuffix(value[1:], `"`)
		if !ok {
			return Param{}, fmt.Errorf("%w: value starts with '\"' but does not end with one", ErrQuote)
		}
		value = inner
	}
	p := Param{Name: name, Value: value}
	if err := p.Validate(); err != nil {
		return Param{}, err
	}
	if !quoted && strings.Contains(value, " ") {
		return Param{}, fmt.Errorf("space in unquoted value (quote the value: %s=\"...\")", name)
	}
	return p, nil
}

// SameName reports whether two parameter (or module) names are the same for
// the kernel, which treats '-' and '_' as equal.
func SameName(a, b string) bool {
	return canon(a) == canon(b)
}

// canon returns name with every '-' replaced by '_'.
func canon(name string) string {
	return strings.ReplaceAll(name, "-", "_")
}

// Params is an ordered list of parameters for one module.
type Params []Param

// String renders the list as the parameter string given to finit_module or
// init_module: the parameters separated by single spaces, values with spaces
// quoted.
func (ps Params) String() string {
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = p.String()
	}
	return strings.Join(parts, " ")
}

// Has reports whether the list sets the parameter name (in any of its '-'
// or '_' spellings), flag or not.
func (ps Params) Has(name string) bool {
	_, ok := ps.Lookup(name)
	return ok
}

// Lookup returns the last parameter of the list with the given name (in any
// of its '-' or '_' spellings); the kernel applies parameters in order, so
// the last one is the one in effect.
func (ps Params) Lookup(name string) (Param, bool) {
	for i := len(ps) - 1; i >= 0; i-- {
		if SameName(ps[i].Name, name) {
			return ps[i], true
		}
	}
	return Param{}, false
}

// Is reports whether the list sets the parameter name to exactly value, for
// example Is("NVreg_EnableGpuFirmware", "0"). A flag never matches.
func (ps Params) Is(name, value string) bool {
	p, ok := ps.Lookup(name)
	return ok && !p.Flag && p.Value == value
}

// ModprobeConf returns the content of /etc/modprobe.d/<module>.conf that
// gives module the parameters ps: "options <module> <params>\n". It returns
// nil when ps is empty, since such a file would set nothing.
func ModprobeConf(module string, ps Params) []byte {
	if len(ps) == 0 {
		return nil
	}
	return []byte("options " + module + " " + ps.String() + "\n")
}
