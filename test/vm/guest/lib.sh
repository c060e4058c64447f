# Helpers for the driver-agent VM-test scenarios (busybox ash, sourced by /init after
# /vmtest/config). Every wait is bounded; nothing here may block forever.
#
# A scenario is a function scn_<name> (dashes become underscores) that calls fail/note; run_scenario
# prints one line for it:
#   VMTEST <name> PASS ms=<guest ms>[ <notes>]
#   VMTEST <name> FAIL ms=<guest ms> <failure>; <failure>...[ | <notes>]
# and, on failure, the logs the scenario registered with keep_log, prefixed "  [<name>] ".

KVER=$VMTEST_KERNEL_RELEASE
KDIR=/usr/src/nvidia-$VMTEST_DRIVER_VERSION/kernel
PKG=$KDIR/precompiled/nvidia-modules-$KVER
CORE=$KDIR/nvidia/nv-kernel.o_binary
STATUS=/run/nvidia/validations/.driver-daemons-status
STATE=/run/nvidia/nvidia-driver.state
PIDFILE=/run/nvidia/nvidia-driver.pid
STATUS_JSON=/run/nvidia/driver-agent/status.json
DRIVER_ROOT=/run/nvidia/driver
PERSISTENCED_PIDFILE=/var/run/nvidia-persistenced/nvidia-persistenced.pid
FIRMWARE_PATH=/sys/module/firmware_class/parameters/path
FIRMWARE_WANT=/run/nvidia/driver/lib/firmware
AGENT_CACHE=/run/nvidia/driver-agent/cache
JOURNAL=/run/nvidia/driver-agent/journal.json # what an agent changed on the node, for the next one
FM_STATE=/tmp/vmtest-fm
FM_CONFIG_SHIPPED=/usr/share/nvidia/nvswitch/fabricmanager.cfg
FM_CONFIG_AGENT=/run/nvidia/driver-agent/fabricmanager.cfg
TERMINATION_LOG=/dev/termination-log
METRICS=http://127.0.0.1:9402/metrics
SHUTDOWN_TIMEOUT_S=15
# The environment the gpu-operator would give the container, minus the digest.
AGENT_ENV="DRIVER_VERSION=$VMTEST_DRIVER_VERSION KERNEL_MODULE_TYPE=proprietary NODE_NAME=vmtest
DRIVER_AGENT_LOG_LEVEL=debug DRIVER_AGENT_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT_S}s
DRIVER_AGENT_DAEMON_STOP_TIMEOUT=3s"

