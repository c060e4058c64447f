package flatcar_test

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha512"
	"encoding/hex"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/extract"
	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

const kver = "6.6.60-flatcar"

var rel = flatcar.Release{Channel: "stable", Board: "amd64-usr", Version: "4593.2.0"}

// buildTree is a small kernel build tree, with an incompressible file so
// that the tarball spans many reads.
func buildTree(t *testing.T, extra ...flatcartest.Entry) []flatcartest.Entry {
	t.Helper()
	noise := make([]byte, 1<<20)
	if _, err := rand.Read(noise); err != nil {
		t.Fatal(err)
	}
	return append([]flatcartest.Entry{
		{Name: "Makefile", Body: []byte("# kernel Makefile\n")},
		{Name: ".config", Body: []byte("CONFIG_MODULES=y\n")},
		{Name: "include/", Type: tar.TypeDir},
		{Name: "include/generated/autoconf.h", Body: []byte("#define CONFIG_MODULES 1\n")},
		{Name: "scripts/basic/fixdep", Mode: 0o755, Body: []byte("\x7fELF fixdep")},
		{Name: "tools/objtool/objtool", Mode: 0o755, Body: noise},
	}, extra...)
}

func tarball(t *testing.T, entries []flatcartest.Entry) []byte {
	t.Helper()
	b, err := flatcartest.Tarball(entries)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type env struct {
	srv  *flatcartest.Server
	key  *flatcartest.Key
	logs *hosttest.LogBuffer
	// dest is where trees go, inside parent, which holds nothing else.
	parent, dest string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	key, err := flatcartest.NewKey("test release key")
	if err != nil {
		t.Fatal(err)
	}
	srv := flatcartest.NewServer(key)
	t.Cleanup(srv.Close)
	parent := t.TempDir()
	return &env{srv: srv, key: key, logs: &hosttest.LogBuffer{}, parent: parent, dest: filepath.Join(parent, "tree")}
}

func (e *env) fetcher(t *testing.T, mod ...func(*flatcar.Options)) *flatcar.Fetcher {
	t.Helper()
	o := flatcar.Options{
		URLs:             []string{e.srv.URLTemplate(), e.srv.BincacheTemplate()},
		Keyring:          e.key.ArmoredPublicKey(),
		RetryBase:        time.Millisecond,
		RetryMax:         5 * time.Millisecond,
		ProgressInterval: time.Millisecond,
		Log:              slog.New(slog.NewTextHandler(e.logs, nil)),
	}
	for _, m := range mod {
		m(&o)
	}
	f, err := flatcar.New(o)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func (e *env) publish(t *testing.T, channel string, tb []byte) {
	t.Helper()
	if err := e.srv.Publish(flatcartest.ReleaseDir(channel, rel.Board, rel.Version), tb); err != nil {
		t.Fatal(err)
	}
}

// assertClean fails unless the parent of dest is empty: dest was removed
// and nothing was written next to it.
func (e *env) assertClean(t *testing.T) {
	t.Helper()
	ents, err := os.ReadDir(e.parent)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 0 {
		var names []string
		_ = filepath.WalkDir(e.parent, func(p string, _ fs.DirEntry, _ error) error {
			names = append(names, p)
			return nil
		})
		t.Errorf("left behind after a failure: %v", names)
	}
}

func imagePath(channel string) string {
	return flatcartest.ReleaseDir(channel, rel.Board, rel.Version) + flatcartest.ContainerImage
}

func TestBuildTree(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tb := tarball(t, flatcartest.ContainerTree(kver, buildTree(t)))
	e.publish(t, "stable", tb)
	var bar bytes.Buffer
	f := e.fetcher(t, func(o *flatcar.Options) { o.Progress = &bar })
	tree, err := f.BuildTree(context.Background(), rel, kver, e.dest)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha512.Sum512(tb)
	mod := filepath.Join(e.dest, "usr/lib/modules", kver)
	want := flatcar.Tree{
		Root: e.dest, KernelRelease: kver, ModulesDir: mod, BuildDir: filepath.Join(mod, "build"),
		LibDir: filepath.Join(e.dest, "usr/lib64"), Loader: filepath.Join(e.dest, "usr/lib64/ld-linux-x86-64.so.2"),
		Release: rel, URL: e.srv.URL + imagePath("stable"), SHA512: hex.EncodeToString(sum[:]), Verified: true,
		Signer: tree.Signer, Downloaded: int64(len(tb)), Extracted: tree.Extracted,
	}
	if *tree != want {
		t.Errorf("Tree =\n%+v\nwant\n%+v", *tree, want)
	}
	if tree.Signer == "" || tree.Extracted.Files != 8 {
		t.Errorf("Signer %q, Extracted %+v; want a signer and 8 files", tree.Signer, tree.Extracted)
	}
	for p, body := range map[string]string{
		"usr/lib/modules/" + kver + "/build/Makefile":                     "# kernel Makefile\n",
		"usr/lib/modules/" + kver + "/source/.config":                     "CONFIG_MODULES=y\n",
		"usr/lib/modules/" + kver + "/modules.dep":                        "kernel/drivers/dummy.ko:\n",
		"usr/lib64/libc.so":                                               "\x7fELF stand-in libc",
		"usr/lib/modules/" + kver + "/build/include/generated/autoconf.h": "#define CONFIG_MODULES 1\n",
	} {
		b, err := os.ReadFile(filepath.Join(e.dest, p))
		if err != nil || string(b) != body {
			t.Errorf("%s = %q, %v; want %q", p, b, err, body)
		}
	}
	if fi, err := os.Stat(filepath.Join(tree.BuildDir, "scripts/basic/fixdep")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("fixdep: %v %v, want mode 0755", fi, err)
	}
	for _, p := range []string{"usr/bin", "usr/lib/modules/" + kver + "/kernel", "usr/lib/modules/0.0.1-other", "usr/lib64/systemd", "lib64"} {
		if _, err := os.Lstat(filepath.Join(e.dest, p)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s was extracted (%v); the build does not need it", p, err)
		}
	}
	ents, _ := os.ReadDir(e.dest)
	if len(ents) != 1 || ents[0].Name() != "usr" {
		t.Errorf("dest holds %v, want only usr (no staging directory left)", ents)
	}
	if !strings.Contains(bar.String(), "100%") {
		t.Errorf("progress bar %q does not reach 100%%", bar.String())
	}
	logs := e.logs.String()
	for _, s := range []string{"Installing the Flatcar kernel sources into the development environment...", "downloaded and verified"} {
		if !strings.Contains(logs, s) {
			t.Errorf("log lacks %q:\n%s", s, logs)
		}
	}
	if strings.Contains(logs, "INSECURE") {
		t.Errorf("insecure warning without InsecureSkipVerify:\n%s", logs)
	}
}

// TestBuildTreeVerifyFailures: a signature by another key, a tampered DIGESTS text, a tarball
// other than the signed one, DIGESTS without the tarball's SHA512 line and a download that breaks
// off each fail with ErrVerify, say why, and leave nothing behind.
func TestBuildTreeVerifyFailures(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		// break_ spoils what the server publishes; it runs after the tarball is published.
		break_ func(t *testing.T, e *env)
		opts   func(*flatcar.Options)
		want   string // in the error
		// tarballUntouched: DIGESTS fail first, so the tarball must not have been downloaded.
		tarballUntouched bool
	}{
		{name: "signed by another key", break_: func(t *testing.T, e *env) {
			other, err := flatcartest.NewKey("someone else")
			if err != nil {
				t.Fatal(err)
			}
			e.srv.Key = other // the server signs (again) with a key the fetcher does not trust
			e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
		}, want: "DIGESTS.asc", tarballUntouched: true},
		{name: "tampered DIGESTS", break_: func(t *testing.T, e *env) {
			dir := flatcartest.ReleaseDir("stable", rel.Board, rel.Version)
			// Change one digit of the signed text, keeping the signature.
			resp, err := http.Get(e.srv.URL + dir + flatcartest.ContainerImage + ".DIGESTS.asc")
			if err != nil {
				t.Fatal(err)
			}
			asc, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			i := bytes.Index(asc, []byte("# SHA512 HASH\n")) + len("# SHA512 HASH\n")
			asc[i] ^= 1
			e.srv.Put(dir+flatcartest.ContainerImage+".DIGESTS.asc", asc)
		}},
		{name: "another tarball", break_: func(t *testing.T, e *env) {
			// A different, well-formed tarball in place of the signed one.
			e.srv.Put(imagePath("stable"), tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
		}, want: "SHA512"},
		{name: "no SHA512 line for the tarball", break_: func(t *testing.T, e *env) {
			text := "# MD5 HASH\n" + strings.Repeat("0", 32) + "  flatcar-container.tar.gz\n# SHA512 HASH\n" +
				strings.Repeat("0", 128) + "  flatcar_production_image.bin.bz2\n"
			asc, err := e.key.ClearSign([]byte(text))
			if err != nil {
				t.Fatal(err)
			}
			e.srv.Put(imagePath("stable")+".DIGESTS.asc", asc)
		}, want: "no SHA512 line for flatcar-container.tar.gz"},
		{name: "download broken off", break_: func(t *testing.T, e *env) {
			e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, data io.ReadSeeker) bool {
				if r.URL.Path != imagePath("stable") {
					return false
				}
				truncate(w, data, "") // without a validator: no resuming
				return true
			})
		}, opts: func(o *flatcar.Options) { o.Retries = 2 }, want: "broke off"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
			c.break_(t, e)
			var opts []func(*flatcar.Options)
			if c.opts != nil {
				opts = append(opts, c.opts)
			}
			_, err := e.fetcher(t, opts...).BuildTree(context.Background(), rel, kver, e.dest)
			if !errors.Is(err, flatcar.ErrVerify) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("BuildTree = %v, want ErrVerify saying %q", err, c.want)
			}
			if c.tarballUntouched && slices.Contains(e.srv.Requests(), imagePath("stable")) {
				t.Error("the tarball was downloaded although its DIGESTS failed verification")
			}
			e.assertClean(t)
		})
	}
}

