package modparams

import (
	"fmt"
	"strings"
)

// Set holds ordered parameters for several modules. Module names are
// compared with '-' and '_' equal, as the kernel does; each module keeps the
// spelling it was first added with. Adding a parameter that a module already
// has replaces its value in place, so a module never has the same parameter
// twice and later sources override earlier ones.
//
// The zero value is an empty Set ready to use.
type Set struct {
	mods []*moduleParams
}

// moduleParams is the entry of one module in a Set.
type moduleParams struct {
	name   string
	params Params
}

// find returns the entry of module, or nil.
func (s *Set) find(module string) *moduleParams {
	for _, m := range s.mods {
		if SameName(m.name, module) {
			return m
		}
	}
	return nil
}

// Add validates module and ps and merges ps into the module's parameters,
// in order. It adds nothing if any of them is invalid.
func (s *Set) Add(module string, ps ...Param) error {
	if !isModule(module) {
		return fmt.Errorf("module %q: %w", module, ErrInvalidModule)
	}
	for _, p := range ps {
		if err := p.Validate(); err != nil {
			return fmt.Errorf("module %s: parameter %q: %w", module, p.String(), err)
		}
	}
	if len(ps) == 0 {
		return nil
	}
	m := s.find(module)
	if m == nil {
		m = &moduleParams{name: module}
		s.mods = append(s.mods, m)
	}
	for _, p := range ps {
		m.params = merge(m.params, p)
	}
	return nil
}

// Merge adds every parameter of other into s; other's values win.
func (s *Set) Merge(other *Set) {
	if other == nil {
		return
	}
	for _, m := range other.mods {
		// other's content was validated when it was added.
		_ = s.Add(m.name, m.params...)
	}
}

// AddDefaults gives each module of defaults the default parameters it does
// not already have, placed before the module's own parameters. A parameter
// the module already sets, with any value, is left alone.
func (s *Set) AddDefaults(defaults *Set) {
	if defaults == nil {
		return
	}
	for _, d := range defaults.mods {
		var missing Params
		m := s.find(d.name)
		for _, p := range d.params {
			if m == nil || !m.params.Has(p.Name) {
				missing = append(missing, p)
			}
		}
		if len(missing) == 0 {
			continue
		}
		if m == nil {
			s.mods = append(s.mods, &moduleParams{name: d.name, params: missing})
			continue
		}
		m.params = append(missing, m.params...)
	}
}

// Params returns a copy of the parameters of module, nil when it has none.
func (s *Set) Params(module string) Params {
	if s == nil {
		return nil
	}
	m := s.find(module)
	if m == nil {
		return nil
	}
	return append(Params(nil), m.params...)
}

// Modules returns the modules that have parameters, in the order they were
// first added, each with the spelling it was first added with.
func (s *Set) Modules() []string {
	if s == nil {
		return nil
	}
	names := make([]string, 0, len(s.mods))
	for _, m := range s.mods {
		names = append(names, m.name)
	}
	return names
}

// String renders the set as "module.param" items separated by spaces, the
// form --module-param takes; values with spaces are quoted.
func (s *Set) String() string {
	if s == nil {
		return ""
	}
	var items []string
	for _, m := range s.mods {
		for _, p := range m.params {
			items = append(items, m.name+"."+p.String())
		}
	}
	return strings.Join(items, " ")
}

// Defaults returns the parameters the agent sets unless the operator set
// them: NVreg_CoherentGPUMemoryMode=driver for module nvidia from driver
// branch 580 on (coherent driver-managed memory, CDMM). Apply them with
// Set.AddDefaults.
func Defaults(branch int) *Set {
	s := &Set{}
	if branch >= 580 {
		s.mods = append(s.mods, &moduleParams{
			name:   "nvidia",
			params: Params{{Name: "NVreg_CoherentGPUMemoryMode", Value: "driver"}},
		})
	}
	return s
}

// Flag is a flag.Value for the repeatable --module-param flag, whose value
// is module.name=value (or module.name for a flag parameter). The module is
// everything before the first '.'. The parameters collect in Params, later
// flags overriding earlier ones.
type Flag struct {
	// Params holds the parameters given so far.
	Params Set
}

// String renders the parameters given so far, as Set.String does.
func (f *Flag) String() string {
	if f == nil {
		return ""
	}
	return f.Params.String()
}

// Set parses and adds one module.name=value parameter.
func (f *Flag) Set(v string) error {
	module, param, ok := strings.Cut(v, ".")
	if !ok || module == "" || param == "" {
		return fmt.Errorf("module parameter %q: want module.name=value", v)
	}
	if !isModule(module) {
		return fmt.Errorf("module parameter %q: %w %q", v, ErrInvalidModule, module)
	}
	p, err := ParseParam(param)
	if err != nil {
		return fmt.Errorf("module parameter %q: %w", v, err)
	}
	return f.Params.Add(module, p)
}
