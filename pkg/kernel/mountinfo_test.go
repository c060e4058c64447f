package kernel

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const mountinfo = `22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
23 22 0:5 / /proc rw,nosuid - proc proc rw

41 22 0:40 / /run/nvidia/driver rw,relatime shared:20 - overlay overlay rw
42 22 0:41 / /mnt/with\040space\134x rw - tmpfs tmpfs rw
43 22 0:42 / /mnt/not\999octal rw - tmpfs tmpfs rw
`

func TestParseMountPoints(t *testing.T) {
	t.Parallel()
	got, err := ParseMountPoints(strings.NewReader(mountinfo))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"/", "/proc", "/run/nvidia/driver", `/mnt/with space\x`, `/mnt/not\999octal`}
	if !slices.Equal(got, want) {
		t.Fatalf("ParseMountPoints = %q, want %q", got, want)
	}
	if _, err := ParseMountPoints(strings.NewReader("22 1 8:1 / /\n")); err == nil || !strings.Contains(err.Error(), "mountinfo line 1: want at least 10 fields, have 5") {
		t.Fatalf("a short line: %v, want a field-count error", err)
	}
}

func TestIsMountPoint(t *testing.T) {
	t.Parallel()
	proc := t.TempDir()
	if _, err := IsMountPoint(proc, "/"); err == nil || !strings.Contains(err.Error(), "mount table") {
		t.Fatalf("without mountinfo: %v, want a mount table error", err)
	}
	if err := os.MkdirAll(filepath.Join(proc, "self"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(proc, "self/mountinfo"), []byte(mountinfo), 0o644); err != nil {
		t.Fatal(err)
	}
	for target, want := range map[string]bool{"/run/nvidia/driver": true, "/run/nvidia": false, "/mnt/with space\\x": true} {
		if got, err := IsMountPoint(proc, target); err != nil || got != want {
			t.Errorf("IsMountPoint(%q) = %t, %v; want %t", target, got, err, want)
		}
	}
}
