// Package compile is the agent's compile install path: it finds a kernel build tree for the
// running kernel (the host's, one given with --kernel-build-tree, or Flatcar's verified
// flatcar-container.tar.gz from the release server), makes the tree's helper programs runnable in
// the container, builds the NVIDIA modules with the kernel's build system and stores them in the
// host cache.
package compile
