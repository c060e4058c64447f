# The driver-agent VM-test scenarios (busybox ash, sourced by /init after lib.sh). Each scn_<name>
# asserts kernel state read in the guest (/proc/modules, /sys/module, /dev, /proc/self/mountinfo,
# the operator files) and the agent's exit code and log; see ../README.md for the list.

KO=/vmtest/ko
SPLIT=/vmtest/split
GPU_INFO=/proc/driver/nvidia/gpus/0000:01:00.0/information

# ---- raw kernel sanity: the stand-ins with busybox insmod/rmmod, no agent ----

# raw-load: nvidia loads with parameters, shows its version, char major 195 and /proc files, an
# open device node keeps it loaded, and rmmod removes everything.
scn_raw_load() {
	if ! insmod "$KO/standard/nvidia.ko" NVreg_EnableGpuFirmware=7 NVreg_RegistryDwords=RmStandinKey=3; then
		fail "insmod nvidia.ko failed"
		return
	fi
	mod_loaded nvidia || fail "nvidia not in /proc/modules"
	check_eq "/sys/module/nvidia/version" "$(readv /sys/module/nvidia/version)" "$VMTEST_DRIVER_VERSION"
	check_eq "NVreg_EnableGpuFirmware" "$(readv /sys/module/nvidia/parameters/NVreg_EnableGpuFirmware)" 7
	check_eq "NVreg_RegistryDwords" "$(readv /sys/module/nvidia/parameters/NVreg_RegistryDwords)" RmStandinKey=3
	grep -q '^195 nvidia-frontend$' /proc/devices || fail "/proc/devices has no '195 nvidia-frontend'"
	grep -q "Kernel Module  $VMTEST_DRIVER_VERSION " /proc/driver/nvidia/version ||
		fail "/proc/driver/nvidia/version: $(readv /proc/driver/nvidia/version)"
	grep -q 'Device Minor:[[:space:]]*0$' "$GPU_INFO" || fail "$GPU_INFO has no 'Device Minor: 0'"
	mknod /tmp/nvidia0 c 195 0
	if hold /tmp/nvidia0; then
		# chrdev_open takes two references (the cdev's and the fops' owner) per open file.
		[ "$(readv /sys/module/nvidia/refcnt)" -gt 0 ] || fail "nvidia refcnt is 0 while a node is open"
		rmmod nvidia 2>/dev/null && fail "rmmod nvidia succeeded while /dev/nvidia0 was open"
	else
		fail "cannot hold a 195:0 node open"
	fi
	release
	rm -f /tmp/nvidia0
	rmmod nvidia || fail "rmmod nvidia failed"
	mod_loaded nvidia && fail "nvidia still loaded after rmmod"
	[ -e /proc/driver/nvidia ] && fail "/proc/driver/nvidia left after rmmod"
	grep -q '^195 ' /proc/devices && fail "major 195 still registered after rmmod"
}

# raw-holders: nvidia-uvm and nvidia-modeset depend on nvidia by symbol, so the kernel lists them as
# holders and refuses to remove nvidia first; nvidia-uvm has a dynamic major.
scn_raw_holders() {
	insmod "$KO/standard/nvidia.ko" || { fail "insmod nvidia.ko failed"; return; }
	insmod "$KO/standard/nvidia-uvm.ko" || fail "insmod nvidia-uvm.ko failed"
	insmod "$KO/standard/nvidia-modeset.ko" || fail "insmod nvidia-modeset.ko failed"
	check_eq "/sys/module/nvidia/holders" "$(ls /sys/module/nvidia/holders | sort | tr '\n' ' ' | sed 's/ $//')" "nvidia_modeset nvidia_uvm"
	check_eq "/sys/module/nvidia/refcnt" "$(readv /sys/module/nvidia/refcnt)" 2
	[ -n "$(uvm_major)" ] || fail "/proc/devices has no nvidia-uvm major"
	check_eq "users of nvidia in /proc/modules" "$(awk '$1 == "nvidia" { print $4 }' /proc/modules)" "nvidia_modeset,nvidia_uvm,"
	rmmod nvidia 2>/dev/null && fail "rmmod nvidia succeeded while it had holders"
	rmmod nvidia_uvm || fail "rmmod nvidia_uvm failed"
	rmmod nvidia_modeset || fail "rmmod nvidia_modeset failed"
	rmmod nvidia || fail "rmmod nvidia failed"
	[ -z "$(nv_modules)" ] || fail "left loaded: $(nv_modules)"
	[ -z "$(uvm_major)" ] || fail "nvidia-uvm major still registered"
}

