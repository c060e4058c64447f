#!/usr/bin/env bash
# Downloads Debian's NVIDIA kernel sources (nvidia-kernel-source from non-free and
# nvidia-open-kernel-source from contrib) and lays them out as the driver image does:
#   $DEST/usr/src/nvidia-<version>/kernel
#   $DEST/usr/src/nvidia-<version>/kernel-open
# It reaches non-free and contrib with a private sources file and private apt state, so /etc/apt
# and the system's package lists stay as they are. Nothing it downloads is committed.
#
# SUITE is the Debian suite to take them from (default: this machine's, from /etc/os-release).
#
# HEADERS, when given, is the kernel build tree the sources are for. Linux 6.12.97 (and so Debian's
# 6.12.117) gave pci_resize_resource() a fourth argument, exclude_bars; NVIDIA's open sources up to
# at least 550.163.01 call it with three, and Debian's package carries no fix, so the open flavour
# does not compile against such a kernel. When HEADERS/include/linux/pci.h declares the argument
# and kernel-open/nvidia/nv-pci.c makes the three-argument call, the call gets exclude_bars=0
# (exclude no BAR: the old behaviour), the fix Flatcar's own nvidia-drivers package carries
# (flatcar/scripts#4205); the script says so. The proprietary flavour does not call it.
#
# usage: scripts/nvidia-sources.sh DEST [SUITE [HEADERS]]    (prints the driver version on its last line)
set -euo pipefail

dest=${1:?usage: $0 DEST [SUITE [HEADERS]]}
headers=${3:-}
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
work="$dest/.apt"
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"

suite=${2:-$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
printf 'deb %s %s main contrib non-free\n' "$mirror" "$suite" >"$work/sources.list"
apt=(apt-get -q -o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=-
	-o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)

if ! "${apt[@]}" update >"$work/update.log" 2>&1; then
	echo "nvidia-sources: apt-get update of $mirror $suite (main contrib non-free) failed:" >&2
	tail -5 "$work/update.log" >&2
	exit 1
fi
(cd "$work/debs" && rm -f ./*.deb && "${apt[@]}" download nvidia-kernel-source nvidia-open-kernel-source) >"$work/download.log" 2>&1 || {
	echo "nvidia-sources: downloading nvidia-kernel-source and nvidia-open-kernel-source failed:" >&2
	tail -5 "$work/download.log" >&2
	exit 1
}

deb=$(ls "$work"/debs/nvidia-kernel-source_*.deb)
version=$(dpkg-deb -f "$deb" Version)
version=${version%%-*} # 535.261.03-1 -> 535.261.03
src="$dest/usr/src/nvidia-$version"
rm -rf "$dest"/usr/src/nvidia-* "$work/x"
mkdir -p "$src" "$work/x"
for pkg in nvidia-kernel-source nvidia-open-kernel-source; do
	dpkg-deb -x "$work"/debs/${pkg}_*.deb "$work/x"
done
tar -C "$work/x" -xf "$work/x/usr/src/nvidia-kernel.tar.xz"
tar -C "$work/x" -xf "$work/x/usr/src/nvidia-open-kernel.tar.xz"
mv "$work/x/modules/nvidia-kernel" "$src/kernel"
mv "$work/x/modules/nvidia-open-kernel" "$src/kernel-open"
rm -rf "$work/x"
for f in kernel/nvidia/nv-kernel.o_binary kernel/nvidia-modeset/nv-modeset-kernel.o_binary kernel-open/nvidia/nv-kernel.o_binary; do
	[ -s "$src/$f" ] || { echo "nvidia-sources: $src/$f is missing from Debian's package" >&2; exit 1; }
done
call='pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size)'
pcih=$headers/include/linux/pci.h
if [ -n "$headers" ] && [ ! -f "$pcih" ]; then
	echo "nvidia-sources: $pcih is missing" >&2
	exit 1
fi
if [ -n "$headers" ] && grep -A1 'int __must_check pci_resize_resource(' "$pcih" | grep -q exclude_bars &&
	grep -qF "$call;" "$src/kernel-open/nvidia/nv-pci.c"; then
	sed -i "s/pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size);/pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size, 0);/" "$src/kernel-open/nvidia/nv-pci.c"
	echo "nvidia-sources: $headers's pci_resize_resource() takes exclude_bars (Linux 6.12.97 and later): kernel-open/nvidia/nv-pci.c now passes 0, as Flatcar's nvidia-drivers does" >&2
fi
echo "$version"