// truncate answers with the full Content-Length but only half the body,
// and the entity tag etag.
func truncate(w http.ResponseWriter, data io.ReadSeeker, etag string) {
	size, _ := data.Seek(0, io.SeekEnd)
	_, _ = data.Seek(0, io.SeekStart)
	w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
	if etag != "" {
		w.Header().Set("ETag", etag)
	}
	_, _ = io.CopyN(w, data, size/2)
}

func TestBuildTreeDoesNotResumeAChangedFile(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
	var once sync.Once
	e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, data io.ReadSeeker) bool {
		done := false
		if r.URL.Path == imagePath("stable") {
			once.Do(func() { truncate(w, data, `"an older version"`); done = true })
		}
		return done
	})
	_, err := e.fetcher(t).BuildTree(context.Background(), rel, kver, e.dest)
	if !errors.Is(err, flatcar.ErrVerify) || !strings.Contains(err.Error(), "instead of the rest of the same file") {
		t.Fatalf("BuildTree = %v, want ErrVerify: the If-Range request got the whole (changed) file", err)
	}
	e.assertClean(t)
}

func TestBuildTreeResumesTruncatedDownload(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
	var once sync.Once
	etag := e.srv.ETag(imagePath("stable"))
	e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, data io.ReadSeeker) bool {
		done := false
		if r.URL.Path == imagePath("stable") {
			once.Do(func() { truncate(w, data, etag); done = true })
		}
		return done
	})
	tree, err := e.fetcher(t).BuildTree(context.Background(), rel, kver, e.dest)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(e.srv.Requests(), imagePath("stable")+" range") {
		t.Errorf("no range request in %v", e.srv.Requests())
	}
	if _, err := os.Stat(filepath.Join(tree.BuildDir, "tools/objtool/objtool")); err != nil {
		t.Error(err)
	}
}

func TestBuildTreeRetriesServerErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
	var mu sync.Mutex
	failures := map[string]int{}
	e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, _ io.ReadSeeker) bool {
		mu.Lock()
		defer mu.Unlock()
		if failures[r.URL.Path] < 2 {
			failures[r.URL.Path]++
			http.Error(w, "try later", http.StatusServiceUnavailable)
			return true
		}
		return false
	})
	if _, err := e.fetcher(t).BuildTree(context.Background(), rel, kver, e.dest); err != nil {
		t.Fatal(err)
	}
	reqs := e.srv.Requests()
	for _, p := range []string{imagePath("stable") + ".DIGESTS.asc", imagePath("stable")} {
		if n := count(reqs, p); n != 3 {
			t.Errorf("%s requested %d times, want 3 (two 503s, then success)", p, n)
		}
	}
}

func count(s []string, v string) int {
	n := 0
	for _, x := range s {
		if x == v {
			n++
		}
	}
	return n
}

func TestBuildTreeFallsBackToOtherChannel(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.publish(t, "lts", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
	tree, err := e.fetcher(t).BuildTree(context.Background(), rel, kver, e.dest)
	if err != nil {
		t.Fatal(err)
	}
	if tree.Release.Channel != "lts" || tree.URL != e.srv.URL+imagePath("lts") {
		t.Errorf("found on %q at %s, want lts", tree.Release.Channel, tree.URL)
	}
	if reqs := e.srv.Requests(); len(reqs) == 0 || reqs[0] != imagePath("stable")+".DIGESTS.asc" {
		t.Errorf("first request %v, want the node's channel (stable) first", reqs)
	}
}

func TestBuildTreeFallsBackToBincache(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	if err := e.srv.Publish("/images/amd64/"+rel.Version+"/", tarball(t, flatcartest.ContainerTree(kver, buildTree(t)))); err != nil {
		t.Fatal(err)
	}
	tree, err := e.fetcher(t).BuildTree(context.Background(), rel, kver, e.dest)
	if err != nil {
		t.Fatal(err)
	}
	if tree.Release.Channel != "" || !strings.Contains(tree.URL, "/images/amd64/") {
		t.Errorf("Tree %+v, want the bincache URL and no channel", tree)
	}
}

func TestBuildTreeNotFound(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	f := e.fetcher(t)
	_, err := f.BuildTree(context.Background(), rel, kver, e.dest)
	if !errors.Is(err, flatcar.ErrNotFound) || errors.Is(err, flatcar.ErrUnreachable) {
		t.Fatalf("BuildTree = %v, want ErrNotFound only", err)
	}
	bases, _ := f.Candidates(rel)
	for _, b := range bases {
		if !strings.Contains(err.Error(), b) {
			t.Errorf("error does not list %s: %v", b, err)
		}
	}
	if len(bases) != 5 || count(e.srv.Requests(), imagePath("lts")+".DIGESTS.asc") != 1 {
		t.Errorf("candidates %v, requests %v: want 4 channels and the bincache, each asked once", bases, e.srv.Requests())
	}
	e.assertClean(t)
}

func TestBuildTreeUnreachable(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now
	e := newEnv(t)
	f := e.fetcher(t, func(o *flatcar.Options) { o.URLs = []string{"http://" + addr + "/{channel}/{board}/{version}"} })
	_, err = f.BuildTree(context.Background(), rel, kver, e.dest)
	if !errors.Is(err, flatcar.ErrUnreachable) {
		t.Fatalf("BuildTree = %v, want ErrUnreachable", err)
	}
	for _, s := range []string{"http://" + addr + "/stable/amd64-usr/4593.2.0/", "--flatcar-release-url"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error lacks %q: %v", s, err)
		}
	}
	e.assertClean(t)
}

