package cli_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/build/buildtest"
	"github.com/driver-agent/driver-agent/pkg/flatcar/flatcartest"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
	"github.com/driver-agent/driver-agent/pkg/modfile"
	"github.com/driver-agent/driver-agent/pkg/sysext"
	"github.com/driver-agent/driver-agent/pkg/sysext/sysexttest"
)

// `driver-agent sysext` with a local build tree: a real kbuild of the stand-in sources against
// Debian's headers, squashed by mksquashfs into an image that unsquashfs lists, whose
// extension-release names the release and whose modules are for the tree's kernel.
func TestSysextCommand(t *testing.T) {
	t.Parallel()
	release, tree, err := buildtest.Headers()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	source, root := sysextInputs(t, dir, tree)
	out := filepath.Join(dir, "out")
	args := []string{"sysext", "--flatcar-version", "4593.2.0", "--kernel-build-tree", tree, "--source", source,
		"--driver-version", "0.0.1", "--container-root", root, "-j", "2", "--work-dir", dir, "-o", out}
	code, stdout, stderr := runCLI(args...)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	name := "nvidia-driver-0.0.1-flatcar4593.2.0"
	image := filepath.Join(out, name+".raw")
	if !strings.HasPrefix(stdout, "wrote "+image+": driver 0.0.1 for Flatcar 4593.2.0 (x86-64, kernel "+release+")") {
		t.Errorf("stdout %q", stdout)
	}
	if ents, _ := filepath.Glob(filepath.Join(dir, "driver-agent-sysext-*")); len(ents) != 0 {
		t.Errorf("work directories left: %v", ents)
	}
	list, err := exec.Command("unsquashfs", "-l", image).CombinedOutput()
	if err != nil {
		t.Fatalf("unsquashfs -l: %v\n%s", err, list)
	}
	for _, m := range []string{"nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-peermem"} {
		rel := "usr/lib/modules/" + release + "/updates/" + m + ".ko"
		if !strings.Contains(string(list), "squashfs-root/"+rel+"\n") {
			t.Errorf("unsquashfs -l lacks %s:\n%s", rel, list)
			continue
		}
		ko, err := exec.Command("unsquashfs", "-cat", image, rel).Output()
		if err != nil {
			t.Fatal(err)
		}
		info, err := modfile.Info(ko)
		if err != nil || !strings.HasPrefix(info.Vermagic, release+" ") {
			t.Errorf("%s: vermagic %q, %v", rel, info.Vermagic, err)
		}
	}
	er, err := exec.Command("unsquashfs", "-cat", image, "usr/lib/extension-release.d/extension-release."+name).Output()
	if err != nil {
		t.Fatal(err)
	}
	if r, err := sysext.ParseRelease(er); err != nil || r != (sysext.Release{ID: "flatcar", VersionID: "4593.2.0", Architecture: "x86-64"}) {
		t.Errorf("extension-release %+v, %v:\n%s", r, err, er)
	}
	if sums, err := os.ReadFile(filepath.Join(out, "SHA256SUMS")); err != nil || !strings.HasSuffix(string(sums), "  "+name+".raw\n") {
		t.Errorf("SHA256SUMS %q, %v", sums, err)
	}

	// Without the userspace: a clear error, exit 2, the output directory as it was.
	hosttest.Must(t, os.Remove(filepath.Join(root, "usr/bin/nvidia-persistenced")))
	before := hosttest.Snapshot(t, out)
	code, _, stderr = runCLI(slices.Replace(slices.Clone(args), 2, 3, "4593.2.1")...)
	if code != 2 || !strings.Contains(stderr, "nvidia-persistenced is in none of") {
		t.Errorf("no nvidia-persistenced: exit %d, stderr:\n%s", code, stderr)
	}
	if d := hosttest.DiffSnapshots(before, hosttest.Snapshot(t, out)); d != "" {
		t.Errorf("a failed sysext changed %s:\n%s", out, d)
	}
}

func TestSysextUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"sysext", "-o", "x", "--driver-version", "535.261.03"}, "set --flatcar-version"},
		{[]string{"sysext", "--flatcar-version", "4593.2.0", "--driver-version", "535.261.03"}, "set -o"},
		{[]string{"sysext", "--flatcar-version", "4593", "--driver-version", "535.261.03", "-o", "x"}, "4593"},
		{[]string{"sysext", "--flatcar-version", "4593.2.0", "--board", "riscv-usr", "--driver-version", "535.261.03", "-o", "x"}, "riscv-usr"},
		{[]string{"sysext", "--flatcar-version", "4593.2.0", "--driver-version", "latest", "-o", "x"}, "want one like 535.261.03"},
		{[]string{"sysext", "--flatcar-version", "4593.2.0", "--driver-version", "535.261.03", "--kernel-build-tree", "/nonexistent", "-o", "x"}, "utsrelease.h"},
	} {
		code, _, stderr := runCLI(tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%q: exit %d, stderr %q, want 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
	if code, stdout, _ := runCLI("sysext", "--help"); code != 0 || !strings.Contains(stdout, "extension-release.<name>") {
		t.Errorf("--help: %d %q", code, stdout)
	}
}

// Without --kernel-build-tree, sysext downloads the release's kernel and build tree from the
// release server (here Debian's headers published as Flatcar 4593.2.0 on a test server, signed
// with a test key), verifies both, builds against the tree and names the kernel of the banner.
func TestSysextDownloads(t *testing.T) {
	t.Parallel()
	release, tree, err := buildtest.Headers()
	if err != nil {
		t.Fatal(err)
	}
	entries, err := flatcartest.DirEntries(tree)
	if err != nil {
		t.Fatal(err)
	}
	tarball, err := flatcartest.Tarball(flatcartest.ContainerTree(release, entries))
	if err != nil {
		t.Fatal(err)
	}
	key, err := flatcartest.NewKey("release key")
	if err != nil {
		t.Fatal(err)
	}
	srv := flatcartest.NewServer(key)
	defer srv.Close()
	version := release + " (builder@localhost) #1 SMP PREEMPT_DYNAMIC Fri Jul 11 12:34:56 -00 2025"
	image, err := os.ReadFile(writeBzImageWith(t, "Linux version "+release+" (builder@localhost) (gcc (Debian 12.2.0-14) 12.2.0, GNU ld 2.40) #1 SMP PREEMPT_DYNAMIC Fri Jul 11 12:34:56 -00 2025", version))
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	keyFile := publishRelease(t, srv, key, flatcartest.ReleaseDir("stable", "amd64-usr", "4593.2.0"), image, tarball)
	source, root := sysextInputs(t, work, tree)
	out := filepath.Join(work, "out")
	code, stdout, stderr := runCLI("sysext", "--flatcar-version", "4593.2.0", "--flatcar-release-url", srv.URLTemplate(), "--flatcar-signing-key", keyFile,
		"--source", source, "--driver-version", "0.0.1", "--container-root", root, "-j", "2", "--work-dir", work, "-o", out)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	if !strings.Contains(stdout, "(x86-64, kernel "+release+")") {
		t.Errorf("stdout %q", stdout)
	}
	ko, err := exec.Command("unsquashfs", "-cat", filepath.Join(out, "nvidia-driver-0.0.1-flatcar4593.2.0.raw"), "usr/lib/modules/"+release+"/updates/nvidia.ko").Output()
	if err != nil {
		t.Fatal(err)
	}
	if info, err := modfile.Info(ko); err != nil || !strings.HasPrefix(info.Vermagic, release+" ") {
		t.Errorf("nvidia.ko vermagic %q, %v", info.Vermagic, err)
	}
	if ents, _ := filepath.Glob(filepath.Join(work, "driver-agent-sysext-*")); len(ents) != 0 {
		t.Errorf("work directories left: %v", ents)
	}
}

// sysextInputs writes under dir the stand-in driver source for tree and a container root with
// its userspace (driver 0.0.1).
func sysextInputs(t *testing.T, dir, tree string) (source, root string) {
	t.Helper()
	source = filepath.Join(dir, "source")
	if err := buildtest.WriteSource(context.Background(), source, tree); err != nil {
		t.Fatal(err)
	}
	root = filepath.Join(dir, "root")
	if err := sysexttest.UserspaceRoot(root, "0.0.1"); err != nil {
		t.Fatal(err)
	}
	return source, root
}
