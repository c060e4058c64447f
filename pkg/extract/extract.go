// Package extract unpacks tar archives from untrusted sources safely.
//
// Tar reads a tar stream once, from start to end-of-archive, and writes the
// members a filter selects into an empty destination directory. Every write
// goes through an os.Root opened on that directory, and every member is
// checked before anything is written for it:
//
//   - member names must be relative and clean: an absolute name, or a name
//     with a ".." (or "." or empty) element, is rejected, not cleaned. A
//     single leading "./", as in archives made with `tar -C dir .`, is
//     accepted and removed;
//   - no member may be written through a symbolic link extracted earlier;
//   - a symbolic link whose target leaves the destination is rejected; the
//     check follows the links the archive itself creates, so a chain of
//     links cannot escape either. Absolute targets are rejected unless
//     Options.RootFS says the archive is a root file system, in which case
//     they are rewritten relative to the link, inside the destination;
//   - a hard link must name a regular file extracted earlier;
//   - character and block devices and FIFOs are rejected;
//   - the size of each file, the total size and the number of entries are
//     bounded.
//
// A rejected member stops the extraction with a *MemberError naming it, and
// everything extracted so far is removed: on error the destination is left
// as empty as it was found.
package extract

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"slices"
	"strings"
)

// Default bounds, used where Options leaves a bound at zero.
const (
	// DefaultMaxFileSize bounds the size of one extracted file.
	DefaultMaxFileSize int64 = 1 << 30
	// DefaultMaxTotalSize bounds the sum of the sizes of all extracted files.
	DefaultMaxTotalSize int64 = 16 << 30
	// DefaultMaxEntries bounds the number of entries extracted.
	DefaultMaxEntries = 1 << 20
)

// maxLinkHops bounds how many symbolic links one target may pass through, as
// the kernel's own limit does (ELOOP after 40).
const maxLinkHops = 40

// Sentinel errors; test with errors.Is.
var (
	// ErrUnsafe means a member could write or point outside the destination,
	// or is of a kind that is never extracted (devices, FIFOs).
	ErrUnsafe = errors.New("unsafe archive member")
	// ErrTooLarge means a member or the archive exceeds a size or count bound.
	ErrTooLarge = errors.New("archive exceeds a bound")
	// ErrDestination means the destination is not an empty directory.
	ErrDestination = errors.New("unusable destination")
)

// MemberError is the error for one archive member.
type MemberError struct {
	// Name is the member's name as stored in the archive.
	Name string
	// Err says what is wrong; it wraps ErrUnsafe or ErrTooLarge for a
	// rejected member, or the I/O error.
	Err error
}

func (e *MemberError) Error() string { return fmt.Sprintf("archive member %q: %v", e.Name, e.Err) }

func (e *MemberError) Unwrap() error { return e.Err }

// Options configures Tar. The zero value extracts everything within the
// default bounds.
type Options struct {
	// Include selects the members to extract by their name, which has no
	// leading "./" and no trailing slash (see Prefixes). Nil selects all.
	// Members not selected are read past; their names must still be safe,
	// but nothing else about them is checked.
	Include func(name string) bool
	// MaxFileSize bounds each file; zero means DefaultMaxFileSize.
	MaxFileSize int64
	// MaxTotalSize bounds the sum of all file sizes; zero means
	// DefaultMaxTotalSize.
	MaxTotalSize int64
	// MaxEntries bounds the number of extracted entries; zero means
	// DefaultMaxEntries.
	MaxEntries int
	// RootFS says the archive is a root file system image, whose absolute
	// symbolic links name paths inside that file system. Such a target is
	// rewritten relative to the link, so that it points to the same place
	// inside the destination. When false, an absolute target is unsafe.
	RootFS bool
	// Log receives a warning for each hard link skipped because its target
	// was not selected; nil discards them.
	Log *slog.Logger
}

// Result counts what Tar extracted.
type Result struct {
	Files, Dirs, Symlinks, Hardlinks int
	// Bytes is the total size of the regular files written.
	Bytes int64
	// Skipped counts members Include did not select, and hard links to
	// files it did not select.
	Skipped int
}

// Prefixes returns an Include filter that selects a name when it starts with
// one of prefixes. A prefix ending in "/" also selects the directory itself
// ("usr/lib64/" selects "usr/lib64" and everything below it); other prefixes
// are plain string prefixes ("lib/modules.d" selects "lib/modules.dep").
func Prefixes(prefixes ...string) func(name string) bool {
	ps := append([]string(nil), prefixes...)
	return func(name string) bool {
		for _, p := range ps {
			if strings.HasPrefix(name, p) || (strings.HasSuffix(p, "/") && name == p[:len(p)-1]) {
				return true
			}
		}
		return false
	}
}

