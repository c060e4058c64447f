package flatcar

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
)

// newClient is the default HTTP client: proxies from the environment
// (HTTPS_PROXY, HTTP_PROXY, NO_PROXY), bounded connect and response-header
// waits, no transparent decompression (the hash is over the bytes as
// published), and file:// URLs for mirrors on a local or mounted directory.
func newClient(o *Options) *http.Client {
	tr := &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: o.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout:   o.ConnectTimeout,
		ResponseHeaderTimeout: o.ResponseTimeout,
		ExpectContinueTimeout: time.Second,
		ForceAttemptHTTP2:     true,
		DisableCompression:    true,
		MaxIdleConnsPerHost:   2,
		IdleConnTimeout:       90 * time.Second,
	}
	tr.RegisterProtocol("file", http.NewFileTransport(http.Dir("/")))
	return &http.Client{Transport: tr}
}

// maxRedirects is how many redirects one request follows, as net/http's default.
const maxRedirects = 10

// httpRedirectsOnly returns a copy of c that follows redirects only to http and https URLs, so
// that a server's answer never reaches the node's files (file://) or another protocol; only the
// configured base URLs may be file:// URLs. c's own redirect policy, if any, applies after.
func httpRedirectsOnly(c *http.Client) *http.Client {
	cc := *c
	next := c.CheckRedirect
	cc.CheckRedirect = func(req *http.Request, via []*http.Request) error {
		if s := req.URL.Scheme; s != "http" && s != "https" {
			return fmt.Errorf("%w: %s redirected to %s; a release server may redirect only to http and https URLs (a mirror in a local directory must be set as the release URL itself, --flatcar-release-url file:///...)",
				ErrRedirect, via[len(via)-1].URL.Redacted(), req.URL.Redacted())
		}
		if next != nil {
			return next(req, via)
		}
		if len(via) >= maxRedirects {
			return fmt.Errorf("stopped after %d redirects", maxRedirects)
		}
		return nil
	}
	return &cc
}

// errRetryable marks a failure worth another attempt: a network error or a
// 5xx/429 answer.
var errRetryable = errors.New("retryable")

// get requests u and returns a response with status 200 (or 206 for a
// range request), retrying network errors and 5xx answers with capped
// exponential backoff and jitter. A 404 or 410 is ErrNotFound at once;
// exhausted retries and other answers are ErrUnreachable.
func (f *Fetcher) get(ctx context.Context, u string, header http.Header) (*http.Response, error) {
	var last error
	for attempt := 0; ; attempt++ {
		resp, err := f.try(ctx, u, header)
		if err == nil {
			return resp, nil
		}
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		if !errors.Is(err, errRetryable) {
			return nil, err
		}
		last = err
		if attempt >= f.opts.Retries {
			break
		}
		d := f.backoff(attempt)
		f.log.Warn("download attempt failed; retrying", "url", u, "attempt", attempt+1, "retry_in", d.Round(time.Millisecond), "err", err)
		if err := sleep(ctx, d); err != nil {
			return nil, err
		}
	}
	var re retryableError
	if errors.As(last, &re) {
		last = re.err
	}
	return nil, fmt.Errorf("%w: cannot reach %s after %d attempts: %w", ErrUnreachable, u, f.opts.Retries+1, last)
}

// try makes one request.
func (f *Fetcher) try(ctx context.Context, u string, header http.Header) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	req.Header.Set("User-Agent", "driver-agent")
	resp, err := f.client.Do(req)
	if ue := (*url.Error)(nil); errors.As(err, &ue) && errors.Is(err, ErrRedirect) {
		return nil, ue.Err // not retried; its message names both URLs
	}
	if err != nil {
		return nil, retryable(err)
	}
	switch {
	case resp.StatusCode == http.StatusOK, resp.StatusCode == http.StatusPartialContent && header.Get("Range") != "":
		return resp, nil
	}
	resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusGone:
		return nil, fmt.Errorf("%w: %s: %s", ErrNotFound, u, resp.Status)
	case resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests:
		return nil, retryable(fmt.Errorf("GET %s: %s", u, resp.Status))
	default:
		return nil, fmt.Errorf("%w: GET %s: %s", ErrUnreachable, u, resp.Status)
	}
}

// retryableError wraps an error with errRetryable.
type retryableError struct{ err error }

func (e retryableError) Error() string   { return e.err.Error() }
func (e retryableError) Unwrap() []error { return []error{errRetryable, e.err} }
func retryable(err error) error          { return retryableError{err} }

// backoff is the wait before retry attempt+1: RetryBase doubled per attempt,
// capped at RetryMax, with full jitter over its upper half.
func (f *Fetcher) backoff(attempt int) time.Duration {
	d := f.opts.RetryBase << min(attempt, 30)
	if d <= 0 || d > f.opts.RetryMax {
		d = f.opts.RetryMax
	}
	return d/2 + rand.N(d/2+1)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return nil
	}
}

