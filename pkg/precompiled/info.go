package precompiled

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
)

// Info writes the text mkprecompiled --info prints for p: the header, then one
// block per member numbered from 1. The linked module CRC and signature size
// lines appear only for a kernel interface with a non-empty signature, as in
// the tool. CRCs are printed in decimal, as the tool does.
func Info(w io.Writer, p *Package) error {
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, "description: %s\n", p.Description)
	fmt.Fprintf(bw, "version: %s\n", p.DriverVersion)
	fmt.Fprintf(bw, "proc version: %s\n", p.ProcVersion)
	fmt.Fprintf(bw, "number of files: %d\n\n", len(p.Files))
	for i := range p.Files {
		f := &p.Files[i]
		fmt.Fprintf(bw, "file %d:\n", i+1)
		fmt.Fprintf(bw, "  name: '%s'\n", f.Name)
		fmt.Fprintf(bw, "  type: %s\n", f.Type)
		fmt.Fprintf(bw, "  attributes: %s\n", f.Attributes)
		fmt.Fprintf(bw, "  size: %d bytes\n", len(f.Data))
		fmt.Fprintf(bw, "  crc: %d\n", f.CRC)
		fmt.Fprintf(bw, "  target directory: %s\n", f.TargetDirectory)
		if f.Type == KernelInterface {
			fmt.Fprintf(bw, "  core object name: %s\n", f.CoreObjectName)
			fmt.Fprintf(bw, "  linked module name: %s\n", f.LinkedModuleName)
			if len(f.Signature) > 0 {
				fmt.Fprintf(bw, "  linked module crc: %d\n", f.LinkedModuleCRC)
				fmt.Fprintf(bw, "  signature size: %d\n", len(f.Signature))
			}
		}
		bw.WriteString("\n")
	}
	return bw.Flush()
}

// PackageInfo is the machine-readable description of a package written by
// InfoJSON. Field names are those of the shared test vectors' expected.json.
// Strings that are not valid UTF-8 are written with U+FFFD replacements.
type PackageInfo struct {
	FormatVersion uint32     `json:"format_version"`
	DriverVersion string     `json:"driver_version"`
	Description   string     `json:"description"`
	ProcVersion   string     `json:"proc_version"`
	NumFiles      int        `json:"num_files"`
	PackageSize   int64      `json:"package_size"`
	PackageSHA256 string     `json:"package_sha256"`
	Files         []FileInfo `json:"files"`
}

// FileInfo describes one member in PackageInfo.
type FileInfo struct {
	Index              uint32   `json:"index"`
	Type               uint32   `json:"type"`
	TypeName           string   `json:"type_name"`
	Attributes         uint32   `json:"attributes"`
	AttributeNames     []string `json:"attribute_names"`
	Name               string   `json:"name"`
	LinkedModuleName   string   `json:"linked_module_name"`
	CoreObjectName     string   `json:"core_object_name"`
	TargetDirectory    string   `json:"target_directory"`
	CRCHex             string   `json:"crc_hex"`
	CRCOfDataHex       string   `json:"crc_of_data_hex"`
	Size               int      `json:"size"`
	SHA256             string   `json:"sha256"`
	LinkedModuleCRCHex string   `json:"linked_module_crc_hex"`
	SignatureSize      int      `json:"signature_size"`
	SignatureSHA256    *string  `json:"signature_sha256"`
	UnpackPathJoined   string   `json:"unpack_path_joined"`
	RecordOffset       int64    `json:"record_offset"`
	RecordSize         int64    `json:"record_size"`
	DataOffset         int64    `json:"data_offset"`
}

// Describe returns the PackageInfo for p. Offsets and sizes are those of the
// package as Marshal writes it, which for a parsed package are the offsets in
// the file it was read from. p must pass Validate.
func Describe(p *Package) (*PackageInfo, error) {
	b, err := p.Marshal()
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(b)
	info := &PackageInfo{
		FormatVersion: FormatVersion,
		DriverVersion: p.DriverVersion,
		Description:   p.Description,
		ProcVersion:   p.ProcVersion,
		NumFiles:      len(p.Files),
		PackageSize:   int64(len(b)),
		PackageSHA256: hex.EncodeToString(sum[:]),
		Files:         make([]FileInfo, 0, len(p.Files)),
	}
	off := p.headerSize()
	for i := range p.Files {
		f := &p.Files[i]
		dataSum := sha256.Sum256(f.Data)
		fi := FileInfo{
			Index:              uint32(i),
			Type:               uint32(f.Type),
			TypeName:           f.Type.String(),
			Attributes:         uint32(f.Attributes),
			AttributeNames:     f.Attributes.Names(),
			Name:               f.Name,
			LinkedModuleName:   f.LinkedModuleName,
			CoreObjectName:     f.CoreObjectName,
			TargetDirectory:    f.TargetDirectory,
			CRCHex:             fmt.Sprintf("%08x", f.CRC),
			CRCOfDataHex:       fmt.Sprintf("%08x", Checksum(f.Data)),
			Size:               len(f.Data),
			SHA256:             hex.EncodeToString(dataSum[:]),
			LinkedModuleCRCHex: fmt.Sprintf("%08x", f.LinkedModuleCRC),
			SignatureSize:      len(f.Signature),
			UnpackPathJoined:   f.TargetDirectory + "/" + f.Name,
			RecordOffset:       off,
			RecordSize:         f.recordSize(),
			// FILE, index, type, attributes, four strings, crc, data length.
			DataOffset: off + 4*10 + int64(len(f.Name)+len(f.LinkedModuleName)+len(f.CoreObjectName)+len(f.TargetDirectory)),
		}
		if len(f.Signature) > 0 {
			s := sha256.Sum256(f.Signature)
			h := hex.EncodeToString(s[:])
			fi.SignatureSHA256 = &h
		}
		info.Files = append(info.Files, fi)
		off += fi.RecordSize
	}
	return info, nil
}

// InfoJSON writes Describe(p) to w as indented JSON followed by a newline.
func InfoJSON(w io.Writer, p *Package) error {
	info, err := Describe(p)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(info)
}
