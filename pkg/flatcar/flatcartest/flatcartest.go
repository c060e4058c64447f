// Package flatcartest serves fake Flatcar releases on loopback for tests.
//
// A Server lays releases out as Flatcar's release server does,
// <channel>/<board>/<version>/flatcar-container.tar.gz with its .DIGESTS
// (Gentoo format: MD5, SHA1 and SHA512 sections) and .DIGESTS.asc (the same
// clear-signed), signed with a Key generated for the test, whose armored
// public key a flatcar.Fetcher takes as its keyring. ContainerTree and
// WriteTarball make a flatcar-container.tar.gz from a kernel build tree,
// for instance Debian's /usr/src/linux-headers-* read with DirEntries.
package flatcartest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/md5"
	"crypto/sha1"
	"crypto/sha256"
	"crypto/sha512"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ProtonMail/go-crypto/openpgp"
	"github.com/ProtonMail/go-crypto/openpgp/armor"
	"github.com/ProtonMail/go-crypto/openpgp/clearsign"
	"github.com/ProtonMail/go-crypto/openpgp/packet"
)

// ContainerImage is the tarball's name on the release server.
const ContainerImage = "flatcar-container.tar.gz"

// Key is an OpenPGP key generated for a test: an EdDSA primary key with a
// signing subkey, which signs, as Flatcar's key is used.
type Key struct {
	entity *openpgp.Entity
}

// NewKey generates a key.
func NewKey(name string) (*Key, error) {
	cfg := &packet.Config{Algorithm: packet.PubKeyAlgoEdDSA}
	e, err := openpgp.NewEntity(name, "test", "test@example.invalid", cfg)
	if err != nil {
		return nil, err
	}
	if err := e.AddSigningSubkey(cfg); err != nil {
		return nil, err
	}
	return &Key{entity: e}, nil
}

// Fingerprint is the primary key's fingerprint in upper-case hex.
func (k *Key) Fingerprint() string { return fmt.Sprintf("%X", k.entity.PrimaryKey.Fingerprint) }

// ArmoredPublicKey returns the public key with its subkeys, armored.
func (k *Key) ArmoredPublicKey() []byte {
	var b bytes.Buffer
	w, err := armor.Encode(&b, openpgp.PublicKeyType, nil)
	if err != nil {
		panic(err) // writing to a buffer
	}
	if err := k.entity.Serialize(w); err != nil {
		panic(err)
	}
	w.Close()
	return b.Bytes()
}

// ClearSign returns text clear-signed with the key's signing subkey.
func (k *Key) ClearSign(text []byte) ([]byte, error) {
	signer, ok := k.entity.SigningKey(time.Now())
	if !ok {
		return nil, errors.New("no signing key")
	}
	var b bytes.Buffer
	w, err := clearsign.Encode(&b, signer.PrivateKey, nil)
	if err != nil {
		return nil, err
	}
	if _, err := w.Write(text); err != nil {
		return nil, err
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// Digests returns a DIGESTS file for name as Flatcar's make_digests writes
// it, from the contents read from r.
func Digests(name string, r io.Reader) ([]byte, error) {
	hs := []struct {
		algo string
		h    hash.Hash
	}{{"MD5", md5.New()}, {"SHA1", sha1.New()}, {"SHA512", sha512.New()}}
	ws := make([]io.Writer, len(hs))
	for i := range hs {
		ws[i] = hs[i].h
	}
	if _, err := io.Copy(io.MultiWriter(ws...), r); err != nil {
		return nil, err
	}
	var b bytes.Buffer
	for _, h := range hs {
		fmt.Fprintf(&b, "# %s HASH\n%x  %s\n", h.algo, h.h.Sum(nil), name)
	}
	return b.Bytes(), nil
}

// Server is a fake release server on loopback.
type Server struct {
	// URL is the server's base URL, http://127.0.0.1:<port>.
	URL string
	// Key signs the DIGESTS of what Publish publishes.
	Key *Key

	srv      *httptest.Server
	mu       sync.Mutex
	files    map[string]content
	hook     func(w http.ResponseWriter, r *http.Request, data io.ReadSeeker) bool
	requests []string
}

type content struct {
	data []byte
	file string // served from disk when set
	etag string
}

// NewServer starts a server whose releases key signs.
func NewServer(key *Key) *Server {
	s := &Server{Key: key, files: map[string]content{}}
	s.srv = httptest.NewServer(http.HandlerFunc(s.serve))
	s.URL = s.srv.URL
	return s
}

// Close stops the server.
func (s *Server) Close() { s.srv.Close() }

// URLTemplate is the flatcar.Options URL template for this server's release
// layout: URL/{channel}/{board}/{version}/.
func (s *Server) URLTemplate() string { return s.URL + "/{channel}/{board}/{version}/" }

// BincacheTemplate is the template of the build-cache layout on this
// server: URL/images/{arch}/{version}/.
func (s *Server) BincacheTemplate() string { return s.URL + "/images/{arch}/{version}/" }

// ReleaseDir is the path of a release's directory on the server.
func ReleaseDir(channel, board, version string) string {
	return "/" + channel + "/" + board + "/" + version + "/"
}

// Put serves data at urlPath (e.g. "/stable/amd64-usr/1.2.3/x").
func (s *Server) Put(urlPath string, data []byte) {
	sum := sha256.Sum256(data)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.files[urlPath] = content{data: data, etag: fmt.Sprintf(`"%x"`, sum[:8])}
}

// PutFile serves the file at file from urlPath; it is read at each request.
func (s *Server) PutFile(urlPath, file string) error {
	fi, err := os.Stat(file)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.files[urlPath] = content{file: file, etag: fmt.Sprintf(`"%x-%x"`, fi.Size(), fi.ModTime().UnixNano())}
	return nil
}

// ETag returns the entity tag the server sends for urlPath ("" if none).
func (s *Server) ETag(urlPath string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.files[urlPath].etag
}

// Remove stops serving urlPath.
func (s *Server) Remove(urlPath string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.files, urlPath)
}

// Publish serves tarball as flatcar-container.tar.gz in dir (ReleaseDir or
// any other directory path ending in "/"), with its DIGESTS and their clear
// signature by s.Key.
func (s *Server) Publish(dir string, tarball []byte) error {
	return s.PublishAs(dir, ContainerImage, tarball)
}

// PublishAs serves data as the release file name in dir, with its DIGESTS and their clear
// signature by s.Key.
func (s *Server) PublishAs(dir, name string, data []byte) error {
	if err := s.publishDigests(dir, name, bytes.NewReader(data)); err != nil {
		return err
	}
	s.Put(dir+name, data)
	return nil
}

// PublishFile is Publish for a tarball on disk.
func (s *Server) PublishFile(dir, file string) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := s.publishDigests(dir, ContainerImage, f); err != nil {
		return err
	}
	return s.PutFile(dir+ContainerImage, file)
}

