package sysext_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/sysext"
)

// An extension-release over 64 KiB is an error naming it, read no further than the limit; the
// other extensions are still found.
func TestFindOversizedRelease(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, sysext.ReleaseDir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	good := sysext.Name("535.261.03", "4593.2.0")
	big := sysext.Name("570.172.08", "4593.2.0")
	rel := sysext.Release{ID: "flatcar", VersionID: "4593.2.0", Architecture: "x86-64"}.Format()
	if err := os.WriteFile(filepath.Join(dir, "extension-release."+good), rel, 0o644); err != nil {
		t.Fatal(err)
	}
	padded := append([]byte(strings.Repeat("# padding\n", 64<<10/10)), rel...)
	if err := os.WriteFile(filepath.Join(dir, "extension-release."+big), padded, 0o644); err != nil {
		t.Fatal(err)
	}
	found, err := sysext.Find(root, sysext.Host{ID: "flatcar", VersionID: "4593.2.0", Architecture: "x86-64"})
	if err == nil || !strings.Contains(err.Error(), "extension-release."+big) || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("Find error %v, want one naming extension-release.%s as too large", err, big)
	}
	if len(found) != 1 || found[0].Name != good || !found[0].Merged || found[0].Refused != nil {
		t.Errorf("found %+v, want only %s, merged and fitting", found, good)
	}
}
