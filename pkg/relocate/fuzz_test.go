package relocate

import (
	"bytes"
	"os"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// FuzzInspectELF feeds arbitrary files to the ELF inspection that decides what Tree touches.
func FuzzInspectELF(f *testing.F) {
	f.Add(hosttest.ModuleELF("vermagic=6.1.0 SMP"))
	f.Add([]byte("\x7fELF\x02\x01\x01"))
	f.Add([]byte("#!/bin/sh\n"))
	if exe, err := os.Executable(); err == nil {
		if b, err := os.ReadFile(exe); err == nil && len(b) > 4096 {
			f.Add(b[:4096])
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		interp, exe, err := inspectELF(bytes.NewReader(data))
		if err != nil && (exe || interp != "") {
			t.Fatalf("error %v with exe %v interp %q", err, exe, interp)
		}
		if interp != "" && !exe {
			t.Fatalf("interpreter %q for a non-executable", interp)
		}
	})
}
