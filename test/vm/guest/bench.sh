# Figures for `make vm-bench` (busybox ash, sourced by /init in the bench boot only). The
# scenario "bench" measures, VMTEST_BENCH_RUNS times in the same boot and interleaved:
#   precompiled  `driver-agent init` from start to Ready with an empty module cache (it links the
#                package with ld), its peak RSS (VmHWM), its phases, and SIGTERM to exit;
#   cached       the same with the modules in the cache from the run before (no link);
#   script-min   a busybox script doing only the agent's insmod calls (same files, same
#                parameters, same order) and mknods, then rmmod and rm;
#   script-full  the same plus what the agent also does on this path: ld -d -r of both interface
#                objects, the firmware path, the nvidia-persistenced stand-in, the rbind mount.
# Each run prints one line for the harness to turn into figures; nothing here is a pass/fail
# check on time (the scenario fails only when a run does not reach its end state):
#   VMTEST-BENCH kind=<kind> run=<n> ready_ms=<ms> teardown_ms=<ms> [agent_ms=<ms> hwm_kb=<kb>
#                rss_kb=<kb> cpu_ms=<ms> live_cpu_ms=<ms> slices=<n> rc=<rc>
#                phases=<name>:<ms>,...]
#                [link_ms=<ms> persistenced_ms=<ms> (script-full: the two ld, and the
#                nvidia-persistenced stand-in's own start)]
#   VMTEST-BENCH kind=agent-exec run=<n> exec_ms=<ms>  (`driver-agent version`: exec to exit)
# With VMTEST_BENCH_B set (DRIVER_AGENT_VM_BENCH_B on the host), a second agent's precompiled and
# cached runs join each round as kinds precompiled-b and cached-b, first in the even rounds.

