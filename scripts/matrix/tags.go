package main

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// The tag scheme. The gpu-operator pulls <repository>/<image>:<driver.version>-<osTag>, where
// osTag is the node's os-release ID followed by its VERSION_ID (flatcar4593.2.0, talosv1.12.0).
// So, with driver.version set to a driver version:
//
//	<driver>-flatcar             the build image (compiles on the node); BASE of the precompiled ones
//	<driver>-flatcar<VERSION_ID> what a Flatcar node pulls: the precompiled image for that release,
//	                             or the build image under that name
//	<driver>-talos<VERSION_ID>   what a Talos node pulls: the build image (host-managed modules)
//
// Each tag also exists with a prefix: v<agent release>-<tag> (never moves; set driver.version to
// v<release>-<driver> to pin the agent too) and edge-<tag> (builds of main).

// Tag is a parsed image tag.
type Tag struct {
	Prefix    string // "", "edge" or an agent release such as v1.2.0
	Driver    string // NVIDIA driver version
	OS        string // flatcar or talos
	OSVersion string // VERSION_ID; empty for the build image's base tag
}

// String is the tag.
func (t Tag) String() string {
	s := t.Driver + "-" + t.OS + t.OSVersion
	if t.Prefix != "" {
		s = t.Prefix + "-" + s
	}
	return s
}

// DriverVersion is the value of the operator's driver.version that makes a node of t's OS
// release pull t.
func (t Tag) DriverVersion() string {
	if t.Prefix != "" {
		return t.Prefix + "-" + t.Driver
	}
	return t.Driver
}

// OperatorTag is the tag the gpu-operator resolves for driver.version on a node whose
// os-release has ID and VERSION_ID (its osTag is their concatenation).
func OperatorTag(driverVersion, id, versionID string) string {
	return driverVersion + "-" + id + versionID
}

// ParseTag checks tag against the scheme.
func ParseTag(tag string) (Tag, error) {
	if !tagRe.MatchString(tag) {
		return Tag{}, fmt.Errorf("%q is not a valid image tag ([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})", tag)
	}
	m := schemeRe.FindStringSubmatch(tag)
	if m == nil {
		return Tag{}, fmt.Errorf("%q does not follow [edge-|v<release>-]<driver>-flatcar[<VERSION_ID>] or [...]<driver>-talos<VERSION_ID>", tag)
	}
	t := Tag{Prefix: m[1], Driver: m[2], OS: "flatcar", OSVersion: m[3]}
	if m[4] != "" {
		t.OS, t.OSVersion = "talos", m[4]
	}
	if t.OS == "flatcar" && t.OSVersion != "" {
		if _, ok := channelOf(t.OSVersion); !ok {
			return Tag{}, fmt.Errorf("%q: %s is not a Flatcar release on a known channel", tag, t.OSVersion)
		}
	}
	if got := OperatorTag(t.DriverVersion(), t.OS, t.OSVersion); got != tag {
		return Tag{}, fmt.Errorf("%q: the operator would resolve %q for driver.version=%s", tag, got, t.DriverVersion())
	}
	return t, nil
}

// Naming says which tags a run pushes.
type Naming struct {
	// Image is the repository, e.g. ghcr.io/owner/driver.
	Image string
	// Prefix, when set, adds <Prefix>-<tag> for every tag.
	Prefix string
	// Plain includes the unprefixed tags (releases move them; builds of main do not).
	Plain bool
}

func (n Naming) check() error {
	if n.Image == "" {
		return errors.New("-image is empty: set the repository, e.g. ghcr.io/owner/driver")
	}
	if strings.Contains(n.Image, "@") || strings.ContainsAny(n.Image, " \t\n") {
		return fmt.Errorf("-image %q: give a repository without tag or digest", n.Image)
	}
	if last := n.Image[strings.LastIndex(n.Image, "/")+1:]; strings.Contains(last, ":") {
		return fmt.Errorf("-image %q: give a repository without tag", n.Image)
	}
	if n.Prefix != "" && !prefixRe.MatchString(n.Prefix) {
		return fmt.Errorf("-prefix %q: use edge or an agent release like v1.2.0", n.Prefix)
	}
	if !n.Plain && n.Prefix == "" {
		return errors.New("-plain=false needs -prefix: no tag would be pushed")
	}
	return nil
}

// refs are the full references for t: the plain and/or the prefixed tag.
func (n Naming) refs(t Tag) []string {
	var out []string
	if n.Plain {
		out = append(out, n.Image+":"+t.String())
	}
	if n.Prefix != "" {
		t.Prefix = n.Prefix
		out = append(out, n.Image+":"+t.String())
	}
	return out
}

// primary is the one reference other builds refer to: the prefixed tag when there is one (it
// is this run's), else the plain one.
func (n Naming) primary(t Tag) string {
	if n.Prefix != "" {
		t.Prefix = n.Prefix
	}
	return n.Image + ":" + t.String()
}

