#!/usr/bin/env bash
# Caches a second kernel for the VM tests from another Debian suite (default trixie: the 6.12
# kernels built with gcc 14, the generation Flatcar stable runs), without installing anything
# into the system. scripts/vm-deps.sh runs it; run it as root.
#
# usage: scripts/vm-deps-kernel.sh [SUITE]
#
# The suite is reached with a private sources file and private apt state (as
# scripts/nvidia-sources.sh does), so /etc/apt and the system's package lists stay as they are.
# Nothing is hard-coded: the ABI comes from what the suite's linux-image-amd64 depends on, the
# headers' packages and the compiler package from what linux-headers-<abi> depends on. It keeps,
# in $DRIVER_AGENT_VM_CACHE/<abi>/ (default /var/cache/driver-agent-vm):
#
#  - vmlinuz, config, modules/ (with a modules.dep made by depmod -b) and package, as
#    scripts/vm-deps.sh does for the host's kernel;
#  - headers/: the build tree as Debian ships it, made one self-contained tree the way Flatcar's
#    is (linux-headers-<abi>-common, then linux-headers-<abi> without its one-line Makefile that
#    includes the common one by absolute path, and linux-kbuild-<version>'s scripts/ and tools/
#    in place of the links to them; without vmlinux, which only feeds BTF generation and which
#    Flatcar's tree does not have). Its helpers (fixdep, modpost, objtool...) are the suite's,
#    linked against its newer glibc, so they do not run here: this is the tree the NVIDIA test
#    publishes as a Flatcar release, and the agent must make them runnable;
#  - toolchain/: the suite's compiler (gcc-14) and binutils with the closure of their
#    dependencies (glibc included), unpacked with dpkg-deb -x, every executable pointed at that
#    glibc with patchelf (interpreter and rpath), so they run on this machine; cc links to the
#    compiler;
#  - build/: a copy of headers/ whose helpers are pointed at the toolchain's glibc the same way:
#    a tree the harness can build the stand-ins against, like an installed headers package;
#  - complete, written last.
# $DRIVER_AGENT_VM_CACHE/<suite> links to <abi>: the harness finds the kernel by it.
set -euo pipefail

