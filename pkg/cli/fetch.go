package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/relocate"
	"github.com/driver-agent/driver-agent/pkg/vmlinuz"
)

func fetchUsageText(w io.Writer, prog string) {
	fmt.Fprintf(w, `Usage: %[1]s fetch-build-tree --flatcar-version V [--board B] [--channel C] -o DIR

Image builds (Dockerfile.precompiled): download a Flatcar release's kernel and kernel build tree
from the release server, both verified against the signed DIGESTS, and make the tree's build
helpers runnable here. DIR (missing or empty) then holds
  DIR/flatcar_production_image.vmlinuz   the release's kernel (banner --vmlinuz reads its banner)
  DIR/build                              the kernel build tree, for build --kernel-build-tree
  DIR/tree                               what was extracted (usr/lib/modules, usr/lib64)

  --flatcar-version V       VERSION_ID, e.g. 4593.2.0 (required)
  --board B                 amd64-usr (default) or arm64-usr
  --channel C               stable, beta, alpha or lts (default: from the version's minor number)
  --flatcar-release-url U   release server URL template, repeatable (see help init)
  --flatcar-signing-key F   armored OpenPGP keyring replacing the embedded Flatcar key
  --insecure-skip-verify    do not check signatures (warned)
  -o DIR                    the output directory (required)

Exit codes: 0 done, 1 download, verification or relocation failed (DIR is removed), 2 usage.
`, prog)
}

type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, " ") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

// releaseFlags are the flags naming a Flatcar release and how to fetch it, which fetch-build-tree
// and sysext share.
type releaseFlags struct {
	rel      flatcar.Release
	urls     repeated
	keyFile  string
	insecure bool
}

func (r *releaseFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&r.rel.Version, "flatcar-version", "", "")
	fs.StringVar(&r.rel.Board, "board", "amd64-usr", "")
	fs.StringVar(&r.rel.Channel, "channel", "", "")
	fs.Var(&r.urls, "flatcar-release-url", "")
	fs.StringVar(&r.keyFile, "flatcar-signing-key", "", "")
	fs.BoolVar(&r.insecure, "insecure-skip-verify", false, "")
}

// fetcher makes the Fetcher the flags ask for; its errors are usage errors.
func (r *releaseFlags) fetcher(log *slog.Logger) (*flatcar.Fetcher, error) {
	opts := flatcar.Options{URLs: r.urls, InsecureSkipVerify: r.insecure, Log: log}
	if r.keyFile != "" {
		key, err := os.ReadFile(r.keyFile)
		if err != nil {
			return nil, fmt.Errorf("--flatcar-signing-key: %w", err)
		}
		opts.Keyring = key
	}
	return flatcar.New(opts)
}

// runFetch runs `driver-agent fetch-build-tree`.
func runFetch(ctx context.Context, prog string, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet(prog+" fetch-build-tree", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var flags releaseFlags
	flags.register(fs)
	rel := &flags.rel
	out := fs.String("o", "", "")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fetchUsageText(stdout, prog)
			return 0
		}
		fmt.Fprintf(stderr, "%s fetch-build-tree: %v\n", prog, err)
		fetchUsageText(stderr, prog)
		return 2
	}
	usageErr := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "%s fetch-build-tree: %s\n", prog, fmt.Sprintf(format, a...))
		return 2
	}
	switch {
	case fs.NArg() > 0:
		return usageErr("unexpected arguments %q", fs.Args())
	case rel.Version == "":
		return usageErr("set --flatcar-version to the release's VERSION_ID, e.g. 4593.2.0")
	case *out == "":
		return usageErr("set -o to the output directory")
	}
	if err := rel.Validate(); err != nil {
		return usageErr("%v", err)
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	f, err := flags.fetcher(log)
	if err != nil {
		return usageErr("%v", err)
	}
	if ents, err := os.ReadDir(*out); err == nil && len(ents) > 0 {
		return usageErr("-o %s is not empty; give a missing or empty directory", *out)
	}
	if _, err := fetchBuildTree(ctx, f, *rel, *out, log); err != nil {
		fmt.Fprintf(stderr, "%s fetch-build-tree: %v\n", prog, err)
		if rmErr := os.RemoveAll(*out); rmErr != nil {
			fmt.Fprintf(stderr, "%s fetch-build-tree: removing %s: %v\n", prog, *out, rmErr)
		}
		return 1
	}
	fmt.Fprintln(stdout, filepath.Join(*out, "build"))
	return 0
}

// fetchBuildTree downloads rel's kernel and build tree into out and returns the kernel's banner.
func fetchBuildTree(ctx context.Context, f *flatcar.Fetcher, rel flatcar.Release, out string, log *slog.Logger) (banner string, err error) {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return "", err
	}
	image := filepath.Join(out, flatcar.KernelImage)
	if _, err := f.File(ctx, rel, flatcar.KernelImage, image); err != nil {
		return "", err
	}
	res, err := vmlinuz.BannerFile(image, vmlinuz.Options{})
	if err != nil {
		return "", err
	}
	fields := strings.Fields(res.Banner)
	if len(fields) < 3 {
		return "", fmt.Errorf("%s: banner %q names no kernel release", image, res.Banner)
	}
	kver := fields[2]
	log.Info("Flatcar kernel", "release", kver, "banner", res.Banner)
	tree, err := f.BuildTree(ctx, rel, kver, filepath.Join(out, "tree"))
	if err != nil {
		return "", err
	}
	r, err := relocate.Tree(ctx, tree.BuildDir, relocate.Options{Sysroot: tree.Root, Log: log, Procs: host.OSExec{}})
	if err != nil {
		return "", err
	}
	log.Info("build helpers ready", "relocated", len(r.Relocated), "runnable", len(r.Runnable), "static", len(r.Static))
	link, err := filepath.Rel(out, tree.BuildDir)
	if err != nil {
		return "", err
	}
	return res.Banner, os.Symlink(link, filepath.Join(out, "build"))
}
