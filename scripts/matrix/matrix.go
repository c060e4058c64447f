package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Data is the committed list of what gets built (images/releases.json).
type Data struct {
	// Platforms every image is built for, e.g. linux/amd64.
	Platforms []string `json:"platforms"`
	// Drivers are the NVIDIA driver versions, one build image each.
	Drivers []Driver `json:"drivers"`
	// Flatcar lists the supported Flatcar releases (VERSION_ID) per channel: alpha, beta,
	// stable, lts.
	Flatcar map[string][]string `json:"flatcar"`
	// Talos lists Talos releases whose NVIDIA system extension ships one of Drivers; each gets
	// the build image under the tag the operator resolves there (host-managed modules).
	Talos []Talos `json:"talos,omitempty"`
}

// Driver is one NVIDIA driver version.
type Driver struct {
	Version string `json:"version"`
	// Precompiled: build an image with kernel-interface packages for every Flatcar release.
	// Otherwise each release's tag is an alias of the build image (which compiles on the node).
	Precompiled bool `json:"precompiled"`
	// RunSHA256 is the sha256 of NVIDIA-Linux-<arch>-<version>.run per architecture (amd64,
	// arm64), passed to Dockerfile.build; optional.
	RunSHA256 map[string]string `json:"runSHA256,omitempty"`
}

// Talos is a Talos release and the driver version its NVIDIA extension ships.
type Talos struct {
	Version string `json:"version"` // VERSION_ID, e.g. v1.12.0
	Driver  string `json:"driver"`
}

// Channels in the order they are listed.
var channels = []string{"alpha", "beta", "stable", "lts"}

var (
	driverRe  = regexp.MustCompile(`^([0-9]{3})\.[0-9]+(\.[0-9]+)?$`)
	flatcarRe = regexp.MustCompile(`^[0-9]+\.([0-9])\.[0-9]+$`)
	talosRe   = regexp.MustCompile(`^v[0-9]+\.[0-9]+\.[0-9]+$`)
	sha256Re  = regexp.MustCompile(`^[0-9a-f]{64}$`)
	// prefixRe: what may precede a tag: edge (builds of main) or a release of the agent.
	prefixRe = regexp.MustCompile(`^(edge|v[0-9]+\.[0-9]+\.[0-9]+(-rc\.[0-9]+)?)$`)
	// tagRe is the registry's grammar for a tag.
	tagRe = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)
	// schemeRe is the tag scheme: [prefix-]<driver>-flatcar[<VERSION_ID>] or
	// [prefix-]<driver>-talos<VERSION_ID>.
	schemeRe = regexp.MustCompile(`^(?:(edge|v[0-9]+\.[0-9]+\.[0-9]+(?:-rc\.[0-9]+)?)-)?([0-9]{3}\.[0-9]+(?:\.[0-9]+)?)-(?:flatcar([0-9]+\.[0-9]\.[0-9]+)?|talos(v[0-9]+\.[0-9]+\.[0-9]+))$`)
)

var platforms = []string{"linux/amd64", "linux/arm64"}

// channelOf is the channel a Flatcar version belongs to, from its minor number.
func channelOf(version string) (string, bool) {
	m := flatcarRe.FindStringSubmatch(version)
	if m == nil {
		return "", false
	}
	switch m[1] {
	case "0":
		return "alpha", true
	case "1":
		return "beta", true
	case "2":
		return "stable", true
	case "3":
		return "lts", true
	}
	return "", false
}

// Load reads and checks a data file; unknown fields are errors.
func Load(r io.Reader) (*Data, error) {
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	var d Data
	if err := dec.Decode(&d); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	if dec.More() {
		return nil, errors.New("decode: more than one JSON value")
	}
	if err := d.Check(); err != nil {
		return nil, err
	}
	return &d, nil
}

