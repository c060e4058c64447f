package compile

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/build"
	"github.com/driver-agent/driver-agent/pkg/kernel"
)

// ErrNoTree means no local kernel build tree is usable; the release server is next.
var ErrNoTree = errors.New("no usable kernel build tree")

// Tree is a kernel build tree the NVIDIA sources can be built against.
type Tree struct {
	// Dir is the tree (SYSSRC): the directory holding the kernel's Makefile and .config.
	Dir string
	// From says where it came from: "host", "--kernel-build-tree" or the URL it was downloaded from.
	From string
	// Sysroot, for a downloaded Flatcar tree, is the extracted root whose usr/lib64 holds the
	// loader and libraries the tree's helper programs were linked against; "" for local trees.
	Sysroot string
}

// hostTreeDirs are the places, under the host root, where distributions keep the build tree of
// kernel <kver>: Flatcar's production image ships it in /usr/lib/modules, older Flatcar in
// /usr/lib64/modules, most others in /lib/modules.
func hostTreeDirs(kver string) []string {
	return []string{
		filepath.Join("usr/lib/modules", kver, "build"),
		filepath.Join("lib/modules", kver, "build"),
		filepath.Join("usr/lib64/modules", kver, "build"),
	}
}

// localTree returns the first usable tree: the host's own, then the one given with
// --kernel-build-tree. skipped says why each candidate that exists was passed over.
func localTree(hostRoot, given, kver string) (t Tree, skipped []string, err error) {
	seen := map[string]bool{}
	for _, rel := range hostTreeDirs(kver) {
		dir, err := resolveIn(hostRoot, rel)
		if err != nil {
			if !errors.Is(err, fs.ErrNotExist) {
				skipped = append(skipped, fmt.Sprintf("%s: %v", filepath.Join(hostRoot, rel), err))
			}
			continue
		}
		if seen[dir] {
			continue
		}
		seen[dir] = true
		if err := checkTree(dir, kver); err != nil {
			skipped = append(skipped, err.Error())
			continue
		}
		return Tree{Dir: dir, From: "host"}, skipped, nil
	}
	if given != "" {
		if err := checkTree(given, kver); err != nil {
			return Tree{}, skipped, fmt.Errorf("--kernel-build-tree: %w", err)
		}
		return Tree{Dir: given, From: "--kernel-build-tree"}, skipped, nil
	}
	return Tree{}, skipped, ErrNoTree
}

// resolveIn resolves rel inside root as the host would: absolute symlinks are taken relative to
// root, and nothing resolves outside it.
func resolveIn(root, rel string) (string, error) {
	cur := root
	parts := strings.Split(filepath.Clean(rel), "/")
	for hops := 0; len(parts) > 0; {
		p := parts[0]
		parts = parts[1:]
		switch p {
		case "", ".":
			continue
		case "..":
			if cur != root {
				cur = filepath.Dir(cur)
			}
			continue
		}
		next := filepath.Join(cur, p)
		fi, err := os.Lstat(next)
		if err != nil {
			return "", err
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			cur = next
			continue
		}
		if hops++; hops > 40 {
			return "", fmt.Errorf("%s: too many symbolic links", next)
		}
		target, err := os.Readlink(next)
		if err != nil {
			return "", err
		}
		if filepath.IsAbs(target) {
			cur = root
		}
		parts = append(strings.Split(filepath.Clean(target), "/"), parts...)
	}
	if !strings.HasPrefix(cur+"/", strings.TrimSuffix(root, "/")+"/") {
		return "", fmt.Errorf("%s resolves outside %s", rel, root)
	}
	fi, err := os.Stat(cur)
	if err != nil {
		return "", err
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("%s is not a directory", cur)
	}
	return cur, nil
}

// checkTree says whether dir looks like a configured build tree for kver: it has a Makefile and
// a .config, its recorded release (include/generated/utsrelease.h, when present) is kver, and
// files its Makefile includes by absolute path exist (a Debian-style split tree seen through the
// host root names files the container does not have).
func checkTree(dir, kver string) error {
	for _, name := range []string{"Makefile", ".config"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			return fmt.Errorf("%s is not a configured kernel build tree: %w", dir, err)
		}
	}
	// UTS_RELEASE is what the modules' vermagic will say (Debian's include/config/kernel.release
	// holds the upstream version instead).
	b, err := kernel.ReadSmall(filepath.Join(dir, "include/generated/utsrelease.h"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s: %w", dir, err)
	}
	if rel, ok := build.ParseUTSRelease(string(b)); err == nil && ok && rel != kver {
		return fmt.Errorf("%s is the build tree of kernel %s, not of the running kernel %s", dir, rel, kver)
	}
	f, err := os.Open(filepath.Join(dir, "Makefile"))
	if err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "include ")
		if !ok {
			continue
		}
		if inc := strings.TrimSpace(rest); filepath.IsAbs(inc) {
			if _, err := os.Stat(inc); err != nil {
				return fmt.Errorf("%s/Makefile includes %s, which is not visible here (a split headers package seen through the host root); pass the complete tree with --kernel-build-tree", dir, inc)
			}
		}
	}
	return sc.Err()
}