// Tar extracts the archive read from r into dest, which must be an existing
// empty directory. It reads up to the archive's end-of-archive marker and no
// further, so a caller that hashes the stream must drain r afterwards.
//
// Regular files get their permission bits (setuid, setgid and sticky bits
// are dropped) and modification time; directories get their permission bits
// with the owner's rwx added. Ownership is not changed.
//
// On any error, including ctx's cancellation, Tar removes everything it
// extracted before it returns.
func Tar(ctx context.Context, r io.Reader, dest string, opts Options) (res Result, err error) {
	entries, err := os.ReadDir(dest)
	if err != nil {
		return Result{}, fmt.Errorf("%w: %w", ErrDestination, err)
	}
	if len(entries) > 0 {
		return Result{}, fmt.Errorf("%w: %s is not empty", ErrDestination, dest)
	}
	root, err := os.OpenRoot(dest)
	if err != nil {
		return Result{}, fmt.Errorf("%w: %w", ErrDestination, err)
	}
	defer root.Close()
	x := &extractor{
		ctx:      ctx,
		root:     root,
		opts:     opts,
		symlinks: map[string]string{},
		files:    map[string]bool{},
		buf:      make([]byte, 256<<10),
	}
	x.defaults()
	defer func() {
		if err != nil {
			err = errors.Join(err, removeAll(root))
			res = Result{}
		}
	}()
	if err := x.run(tar.NewReader(&ctxReader{ctx: ctx, r: r})); err != nil {
		return x.res, err
	}
	return x.res, x.checkSymlinks()
}

type extractor struct {
	ctx  context.Context
	root *os.Root
	opts Options
	res  Result
	// symlinks maps each extracted symbolic link to its (relative) target.
	symlinks map[string]string
	// files holds the extracted regular files, the valid hard-link targets.
	files map[string]bool
	buf   []byte
}

func (x *extractor) defaults() {
	if x.opts.MaxFileSize <= 0 {
		x.opts.MaxFileSize = DefaultMaxFileSize
	}
	if x.opts.MaxTotalSize <= 0 {
		x.opts.MaxTotalSize = DefaultMaxTotalSize
	}
	if x.opts.MaxEntries <= 0 {
		x.opts.MaxEntries = DefaultMaxEntries
	}
	if x.opts.Include == nil {
		x.opts.Include = func(string) bool { return true }
	}
	if x.opts.Log == nil {
		x.opts.Log = slog.New(slog.DiscardHandler)
	}
}

func (x *extractor) run(tr *tar.Reader) error {
	entries := 0
	for {
		if err := x.ctx.Err(); err != nil {
			return err
		}
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read archive: %w", err)
		}
		if h.Typeflag == tar.TypeXGlobalHeader {
			continue
		}
		name, err := memberName(h.Name)
		if err != nil {
			return &MemberError{Name: h.Name, Err: err}
		}
		if name == "" { // the archive's root, "./"
			continue
		}
		if !x.opts.Include(name) {
			x.res.Skipped++
			continue
		}
		if entries++; entries > x.opts.MaxEntries {
			return &MemberError{Name: h.Name, Err: fmt.Errorf("%w: more than %d entries", ErrTooLarge, x.opts.MaxEntries)}
		}
		if err := x.member(tr, h, name); err != nil {
			return &MemberError{Name: h.Name, Err: err}
		}
	}
}

// memberName validates a member name and returns it without a leading "./"
// and trailing "/"; "" means the archive's root directory.
func memberName(raw string) (string, error) {
	name := strings.TrimPrefix(raw, "./")
	if name == "" || name == "." {
		if raw == "" {
			return "", fmt.Errorf("%w: empty name", ErrUnsafe)
		}
		return "", nil
	}
	name = strings.TrimSuffix(name, "/")
	switch {
	case strings.HasPrefix(raw, "/"):
		return "", fmt.Errorf("%w: absolute path", ErrUnsafe)
	case strings.ContainsRune(name, 0):
		return "", fmt.Errorf("%w: NUL in name", ErrUnsafe)
	case slices.Contains(strings.Split(name, "/"), ".."):
		return "", fmt.Errorf("%w: path element \"..\"", ErrUnsafe)
	case !fs.ValidPath(name):
		return "", fmt.Errorf("%w: not a clean relative path", ErrUnsafe)
	}
	return name, nil
}