# ns_now sets NS to CLOCK_MONOTONIC in nanoseconds, without starting a process.
ns_now() {
	local a b c
	{
		read -r a
		read -r b
		read -r c
	} </proc/timer_list
	c=${c#now at }
	NS=${c% nsecs}
}

# ready_ns DONE_MS T0: when the agent started at T0 got Ready, on CLOCK_MONOTONIC in
# nanoseconds, never early: the later of the Ready file's change time (its rename into place)
# plus one tick, and the agent's "Done, now waiting for signal" line (logged after the file is
# written; DONE_MS, its stamp in milliseconds of the day from log_stamps, may be empty) plus 1
# ms. The kernel stamps files from its coarse clock, which was seen to lag by more than a tick
# (4 ms, HZ=250 in the bench kernels) after the CPU idled. Both are CLOCK_REALTIME: the offset to
# CLOCK_MONOTONIC is the realtime clock base's in /proc/timer_list (RT_OFFSET, bench_setup).
ready_ns() {
	local s f c day l
	s=$(stat -c '%Z %z' "$STATUS")
	f=${s#* * }
	f=${f%% *}
	f=${f#*.}
	c=$((${s%% *} * 1000000000 + 1${f} - 1000000000 - RT_OFFSET + 4000000))
	if [ -n "$1" ]; then
		day=$((($2 + RT_OFFSET) / 86400000000000 * 86400000000000))
		l=$((day + $1 * 1000000 + 1000000 - RT_OFFSET))
		[ "$l" -lt "$2" ] && l=$((l + 86400000000000)) # the day turned
		[ "$l" -gt "$c" ] && c=$l
	fi
	echo "$c"
}

# fmt_ms NS: nanoseconds as milliseconds with two decimals.
fmt_ms() { printf '%d.%02d' $(($1 / 1000000)) $(($1 / 10000 % 100)); }

# pause SECONDS: sleeps without starting a process (read with a timeout on a FIFO nobody writes).
pause() { read -r -t "$1" -u 9 _; }

BENCH_KO=/tmp/bench-ko
BENCH_LINK=/tmp/bench-link

# bench_setup: the FIFO for pause, and the prerequisite modules the agent loads, in modules.dep
# order (dependencies first), as BENCH_PREREQS (paths).
bench_setup() {
	rm -f /tmp/bench-fifo
	mkfifo /tmp/bench-fifo
	exec 9<>/tmp/bench-fifo
	NVIDIA_PARAMS=$(tr '\n' ' ' </drivers/nvidia.conf)
	RT_OFFSET=$(awk '$1 == ".index:" { i = $2 } i == 1 && $1 == ".offset:" { print $2; exit }' /proc/timer_list)
	[ -n "$RT_OFFSET" ] || fail "no CLOCK_REALTIME offset in /proc/timer_list"
}

# bench_learn_prereqs BEFORE AFTER: the modules an agent loaded besides NVIDIA's (AFTER minus
# BEFORE, module lists), as insmod paths in modules.dep order.
bench_learn_prereqs() {
	local new=" $2 " line path name
	BENCH_PREREQS=
	while IFS= read -r line; do
		path=${line%%:*}
		name=${path##*/}
		name=${name%%.ko*}
		name=$(echo "$name" | tr - _)
		# The ready agent's modules.dep (its driver root) lists NVIDIA's modules too.
		case "$name" in nvidia*) continue ;; esac
		case " $1 " in *" $name "*) continue ;; esac
		case "$new" in *" $name "*) BENCH_PREREQS="$BENCH_PREREQS /lib/modules/$KVER/$path" ;; esac
	done <"/lib/modules/$KVER/modules.dep"
}

# bench_warm_ld: both links of script-full, untimed, before each kind that links, so that
# neither pays for linking first in its round: with the agent first, its two links took 205-330
# ms against the script's 195 (median); with the script first, the script's took 295.
bench_warm_ld() {
	ld -d -r -o /tmp/bench-warm.ko "$SPLIT/nv-linux.o" "$CORE" || fail "warm-up ld nvidia.ko"
	ld -d -r -o /tmp/bench-warm.ko "$SPLIT/nv-modeset-linux.o" "$KDIR/nvidia-modeset/nv-modeset-kernel.o_binary" || fail "warm-up ld nvidia-modeset.ko"
	rm -f /tmp/bench-warm.ko
}

# bench_agent KIND RUN [AGENT]: one run of AGENT (default driver-agent); prints its VMTEST-BENCH
# line.
bench_agent() {
	local kind=$1 run=$2 agent=${3:-driver-agent} log=/tmp/bench-agent.log pid t0 t1 t2 t3 st hwm rss cpu phases agent_ms stamps done_ms rc n=0
	rm -f "$log"
	ns_now
	t0=$NS
	# Started the way the scripts are: one fork, then exec (no env process in between).
	(
		export $AGENT_ENV DRIVER_CONFIG_DIGEST=bench
		exec "$agent" init
	) >"$log" 2>&1 &
	pid=$!
	# The time of Ready comes from the file's change time and the agent's log (ready_ns), so
	# the poll that waits for it need not be fast: a fast one takes the guest's one CPU from
	# the agent.
	while :; do
		st=
		read -r st <"$STATUS" 2>/dev/null
		[ "$st" = Ready ] && break
		if [ ! -d "/proc/$pid" ] || [ "$n" -ge 1200 ]; then
			fail "$kind run $run: the agent did not get Ready: $(last_error "$log")"
			keep_log "$log"
			kill -KILL "$pid" 2>/dev/null
			wait "$pid"
			return 1
		fi
		n=$((n + 1))
		pause 0.05
	done
	AGENT_PID=$pid
	wait_until 10 grep -q '"phase": "wait"' "$STATUS_JSON" # the agent has logged "Done" then
	stamps=$(log_stamps "$log")
	done_ms=${stamps#* }
	agent_ms=
	[ -n "$stamps" ] && agent_ms=$((done_ms - ${stamps% *}))
	t1=$(ready_ns "$done_ms" "$t0")
	hwm=$(awk '$1 == "VmHWM:" { print $2 }' "/proc/$pid/status")
	rss=$(awk '$1 == "VmRSS:" { print $2 }' "/proc/$pid/status")
	# Its CPU time so far: of all its threads, those that ended included (utime and stime in
	# /proc/<pid>/stat, in ticks of 10 ms), and of those alive with their time slices (schedstat:
	# on-CPU ns, wait ns, slices). A thread that a goroutine locked ends with it, taking its
	# schedstat along.
	cpu=$(awk '{ c += $1; n += $3 } END { printf "live_cpu_ms=%.2f slices=%d", c / 1e6, n }' /proc/$pid/task/*/schedstat)
	cpu="$(awk '{ sub(/.*\) /, ""); split($0, f, " "); printf "cpu_ms=%d", (f[12] + f[13]) * 10 }' "/proc/$pid/stat") $cpu"
	phases=$(phase_ms)
	ns_now
	t2=$NS
	kill -TERM "$pid"
	wait "$pid"
	rc=$?
	ns_now
	t3=$NS
	[ "$rc" = 0 ] || fail "$kind run $run: exit code $rc after SIGTERM"
	[ -z "$(nv_modules)" ] || fail "$kind run $run: $(nv_modules) left loaded"
	echo "VMTEST-BENCH kind=$kind run=$run ready_ms=$(fmt_ms $((t1 - t0))) teardown_ms=$(fmt_ms $((t3 - t2))) agent_ms=$agent_ms hwm_kb=$hwm rss_kb=$rss $cpu rc=$rc phases=$phases"
}

# log_stamps LOG: the time= stamps of the agent's first log line and of its "Done, now waiting
# for signal" line, in milliseconds of the day (the agent's clock, so no polling error), or
# nothing when there is no such line.
log_stamps() {
	awk '
		function ms(line,   t, p) {
			if (!match(line, /time=[^ ]+/)) return -1
			t = substr(line, RSTART + 5, RLENGTH - 5)
			t = substr(t, index(t, "T") + 1)
			split(t, p, /[:Z+-]/)
			return ((p[1] * 60 + p[2]) * 60 + p[3]) * 1000
		}
		first == "" { first = ms($0) }
		/Done, now waiting for signal/ { printf "%d %d", first, ms($0); exit }
	' "$1"
}

# bench_exec RUN: `driver-agent version`, what every agent run costs before its own work: the
# exec of the binary, the Go runtime's and the packages' initialisation, one line, the exit.
bench_exec() {
	local t0
	ns_now
	t0=$NS
	driver-agent version >/dev/null || fail "driver-agent version"
	ns_now
	echo "VMTEST-BENCH kind=agent-exec run=$1 exec_ms=$(fmt_ms $((NS - t0)))"
}

# bench_script KIND RUN: the busybox script; full adds the link, firmware path, daemon and mount.
bench_script() {
	local kind=$1 run=$2 t0 t1 t2 t3 m maj name uvm pid pd n link=
	ns_now
	t0=$NS
	if [ "$kind" = script-full ]; then
		mkdir -p "$BENCH_LINK"
		ld -d -r -o "$BENCH_LINK/nvidia.ko" "$SPLIT/nv-linux.o" "$CORE" || fail "ld nvidia.ko"
		ld -d -r -o "$BENCH_LINK/nvidia-modeset.ko" "$SPLIT/nv-modeset-linux.o" "$KDIR/nvidia-modeset/nv-modeset-kernel.o_binary" || fail "ld nvidia-modeset.ko"
		ns_now
		link=" link_ms=$(fmt_ms $((NS - t0)))"
	fi
	for m in $BENCH_PREREQS; do
		insmod "$m" || fail "$kind: insmod $m"
	done
	insmod "$BENCH_KO/nvidia.ko" $NVIDIA_PARAMS || fail "$kind: insmod nvidia.ko"
	insmod "$BENCH_KO/nvidia-uvm.ko" || fail "$kind: insmod nvidia-uvm.ko"
	insmod "$BENCH_KO/nvidia-modeset.ko" || fail "$kind: insmod nvidia-modeset.ko"
	uvm=
	while read -r maj name; do
		[ "$name" = nvidia-uvm ] && uvm=$maj
	done </proc/devices
	mknod -m 666 /dev/nvidiactl c 195 255
	mknod -m 666 /dev/nvidia0 c 195 0
	mknod -m 666 /dev/nvidia-modeset c 195 254
	mknod -m 666 /dev/nvidia-uvm c "$uvm" 0
	mknod -m 666 /dev/nvidia-uvm-tools c "$uvm" 1
	if [ "$kind" = script-full ]; then
		echo "$FIRMWARE_WANT" >"$FIRMWARE_PATH"
		ns_now
		pd=$NS
		nvidia-persistenced --persistence-mode || fail "$kind: nvidia-persistenced"
		ns_now
		link="$link persistenced_ms=$(fmt_ms $((NS - pd)))"
		mkdir -p "$DRIVER_ROOT"
		mount -o rbind / "$DRIVER_ROOT" || fail "$kind: mount"
	fi
	ns_now
	t1=$NS

	t2=$NS
	if [ "$kind" = script-full ]; then
		pid=$(cat "$PERSISTENCED_PIDFILE")
		kill "$pid"
		n=0
		while alive "$pid" && [ "$n" -lt 1000 ]; do
			pause 0.01
			n=$((n + 1))
		done
		umount -l "$DRIVER_ROOT"
		echo >"$FIRMWARE_PATH"
	fi
	rmmod nvidia_modeset nvidia_uvm nvidia || fail "$kind: rmmod"
	for m in $BENCH_PREREQS; do
		name=${m##*/}
		name=$(echo "${name%%.ko*}" | tr - _)
		BENCH_RMMOD="$name $BENCH_RMMOD"
	done
	rmmod $BENCH_RMMOD || fail "$kind: rmmod prerequisites"
	BENCH_RMMOD=
	rm -f /dev/nvidiactl /dev/nvidia0 /dev/nvidia-modeset /dev/nvidia-uvm /dev/nvidia-uvm-tools
	ns_now
	t3=$NS
	rm -rf "$BENCH_LINK"
	[ -z "$(nv_modules)" ] || fail "$kind run $run: $(nv_modules) left loaded"
	echo "VMTEST-BENCH kind=$kind run=$run ready_ms=$(fmt_ms $((t1 - t0))) teardown_ms=$(fmt_ms $((t3 - t2)))$link"
}

# bench_agent_pair RUN SUFFIX AGENT: AGENT's precompiled run (empty cache, links warmed), then
# its cached run, as kinds precompiled$SUFFIX and cached$SUFFIX.
bench_agent_pair() {
	rm -rf "$AGENT_CACHE"
	bench_warm_ld
	bench_agent "precompiled$2" "$1" "$3" || return
	bench_agent "cached$2" "$1" "$3"
}

scn_bench() {
	local runs=${VMTEST_BENCH_RUNS:-7} i before
	bench_setup
	before=$(modules_snapshot)
	for i in $(seq 1 "$runs"); do
		# With a second agent (VMTEST_BENCH_B), it runs its pair first in the even rounds.
		[ -n "$VMTEST_BENCH_B" ] && [ $((i % 2)) = 0 ] && { bench_agent_pair "$i" -b "$VMTEST_BENCH_B" || return; }
		bench_agent_pair "$i" "" driver-agent || return
		if [ "$i" = 1 ]; then
			# Learn what the agent loaded, and keep its linked modules for the scripts.
			mkdir -p "$BENCH_KO"
			cp "$AGENT_CACHE"/*/modules/*.ko "$BENCH_KO/" || { fail "no linked modules in $AGENT_CACHE"; return; }
		fi
		[ -n "$VMTEST_BENCH_B" ] && [ $((i % 2)) = 1 ] && { bench_agent_pair "$i" -b "$VMTEST_BENCH_B" || return; }
		if [ "$i" = 1 ]; then
			start_ready /tmp/bench-learn.log bench || return
			bench_learn_prereqs "$before" "$(modules_snapshot)"
			agent_stop TERM 30
			note "prerequisites:$BENCH_PREREQS"
		fi
		bench_exec "$i"
		bench_script script-min "$i"
		bench_warm_ld
		bench_script script-full "$i"
		check_eq "modules after run $i" "$(modules_snapshot)" "$before"
		[ -n "$FAILS" ] && return
	done
	note "$runs runs"
}
