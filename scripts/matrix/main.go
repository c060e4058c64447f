// Command matrix turns images/releases.json (the supported Flatcar releases per channel, the
// NVIDIA driver versions, the Talos releases) into the build matrices of the workflows in
// .github/workflows, and checks image tags against the scheme the gpu-operator resolves (see
// tags.go).
//
// Usage, from the repository root:
//
//	go run ./scripts/matrix [flags] build         matrix of build images (Dockerfile.build), JSON
//	go run ./scripts/matrix [flags] precompiled   matrix of precompiled images (Dockerfile.precompiled)
//	go run ./scripts/matrix [flags] aliases       matrix of tags that name a build image under an OS tag
//	go run ./scripts/matrix [flags] sysext        matrix of system extensions (driver-agent sysext), JSON
//	go run ./scripts/matrix [flags] tags          every reference a run pushes, one a line
//	go run ./scripts/matrix [flags] check         check the data file and every tag
//	go run ./scripts/matrix check-tag TAG...      check tags against the scheme
//	go run ./scripts/matrix [-url URL] current    channel=version of each channel's current release
//
// Flags: -data FILE (images/releases.json), -image REPOSITORY, -prefix edge|v<release>,
// -plain=false (only the prefixed tags), -add channel=version,... (releases to add, e.g. the
// output of current), -url (current's version.txt URL, {channel} replaced).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"
)

const (
	defaultData  = "images/releases.json"
	defaultImage = "ghcr.io/driver-agent/driver"
	// defaultURL is where Flatcar publishes each channel's current release.
	defaultURL = "https://{channel}.release.flatcar-linux.net/amd64-usr/current/version.txt"
	// maxVersionTxt bounds what current reads of a version.txt (a few hundred bytes).
	maxVersionTxt = 64 << 10
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr, &http.Client{Timeout: 30 * time.Second}))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer, client *http.Client) int {
	fs := flag.NewFlagSet("matrix", flag.ContinueOnError)
	fs.SetOutput(stderr)
	data := fs.String("data", defaultData, "the data file")
	image := fs.String("image", defaultImage, "the image repository, without tag")
	prefix := fs.String("prefix", "", "also push <prefix>-<tag>: edge or an agent release like v1.2.0")
	plain := fs.Bool("plain", true, "push the unprefixed tags")
	add := fs.String("add", "", "Flatcar releases to add, channel=version,...")
	url := fs.String("url", defaultURL, "current: version.txt URL, {channel} replaced")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() == 0 {
		fmt.Fprintln(stderr, "matrix: name a command: build, precompiled, aliases, sysext, tags, check, check-tag or current")
		return 2
	}
	cmd, rest := fs.Arg(0), fs.Args()[1:]
	fail := func(err error) int {
		fmt.Fprintf(stderr, "matrix %s: %v\n", cmd, err)
		return 1
	}
	switch cmd {
	case "check-tag":
		if len(rest) == 0 {
			fmt.Fprintln(stderr, "matrix check-tag: give one or more tags")
			return 2
		}
		var errs []error
		for _, tag := range rest {
			t, err := ParseTag(tag)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			fmt.Fprintf(stdout, "%s: driver.version=%s on %s%s%s\n", tag, t.DriverVersion(), t.OS, t.OSVersion, orBase(t.OSVersion))
		}
		if err := errors.Join(errs...); err != nil {
			return fail(err)
		}
		return 0
	case "current":
		pairs, err := Current(ctx, client, *url)
		if err != nil {
			return fail(err)
		}
		fmt.Fprintln(stdout, pairs)
		return 0
	case "build", "precompiled", "aliases", "sysext", "tags", "check":
	default:
		fmt.Fprintf(stderr, "matrix: unknown command %q\n", cmd)
		return 2
	}
	if len(rest) > 0 {
		fmt.Fprintf(stderr, "matrix %s: unexpected arguments %q\n", cmd, rest)
		return 2
	}
	n := Naming{Image: *image, Prefix: *prefix, Plain: *plain}
	if err := n.check(); err != nil {
		return fail(err)
	}
	d, err := loadFile(*data)
	if err != nil {
		return fail(err)
	}
	if *add != "" {
		if err := d.Add(*add); err != nil {
			return fail(fmt.Errorf("%s with -add %s: %w", *data, *add, err))
		}
	}
	var m Matrix
	switch cmd {
	case "build":
		m, _, err = BuildMatrix(d, n)
	case "precompiled":
		m, _, err = PrecompiledMatrix(d, n)
	case "aliases":
		m, _, err = AliasMatrix(d, n)
	case "sysext":
		m = SysextMatrix(d, n)
	case "tags", "check":
		var refs []string
		refs, err = AllRefs(d, n)
		if err != nil {
			return fail(err)
		}
		if cmd == "tags" {
			fmt.Fprintln(stdout, strings.Join(refs, "\n"))
		} else {
			fmt.Fprintf(stdout, "%s: %d drivers, %d Flatcar releases, %d Talos releases, %d references: ok\n",
				*data, len(d.Drivers), len(d.Releases()), len(d.Talos), len(refs))
		}
		return 0
	}
	if err != nil {
		return fail(err)
	}
	b, err := json.Marshal(m)
	if err != nil {
		return fail(err)
	}
	fmt.Fprintln(stdout, string(b))
	return 0
}

func orBase(v string) string {
	if v == "" {
		return " (the build image's base tag)"
	}
	return ""
}

func loadFile(path string) (*Data, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w (run from the repository root or set -data)", err)
	}
	defer f.Close()
	d, err := Load(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return d, nil
}

// Current fetches each channel's current release from urlTemplate ({channel} replaced) and
// returns them as channel=version pairs for -add.
func Current(ctx context.Context, client *http.Client, urlTemplate string) (string, error) {
	var pairs []string
	for _, ch := range channels {
		u := strings.ReplaceAll(urlTemplate, "{channel}", ch)
		v, err := fetchVersion(ctx, client, u)
		if err != nil {
			return "", fmt.Errorf("%s: %w", ch, err)
		}
		if got, ok := channelOf(v); !ok || got != ch {
			return "", fmt.Errorf("%s: %s names release %q, which is not a %s release", ch, u, v, ch)
		}
		pairs = append(pairs, ch+"="+v)
	}
	return strings.Join(pairs, ","), nil
}

func fetchVersion(ctx context.Context, client *http.Client, u string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", u, resp.Status)
	}
	v, err := ParseVersionTxt(io.LimitReader(resp.Body, maxVersionTxt))
	if err != nil {
		return "", fmt.Errorf("%s: %w", u, err)
	}
	return v, nil
}

// ParseVersionTxt reads a Flatcar version.txt (KEY=VALUE lines) and returns the release's
// VERSION_ID: FLATCAR_VERSION_ID, else FLATCAR_VERSION.
func ParseVersionTxt(r io.Reader) (string, error) {
	vals := map[string]string{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), "=")
		if !ok || strings.HasPrefix(k, "#") {
			continue
		}
		vals[k] = strings.Trim(v, `"'`)
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	v := vals["FLATCAR_VERSION_ID"]
	if v == "" {
		v = vals["FLATCAR_VERSION"]
	}
	if v == "" {
		return "", errors.New("no FLATCAR_VERSION_ID or FLATCAR_VERSION line")
	}
	if !flatcarRe.MatchString(v) {
		return "", fmt.Errorf("version %q is not a Flatcar VERSION_ID like 4593.2.0", v)
	}
	return v, nil
}