# raw-link: the guest's ld links the split stand-ins (interface + core object) as NVIDIA's
# installer does, and the linked modules load, export symbols and unload.
scn_raw_link() {
	mkdir -p /tmp/link
	if ! ld -d -r -o /tmp/link/nvidia.ko "$SPLIT/nv-linux.o" "$SPLIT/nv-kernel.o_binary" 2>/tmp/link/ld.err; then
		fail "ld -d -r nvidia.ko failed: $(readv /tmp/link/ld.err)"
		return
	fi
	if ! ld -d -r -o /tmp/link/nvidia-modeset.ko "$SPLIT/nv-modeset-linux.o" "$SPLIT/nv-modeset-kernel.o_binary" 2>/tmp/link/ld.err; then
		fail "ld -d -r nvidia-modeset.ko failed: $(readv /tmp/link/ld.err)"
		return
	fi
	insmod /tmp/link/nvidia.ko NVreg_EnableGpuFirmware=0 || { fail "insmod of the linked nvidia.ko failed"; return; }
	check_eq "linked nvidia version" "$(readv /sys/module/nvidia/version)" "$VMTEST_DRIVER_VERSION"
	[ -f "$GPU_INFO" ] || fail "linked nvidia did not create $GPU_INFO"
	insmod /tmp/link/nvidia-modeset.ko || fail "insmod of the linked nvidia-modeset.ko failed"
	insmod "$KO/standard/nvidia-uvm.ko" || fail "nvidia-uvm.ko does not load against the linked nvidia.ko"
	check_eq "holders of the linked nvidia" "$(ls /sys/module/nvidia/holders | sort | tr '\n' ' ' | sed 's/ $//')" "nvidia_modeset nvidia_uvm"
	rmmod nvidia_uvm nvidia_modeset nvidia 2>/dev/null || { rmmod nvidia_uvm; rmmod nvidia_modeset; rmmod nvidia; }
	[ -z "$(nv_modules)" ] || fail "left loaded: $(nv_modules)"
	rm -rf /tmp/link
}

# raw-enodev: the ENODEV variant's init fails as nvidia.ko does without a GPU; nothing stays.
scn_raw_enodev() {
	insmod "$KO/enodev/nvidia.ko" 2>/dev/null && fail "insmod of the ENODEV variant succeeded"
	mod_loaded nvidia && fail "nvidia loaded after a failed init"
	dmesg | grep -q "NVRM: No NVIDIA GPU found." || fail "no 'NVRM: No NVIDIA GPU found.' in dmesg"
	[ -e /proc/driver/nvidia ] && fail "/proc/driver/nvidia left after a failed init"
}

# ---- the agent ----

# banner: the package was made for this kernel's exact banner (else every agent scenario fails).
scn_banner() {
	check_eq "first line of /proc/version vs the package's banner" "$(head -n1 /proc/version)" "$(cat /vmtest/banner)"
}

# dry-run: `driver-agent --dry-run` exits 0, chooses the precompiled package, and changes nothing.
scn_dry_run() {
	local before
	before=$(modules_snapshot)
	keep_log /tmp/dry-run.out /tmp/dry-run.err
	env $AGENT_ENV DRIVER_CONFIG_DIGEST=vmtest-a driver-agent --dry-run --output json >/tmp/dry-run.out 2>/tmp/dry-run.err
	check_eq "exit code" $? 0
	grep -q '"path": *"precompiled"' /tmp/dry-run.out || fail "plan does not choose the precompiled path: $(grep -m1 '"reason"' /tmp/dry-run.out)"
	check_eq "modules after the dry run" "$(modules_snapshot)" "$before"
	[ -e /run/nvidia ] && fail "the dry run created /run/nvidia"
	[ -z "$(nv_devices)" ] || fail "the dry run created $(nv_devices)"
}

# lifecycle: init from the precompiled package to Ready, the whole node state while ready, then
# SIGTERM undoes all of it and exits 0.
scn_lifecycle() {
	local log=/tmp/lifecycle.log major pid pol
	start_ready "$log" vmtest-a || return
	wait_until 5 grep -q '"phase": "wait"' "$STATUS_JSON"
	note "ready ${AGENT_READY_MS}ms ($(phase_ms))"
	for m in nvidia nvidia_uvm nvidia_modeset; do
		mod_loaded "$m" || fail "$m not loaded"
	done
	mod_loaded nvidia_drm && fail "nvidia_drm loaded without --load-drm"
	for m in ipmi_msghandler ipmi_devintf; do
		mod_loaded "$m" || fail "prerequisite $m not loaded"
	done
	check_eq "/sys/module/nvidia/version" "$(readv /sys/module/nvidia/version)" "$VMTEST_DRIVER_VERSION"
	check_eq "NVreg_EnableGpuFirmware (from /drivers/nvidia.conf)" "$(readv /sys/module/nvidia/parameters/NVreg_EnableGpuFirmware)" 1
	check_eq "NVreg_RegistryDwords (from /drivers/nvidia.conf)" "$(readv /sys/module/nvidia/parameters/NVreg_RegistryDwords)" RmStandinKey=1
	check_eq "/sys/module/nvidia/holders" "$(ls /sys/module/nvidia/holders 2>/dev/null | sort | tr '\n' ' ' | sed 's/ $//')" "nvidia_modeset nvidia_uvm"
	check_chr /dev/nvidiactl 195 255
	check_chr /dev/nvidia0 195 0
	check_chr /dev/nvidia-modeset 195 254
	major=$(uvm_major)
	if [ -n "$major" ]; then
		check_chr /dev/nvidia-uvm "$major" 0
		check_chr /dev/nvidia-uvm-tools "$major" 1
	else
		fail "nvidia-uvm has no major in /proc/devices"
	fi
	mounted "$DRIVER_ROOT" || fail "$DRIVER_ROOT is not a mount point"
	[ -x "$DRIVER_ROOT/usr/local/bin/driver-agent" ] || fail "$DRIVER_ROOT does not show the container root"
	check_eq "firmware search path" "$(firmware_path)" "$FIRMWARE_WANT"
	persistenced_running || fail "nvidia-persistenced stand-in is not running"
	if [ "$(nproc)" = 1 ]; then
		# host.BatchThreads: the agent's threads in SCHED_BATCH (3) but the one that starts the
		# children, which has the policy the agent started with (0), as its children do.
		pol=$(sched_policies "/proc/$AGENT_PID/task/*")
		check_eq "the agent's threads in SCHED_OTHER" "$(echo "$pol" | grep -cx 0)" 1
		check_eq "the agent's threads in neither SCHED_OTHER nor SCHED_BATCH" "$(echo "$pol" | grep -cvx '[03]')" 0
		check_eq "scheduling policy of nvidia-persistenced" "$(sched_policies "/proc/$(cat "$PERSISTENCED_PIDFILE")")" 0
	fi
	check_eq "$PIDFILE" "$(readv "$PIDFILE")" "$AGENT_PID"
	check_eq "$STATE" "$(readv "$STATE")" vmtest-a
	grep -q '"ready": *true' "$STATUS_JSON" 2>/dev/null || fail "$STATUS_JSON does not say ready"
	driver-agent status >/tmp/status.out 2>&1 || fail "driver-agent status exited $?: $(readv /tmp/status.out | cut -c1-200)"

	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "exit code after SIGTERM" "$AGENT_RC" 0
	note "teardown ${AGENT_STOP_MS}ms"
	check_clean
	check_eq "firmware search path after teardown" "$(firmware_path)" ""
	grep -q "Caught signal" "$log" || note "no 'Caught signal' line in the log"
}

