// Package flatcar downloads the kernel build tree of a Flatcar release from
// Flatcar's release servers, verified.
//
// A Flatcar release publishes flatcar-container.tar.gz, the whole OS tree,
// which carries usr/lib/modules/<kernel release>/build (the tree that
// out-of-tree modules are built against) and usr/lib64 (the glibc that the
// build helpers in that tree are linked against). Next to it are
// flatcar-container.tar.gz.DIGESTS, in Gentoo format, and
// flatcar-container.tar.gz.DIGESTS.asc, the same clear-signed with the
// Flatcar image signing key.
//
// Fetcher.BuildTree looks for the release on each base URL in turn (the
// node's channel first, then the other channels, then the build cache),
// verifies the OpenPGP signature of the .DIGESTS.asc against the embedded
// key (or a given keyring), and streams the tarball once, without a
// temporary copy: HTTP body -> SHA512 -> gunzip -> tar, extracting only the
// build tree, the modules.* files and the top level of usr/lib64 into a
// staging directory inside the destination. The staging directory is renamed
// into place only after the whole body has been read and its SHA512 equals
// the signed one; on any failure everything extracted is removed.
package flatcar

import (
	"context"
	"crypto/sha512"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ProtonMail/go-crypto/openpgp"
	"github.com/ProtonMail/go-crypto/openpgp/clearsign"
	"github.com/klauspost/compress/gzip"

	"github.com/driver-agent/driver-agent/pkg/extract"
)

// ContainerImage is the name of the release file that carries the OS tree.
const ContainerImage = "flatcar-container.tar.gz"

// Defaults for the zero fields of Options.
const (
	DefaultConnectTimeout   = 30 * time.Second
	DefaultResponseTimeout  = 60 * time.Second
	DefaultStallTimeout     = 60 * time.Second
	DefaultRetries          = 3
	DefaultRetryBase        = time.Second
	DefaultRetryMax         = 15 * time.Second
	DefaultProgressInterval = 10 * time.Second
	// DefaultMaxDownloadSize bounds the tarball (377 MiB for 4593.2.5).
	DefaultMaxDownloadSize int64 = 4 << 30
	// DefaultMaxExtractSize bounds what is extracted from it.
	DefaultMaxExtractSize int64 = 8 << 30
)

// Sentinel errors; test with errors.Is.
var (
	// ErrVerify means the download could not be shown to be the published
	// file: a bad or unknown signature, no SHA512 line for the file, a
	// digest mismatch, a truncated or oversized body, or a corrupt archive.
	ErrVerify = errors.New("verification failed")
	// ErrNotFound means no base URL has the release (every one answered 404).
	ErrNotFound = errors.New("flatcar release not found")
	// ErrUnreachable means a server could not be reached or refused the
	// request, after retries.
	ErrUnreachable = errors.New("release server unreachable")
	// ErrNoBuildTree means the release's tarball has no build tree for the
	// kernel release asked for.
	ErrNoBuildTree = errors.New("no kernel build tree in the release")
	// ErrRedirect means a server redirected to a URL that is not http or
	// https (a file:// URL would make a remote answer read the node's own
	// files); it is not retried, nor are other servers tried.
	ErrRedirect = errors.New("redirect refused")
	// ErrInvalid means a bad argument or option.
	ErrInvalid = errors.New("invalid input")
)

