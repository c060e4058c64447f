// Package vm holds the VM tests: the agent's whole lifecycle on a real Linux kernel (Debian's
// linux-image-amd64) booted under qemu with TCG, with stand-in NVIDIA modules built from C in
// standin/ and a busybox guest that runs the scenarios in guest/.
//
// The tests are behind the build tag vmtest so that `go test ./...` does not run them:
//
//	make vm-test   # go test -tags vmtest -v -count=1 -timeout 20m ./test/vm/
//
// scripts/vm-deps.sh (as root) installs what they need; see README.md.
package vm