# second-instance: a second agent while the first runs is refused with exit code 4 and changes
# nothing; the first then stops cleanly.
scn_second_instance() {
	local first
	start_ready /tmp/first.log vmtest-a || return
	first=$AGENT_PID
	agent_run /tmp/second.log vmtest-a 30
	check_eq "second instance exit code" "$AGENT_RC" 4
	AGENT_PID=$first
	alive "$first" || fail "the first agent died"
	ready || fail "$STATUS no longer says Ready"
	check_eq "$PIDFILE" "$(readv "$PIDFILE")" "$first"
	mod_loaded nvidia || fail "nvidia unloaded by the second instance"
	mounted "$DRIVER_ROOT" || fail "$DRIVER_ROOT unmounted by the second instance"
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "first agent exit code after SIGTERM" "$AGENT_RC" 0
	check_clean
}

# in-use: a process holds /dev/nvidia0; SIGTERM stops the daemon and unmounts, but leaves the
# modules loaded, names the holder, and exits 10 within the shutdown deadline.
scn_in_use() {
	local log=/tmp/in-use.log
	start_ready "$log" vmtest-a || return
	hold /dev/nvidia0 || fail "the holder could not open /dev/nvidia0"
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "exit code with /dev/nvidia0 open" "$AGENT_RC" 10
	[ "$AGENT_STOP_MS" -le $(((SHUTDOWN_TIMEOUT_S + 2) * 1000)) ] || fail "took ${AGENT_STOP_MS}ms, deadline ${SHUTDOWN_TIMEOUT_S}s"
	note "stop ${AGENT_STOP_MS}ms"
	grep -qw "$HOLDER_PID" "$log" || fail "the log does not name the holder's PID $HOLDER_PID"
	grep -qw sleep "$log" || fail "the log does not name the holder's command (sleep)"
	for m in nvidia nvidia_uvm nvidia_modeset; do
		mod_loaded "$m" || fail "$m unloaded although in use"
	done
	[ -c /dev/nvidia0 ] || fail "/dev/nvidia0 removed although in use"
	check_eq "firmware search path with the driver in use" "$(firmware_path)" "$FIRMWARE_WANT"
	mod_loaded ipmi_msghandler || fail "prerequisite ipmi_msghandler unloaded under the driver in use"
	grep -q '"firmwarePathBefore"' "$JOURNAL" || fail "the journal does not keep the firmware search path for the next agent"
	mounted_under "$DRIVER_ROOT" && fail "$DRIVER_ROOT still mounted"
	persistenced_running && fail "nvidia-persistenced stand-in still running"
	ready && fail "$STATUS still says Ready"
}

# in-use-at-start: an agent was killed while ready and a process (sleep) holds /dev/nvidia0; a new
# agent with another digest must unload the old driver first. With DRIVER_AGENT_UNLOAD_TIMEOUT=5s
# it retries for 5 s, naming the holder in every retry, then exits 10 with the script's line and
# the holder in the termination log, having loaded, unloaded and stored nothing.
scn_in_use_at_start() {
	local log=/tmp/in-use-start.log id before t1 ms retries
	crash_after_ready /tmp/in-use-start-setup.log vmtest-a || return
	hold /dev/nvidia0 || { fail "the holder could not open /dev/nvidia0"; return; }
	id=$(load_id)
	before=$(modules_snapshot)
	: >"$TERMINATION_LOG"
	AGENT_EXTRA_ENV="DRIVER_AGENT_UNLOAD_TIMEOUT=5s"
	agent_start "$log" vmtest-b
	if ! wait_until 60 grep -q "Unloading NVIDIA driver kernel modules" "$log"; then
		fail "the agent never started to unload the old driver: $(last_error "$log")"
		agent_stop KILL 5
		return
	fi
	t1=$(now_ms)
	agent_wait_exit 30
	ms=$(($(now_ms) - t1))
	check_eq "exit code with the old driver in use" "$AGENT_RC" 10
	note "unload to exit ${ms}ms"
	[ "$ms" -ge 4800 ] && [ "$ms" -le 8000 ] || fail "exit ${ms}ms after the unload began, want about the 5 s bound"
	retries=$(grep -c "NVIDIA driver kernel modules are in use; retrying" "$log")
	[ "$retries" -ge 3 ] || fail "$retries retry lines in the log"
	check_eq "retry lines naming pid $HOLDER_PID (sleep)" "$(grep "in use; retrying" "$log" | grep -c "pid $HOLDER_PID (sleep) has /dev/nvidia0 open")" "$retries"
	grep -q 'level=ERROR msg="Could not unload NVIDIA driver kernel modules, driver is in use"' "$log" || fail "no line of its own with the script's message"
	grep -q "driver-agent exit 10: .*driver is in use.*pid $HOLDER_PID (sleep)" "$TERMINATION_LOG" || fail "$TERMINATION_LOG: '$(readv "$TERMINATION_LOG" | cut -c1-300)'"
	check_eq "nvidia load id (nothing reloaded)" "$(load_id)" "$id"
	check_eq "modules (nothing loaded or unloaded)" "$(modules_snapshot)" "$before"
	check_eq "$STATE (the old digest kept)" "$(readv "$STATE")" vmtest-a
	ready && fail "$STATUS says Ready"
}