// Options configures a Fetcher. The zero value downloads from Flatcar's
// servers and verifies with the embedded key.
type Options struct {
	// URLs are templates of the base URLs of a release's directory, tried
	// in order. Placeholders: {channel} (a template with it is tried once
	// per channel: the release's own, the one its version belongs to, then
	// stable, beta, alpha, lts), {board} (amd64-usr), {arch} (amd64) and
	// {version} (4593.2.0). http, https and file URLs work; a server's
	// redirect is followed only to http and https URLs. Empty means
	// DefaultURLs(). A mirror that copies the release server's layout is
	// "https://mirror.example/flatcar/{channel}/{board}/{version}/".
	URLs []string
	// Keyring is an OpenPGP public keyring (armored or binary) that replaces
	// the embedded Flatcar image signing key.
	Keyring []byte
	// InsecureSkipVerify skips the signature check. The digest from an
	// unverified .DIGESTS.asc is still compared when there is one. Each use
	// logs a warning.
	InsecureSkipVerify bool
	// Client makes the requests; nil means a client that honours
	// HTTPS_PROXY/HTTP_PROXY/NO_PROXY and the timeouts below. Either way
	// the Fetcher refuses redirects to other schemes than http and https.
	Client *http.Client
	// ConnectTimeout bounds connecting, including TLS (default 30s).
	ConnectTimeout time.Duration
	// ResponseTimeout bounds the wait for response headers (default 60s).
	ResponseTimeout time.Duration
	// StallTimeout bounds the wait for the next bytes of every body, the
	// DIGESTS as much as the tarball (default 60s).
	StallTimeout time.Duration
	// Retries is the number of retries after a network error or a 5xx
	// answer, and of resumed requests after a broken download (default 3,
	// negative for none).
	Retries int
	// RetryBase and RetryMax shape the backoff between retries: RetryBase
	// doubled per retry, capped at RetryMax, with jitter (defaults 1s, 15s).
	RetryBase, RetryMax time.Duration
	// MaxDownloadSize bounds the tarball (default 4 GiB).
	MaxDownloadSize int64
	// MaxExtractSize bounds the files extracted from it (default 8 GiB).
	MaxExtractSize int64
	// ProgressInterval is the interval of the progress log records
	// (default 10s, negative for none).
	ProgressInterval time.Duration
	// Progress, when set (to a terminal), gets a one-line progress bar.
	Progress io.Writer
	// Log receives progress and warnings; nil discards them.
	Log *slog.Logger
}

// Fetcher downloads Flatcar kernel build trees. It is safe for concurrent
// use, with a different destination per call.
type Fetcher struct {
	opts    Options
	log     *slog.Logger
	client  *http.Client
	keyring openpgp.EntityList
}

// New checks opts and returns a Fetcher.
func New(opts Options) (*Fetcher, error) {
	if len(opts.URLs) == 0 {
		opts.URLs = DefaultURLs()
	} else {
		opts.URLs = slices.Clone(opts.URLs)
	}
	if err := checkTemplates(opts.URLs); err != nil {
		return nil, err
	}
	setDefault(&opts.ConnectTimeout, DefaultConnectTimeout)
	setDefault(&opts.ResponseTimeout, DefaultResponseTimeout)
	setDefault(&opts.StallTimeout, DefaultStallTimeout)
	setDefault(&opts.RetryBase, DefaultRetryBase)
	setDefault(&opts.RetryMax, DefaultRetryMax)
	setDefault(&opts.ProgressInterval, DefaultProgressInterval)
	setDefault(&opts.MaxDownloadSize, DefaultMaxDownloadSize)
	setDefault(&opts.MaxExtractSize, DefaultMaxExtractSize)
	switch {
	case opts.Retries == 0:
		opts.Retries = DefaultRetries
	case opts.Retries < 0:
		opts.Retries = 0
	}
	f := &Fetcher{opts: opts, log: opts.Log, client: opts.Client}
	if f.log == nil {
		f.log = slog.New(slog.DiscardHandler)
	}
	if f.client == nil {
		f.client = newClient(&f.opts)
	}
	f.client = httpRedirectsOnly(f.client)
	key := opts.Keyring
	if key == nil {
		key = signingKey
	}
	var err error
	if f.keyring, err = ReadKeyring(key); err != nil {
		return nil, fmt.Errorf("%w: signing key: %w", ErrInvalid, err)
	}
	return f, nil
}

func setDefault[T time.Duration | int64](v *T, d T) {
	if *v == 0 {
		*v = d
	}
}

// Tree is a kernel build tree extracted from a Flatcar release.
type Tree struct {
	// Root is the destination given to BuildTree; it holds usr/.
	Root string
	// KernelRelease is the kernel release the tree is for.
	KernelRelease string
	// ModulesDir is Root/usr/lib/modules/<kernel release> (or
	// Root/usr/lib64/modules/<kernel release> on releases up to 3115).
	ModulesDir string
	// BuildDir is ModulesDir/build, the SYSSRC of an out-of-tree build.
	BuildDir string
	// LibDir is Root/usr/lib64, Flatcar's glibc and the libraries the
	// build helpers in BuildDir need; "" if the release has none.
	LibDir string
	// Loader is the dynamic loader in LibDir (ld-linux-x86-64.so.2 on
	// amd64); "" if none was found.
	Loader string
	// Release is the release as found: Channel is the channel whose server
	// had it ("" for a base URL without {channel}).
	Release Release
	// URL is the tarball's URL.
	URL string
	// SHA512 is the hex digest of the tarball, checked against the signed
	// DIGESTS; "" when InsecureSkipVerify found no digest to compare.
	SHA512 string
	// Verified reports whether the digest came from a verified signature.
	Verified bool
	// Signer is the key ID of the signing (sub)key; "" when not verified.
	Signer string
	// Downloaded is the size of the tarball.
	Downloaded int64
	// Extracted counts what was extracted.
	Extracted extract.Result
}