# now_ms prints the guest's uptime in milliseconds (10 ms resolution).
now_ms() {
	local up s f
	read -r up _ </proc/uptime
	s=${up%.*}
	f=${up#*.}
	echo $((s * 1000 + ${f#0} * 10))
}

fail() { FAILS="${FAILS:+$FAILS; }$*"; }
note() { NOTES="${NOTES:+$NOTES; }$*"; }
keep_log() { LOGS="$LOGS $*"; }

# readv FILE: the file's contents on one line, or <missing>.
readv() {
	if [ -e "$1" ]; then
		tr '\n' ' ' <"$1" | sed 's/ *$//'
	else
		echo "<missing>"
	fi
}

# check_eq WHAT GOT WANT
check_eq() {
	[ "$2" = "$3" ] || fail "$1: got '$2', want '$3'"
}

# wait_until SECONDS COMMAND...: runs COMMAND every 0.1 s until it succeeds; 1 on timeout.
wait_until() {
	local n=$(($1 * 10))
	shift
	while ! "$@"; do
		n=$((n - 1))
		[ "$n" -le 0 ] && return 1
		usleep 100000
	done
	return 0
}

mod_loaded() { grep -q "^$1 " /proc/modules; }
nv_modules() { awk '$1 ~ /^nvidia/ { printf "%s ", $1 }' /proc/modules | sed 's/ $//'; }
modules_snapshot() { awk '{ print $1 }' /proc/modules | sort | tr '\n' ' ' | sed 's/ $//'; }
nv_devices() { ls -d /dev/nvidia* 2>/dev/null | tr '\n' ' ' | sed 's/ $//'; }
mounted() { awk -v p="$1" '$5 == p { f = 1 } END { exit !f }' /proc/self/mountinfo; }
mounted_under() { awk -v p="$1" 'index($5, p) == 1 { f = 1 } END { exit !f }' /proc/self/mountinfo; }
ready() { [ "$(cat "$STATUS" 2>/dev/null)" = Ready ]; }
load_id() { readv /sys/module/nvidia/parameters/standin_load_id; }
persistenced_running() {
	[ -f "$PERSISTENCED_PIDFILE" ] && alive "$(cat "$PERSISTENCED_PIDFILE" 2>/dev/null)"
}
# sched_policies GLOB: the scheduling policy (/proc/PID/stat field 41) of each process or thread
# whose /proc directory GLOB names, one per line.
sched_policies() {
	local d
	for d in $1; do awk '{ print $41 }' "$d/stat"; done
}
firmware_path() { tr -d '\n' <"$FIRMWARE_PATH" 2>/dev/null; }

# alive PID: the process exists and is not a zombie.
alive() {
	[ -n "$1" ] && [ -r "/proc/$1/stat" ] || return 1
	[ "$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
pid_gone() { ! alive "$1"; }

# check_chr PATH MAJOR MINOR: PATH is a character device with those numbers.
check_chr() {
	if [ ! -c "$1" ]; then
		fail "$1 is not a character device"
		return
	fi
	local got want
	got=$(stat -c '%t:%T' "$1")
	want=$(printf '%x:%x' "$2" "$3")
	[ "$got" = "$want" ] || fail "$1 is $got (hex major:minor), want $want"
}

# uvm_major: the dynamic major of nvidia-uvm from /proc/devices.
uvm_major() { awk '$2 == "nvidia-uvm" { print $1 }' /proc/devices; }

# agent_start LOG DIGEST [ARGS...]: starts `driver-agent init` in the background with the
# operator's environment, AGENT_EXTRA_ENV (a scenario's additions, reset after each scenario) and
# DRIVER_CONFIG_DIGEST=DIGEST (none when DIGEST is -); sets AGENT_PID.
agent_start() {
	local log=$1 digest=$2
	shift 2
	keep_log "$log"
	if [ "$digest" = - ]; then
		env $AGENT_ENV $AGENT_EXTRA_ENV driver-agent init "$@" >"$log" 2>&1 &
	else
		env $AGENT_ENV $AGENT_EXTRA_ENV DRIVER_CONFIG_DIGEST="$digest" driver-agent init "$@" >"$log" 2>&1 &
	fi
	AGENT_PID=$!
}

# agent_ready LOG: the operator file says Ready and the agent logged that it waits for a signal
# (the file alone may be a stale Ready left by an agent that was killed).
agent_ready() { ready && grep -q "Done, now waiting for signal" "$1"; }

# wait_ready LOG SECONDS [PID]: 0 once the agent is ready; 1 if PID (default: the agent's) exited
# or time ran out.
wait_ready() {
	local n=$(($2 * 10)) pid=${3:-$AGENT_PID}
	while [ "$n" -gt 0 ]; do
		agent_ready "$1" && return 0
		alive "$pid" || return 1
		usleep 100000
		n=$((n - 1))
	done
	return 1
}

agent_gone() { ! alive "$AGENT_PID"; }

# agent_wait_exit SECONDS: waits for the agent to exit; AGENT_RC is its exit status, or
# "timeout" (it is then killed).
agent_wait_exit() {
	if wait_until "$1" agent_gone; then
		wait "$AGENT_PID"
		AGENT_RC=$?
	else
		kill -KILL "$AGENT_PID" 2>/dev/null
		wait "$AGENT_PID"
		AGENT_RC=timeout
	fi
}

# agent_stop SIGNAL SECONDS: signals the agent and waits for it; sets AGENT_RC and AGENT_STOP_MS.
agent_stop() {
	local t0
	t0=$(now_ms)
	kill -"$1" "$AGENT_PID" 2>/dev/null
	agent_wait_exit "$2"
	AGENT_STOP_MS=$(($(now_ms) - t0))
}

# agent_run LOG DIGEST SECONDS [ARGS...]: runs `driver-agent init` until it exits by itself.
agent_run() {
	local log=$1 digest=$2 secs=$3
	shift 3
	agent_start "$log" "$digest" "$@"
	agent_wait_exit "$secs"
}

# start_ready LOG DIGEST: starts an agent and waits until it is ready; fails the scenario and
# returns 1 otherwise.
start_ready() {
	local t0
	t0=$(now_ms)
	agent_start "$1" "$2"
	if ! wait_ready "$1" 60; then
		if alive "$AGENT_PID"; then
			fail "agent not ready after 60 s (status '$(readv "$STATUS")')"
			agent_stop KILL 5
		else
			wait "$AGENT_PID"
			fail "agent exited with $? before it was ready: $(last_error "$1")"
		fi
		return 1
	fi
	AGENT_READY_MS=$(($(now_ms) - t0))
	return 0
}

# phase_ms: the agent's phases and how long each took, from status.json: "detect:12,decide:30,...".
phase_ms() {
	awk -F'[": ,]+' '$2 == "name" { n = $3 } $2 == "durationNanoseconds" { printf "%s%s:%d", sep, n, $3 / 1000000; sep = "," }' "$STATUS_JSON" 2>/dev/null
}

# last_error LOG: the last error-level line of an agent log, shortened.
last_error() {
	grep -E 'level=ERROR|"level":"ERROR"' "$1" | tail -n1 | cut -c1-400
}

# use_package VARIANT: installs the precompiled package (and core objects) of VARIANT where the
# agent looks for them, and drops the agent's cache so that a linked module of another variant
# cannot be reused.
use_package() {
	cp "/vmtest/packages/$1/nvidia-modules-$KVER" "$PKG"
	cp "/vmtest/packages/$1/nv-kernel.o_binary" "$CORE"
	rm -rf "$AGENT_CACHE"
}

# kill_persistenced: stops a stand-in daemon left behind by an agent that was killed.
kill_persistenced() {
	local p
	p=$(cat "$PERSISTENCED_PIDFILE" 2>/dev/null)
	if [ -n "$p" ]; then
		kill "$p" 2>/dev/null
		wait_until 5 pid_gone "$p" || kill -KILL "$p" 2>/dev/null
	fi
	rm -f "$PERSISTENCED_PIDFILE"
}

# check_clean: what every clean stop must have undone, as failures.
check_clean() {
	local nv dev
	nv=$(nv_modules)
	[ -z "$nv" ] || fail "modules still loaded: $nv"
	dev=$(nv_devices)
	[ -z "$dev" ] || fail "device nodes left: $dev"
	mounted_under "$DRIVER_ROOT" && fail "$DRIVER_ROOT still mounted"
	ready && fail "$STATUS still says Ready"
	persistenced_running && fail "nvidia-persistenced stand-in still running"
	[ -e "$STATE" ] && fail "$STATE left: $(readv "$STATE")"
	check_eq "modules after the run (baseline restored)" "$(modules_snapshot)" "$BASELINE_MODULES"
}

# check_stopped: what a clean stop of an agent that adopted a driver loaded by an earlier
# (killed) agent must have undone: it unloads the modules, unmounts, stops its daemon and is no
# longer Ready. Device nodes and prerequisites that the earlier agent created are not this run's
# to remove; they are only noted.
check_stopped() {
	local nv
	nv=$(nv_modules)
	[ -z "$nv" ] || fail "modules still loaded: $nv"
	mounted_under "$DRIVER_ROOT" && fail "$DRIVER_ROOT still mounted"
	ready && fail "$STATUS still says Ready"
	persistenced_running && fail "nvidia-persistenced stand-in still running"
	[ -n "$(nv_devices)" ] && note "left by the killed agent: $(nv_devices)"
	[ "$(modules_snapshot)" != "$BASELINE_MODULES" ] && note "loaded by the killed agent: $(modules_snapshot)"
}

# cleanup: puts the guest back to its boot state after a scenario, whatever the scenario left.
cleanup() {
	local what="" p i
	for p in $(pidof driver-agent); do
		kill -KILL "$p" 2>/dev/null && what="$what agent:$p"
	done
	[ -n "$HOLDER_PID" ] && kill -KILL "$HOLDER_PID" 2>/dev/null && what="$what holder:$HOLDER_PID"
	HOLDER_PID=
	p=$(cat "$FM_STATE/pid" 2>/dev/null)
	alive "$p" && kill -KILL "$p" 2>/dev/null && what="$what fabricmanager:$p"
	rm -rf "$FM_STATE" "$TERMINATION_LOG" /usr/local/bin/ld /tmp/ld-calls
	AGENT_EXTRA_ENV=
	persistenced_running && what="$what persistenced" && kill_persistenced
	for i in 1 2 3 4 5; do
		mounted_under "$DRIVER_ROOT" || break
		umount -l "$DRIVER_ROOT" 2>/dev/null
		what="$what umount"
	done
	for i in 1 2 3 4; do
		[ "$(modules_snapshot)" = "$BASELINE_MODULES" ] && break
		for p in nvidia_modeset nvidia_uvm nvidia $(modules_snapshot); do
			case " $BASELINE_MODULES " in *" $p "*) continue ;; esac
			rmmod "$p" 2>/dev/null && what="$what rmmod:$p"
		done
	done
	[ -n "$(nv_devices)" ] && what="$what devices" && rm -rf /dev/nvidia*
	[ -e /run/nvidia ] && rm -rf /run/nvidia
	[ -n "$(firmware_path)" ] && echo >"$FIRMWARE_PATH" && what="$what firmware-path"
	rm -rf "$AGENT_CACHE"
	ls -d /tmp/driver-agent-* >/dev/null 2>&1 && what="$what workdirs" && rm -rf /tmp/driver-agent-*
	[ -d /vmtest/packages/standard ] && use_package standard
	[ -n "$what" ] && echo "VMTEST-CLEANUP $1:$what"
}

# run_scenario NAME: runs scn_NAME and prints its result line.
run_scenario() {
	local name=$1 fn t0 ms l
	fn=scn_$(echo "$name" | tr - _)
	FAILS=""
	NOTES=""
	LOGS=""
	echo "VMTEST-START $name"
	DMESG_START=$(dmesg | wc -l)
	t0=$(now_ms)
	"$fn"
	ms=$(($(now_ms) - t0))
	if [ -z "$FAILS" ]; then
		echo "VMTEST $name PASS ms=$ms${NOTES:+ $NOTES}"
	else
		echo "VMTEST $name FAIL ms=$ms $FAILS${NOTES:+ | $NOTES}"
		for l in $LOGS; do
			[ -f "$l" ] && sed "s|^|  [$name $(basename "$l")] |" "$l"
		done
		dmesg | tail -n +$((DMESG_START + 1)) | tail -n 60 | sed "s|^|  [$name dmesg] |"
	fi
	cleanup "$name"
}
