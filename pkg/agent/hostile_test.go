package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// TestCompilePathHostileServer: a release server that redirects to a file:// URL naming a validly
// signed release on the node, or that sends an empty tarball, fails the run with the download
// code (8) and a message naming what it did; nothing is loaded and nothing is left behind.
func TestCompilePathHostileServer(t *testing.T) {
	const kver = "6.6.95-flatcar" // the fixture's kernel
	key, err := flatcartest.NewKey("test release key")
	if err != nil {
		t.Fatal(err)
	}
	keyFile := filepath.Join(t.TempDir(), "key.asc")
	if err := os.WriteFile(keyFile, key.ArmoredPublicKey(), 0o644); err != nil {
		t.Fatal(err)
	}
	tb, err := flatcartest.Tarball(flatcartest.ContainerTree(kver, []flatcartest.Entry{{Name: "Makefile", Body: []byte("# kernel Makefile\n")}}))
	if err != nil {
		t.Fatal(err)
	}
	dir := flatcartest.ReleaseDir("stable", "amd64-usr", "4230.2.1")
	image := dir + flatcartest.ContainerImage
	// The same release, signed, in a local directory.
	local := t.TempDir()
	digests, err := flatcartest.Digests(flatcartest.ContainerImage, bytes.NewReader(tb))
	if err != nil {
		t.Fatal(err)
	}
	asc, err := key.ClearSign(digests)
	if err != nil {
		t.Fatal(err)
	}
	hosttest.Must(t, os.WriteFile(filepath.Join(local, flatcartest.ContainerImage), tb, 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(local, flatcartest.ContainerImage+".DIGESTS.asc"), asc, 0o644))

	for name, c := range map[string]struct {
		hook func(w http.ResponseWriter, r *http.Request) bool
		want string
	}{
		"redirect to file": {
			hook: func(w http.ResponseWriter, r *http.Request) bool {
				http.Redirect(w, r, "file://"+filepath.Join(local, filepath.Base(r.URL.Path)), http.StatusFound)
				return true
			},
			want: "redirected to file://" + local,
		},
		"empty tarball": {
			hook: func(w http.ResponseWriter, r *http.Request) bool {
				if r.URL.Path != image {
					return false
				}
				w.Header().Set("Content-Length", "0")
				return true
			},
			want: image + " is empty (0 bytes) but the signed DIGESTS give SHA512",
		},
	} {
		t.Run(name, func(t *testing.T) {
			srv := flatcartest.NewServer(key)
			defer srv.Close()
			if err := srv.Publish(dir, tb); err != nil {
				t.Fatal(err)
			}
			srv.SetHook(func(w http.ResponseWriter, r *http.Request, _ io.ReadSeeker) bool { return c.hook(w, r) })
			w := newWorld(t)
			work := t.TempDir()
			a := w.agent(t, "--flatcar-release-url", srv.URLTemplate(), "--flatcar-signing-key", keyFile, "--work-dir", work)
			a.Source = nil
			err := a.Run(context.Background())
			if !errors.Is(err, exitcode.ErrDownload) || exitcode.Code(err) != 8 || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Run = %v (code %d), want the download code 8 and %q", err, exitcode.Code(err), c.want)
			}
			if left, _ := os.ReadDir(work); len(left) != 0 {
				t.Errorf("the work dir keeps %v", left)
			}
			if calls := w.kernel.Calls(); len(calls) != 0 {
				t.Errorf("kernel calls %v", calls)
			}
			os.Remove(w.roots.InRun("nvidia/driver-agent/status.json"))
			w.assertClean(t)
		})
	}
}
