// Command fetch is the measuring tool behind scripts/measure-fetch.sh; it is
// not a test. It makes a flatcar-container.tar.gz-like tarball, serves it as
// a signed Flatcar release on loopback, and runs the agent's download path
// (flatcar.Fetcher.BuildTree) against it, so that the script can compare the
// agent with curl | sha512sum and curl | tar xz on the same file.
//
//	fetch gen   -out FILE [-mib N] [-kver K]   write the tarball
//	fetch serve -tarball FILE -keyring OUT      serve it; print the URL template, then the tarball URL
//	fetch get   -url TEMPLATE -keyring FILE -dest DIR [-kver K]
package main

import (
	"archive/tar"
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/klauspost/compress/gzip"

	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
)

const (
	defaultKver = "6.12.81-flatcar"
	board       = "amd64-usr"
	version     = "4593.2.0"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: fetch gen|serve|get [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "gen":
		err = gen(os.Args[2:])
	case "serve":
		err = serve(os.Args[2:])
	case "get":
		err = get(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fetch:", err)
		os.Exit(1)
	}
}

// gen writes a tarball laid out like flatcar-container.tar.gz: a kernel
// build tree of compressible C headers and a few binaries, a usr/lib64 of
// half-compressible libraries (both extracted by the agent), and kernel
// modules, binaries and data the agent skips, mostly incompressible, making
// up the rest of the requested compressed size.
func gen(args []string) error {
	fs := flag.NewFlagSet("gen", flag.ExitOnError)
	out := fs.String("out", "", "tarball to write")
	mib := fs.Int("mib", 320, "approximate compressed size in MiB")
	kver := fs.String("kver", defaultKver, "kernel release")
	_ = fs.Parse(args)
	if *out == "" {
		return errors.New("gen: -out is required")
	}
	f, err := os.Create(*out)
	if err != nil {
		return err
	}
	defer f.Close()
	cw := &countWriter{w: f}
	bw := bufio.NewWriterSize(cw, 1<<20)
	zw, err := gzip.NewWriterLevel(bw, gzip.DefaultCompression)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(zw)
	rng := rand.New(rand.NewChaCha8([32]byte{1}))
	mtime := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	add := func(name string, typ byte, mode int64, body []byte, link string) error {
		h := &tar.Header{Name: name, Typeflag: typ, Mode: mode, Size: int64(len(body)), Linkname: link, ModTime: mtime, Format: tar.FormatGNU}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err := tw.Write(body)
		return err
	}
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := 0; i+8 <= n; i += 8 {
			v := rng.Uint64()
			for j := range 8 {
				b[i+j] = byte(v >> (8 * j))
			}
		}
		return b
	}
	text := func(n int) []byte {
		words := []string{"#define ", "CONFIG_", "struct ", "static inline ", "unsigned long ", "return ", "int ", "void ", "u32 ", "__attribute__", "(", ");\n", "{\n", "}\n", " = ", "\t"}
		b := make([]byte, 0, n)
		for len(b) < n {
			b = append(b, words[rng.IntN(len(words))]...)
			b = fmt.Appendf(b, "%x", rng.Uint32()&0xfff)
		}
		return b[:n]
	}
	half := func(n int) []byte { // about 2:1 compressible, like shared libraries
		b := random(n)
		copy(b[n/2:], text(n-n/2))
		return b
	}
	mod := "./usr/lib/modules/" + *kver + "/"
	dirs := []string{"./", "./usr/", "./usr/lib/", "./usr/lib/modules/", mod, mod + "build/", "./usr/lib64/", "./usr/bin/", "./usr/share/"}
	for _, d := range dirs {
		if err := add(d, tar.TypeDir, 0o755, nil, ""); err != nil {
			return err
		}
	}
	// Build tree: about 90 MiB of headers in 300 directories, and binaries.
	for d := range 300 {
		dir := fmt.Sprintf("%sbuild/include/dir%03d/", mod, d)
		if err := add(dir, tar.TypeDir, 0o755, nil, ""); err != nil {
			return err
		}
		for i := range 25 {
			if err := add(fmt.Sprintf("%sh%02d.h", dir, i), tar.TypeReg, 0o644, text(2048+rng.IntN(20480)), ""); err != nil {
				return err
			}
		}
	}
	for _, p := range []string{"Makefile", ".config", "Module.symvers"} {
		if err := add(mod+"build/"+p, tar.TypeReg, 0o644, text(1<<20), ""); err != nil {
			return err
		}
	}
	for _, p := range []string{"scripts/basic/fixdep", "scripts/mod/modpost", "tools/objtool/objtool"} {
		if err := add(mod+"build/"+p, tar.TypeReg, 0o755, half(2<<20), ""); err != nil {
			return err
		}
	}
	if err := add(mod+"source", tar.TypeSymlink, 0o777, nil, "build"); err != nil {
		return err
	}
	for _, p := range []string{"modules.dep", "modules.alias", "modules.symbols", "modules.order", "modules.builtin"} {
		if err := add(mod+p, tar.TypeReg, 0o644, text(256<<10), ""); err != nil {
			return err
		}
	}
	// usr/lib64: 40 MiB of libraries, with the loader and a few links.
	for i := range 200 {
		if err := add(fmt.Sprintf("./usr/lib64/lib%03d.so.1", i), tar.TypeReg, 0o755, half(200<<10), ""); err != nil {
			return err
		}
		if err := add(fmt.Sprintf("./usr/lib64/lib%03d.so", i), tar.TypeSymlink, 0o777, nil, fmt.Sprintf("lib%03d.so.1", i)); err != nil {
			return err
		}
	}
	if err := add("./usr/lib64/ld-linux-x86-64.so.2", tar.TypeReg, 0o755, half(256<<10), ""); err != nil {
		return err
	}
	// Skipped by the agent: kernel modules, binaries, data, until the
	// compressed size is reached.
	for i := 0; ; i++ {
		if err := zw.Flush(); err != nil {
			return err
		}
		if cw.n+int64(bw.Buffered()) >= int64(*mib)<<20 {
			break
		}
		var name string
		var body []byte
		switch i % 3 {
		case 0:
			name, body = fmt.Sprintf("%skernel/drivers/m%05d.ko", mod, i), half(96<<10)
		case 1:
			name, body = fmt.Sprintf("./usr/bin/tool%05d", i), random(256<<10)
		default:
			name, body = fmt.Sprintf("./usr/share/data%05d.bin", i), random(512<<10)
		}
		if err := add(name, tar.TypeReg, 0o644, body, ""); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := zw.Close(); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	fmt.Printf("wrote %s: %d bytes\n", *out, cw.n)
	return f.Close()
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// serve publishes the tarball as a signed stable release and serves it
// until SIGTERM or SIGINT.
func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	tarball := fs.String("tarball", "", "tarball to serve")
	keyring := fs.String("keyring", "", "where to write the armored public key")
	_ = fs.Parse(args)
	key, err := flatcartest.NewKey("measure")
	if err != nil {
		return err
	}
	if err := os.WriteFile(*keyring, key.ArmoredPublicKey(), 0o644); err != nil {
		return err
	}
	srv := flatcartest.NewServer(key)
	defer srv.Close()
	dir := flatcartest.ReleaseDir("stable", board, version)
	if err := srv.PublishFile(dir, *tarball); err != nil {
		return err
	}
	fmt.Println(srv.URLTemplate())
	fmt.Println(srv.URL + dir + flatcartest.ContainerImage)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	<-ctx.Done()
	return nil
}

// get runs the agent's download path once.
func get(args []string) error {
	fs := flag.NewFlagSet("get", flag.ExitOnError)
	url := fs.String("url", "", "URL template")
	keyring := fs.String("keyring", "", "armored public key")
	dest := fs.String("dest", "", "destination directory")
	kver := fs.String("kver", defaultKver, "kernel release")
	verbose := fs.Bool("v", false, "log progress")
	_ = fs.Parse(args)
	key, err := os.ReadFile(*keyring)
	if err != nil {
		return err
	}
	log := slog.New(slog.DiscardHandler)
	if *verbose {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	f, err := flatcar.New(flatcar.Options{URLs: []string{*url}, Keyring: key, Log: log})
	if err != nil {
		return err
	}
	start := time.Now()
	tree, err := f.BuildTree(context.Background(), flatcar.Release{Channel: "stable", Board: board, Version: version}, *kver, *dest)
	if err != nil {
		return err
	}
	fmt.Printf("agent: %.3fs downloaded=%d extracted_files=%d extracted_bytes=%d verified=%v\n",
		time.Since(start).Seconds(), tree.Downloaded, tree.Extracted.Files, tree.Extracted.Bytes, tree.Verified)
	return nil
}
