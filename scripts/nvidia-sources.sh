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
# usage: scripts/nvidia-sources.sh DEST [SUITE]    (prints the driver version on its last line)
set -euo pipefail

dest=${1:?usage: $0 DEST [SUITE]}
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
echo "$version"