func (x *extractor) member(tr *tar.Reader, h *tar.Header, name string) error {
	if err := x.checkParents(name); err != nil {
		return err
	}
	switch h.Typeflag {
	case tar.TypeDir:
		return x.dir(name, h)
	case tar.TypeReg, tar.TypeGNUSparse: // the reader turns the legacy TypeRegA into TypeReg
		return x.file(tr, name, h)
	case tar.TypeSymlink:
		return x.symlink(name, h.Linkname)
	case tar.TypeLink:
		return x.hardlink(name, h.Linkname)
	case tar.TypeChar, tar.TypeBlock:
		return fmt.Errorf("%w: device node", ErrUnsafe)
	case tar.TypeFifo:
		return fmt.Errorf("%w: FIFO", ErrUnsafe)
	default:
		return fmt.Errorf("%w: unsupported member type %q", ErrUnsafe, h.Typeflag)
	}
}

// checkParents refuses a member below a symbolic link and creates its
// missing parent directories.
func (x *extractor) checkParents(name string) error {
	for i := 0; i < len(name); i++ {
		if name[i] != '/' {
			continue
		}
		if _, ok := x.symlinks[name[:i]]; ok {
			return fmt.Errorf("%w: below the symbolic link %q", ErrUnsafe, name[:i])
		}
	}
	if dir := path.Dir(name); dir != "." {
		if err := x.root.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	return nil
}

// clear removes what an earlier member left at name, unless it is a
// directory and keepDir is set. A non-empty directory is not replaced.
func (x *extractor) clear(name string, keepDir bool) (exists bool, err error) {
	fi, err := x.root.Lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if fi.IsDir() && keepDir {
		return true, nil
	}
	if err := x.root.Remove(name); err != nil {
		return false, fmt.Errorf("replace an earlier member: %w", err)
	}
	delete(x.symlinks, name)
	delete(x.files, name)
	return false, nil
}

func (x *extractor) dir(name string, h *tar.Header) error {
	exists, err := x.clear(name, true)
	if err != nil {
		return err
	}
	mode := fs.FileMode(h.Mode)&fs.ModePerm | 0o700
	if !exists {
		if err := x.root.Mkdir(name, mode); err != nil {
			return err
		}
		x.res.Dirs++
	}
	return x.root.Chmod(name, mode)
}

func (x *extractor) file(tr *tar.Reader, name string, h *tar.Header) (err error) {
	if h.Size < 0 {
		return fmt.Errorf("%w: negative size", ErrUnsafe)
	}
	if h.Size > x.opts.MaxFileSize {
		return fmt.Errorf("%w: %d bytes, more than the %d allowed for one file", ErrTooLarge, h.Size, x.opts.MaxFileSize)
	}
	if x.res.Bytes+h.Size > x.opts.MaxTotalSize {
		return fmt.Errorf("%w: more than %d bytes in all", ErrTooLarge, x.opts.MaxTotalSize)
	}
	if _, err := x.clear(name, false); err != nil {
		return err
	}
	// O_EXCL: never open through whatever might be at name.
	f, err := x.root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	x.files[name] = true
	defer func() { err = errors.Join(err, f.Close()) }()
	if err := x.copy(f, tr, h.Size); err != nil {
		return err
	}
	if err := f.Chmod(fs.FileMode(h.Mode) & fs.ModePerm); err != nil {
		return err
	}
	x.res.Files++
	if !h.ModTime.IsZero() {
		at := h.AccessTime
		if at.IsZero() {
			at = h.ModTime
		}
		return x.root.Chtimes(name, at, h.ModTime)
	}
	return nil
}

func (x *extractor) symlink(name, target string) error {
	if target == "" || strings.ContainsRune(target, 0) {
		return fmt.Errorf("%w: empty or invalid symbolic link target", ErrUnsafe)
	}
	if path.IsAbs(target) {
		if !x.opts.RootFS {
			return fmt.Errorf("%w: absolute symbolic link target %q", ErrUnsafe, target)
		}
		// In a root file system "/.." is "/", which path.Clean applies.
		inRoot := strings.TrimPrefix(path.Clean(target), "/")
		if inRoot == "" {
			inRoot = "."
		}
		target = relativeTo(path.Dir(name), inRoot)
	} else if to := path.Join(path.Dir(name), target); to == ".." || strings.HasPrefix(to, "../") {
		return fmt.Errorf("%w: symbolic link target %q is outside the destination", ErrUnsafe, target)
	}
	if _, err := x.clear(name, false); err != nil {
		return err
	}
	if err := x.root.Symlink(target, name); err != nil {
		return err
	}
	x.symlinks[name] = target
	x.res.Symlinks++
	return nil
}

// relativeTo returns the relative path from directory dir to target, both
// clean and relative to the same root.
func relativeTo(dir, target string) string {
	var d, t []string
	if dir != "." {
		d = strings.Split(dir, "/")
	}
	if target != "." {
		t = strings.Split(target, "/")
	}
	common := 0
	for common < len(d) && common < len(t) && d[common] == t[common] {
		common++
	}
	parts := make([]string, 0, len(d)-common+len(t)-common)
	for range d[common:] {
		parts = append(parts, "..")
	}
	parts = append(parts, t[common:]...)
	if len(parts) == 0 {
		return "."
	}
	return strings.Join(parts, "/")
}

func (x *extractor) hardlink(name, linkname string) error {
	target, err := memberName(linkname)
	if err != nil || target == "" {
		if err == nil {
			err = fmt.Errorf("%w: hard link to the archive's root", ErrUnsafe)
		}
		return fmt.Errorf("hard link target %q: %w", linkname, err)
	}
	if !x.files[target] {
		if !x.opts.Include(target) {
			x.opts.Log.Warn("hard link to a file that is not extracted skipped", "member", name, "target", target)
			x.res.Skipped++
			return nil
		}
		return fmt.Errorf("%w: hard link to %q, which is not a regular file extracted earlier", ErrUnsafe, target)
	}
	if _, err := x.clear(name, false); err != nil {
		return err
	}
	if err := x.root.Link(target, name); err != nil {
		return err
	}
	x.files[name] = true
	x.res.Hardlinks++
	return nil
}

// checkSymlinks resolves every extracted symbolic link through the links the
// archive created, wherever they came in the archive, and rejects any that
// leads outside the destination or loops.
func (x *extractor) checkSymlinks() error {
	for name := range x.symlinks {
		var dir []string
		if d := path.Dir(name); d != "." {
			dir = strings.Split(d, "/")
		}
		hops := 0
		if _, err := x.resolve(dir, x.symlinks[name], &hops); err != nil {
			return &MemberError{Name: name, Err: err}
		}
	}
	return nil
}

// resolve walks target from the directory dir (clean elements below the
// destination) and returns where it ends, following extracted links.
func (x *extractor) resolve(dir []string, target string, hops *int) ([]string, error) {
	cur := append([]string(nil), dir...)
	for _, elem := range strings.Split(target, "/") {
		switch elem {
		case "", ".":
			continue
		case "..":
			if len(cur) == 0 {
				return nil, fmt.Errorf("%w: symbolic link leads outside the destination", ErrUnsafe)
			}
			cur = cur[:len(cur)-1]
			continue
		}
		next := append(cur, elem)
		t, ok := x.symlinks[strings.Join(next, "/")]
		if !ok {
			cur = next
			continue
		}
		if *hops++; *hops > maxLinkHops {
			return nil, fmt.Errorf("%w: too many levels of symbolic links", ErrUnsafe)
		}
		var err error
		if cur, err = x.resolve(cur, t, hops); err != nil {
			return nil, err
		}
	}
	return cur, nil
}

// removeAll empties the root directory.
func removeAll(root *os.Root) error {
	d, err := root.Open(".")
	if err != nil {
		return err
	}
	names, err := d.Readdirnames(-1)
	d.Close()
	for _, n := range names {
		err = errors.Join(err, root.RemoveAll(n))
	}
	return err
}

// copy writes size bytes from r to f in whole buffers: one write for most
// files, so that no page is written twice.
func (x *extractor) copy(f *os.File, r io.Reader, size int64) error {
	for size > 0 {
		n, err := io.ReadFull(r, x.buf[:min(size, int64(len(x.buf)))])
		if _, werr := f.Write(x.buf[:n]); werr != nil {
			return werr
		}
		x.res.Bytes += int64(n)
		size -= int64(n)
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			return fmt.Errorf("read archive: %w", err)
		}
	}
	return nil
}

// ctxReader fails reads once ctx is done, so a long member stops promptly.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
