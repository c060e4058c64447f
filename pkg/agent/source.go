package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/driver-agent/driver-agent/pkg/build"
	"github.com/driver-agent/driver-agent/pkg/cache"
	"github.com/driver-agent/driver-agent/pkg/compile"
	"github.com/driver-agent/driver-agent/pkg/config"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/extract"
	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/kernel"
	"github.com/driver-agent/driver-agent/pkg/link"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
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
	// Extra are modules to install in the shared driver root without loading them:
	// nvidia_peermem with GPU_DIRECT_RDMA_ENABLED, for the peermem sidecar, when init does not
	// load it. A source that lacks them still serves the others.
	Extra      []string `json:"extra,omitempty"`
	ModulesWhy []string `json:"modulesWhy,omitempty"`
	Skipped    []string `json:"skipped,omitempty"` // packages and cache entries passed over, with why
}

// Source finds and prepares kernel modules for the paths that load them (cached, precompiled,
// compile).
type Source interface {
	// Find says which of those paths can provide modules for this node, and why. It reads only.
	Find(ctx context.Context, f detect.Facts, flavor string) (Decision, error)
	// Prepare produces the files of d.Modules, using workDir (private, removed at teardown) for
	// anything it has to write; the agent orders them by their depends=.
	Prepare(ctx context.Context, d Decision, workDir string) ([]host.ModuleImage, error)
	// Wait returns once what Prepare left running in the background (storing new modules in
	// the host cache while the agent loads them) has ended, or with ctx's error when ctx ends
	// first. The agent calls it before it writes Ready, so that a Ready node's cache holds its
	// modules, and before it removes workDir.
	Wait(ctx context.Context) error
}

// imageSource is the default Source: the host cache, then NVIDIA's precompiled packages shipped
// in the image under <root>/usr/src/nvidia-<version>/<flavor>/precompiled.
type imageSource struct {
	// cfg is the run's configuration: the driver version, the cache, --require-signed, the
	// compile path's settings.
	cfg        *config.Config
	roots      host.Roots
	files      host.Files // the build log's copy and removal, a cache entry's removal and use
	release    string
	banner     string
	log        *slog.Logger
	procs      host.Procs           // runs the linker and the compile path's children
	terminal   io.Writer            // progress bars, when stderr is a terminal
	entry      *cache.Entry         // the entry Find checked, whose modules Prepare verifies
	damaged    error                // why Prepare removed that entry
	pkg        *precompiled.Package // the package Find chose (read and checked once), linked by Prepare
	pkgPath    string               // its file
	compile    compile.Options
	compileErr error            // why the compile path cannot work, found by Find
	storer     *host.Background // the background cache store, nil when none; Wait waits for it
	stored     bool             // the store succeeded; read after storer's Wait
	found      bool             // Find ran

	mu    sync.Mutex
	stats SourceStats
}

// SourceStats are what a Source counts for the metrics.
type SourceStats struct {
	CacheHits, CacheMisses int
	DownloadBytes          int64
	DownloadSeconds        float64
	BuildSeconds           float64
}

// Stats returns the counts so far; safe to call while Find or Prepare run.
func (s *imageSource) Stats() SourceStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

func (s *imageSource) count(f func(*SourceStats)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(&s.stats)
}

// version is the driver version; a dry run without one still shows where it would look.
func (s *imageSource) version() string {
	if s.cfg.DriverVersion == "" {
		return "<DRIVER_VERSION>"
	}
	return s.cfg.DriverVersion
}

// cacheDir is the module cache: --cache-dir, by default under <run>; "" when
// --cache-max-entries is 0 (no cache).
func (s *imageSource) cacheDir() string {
	switch {
	case s.cfg.CacheMaxEntries == 0:
		return ""
	case s.cfg.CacheDir != "":
		return s.cfg.CacheDir
	}
	return s.roots.InRun("nvidia/driver-agent/cache")
}

func (s *imageSource) srcDir(flavor string) string {
	return s.roots.InRoot("usr/src", "nvidia-"+s.version(), flavor)
}

func (s *imageSource) key(flavor string) cache.Key {
	return cache.Key{Banner: s.banner, DriverVersion: s.version(), Flavor: flavor}
}