# foreign-holder: a module the agent did not load (a gdrdrv stand-in, as the GDRCopy sidecar
# loads it) holds nvidia when SIGTERM comes: the agent leaves it and the driver loaded, names it,
# and exits 10 within the shutdown deadline. `driver-agent unload` refuses the same way (its
# --dry-run says so, and with --unload-foreign-holders plans gdrdrv's removal, changing nothing);
# `driver-agent unload --unload-foreign-holders` removes it and the driver.
scn_foreign_holder() {
	local log=/tmp/foreign.log m
	start_ready "$log" vmtest-a || return
	insmod "$KO/standard/gdrdrv.ko" || { fail "insmod gdrdrv.ko failed"; agent_stop TERM 30; return; }
	[ -e /sys/module/nvidia/holders/gdrdrv ] || fail "gdrdrv is not a holder of nvidia"
	: >"$TERMINATION_LOG"
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "exit code with gdrdrv loaded" "$AGENT_RC" 10
	[ "$AGENT_STOP_MS" -le $(((SHUTDOWN_TIMEOUT_S + 2) * 1000)) ] || fail "took ${AGENT_STOP_MS}ms, deadline ${SHUTDOWN_TIMEOUT_S}s"
	note "stop ${AGENT_STOP_MS}ms"
	for m in gdrdrv nvidia nvidia_uvm nvidia_modeset; do
		mod_loaded "$m" || fail "$m unloaded although gdrdrv holds the driver"
	done
	grep -q "module gdrdrv (not loaded by driver-agent" "$log" || fail "the log does not name gdrdrv"
	grep -q "driver-agent exit 10: .*module gdrdrv" "$TERMINATION_LOG" || fail "$TERMINATION_LOG: '$(readv "$TERMINATION_LOG" | cut -c1-300)'"
	mounted_under "$DRIVER_ROOT" && fail "$DRIVER_ROOT still mounted"
	persistenced_running && fail "nvidia-persistenced stand-in still running"
	ready && fail "$STATUS still says Ready"

	keep_log /tmp/unload-plan.log
	driver-agent unload --dry-run >/tmp/unload-plan.log 2>&1
	check_eq "driver-agent unload --dry-run exit code with gdrdrv loaded" "$?" 0
	grep -q "^Note: would fail: .*module gdrdrv (not loaded by driver-agent" /tmp/unload-plan.log || fail "unload --dry-run: '$(readv /tmp/unload-plan.log | cut -c1-300)'"
	driver-agent unload --dry-run --unload-foreign-holders >>/tmp/unload-plan.log 2>&1
	grep -q "^  unload-module gdrdrv$" /tmp/unload-plan.log || fail "unload --dry-run --unload-foreign-holders does not plan gdrdrv's removal"
	for m in gdrdrv nvidia nvidia_uvm nvidia_modeset; do
		mod_loaded "$m" || fail "$m unloaded by unload --dry-run"
	done
	keep_log /tmp/unload.log
	env DRIVER_AGENT_SHUTDOWN_TIMEOUT=3s driver-agent unload >/tmp/unload.log 2>&1
	check_eq "driver-agent unload exit code with gdrdrv loaded" "$?" 10
	mod_loaded gdrdrv || fail "driver-agent unload removed gdrdrv"
	env DRIVER_AGENT_SHUTDOWN_TIMEOUT=3s driver-agent unload --unload-foreign-holders >>/tmp/unload.log 2>&1
	check_eq "driver-agent unload --unload-foreign-holders exit code" "$?" 0
	[ -z "$(nv_modules)" ] || fail "left loaded: $(nv_modules)"
	mod_loaded gdrdrv && fail "gdrdrv left loaded by --unload-foreign-holders"
}

# hold NODE: a background process (command "sleep") keeps NODE open on fd 3; sets HOLDER_PID.
hold() {
	HOLDER_NODE=$1
	sh -c 'exec 3<"$1" && exec sleep 600' hold "$1" &
	HOLDER_PID=$!
	wait_until 5 holder_ready
}

holder_ready() {
	[ "$(readlink "/proc/$HOLDER_PID/fd/3" 2>/dev/null)" = "$HOLDER_NODE" ] &&
		[ "$(cat "/proc/$HOLDER_PID/comm" 2>/dev/null)" = sleep ]
}

# release: ends the holder.
release() {
	[ -n "$HOLDER_PID" ] && kill -KILL "$HOLDER_PID" 2>/dev/null
	wait_until 5 pid_gone "$HOLDER_PID"
	HOLDER_PID=
}

