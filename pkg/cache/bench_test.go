package cache

import (
	"crypto/rand"
	"os"
	"path/filepath"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/link"
)

// BenchmarkStore stores modules of about the sizes of a stripped 550 build (nvidia.ko 40 MiB,
// nvidia-modeset.ko 2 MiB, nvidia-uvm.ko 4 MiB) into a fresh cache directory: the work the
// precompiled and compile paths do beside the load before Ready.
func BenchmarkStore(b *testing.B) {
	src := b.TempDir()
	var mods []link.Module
	var total int64
	for _, m := range []struct {
		file, name string
		size       int
	}{{"nvidia.ko", "nvidia", 40 << 20}, {"nvidia-modeset.ko", "nvidia_modeset", 2 << 20}, {"nvidia-uvm.ko", "nvidia_uvm", 4 << 20}} {
		data := make([]byte, m.size)
		rand.Read(data)
		p := filepath.Join(src, m.file)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			b.Fatal(err)
		}
		mods = append(mods, link.Module{Name: m.name, Path: p})
		total += int64(m.size)
	}
	b.SetBytes(total)
	for b.Loop() {
		dir, err := os.MkdirTemp(b.TempDir(), "cache")
		if err != nil {
			b.Fatal(err)
		}
		if _, err := Store(dir, testKey(), mods); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		os.RemoveAll(dir)
		b.StartTimer()
	}
}
