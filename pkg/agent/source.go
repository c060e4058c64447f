package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
)

// Install paths.
const (
	PathFast        = "fast"
	PathHost        = "host"
	PathPrecompiled = "precompiled"
	PathCached      = "cached"
	PathCompile     = "compile"
)

// Decision is the chosen install path and why.
type Decision struct {
	Path         string   `json:"path"`
	Reason       string   `json:"reason"`
	Flavor       string   `json:"flavor"` // kernel or kernel-open
	FlavorReason string   `json:"flavorReason"`
	Package      string   `json:"package,omitempty"` // the precompiled package or cache entry used
	Reload       bool     `json:"reload"`            // loaded NVIDIA modules must be unloaded first
	Modules      []string `json:"modules"`           // the NVIDIA modules to load, by kernel name
	ModulesWhy   []string `json:"modulesWhy,omitempty"`
}

// Source finds and prepares kernel modules for the paths that load them (precompiled, cached,
// compile).
type Source interface {
	// Find says which of those paths can provide modules for this node, and why.
	Find(ctx context.Context, f detect.Facts, flavor string) (Decision, error)
	// Prepare produces the files of d.Modules; the agent orders them by their depends=.
	Prepare(ctx context.Context, d Decision) ([]host.ModuleImage, error)
}

// imageSource is the default Source: NVIDIA's precompiled packages shipped in the image under
// <root>/usr/src/nvidia-<version>/<flavor>/precompiled.
type imageSource struct {
	roots   host.Roots
	version string
}

func (s imageSource) dir(flavor string) string {
	return s.roots.InRoot("usr/src", "nvidia-"+s.version, flavor, "precompiled")
}

// Find implements Source.
func (s imageSource) Find(_ context.Context, f detect.Facts, flavor string) (Decision, error) {
	dir := s.dir(flavor)
	entries, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		return Decision{}, fmt.Errorf("precompiled packages: %w", err)
	}
	d := Decision{Path: PathCompile, Reason: fmt.Sprintf("no precompiled package in %s and no cached build for kernel %s", dir, f.KernelRelease)}
	if len(entries) > 0 {
		d.Reason = fmt.Sprintf("%d precompiled package(s) in %s, but this build cannot read them yet, and no cached build for kernel %s", len(entries), dir, f.KernelRelease)
	}
	return d, nil
}

// Prepare implements Source.
func (s imageSource) Prepare(_ context.Context, d Decision) ([]host.ModuleImage, error) {
	return nil, fmt.Errorf("%w: the %s install path (build tree %s) is not implemented in this build", exitcode.ErrNotImplemented, d.Path, filepath.Join("/usr/lib/modules", "<kver>", "build"))
}
