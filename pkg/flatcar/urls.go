package flatcar

import (
	"fmt"
	"net/url"
	"slices"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/detect"
)

// DefaultURLs returns the templates of the directories that hold a Flatcar
// release's files: the release servers of every channel, then the build
// cache that Flatcar's own setup-nvidia falls back to:
//
//	https://{channel}.release.flatcar-linux.net/{board}/{version}/
//	https://bincache.flatcar-linux.net/images/{arch}/{version}/
func DefaultURLs() []string {
	return []string{
		"https://{channel}.release.flatcar-linux.net/{board}/{version}/",
		"https://bincache.flatcar-linux.net/images/{arch}/{version}/",
	}
}

// channelOrder lists the Flatcar release channels in the order they are
// tried after the node's own channel and the channel its version belongs to.
var channelOrder = []string{"stable", "beta", "alpha", "lts"}

// isVersion reports whether s matches ^[0-9]+\.[0-9]+\.[0-9]+$.
func isVersion(s string) bool {
	n := 0
	for f := range strings.SplitSeq(s, ".") {
		if f == "" || strings.Trim(f, "0123456789") != "" {
			return false
		}
		n++
	}
	return n == 3
}

// isBoard reports whether s matches ^[a-z0-9_]+-usr$.
func isBoard(s string) bool {
	arch, ok := strings.CutSuffix(s, "-usr")
	return ok && arch != "" && strings.Trim(arch, "abcdefghijklmnopqrstuvwxyz0123456789_") == ""
}

// nextPlaceholder returns the bounds of the leftmost match of \{[^{}]*\} in t, or -1, -1: the
// first '}' after a '{', and the last '{' before it.
func nextPlaceholder(t string) (start, end int) {
	open := strings.IndexByte(t, '{')
	if open < 0 {
		return -1, -1
	}
	end = strings.IndexByte(t[open:], '}')
	if end < 0 {
		return -1, -1
	}
	end += open
	return strings.LastIndexByte(t[:end], '{'), end + 1
}

// placeholders returns the matches of \{[^{}]*\} in t, as regexp's FindAllString(t, -1) does.
func placeholders(t string) []string {
	var out []string
	for start, end := nextPlaceholder(t); start >= 0; start, end = nextPlaceholder(t) {
		out = append(out, t[start:end])
		t = t[end:]
	}
	return out
}

// blankPlaceholders returns t with each match of \{[^{}]*\} replaced by "x", as regexp's
// ReplaceAllString(t, "x") does.
func blankPlaceholders(t string) string {
	var b strings.Builder
	for start, end := nextPlaceholder(t); start >= 0; start, end = nextPlaceholder(t) {
		b.WriteString(t[:start])
		b.WriteByte('x')
		t = t[end:]
	}
	return b.String() + t
}

// Release names one Flatcar release build.
type Release struct {
	// Channel is the node's channel (stable, beta, alpha or lts), tried
	// first; empty tries the channel the version belongs to first.
	Channel string
	// Board is FLATCAR_BOARD, amd64-usr or arm64-usr.
	Board string
	// Version is VERSION_ID, e.g. 4593.2.0.
	Version string
}

// Validate checks that r's fields can be put into a URL.
func (r Release) Validate() error {
	if r.Channel != "" && !slices.Contains(channelOrder, r.Channel) {
		return fmt.Errorf("%w: channel %q is not one of %s", ErrInvalid, r.Channel, strings.Join(channelOrder, ", "))
	}
	if !isBoard(r.Board) {
		return fmt.Errorf("%w: board %q is not like amd64-usr", ErrInvalid, r.Board)
	}
	if !isVersion(r.Version) {
		return fmt.Errorf("%w: version %q is not like 4593.2.0", ErrInvalid, r.Version)
	}
	return nil
}

// Arch is the board without its "-usr" suffix, as the build cache names it.
func (r Release) Arch() string { return strings.TrimSuffix(r.Board, "-usr") }

// channels lists the channels to try for r: the node's, the version's, then
// the others.
func (r Release) channels() []string {
	order := []string{r.Channel, detect.ChannelFromVersion(r.Version)}
	order = append(order, channelOrder...)
	var out []string
	for _, c := range order {
		if c != "" && slices.Contains(channelOrder, c) && !slices.Contains(out, c) {
			out = append(out, c)
		}
	}
	return out
}

// checkTemplates validates URL templates: placeholders are {channel},
// {board}, {arch} and {version} only, and the URL is http, https or file.
func checkTemplates(templates []string) error {
	if len(templates) == 0 {
		return fmt.Errorf("%w: no release URL", ErrInvalid)
	}
	for _, t := range templates {
		for _, p := range placeholders(t) {
			switch p {
			case "{channel}", "{board}", "{arch}", "{version}":
			default:
				return fmt.Errorf("%w: release URL %q: unknown placeholder %s (use {channel}, {board}, {arch}, {version})", ErrInvalid, t, p)
			}
		}
		u, err := url.Parse(blankPlaceholders(t))
		if err != nil {
			return fmt.Errorf("%w: release URL %q: %w", ErrInvalid, t, err)
		}
		if u.Scheme != "http" && u.Scheme != "https" && u.Scheme != "file" {
			return fmt.Errorf("%w: release URL %q: scheme must be http, https or file", ErrInvalid, t)
		}
		if u.Scheme != "file" && u.Host == "" {
			return fmt.Errorf("%w: release URL %q has no host", ErrInvalid, t)
		}
	}
	return nil
}

// candidate is one base URL to try, and the channel it was made for.
type candidate struct{ url, channel string }

func urlsOf(cs []candidate) []string {
	var out []string
	for _, c := range cs {
		out = append(out, c.url)
	}
	return out
}

// expand returns the base URLs (ending in "/") to try for r, in order: each
// template in turn, and a template with {channel} once for each channel.
func expand(templates []string, r Release) []candidate {
	var out []candidate
	for _, t := range templates {
		chans := []string{""}
		if strings.Contains(t, "{channel}") {
			chans = r.channels()
		}
		for _, c := range chans {
			u := strings.NewReplacer("{channel}", c, "{board}", r.Board, "{arch}", r.Arch(), "{version}", r.Version).Replace(t)
			if !strings.HasSuffix(u, "/") {
				u += "/"
			}
			if !slices.Contains(urlsOf(out), u) {
				out = append(out, candidate{u, c})
			}
		}
	}
	return out
}
