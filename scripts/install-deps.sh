#!/usr/bin/env bash
# Installs what the tests need on a Debian machine: gcc and binutils (the module-file tests compile
# stand-in ELF objects), patchelf (the build-helper relocation tests), xz-utils and zstd
# (compressed-module fixtures), prometheus for promtool (the metrics and alert-rule checks),
# kmod (pkg/depmod checks its index with kmod's modprobe), shellcheck (actionlint runs it on the
# workflows' scripts) and squashfs-tools (the sysext tests make images with mksquashfs and list
# them with unsquashfs); for make image-test and the VM's container scenarios buildah, mmdebstrap,
# makeself, dpkg-dev (dpkg-scanpackages), gpg, e2fsprogs (mke2fs -d) and crun. Go modules come
# through the Go toolchain. Nothing is installed when everything is already present.
set -euo pipefail
need=()
for pair in gcc:gcc ld:binutils objcopy:binutils xz:xz-utils zstd:zstd make:make patchelf:patchelf git:git promtool:prometheus shellcheck:shellcheck mksquashfs:squashfs-tools unsquashfs:squashfs-tools \
	buildah:buildah mmdebstrap:mmdebstrap crun:crun makeself:makeself dpkg-scanpackages:dpkg-dev gpg:gpg mke2fs:e2fsprogs; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
[ -x /usr/sbin/modprobe ] || [ -x /sbin/modprobe ] || command -v modprobe >/dev/null 2>&1 || need+=(kmod)
if [ ${#need[@]} -eq 0 ]; then
  echo "install-deps: everything needed is present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing ${need[*]}; run as root: apt-get install -y ${need[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
