package sysext

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/kernel"
)

// Dirs are where systemd-sysext looks for extension images (NAME.raw) and directories (NAME),
// relative to the root.
var Dirs = []string{"etc/extensions", "run/extensions", "var/lib/extensions"}

// Found is a driver extension made by Build, found on a host.
type Found struct {
	Name          string // nvidia-driver-<driver>-flatcar<version>
	DriverVersion string
	// Where is its path as the host sees it: /usr/lib/extension-release.d/extension-release.<name>
	// when merged, else the image or directory in one of Dirs.
	Where  string
	Merged bool
	// Refused is why systemd-sysext refuses it on this host (wraps ErrRefused); nil when it fits.
	Refused error
}

// Find looks under root (the host's root as this process sees it) for the driver extensions: the
// merged ones first (systemd-sysext's /usr/lib/extension-release.d), then the images and
// directories in Dirs that are not merged. Each is checked against h as systemd-sysext checks
// it: a merged one by its extension-release, a directory by the one inside it, an image by the
// release its name carries (the name and the extension-release are made together). Only what
// cannot be read is an error; the extensions found so far are returned with it.
func Find(root string, h Host) ([]Found, error) {
	var found []Found
	var errs []error
	merged := map[string]bool{}
	rels, _ := filepath.Glob(filepath.Join(root, ReleaseDir, "extension-release."+namePrefix+"*"))
	for _, p := range rels {
		name := strings.TrimPrefix(filepath.Base(p), "extension-release.")
		drv, _, ok := ParseName(name)
		if !ok {
			continue
		}
		f := Found{Name: name, DriverVersion: drv, Where: "/" + path.Join(ReleaseDir, "extension-release."+name), Merged: true}
		rel, err := readRelease(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		f.Refused = Check(name, rel, h)
		merged[name] = true
		found = append(found, f)
	}
	for _, d := range Dirs {
		ents, err := os.ReadDir(filepath.Join(root, d))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, e := range ents {
			name := strings.TrimSuffix(e.Name(), ".raw")
			drv, fcVersion, ok := ParseName(name)
			if !ok || merged[name] {
				continue
			}
			f := Found{Name: name, DriverVersion: drv, Where: "/" + path.Join(d, e.Name())}
			rel := Release{ID: "flatcar", VersionID: fcVersion}
			if e.IsDir() { // a directory shows its extension-release; a link or an image is judged by name
				r, err := readRelease(filepath.Join(root, d, e.Name(), ReleaseDir, "extension-release."+name))
				if err != nil {
					errs = append(errs, err)
					continue
				}
				rel = r
			}
			f.Refused = Check(name, rel, h)
			merged[name] = true // the first directory in Dirs wins, as with systemd-sysext
			found = append(found, f)
		}
	}
	return found, errors.Join(errs...)
}

func readRelease(p string) (Release, error) {
	data, err := kernel.ReadLimit(p, 64<<10)
	if err != nil {
		return Release{}, err
	}
	r, err := ParseRelease(data)
	if err != nil {
		return Release{}, fmt.Errorf("%s: %w", p, err)
	}
	return r, nil
}