// Find implements Source.
func (s *imageSource) Find(_ context.Context, f detect.Facts, flavor string) (Decision, error) {
	s.release, s.banner, s.found = f.KernelRelease, f.Banner, true
	var d Decision
	cacheDir := s.cacheDir()
	if s.damaged != nil { // Prepare found the entry Find chose damaged, and removed it
		d.Skipped = append(d.Skipped, "cache: "+s.damaged.Error())
		cacheDir = ""                                       // not looked up again: a dry run only recorded its removal
		s.count(func(st *SourceStats) { st.CacheMisses++ }) // the miss openCached left to count
	}
	if cacheDir != "" {
		// Open leaves the modules' checksums to Prepare, which verifies each through the
		// descriptor it is then loaded from: what is loaded is read once. Open writes nothing: the entry's
		// removal and its use go through s.files, which a dry run records.
		key := s.key(flavor)
		entry, ok, err := cache.Open(cacheDir, key)
		s.count(func(st *SourceStats) {
			if ok {
				st.CacheHits++
			} else {
				st.CacheMisses++
			}
		})
		switch {
		case ok:
			// Best effort: a failed touch only makes the entry look older to Prune.
			_ = s.files.Touch(cache.UsedPath(entry.Dir))
			s.entry = &entry
			d.Path, d.Package = PathCached, entry.Dir
			d.Reason = fmt.Sprintf("modules built earlier on this node for this kernel banner, driver %s and flavour %s are in the cache", s.version(), flavor)
			return d, nil
		case errors.Is(err, cache.ErrCorrupt):
			if rmErr := s.files.RemoveAll(cache.Path(cacheDir, key)); rmErr != nil {
				err = fmt.Errorf("%w; removing it failed: %w", err, rmErr)
			}
			s.log.Warn("damaged cache entry removed; it will be rebuilt", "error", err)
			d.Skipped = append(d.Skipped, "cache: "+err.Error())
		case err != nil:
			s.log.Warn("module cache unusable", "dir", cacheDir, "error", err)
			d.Skipped = append(d.Skipped, "cache: "+err.Error())
		}
	}
	dir := filepath.Join(s.srcDir(flavor), "precompiled")
	res := precompiled.Scan(dir, s.banner, s.version())
	for _, sk := range res.Skipped {
		s.log.Warn("skipping precompiled package", "package", sk.Path, "why", sk.Reason)
		d.Skipped = append(d.Skipped, fmt.Sprintf("%s: %s", sk.Path, sk.Reason))
	}
	if res.Found() {
		s.log.Info("Found NVIDIA driver package " + filepath.Base(res.Path))
		d.Path, d.Package = PathPrecompiled, res.Path
		s.pkg, s.pkgPath = res.Package, res.Path
		d.Reason = fmt.Sprintf("kernel interface matches: %s was built for this kernel banner and driver %s", filepath.Base(res.Path), s.version())
		return d, nil
	}
	d.Path = PathCompile
	d.Reason = fmt.Sprintf("no precompiled package in %s matches kernel %s and driver %s, and no cached build", dir, s.release, s.version())
	s.compile, s.compileErr = s.compileOptions(f, flavor)
	if s.compileErr == nil {
		var plan string
		if plan, s.compileErr = compile.Plan(s.compile); s.compileErr == nil {
			d.Reason += "; " + plan
		}
	}
	if s.compileErr != nil {
		d.Reason += "; cannot compile: " + s.compileErr.Error()
	}
	return d, nil
}

// compileOptions turns the configuration and the host's facts into the compile path's options.
func (s *imageSource) compileOptions(f detect.Facts, flavor string) (compile.Options, error) {
	o := compile.Options{
		Roots: s.roots, KernelRelease: f.KernelRelease, Banner: f.Banner, DriverVersion: s.version(),
		Flatcar: f.Flatcar, SourceDir: s.srcDir(flavor), Procs: s.procs, Log: s.log,
		Terminal: s.terminal, KernelBuildTree: s.cfg.KernelBuildTree, Jobs: s.cfg.MaxThreads, CC: s.cfg.CC,
		Fetch: flatcar.Options{URLs: s.cfg.FlatcarReleaseURLs, InsecureSkipVerify: s.cfg.InsecureSkipVerify},
	}
	if s.cfg.FlatcarSigningKey != "" {
		key, err := os.ReadFile(s.cfg.FlatcarSigningKey)
		if err != nil {
			return o, fmt.Errorf("--flatcar-signing-key: %w", err)
		}
		o.Fetch.Keyring = key
	}
	return o, nil
}

// compileKey is the cache key of modules built here: the compiler is a build input.
func (s *imageSource) compileKey(flavor string) cache.Key {
	k := s.key(flavor)
	if s.compile.CC != "" {
		k.BuildParams = []string{"cc=" + s.compile.CC}
	}
	return k
}