# crash_after_ready LOG DIGEST: an agent reaches Ready and is killed with SIGKILL, leaving the
# driver loaded, the digest stored, the root mounted (what a crash or OOM kill leaves).
crash_after_ready() {
	start_ready "$1" "$2" || return 1
	agent_stop KILL 10
	kill_persistenced
	mod_loaded nvidia || { fail "setup: nvidia not loaded after the first agent was killed"; return 1; }
	return 0
}

# fast-path: after an agent was killed (SIGKILL) while ready, a new agent with the same
# DRIVER_CONFIG_DIGEST adopts the loaded modules without reloading them, becomes ready, and
# unloads them on SIGTERM.
scn_fast_path() {
	local id log=/tmp/fast-path.log
	crash_after_ready /tmp/fast-path-setup.log vmtest-a || return
	id=$(load_id)
	start_ready "$log" vmtest-a || return
	check_eq "nvidia load id (a reload changes it)" "$(load_id)" "$id"
	grep -q '"installPath": *"fast"' "$STATUS_JSON" 2>/dev/null || fail "$STATUS_JSON does not say installPath fast"
	check_chr /dev/nvidia0 195 0
	mounted "$DRIVER_ROOT" || fail "$DRIVER_ROOT is not a mount point"
	persistenced_running || fail "nvidia-persistenced stand-in is not running"
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "exit code after SIGTERM" "$AGENT_RC" 0
	check_stopped
}

# reload-digest: after an agent was killed while ready, a new agent with another
# DRIVER_CONFIG_DIGEST unloads and reloads the modules, stores the new digest, and unloads them on
# SIGTERM.
scn_reload_digest() {
	local id log=/tmp/reload.log
	crash_after_ready /tmp/reload-setup.log vmtest-a || return
	id=$(load_id)
	start_ready "$log" vmtest-b || return
	[ "$(load_id)" != "$id" ] || fail "nvidia was not reloaded (load id $id unchanged)"
	check_eq "$STATE" "$(readv "$STATE")" vmtest-b
	grep -Eq '"installPath": *"(precompiled|cached)"' "$STATUS_JSON" 2>/dev/null || fail "$STATUS_JSON does not say installPath precompiled or cached"
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "exit code after SIGTERM" "$AGENT_RC" 0
	check_stopped
}

# compressed-prereqs: this boot's prerequisite modules are .ko.xz and .ko.zst (modules.dep says
# so); the agent loads them, becomes ready, and unloads them again on SIGTERM.
scn_compressed_prereqs() {
	local m kc by_kernel
	start_ready /tmp/compressed.log vmtest-a || return
	for m in ipmi_msghandler ipmi_devintf; do
		mod_loaded "$m" || fail "compressed prerequisite $m not loaded"
	done
	for m in wmi video; do
		mod_loaded "$m" && note "$m loaded" || note "$m not loaded"
	done
	# A kernel with CONFIG_MODULE_DECOMPRESS (6.12: xz) gets the files of its format as they are
	# (finit_module with MODULE_INIT_COMPRESSED_FILE); the others the agent decompresses (6.1: all).
	kc=$(cat /sys/module/compression 2>/dev/null)
	by_kernel=$(grep -c 'msg="loading kernel module".*decompressed_by=kernel' /tmp/compressed.log)
	case "$kc" in
	xz) grep -q 'msg="loading kernel module".*\.ko\.xz .*decompressed_by=kernel' /tmp/compressed.log || fail "the kernel decompresses xz, but no .ko.xz was handed to it" ;;
	"") [ "$by_kernel" = 0 ] || fail "$by_kernel modules handed to a kernel that decompresses none" ;;
	esac
	grep 'msg="loading kernel module".*\.ko\.zst' /tmp/compressed.log | grep -q decompressed_by=kernel && [ "$kc" != zstd ] && fail "a .ko.zst handed to a kernel that decompresses '$kc'"
	note "kernel decompresses '${kc:-none}': $by_kernel of the prerequisites"
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "exit code after SIGTERM" "$AGENT_RC" 0
	check_clean
}

# enodev: nvidia's init fails with ENODEV (no GPU): exit code 5, everything this run loaded
# (prerequisites included) is unloaded, nothing else is left.
scn_enodev() {
	local log=/tmp/enodev.log
	use_package enodev
	agent_run "$log" vmtest-a 60
	check_eq "exit code" "$AGENT_RC" 5
	grep -qiE 'no (nvidia )?gpu|enodev|no such device' "$log" || fail "the log does not say that no GPU was found"
	check_clean
}

# sigterm-during-load: SIGTERM while nvidia's init is still running (the slow variant sleeps):
# the agent waits for the load, undoes it, and exits 0 with nothing left.
scn_sigterm_during_load() {
	local log=/tmp/sigterm-load.log
	use_package slow
	agent_start "$log" vmtest-a
	wait_until 60 coming_or_gone
	if ! nvidia_coming; then
		if alive "$AGENT_PID"; then
			fail "nvidia never showed initstate 'coming' within 60 s"
			agent_stop KILL 5
		else
			agent_wait_exit 1
			fail "the agent exited with $AGENT_RC before nvidia's init ran: $(last_error "$log")"
		fi
		return
	fi
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 20))
	check_eq "exit code after SIGTERM during the load" "$AGENT_RC" 0
	note "stop ${AGENT_STOP_MS}ms"
	check_clean
}

