package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/driver-agent/driver-agent/pkg/vmlinuz"
)

// Exit codes of `driver-agent banner`.
const (
	bannerOK       = 0
	bannerNotFound = 1 // the image could not be read, or holds no banner
	bannerUsage    = 2
)

func bannerUsageText(w io.Writer, prog string) {
	fmt.Fprintf(w, `Usage: %[1]s banner --vmlinuz FILE [--json]

Print the kernel banner of a kernel image: the line the booted kernel shows as the
first line of /proc/version ("Linux version <release> (<builder>) (<compiler>) <version>"),
which precompiled packages are matched against. FILE is an x86 bzImage (vmlinuz) with a
gzip, xz (with or without the x86 BCJ filter), zstd, lz4, lzma or bzip2 payload, or a raw
compressed or uncompressed kernel.

  --vmlinuz FILE   the kernel image (required)
  --json           print {"banner", "compression", "offset", "kernelVersion"} as JSON

Exit codes: 0 printed, 1 no banner found or the file cannot be read, 2 usage error.
`, prog)
}

// runBanner runs `driver-agent banner --vmlinuz FILE`.
func runBanner(prog string, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet(prog+" banner", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	image := fs.String("vmlinuz", "", "the kernel image")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			bannerUsageText(stdout, prog)
			return bannerOK
		}
		fmt.Fprintf(stderr, "%s banner: %v\n", prog, err)
		bannerUsageText(stderr, prog)
		return bannerUsage
	}
	switch {
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "%s banner: unexpected arguments %q\n", prog, fs.Args())
		bannerUsageText(stderr, prog)
		return bannerUsage
	case *image == "":
		fmt.Fprintf(stderr, "%s banner: set --vmlinuz to the kernel image, e.g. flatcar_production_image.vmlinuz\n", prog)
		return bannerUsage
	}
	res, err := vmlinuz.BannerFile(*image, vmlinuz.Options{})
	if err != nil {
		fmt.Fprintf(stderr, "%s banner: %v\n", prog, err)
		return bannerNotFound
	}
	if *asJSON {
		out := struct {
			Banner        string `json:"banner"`
			Compression   string `json:"compression"`
			Offset        int64  `json:"offset"`
			KernelVersion string `json:"kernelVersion,omitempty"`
		}{Banner: res.Banner, Compression: res.Compression, Offset: res.Offset}
		if res.Header != nil {
			out.KernelVersion = res.Header.KernelVersion
		}
		if writeJSON(stdout, out) != 0 {
			return bannerNotFound
		}
		return bannerOK
	}
	fmt.Fprintln(stdout, res.Banner)
	return bannerOK
}
