package flatcar

import (
	"context"
	"crypto/sha512"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/host"
)

// KernelImage is the release's kernel, whose banner names the kernel release its build tree is
// for.
const KernelImage = "flatcar_production_image.vmlinuz"

// File downloads the release file name (KernelImage, say) to dest, verified against the release's
// clear-signed <name>.DIGESTS.asc like BuildTree's tarball, trying the base URLs in the same order.
// It writes a temporary file next to dest and renames it into place only after the digest
// matched; on error dest is not created. It returns the URL it used.
func (f *Fetcher) File(ctx context.Context, rel Release, name, dest string) (string, error) {
	if err := rel.Validate(); err != nil {
		return "", err
	}
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return "", fmt.Errorf("%w: file name %q", ErrInvalid, name)
	}
	if f.opts.InsecureSkipVerify {
		f.log.Warn("INSECURE: the signature of the Flatcar release is not verified (insecure skip verify is set); the download may have been tampered with",
			"version", rel.Version, "file", name)
	}
	bases := expand(f.opts.URLs, rel)
	var notFound, unreachable []error
	for _, base := range bases {
		u := base.url + name
		err := f.fileFrom(ctx, u, dest)
		switch {
		case err == nil:
			return u, nil
		case ctx.Err() != nil:
			return "", context.Cause(ctx)
		case errors.Is(err, ErrNotFound):
			notFound = append(notFound, err)
		case errors.Is(err, ErrUnreachable):
			f.log.Warn("Flatcar release server unreachable", "url", base.url, "err", err)
			unreachable = append(unreachable, err)
		default:
			return "", err
		}
	}
	if len(unreachable) > 0 {
		return "", fmt.Errorf("%w (and %d of %d servers do not have it); set the Flatcar release URL (--flatcar-release-url) to a reachable mirror",
			errors.Join(unreachable...), len(notFound), len(bases))
	}
	return "", fmt.Errorf("%w: %s of Flatcar %s %s is on none of %s (every one answered 404)",
		ErrNotFound, name, rel.Board, rel.Version, strings.Join(urlsOf(bases), ", "))
}

func (f *Fetcher) fileFrom(ctx context.Context, u, dest string) error {
	sum, signer, err := f.signedDigest(ctx, u+".DIGESTS.asc")
	if err != nil {
		return err
	}
	b, err := f.openBody(ctx, u)
	if err != nil {
		return err
	}
	defer b.Close()
	var n int64
	err = host.WriteAtomicFrom(dest, 0o600, func(w io.Writer) error {
		h := sha512.New()
		prog := startProgress(f.log, u, b.size, f.opts.ProgressInterval, f.opts.Progress)
		var err error
		n, err = io.Copy(io.MultiWriter(w, h, prog), io.LimitReader(b, f.opts.MaxDownloadSize+1))
		prog.finish(err == nil)
		switch {
		case b.err != nil:
			return b.err
		case err != nil:
			return fmt.Errorf("download %s: %w", u, err)
		case n > f.opts.MaxDownloadSize:
			return fmt.Errorf("%w: %s is larger than %d bytes", ErrVerify, u, f.opts.MaxDownloadSize)
		case sum != nil && !slices.Equal(h.Sum(nil), sum):
			return fmt.Errorf("%w: SHA512 of %s is %x, the DIGESTS say %x", ErrVerify, u, h.Sum(nil), sum)
		}
		return nil
	})
	if err != nil {
		return err
	}
	f.log.Info("Flatcar release file downloaded", "url", u, "bytes", n, "verified_signature", signer != "")
	return nil
}