func TestBuildTreeRejectsUnsafeArchives(t *testing.T) {
	t.Parallel()
	for name, bad := range map[string]flatcartest.Entry{
		"dotdot":           {Name: "../../../../../../../escaped", Body: []byte("x")},
		"escaping symlink": {Name: "escape", Type: tar.TypeSymlink, Linkname: "../../../../../../../.."},
		"device node":      {Name: "null", Type: tar.TypeChar},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t, bad, flatcartest.Entry{Name: "escape/file", Body: []byte("x")}))))
			_, err := e.fetcher(t).BuildTree(context.Background(), rel, kver, e.dest)
			if !errors.Is(err, extract.ErrUnsafe) {
				t.Fatalf("BuildTree = %v, want extract.ErrUnsafe", err)
			}
			var me *extract.MemberError
			if !errors.As(err, &me) || !strings.Contains(me.Name, "/build/") {
				t.Errorf("error %v does not name the member", err)
			}
			e.assertClean(t)
		})
	}
}

func TestBuildTreeCancelledDuringDownload(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
	sent := make(chan struct{})
	e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, data io.ReadSeeker) bool {
		if r.URL.Path != imagePath("stable") {
			return false
		}
		size, _ := data.Seek(0, io.SeekEnd)
		_, _ = data.Seek(0, io.SeekStart)
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		_, _ = io.CopyN(w, data, size/2)
		w.(http.Flusher).Flush()
		close(sent)
		<-r.Context().Done() // hang until the client goes away
		return true
	})
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-sent
		cancel()
	}()
	_, err := e.fetcher(t).BuildTree(ctx, rel, kver, e.dest)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("BuildTree = %v, want context.Canceled", err)
	}
	e.assertClean(t)
}

