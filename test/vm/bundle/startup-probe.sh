#!/bin/sh
set -eu
dir=/run/nvidia/validations
mkdir -p "$dir"
if [ ! -e /sys/module/nvidia/refcnt ]; then
  echo "the nvidia module is not loaded yet"
  exit 1
fi
if [ -e "$dir/.driver-daemons-status" ] && [ "$(cat "$dir/.driver-daemons-status")" != Ready ]; then
  echo "the driver's daemons are not ready yet"
  exit 1
fi
nvidia-smi > /dev/null
tmp=$(mktemp "$dir/.driver-ctr-ready.XXXXXX")
printf 'GDRCOPY_ENABLED: %s\nGDS_ENABLED: %s\nGPU_DIRECT_RDMA_ENABLED: %s\n' \
  "${GDRCOPY_ENABLED:-false}" "${GDS_ENABLED:-false}" "${GPU_DIRECT_RDMA_ENABLED:-false}" > "$tmp"
mv "$tmp" "$dir/.driver-ctr-ready"