// Check reports every problem in d, one per line.
func (d *Data) Check() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if len(d.Platforms) == 0 {
		bad("platforms: empty; list linux/amd64 and/or linux/arm64")
	}
	for i, p := range d.Platforms {
		if !slices.Contains(platforms, p) {
			bad("platforms: %q is not supported; use linux/amd64 or linux/arm64", p)
		}
		if slices.Contains(d.Platforms[:i], p) {
			bad("platforms: %s listed twice", p)
		}
	}
	if len(d.Drivers) == 0 {
		bad("drivers: empty; list at least one driver version")
	}
	seen := map[string]bool{}
	for _, drv := range d.Drivers {
		m := driverRe.FindStringSubmatch(drv.Version)
		switch {
		case m == nil:
			bad("drivers: version %q is not an NVIDIA driver version like 580.159.04", drv.Version)
		case atoi(m[1]) < 515:
			bad("drivers: %s: branch %s has no open kernel modules; use 515 or newer", drv.Version, m[1])
		}
		if seen[drv.Version] {
			bad("drivers: %s listed twice", drv.Version)
		}
		seen[drv.Version] = true
		for arch, sum := range drv.RunSHA256 {
			if arch != "amd64" && arch != "arm64" {
				bad("drivers: %s: runSHA256 key %q is not amd64 or arm64", drv.Version, arch)
			}
			if !sha256Re.MatchString(sum) {
				bad("drivers: %s: runSHA256[%s] is not 64 lower-case hex digits", drv.Version, arch)
			}
		}
	}
	listed := map[string]string{}
	for ch, versions := range d.Flatcar {
		if !slices.Contains(channels, ch) {
			bad("flatcar: unknown channel %q; use alpha, beta, stable or lts", ch)
			continue
		}
		for _, v := range versions {
			got, ok := channelOf(v)
			switch {
			case !ok:
				bad("flatcar: %s: %q is not a Flatcar VERSION_ID like 4593.2.0", ch, v)
			case got != ch:
				bad("flatcar: %s is a %s release (minor %s), not %s", v, got, strings.Split(v, ".")[1], ch)
			}
			if prev, dup := listed[v]; dup {
				bad("flatcar: %s listed twice (%s and %s)", v, prev, ch)
			}
			listed[v] = ch
		}
	}
	if len(listed) == 0 {
		bad("flatcar: no releases; list at least one VERSION_ID under stable")
	}
	talos := map[string]bool{}
	for _, t := range d.Talos {
		if !talosRe.MatchString(t.Version) {
			bad("talos: %q is not a Talos VERSION_ID like v1.12.0", t.Version)
		}
		if !seen[t.Driver] {
			bad("talos: %s: driver %q is not in drivers", t.Version, t.Driver)
		}
		if talos[t.Version] {
			bad("talos: %s listed twice", t.Version)
		}
		talos[t.Version] = true
	}
	return errors.Join(errs...)
}

// Add merges releases given as channel=version pairs (comma-separated), e.g. the current
// release of each channel, skipping those already listed.
func (d *Data) Add(pairs string) error {
	if d.Flatcar == nil {
		d.Flatcar = map[string][]string{}
	}
	for p := range strings.SplitSeq(pairs, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		ch, v, ok := strings.Cut(p, "=")
		if !ok {
			return fmt.Errorf("add: %q is not channel=version", p)
		}
		if d.listed(v) {
			continue
		}
		d.Flatcar[ch] = append(d.Flatcar[ch], v)
	}
	return d.Check()
}

func (d *Data) listed(v string) bool {
	for _, vs := range d.Flatcar {
		if slices.Contains(vs, v) {
			return true
		}
	}
	return false
}

// Release is one Flatcar release.
type Release struct {
	Channel string
	Version string
}

// Releases in channel order, then as listed.
func (d *Data) Releases() []Release {
	var rs []Release
	for _, ch := range channels {
		for _, v := range d.Flatcar[ch] {
			rs = append(rs, Release{ch, v})
		}
	}
	return rs
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}