// checkRefs parses every tag of refs and rejects duplicates: two images under one tag.
func checkRefs(refs []string) error {
	var errs []error
	seen := map[string]bool{}
	for _, r := range refs {
		tag := r[strings.LastIndex(r, ":")+1:]
		if _, err := ParseTag(tag); err != nil {
			errs = append(errs, err)
		}
		if seen[r] {
			errs = append(errs, fmt.Errorf("%s would be pushed twice", r))
		}
		seen[r] = true
	}
	return errors.Join(errs...)
}

// Entry is one job of a GitHub Actions matrix.
type Entry map[string]string

// Matrix is what strategy.matrix takes: {"include": [...]}.
type Matrix struct {
	Include []Entry `json:"include"`
}

// BuildMatrix has one entry per driver: the build image.
func BuildMatrix(d *Data, n Naming) (Matrix, []string, error) {
	m := Matrix{Include: []Entry{}}
	var all []string
	for _, drv := range d.Drivers {
		t := Tag{Driver: drv.Version, OS: "flatcar"}
		refs := n.refs(t)
		all = append(all, refs...)
		m.Include = append(m.Include, Entry{
			"driver":       drv.Version,
			"platforms":    strings.Join(d.Platforms, ","),
			"tags":         strings.Join(refs, "\n"),
			"ref":          n.primary(t),
			"sha256_amd64": drv.RunSHA256["amd64"],
			"sha256_arm64": drv.RunSHA256["arm64"],
		})
	}
	return m, all, checkRefs(all)
}

// PrecompiledMatrix has one entry per precompiled driver and Flatcar release.
func PrecompiledMatrix(d *Data, n Naming) (Matrix, []string, error) {
	m := Matrix{Include: []Entry{}}
	var all []string
	for _, drv := range d.Drivers {
		if !drv.Precompiled {
			continue
		}
		base := n.primary(Tag{Driver: drv.Version, OS: "flatcar"})
		for _, r := range d.Releases() {
			t := Tag{Driver: drv.Version, OS: "flatcar", OSVersion: r.Version}
			refs := n.refs(t)
			all = append(all, refs...)
			m.Include = append(m.Include, Entry{
				"driver":    drv.Version,
				"flatcar":   r.Version,
				"channel":   r.Channel,
				"platforms": strings.Join(d.Platforms, ","),
				"base":      base,
				"tags":      strings.Join(refs, "\n"),
				"ref":       n.primary(t),
			})
		}
	}
	return m, all, checkRefs(all)
}

// AliasMatrix has one entry per tag that names the build image under a node's OS tag: Flatcar
// releases of drivers without precompiled images, and the Talos releases.
func AliasMatrix(d *Data, n Naming) (Matrix, []string, error) {
	m := Matrix{Include: []Entry{}}
	var all []string
	add := func(driver, os, version string) {
		t := Tag{Driver: driver, OS: os, OSVersion: version}
		refs := n.refs(t)
		all = append(all, refs...)
		m.Include = append(m.Include, Entry{
			"driver": driver,
			"os":     os + version,
			"source": n.primary(Tag{Driver: driver, OS: "flatcar"}),
			"tags":   strings.Join(refs, "\n"),
			"ref":    n.primary(t),
		})
	}
	for _, drv := range d.Drivers {
		if drv.Precompiled {
			continue
		}
		for _, r := range d.Releases() {
			add(drv.Version, "flatcar", r.Version)
		}
	}
	for _, t := range d.Talos {
		add(t.Driver, "talos", t.Version)
	}
	return m, all, checkRefs(all)
}

// AllRefs is every reference a run pushes, checked together (a precompiled tag and an alias
// must never share a name).
func AllRefs(d *Data, n Naming) ([]string, error) {
	var all []string
	for _, f := range []func(*Data, Naming) (Matrix, []string, error){BuildMatrix, PrecompiledMatrix, AliasMatrix} {
		_, refs, _ := f(d, n) // checked below, together
		all = append(all, refs...)
	}
	err := checkRefs(all)
	slices.Sort(all)
	return all, err
}

// SysextMatrix has one entry per driver and Flatcar release: the system extension
// `driver-agent sysext` makes in that driver's build image (base) for the release, on amd64
// (the extension's file name carries no architecture, so an arm64 one would collide with it in a
// release's assets), published as the release asset named asset.
func SysextMatrix(d *Data, n Naming) Matrix {
	m := Matrix{Include: []Entry{}}
	for _, drv := range d.Drivers {
		base := n.primary(Tag{Driver: drv.Version, OS: "flatcar"})
		for _, r := range d.Releases() {
			m.Include = append(m.Include, Entry{
				"driver":  drv.Version,
				"flatcar": r.Version,
				"channel": r.Channel,
				"base":    base,
				"asset":   "nvidia-driver-" + drv.Version + "-flatcar" + r.Version + ".raw",
			})
		}
	}
	return m
}
