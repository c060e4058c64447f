package precompiled

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Unpack writes each member's data to dir/<target directory>/<name>, with
// mode 0644, as mkprecompiled --unpack does, and returns the paths written in
// package order. Signatures are not written. Unlike the tool it creates
// missing target directories (mode 0755) under dir.
//
// All access goes through an os.Root opened on dir, so nothing can be written
// outside dir, neither through the member paths (which Validate already
// restricts) nor through symbolic links already present in dir. dir must
// exist. On error the paths written so far are returned with it.
//
// Unpack checks what Validate checks but the members' CRCs: Read and Parse
// verified them, and link.Link unpacks a package it has just read, so a
// second pass over every byte would only cost the node's start.
func Unpack(p *Package, dir string) ([]string, error) {
	if err := p.validate(false); err != nil {
		return nil, err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	var written []string
	for i := range p.Files {
		f := &p.Files[i]
		rel := filepath.Join(f.TargetDirectory, f.Name)
		if err := writeMember(root, f, rel); err != nil {
			return written, fmt.Errorf("unpack file %d (%q) to %s: %w", i, f.Name, filepath.Join(dir, rel), err)
		}
		written = append(written, filepath.Join(dir, rel))
	}
	return written, nil
}

func writeMember(root *os.Root, f *File, rel string) (err error) {
	if dir := filepath.Dir(rel); dir != "." {
		if err := root.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	out, err := root.OpenFile(rel, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, out.Close()) }()
	// The umask may have narrowed the mode, and an existing file keeps its own.
	if err := out.Chmod(0o644); err != nil {
		return err
	}
	_, err = out.Write(f.Data)
	return err
}
