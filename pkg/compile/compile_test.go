package compile

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/build/buildtest"
	"github.com/driver-agent/driver-agent/pkg/detect"
	"github.com/driver-agent/driver-agent/pkg/extract"
	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/modfile"
)

var testRelease = &detect.Flatcar{Version: "4152.2.3", Board: "amd64-usr", Channel: "stable"}

// server publishes Debian's installed headers as the Flatcar release testRelease on lts only, so
// the stable channel answers 404 first.
func server(t *testing.T) (srv *flatcartest.Server, release, tree string) {
	t.Helper()
	release, tree, err := buildtest.Headers()
	if err != nil {
		t.Fatal(err)
	}
	entries, err := flatcartest.DirEntries(tree)
	if err != nil {
		t.Fatal(err)
	}
	tarball, err := flatcartest.Tarball(flatcartest.ContainerTree(release, entries))
	if err != nil {
		t.Fatal(err)
	}
	key, err := flatcartest.NewKey("test signer")
	if err != nil {
		t.Fatal(err)
	}
	srv = flatcartest.NewServer(key)
	t.Cleanup(srv.Close)
	if err := srv.Publish(flatcartest.ReleaseDir("lts", testRelease.Board, testRelease.Version), tarball); err != nil {
		t.Fatal(err)
	}
	return srv, release, tree
}

