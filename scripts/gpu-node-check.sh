#!/bin/bash
# driver-agent on a node whose NVIDIA driver is already loaded (a GPU machine, as root): the
# node's facts, the dry runs (auto, host, unload) with and without a CUDA process holding the GPU,
# a real `init --modules=host` to Ready with metrics and SIGTERM (five rounds, a stand-in
# nvidia-persistenced under /tmp/root, so the GPU's persistence mode is left as it is), and the
# binary's own start cost. The driver is never unloaded: the real `unload` runs only where the
# kernel cannot unload modules (no /sys/module/nvidia/refcnt), where it is refused at once.
# Nothing outside /tmp is changed but what a node's agent changes: /sys made private and
# unbindable by the shared root. The log goes to $OUT/device.log (default /tmp/gpu-node-check).
#
#   sudo AGENT=bin/driver-agent bash scripts/gpu-node-check.sh
#
# SYS (default /sys) and HOST_TIMEOUT let it be rehearsed on a machine without the driver.
set -u
A=$(realpath "${AGENT:-bin/driver-agent}")
O=${OUT:-/tmp/gpu-node-check}
mkdir -p "$O"
exec > >(tee "$O/device.log") 2>&1
SYS=${SYS:-/sys}
HOST_TIMEOUT=${HOST_TIMEOUT:-5s}
sec() { printf '\n=== %s\n' "$*"; }
ms() { echo $(($(date +%s%N) / 1000000)); }
names() { for f in "$1"/*; do [ -e "$f" ] && printf '%s ' "${f##*/}"; done; }
mods() {
	for m in nvidia nvidia_uvm nvidia_modeset nvidia_drm nvidia_peermem; do
		[ -d "$SYS/module/$m" ] && echo "  $m version=$(cat "$SYS/module/$m/version" 2>/dev/null) refcnt=$(cat "$SYS/module/$m/refcnt" 2>/dev/null) holders=$(names "$SYS/module/$m/holders")"
	done
}

