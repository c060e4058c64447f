#!/usr/bin/env bash
# Measures the agent's download path (issue 6) on loopback; a measurement, not a test.
#
# Makes a flatcar-container.tar.gz-like tarball of about MIB MiB (default 320; build tree and
# usr/lib64 that the agent extracts, mostly incompressible data that it skips), serves it as a
# signed Flatcar release on 127.0.0.1 and times, best of RUNS (default 2), each reading the same
# URL from the page cache:
#   agent   flatcar.Fetcher.BuildTree: HTTP -> sha512 -> gunzip -> tar -> extract, verified
#   sha     curl -s URL | sha512sum
#   tarxz   curl -s URL | tar xz        (extracts everything)
#   tarsub  curl -s URL | tar xz MEMBERS (the same members as the agent, for information)
# and prints wall times, the agent's ratios to both, its peak RSS, and the bytes each wrote to
# disk (getrusage's block outputs, as /usr/bin/time reports them, which count whole pages) against
# the disk space of what it extracted (du -B1). Targets (issue 6): agent <= 1.2 x tarxz, peak RSS < 64 MiB, disk written <= extracted.
#
# Usage: scripts/measure-fetch.sh [WORKDIR]   (default: a new /tmp/measure-fetch-* directory;
# the tarball is kept there and reused by later runs with the same WORKDIR)
set -euo pipefail

MIB=${MIB:-320}
KVER=6.12.81-flatcar # the kernel release test/measure/fetch uses
RUNS=${RUNS:-2}
missing=()
for pair in curl:curl tar:tar gzip:gzip sha512sum:coreutils /usr/bin/time:time; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "measure-fetch: missing tools; run: apt-get install -y ${missing[*]}" >&2
  exit 1
fi

cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d /tmp/measure-fetch-XXXXXX)}
mkdir -p "$work"
go build -o "$work/fetch" ./test/measure/fetch
tarball=$work/flatcar-container.tar.gz
if [ ! -s "$tarball" ]; then
  echo "generating $tarball (about $MIB MiB)..."
  "$work/fetch" gen -out "$tarball" -mib "$MIB"
fi

"$work/fetch" serve -tarball "$tarball" -keyring "$work/keyring.asc" >"$work/serve.out" &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -rf "$work"/x-*' EXIT
for _ in $(seq 100); do
  [ "$(wc -l <"$work/serve.out")" -ge 2 ] && break
  sleep 0.2
done
template=$(sed -n 1p "$work/serve.out")
url=$(sed -n 2p "$work/serve.out")
[ -n "$url" ] || { echo "measure-fetch: the server did not start" >&2; exit 1; }
curl -sf -o /dev/null "$url" # the tarball into the page cache

# run NAME CMD...: runs CMD under /usr/bin/time, keeps the best wall time, its peak RSS (KiB) and
# block outputs (512-byte units, the command and the children it waited for).
declare -A wall rss out
run() {
  local name=$1; shift
  sync
  /usr/bin/time -f '%e %M %O' -o "$work/time.$name" "$@" >"$work/out.$name" 2>&1 || {
    echo "measure-fetch: $name failed:" >&2; cat "$work/out.$name" >&2; exit 1; }
  local e m o
  read -r e m o <"$work/time.$name"
  if [ -z "${wall[$name]:-}" ] || awk -v a="$e" -v b="${wall[$name]}" 'BEGIN{exit !(a<b)}'; then
    wall[$name]=$e; rss[$name]=$m; out[$name]=$o
  fi
}

for i in $(seq "$RUNS"); do
  echo "run $i of $RUNS..."
  run sha bash -c "curl -sf '$url' | sha512sum >/dev/null"
  rm -rf "$work/x-tar"; mkdir "$work/x-tar"
  run tarxz bash -c "curl -sf '$url' | tar xz -C '$work/x-tar'"
  rm -rf "$work/x-sub"; mkdir "$work/x-sub"
  run tarsub bash -c "curl -sf '$url' | tar xz -C '$work/x-sub' --wildcards './usr/lib/modules/$KVER/build' \
    './usr/lib/modules/$KVER/source' './usr/lib/modules/$KVER/modules.*' './usr/lib64/*'"
  rm -rf "$work/x-agent"
  run agent "$work/fetch" get -url "$template" -keyring "$work/keyring.asc" -dest "$work/x-agent"
done

size=$(stat -c %s "$tarball")
agent_tree=$(du -s -B1 "$work/x-agent" | cut -f1)
tar_tree=$(du -s -B1 "$work/x-tar" | cut -f1)
echo
echo "tarball: $size bytes ($((size >> 20)) MiB) at $url"
grep '^agent:' "$work/out.agent" || true
awk -v a="${wall[agent]}" -v s="${wall[sha]}" -v t="${wall[tarxz]}" -v u="${wall[tarsub]}" \
    -v rss="${rss[agent]}" -v ao="${out[agent]}" -v to="${out[tarxz]}" \
    -v at="$agent_tree" -v tt="$tar_tree" 'BEGIN {
  printf "wall time (best of runs):  agent %.2fs   curl|sha512sum %.2fs   curl|tar xz %.2fs   curl|tar xz MEMBERS %.2fs\n", a, s, t, u
  printf "agent / (curl|sha512sum) = %.2f\n", a / s
  printf "agent / (curl|tar xz)    = %.2f   (target <= 1.2)\n", a / t
  printf "agent / (curl|tar xz MEMBERS) = %.2f (same members extracted, no verification in tar)\n", a / u
  printf "agent peak RSS           = %.1f MiB (target < 64)\n", rss / 1024
  printf "agent disk written       = %.1f MiB; extracted tree uses %.1f MiB (ratio %.2f, target <= 1)\n", ao * 512 / 1048576, at / 1048576, (ao * 512) / at
  printf "tar xz disk written      = %.1f MiB; extracted tree uses %.1f MiB\n", to * 512 / 1048576, tt / 1048576
}'
