package flatcar_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
)

func TestFileVerified(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	image := bytes.Repeat([]byte("vmlinuz "), 100000)
	if err := e.srv.PublishAs(flatcartest.ReleaseDir("lts", rel.Board, rel.Version), flatcar.KernelImage, image); err != nil {
		t.Fatal(err)
	}
	dest := filepath.Join(e.parent, "vmlinuz")
	u, err := e.fetcher(t).File(context.Background(), rel, flatcar.KernelImage, dest)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(u, "/lts/amd64-usr/"+rel.Version+"/"+flatcar.KernelImage) {
		t.Errorf("url %s: want the lts copy after 404s", u)
	}
	if got, _ := os.ReadFile(dest); !bytes.Equal(got, image) {
		t.Errorf("downloaded %d bytes, want the image", len(got))
	}
}

func TestFileRejectsTamperedAndMissing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := flatcartest.ReleaseDir("stable", rel.Board, rel.Version)
	if err := e.srv.PublishAs(dir, flatcar.KernelImage, []byte("the signed kernel")); err != nil {
		t.Fatal(err)
	}
	e.srv.Put(dir+flatcar.KernelImage, []byte("a different kernel"))
	dest := filepath.Join(e.parent, "vmlinuz")
	if _, err := e.fetcher(t).File(context.Background(), rel, flatcar.KernelImage, dest); !errors.Is(err, flatcar.ErrVerify) {
		t.Fatalf("tampered file: %v, want ErrVerify", err)
	}
	if _, err := e.fetcher(t).File(context.Background(), rel, "flatcar_production_image.bin.bz2", dest); !errors.Is(err, flatcar.ErrNotFound) {
		t.Fatalf("missing file: %v, want ErrNotFound", err)
	}
	if ents, _ := os.ReadDir(e.parent); len(ents) != 0 {
		t.Errorf("left behind: %v", ents)
	}
}
