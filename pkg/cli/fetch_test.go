package cli_test

import (
	"archive/tar"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/flatcar"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// fetch-build-tree downloads the release's kernel, reads the kernel release from its banner and
// downloads that kernel's build tree, both verified; a release signed by another key fails and
// leaves no output directory.
func TestFetchBuildTree(t *testing.T) {
	key, err := flatcartest.NewKey("release key")
	if err != nil {
		t.Fatal(err)
	}
	srv := flatcartest.NewServer(key)
	defer srv.Close()
	image, err := os.ReadFile(writeBzImage(t))
	if err != nil {
		t.Fatal(err)
	}
	tb, err := flatcartest.Tarball(flatcartest.ContainerTree("6.6.95-flatcar", []flatcartest.Entry{
		{Name: "./", Type: tar.TypeDir}, {Name: "./Makefile", Body: []byte("# kernel\n")}, {Name: "./.config", Body: []byte("CONFIG_MODULES=y\n")},
	}))
	if err != nil {
		t.Fatal(err)
	}
	keyFile := publishRelease(t, srv, key, flatcartest.ReleaseDir("stable", "amd64-usr", "4230.2.1"), image, tb)
	out := filepath.Join(t.TempDir(), "flatcar")
	args := []string{"fetch-build-tree", "--flatcar-version", "4230.2.1", "--channel", "stable", "--flatcar-release-url", srv.URLTemplate(), "--flatcar-signing-key", keyFile, "-o", out}
	code, stdout, stderr := runCLI(args...)
	if code != 0 || strings.TrimSpace(stdout) != filepath.Join(out, "build") {
		t.Fatalf("exit %d, stdout %q, stderr:\n%s", code, stdout, stderr)
	}
	if b, err := os.ReadFile(filepath.Join(out, "build", "Makefile")); err != nil || string(b) != "# kernel\n" {
		t.Errorf("build/Makefile: %q, %v", b, err)
	}
	if code, out2, _ := runCLI("banner", "--vmlinuz", filepath.Join(out, flatcar.KernelImage)); code != 0 || strings.TrimSpace(out2) != cliBanner {
		t.Errorf("banner of the fetched kernel: %d %q", code, out2)
	}

	other, err := flatcartest.NewKey("someone else")
	hosttest.Must(t, err)
	hosttest.Must(t, os.WriteFile(keyFile, other.ArmoredPublicKey(), 0o644))
	out = filepath.Join(t.TempDir(), "flatcar")
	args[len(args)-1] = out
	if code, _, stderr := runCLI(args...); code != 1 || !strings.Contains(stderr, "verification failed") {
		t.Fatalf("wrong key: exit %d, stderr:\n%s", code, stderr)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("output left after a failure: %v", err)
	}
	if code, _, stderr := runCLI("fetch-build-tree", "-o", out); code != 2 || !strings.Contains(stderr, "set --flatcar-version") {
		t.Errorf("usage: exit %d, %s", code, stderr)
	}
}

// publishRelease publishes the kernel image and build-tree tarball of a release in dir on srv,
// and writes key's public half to the file it returns, for --flatcar-signing-key.
func publishRelease(t *testing.T, srv *flatcartest.Server, key *flatcartest.Key, dir string, image, tarball []byte) string {
	t.Helper()
	if err := srv.PublishAs(dir, flatcar.KernelImage, image); err != nil {
		t.Fatal(err)
	}
	if err := srv.Publish(dir, tarball); err != nil {
		t.Fatal(err)
	}
	keyFile := filepath.Join(t.TempDir(), "key.asc")
	if err := os.WriteFile(keyFile, key.ArmoredPublicKey(), 0o644); err != nil {
		t.Fatal(err)
	}
	return keyFile
}
