package cache

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/kernel"
)

// ManifestFormat is the manifest format version this package writes. It reads it and format 2,
// whose modules carry a sha256 instead of an xxh64, so that an entry stored by an earlier agent
// is still used after an upgrade, not rebuilt. Format 1 entries also held the modules a second
// time, as a precompiled package; they read as damaged and are replaced.
const ManifestFormat = 3

// sha256Format is the last format whose modules carry a sha256.
const sha256Format = 2

// maxManifestSize bounds what ReadManifest accepts.
const maxManifestSize = 1 << 20

// maxModuleSize bounds the size of one module (as precompiled.MaxPackageSize bounds a package).
const maxModuleSize = 1 << 30

// maxModules bounds the number of modules in one entry.
const maxModules = 64

// Manifest describes one cache entry; it is stored as manifest.json.
type Manifest struct {
	// Format is ManifestFormat.
	Format int `json:"format"`
	// Key is the key the entry was stored under.
	Key Key `json:"key"`
	// Modules are the entry's modules, in load order as stored.
	Modules []ModuleSum `json:"modules"`
}

// ModuleSum is one module of an entry.
type ModuleSum struct {
	// Name is the kernel's name for the module, e.g. "nvidia_uvm".
	Name string `json:"name"`
	// File is the module's file name in the entry's modules directory, e.g.
	// "nvidia-uvm.ko".
	File string `json:"file"`
	// Size is the module's size in bytes.
	Size int64 `json:"size"`
	// XXH64 is the lower-case hex xxh64 of the module (format 3).
	XXH64 string `json:"xxh64,omitempty"`
	// SHA256 is the lower-case hex sha256 of the module (format 2).
	SHA256 string `json:"sha256,omitempty"`
	// Signed reports whether the module carries a signature.
	Signed bool `json:"signed"`
}

// ReadManifest decodes and checks a manifest: at most 1 MiB of JSON with
// exactly the known fields, format ManifestFormat (each module with its xxh64)
// or 2 (each with its sha256), a valid key, plain file names, lower-case hex
// sums, valid and distinct module names and files. Errors wrap ErrCorrupt.
func ReadManifest(r io.Reader) (*Manifest, error) {
	m, err := readManifest(r)
	if err != nil {
		return nil, fmt.Errorf("%w: manifest: %w", ErrCorrupt, err)
	}
	return m, nil
}

// readManifest is ReadManifest without the ErrCorrupt wrapping.
func readManifest(r io.Reader) (*Manifest, error) {
	b, err := io.ReadAll(io.LimitReader(r, maxManifestSize+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxManifestSize {
		return nil, fmt.Errorf("over %d bytes", maxManifestSize)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var m Manifest
	if err := dec.Decode(&m); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("data after the JSON object")
	}
	if err := m.validate(); err != nil {
		return nil, err
	}
	return &m, nil
}

// marshal encodes m as manifest.json holds it.
func (m *Manifest) marshal() ([]byte, error) {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

func (m *Manifest) validate() error {
	if m.Format != ManifestFormat && m.Format != sha256Format {
		return fmt.Errorf("format %d, want %d or %d", m.Format, ManifestFormat, sha256Format)
	}
	if err := m.Key.validate(); err != nil {
		return err
	}
	if len(m.Modules) == 0 || len(m.Modules) > maxModules {
		return fmt.Errorf("%d modules, want 1 to %d", len(m.Modules), maxModules)
	}
	names, files := map[string]bool{}, map[string]bool{}
	for i, mod := range m.Modules {
		if !kernel.ValidModuleName(mod.Name) || strings.Contains(mod.Name, "-") {
			return fmt.Errorf("module %d: invalid module name %q", i, mod.Name)
		}
		if err := checkFile(mod.File); err != nil {
			return fmt.Errorf("module %d: %w", i, err)
		}
		if err := mod.checkSums(m.Format); err != nil {
			return fmt.Errorf("module %d: %w", i, err)
		}
		if mod.Size < 0 {
			return fmt.Errorf("module %d: negative size %d", i, mod.Size)
		}
		if names[mod.Name] || files[mod.File] {
			return fmt.Errorf("module %d: %s (%s) listed twice", i, mod.Name, mod.File)
		}
		names[mod.Name], files[mod.File] = true, true
	}
	return nil
}

// checkFile accepts a plain, visible file name.
func checkFile(name string) error {
	if name == "" || strings.HasPrefix(name, ".") || strings.ContainsAny(name, "/\\\x00") || len(name) > 255 {
		return fmt.Errorf("invalid file name %q", name)
	}
	return nil
}

// checkSums accepts the one sum of the manifest's format: an xxh64, or a sha256 in format 2.
func (m ModuleSum) checkSums(format int) error {
	if format == sha256Format {
		if m.XXH64 != "" {
			return fmt.Errorf("an xxh64 in a format %d manifest", format)
		}
		return checkHex("sha256", m.SHA256, sha256.Size)
	}
	if m.SHA256 != "" {
		return fmt.Errorf("a sha256 in a format %d manifest", format)
	}
	return checkHex("xxh64", m.XXH64, 8) // an xxh64 is 8 bytes
}

// checkHex accepts size bytes written as lower-case hex digits.
func checkHex(what, s string, size int) error {
	if len(s) != 2*size || strings.ToLower(s) != s {
		return fmt.Errorf("invalid %s %q", what, s)
	}
	if _, err := hex.DecodeString(s); err != nil {
		return fmt.Errorf("invalid %s %q", what, s)
	}
	return nil
}