nvidia_coming() { [ "$(cat /sys/module/nvidia/initstate 2>/dev/null)" = coming ]; }
coming_or_gone() { nvidia_coming || ! alive "$AGENT_PID"; }

# no-match: the only package was built for another banner and there is no build tree: a clear
# error with exit code 11, nothing loaded.
scn_no_match() {
	local log=/tmp/no-match.log
	use_package mismatch
	agent_run "$log" vmtest-a 60
	check_eq "exit code" "$AGENT_RC" 11
	check_clean
}

# ---- the module cache ----

# ld_counter: an `ld` first in PATH that logs each call to /tmp/ld-calls and runs the real one.
ld_counter() {
	printf '#!/bin/sh\necho "$*" >>/tmp/ld-calls\nexec /usr/bin/ld "$@"\n' >/usr/local/bin/ld
	chmod 755 /usr/local/bin/ld
	: >/tmp/ld-calls
}
ld_calls() { wc -l </tmp/ld-calls | tr -d ' '; }
link_dirs() { ls -d /tmp/driver-agent-*/link 2>/dev/null | tr '\n' ' '; } # the agent's work dirs
cache_sums() { find "$AGENT_CACHE" -type f -name '*.ko' 2>/dev/null | sort | xargs -r md5sum; }

# cache: the first start links the precompiled package (ld runs) and keeps the linked modules in
# the cache; after a clean stop the second start loads them from the cache: path=cached, no ld
# call, no link work directory, the cached files unchanged.
scn_cache() {
	local log1=/tmp/cache-1.log log2=/tmp/cache-2.log sums dirs
	ld_counter
	start_ready "$log1" vmtest-a || return
	grep -q 'path=precompiled' "$log1" || fail "first start: not the precompiled path: $(grep -m1 'install path chosen' "$log1")"
	grep -q 'Relinking NVIDIA driver kernel modules' "$log1" || fail "first start: no 'Relinking' line"
	[ "$(ld_calls)" -ge 1 ] || fail "first start: ld never ran"
	note "first start: ready ${AGENT_READY_MS}ms, $(ld_calls) ld calls"
	grep -q '"installPath": *"precompiled"' "$STATUS_JSON" || fail "first start: $STATUS_JSON does not say installPath precompiled"
	sums=$(cache_sums)
	[ -n "$sums" ] || fail "no module in $AGENT_CACHE after the first start"
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "first stop exit code" "$AGENT_RC" 0
	[ -z "$(nv_modules)" ] || fail "first stop left $(nv_modules) loaded"
	check_eq "cached modules after the first stop" "$(cache_sums)" "$sums"

	: >/tmp/ld-calls
	dirs=$(link_dirs)
	start_ready "$log2" vmtest-a || return
	note "second start: ready ${AGENT_READY_MS}ms"
	grep -q 'path=cached' "$log2" || fail "second start: not the cached path: $(grep -m1 'install path chosen' "$log2")"
	grep -q 'Relinking' "$log2" && fail "second start: linked again"
	check_eq "ld calls on the second start" "$(ld_calls)" 0
	check_eq "link work directories after the second start" "$(link_dirs)" "$dirs"
	grep -q '"installPath": *"cached"' "$STATUS_JSON" || fail "second start: $STATUS_JSON does not say installPath cached"
	for m in nvidia nvidia_uvm nvidia_modeset; do
		mod_loaded "$m" || fail "second start: $m not loaded"
	done
	check_eq "second start: nvidia version" "$(readv /sys/module/nvidia/version)" "$VMTEST_DRIVER_VERSION"
	check_chr /dev/nvidia0 195 0
	check_eq "cached modules after the second start" "$(cache_sums)" "$sums"
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "second stop exit code" "$AGENT_RC" 0
	check_clean
}

# ---- NVSwitch nodes: fabric manager ----

# The overrides the fabric scenarios pass: one edits a line in place, one is ignored (the agent
# forces DAEMONIZE=0), one is not in the file and is appended.
FM_ENV="NVFM_CONFIG_FM_STAY_RESIDENT_ON_FAILURES=1 NVFM_CONFIG_DAEMONIZE=1 NVFM_CONFIG_FM_CMD_PORT_NUMBER=16001"

# nvswitch_on: loads the NVSwitch stand-in, so /proc/driver/nvidia-nvswitch/devices lists two.
nvswitch_on() {
	if ! insmod "$KO/standard/nvswitch-standin.ko"; then
		fail "insmod nvswitch-standin.ko failed"
		return 1
	fi
	check_eq "NVSwitches in /proc/driver/nvidia-nvswitch/devices" "$(ls /proc/driver/nvidia-nvswitch/devices | tr '\n' ' ')" "0000:c1:00.0 0000:c2:00.0 "
}
nvswitch_off() { rmmod nvswitch_standin || fail "rmmod nvswitch_standin failed"; }

# fm_setting KEY: the KEY= line of the configuration fabric manager was given, or <none>.
fm_setting() { grep "^$1=" "$FM_STATE/config" 2>/dev/null || echo "<none>"; }
# line_of FILE KEY: the line number of KEY= in FILE.
line_of() { grep -n "^$2=" "$1" | cut -d: -f1; }
fm_pid() { cat "$FM_STATE/pid" 2>/dev/null; }
fm_starts() { cat "$FM_STATE/starts" 2>/dev/null || echo 0; }
# daemon_json NAME FIELD: FIELD of daemon NAME in status.json (its fields are one per line).
daemon_json() {
	awk -v n="\"$1\"," -v f="\"$2\":" '$1 == "\"name\":" { in_ = ($2 == n) } in_ && $1 == f { gsub(/[",]/, "", $2); print $2; exit }' "$STATUS_JSON" 2>/dev/null
}
metric() { wget -q -O - "$METRICS" 2>/dev/null | grep "^$1 " | awk '{ print $2 }'; }

