//go:build vmtest

package vm

import (
	"bytes"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// checkVmlinuzBanner runs `driver-agent banner --vmlinuz` on the host against the kernel image
// the guests boot, and checks that it prints exactly the first line of /proc/version that the
// booted kernel showed (VMTEST-BANNER), as precompiled packages are matched against it.
func (h *harness) checkVmlinuzBanner(t *testing.T) {
	booted := h.kernelBanner(t)
	t0 := time.Now()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(h.agent, "banner", "--vmlinuz", h.tl.vmlinuz)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("driver-agent banner --vmlinuz %s: %v\n%s", h.tl.vmlinuz, err, stderr.String())
	}
	got, ok := strings.CutSuffix(stdout.String(), "\n")
	if !ok || strings.Contains(got, "\n") {
		t.Fatalf("driver-agent banner printed %q: want one line", stdout.String())
	}
	if got != booted {
		t.Fatalf("driver-agent banner --vmlinuz %s:\n  %q\nthe booted kernel's /proc/version:\n  %q", h.tl.vmlinuz, got, booted)
	}
	h.timings = append(h.timings, "banner --vmlinuz "+since(t0))
	t.Logf("banner --vmlinuz %s matches the booted kernel: %q (%s)", h.tl.vmlinuz, got, since(t0))
}
