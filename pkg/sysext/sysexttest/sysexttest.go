// Package sysexttest makes the driver image's userspace for sysext tests: a container root with
// small stand-in files where the driver image has nvidia-smi, nvidia-persistenced, the driver's
// libraries and links, and the GSP firmware.
package sysexttest

import (
	"os"
	"path/filepath"
)

// Libraries are the driver libraries UserspaceRoot writes, as lib<name>.so.<version>.
var Libraries = []string{"libnvidia-ml", "libcuda", "libnvidia-ptxjitcompiler"}

// UserspaceRoot writes, under root, what Dockerfile.build's image holds for driver version:
// usr/bin/nvidia-smi and nvidia-persistenced (shell scripts), the Libraries in
// usr/lib/x86_64-linux-gnu with their soname and development links (libcuda.so.1 ->
// libcuda.so.<version>, libcuda.so -> libcuda.so.1), an unrelated library, and
// usr/share/driver-agent/firmware/nvidia/<version>/gsp_ga10x.bin.
func UserspaceRoot(root, version string) error {
	files := map[string]string{
		"usr/bin/nvidia-smi":                                                   "#!/bin/sh\necho nvidia-smi " + version + "\n",
		"usr/bin/nvidia-persistenced":                                          "#!/bin/sh\necho nvidia-persistenced " + version + "\n",
		"usr/lib/x86_64-linux-gnu/libz.so.1.2.13":                              "not the driver's",
		"usr/share/driver-agent/firmware/nvidia/" + version + "/gsp_ga10x.bin": "GSP firmware " + version,
	}
	for _, l := range Libraries {
		files["usr/lib/x86_64-linux-gnu/"+l+".so."+version] = l + " " + version
	}
	for rel, data := range files {
		p := filepath.Join(root, filepath.FromSlash(rel))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, []byte(data), 0o755); err != nil {
			return err
		}
	}
	lib := filepath.Join(root, "usr/lib/x86_64-linux-gnu")
	for _, l := range Libraries {
		if err := os.Symlink(l+".so."+version, filepath.Join(lib, l+".so.1")); err != nil {
			return err
		}
	}
	return os.Symlink("libcuda.so.1", filepath.Join(lib, "libcuda.so"))
}