# fabric-manager: on a node with NVSwitches the agent starts nv-fabricmanager (a stand-in) with
# its own copy of fabricmanager.cfg: the overrides applied in place, DAEMONIZE=0 and the log on
# stderr forced, everything else kept; it supervises it as a child, reads the fabric state
# (nvidia-smi stand-in: Completed), gets Ready, and on SIGTERM stops it and removes the copy.
scn_fabric_manager() {
	local log=/tmp/fabric.log fm k
	nvswitch_on || return
	AGENT_EXTRA_ENV=$FM_ENV
	if ! start_ready "$log" vmtest-a; then
		nvswitch_off
		return
	fi
	wait_until 5 grep -q '"phase": "wait"' "$STATUS_JSON"
	note "ready ${AGENT_READY_MS}ms ($(phase_ms))"
	grep -q 'Detected NVSwitch system' "$log" || fail "no 'Detected NVSwitch system' in the log"
	grep -q 'Starting NVIDIA fabric manager daemon' "$log" || fail "no 'Starting NVIDIA fabric manager daemon' in the log"
	check_eq "nv-fabricmanager arguments" "$(readv "$FM_STATE/args")" "-c $FM_CONFIG_AGENT"
	check_eq "nv-fabricmanager starts" "$(fm_starts)" 1
	fm=$(fm_pid)
	alive "$fm" || fail "nv-fabricmanager (pid '$fm') is not running"
	check_eq "nv-fabricmanager's parent" "$(awk '{ print $4 }' "/proc/$fm/stat" 2>/dev/null)" "$AGENT_PID"
	check_eq "DAEMONIZE given to fabric manager" "$(fm_setting DAEMONIZE)" "DAEMONIZE=0"
	check_eq "LOG_FILE_NAME given to fabric manager" "$(fm_setting LOG_FILE_NAME)" "LOG_FILE_NAME="
	check_eq "LOG_USE_SYSLOG given to fabric manager" "$(fm_setting LOG_USE_SYSLOG)" "LOG_USE_SYSLOG=0"
	check_eq "FM_STAY_RESIDENT_ON_FAILURES (override)" "$(fm_setting FM_STAY_RESIDENT_ON_FAILURES)" "FM_STAY_RESIDENT_ON_FAILURES=1"
	check_eq "FM_CMD_PORT_NUMBER (appended override)" "$(fm_setting FM_CMD_PORT_NUMBER)" "FM_CMD_PORT_NUMBER=16001"
	check_eq "FABRIC_MODE (kept)" "$(fm_setting FABRIC_MODE)" "FABRIC_MODE=0"
	check_eq "BIND_INTERFACE_IP (kept)" "$(fm_setting BIND_INTERFACE_IP)" "BIND_INTERFACE_IP=127.0.0.1"
	grep -q '^# Run as a daemon$' "$FM_STATE/config" || fail "the comments of fabricmanager.cfg were not kept"
	for k in LOG_FILE_NAME FABRIC_MODE DAEMONIZE LOG_USE_SYSLOG FM_STAY_RESIDENT_ON_FAILURES; do
		check_eq "line of $k (edited in place)" "$(line_of "$FM_STATE/config" "$k")" "$(line_of "$FM_CONFIG_SHIPPED" "$k")"
	done
	cmp -s /vmtest/fabricmanager.cfg "$FM_CONFIG_SHIPPED" || fail "the shipped $FM_CONFIG_SHIPPED was changed"
	grep -q 'NVFM_CONFIG_DAEMONIZE=1 ignored' "$log" || fail "no warning that NVFM_CONFIG_DAEMONIZE=1 is ignored"
	grep -q 'FM_CMD_PORT_NUMBER is not in fabricmanager.cfg' "$log" || fail "no warning that FM_CMD_PORT_NUMBER was appended"
	grep 'daemon=nv-fabricmanager' "$log" | grep -q 'running as pid' || fail "fabric manager's output is not in the agent's log"
	check_eq "status.json fabric" "$(awk -F'"' '$2 == "fabric" { print $4 }' "$STATUS_JSON")" completed
	check_eq "status.json nv-fabricmanager state" "$(daemon_json nv-fabricmanager state)" up
	check_eq "driver_agent_daemon_up{nv-fabricmanager}" "$(metric 'driver_agent_daemon_up{daemon="nv-fabricmanager"}')" 1
	check_eq "driver_agent_fabric_state{completed}" "$(metric 'driver_agent_fabric_state{state="completed"}')" 1
	persistenced_running || fail "nvidia-persistenced stand-in is not running"

	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "exit code after SIGTERM" "$AGENT_RC" 0
	[ -e "$FM_STATE/terminated" ] || fail "nv-fabricmanager did not get SIGTERM"
	alive "$fm" && fail "nv-fabricmanager still running"
	[ -e "$FM_CONFIG_AGENT" ] && fail "$FM_CONFIG_AGENT left after the stop"
	nvswitch_off
	check_clean
}