// Candidates returns the base URLs BuildTree tries for rel, in order.
func (f *Fetcher) Candidates(rel Release) ([]string, error) {
	if err := rel.Validate(); err != nil {
		return nil, err
	}
	return urlsOf(expand(f.opts.URLs, rel)), nil
}

// BuildTree downloads the release rel, verifies it and extracts the build
// tree of kernelRelease (usr/lib/modules/<kernelRelease>/build, its source
// link and modules.* files) and the top level of usr/lib64 into dest, which
// must be missing or an empty directory.
//
// The first base URL with a .DIGESTS.asc for the tarball is used; a 404
// moves on to the next, and so does a server unreachable after retries.
// A verification failure stops at once. Errors: ErrNotFound when every base
// URL answered 404, ErrUnreachable when some could not be reached,
// ErrVerify, ErrNoBuildTree, extract.ErrUnsafe or extract.ErrTooLarge for a
// hostile or oversized archive, ErrInvalid, or ctx's error. On error dest
// is removed if BuildTree created it, and emptied otherwise.
func (f *Fetcher) BuildTree(ctx context.Context, rel Release, kernelRelease, dest string) (tree *Tree, err error) {
	if err := rel.Validate(); err != nil {
		return nil, err
	}
	bases := expand(f.opts.URLs, rel)
	if kernelRelease == "" || kernelRelease == "." || kernelRelease == ".." || strings.ContainsAny(kernelRelease, "/\x00") {
		return nil, fmt.Errorf("%w: kernel release %q", ErrInvalid, kernelRelease)
	}
	if f.opts.InsecureSkipVerify {
		f.log.Warn("INSECURE: the signature of the Flatcar release is not verified (insecure skip verify is set); the download may have been tampered with",
			"version", rel.Version, "board", rel.Board)
	}
	created, err := prepareDest(dest)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, cleanDest(dest, created))
		}
	}()

	var notFound, unreachable []error
	for _, base := range bases {
		tree, err := f.fetchFrom(ctx, base, rel, kernelRelease, dest)
		switch {
		case err == nil:
			return tree, nil
		case ctx.Err() != nil:
			return nil, context.Cause(ctx)
		case errors.Is(err, ErrNotFound):
			f.log.Info("Flatcar release not on this server", "url", base.url, "err", err)
			notFound = append(notFound, err)
		case errors.Is(err, ErrUnreachable):
			f.log.Warn("Flatcar release server unreachable", "url", base.url, "err", err)
			unreachable = append(unreachable, err)
		default:
			return nil, err
		}
	}
	if len(unreachable) > 0 {
		return nil, fmt.Errorf("%w (and %d of %d servers do not have it); set the Flatcar release URL (--flatcar-release-url) to a reachable mirror, or provide a kernel build tree",
			errors.Join(unreachable...), len(notFound), len(bases))
	}
	return nil, fmt.Errorf("%w: Flatcar %s %s is on none of %s (every one answered 404); check the version, or set the Flatcar release URL (--flatcar-release-url) to a mirror that has it",
		ErrNotFound, rel.Board, rel.Version, strings.Join(urlsOf(bases), ", "))
}

// prepareDest creates dest or checks that it is an empty directory.
func prepareDest(dest string) (created bool, err error) {
	ents, err := os.ReadDir(dest)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(dest, 0o755); err != nil {
			return false, err
		}
		return true, nil
	case err != nil:
		return false, fmt.Errorf("%w: destination: %w", ErrInvalid, err)
	case len(ents) > 0:
		return false, fmt.Errorf("%w: destination %s is not empty; give a missing or empty directory", ErrInvalid, dest)
	}
	return false, nil
}

func cleanDest(dest string, created bool) error {
	if created {
		return os.RemoveAll(dest)
	}
	ents, err := os.ReadDir(dest)
	for _, e := range ents {
		err = errors.Join(err, os.RemoveAll(filepath.Join(dest, e.Name())))
	}
	return err
}

// want selects the members BuildTree extracts, and records the kernel
// releases the archive has a modules directory for.
type want struct {
	kver string
	mu   sync.Mutex
	seen []string
}