// compileModules runs the compile path and stores its result in the cache.
func (s *imageSource) compileModules(ctx context.Context, d Decision, workDir string) ([]host.ModuleImage, error) {
	if s.compileErr != nil {
		why, _, _ := strings.Cut(d.Reason, "; ")
		return nil, fmt.Errorf("%w (%s)", classifyCompile(s.compileErr), why)
	}
	if workDir == "" { // dry run: Find's plan is the answer
		return nil, nil
	}
	o := s.compile
	o.WorkDir = filepath.Join(workDir, "compile")
	if err := s.files.Remove(s.failedBuildLog()); err != nil {
		s.log.Warn("could not remove an earlier build's log", "error", err)
	}
	s.log.Info("Compiling NVIDIA driver kernel modules...")
	res, err := compile.Run(ctx, o)
	s.count(func(st *SourceStats) {
		st.DownloadBytes += res.Downloaded
		st.DownloadSeconds += res.DownloadTime.Seconds()
		st.BuildSeconds += res.BuildTime.Seconds()
	})
	if err != nil {
		return nil, classifyCompile(s.keepBuildLog(err))
	}
	s.storeInBackground(s.compileKey(d.Flavor), res.Modules)
	return pick(res.Modules, d)
}

// failedBuildLog is where the log of a failed build is kept: next to status.json, which a failed
// run keeps too. The next build on the node replaces or removes it.
func (s *imageSource) failedBuildLog() string {
	return s.roots.InRun("nvidia/driver-agent/build-failed.log")
}

// keepBuildLog copies the log of a failed build out of the work dir, which the teardown removes,
// and makes the error name the copy.
func (s *imageSource) keepBuildLog(err error) error {
	var be *build.Error
	if !errors.As(err, &be) {
		return err
	}
	if cerr := s.files.CopyFile(be.Log, s.failedBuildLog(), 0o644); cerr != nil {
		s.log.Warn("could not keep the failed build's log; it goes with the work dir", "log", be.Log, "error", cerr)
		return err
	}
	be.Log = s.failedBuildLog()
	return err
}

// classifyCompile gives a compile-path error its exit code: no way to get a build tree, a failed
// download or verification, or a failed build.
func classifyCompile(err error) error {
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return err
	case errors.Is(err, compile.ErrImpossible):
		return fmt.Errorf("%w: %w", exitcode.ErrNoInstallPath, err)
	case errors.Is(err, flatcar.ErrVerify), errors.Is(err, flatcar.ErrNotFound), errors.Is(err, flatcar.ErrUnreachable), errors.Is(err, flatcar.ErrRedirect),
		errors.Is(err, flatcar.ErrNoBuildTree), errors.Is(err, flatcar.ErrInvalid), errors.Is(err, extract.ErrUnsafe), errors.Is(err, extract.ErrTooLarge):
		return fmt.Errorf("%w: %w", exitcode.ErrDownload, err)
	}
	return fmt.Errorf("%w: %w", exitcode.ErrBuild, err)
}

// storeInBackground puts freshly made modules in the host cache while the agent loads them from
// the work dir (on a node the two overlap: nvidia takes seconds to initialise its GPUs). Wait
// waits for it. A failed store is a warning: the next start makes the modules again.
func (s *imageSource) storeInBackground(key cache.Key, mods []link.Module) {
	dir := s.cacheDir()
	if dir == "" {
		return
	}
	// Ready waits for the store, the load does not: the load keeps the CPU, and the store takes
	// what the load leaves idle (on a node with few CPUs, the daemons' start) until Wait raises
	// it.
	s.storer = &host.Background{Name: "the cache store", Log: s.log}
	s.storer.Go(func() {
		start := time.Now()
		entry, err := cache.Store(dir, key, mods)
		if err != nil {
			s.log.Warn("could not store the modules in the cache; the next start makes them again", "dir", dir, "error", err)
			return
		}
		s.stored = true
		s.log.Info("stored the modules in the host cache", "entry", entry.Dir, "seconds", time.Since(start).Seconds())
		if removed, err := cache.Prune(dir, s.cfg.CacheMaxEntries); err != nil {
			s.log.Warn("could not prune the module cache", "error", err)
		} else if len(removed) > 0 {
			s.log.Info("pruned the module cache", "removed", removed)
		}
	})
}

// KeptIn says which module cache holds the modules this run uses, once Wait has returned: the
// cache they came from or were stored in, or, on the fast path (Find never ran), the cache an
// earlier run stored them in if it could; "" when none does.
func (s *imageSource) KeptIn() string {
	if !s.found || s.entry != nil || s.stored {
		return s.cacheDir()
	}
	return ""
}