suite=${1:-trixie}
CACHE=${DRIVER_AGENT_VM_CACHE:-/var/cache/driver-agent-vm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { echo "vm-deps-kernel: $*" >&2; }

if [ -L "$CACHE/$suite" ] && [ -f "$CACHE/$suite/complete" ]; then
  log "the $suite kernel is present: $(readlink "$CACHE/$suite") in $CACHE"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  log "the $suite kernel is missing from $CACHE; run as root: bash scripts/vm-deps-kernel.sh $suite"
  exit 1
fi
for cmd in apt-get apt-cache dpkg-deb depmod patchelf; do
  command -v "$cmd" >/dev/null || { log "$cmd is missing (apt-get install kmod patchelf)"; exit 1; }
done

start=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/vm-deps-kernel.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
chmod 0777 "$work/debs"
printf 'deb %s %s main\n' "$mirror" "$suite" >"$work/sources.list"
: >"$work/status"
opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=-
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
  -o "Dir::State::status=$work/status" -o "Dir::State::extended_states=$work/extended_states"
  -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
apt=(apt-get -q "${opts[@]}")
cache=(apt-cache "${opts[@]}")

if ! "${apt[@]}" update >"$work/update.log" 2>&1; then
  log "apt-get update of $mirror $suite failed:"
  tail -5 "$work/update.log" >&2
  exit 1
fi

# depends PKG REGEX: the first dependency of PKG (in the suite) whose name matches REGEX.
depends() {
  "${cache[@]}" show "$1" | sed -n 's/^Depends: //p' | head -n1 | sed 's/[,|]/\n/g' |
    sed 's/^ *//; s/ .*//' | grep -E -m1 "$2" || true
}

image=$(depends linux-image-amd64 '^linux-image-[0-9].*-amd64$')
if [ -z "$image" ]; then
  log "cannot resolve the kernel ABI from $suite's linux-image-amd64 dependencies"
  exit 1
fi
abi=${image#linux-image-}
headers=linux-headers-$abi
common=$(depends "$headers" '^linux-headers-.*-common$')
kbuild=$(depends "$headers" '^linux-kbuild-')
compiler=$(depends "$headers" '^gcc-[0-9]+$')
if [ -z "$common" ] || [ -z "$kbuild" ] || [ -z "$compiler" ]; then
  log "$headers depends on no -common, linux-kbuild or gcc-N package: $("${cache[@]}" show "$headers" | sed -n 's/^Depends: //p' | head -n1)"
  exit 1
fi
# The toolchain: the compiler, binutils and the kbuild helpers' libraries, with the closure of
# their dependencies as apt resolves it for an empty system (so glibc comes too).
mapfile -t closure < <("${apt[@]}" install -s --no-install-recommends "$compiler" binutils "$kbuild" 2>"$work/resolve.log" |
  sed -n 's/^Inst \([^ ]*\) .*/\1/p' | grep -v -x -F "$kbuild")
if [ ${#closure[@]} -eq 0 ]; then
  log "cannot resolve $compiler's dependencies in $suite:"
  tail -5 "$work/resolve.log" >&2
  exit 1
fi
log "downloading $image, $headers, $common, $kbuild and $compiler with ${#closure[@]} packages of toolchain from $suite"
if ! (cd "$work/debs" && "${apt[@]}" download "$image" "$headers" "$common" "$kbuild" "${closure[@]}") >"$work/download.log" 2>&1; then
  log "downloading from $mirror $suite failed:"
  tail -5 "$work/download.log" >&2
  exit 1
fi

out=$work/out
mkdir -p "$out/toolchain" "$work/image" "$work/headers"
dpkg-deb -x "$work/debs/${image}"_*.deb "$work/image"
for p in "$headers" "$common" "$kbuild"; do
  dpkg-deb -x "$work/debs/${p}"_*.deb "$work/headers"
done
for p in "${closure[@]}"; do
  dpkg-deb -x "$work/debs/${p}"_*.deb "$out/toolchain"
done

mods=$work/image/lib/modules/$abi
[ -d "$mods" ] || mods=$work/image/usr/lib/modules/$abi
if [ ! -s "$work/image/boot/vmlinuz-$abi" ] || [ ! -d "$mods" ]; then
  log "$image has no boot/vmlinuz-$abi or no lib/modules/$abi"
  exit 1
fi
depmod -b "$work/image" "$abi" 2>/dev/null || true
[ -s "$mods/modules.dep" ] || depmod -b "$work/image/usr" "$abi"
[ -s "$mods/modules.dep" ] || { log "depmod made no modules.dep for $abi"; exit 1; }
install -m 0644 "$work/image/boot/vmlinuz-$abi" "$out/vmlinuz"
install -m 0644 "$work/image/boot/config-$abi" "$out/config"
mv "$mods" "$out/modules"
(cd "$work/debs" && ls "${image}"_*.deb) >"$out/package"

src=$work/headers/usr/src
kb=$work/headers/usr/lib/${kbuild}
tree=$out/headers
mkdir "$tree"
cp -a "$src/$common/." "$tree/"
rm -f "$tree/scripts" "$tree/tools"
cp -a "$kb/scripts" "$kb/tools" "$tree/"
(cd "$src/$headers" && tar --exclude=./Makefile --exclude=./scripts --exclude=./tools --exclude=./vmlinux -cf - .) | tar -C "$tree" -xf -
for f in Makefile .config Module.symvers include/generated/utsrelease.h scripts/basic/fixdep scripts/mod/modpost; do
  [ -e "$tree/$f" ] || { log "the merged tree lacks $f"; exit 1; }
done

# relocate DIR...: point every dynamically linked executable under DIR at the toolchain's glibc.
tc=$CACHE/$abi/toolchain
libdir=$tc/usr/lib/x86_64-linux-gnu
loader=$libdir/ld-linux-x86-64.so.2
[ -e "$out/toolchain/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" ] || { log "the toolchain has no ld-linux-x86-64.so.2"; exit 1; }
relocate() {
  local f n=0
  while IFS= read -r -d '' f; do
    case $f in *.so | *.so.*) continue ;; esac
    if patchelf --print-interpreter "$f" >/dev/null 2>&1; then
      patchelf --set-interpreter "$loader" --force-rpath --set-rpath "$libdir" "$f"
      n=$((n + 1))
    fi
  done < <(find "$@" -type f -perm -u+x -print0)
  echo "$n"
}
cp -a "$tree" "$out/build"
n_tc=$(relocate "$out/toolchain/usr/bin" "$out/toolchain/usr/libexec")
n_build=$(relocate "$out/build")
ln -s "toolchain/usr/bin/$compiler" "$out/cc"

rm -rf "${CACHE:?}/$abi"
mkdir -p "$CACHE"
mv "$out" "$CACHE/$abi"
# The relocated programs must run here (the loader path names the cache, so only now).
"$CACHE/$abi/cc" --version >"$work/cc.version" || { log "$CACHE/$abi/cc does not run"; exit 1; }
for h in scripts/basic/fixdep tools/objtool/objtool; do
  out=$("$CACHE/$abi/build/$h" --help 2>&1 || true)
  case $out in *GLIBC* | *"No such file"* | "") log "$CACHE/$abi/build/$h does not run: $out"; exit 1 ;; esac
done
chmod -R a+rX "$CACHE/$abi"
touch "$CACHE/$abi/complete"
ln -sfn "$abi" "$CACHE/$suite"
log "done in $(($(date +%s) - start)) s: $suite kernel $abi in $CACHE/$abi ($(head -n1 "$work/cc.version"); $n_tc toolchain programs and $n_build build helpers relocated)"
