package precompiled

import (
	"bytes"
	"fmt"
	"path/filepath"
)

// NewKernelInterface returns a kernel-interface member named name holding
// data, as mkprecompiled --kernel-interface builds it. linkedModuleName (the
// module the interface links into, e.g. "nvidia.ko") and coreObjectName (the
// object it is linked with, e.g. "nvidia/nv-kernel.o_binary") are required,
// as the tool requires them. targetDir may be empty. data is not copied.
func NewKernelInterface(name, linkedModuleName, coreObjectName, targetDir string, data []byte) (File, error) {
	if linkedModuleName == "" || coreObjectName == "" {
		return File{}, fmt.Errorf("%w: kernel interface %q needs both a linked module name and a core object name", ErrInvalid, name)
	}
	f := File{
		Type:             KernelInterface,
		Name:             name,
		LinkedModuleName: linkedModuleName,
		CoreObjectName:   coreObjectName,
		TargetDirectory:  targetDir,
		CRC:              StoredCRC(data),
		Data:             data,
	}
	if err := f.validate(0, true); err != nil {
		return File{}, err
	}
	return f, nil
}

// NewKernelModule returns a kernel-module member named name holding data, as
// mkprecompiled --kernel-module builds it; signed sets AttrEmbeddedSignature
// (--signed: the module already carries its signature). targetDir may be
// empty. data is not copied.
func NewKernelModule(name, targetDir string, data []byte, signed bool) (File, error) {
	f := File{
		Type:            KernelModule,
		Name:            name,
		TargetDirectory: targetDir,
		CRC:             StoredCRC(data),
		Data:            data,
	}
	if signed {
		f.Attributes |= AttrEmbeddedSignature
	}
	if err := f.validate(0, true); err != nil {
		return File{}, err
	}
	return f, nil
}

// SetDetachedSignature attaches a detached signature to a kernel interface the
// way mkprecompiled --linked-module L --signed-module S does: it sets
// AttrDetachedSignature and AttrLinkedModuleCRC, LinkedModuleCRC to the CRC of
// linkedModule (as the tool stores it, see StoredCRC) and Signature to the
// bytes of signedModule after its first len(linkedModule) bytes.
//
// Unlike the tool, it also requires signedModule to be longer than
// linkedModule and to start with it, since otherwise the stored signature
// could never be valid for the module nvidia-installer links.
func (f *File) SetDetachedSignature(linkedModule, signedModule []byte) error {
	if f.Type != KernelInterface {
		return fmt.Errorf("%w: %q: a detached signature needs a kernel interface, not a %s", ErrInvalid, f.Name, f.Type)
	}
	if len(signedModule) <= len(linkedModule) {
		return fmt.Errorf("%w: %q: the signed module (%d bytes) is not longer than the linked module (%d bytes)",
			ErrInvalid, f.Name, len(signedModule), len(linkedModule))
	}
	if !bytes.Equal(signedModule[:len(linkedModule)], linkedModule) {
		return fmt.Errorf("%w: %q: the signed module does not start with the linked module", ErrInvalid, f.Name)
	}
	f.Attributes |= AttrDetachedSignature | AttrLinkedModuleCRC
	f.LinkedModuleCRC = StoredCRC(linkedModule)
	f.Signature = bytes.Clone(signedModule[len(linkedModule):])
	return nil
}

// Append validates f, sets its Index to its new position and appends it.
// Appending to a package read from disk keeps its header, as mkprecompiled
// --pack does on an existing package.
func (p *Package) Append(f File) error {
	i := len(p.Files)
	f.Index = uint32(i)
	if err := f.validate(i, true); err != nil {
		return err
	}
	p.Files = append(p.Files, f)
	return nil
}

// AddKernelInterface reads the interface object at path and appends it,
// following mkprecompiled's --kernel-interface path --linked-module-name
// linkedModuleName --core-object-name coreObjectName [--target-directory
// targetDir] [--linked-module linkedModule --signed-module signedModule].
// The member is named after the basename of path. linkedModule and
// signedModule are file paths that must be given together or not at all; see
// SetDetachedSignature.
func (p *Package) AddKernelInterface(path, linkedModuleName, coreObjectName, targetDir, linkedModule, signedModule string) error {
	if (linkedModule == "") != (signedModule == "") {
		return fmt.Errorf("%w: %s: a linked module and a signed module must be given together", ErrInvalid, path)
	}
	data, err := readFileLimited(path)
	if err != nil {
		return err
	}
	f, err := NewKernelInterface(filepath.Base(path), linkedModuleName, coreObjectName, targetDir, data)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if linkedModule != "" {
		linked, err := readFileLimited(linkedModule)
		if err != nil {
			return err
		}
		signed, err := readFileLimited(signedModule)
		if err != nil {
			return err
		}
		if err := f.SetDetachedSignature(linked, signed); err != nil {
			return fmt.Errorf("%s, %s: %w", linkedModule, signedModule, err)
		}
	}
	return p.Append(f)
}

// AddKernelModule reads the kernel module at path and appends it, following
// mkprecompiled's --kernel-module path [--signed] [--target-directory
// targetDir]. The member is named after the basename of path.
func (p *Package) AddKernelModule(path, targetDir string, signed bool) error {
	data, err := readFileLimited(path)
	if err != nil {
		return err
	}
	f, err := NewKernelModule(filepath.Base(path), targetDir, data, signed)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return p.Append(f)
}
