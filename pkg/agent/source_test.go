package agent

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// TestPrepareLinksThePackageFindChose: the package is read and checked once, by Find; Prepare
// links what Find chose even when the file is replaced in between (no second read).
func TestPrepareLinksThePackageFindChose(t *testing.T) {
	dir := t.TempDir()
	roots := hosttest.Roots(t, dir)
	banner := "Linux version 6.6.95-flatcar (build@pony) #1 SMP"
	path := writePackage(t, roots, "nvidia-modules-6.6.95", banner)
	s := &imageSource{roots: roots, version: testVersion, log: slog.New(slog.DiscardHandler)}
	d, err := s.Find(context.Background(), detect.Facts{KernelRelease: "6.6.95-flatcar", Banner: banner}, "kernel")
	if err != nil || d.Path != PathPrecompiled || d.Package != path {
		t.Fatalf("Find = %+v, %v; want the package %s", d, err, path)
	}
	if err := os.WriteFile(path, []byte("not a package"), 0o644); err != nil {
		t.Fatal(err)
	}
	d.Modules = []string{"nvidia", "nvidia_uvm", "nvidia_modeset"}
	work := t.TempDir()
	images, err := s.Prepare(context.Background(), d, work)
	if err != nil {
		t.Fatalf("Prepare after the file changed = %v; want the package Find read", err)
	}
	if len(images) != 3 {
		t.Fatalf("images %+v", images)
	}
	for _, im := range images {
		data, err := os.ReadFile(im.Path)
		if err != nil || !strings.HasPrefix(im.Path, filepath.Join(work, "link")) || !strings.Contains(string(data), "name="+im.Name) {
			t.Errorf("module %s at %s: %q, %v", im.Name, im.Path, data, err)
		}
	}
}
