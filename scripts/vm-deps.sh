#!/usr/bin/env bash
# Installs what `make vm-test` needs on a Debian machine. Run it as root (CI does, before
# `make vm-test`); it does nothing when everything is already present.
#
#  - with apt-get: qemu-system-x86 linux-headers-amd64 busybox-static cpio kmod binutils gcc make
#    patchelf;
#  - the kernel image of the SAME ABI as the installed linux-headers-amd64 (the ABI is read from
#    that metapackage's dependency, never hard-coded), fetched with `apt-get download` and
#    unpacked with `dpkg-deb -x`; its vmlinuz, config and module tree (with a modules.dep made by
#    `depmod -b`, about 400 MB) are kept in $DRIVER_AGENT_VM_CACHE/<abi>/ (default
#    /var/cache/driver-agent-vm), and a file named `complete` is written last. /boot is not
#    touched and the linux-image-amd64 metapackage is not installed (it would pull in
#    initramfs-tools and write to /boot).
#  - a second kernel, trixie's 6.12 with its headers and gcc 14, cached by
#    scripts/vm-deps-kernel.sh (see there) without installing it.
#
# The harness (test/vm) reads the same cache directory and tells you to run this script when
# something is missing.
set -euo pipefail

CACHE=${DRIVER_AGENT_VM_CACHE:-/var/cache/driver-agent-vm}
PKGS=(qemu-system-x86 linux-headers-amd64 busybox-static cpio kmod binutils gcc make patchelf)

log() { echo "vm-deps: $*" >&2; }

# abi prints the kernel ABI (e.g. 6.1.0-57-amd64) that the installed linux-headers-amd64
# depends on, or nothing when it is not installed.
abi() {
  dpkg-query -W -f='${Depends}' linux-headers-amd64 2>/dev/null |
    grep -o 'linux-headers-[0-9][^ ,]*-amd64' | head -n1 | sed 's/^linux-headers-//' || true
}

missing_pkgs() {
  local p
  for p in "${PKGS[@]}"; do
    if [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" != installed ]; then
      echo "$p"
    fi
  done
}

kernel_ready() {
  local a=$1
  [ -n "$a" ] && [ -d "/usr/src/linux-headers-$a" ] && [ -f "$CACHE/$a/complete" ]
}

need=$(missing_pkgs | tr '\n' ' ')
a=$(abi)
if [ -z "${need// /}" ] && kernel_ready "$a"; then
  log "everything needed is present (kernel $a in $CACHE/$a)"
  exec bash "$(dirname "$0")/vm-deps-kernel.sh" trixie
fi
if [ "$(id -u)" -ne 0 ]; then
  log "missing:${need:+ packages ${need}}${a:+ kernel image $a}; run as root: bash scripts/vm-deps.sh"
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
start=$(date +%s)
apt-get update -qq
# Installing linux-headers-amd64 again also upgrades it to the newest ABI in the archive, whose
# image is the one apt-get download can still fetch.
apt-get install -y -qq --no-install-recommends "${PKGS[@]}"
a=$(abi)
if [ -z "$a" ]; then
  log "cannot resolve the kernel ABI from linux-headers-amd64's dependencies"
  exit 1
fi
if [ ! -d "/usr/src/linux-headers-$a" ]; then
  log "/usr/src/linux-headers-$a is missing after installing linux-headers-amd64"
  exit 1
fi

if [ ! -f "$CACHE/$a/complete" ]; then
  ver=$(dpkg-query -W -f='${Version}' "linux-headers-$a")
  work=$(mktemp -d "${TMPDIR:-/tmp}/vm-deps.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  log "downloading linux-image-$a (headers version $ver)"
  # apt-get download writes into the current directory as the _apt user.
  chmod 0777 "$work"
  if ! (cd "$work" && apt-get download -qq "linux-image-$a=$ver"); then
    log "linux-image-$a=$ver is not downloadable; trying the archive's candidate of the same ABI"
    (cd "$work" && apt-get download -qq "linux-image-$a")
  fi
  deb=$(ls "$work"/linux-image-"$a"_*.deb)
  dpkg-deb -x "$deb" "$work/x"
  mods=$work/x/lib/modules/$a
  [ -d "$mods" ] || mods=$work/x/usr/lib/modules/$a
  if [ ! -s "$work/x/boot/vmlinuz-$a" ] || [ ! -d "$mods" ]; then
    log "$deb has no boot/vmlinuz-$a or no lib/modules/$a"
    exit 1
  fi
  depmod -b "$work/x" "$a"
  [ -s "$mods/modules.dep" ] || depmod -b "$work/x/usr" "$a"
  rm -rf "${CACHE:?}/$a"
  mkdir -p "$CACHE/$a"
  install -m 0644 "$work/x/boot/vmlinuz-$a" "$CACHE/$a/vmlinuz"
  install -m 0644 "$work/x/boot/config-$a" "$CACHE/$a/config"
  mv "$mods" "$CACHE/$a/modules"
  basename "$deb" >"$CACHE/$a/package"
  chmod -R a+rX "$CACHE"
  touch "$CACHE/$a/complete"
fi
log "done in $(($(date +%s) - start)) s: kernel $a in $CACHE/$a, headers in /usr/src/linux-headers-$a"
bash "$(dirname "$0")/vm-deps-kernel.sh" trixie