# fabric-manager-dies: fabric manager dies after the agent got Ready and keeps dying when it is
# restarted. While it is restarted the metrics say it is down and count the restarts; after the
# last restart the agent gives up: not Ready, exit code 9 (a required daemon failed), the log and
# the termination log name nv-fabricmanager and the reason it printed, and the node is cleaned up.
scn_fabric_manager_dies() {
	local log=/tmp/fabric-dies.log fm t0 reason="lost the NVSwitch fabric (VM-test fault)" up restarts
	nvswitch_on || return
	: >"$TERMINATION_LOG"
	AGENT_EXTRA_ENV=$FM_ENV
	if ! start_ready "$log" vmtest-a; then
		nvswitch_off
		return
	fi
	fm=$(fm_pid)
	t0=$(now_ms)
	echo "$reason" >"$FM_STATE/die"
	wait_until 10 pid_gone "$fm" || fail "nv-fabricmanager (pid $fm) did not die"
	if wait_until 20 fm_restarted; then
		up=$(metric 'driver_agent_daemon_up{daemon="nv-fabricmanager"}')
		restarts=$(metric 'driver_agent_daemon_restarts_total{daemon="nv-fabricmanager"}')
		check_eq "driver_agent_daemon_up{nv-fabricmanager} while it is restarted" "$up" 0
		[ "${restarts:-0}" -ge 1 ] 2>/dev/null || fail "driver_agent_daemon_restarts_total{nv-fabricmanager} is '$restarts' while it is restarted"
		note "while restarting: status.json says nv-fabricmanager is '$(daemon_json nv-fabricmanager state)', Ready file '$(readv "$STATUS")'"
	else
		fail "nv-fabricmanager was not restarted (starts: $(fm_starts))"
	fi
	agent_wait_exit 120
	note "gave up after $(($(now_ms) - t0))ms and $(fm_starts) starts"
	check_eq "exit code after fabric manager failed for good" "$AGENT_RC" 9
	ready && fail "$STATUS still says Ready"
	grep 'failed for good' "$log" | grep -q 'nv-fabricmanager' || fail "the log has no 'failed for good' line for nv-fabricmanager"
	grep 'failed for good' "$log" | grep -q "$reason" || fail "the log's 'failed for good' line does not give fabric manager's last words"
	grep -q "driver-agent exit 9: .*nv-fabricmanager.*$reason" "$TERMINATION_LOG" || fail "$TERMINATION_LOG: '$(readv "$TERMINATION_LOG" | cut -c1-300)'"
	check_eq "nv-fabricmanager starts (1 + 5 restarts)" "$(fm_starts)" 6
	[ -e "$FM_CONFIG_AGENT" ] && fail "$FM_CONFIG_AGENT left after the failure"
	nvswitch_off
	check_clean
}

fm_restarted() { [ "$(fm_starts)" -ge 2 ]; }

# driver-root-modprobe: after Ready the shared driver root's /lib/modules/<kver> holds the loaded
# modules with a modules.dep (and kmod's modules.dep.bin), as NVIDIA's script leaves them: busybox
# modprobe in `chroot /run/nvidia/driver` reloads a stand-in from there. After SIGTERM the files
# are gone and modules.dep is as it was.
scn_driver_root_modprobe() {
	local log=/tmp/driver-root.log kdir dep_before bin_before m
	kdir="/lib/modules/$(uname -r)"
	dep_before=$(md5sum "$kdir/modules.dep" 2>/dev/null)
	bin_before=$(md5sum "$kdir/modules.dep.bin" 2>/dev/null)
	start_ready "$log" vmtest-a || return
	for m in nvidia nvidia-uvm nvidia-modeset; do
		[ -f "$DRIVER_ROOT$kdir/kernel/drivers/video/$m.ko" ] || fail "$m.ko is not in $DRIVER_ROOT$kdir/kernel/drivers/video"
	done
	grep -qx 'kernel/drivers/video/nvidia-uvm.ko: kernel/drivers/video/nvidia.ko' "$DRIVER_ROOT$kdir/modules.dep" ||
		fail "modules.dep has no line for nvidia-uvm: $(grep nvidia "$DRIVER_ROOT$kdir/modules.dep" | tr '\n' '|')"
	[ -s "$DRIVER_ROOT$kdir/modules.dep.bin" ] || fail "no modules.dep.bin in $DRIVER_ROOT$kdir"
	grep -q "Installing NVIDIA driver kernel modules..." "$log" || fail "the log lacks 'Installing NVIDIA driver kernel modules...'"
	rmmod nvidia_uvm || fail "rmmod nvidia_uvm failed"
	if chroot "$DRIVER_ROOT" modprobe nvidia-uvm >/tmp/modprobe.out 2>&1; then
		mod_loaded nvidia_uvm || fail "nvidia_uvm is not loaded after chroot $DRIVER_ROOT modprobe nvidia-uvm"
	else
		fail "chroot $DRIVER_ROOT modprobe nvidia-uvm exited $?: $(tr '\n' ' ' </tmp/modprobe.out)"
	fi
	agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
	check_eq "exit code after SIGTERM" "$AGENT_RC" 0
	check_clean
	[ -e "$kdir/kernel/drivers/video/nvidia.ko" ] && fail "nvidia.ko left in $kdir/kernel/drivers/video"
	check_eq "modules.dep.bin after teardown" "$(md5sum "$kdir/modules.dep.bin" 2>/dev/null)" "$bin_before"
	check_eq "modules.dep after teardown" "$(md5sum "$kdir/modules.dep" 2>/dev/null)" "$dep_before"
}