// Wait implements Source.
func (s *imageSource) Wait(ctx context.Context) error {
	if s.storer == nil {
		return nil
	}
	// Nothing is left to run but the store: it runs as the agent does from here on.
	if err := s.storer.Wait(ctx); err != nil {
		return fmt.Errorf("storing the modules in the host cache: %w", err)
	}
	return nil
}

// Prepare implements Source.
func (s *imageSource) Prepare(ctx context.Context, d Decision, workDir string) ([]host.ModuleImage, error) {
	switch d.Path {
	case PathCached:
		if s.entry == nil || s.entry.Dir != d.Package {
			return nil, fmt.Errorf("%w: no verified cache entry for %s", exitcode.ErrNoInstallPath, d.Package)
		}
		images, err := pick(s.entry.Modules, d)
		if err != nil {
			return nil, err
		}
		return s.openCached(images)
	case PathPrecompiled:
		p := s.pkg
		s.pkg = nil // the package (its complete modules too) is not held past the link
		if p == nil || d.Package != s.pkgPath {
			var err error
			if p, err = precompiled.ReadFile(d.Package); err != nil {
				return nil, fmt.Errorf("%w: %w", exitcode.ErrModuleLoad, err)
			}
		}
		s.log.Info("Relinking NVIDIA driver kernel modules...", "package", d.Package)
		mods, err := link.Link(ctx, p, filepath.Join(workDir, "link"), link.Options{
			CoreObjectDir: s.srcDir(d.Flavor), KernelRelease: s.release, RequireSigned: s.cfg.RequireSigned, Log: s.log, Procs: s.procs,
		})
		if err != nil {
			return nil, fmt.Errorf("%w: link %s: %w", exitcode.ErrModuleLoad, filepath.Base(d.Package), err)
		}
		s.storeInBackground(s.key(d.Flavor), mods)
		return pick(mods, d)
	case PathCompile:
		return s.compileModules(ctx, d, workDir)
	}
	return nil, fmt.Errorf("%w: install path %q", exitcode.ErrNoInstallPath, d.Path)
}

// errDamagedEntry says the cache entry Find chose failed verification in Prepare and was
// removed: the agent decides again (Find then misses the cache) and prepares what it chooses.
var errDamagedEntry = errors.New("damaged cache entry removed; it will be rebuilt")

// openCached opens each cached module, verifying its checksum through the file the kernel then
// loads it from. A damaged module removes the entry (errDamagedEntry) and nothing stays open.
func (s *imageSource) openCached(images []host.ModuleImage) ([]host.ModuleImage, error) {
	for i := range images {
		f, err := s.entry.OpenModule(images[i].Name)
		if err == nil {
			images[i].File = f
			continue
		}
		closeFiles(images)
		if !errors.Is(err, cache.ErrCorrupt) {
			return nil, fmt.Errorf("%w: %w", exitcode.ErrModuleLoad, err)
		}
		if rmErr := s.files.RemoveAll(s.entry.Dir); rmErr != nil {
			err = fmt.Errorf("%w; removing it failed: %w", err, rmErr)
		}
		s.entry, s.damaged = nil, err
		s.count(func(st *SourceStats) { st.CacheHits-- }) // not a hit after all: Find counts the miss
		return nil, fmt.Errorf("%w: %w", errDamagedEntry, err)
	}
	return images, nil
}

// closeFiles closes the files images hold open; closing one twice does no harm.
func closeFiles(images []host.ModuleImage) {
	for _, im := range images {
		if im.File != nil {
			im.File.Close()
		}
	}
}

// pick returns the modules of d.Modules from mods, or says which are missing.
func pick(mods []link.Module, d Decision) ([]host.ModuleImage, error) {
	have := map[string]link.Module{}
	for _, m := range mods {
		have[kernel.Normalize(m.Name)] = m
	}
	var images []host.ModuleImage
	var missing []string
	for _, name := range d.Modules {
		m, ok := have[name]
		if !ok {
			missing = append(missing, name)
			continue
		}
		images = append(images, host.ModuleImage{Name: name, Path: m.Path})
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%w: %s does not provide %s", exitcode.ErrNoInstallPath, d.Package, strings.Join(missing, ", "))
	}
	for _, name := range d.Extra {
		if m, ok := have[name]; ok {
			images = append(images, host.ModuleImage{Name: name, Path: m.Path})
		}
	}
	return images, nil
}
