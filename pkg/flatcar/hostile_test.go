package flatcar_test

import (
	"bytes"
	"context"
	"crypto/sha512"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// TestBuildTreeRefusesRedirectsOffHTTP: a release server that redirects to a file:// URL (or any
// scheme but http and https) does not make the fetcher read the node's own files, even when what
// they hold would verify; a redirect to another http URL is followed.
func TestBuildTreeRefusesRedirectsOffHTTP(t *testing.T) {
	t.Parallel()
	for _, target := range []string{"file://", "ftp://mirror.example", "gopher://mirror.example"} {
		t.Run(target, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			local := writeRelease(t, e, t.TempDir())
			e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, _ io.ReadSeeker) bool {
				if !strings.HasPrefix(r.URL.Path, flatcartest.ReleaseDir("stable", rel.Board, rel.Version)) {
					return false
				}
				http.Redirect(w, r, target+filepath.Join(local, filepath.Base(r.URL.Path)), http.StatusFound)
				return true
			})
			f := e.fetcher(t, func(o *flatcar.Options) { o.URLs = []string{e.srv.URLTemplate()} })
			_, err := f.BuildTree(context.Background(), rel, kver, e.dest)
			if !errors.Is(err, flatcar.ErrRedirect) {
				t.Fatalf("BuildTree = %v, want ErrRedirect", err)
			}
			msg := err.Error()
			for _, want := range []string{e.srv.URL + imagePath("stable") + ".DIGESTS.asc", target, "redirect only to http and https URLs"} {
				if !strings.Contains(msg, want) {
					t.Errorf("error %q does not name %q", msg, want)
				}
			}
			if n := len(e.srv.Requests()); n != 1 {
				t.Errorf("%d requests (%v), want 1: a refused redirect is not retried, nor other channels tried", n, e.srv.Requests())
			}
			e.assertClean(t)
		})
	}

	t.Run("http", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		if err := e.srv.Publish("/moved/", tarball(t, flatcartest.ContainerTree(kver, buildTree(t)))); err != nil {
			t.Fatal(err)
		}
		e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, _ io.ReadSeeker) bool {
			if !strings.HasPrefix(r.URL.Path, flatcartest.ReleaseDir("stable", rel.Board, rel.Version)) {
				return false
			}
			http.Redirect(w, r, e.srv.URL+"/moved/"+filepath.Base(r.URL.Path), http.StatusMovedPermanently)
			return true
		})
		if _, err := e.fetcher(t).BuildTree(context.Background(), rel, kver, e.dest); err != nil {
			t.Fatalf("BuildTree through an http redirect: %v", err)
		}
	})
}

// TestFileRefusesRedirectsOffHTTP: the same for a single release file (the kernel image).
func TestFileRefusesRedirectsOffHTTP(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	local := t.TempDir()
	secret := []byte("the node's own file\n")
	d, err := flatcartest.Digests(flatcar.KernelImage, bytes.NewReader(secret))
	if err != nil {
		t.Fatal(err)
	}
	asc, err := e.key.ClearSign(d)
	hosttest.Must(t, err)
	hosttest.Must(t, os.WriteFile(filepath.Join(local, flatcar.KernelImage), secret, 0o644))
	hosttest.Must(t, os.WriteFile(filepath.Join(local, flatcar.KernelImage+".DIGESTS.asc"), asc, 0o644))
	e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, _ io.ReadSeeker) bool {
		http.Redirect(w, r, "file://"+filepath.Join(local, filepath.Base(r.URL.Path)), http.StatusTemporaryRedirect)
		return true
	})
	dest := filepath.Join(e.parent, "vmlinuz")
	_, err = e.fetcher(t).File(context.Background(), rel, flatcar.KernelImage, dest)
	if !errors.Is(err, flatcar.ErrRedirect) {
		t.Fatalf("File = %v, want ErrRedirect", err)
	}
	e.assertClean(t)
}