func (w *want) include(name string) bool {
	for _, modules := range []string{"usr/lib/modules/", "usr/lib64/modules/"} {
		rest, ok := strings.CutPrefix(name, modules)
		if !ok {
			continue
		}
		k, sub, _ := strings.Cut(rest, "/")
		if k != w.kver {
			w.mu.Lock()
			if !slices.Contains(w.seen, k) && len(w.seen) < 16 {
				w.seen = append(w.seen, k)
			}
			w.mu.Unlock()
			return false
		}
		return sub == "build" || strings.HasPrefix(sub, "build/") || sub == "source" || strings.HasPrefix(sub, "modules.")
	}
	// The top level of usr/lib64: the loader and the shared libraries.
	rest, ok := strings.CutPrefix(name, "usr/lib64/")
	return name == "usr/lib64" || ok && !strings.Contains(rest, "/")
}

// fetchFrom fetches the release from one base URL.
func (f *Fetcher) fetchFrom(ctx context.Context, base candidate, rel Release, kver, dest string) (*Tree, error) {
	imageURL := base.url + ContainerImage
	rel.Channel = base.channel
	sum, signer, err := f.signedDigest(ctx, imageURL+".DIGESTS.asc")
	if err != nil {
		return nil, err
	}
	staging, err := os.MkdirTemp(dest, ".staging-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(staging)

	b, err := f.openBody(ctx, imageURL)
	if err != nil {
		return nil, err
	}
	defer b.Close()
	f.log.Info("Installing the Flatcar kernel sources into the development environment...",
		"url", imageURL, "bytes", b.size, "kernel", kver, "verified_signature", signer != "")
	h := sha512.New()
	prog := startProgress(f.log, imageURL, b.size, f.opts.ProgressInterval, f.opts.Progress)
	w := &want{kver: kver}
	res, err := f.stream(ctx, io.TeeReader(b, io.MultiWriter(h, prog)), staging, w)
	prog.finish(err == nil)
	if err != nil {
		if b.err != nil { // the root cause; gunzip and tar report it as their own
			return nil, b.err
		}
		if b.off == 0 {
			return nil, emptyBody(imageURL, sum)
		}
		if errors.Is(err, extract.ErrUnsafe) || errors.Is(err, extract.ErrTooLarge) || ctx.Err() != nil {
			return nil, err
		}
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, gzip.ErrChecksum) || errors.Is(err, gzip.ErrHeader) || isCorrupt(err) {
			return nil, fmt.Errorf("%w: %s: %w", ErrVerify, imageURL, err)
		}
		return nil, fmt.Errorf("extract %s: %w", imageURL, err)
	}
	got := h.Sum(nil)
	tree := &Tree{Root: dest, KernelRelease: kver, Release: rel, URL: imageURL, Downloaded: b.off, Extracted: res, Signer: signer, Verified: signer != ""}
	if sum != nil {
		if !slices.Equal(got, sum) {
			return nil, fmt.Errorf("%w: SHA512 of %s is %x, the DIGESTS say %x", ErrVerify, imageURL, got, sum)
		}
		tree.SHA512 = hex.EncodeToString(got)
	}
	_, elapsed, rate := prog.stats()
	f.log.Info("Flatcar release downloaded and verified", "url", imageURL, "bytes", b.off, "elapsed", elapsed.Round(time.Millisecond),
		"rate", mib(rate)+"/s", "sha512", tree.SHA512, "files", res.Files, "extracted_bytes", res.Bytes)
	if err := f.place(staging, dest, tree, w); err != nil {
		return nil, err
	}
	return tree, nil
}

// emptyBody is the error for a release file that came with no bytes at all, given the digest
// that the DIGESTS list for it (nil when there are none).
func emptyBody(u string, sum []byte) error {
	empty := sha512.Sum512(nil)
	switch {
	case sum == nil:
		return fmt.Errorf("%w: %s is empty (0 bytes) and unverified (no DIGESTS): the server sent nothing", ErrVerify, u)
	case slices.Equal(sum, empty[:]):
		return fmt.Errorf("%w: %s is empty (0 bytes), as its signed DIGESTS say: not a Flatcar container image (SHA512 %x is the empty file's)", ErrVerify, u, sum)
	}
	return fmt.Errorf("%w: %s is empty (0 bytes) but the signed DIGESTS give SHA512 %x: the download is not the published file", ErrVerify, u, sum)
}