func TestBuildTreeInsecureSkipVerify(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	other, err := flatcartest.NewKey("someone else")
	if err != nil {
		t.Fatal(err)
	}
	e.srv.Key = other
	tb := tarball(t, flatcartest.ContainerTree(kver, buildTree(t)))
	e.publish(t, "stable", tb)
	f := e.fetcher(t, func(o *flatcar.Options) { o.InsecureSkipVerify = true })
	tree, err := f.BuildTree(context.Background(), rel, kver, e.dest)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha512.Sum512(tb)
	if tree.Verified || tree.Signer != "" || tree.SHA512 != hex.EncodeToString(sum[:]) {
		t.Errorf("Tree %+v: want unverified, with the digest still compared", tree)
	}
	if n := strings.Count(e.logs.String(), "level=WARN msg=\"INSECURE: the signature"); n != 1 {
		t.Errorf("%d insecure warnings for one use, want 1:\n%s", n, e.logs.String())
	}

	// A second use warns again; without any DIGESTS the digest is not checked.
	e.srv.Remove(imagePath("stable") + ".DIGESTS.asc")
	dest2 := filepath.Join(t.TempDir(), "tree")
	tree, err = f.BuildTree(context.Background(), rel, kver, dest2)
	if err != nil {
		t.Fatal(err)
	}
	if tree.SHA512 != "" {
		t.Errorf("SHA512 = %q without DIGESTS", tree.SHA512)
	}
	logs := e.logs.String()
	if n := strings.Count(logs, "level=WARN msg=\"INSECURE: the signature"); n != 2 {
		t.Errorf("%d insecure warnings for two uses, want 2", n)
	}
	if !strings.Contains(logs, "INSECURE: no DIGESTS") {
		t.Errorf("no warning about the missing DIGESTS:\n%s", logs)
	}
}

func TestBuildTreeWrongKernel(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
	_, err := e.fetcher(t).BuildTree(context.Background(), rel, "6.6.61-flatcar", e.dest)
	if !errors.Is(err, flatcar.ErrNoBuildTree) || !strings.Contains(err.Error(), kver) {
		t.Fatalf("BuildTree = %v, want ErrNoBuildTree naming %s", err, kver)
	}
	e.assertClean(t)
}