// stallAfter answers with the whole Content-Length of data, sends its first n bytes and then
// nothing until the client goes away.
func stallAfter(w http.ResponseWriter, r *http.Request, data io.ReadSeeker, n int64) {
	size, _ := data.Seek(0, io.SeekEnd)
	_, _ = data.Seek(0, io.SeekStart)
	w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
	_, _ = io.CopyN(w, data, n)
	w.(http.Flusher).Flush()
	<-r.Context().Done()
}

// TestBuildTreeStalledDigests: a server that stalls while sending the .DIGESTS.asc (before any
// byte of the body, or in its middle) is bounded by StallTimeout like the tarball, and the error
// names the file.
func TestBuildTreeStalledDigests(t *testing.T) {
	t.Parallel()
	for name, sent := range map[string]int64{"no body": 0, "half the body": 200} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
			e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, data io.ReadSeeker) bool {
				if !strings.HasSuffix(r.URL.Path, ".DIGESTS.asc") {
					return false
				}
				stallAfter(w, r, data, sent)
				return true
			})
			f := e.fetcher(t, func(o *flatcar.Options) {
				o.URLs, o.StallTimeout, o.Retries = []string{e.srv.URL + flatcartest.ReleaseDir("stable", "{board}", "{version}")}, 50*time.Millisecond, 1
			})
			// The bound of the test itself: a fetcher that ignores the stall hangs until here.
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			_, err := f.BuildTree(ctx, rel, kver, e.dest)
			if ctx.Err() != nil {
				t.Fatalf("BuildTree hung on a stalled DIGESTS.asc until the test's deadline: %v", err)
			}
			if !errors.Is(err, flatcar.ErrUnreachable) || !strings.Contains(err.Error(), e.srv.URL+imagePath("stable")+".DIGESTS.asc") ||
				!strings.Contains(err.Error(), "no data for 50ms") {
				t.Fatalf("BuildTree = %v, want ErrUnreachable naming the stalled DIGESTS.asc", err)
			}
			e.assertClean(t)
		})
	}
}

// TestBuildTreeEmptyTarball: an empty body where the tarball should be is a failed download,
// with a message that says so, whether or not the DIGESTS are signed, and also when the signed
// DIGESTS do list the empty file's digest (nothing there is a release).
func TestBuildTreeEmptyTarball(t *testing.T) {
	t.Parallel()
	empty := sha512.Sum512(nil)
	for name, c := range map[string]struct {
		publishEmpty, insecure bool
		want                   string
	}{
		"signed digest of another file":  {want: "is empty (0 bytes) but the signed DIGESTS give SHA512"},
		"signed digest of an empty file": {publishEmpty: true, want: "is empty (0 bytes), as its signed DIGESTS say: not a Flatcar container image"},
		"no digests":                     {insecure: true, want: "is empty (0 bytes) and unverified"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			tb := tarball(t, flatcartest.ContainerTree(kver, buildTree(t)))
			if c.publishEmpty {
				tb = nil
			}
			e.publish(t, "stable", tb)
			if c.insecure {
				e.srv.Remove(imagePath("stable") + ".DIGESTS.asc")
			}
			e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, _ io.ReadSeeker) bool {
				if r.URL.Path != imagePath("stable") {
					return false
				}
				w.Header().Set("Content-Length", "0")
				return true
			})
			f := e.fetcher(t, func(o *flatcar.Options) { o.InsecureSkipVerify = c.insecure })
			_, err := f.BuildTree(context.Background(), rel, kver, e.dest)
			if !errors.Is(err, flatcar.ErrVerify) || !strings.Contains(err.Error(), e.srv.URL+imagePath("stable")+" "+c.want) {
				t.Fatalf("BuildTree = %v, want ErrVerify: %s", err, c.want)
			}
			if c.publishEmpty != strings.Contains(err.Error(), hex.EncodeToString(empty[:])) {
				t.Errorf("error %q: names the empty file's digest only when it is the signed one", err)
			}
			e.assertClean(t)
		})
	}
}