// stream gunzips and extracts r into staging and reads r to its end, so
// that the hash covers the whole body.
func (f *Fetcher) stream(ctx context.Context, r io.Reader, staging string, w *want) (extract.Result, error) {
	zr, err := gzip.NewReader(r)
	if err != nil {
		return extract.Result{}, err
	}
	res, err := extract.Tar(ctx, zr, staging, extract.Options{
		Include: w.include, RootFS: true, MaxTotalSize: f.opts.MaxExtractSize, Log: f.log,
	})
	if err != nil {
		return res, err
	}
	// What follows the end-of-archive marker: tar's padding to its record
	// size, then the end of the gzip stream.
	const maxTrailer = 1 << 20
	n, err := io.Copy(io.Discard, io.LimitReader(zr, maxTrailer+1))
	if err != nil {
		return res, err
	}
	if n > maxTrailer {
		return res, fmt.Errorf("%w: more than %d bytes after the end of the archive", ErrVerify, maxTrailer)
	}
	if _, err := io.Copy(io.Discard, r); err != nil {
		return res, err
	}
	return res, nil
}

// isCorrupt reports a damaged gzip or tar stream.
func isCorrupt(err error) bool {
	s := err.Error()
	return strings.Contains(s, "flate:") || strings.Contains(s, "archive/tar:") || strings.Contains(s, "gzip:")
}

// place checks the staged tree and renames it into dest.
func (f *Fetcher) place(staging, dest string, tree *Tree, w *want) error {
	var modules string
	for _, m := range []string{"usr/lib/modules", "usr/lib64/modules"} {
		if fi, err := os.Stat(filepath.Join(staging, m, tree.KernelRelease, "build", "Makefile")); err == nil && fi.Mode().IsRegular() {
			modules = path.Join(m, tree.KernelRelease)
			break
		}
	}
	if modules == "" {
		w.mu.Lock()
		seen := slices.Clone(w.seen)
		w.mu.Unlock()
		return fmt.Errorf("%w: %s has no usr/lib/modules/%s/build/Makefile (kernels in it: %s); the node's kernel does not belong to this Flatcar release",
			ErrNoBuildTree, tree.URL, tree.KernelRelease, strings.Join(seen, ", "))
	}
	if err := os.Rename(filepath.Join(staging, "usr"), filepath.Join(dest, "usr")); err != nil {
		return err
	}
	tree.ModulesDir = filepath.Join(dest, modules)
	tree.BuildDir = filepath.Join(tree.ModulesDir, "build")
	lib := filepath.Join(dest, "usr", "lib64")
	if fi, err := os.Stat(lib); err == nil && fi.IsDir() {
		tree.LibDir = lib
		loaders, _ := filepath.Glob(filepath.Join(lib, "ld-linux*.so*"))
		if len(loaders) > 0 {
			tree.Loader = loaders[0]
		}
	}
	return nil
}

// signedDigest fetches a .DIGESTS.asc, verifies it and returns the SHA512
// of the file it is for and the signer. With InsecureSkipVerify the
// signature is not checked and a missing file is no error (nil digest).
func (f *Fetcher) signedDigest(ctx context.Context, u string) (sum []byte, signer string, err error) {
	// Read through body like the tarball: StallTimeout bounds the wait for each byte.
	b, err := f.openBody(ctx, u)
	if err != nil {
		if f.opts.InsecureSkipVerify && errors.Is(err, ErrNotFound) {
			f.log.Warn("INSECURE: no DIGESTS for the Flatcar release; its integrity is not checked", "url", u)
			return nil, "", nil
		}
		return nil, "", err
	}
	defer b.Close()
	b.broken = ErrUnreachable // another server may have them
	const maxDigests = 1 << 20
	data, err := io.ReadAll(io.LimitReader(b, maxDigests+1))
	if err != nil {
		return nil, "", err
	}
	if len(data) > maxDigests {
		return nil, "", fmt.Errorf("%w: %s is larger than %d bytes", ErrVerify, u, maxDigests)
	}
	file := path.Base(strings.TrimSuffix(u, ".DIGESTS.asc"))
	var text []byte
	if f.opts.InsecureSkipVerify {
		f.log.Warn("INSECURE: using the Flatcar DIGESTS without checking their signature", "url", u)
		text = data
		if b, _ := clearsign.Decode(data); b != nil {
			text = b.Plaintext
		}
	} else if text, signer, err = verifyClearSigned(f.keyring, data, time.Now()); err != nil {
		return nil, "", fmt.Errorf("%s: %w", u, err)
	}
	d, err := ParseDigests(text)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", u, err)
	}
	if sum, err = d.SHA512(file); err != nil {
		return nil, "", fmt.Errorf("%s: %w", u, err)
	}
	return sum, signer, nil
}
