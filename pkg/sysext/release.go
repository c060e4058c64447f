// Package sysext makes and recognises systemd system extensions (systemd-sysext) of the NVIDIA
// driver for Flatcar: a squashfs image that, merged over the host's /usr, adds the kernel modules
// built for one Flatcar release, the driver's userspace and a unit that loads them; and the check
// systemd-sysext makes of an extension's extension-release against the host's os-release.
package sysext

import (
	"bytes"
	"errors"
	"fmt"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/osrelease"
)

// ErrRefused means systemd-sysext would refuse to merge the extension on this host.
var ErrRefused = errors.New("the system extension does not fit the host")

// ReleaseDir is where an extension keeps its extension-release file, relative to its root.
const ReleaseDir = "usr/lib/extension-release.d"

// Release is an extension-release file: the OS, release and architecture an extension is for.
type Release struct {
	ID, VersionID, SysextLevel, Architecture string
}

// ParseRelease parses an extension-release file (os-release syntax).
func ParseRelease(data []byte) (Release, error) {
	vars, err := osrelease.Parse(bytes.NewReader(data))
	if err != nil {
		return Release{}, fmt.Errorf("extension-release: %w", err)
	}
	return Release{ID: vars["ID"], VersionID: vars["VERSION_ID"], SysextLevel: vars["SYSEXT_LEVEL"], Architecture: vars["ARCHITECTURE"]}, nil
}

// Format writes r in os-release syntax, the empty fields left out. The values are plain words
// (validated by the caller), so they need no quotes.
func (r Release) Format() []byte {
	var b bytes.Buffer
	for _, kv := range [][2]string{{"ID", r.ID}, {"VERSION_ID", r.VersionID}, {"SYSEXT_LEVEL", r.SysextLevel}, {"ARCHITECTURE", r.Architecture}} {
		if kv[1] != "" {
			fmt.Fprintf(&b, "%s=%s\n", kv[0], kv[1])
		}
	}
	return b.Bytes()
}

// Host is what systemd-sysext compares an extension-release with: the host's os-release ID,
// VERSION_ID and SYSEXT_LEVEL, and its architecture in systemd's names (Architecture).
type Host struct {
	ID, VersionID, SysextLevel, Architecture string
}

// Check is systemd-sysext's test of an extension (named name) against the host: ARCHITECTURE, when
// set and not _any, must be the host's; ID must be the host's (or _any); then, unless the host
// names neither VERSION_ID nor SYSEXT_LEVEL, an extension with a SYSEXT_LEVEL needs the host's
// SYSEXT_LEVEL, and one without needs the host's VERSION_ID. A refusal wraps ErrRefused and says
// what the extension is for and what the host is.
func Check(name string, ext Release, h Host) error {
	refuse := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrRefused, name, fmt.Sprintf(format, a...))
	}
	if ext.Architecture != "" && ext.Architecture != "_any" && ext.Architecture != h.Architecture {
		return refuse("it is for architecture %s, the host is %s", ext.Architecture, orUnknown(h.Architecture))
	}
	switch {
	case ext.ID == "":
		return refuse("its extension-release sets no ID")
	case ext.ID == "_any":
		return nil
	case ext.ID != h.ID:
		return refuse("it is for OS %s, the host is %s", ext.ID, orUnknown(h.ID))
	case h.VersionID == "" && h.SysextLevel == "":
		return nil // a rolling release
	case ext.SysextLevel != "" && h.SysextLevel != "":
		if ext.SysextLevel != h.SysextLevel {
			return refuse("it is for SYSEXT_LEVEL %s, the host has %s", ext.SysextLevel, h.SysextLevel)
		}
		return nil
	case h.VersionID == "":
		return refuse("it sets no SYSEXT_LEVEL matching the host's %s", h.SysextLevel)
	case ext.VersionID == "":
		return refuse("its extension-release sets neither SYSEXT_LEVEL nor VERSION_ID")
	case ext.VersionID != h.VersionID:
		return refuse("it is for %s %s, the host runs %s %s; use the extension built for %s", ext.ID, ext.VersionID, h.ID, h.VersionID, h.VersionID)
	}
	return nil
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

// Architecture returns systemd's name (x86-64, arm64) of a Flatcar board (amd64-usr, arm64-usr)
// or a Go GOARCH (amd64, arm64).
func Architecture(boardOrGOARCH string) (string, error) {
	switch strings.TrimSuffix(boardOrGOARCH, "-usr") {
	case "amd64":
		return "x86-64", nil
	case "arm64":
		return "arm64", nil
	}
	return "", fmt.Errorf("no systemd architecture for %q: want amd64-usr or arm64-usr", boardOrGOARCH)
}

// namePrefix starts the name of every extension this package makes.
const namePrefix = "nvidia-driver-"

// Name is the extension's name for a driver version and Flatcar release:
// nvidia-driver-<driver>-flatcar<version>; the image is Name + ".raw".
func Name(driverVersion, flatcarVersion string) string {
	return namePrefix + driverVersion + "-flatcar" + flatcarVersion
}

// ParseName returns the driver version and Flatcar release of a name made by Name: the groups of
// ^nvidia-driver-([0-9]+(?:\.[0-9]+)+)-flatcar([0-9]+\.[0-9]+\.[0-9]+)$.
func ParseName(name string) (driverVersion, flatcarVersion string, ok bool) {
	rest, ok := strings.CutPrefix(name, namePrefix)
	// The driver version has no '-', so the first "-flatcar" ends it.
	driverVersion, flatcarVersion, found := strings.Cut(rest, "-flatcar")
	if !ok || !found || numbers(driverVersion) < 2 || numbers(flatcarVersion) != 3 {
		return "", "", false
	}
	return driverVersion, flatcarVersion, true
}

// numbers returns how many numbers s has if it matches ^[0-9]+(\.[0-9]+)*$, and 0 otherwise.
func numbers(s string) int {
	n := 0
	for f := range strings.SplitSeq(s, ".") {
		if f == "" || strings.Trim(f, "0123456789") != "" {
			return 0
		}
		n++
	}
	return n
}