func options(t *testing.T, srv *flatcartest.Server, release string) Options {
	return Options{
		Roots: host.Roots{HostRoot: t.TempDir()}, KernelRelease: release, DriverVersion: "535.261.03", Flatcar: testRelease,
		Fetch:   flatcar.Options{URLs: []string{srv.URLTemplate()}, Keyring: srv.Key.ArmoredPublicKey(), RetryBase: time.Millisecond, RetryMax: time.Millisecond},
		WorkDir: filepath.Join(t.TempDir(), "work"), Jobs: 2, Procs: host.OSExec{},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

// TestRunDownloadsAndBuilds is the compile path end to end with a real kbuild: the host has no
// build tree, the release is found on the lts channel after a 404 on stable, verified, extracted
// and built against; the modules carry the tree's release in their vermagic.
func TestRunDownloadsAndBuilds(t *testing.T) {
	srv, release, tree := server(t)
	o := options(t, srv, release)
	o.SourceDir = filepath.Join(t.TempDir(), "kernel")
	if err := buildtest.WriteSource(context.Background(), o.SourceDir, tree); err != nil {
		t.Fatal(err)
	}
	plan, err := Plan(o)
	if err != nil || !strings.Contains(plan, "download flatcar-container.tar.gz for Flatcar 4152.2.3") {
		t.Fatalf("Plan = %q, %v", plan, err)
	}
	res, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(res.Tree.From, "/lts/amd64-usr/4152.2.3/flatcar-container.tar.gz") || res.Downloaded == 0 {
		t.Errorf("tree %+v, downloaded %d", res.Tree, res.Downloaded)
	}
	var names []string
	for _, m := range res.Modules {
		names = append(names, m.Name)
		data, err := os.ReadFile(m.Path)
		if err != nil {
			t.Fatal(err)
		}
		info, err := modfile.Info(data)
		if err != nil || !strings.HasPrefix(info.Vermagic, release+" ") {
			t.Errorf("%s: vermagic %q (%v), want %s", m.Name, info.Vermagic, err, release)
		}
	}
	if strings.Join(names, " ") != "nvidia nvidia_uvm nvidia_modeset nvidia_peermem" {
		t.Errorf("modules %v", names)
	}
	if log, err := os.ReadFile(res.LogFile); err != nil || !strings.Contains(string(log), "nvidia") {
		t.Errorf("build log %s: %v", res.LogFile, err)
	}
}

// TestRunCancelledDuringDownload: a signal while the tarball streams ends the run promptly with
// the context's error and leaves nothing extracted.
func TestRunCancelledDuringDownload(t *testing.T) {
	srv, release, _ := server(t)
	ctx, cancel := context.WithCancel(context.Background())
	srv.SetHook(func(w http.ResponseWriter, r *http.Request, data io.ReadSeeker) bool {
		if !strings.HasSuffix(r.URL.Path, ".tar.gz") {
			return false
		}
		w.WriteHeader(http.StatusOK)
		io.CopyN(w, data, 64<<10)
		w.(http.Flusher).Flush()
		cancel()
		<-r.Context().Done()
		return true
	})
	o := options(t, srv, release)
	o.SourceDir = t.TempDir()
	_, err := Run(ctx, o)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v, want context.Canceled", err)
	}
	left, _ := os.ReadDir(o.WorkDir)
	for _, e := range left {
		t.Errorf("left in the work dir: %s", e.Name())
	}
}

// TestRunNotFoundNamesTheImage: a release no server has gives the mirror and image-tag hints.
func TestRunNotFoundNamesTheImage(t *testing.T) {
	srv, release, _ := server(t)
	o := options(t, srv, release)
	o.SourceDir = t.TempDir()
	o.Flatcar = &detect.Flatcar{Version: "9999.0.0", Board: "amd64-usr", Channel: "stable"}
	_, err := Run(context.Background(), o)
	if !errors.Is(err, flatcar.ErrNotFound) || !strings.Contains(err.Error(), "precompiled image tagged 535.261.03-flatcar9999.0.0") ||
		!strings.Contains(err.Error(), "--flatcar-release-url") {
		t.Fatalf("Run = %v", err)
	}
}

// TestRunWithoutAnyTree: not Flatcar, no host tree, no --kernel-build-tree.
func TestRunWithoutAnyTree(t *testing.T) {
	o := Options{Roots: host.Roots{HostRoot: t.TempDir()}, KernelRelease: "6.8.0-1-generic", WorkDir: filepath.Join(t.TempDir(), "w"), Procs: host.OSExec{}}
	for name, f := range map[string]func() error{
		"Plan": func() error { _, err := Plan(o); return err },
		"Run":  func() error { _, err := Run(context.Background(), o); return err },
	} {
		err := f()
		if !errors.Is(err, ErrImpossible) || !strings.Contains(err.Error(), "set --kernel-build-tree or use an image with a precompiled package") {
			t.Errorf("%s = %v", name, err)
		}
	}
}

// TestRunHostTreeIsCopied: the host's tree is built against from a private copy, so the host's
// files are never written (kbuild and relocation both write into the tree).
func TestRunHostTreeIsCopied(t *testing.T) {
	release, tree, err := buildtest.Headers()
	if err != nil {
		t.Fatal(err)
	}
	hostRoot := t.TempDir()
	hostTree := filepath.Join(hostRoot, "usr/lib/modules", release, "build")
	if err := os.MkdirAll(hostTree, 0o755); err != nil {
		t.Fatal(err)
	}
	// Debian's tree made self-contained (its links into -common and kbuild resolved), as a host's.
	entries, err := flatcartest.DirEntries(tree)
	if err != nil {
		t.Fatal(err)
	}
	tarball, err := flatcartest.Tarball(entries)
	if err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(bytes.NewReader(tarball))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := extract.Tar(context.Background(), zr, hostTree, extract.Options{}); err != nil {
		t.Fatal(err)
	}
	o := Options{Roots: host.Roots{HostRoot: hostRoot}, KernelRelease: release, WorkDir: filepath.Join(t.TempDir(), "w"), Jobs: 2, Procs: host.OSExec{},
		SourceDir: filepath.Join(t.TempDir(), "kernel")}
	if err := buildtest.WriteSource(context.Background(), o.SourceDir, tree); err != nil {
		t.Fatal(err)
	}
	before, _ := os.Stat(filepath.Join(hostTree, "Makefile"))
	res, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if res.Tree.From != "host" || res.Tree.Dir != filepath.Join(o.WorkDir, "host-tree") || res.Downloaded != 0 {
		t.Errorf("tree %+v", res.Tree)
	}
	if after, _ := os.Stat(filepath.Join(hostTree, "Makefile")); !after.ModTime().Equal(before.ModTime()) {
		t.Error("the host's tree was modified")
	}
	if len(res.Modules) == 0 {
		t.Error("no modules")
	}
}