func (s *Server) publishDigests(dir, name string, r io.Reader) error {
	d, err := Digests(name, r)
	if err != nil {
		return err
	}
	asc, err := s.Key.ClearSign(d)
	if err != nil {
		return err
	}
	s.Put(dir+name+".DIGESTS", d)
	s.Put(dir+name+".DIGESTS.asc", asc)
	return nil
}

// SetHook installs h, which sees every request first, with the content
// at its path (nil when none), and handles it when it returns true.
// Tests use it to inject errors, truncation and stalls.
func (s *Server) SetHook(h func(w http.ResponseWriter, r *http.Request, data io.ReadSeeker) bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hook = h
}

// Requests returns the paths requested so far, with " range" appended for
// range requests.
func (s *Server) Requests() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.requests...)
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	c, ok := s.files[r.URL.Path]
	hook := s.hook
	req := r.URL.Path
	if r.Header.Get("Range") != "" {
		req += " range"
	}
	s.requests = append(s.requests, req)
	s.mu.Unlock()
	var rs io.ReadSeeker
	if ok {
		if c.file != "" {
			f, err := os.Open(c.file)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			defer f.Close()
			rs = f
		} else {
			rs = bytes.NewReader(c.data)
		}
	}
	if hook != nil && hook(w, r, rs) {
		return
	}
	if !ok {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("ETag", c.etag)
	http.ServeContent(w, r, path.Base(r.URL.Path), time.Time{}, rs)
}

// Entry is one member of a tarball.
type Entry struct {
	// Name is the member name, e.g. "./usr/lib64/libc.so.6".
	Name string
	// Type is a tar type flag; zero means a regular file.
	Type byte
	// Mode is the permission bits; zero means 0644 (0755 for directories).
	Mode int64
	// Body is a regular file's contents, unless Source is set.
	Body []byte
	// Source is a file whose contents are the member's, read when written.
	Source string
	// Linkname is a link's target.
	Linkname string
}

