#!/usr/bin/env bash
# make image-test: builds Dockerfile.build with buildah as CI would build the driver image, with
# no registry and no NVIDIA download server, and checks the image it made.
#
#  - BASE_IMAGE is a Debian base made by mmdebstrap (imported with FROM scratch + ADD); the agent
#    stage's golang:<GO_VERSION> is the same base plus this machine's Go toolchain, tagged
#    docker.io/library/golang:<GO_VERSION> in local storage, and the build runs with --pull=never;
#  - DRIVER_BASE_URL and CUDA_REPO_BASE point at a busybox httpd on 127.0.0.1 serving
#      <ver>/NVIDIA-Linux-x86_64-<ver>.run   made with makeself: Debian's real NVIDIA kernel sources
#                                            (scripts/nvidia-sources.sh) and userspace laid out as
#                                            NVIDIA's .run lays it out (test/vm/README.md says
#                                            which parts are stand-ins);
#      cuda/x86_64/                          a signed apt repository with stand-in
#                                            nvidia-fabricmanager-<branch> and libnvidia-nscq-<branch>
#                                            debs (dpkg-deb), and a cuda-keyring deb pointing at it.
#
# Then it checks the image (entrypoint, labels, nvidia-driver link, static agent, kernel sources,
# firmware, toolchain, fabric manager pins), prints its size, and leaves its root filesystem in
# $WORK/rootfs.ext4 (made with mke2fs -d) for the VM's container scenarios (test/vm, TestContainer). One line per check:
#   image-test: PASS|FAIL <what it checked>
#
# usage: scripts/image-test.sh   (as root; WORK=${DRIVER_AGENT_IMAGE_WORK:-/var/tmp/driver-agent-image})
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
WORK=${DRIVER_AGENT_IMAGE_WORK:-/var/tmp/driver-agent-image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=$(. /etc/os-release && echo "${VERSION_CODENAME:?}")
# The same <dir>/<suite> as make nvidia-test's, so the suite's sources are downloaded into one place.
SOURCES=${DRIVER_AGENT_NVIDIA_SOURCES:-/tmp/driver-agent-nvidia-sources}/$SUITE
GO_VERSION=$(sed -n 's/^ARG GO_VERSION=//p' "$repo/Dockerfile.build")
IMAGE=localhost/driver-agent-image-test
BASE=localhost/driver-agent-image-test/debian:$SUITE
GOIMG=docker.io/library/golang:$GO_VERSION
BUILDAH=(buildah --storage-driver vfs)

log() { echo "image-test: $*" >&2; }
die() { log "$*"; exit 1; }
fails=0
check() { # check "what" command...: one result line
	local what=$1
	shift
	if out=$("$@" 2>&1); then
		echo "image-test: PASS $what"
	else
		echo "image-test: FAIL $what: $(echo "$out" | tail -3 | tr '\n' ' ')"
		fails=$((fails + 1))
	fi
}
t0=$(date +%s)
t_last=$t0
times=()
stage() { # stage NAME: how long since the last stage ended
	local now
	now=$(date +%s)
	times+=("$1 $((now - t_last)) s")
	t_last=$now
}

[ "$(id -u)" -eq 0 ] || die "run as root (buildah's vfs storage and chroot isolation need it)"
for c in buildah mmdebstrap makeself dpkg-deb dpkg-scanpackages gpg busybox readelf mke2fs; do
	command -v "$c" >/dev/null || die "$c is missing; run as root: bash scripts/vm-deps.sh"
done
mkdir -p "$WORK"

# --- NVIDIA's kernel sources (Debian's) and the userspace packages -------------------------------
version=$(bash "$repo/scripts/nvidia-sources.sh" "$SOURCES" "$SUITE" | tail -n1)
branch=${version%%.*}
stage sources
apt_dir="$WORK/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
printf 'deb %s %s main contrib non-free non-free-firmware\n' "$MIRROR" "$SUITE" >"$apt_dir/sources.list"
apt=(apt-get -q -o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o Dir::Etc::sourceparts=-
	-o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o APT::Sandbox::User=root)
"${apt[@]}" update >"$apt_dir/update.log" 2>&1 || { tail -5 "$apt_dir/update.log" >&2; die "apt-get update failed"; }
userspace=(nvidia-smi libnvidia-ml1 libnvidia-cfg1 firmware-nvidia-gsp nvidia-persistenced nvidia-kernel-source)
(cd "$apt_dir/debs" && rm -f ./*.deb && "${apt[@]}" download "${userspace[@]}") >"$apt_dir/download.log" 2>&1 ||
	{ tail -5 "$apt_dir/download.log" >&2; die "downloading ${userspace[*]} failed"; }
for p in nvidia-smi libnvidia-ml1 firmware-nvidia-gsp; do
	v=$(dpkg-deb -f "$apt_dir"/debs/${p}_*.deb Version)
	[ "${v%%-*}" = "$version" ] || die "$p is $v, the kernel sources $version: Debian's archive is mid-update, retry later"
done

# --- the .run ------------------------------------------------------------------------------------
# NVIDIA's layout (what nvidia-installer and the Dockerfile read): kernel/, kernel-open/, the
# userspace binaries and libraries at the top, firmware/, LICENSE, mkprecompiled, nvidia-installer.
www="$WORK/www"
rm -rf "$www" "$WORK/run"
name="NVIDIA-Linux-x86_64-$version"
run_dir="$WORK/run/$name"
mkdir -p "$run_dir" "$www/$version" "$WORK/run/x"
for d in "$apt_dir"/debs/*.deb; do dpkg-deb -x "$d" "$WORK/run/x"; done
x="$WORK/run/x"
cp -a "$SOURCES/usr/src/nvidia-$version/kernel" "$SOURCES/usr/src/nvidia-$version/kernel-open" "$run_dir/"
cp -a "$x/usr/lib/nvidia/current/nvidia-smi" "$x/usr/bin/nvidia-persistenced" "$run_dir/"
cp -a "$x/usr/lib/x86_64-linux-gnu/nvidia/current"/lib{nvidia-ml,nvidia-cfg}.so."$version" "$run_dir/"
mkdir -p "$run_dir/firmware"
cp -a "$x/lib/firmware/nvidia/$version"/gsp_*.bin "$run_dir/firmware/"
cp "$x/usr/share/doc/nvidia-kernel-source/copyright" "$run_dir/LICENSE"
install -m 0755 "$repo/test/image/nvidia-installer" "$run_dir/nvidia-installer"
install -m 0755 "$repo/test/image/mkprecompiled" "$run_dir/mkprecompiled"
printf 'NVIDIA Accelerated Graphics Driver for Linux-x86_64\n%s\n' "$version" >"$run_dir/.manifest"
# NVIDIA's list of chips and whether the open modules drive them; Debian does not ship it, so a
# stand-in with two chips (the agent's KERNEL_MODULE_TYPE=auto reads it).
mkdir -p "$run_dir/supported-gpus"
cat >"$run_dir/supported-gpus/supported-gpus.json" <<'JSON'
{"chips": [
  {"devid": "0x1EB8", "name": "Tesla T4 (image-test stand-in entry)", "features": ["kernelopen"]},
  {"devid": "0x20B0", "name": "NVIDIA A100-SXM4-40GB (image-test stand-in entry)", "features": ["kernelopen"]}
]}
JSON
# NVIDIA's .run is makeself with an extra -x (extract into ./NVIDIA-Linux-<arch>-<version> and
# stop); Debian's makeself header gets that option here, as --noexec --keep.
sed 's/^\t--noexec)$/\t-x|--extract-only)\n\tscript=""\n\tcleanup_script=""\n\tkeep=y\n\tshift\n\t;;\n&/' \
	/usr/share/makeself/makeself-header.sh >"$WORK/run/header.sh"
grep -q -- '-x|--extract-only)' "$WORK/run/header.sh" || die "cannot add -x to $(command -v makeself)'s header"
(cd "$WORK/run" && makeself --quiet --header "$WORK/run/header.sh" --notemp --nox11 --gzip --complevel 1 \
	"$name" "$www/$version/$name.run" "NVIDIA Accelerated Graphics Driver (driver-agent image-test)" ./nvidia-installer) >/dev/null
run_sha=$(sha256sum "$www/$version/$name.run" | cut -d' ' -f1)
stage .run

# --- the CUDA repository: fabric manager and NSCQ stand-ins, signed ------------------------------
repo_dir="$www/cuda/x86_64"
mkdir -p "$repo_dir"
export GNUPGHOME="$WORK/gnupg"
rm -rf "$GNUPGHOME" && mkdir -m 0700 "$GNUPGHOME"
gpg --batch --quiet --pinentry-mode loopback --passphrase '' \
	--quick-gen-key "driver-agent image-test <image-test@driver-agent.invalid>" ed25519 sign never 2>/dev/null
gpg --batch --export >"$WORK/run/cuda-archive-keyring.gpg"
deb() { # deb NAME VERSION ARCH ROOT DESCRIPTION: a stand-in package made with dpkg-deb
	local root=$4
	mkdir -p "$root/DEBIAN"
	printf 'Package: %s\nVersion: %s\nArchitecture: %s\nMaintainer: driver-agent image-test <image-test@driver-agent.invalid>\nDescription: %s\n' \
		"$1" "$2" "$3" "$5" >"$root/DEBIAN/control"
	dpkg-deb --root-owner-group -Zxz -b "$root" "$repo_dir/${1}_${2}_${3}.deb" >/dev/null
}
fm="$WORK/run/fm"
mkdir -p "$fm/usr/bin" "$fm/usr/share/nvidia/nvswitch"
install -m 0755 "$repo/test/vm/guest/nv-fabricmanager" "$fm/usr/bin/nv-fabricmanager"
cp "$repo/test/vm/guest/fabricmanager.cfg" "$fm/usr/share/nvidia/nvswitch/fabricmanager.cfg"
deb "nvidia-fabricmanager-$branch" "$version-1" amd64 "$fm" "stand-in for NVIDIA's fabric manager (driver-agent image-test)"
nscq="$WORK/run/nscq"
mkdir -p "$nscq/usr/lib/x86_64-linux-gnu"
echo "stand-in for NVIDIA's libnvidia-nscq (driver-agent image-test)" >"$nscq/usr/lib/x86_64-linux-gnu/libnvidia-nscq.so.$version"
deb "libnvidia-nscq-$branch" "$version-1" amd64 "$nscq" "stand-in for NVIDIA's NSCQ library (driver-agent image-test)"
# An older version of each, so that the pin (=<version>-1) is what picks the package.
deb "nvidia-fabricmanager-$branch" "$branch.1.1-1" amd64 "$fm" "older stand-in"
deb "libnvidia-nscq-$branch" "$branch.1.1-1" amd64 "$nscq" "older stand-in"
(cd "$repo_dir" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null >Packages && gzip -9k Packages)
{
	echo "Origin: driver-agent image-test"
	echo "Label: cuda stand-in"
	echo "Date: $(date -Ru)"
	echo "SHA256:"
	for f in Packages Packages.gz; do printf ' %s %s %s\n' "$(sha256sum "$repo_dir/$f" | cut -d' ' -f1)" "$(stat -c %s "$repo_dir/$f")" "$f"; done
} >"$repo_dir/Release"
gpg --batch --yes --clearsign -o "$repo_dir/InRelease" "$repo_dir/Release"
port=$((20000 + RANDOM % 20000))
kr="$WORK/run/keyring"
mkdir -p "$kr/usr/share/keyrings" "$kr/etc/apt/sources.list.d"
cp "$WORK/run/cuda-archive-keyring.gpg" "$kr/usr/share/keyrings/"
echo "deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] http://127.0.0.1:$port/cuda/x86_64/ /" \
	>"$kr/etc/apt/sources.list.d/cuda-$SUITE-x86_64.list"
deb cuda-keyring 1.1-1 all "$kr" "stand-in for NVIDIA's CUDA repository keyring (driver-agent image-test)"

busybox httpd -f -p "127.0.0.1:$port" -h "$www" &
httpd=$!
trap 'kill $httpd 2>/dev/null || true' EXIT
stage repository

# --- the base images -----------------------------------------------------------------------------
# Reused from an earlier run when present (remove $WORK/base*.tar to make them again).
if [ ! -s "$WORK/base.tar" ]; then
	mmdebstrap --quiet --variant=minbase "$SUITE" "$WORK/base.new.tar" "$MIRROR" && mv "$WORK/base.new.tar" "$WORK/base.tar"
fi
goroot=$(go env GOROOT)
[ "$(go env GOVERSION)" = "go$GO_VERSION" ] || case "$(go env GOVERSION)" in go"$GO_VERSION".*) ;; *) die "Dockerfile.build wants Go $GO_VERSION, this machine has $(go env GOVERSION)" ;; esac
ctx="$WORK/ctx"
rm -rf "$ctx" && mkdir -p "$ctx"
ln "$WORK/base.tar" "$ctx/base.tar" 2>/dev/null || cp "$WORK/base.tar" "$ctx/base.tar"
printf 'FROM scratch\nADD base.tar /\nCMD ["/bin/bash"]\n' >"$ctx/Containerfile.base"
"${BUILDAH[@]}" bud --quiet --isolation chroot --pull=never -f "$ctx/Containerfile.base" -t "$BASE" "$ctx" >/dev/null
tar -C "$(dirname "$goroot")" -cf "$ctx/go.tar" "$(basename "$goroot")"
# The agent's modules, downloaded here (through this machine's proxy and trust) into a module
# cache that the image carries; GOPROXY=off in it, so the build inside needs no network.
(cd "$repo" && GOMODCACHE="$WORK/gomod" GOFLAGS=-modcacherw go mod download)
tar -C "$WORK" -cf "$ctx/gomod.tar" --transform 's|^gomod|go/pkg/mod|' gomod
cat >"$ctx/Containerfile.golang" <<EOF
FROM $BASE
RUN apt-get update && apt-get install -y --no-install-recommends make binutils && rm -rf /var/lib/apt/lists/*
ADD go.tar /usr/local/
ADD gomod.tar /
ENV GOPATH=/go GOPROXY=off GOTOOLCHAIN=local PATH=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EOF
"${BUILDAH[@]}" bud --quiet --isolation chroot --pull=never -f "$ctx/Containerfile.golang" -t "$GOIMG" "$ctx" >/dev/null
rm -rf "$ctx"
stage "base images"

# --- the build -----------------------------------------------------------------------------------
tag="$IMAGE:$version"
agent_version=$(git -C "$repo" describe --tags --always --dirty 2>/dev/null || echo dev)
revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || true) # read once: the label check must not see a later HEAD
"${BUILDAH[@]}" bud --isolation chroot --pull=never --layers=false -f "$repo/Dockerfile.build" \
	--build-arg BASE_IMAGE="$BASE" \
	--build-arg TARGETOS=linux --build-arg TARGETARCH=amd64 \
	--build-arg DRIVER_VERSION="$version" \
	--build-arg DRIVER_BASE_URL="http://127.0.0.1:$port" \
	--build-arg DRIVER_RUN_SHA256_AMD64="$run_sha" \
	--build-arg CUDA_REPO_BASE="http://127.0.0.1:$port/cuda" \
	--build-arg GCC_MAJOR="$(gcc -dumpversion | cut -d. -f1)" \
	--build-arg VERSION="$agent_version" \
	--build-arg REVISION="$revision" \
	-t "$tag" "$repo" >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; die "buildah bud of Dockerfile.build failed (whole log: $WORK/build.log)"; }
stage "image build"
"${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true # the images earlier runs tagged

# --- the checks ----------------------------------------------------------------------------------
inspect() { "${BUILDAH[@]}" inspect --type image --format "$1" "$tag"; }
ctr=$("${BUILDAH[@]}" from --pull-never "$tag")
trap 'kill $httpd 2>/dev/null || true; "${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
root=$("${BUILDAH[@]}" mount "$ctr")
in_image() { chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
eq() { [ "$1" = "$2" ] || { echo "got '$1', want '$2'"; return 1; }; }

check "entrypoint [nvidia-driver init], no cmd" eq "$(inspect '{{.OCIv1.Config.Entrypoint}} {{len .OCIv1.Config.Cmd}}')" '[nvidia-driver init] 0'
check "env DRIVER_VERSION=$version NVIDIA_VISIBLE_DEVICES=void" eq \
	"$(inspect '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' | grep -E '^(DRIVER_VERSION|NVIDIA_VISIBLE_DEVICES)=' | sort | tr '\n' ' ')" \
	"DRIVER_VERSION=$version NVIDIA_VISIBLE_DEVICES=void "
label() { inspect "{{index .OCIv1.Config.Labels \"$1\"}}"; }
check "labels driver-version $version, kind build, base.name $BASE, title, source, version, revision" sh -c \
	"test '$(label io.driver-agent.driver-version)/$(label io.driver-agent.kind)/$(label org.opencontainers.image.base.name)' = '$version/build/$BASE' && test -n '$(label org.opencontainers.image.title)' -a -n '$(label org.opencontainers.image.source)' -a -n '$(label org.opencontainers.image.version)' -a '$(label org.opencontainers.image.revision)' = '$revision'"
check "nvidia-driver is a link to driver-agent" eq "$(readlink "$root/usr/local/bin/nvidia-driver")" driver-agent
check "driver-agent is static (no PT_INTERP)" sh -c "! readelf -l '$root/usr/local/bin/driver-agent' | grep -q INTERP"
check "nvidia-driver version runs in the image and says $agent_version" sh -c "chroot '$root' /usr/local/bin/nvidia-driver version | grep -qF -- '$agent_version'"
src="/usr/src/nvidia-$version"
check "kernel sources in $src (kernel, kernel-open, nv-kernel.o_binary, Kbuild, LICENSE, mkprecompiled, supported-gpus.json)" \
	sh -c "cd '$root$src' && test -s supported-gpus/supported-gpus.json -a -s kernel/nvidia/nv-kernel.o_binary -a -s kernel/nvidia-modeset/nv-modeset-kernel.o_binary -a -s kernel-open/nvidia/nv-kernel.o_binary -a -f kernel/Kbuild -a -f kernel-open/Kbuild -a -f LICENSE -a -x mkprecompiled -a -d kernel/precompiled -o ! -e kernel/precompiled"
check "GSP firmware in /lib/firmware/nvidia/$version and hard-linked in /usr/share/driver-agent/firmware" \
	sh -c "ls '$root/lib/firmware/nvidia/$version'/gsp_*.bin >/dev/null && for f in '$root/lib/firmware/nvidia/$version'/gsp_*.bin; do test \"\$f\" -ef '$root/usr/share/driver-agent/firmware/nvidia/$version'/\$(basename \"\$f\") || exit 1; done"
check "userspace: nvidia-smi, nvidia-persistenced, libnvidia-ml.so.1 -> .so.$version" \
	sh -c "test -x '$root/usr/bin/nvidia-smi' -a -x '$root/usr/bin/nvidia-persistenced' && test \"\$(readlink '$root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1')\" = libnvidia-ml.so.$version"
gcc_major=$(gcc -dumpversion | cut -d. -f1)
check "toolchain: gcc $gcc_major as cc, make, ld, libelf headers, patchelf, kmod" \
	in_image sh -c "cc --version | head -1 | grep -q ' $gcc_major\.' && make --version >/dev/null && ld --version >/dev/null && test -f /usr/include/libelf.h && patchelf --version >/dev/null && modprobe --version >/dev/null"
check "toolchain compiles and links a C file" in_image sh -c 'printf "int main(void){return 0;}\n" >/tmp/t.c && cc -o /tmp/t /tmp/t.c && /tmp/t && rm -f /tmp/t /tmp/t.c'
check "fabric manager nvidia-fabricmanager-$branch=$version-1 and libnvidia-nscq-$branch=$version-1, held, cuda list removed" \
	in_image sh -c "test \"\$(dpkg-query -W -f='\${Version}' nvidia-fabricmanager-$branch)\" = $version-1 && test \"\$(dpkg-query -W -f='\${Version}' libnvidia-nscq-$branch)\" = $version-1 && apt-mark showhold | grep -qx nvidia-fabricmanager-$branch && test -x /usr/bin/nv-fabricmanager && ! ls /etc/apt/sources.list.d/cuda* 2>/dev/null"
check "the runfile stage's files are not in the image (/drivers empty)" sh -c "test -z \"\$(ls -A '$root/drivers')\""
stage checks
# The root filesystem for the VM's container scenarios: an ext4 image made with mke2fs -d, with
# 512 MiB free for what the container writes (the guest attaches it with snapshot=on).
size=$(du -sb "$root" | cut -f1)
rm -f "$WORK/rootfs.ext4" "$WORK/rootfs.version"
mke2fs -q -t ext4 -L driver-image -d "$root" "$WORK/rootfs.ext4" $(((size / 1024 / 1024 + 512) * 1024))K
echo "$version" >"$WORK/rootfs.version"
"${BUILDAH[@]}" umount "$ctr" >/dev/null
stage "rootfs.ext4"
echo "image-test: image $tag: $((size / 1024 / 1024)) MiB unpacked, $("${BUILDAH[@]}" images --format '{{.Size}}' "$tag") as buildah reports it; root filesystem image $WORK/rootfs.ext4"
echo "image-test: times: ${times[*]} (total $(($(date +%s) - t0)) s)"
[ "$fails" -eq 0 ] || die "$fails checks failed"
