package precompiled

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// SkipKind says why Scan passed over a file or directory.
type SkipKind int

// Reasons for skipping.
const (
	// SkipUnreadable: the file or directory could not be opened or read.
	SkipUnreadable SkipKind = iota + 1
	// SkipNotRegular: the entry is neither a regular file nor a directory.
	SkipNotRegular
	// SkipCorrupt: the file is not a well-formed package (or is too large).
	SkipCorrupt
	// SkipDriverVersion: the package is for another driver version.
	SkipDriverVersion
	// SkipBanner: the package was built for another kernel banner.
	SkipBanner
	// SkipOtherKernel: a <kver>/ sub-directory for another kernel release;
	// its packages are not read.
	SkipOtherKernel
	// SkipDuplicate: the package matches too, but an earlier one was chosen.
	SkipDuplicate
)

// String returns a short name for the kind.
func (k SkipKind) String() string {
	switch k {
	case SkipUnreadable:
		return "unreadable"
	case SkipNotRegular:
		return "not a regular file"
	case SkipCorrupt:
		return "corrupt"
	case SkipDriverVersion:
		return "other driver version"
	case SkipBanner:
		return "banner mismatch"
	case SkipOtherKernel:
		return "other kernel release"
	case SkipDuplicate:
		return "duplicate match"
	}
	return fmt.Sprintf("SkipKind(%d)", int(k))
}

// Skipped is a file or directory Scan looked at and did not choose.
type Skipped struct {
	// Path is the file or directory.
	Path string
	// Kind classifies the reason.
	Kind SkipKind
	// Reason is a one-line explanation, e.g. the parse error of a corrupt
	// package, "driver version 580.95.05, want 595.71.05", or the first line
	// of Explain for a banner mismatch.
	Reason string
	// Explain is Explain's full text for a banner mismatch; empty otherwise.
	Explain string
}

// ScanResult is what Scan found in a precompiled directory.
type ScanResult struct {
	// Path is the chosen package's file; empty when nothing matched.
	Path string
	// Package is the chosen package; nil when nothing matched.
	Package *Package
	// Skipped lists, in scan order, every other entry looked at and why it
	// was not chosen.
	Skipped []Skipped
}

// Found reports whether Scan chose a package.
func (r *ScanResult) Found() bool { return r.Package != nil }

// Scan looks for the package built for the running kernel in dir, the
// precompiled directory of a driver's kernel source tree
// (<root>/usr/src/nvidia-<version>/<kernel|kernel-open>/precompiled/).
// It chooses the package whose stored proc version equals banner (the first
// line of /proc/version) byte for byte and whose driver version equals
// driverVersion.
//
// Two layouts are read: package files directly in dir (the flat layout,
// e.g. precompiled/nvidia-modules-6.12.81), and package files in a
// sub-directory named after the kernel release (precompiled/<kver>/...).
// Only the sub-directory for the banner's release is read; the others are
// reported as SkipOtherKernel (when the banner cannot be parsed, every
// sub-directory is read). Flat files come first, then the sub-directory's,
// each in name order; the first matching package wins and later matches are
// reported as SkipDuplicate. Names starting with '.' are ignored.
//
// Every package is read in full and parsed strictly, so a corrupt package is
// reported (SkipCorrupt, with the parse error) and never chosen. A missing dir
// is not an error: the result is simply empty. Scan never panics and has no
// other failure mode: unreadable entries are reported as SkipUnreadable.
func Scan(dir, banner, driverVersion string) ScanResult {
	banner = firstLine(banner)
	var res ScanResult
	release := ""
	if b, ok := ParseBanner(banner); ok {
		release = b.Release
	}
	files, subdirs := listDir(dir, &res)
	for _, sub := range subdirs {
		if release != "" && filepath.Base(sub) != release {
			res.Skipped = append(res.Skipped, Skipped{Path: sub, Kind: SkipOtherKernel,
				Reason: fmt.Sprintf("sub-directory for kernel release %q, running %q", filepath.Base(sub), release)})
			continue
		}
		more, _ := listDir(sub, &res) // one level deep only
		files = append(files, more...)
	}
	for _, path := range files {
		res.consider(path, banner, driverVersion)
	}
	return res
}

// listDir returns the regular files and sub-directories of dir (symbolic
// links followed), sorted by name, recording what it cannot use.
func listDir(dir string, res *ScanResult) (files, dirs []string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			res.Skipped = append(res.Skipped, Skipped{Path: dir, Kind: SkipUnreadable, Reason: err.Error()})
		}
		return nil, nil
	}
	for _, e := range entries { // ReadDir sorts by name
		if strings.HasPrefix(e.Name(), ".") {
			continue
		}
		path := filepath.Join(dir, e.Name())
		st, err := os.Stat(path)
		switch {
		case err != nil:
			res.Skipped = append(res.Skipped, Skipped{Path: path, Kind: SkipUnreadable, Reason: err.Error()})
		case st.IsDir():
			dirs = append(dirs, path)
		case st.Mode().IsRegular():
			files = append(files, path)
		default:
			res.Skipped = append(res.Skipped, Skipped{Path: path, Kind: SkipNotRegular,
				Reason: fmt.Sprintf("file type %s", st.Mode().Type())})
		}
	}
	slices.Sort(dirs)
	return files, dirs
}

// consider reads the package at path and either chooses it or records why not.
func (r *ScanResult) consider(path, banner, driverVersion string) {
	p, err := readPackage(path)
	if err != nil {
		kind := SkipUnreadable
		if errors.Is(err, ErrCorrupt) || errors.Is(err, ErrTooLarge) {
			kind = SkipCorrupt
		}
		r.Skipped = append(r.Skipped, Skipped{Path: path, Kind: kind, Reason: err.Error()})
		return
	}
	switch {
	case p.DriverVersion != driverVersion:
		r.Skipped = append(r.Skipped, Skipped{Path: path, Kind: SkipDriverVersion,
			Reason: fmt.Sprintf("driver version %q, want %q", p.DriverVersion, driverVersion)})
	case p.ProcVersion != banner:
		expl := Explain(p.ProcVersion, banner)
		r.Skipped = append(r.Skipped, Skipped{Path: path, Kind: SkipBanner, Reason: firstLine(expl), Explain: expl})
	case r.Package != nil:
		r.Skipped = append(r.Skipped, Skipped{Path: path, Kind: SkipDuplicate,
			Reason: "matches too, but " + r.Path + " was chosen first"})
	default:
		r.Path, r.Package = path, p
	}
}

// readPackage is ReadFile with errors that do not repeat the path.
func readPackage(path string) (*Package, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := readSized(f)
	if err != nil {
		return nil, err
	}
	return parseOwned(b)
}