func TestBuildTreeDestination(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
	if err := os.MkdirAll(filepath.Join(e.dest, "keep"), 0o755); err != nil {
		t.Fatal(err)
	}
	f := e.fetcher(t)
	if _, err := f.BuildTree(context.Background(), rel, kver, e.dest); !errors.Is(err, flatcar.ErrInvalid) {
		t.Fatalf("non-empty dest: %v, want ErrInvalid", err)
	}
	if _, err := os.Stat(filepath.Join(e.dest, "keep")); err != nil {
		t.Errorf("existing content touched: %v", err)
	}
	// An existing empty directory is used, and kept (emptied) on failure.
	empty := filepath.Join(t.TempDir(), "empty")
	if err := os.Mkdir(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := f.BuildTree(context.Background(), rel, "9.9.9", empty); !errors.Is(err, flatcar.ErrNoBuildTree) {
		t.Fatalf("BuildTree = %v, want ErrNoBuildTree", err)
	}
	if ents, err := os.ReadDir(empty); err != nil || len(ents) != 0 {
		t.Errorf("given empty dest: %v %v, want it kept and empty", ents, err)
	}
	for _, bad := range []string{"", "..", "a/b"} {
		if _, err := f.BuildTree(context.Background(), rel, bad, e.dest); !errors.Is(err, flatcar.ErrInvalid) {
			t.Errorf("kernel release %q: %v, want ErrInvalid", bad, err)
		}
	}
}

// writeRelease writes a whole, validly signed release (tarball and DIGESTS.asc) into dir, as a
// file mirror (or an attacker who knows a file on the node) would have it, and returns dir.
func writeRelease(t *testing.T, e *env, dir string) string {
	t.Helper()
	tb := tarball(t, flatcartest.ContainerTree(kver, buildTree(t)))
	d, err := flatcartest.Digests(flatcartest.ContainerImage, bytes.NewReader(tb))
	if err != nil {
		t.Fatal(err)
	}
	asc, err := e.key.ClearSign(d)
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range map[string][]byte{flatcartest.ContainerImage: tb, flatcartest.ContainerImage + ".DIGESTS.asc": asc} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestBuildTreeFileMirror(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	mirror := t.TempDir()
	dir := filepath.Join(mirror, "lts", rel.Board, rel.Version)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeRelease(t, e, dir)
	f := e.fetcher(t, func(o *flatcar.Options) { o.URLs = []string{"file://" + mirror + "/{channel}/{board}/{version}/"} })
	tree, err := f.BuildTree(context.Background(), rel, kver, e.dest)
	if err != nil {
		t.Fatal(err)
	}
	if !tree.Verified || tree.Release.Channel != "lts" {
		t.Errorf("Tree %+v, want verified, from lts", tree)
	}
}

func TestCandidates(t *testing.T) {
	t.Parallel()
	f, err := flatcar.New(flatcar.Options{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := f.Candidates(flatcar.Release{Channel: "beta", Board: "arm64-usr", Version: "3510.3.1"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"https://beta.release.flatcar-linux.net/arm64-usr/3510.3.1/",
		"https://lts.release.flatcar-linux.net/arm64-usr/3510.3.1/",
		"https://stable.release.flatcar-linux.net/arm64-usr/3510.3.1/",
		"https://alpha.release.flatcar-linux.net/arm64-usr/3510.3.1/",
		"https://bincache.flatcar-linux.net/images/arm64/3510.3.1/",
	}
	if !slices.Equal(got, want) {
		t.Errorf("Candidates =\n%q\nwant\n%q", got, want)
	}
	got, _ = f.Candidates(flatcar.Release{Board: "amd64-usr", Version: "4593.0.0"})
	if got[0] != "https://alpha.release.flatcar-linux.net/amd64-usr/4593.0.0/" {
		t.Errorf("without a channel the version's comes first: %q", got)
	}
	for _, r := range []flatcar.Release{
		{Channel: "edge", Board: "amd64-usr", Version: "1.2.3"},
		{Channel: "stable", Board: "../x", Version: "1.2.3"},
		{Channel: "stable", Board: "amd64-usr", Version: "current"},
		{Channel: "stable", Board: "amd64-usr", Version: "1.2.3/../../x"},
	} {
		if _, err := f.Candidates(r); !errors.Is(err, flatcar.ErrInvalid) {
			t.Errorf("Candidates(%+v) = %v, want ErrInvalid", r, err)
		}
	}
}

func TestNewRejectsBadOptions(t *testing.T) {
	t.Parallel()
	for name, o := range map[string]flatcar.Options{
		"placeholder": {URLs: []string{"https://m.example/{channel}/{release}/"}},
		"scheme":      {URLs: []string{"ftp://m.example/{version}/"}},
		"no host":     {URLs: []string{"https:///{version}/"}},
		"keyring":     {Keyring: []byte("not a key")},
	} {
		if _, err := flatcar.New(o); !errors.Is(err, flatcar.ErrInvalid) {
			t.Errorf("%s: New = %v, want ErrInvalid", name, err)
		}
	}
}

func TestEmbeddedKey(t *testing.T) {
	t.Parallel()
	el, err := flatcar.ReadKeyring(flatcar.SigningKey())
	if err != nil {
		t.Fatal(err)
	}
	if len(el) != 1 {
		t.Fatalf("%d keys, want 1", len(el))
	}
	if fp := strings.ToUpper(hex.EncodeToString(el[0].PrimaryKey.Fingerprint)); fp != flatcar.SigningKeyFingerprint {
		t.Errorf("primary fingerprint %s, want %s", fp, flatcar.SigningKeyFingerprint)
	}
	var signing []string
	for _, s := range el[0].Subkeys {
		if s.Sig.FlagsValid && s.Sig.FlagSign {
			signing = append(signing, strings.ToUpper(hex.EncodeToString(s.PublicKey.Fingerprint)))
		}
	}
	if !slices.Contains(signing, "52F145DFD00BBDCD928CBB5A32DA80F91EF52974") || len(signing) != 9 {
		t.Errorf("signing subkeys %v: want all 9, with the 2025 subkey 52F145DF...", signing)
	}
}

// TestBuildTreeStalledServer: a server that stops sending in the middle of
// the body, and then never answers the resuming request, ends in an error
// instead of a hang (StallTimeout, ResponseTimeout).
func TestBuildTreeStalledServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.publish(t, "stable", tarball(t, flatcartest.ContainerTree(kver, buildTree(t))))
	etag := e.srv.ETag(imagePath("stable"))
	e.srv.SetHook(func(w http.ResponseWriter, r *http.Request, data io.ReadSeeker) bool {
		if r.URL.Path != imagePath("stable") {
			return false
		}
		if r.Header.Get("Range") == "" {
			size, _ := data.Seek(0, io.SeekEnd)
			_, _ = data.Seek(0, io.SeekStart)
			w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
			w.Header().Set("ETag", etag)
			_, _ = io.CopyN(w, data, size/2)
			w.(http.Flusher).Flush()
		}
		<-r.Context().Done()
		return true
	})
	f := e.fetcher(t, func(o *flatcar.Options) {
		o.StallTimeout, o.ResponseTimeout, o.Retries = 50*time.Millisecond, 50*time.Millisecond, 1
	})
	_, err := f.BuildTree(context.Background(), rel, kver, e.dest)
	if !errors.Is(err, flatcar.ErrUnreachable) || !strings.Contains(err.Error(), "resume") {
		t.Fatalf("BuildTree = %v, want ErrUnreachable from the resuming request", err)
	}
	if !strings.Contains(e.logs.String(), "no data for 50ms") {
		t.Errorf("the stall is not logged:\n%s", e.logs.String())
	}
	e.assertClean(t)
}