// ContainerTree returns the members of a flatcar-container.tar.gz-like
// tarball for kernel release kver: the given build tree (names relative to
// the build directory) under ./usr/lib/modules/<kver>/build/, with the
// "source" link, modules.dep and a kernel module next to it, a stand-in
// loader and glibc in ./usr/lib64, and files elsewhere that a build does
// not need (./usr/bin, ./usr/lib64/systemd, another kernel's modules).
func ContainerTree(kver string, build []Entry) []Entry {
	mod := "./usr/lib/modules/" + kver + "/"
	es := []Entry{
		{Name: "./", Type: tar.TypeDir},
		{Name: "./usr/", Type: tar.TypeDir},
		{Name: "./usr/bin/", Type: tar.TypeDir},
		{Name: "./usr/bin/bash", Mode: 0o755, Body: []byte("#!stand-in bash\n")},
		{Name: "./usr/lib/", Type: tar.TypeDir},
		{Name: "./usr/lib/modules/", Type: tar.TypeDir},
		{Name: mod, Type: tar.TypeDir},
		{Name: mod + "build/", Type: tar.TypeDir},
	}
	for _, e := range build {
		e.Name = mod + "build/" + strings.TrimPrefix(e.Name, "./")
		es = append(es, e)
	}
	es = append(es,
		Entry{Name: mod + "source", Type: tar.TypeSymlink, Linkname: "build"},
		Entry{Name: mod + "modules.dep", Body: []byte("kernel/drivers/dummy.ko:\n")},
		Entry{Name: mod + "kernel/drivers/dummy.ko", Body: bytes.Repeat([]byte{0x7f}, 4096)},
		Entry{Name: "./usr/lib/modules/0.0.1-other/modules.dep", Body: []byte{}},
		Entry{Name: "./usr/lib64/", Type: tar.TypeDir},
		Entry{Name: "./usr/lib64/ld-linux-x86-64.so.2", Mode: 0o755, Body: []byte("\x7fELF stand-in loader")},
		Entry{Name: "./usr/lib64/libc.so.6", Mode: 0o755, Body: []byte("\x7fELF stand-in libc")},
		Entry{Name: "./usr/lib64/libc.so", Type: tar.TypeSymlink, Linkname: "/usr/lib64/libc.so.6"},
		Entry{Name: "./usr/lib64/systemd/libsystemd-shared.so", Body: []byte("not needed")},
		Entry{Name: "./lib64", Type: tar.TypeSymlink, Linkname: "usr/lib64"},
	)
	return es
}

// DirEntries returns the members for the tree at dir, with names relative to
// it, in a stable order. Symbolic links that stay inside dir are kept;
// those that lead outside it are replaced by what they point to, so that a
// tree made of links into a sibling directory (Debian's
// linux-headers-<kver>-amd64, which links into linux-headers-<kver>-common)
// becomes self-contained. File contents are read when the tarball is written.
func DirEntries(dir string) ([]Entry, error) {
	root, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return nil, err
	}
	var out []Entry
	var walk func(real, name string, depth int) error
	walk = func(real, name string, depth int) error {
		if depth > 8 {
			return fmt.Errorf("%s: too many nested directory links", real)
		}
		ents, err := os.ReadDir(real)
		if err != nil {
			return err
		}
		for _, e := range ents {
			p, n := filepath.Join(real, e.Name()), path.Join(name, e.Name())
			fi, err := os.Lstat(p)
			if err != nil {
				return err
			}
			followed := 0
			if fi.Mode()&fs.ModeSymlink != 0 {
				followed = 1
				target, err := os.Readlink(p)
				if err != nil {
					return err
				}
				if !filepath.IsAbs(target) && inside(root, filepath.Join(real, target)) {
					out = append(out, Entry{Name: n, Type: tar.TypeSymlink, Linkname: target})
					continue
				}
				if fi, err = os.Stat(p); err != nil {
					continue // dangling: leave it out
				}
				if p, err = filepath.EvalSymlinks(p); err != nil {
					return err
				}
			}
			switch {
			case fi.IsDir():
				out = append(out, Entry{Name: n + "/", Type: tar.TypeDir, Mode: int64(fi.Mode().Perm())})
				if err := walk(p, n, depth+followed); err != nil {
					return err
				}
			case fi.Mode().IsRegular():
				out = append(out, Entry{Name: n, Type: tar.TypeReg, Mode: int64(fi.Mode().Perm()), Source: p})
			}
		}
		return nil
	}
	if err := walk(root, "", 0); err != nil {
		return nil, err
	}
	return out, nil
}

func inside(root, p string) bool {
	p = filepath.Clean(p)
	return p == root || strings.HasPrefix(p, root+string(filepath.Separator))
}

// WriteTarball writes entries as a gzipped tar to w, as `tar -czf` would.
func WriteTarball(w io.Writer, entries []Entry) error {
	zw := gzip.NewWriter(w)
	tw := tar.NewWriter(zw)
	mtime := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, e := range entries {
		h := &tar.Header{Name: e.Name, Typeflag: e.Type, Mode: e.Mode, Linkname: e.Linkname, ModTime: mtime, Format: tar.FormatGNU}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		if err := writeEntry(tw, h, e); err != nil {
			return fmt.Errorf("%s: %w", e.Name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return zw.Close()
}

func writeEntry(tw *tar.Writer, h *tar.Header, e Entry) error {
	if h.Typeflag != tar.TypeReg {
		return tw.WriteHeader(h)
	}
	if e.Source == "" {
		h.Size = int64(len(e.Body))
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err := tw.Write(e.Body)
		return err
	}
	f, err := os.Open(e.Source)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	h.Size = fi.Size()
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	_, err = io.Copy(tw, f)
	return err
}

// Tarball returns entries as a gzipped tar.
func Tarball(entries []Entry) ([]byte, error) {
	var b bytes.Buffer
	if err := WriteTarball(&b, entries); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}
