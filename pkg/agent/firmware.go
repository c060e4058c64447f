package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// imageFirmwareDir is where the image keeps its copy of the GSP firmware, under the container
// root: the gpu-operator mounts the host's /run/nvidia/driver/lib/firmware over /lib/firmware,
// hiding what the image installed there, and the kernel reads that host directory (see
// firmwareSearchPath) when the nvidia module initialises a GPU, before the root is shared.
const imageFirmwareDir = "usr/share/driver-agent/firmware/nvidia"

// installFirmware copies the image's GSP firmware for this driver version into
// <root>/lib/firmware/nvidia/<version> before the modules load. Files already there with the same
// size are kept. The copies are removed at teardown once nvidia is gone, so a GPU still in use
// keeps its firmware.
func (r *run) installFirmware() error {
	src := r.Host.InRoot(imageFirmwareDir, r.Config.DriverVersion)
	entries, err := os.ReadDir(src)
	if errors.Is(err, fs.ErrNotExist) {
		r.Log.Debug("the image has no GSP firmware copy", "dir", src)
		return nil
	}
	if err != nil {
		return fmt.Errorf("GSP firmware: %w", err)
	}
	dst := r.Host.InRoot("lib/firmware/nvidia", r.Config.DriverVersion)
	var todo []string
	for _, e := range entries {
		fi, err := os.Stat(filepath.Join(src, e.Name()))
		if err != nil || !fi.Mode().IsRegular() {
			continue
		}
		if have, err := os.Stat(filepath.Join(dst, e.Name())); err == nil && have.Size() == fi.Size() {
			continue
		}
		todo = append(todo, e.Name())
	}
	if len(todo) == 0 {
		return nil
	}
	var dsts []string
	for _, name := range todo {
		dsts = append(dsts, filepath.Join(dst, name))
	}
	if err := r.recordFirmware(missingDirs(dst), dsts); err != nil {
		return err
	}
	if err := r.mkdirUndo(PhaseLoad, dst); err != nil {
		return fmt.Errorf("GSP firmware: %w", err)
	}
	var copied []string
	r.push(PhaseLoad, func(context.Context) error {
		if _, err := os.Stat(r.Host.InSys("module/nvidia")); err == nil {
			r.Log.Info("nvidia is still loaded; leaving its GSP firmware in place", "dir", dst)
			return nil
		}
		var errs []error
		for _, p := range copied {
			errs = append(errs, r.Host.Files.Remove(p))
		}
		return errors.Join(errs...)
	})
	for _, name := range todo {
		to := filepath.Join(dst, name)
		// Through a temporary file renamed into place, so the kernel never reads a partial file.
		if err := r.Host.Files.CopyFile(filepath.Join(src, name), to, 0o644); err != nil {
			return fmt.Errorf("GSP firmware: %w", err)
		}
		copied = append(copied, to)
	}
	r.Log.Info("Installed the GSP firmware", "files", len(copied), "dir", dst)
	return nil
}