// body reads a download to its end across connection failures: when a read
// fails, or the connection ends before Content-Length, it asks for the rest
// with a Range request guarded by If-Range, up to Retries times, so that the
// stream the caller hashes is the published file or an error. A read that
// waits longer than StallTimeout for data counts as a failure; so does a
// response whose first read does not come within StallTimeout.
type body struct {
	f    *Fetcher
	ctx  context.Context
	url  string
	size int64 // Content-Length, -1 when unknown
	off  int64
	// validator is the ETag or Last-Modified for If-Range; empty when the
	// server gave neither, which rules out resuming.
	validator string
	resumes   int
	// broken classes a download that broke off for good: ErrVerify for a release file (the
	// bytes so far are not the published file), ErrUnreachable for its DIGESTS (another
	// server may have them).
	broken error

	rc     io.ReadCloser
	cancel context.CancelFunc
	timer  *time.Timer
	// err is the final error, kept because gzip hides the reader's errors
	// behind its own.
	err error
	mu  sync.Mutex
	// stalled is set when the stall timer cancelled the request.
	stalled bool
}

func (f *Fetcher) openBody(ctx context.Context, u string) (*body, error) {
	b := &body{f: f, ctx: ctx, url: u, broken: ErrVerify}
	resp, err := b.request(nil)
	if err != nil {
		return nil, err
	}
	b.size = resp.ContentLength
	if b.size > f.opts.MaxDownloadSize {
		b.Close()
		return nil, fmt.Errorf("%w: %s is %d bytes, more than the %d allowed", ErrVerify, u, b.size, f.opts.MaxDownloadSize)
	}
	if et := resp.Header.Get("ETag"); et != "" && !strings.HasPrefix(et, "W/") {
		b.validator = et
	} else {
		b.validator = resp.Header.Get("Last-Modified")
	}
	return b, nil
}

// request starts a request with its own context, whose cancellation by the
// stall timer fails a hanging read.
func (b *body) request(header http.Header) (*http.Response, error) {
	ctx, cancel := context.WithCancel(b.ctx)
	resp, err := b.f.get(ctx, b.url, header)
	if err != nil {
		cancel()
		return nil, err
	}
	b.mu.Lock()
	b.rc, b.cancel, b.stalled = resp.Body, cancel, false
	b.mu.Unlock()
	b.timer = time.AfterFunc(b.f.opts.StallTimeout, func() {
		b.mu.Lock()
		b.stalled = true
		b.mu.Unlock()
		cancel()
	})
	return resp, nil
}

func (b *body) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	for {
		// The stall timer runs only while waiting for the server, not while
		// the caller works on what it got.
		b.timer.Reset(b.f.opts.StallTimeout)
		n, err := b.rc.Read(p)
		b.timer.Stop()
		b.off += int64(n)
		if b.off > b.f.opts.MaxDownloadSize || (b.size >= 0 && b.off > b.size) {
			b.err = fmt.Errorf("%w: %s sent more than the %d bytes expected", ErrVerify, b.url, min(b.size, b.f.opts.MaxDownloadSize))
			return 0, b.err
		}
		if err == nil || n > 0 {
			return n, nil // a pending error comes back on the next read
		}
		if err == io.EOF && (b.size < 0 || b.off == b.size) {
			return 0, io.EOF
		}
		if b.ctx.Err() != nil {
			b.err = context.Cause(b.ctx)
			return 0, b.err
		}
		b.mu.Lock()
		if b.stalled {
			err = fmt.Errorf("no data for %v", b.f.opts.StallTimeout)
		}
		b.mu.Unlock()
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		if rerr := b.resume(err); rerr != nil {
			b.err = rerr
			return 0, rerr
		}
	}
}

// resume replaces the failed connection with a range request for the rest.
func (b *body) resume(cause error) error {
	b.closeConn()
	truncated := fmt.Errorf("%w: download of %s broke off after %d of %d bytes: %w", b.broken, b.url, b.off, b.size, cause)
	if b.size < 0 || b.validator == "" {
		return truncated
	}
	if b.resumes >= b.f.opts.Retries {
		return fmt.Errorf("%w (after %d resumed requests)", truncated, b.resumes)
	}
	b.resumes++
	d := b.f.backoff(b.resumes - 1)
	b.f.log.Warn("download interrupted; resuming", "url", b.url, "offset", b.off, "retry_in", d.Round(time.Millisecond), "err", cause)
	if err := sleep(b.ctx, d); err != nil {
		return err
	}
	h := http.Header{}
	h.Set("Range", "bytes="+strconv.FormatInt(b.off, 10)+"-")
	h.Set("If-Range", b.validator)
	resp, err := b.request(h)
	if err != nil {
		return fmt.Errorf("resume %s at byte %d: %w", b.url, b.off, err)
	}
	want := fmt.Sprintf("bytes %d-%d/%d", b.off, b.size-1, b.size)
	if resp.StatusCode != http.StatusPartialContent || resp.Header.Get("Content-Range") != want {
		b.closeConn()
		return fmt.Errorf("%w: resume %s at byte %d: the server answered %s (Content-Range %q) instead of the rest of the same file",
			ErrVerify, b.url, b.off, resp.Status, resp.Header.Get("Content-Range"))
	}
	return nil
}

func (b *body) closeConn() {
	if b.timer != nil {
		b.timer.Stop()
	}
	b.mu.Lock()
	rc, cancel := b.rc, b.cancel
	b.rc, b.cancel = nil, nil
	b.mu.Unlock()
	if rc != nil {
		rc.Close()
	}
	if cancel != nil {
		cancel()
	}
}

// Close releases the connection.
func (b *body) Close() error {
	b.closeConn()
	return nil
}