sec facts
uname -a; cat /proc/version; echo "uid $(id -u), $(nproc) CPUs"; head -2 /etc/os-release
cat /proc/driver/nvidia/version 2>&1
grep -E '^nvidia' /proc/modules
mods
echo "$SYS/module/nvidia: $(names "$SYS/module/nvidia")"
grep -i nvidia /proc/devices
stat -c '%n %F %t:%T %a' /dev/nvidia* /dev/nvidia-caps/* 2>&1
ls /proc/driver/nvidia/ /proc/driver/nvidia/gpus/ 2>&1
cat /proc/driver/nvidia/gpus/*/information 2>&1 | head -20
find /proc/driver/nvidia/capabilities -type f 2>/dev/null | head
ls /proc/driver/nvidia-nvswitch/devices 2>&1
for d in /sys/bus/pci/devices/*; do
	v=$(cat "$d/vendor")
	[ "$v" = 0x10de ] || [ "$v" = 0x15b3 ] || continue
	echo "  pci $(basename "$d") vendor=$v device=$(cat "$d/device") class=$(cat "$d/class") driver=$(basename "$(readlink "$d/driver")" 2>/dev/null)"
done
echo "firmware search path: '$(cat /sys/module/firmware_class/parameters/path 2>&1)'"
nvidia-smi --query-gpu=name,pci.bus_id,persistence_mode,driver_version --format=csv 2>&1
pgrep -a 'persistenced|fabricmanager' 
echo "/usr/local/nvidia/bin: $(names /usr/local/nvidia/bin)"
timeout 20 find / -xdev -name supported-gpus.json 2>/dev/null | head -3
ls -l /dev/kvm 2>&1
V=$(cat "$SYS/module/nvidia/version" 2>/dev/null || echo 580.95.05)
echo "loaded nvidia version: $V"

sec "dry run, --modules=auto (the default), the node's own roots"
DRIVER_VERSION=$V $A --dry-run --sys "$SYS"; echo "rc=$?"
DRIVER_VERSION=$V $A --dry-run --sys "$SYS" --output json >"$O/plan-auto.json" 2>/dev/null; echo "json rc=$?"
sec "dry run, --modules=host"
DRIVER_VERSION=$V $A --dry-run --sys "$SYS" --modules=host 2>&1 | grep -vE '^  (kernel|banner) '; echo "rc=${PIPESTATUS[0]}"
sec "unload --dry-run"
$A unload --dry-run --sys "$SYS"; echo "rc=$?"

sec "a CUDA process holds the GPU (python3 with torch; else a process holding /dev/nvidiactl)"
rm -f /tmp/cuda-up
python3 -c "
import torch, time
x = torch.ones(1, device='cuda')
print('cuda up:', torch.cuda.get_device_name(0), flush=True)
open('/tmp/cuda-up', 'w').close()
time.sleep(600)" &
CP=$!
for _ in $(seq 240); do [ -e /tmp/cuda-up ] && break; kill -0 $CP 2>/dev/null || break; sleep 0.25; done
if [ ! -e /tmp/cuda-up ]; then
	sh -c 'exec 3</dev/nvidiactl && touch /tmp/cuda-up && exec sleep 600' &
	CP=$!
	sleep 0.5
fi
echo "holder pid $CP up: $([ -e /tmp/cuda-up ] && echo yes || echo no)"
mods
$A unload --dry-run --sys "$SYS"; echo "rc=$?"
DRIVER_VERSION=$V $A --dry-run --sys "$SYS" 2>/dev/null | grep -E '^  - |unload-module'; echo "rc=${PIPESTATUS[0]}"
if [ ! -e "$SYS/module/nvidia/refcnt" ]; then
	sec "unload, for real, on a kernel that cannot unload modules: refused at once, nothing changed"
	$A unload --sys "$SYS" --run /tmp/ru; echo "rc=$?"
	mods
fi

sec "init --modules=host with another version: refused, nothing changed"
rm -rf /tmp/r0; mkdir -p /tmp/r0; : >/tmp/r0/termination-log
DRIVER_VERSION=1.2.3 $A init --modules=host --sys "$SYS" --root /tmp/root --run /tmp/r0 --metrics-address= \
	--host-modules-timeout=1s --termination-log /tmp/r0/termination-log 2>&1 | tail -3
echo "rc=${PIPESTATUS[0]}"; echo "termination log: $(cat /tmp/r0/termination-log)"; (cd /tmp/r0 && find . | sort | tr '\n' ' '); echo

sec "init --modules=host with the loaded version: Ready, metrics, SIGTERM (5 rounds)"
rm -rf /tmp/root /tmp/run; mkdir -p /tmp/root/usr/bin /tmp/root/var/run /tmp/run
cat >/tmp/root/usr/bin/nvidia-persistenced <<'SH'
#!/bin/bash
# nvidia-persistenced stand-in (not NVIDIA code): like the real daemon it forks, holds the
# control device open, writes its PID file and exits 0 on SIGTERM, removing it.
p=/tmp/root/var/run/nvidia-persistenced/nvidia-persistenced.pid
rm -f $p
(
	[ -c /dev/nvidiactl ] && exec 3</dev/nvidiactl
	trap 'rm -f $p; exit 0' TERM
	echo $BASHPID >$p
	while :; do sleep 1 & wait $!; done
) </dev/null >/dev/null 2>&1 &
for _ in $(seq 50); do [ -s $p ] && exit 0; sleep 0.1; done
exit 1
SH
chmod 755 /tmp/root/usr/bin/nvidia-persistenced
before=$(grep -E '^nvidia' /proc/modules | awk '{print $1, $3}' | tr '\n' ' ')
for round in 1 2 3 4 5; do
	t0=$(ms)
	DRIVER_VERSION=$V $A init --modules=host --sys "$SYS" --root /tmp/root --run /tmp/run --host-modules-timeout "$HOST_TIMEOUT" \
		--metrics-address 127.0.0.1:9402 --termination-log /tmp/none >"$O/host-init-$round.log" 2>&1 &
	AP=$!
	for _ in $(seq 3000); do
		[ "$(cat /tmp/run/nvidia/validations/.driver-daemons-status 2>/dev/null)" = Ready ] && break
		kill -0 $AP 2>/dev/null || break
		sleep 0.01
	done
	t1=$(ms)
	echo "round $round: start->Ready $((t1 - t0)) ms ($(cat /tmp/run/nvidia/validations/.driver-daemons-status 2>/dev/null))"
	if [ "$round" = 1 ]; then
		python3 - <<'PY'
import urllib.request
for path in ("/healthz", "/readyz", "/metrics"):
    try:
        r = urllib.request.urlopen("http://127.0.0.1:9402" + path, timeout=5)
        body = r.read().decode()
    except Exception as e:
        print(path, "error", e); continue
    if path == "/metrics":
        lines = [l for l in body.splitlines() if l.startswith("driver_agent_") and "_bucket" not in l]
        print("/metrics:", len(body.splitlines()), "lines; driver_agent_ samples:")
        print("\n".join("  " + l for l in lines[:60]))
    else:
        print(path, r.status, body.strip()[:200])
PY
		$A status --run /tmp/run
		grep ' /tmp/run/nvidia/driver ' /proc/self/mountinfo | cut -d' ' -f1-6
		pgrep -a nvidia-persiste
	fi
	t2=$(ms)
	kill -TERM $AP
	wait $AP
	rc=$?
	echo "round $round: SIGTERM->exit $(($(ms) - t2)) ms, rc=$rc"
done
after=$(grep -E '^nvidia' /proc/modules | awk '{print $1, $3}' | tr '\n' ' ')
echo "modules before: $before"
echo "modules after:  $after"
echo "left under /tmp/run: $(cd /tmp/run && find . | sort | tr '\n' ' ')"
echo "mounts left: $(grep -c ' /tmp/run' /proc/self/mountinfo)"
echo "stand-ins left: $(pgrep -c nvidia-persiste)"
grep -hE 'level=(WARN|ERROR)' "$O"/host-init-1.log | head
grep -hE 'msg=' "$O"/host-init-1.log | cut -c1-220 | head -40

sec "the binary's own start, natively"
for c in /bin/true "$A version"; do
	t=$(ms); for _ in $(seq 100); do $c >/dev/null; done; echo "$c: $(($(ms) - t)) ms per 100"
done
GODEBUG=inittrace=1 $A version 2>&1 >/dev/null | awk '{s += $5} END {printf "package initialisers: %.2f ms of clock\n", s}'

kill $CP 2>/dev/null; wait $CP 2>/dev/null
mods
echo "finished"
