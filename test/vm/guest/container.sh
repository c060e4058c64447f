# The container scenarios (busybox ash, sourced by /init after lib.sh when the harness ships it):
# the driver image, built by make image-test, runs under crun as the gpu-operator's DaemonSet
# would run it. The guest plays the node: its root is the host, /vmtest/bundle is the OCI spec
# generated from the operator's DaemonSet (test/images, TestDriverBundle) and the pod's
# settings (pod.sh), and this file plays the kubelet: hostPath directories, the pod directory,
# the startup probe through `crun exec`, preStop, SIGTERM, the grace period, SIGKILL.
#
# The image's root is the ext4 disk /dev/vda (make image-test's rootfs.ext4, attached read-only);
# each container gets a fresh overlay of it, as a container runtime gives each container a new
# writable layer. The overlay's upper layer starts with the harness's stand-ins (what needs a
# GPU, and the test's driver version): see ctr_layer.

CTR_IMAGE=/vmtest/image
CTR_BUNDLE=/vmtest/bundle
CTR_RUN=/var/lib/vmtest-ctr # on the initramfs root, which is private: mounts under it do not propagate
. "$CTR_BUNDLE/pod.sh"

# ctr_boot: once per boot, before the boot-time module list is taken: the disk, the overlay and
# cgroup2, /dev/log (busybox syslogd), /run shared (the kubelet needs the source of a
# Bidirectional volume, /run/nvidia, on a shared mount).
ctr_boot() {
	local m
	for m in virtio_pci virtio_blk crc32c_generic ext4 overlay; do
		modprobe "$m" || echo "VMTEST-CTR modprobe $m failed"
	done
	wait_until 10 test -b /dev/vda || echo "VMTEST-CTR no /dev/vda"
	mkdir -p "$CTR_IMAGE" /sys/fs/cgroup /var/log
	mount -t ext4 -o ro,noload /dev/vda "$CTR_IMAGE" || echo "VMTEST-CTR cannot mount /dev/vda"
	mount -t cgroup2 cgroup2 /sys/fs/cgroup
	mount --make-rshared /run
	syslogd -O /var/log/messages
	wait_until 5 test -S /dev/log || echo "VMTEST-CTR syslogd made no /dev/log"
	# The image's driver version (its sources and userspace are not used here: the test's driver
	# is the stand-ins').
	CTR_IMAGE_VERSION=$(cat /vmtest/image-version)
	VMTEST_UPGRADE_VERSION=$(cat /vmtest/upgrade-version)
}
ctr_boot

# ctr_layer UPPER VERSION: the container's first writable layer: the harness's stand-ins for
# what needs a GPU (nvidia-smi, nvidia-persistenced, nv-fabricmanager; busybox scripts, run by a
# busybox of their own since the image has no usleep) and the precompiled package and core
# objects of the stand-in driver VERSION under /usr/src/nvidia-VERSION/kernel{,-open}. Then
# CTR_LAYER_EXTRA, when set, is called with UPPER and VERSION.
ctr_layer() {
	local up=$1 version=$2 f a
	mkdir -p "$up/vmtest/bin" "$up/usr/bin" "$up/usr/src"
	cp /bin/busybox "$up/vmtest/bin/busybox"
	for a in usleep sleep cat mkdir rm kill echo; do
		ln -s busybox "$up/vmtest/bin/$a"
	done
	cp /vmtest/persistenced-mode "$up/vmtest/persistenced-mode"
	for f in nvidia-persistenced nvidia-smi nv-fabricmanager; do
		sed -e '1s|.*|#!/vmtest/bin/busybox sh|' -e '1a PATH=/vmtest/bin:$PATH' "/usr/bin/$f" >"$up/usr/bin/$f"
		chmod 0755 "$up/usr/bin/$f"
	done
	if [ -e /vmtest/container-agent-tree ]; then
		mkdir -p "$up/usr/local/bin"
		cp /usr/local/bin/driver-agent "$up/usr/local/bin/driver-agent"
	fi
	cp -a "/usr/src/nvidia-$version" "$up/usr/src/"
	# The operator's KERNEL_MODULE_TYPE=auto picks the open flavour from branch 560 on: the
	# stand-ins (neither flavour) are there too.
	cp -a "$up/usr/src/nvidia-$version/kernel" "$up/usr/src/nvidia-$version/kernel-open"
	[ -z "$CTR_LAYER_EXTRA" ] || "$CTR_LAYER_EXTRA" "$up" "$version"
}

# ctr_start NAME DIGEST [VERSION]: kubelet and crun: makes the pod directory and the hostPath
# directories, the container's overlay root and its config.json (the bundle's placeholders filled
# in, CTR_EXTRA_ENV added), and runs `crun run` in the background. Sets CRUN_PID, CTR_LOG and
# AGENT_PID (the container's init, the agent, in the host's PID namespace).
ctr_start() {
	local name=$1 digest=$2 version=${3:-$VMTEST_DRIVER_VERSION} d e extra=""
	d=$CTR_RUN/$name
	rm -rf "$d"
	mkdir -p "$d/upper" "$d/work" "$d/rootfs" "$d/pod/volumes/driver-startup-probe-script"
	ctr_layer "$d/upper" "$version"
	mount -t overlay overlay -o "lowerdir=$CTR_IMAGE,upperdir=$d/upper,workdir=$d/work" "$d/rootfs" || fail "overlay for $name"
	echo "$name" >"$d/pod/hostname"
	printf '127.0.0.1\tlocalhost\n' >"$d/pod/etc-hosts"
	: >"$d/pod/termination-log"
	cp "$CTR_BUNDLE/startup-probe.sh" "$d/pod/volumes/driver-startup-probe-script/startup-probe.sh"
	chmod 0755 "$d/pod/volumes/driver-startup-probe-script/startup-probe.sh"
	for e in $POD_HOSTPATH_CREATE; do mkdir -p "$e"; done
	for e in $CTR_EXTRA_ENV; do extra="$extra\"$e\", "; done
	sed -e "s|@ROOTFS@|$d/rootfs|" -e "s|@POD_DIR@|$d/pod|g" -e "s|@DRIVER_VERSION@|$version|" \
		-e "s|@DRIVER_CONFIG_DIGEST@|$digest|" -e "s|\"PATH=|$extra\"PATH=|" "$CTR_BUNDLE/config.json" >"$d/config.json"
	CTR_LOG=/tmp/ctr-$name.log # outside $d, which ctr_cleanup removes before the log is printed
	keep_log "$CTR_LOG"
	crun run --no-pivot --bundle "$d" "$name" >"$CTR_LOG" 2>&1 &
	CRUN_PID=$!
	CTR_NAME=$name
	CTR_VERSION=$version
	AGENT_PID=
	wait_until 10 ctr_started || fail "crun did not start $name: $(readv "$CTR_LOG" | cut -c1-300)"
}

ctr_pid() { crun state "$1" 2>/dev/null | sed -n 's/.*"pid": *\([0-9]*\).*/\1/p'; }
ctr_started() {
	AGENT_PID=$(ctr_pid "$CTR_NAME")
	[ -n "$AGENT_PID" ] && [ "$AGENT_PID" != 0 ]
}
crun_gone() { ! alive "$CRUN_PID"; }

# ctr_wait_ready SECONDS: lib.sh's wait_ready on the container's log, watching crun; 1 if the
# container ended or time ran out.
ctr_wait_ready() { wait_ready "$CTR_LOG" "$1" "$CRUN_PID"; }

# ctr_probe: the DaemonSet's startup probe as the kubelet runs it (crun exec, under the probe's
# timeout); CTR_PROBE_RC and CTR_PROBE_OUT.
ctr_probe() {
	eval "timeout $POD_STARTUP_PROBE_TIMEOUT crun exec $CTR_NAME $POD_STARTUP_PROBE" >/tmp/probe.out 2>&1
	CTR_PROBE_RC=$?
	CTR_PROBE_OUT=$(readv /tmp/probe.out | cut -c1-200)
}

# ctr_stop: the kubelet's stop: preStop (crun exec), SIGTERM, then SIGKILL after the pod's
# grace period, then crun delete; CTR_RC is the container's exit status ("killed" when the grace
# period ran out), CTR_STOP_MS the time from SIGTERM to the end.
ctr_stop() {
	local t0
	eval "crun exec $CTR_NAME $POD_PRESTOP" >/tmp/prestop.out 2>&1 || fail "preStop failed: $(readv /tmp/prestop.out)"
	t0=$(now_ms)
	crun kill "$CTR_NAME" TERM
	if wait_until "$POD_GRACE_SECONDS" crun_gone; then
		wait "$CRUN_PID"
		CTR_RC=$?
	else
		crun kill "$CTR_NAME" KILL
		wait_until 10 crun_gone || { crun delete -f "$CTR_NAME" >/dev/null 2>&1; kill -KILL "$CRUN_PID" 2>/dev/null; }
		wait "$CRUN_PID"
		CTR_RC=killed
	fi
	CTR_STOP_MS=$(($(now_ms) - t0))
	ctr_delete
}

# ctr_crash [agent]: SIGKILL for the container (crun kill KILL: its init, and with it the
# container), or with "agent" for the agent alone (kill -KILL of its PID from the host); then
# crun delete, which kills what is left in the container's cgroup, as a runtime does.
ctr_crash() {
	if [ "$1" = agent ]; then
		kill -KILL "$AGENT_PID"
	else
		crun kill "$CTR_NAME" KILL
	fi
	if ! wait_until 10 crun_gone; then
		# With its init dead but the daemons it forked still in its cgroup, crun run waits; a
		# runtime then kills the cgroup, which crun delete -f does.
		note "crun run still waited 10 s after the SIGKILL (daemons left in the cgroup): crun delete -f"
		crun delete -f "$CTR_NAME" >/dev/null 2>&1
		kill -KILL "$CRUN_PID" 2>/dev/null
	fi
	wait "$CRUN_PID"
	ctr_delete
}

# ctr_delete: crun delete -f and the container's overlay root.
ctr_delete() {
	crun delete -f "$CTR_NAME" >/dev/null 2>&1
	umount "$CTR_RUN/$CTR_NAME/rootfs" 2>/dev/null || umount -l "$CTR_RUN/$CTR_NAME/rootfs" 2>/dev/null
}

# ctr_cleanup: after each scenario: containers left running, then lib.sh's cleanup.
ctr_cleanup() {
	local c what=""
	for c in $(crun list -q 2>/dev/null); do
		crun delete -f "$c" >/dev/null 2>&1 && what="$what container:$c"
	done
	for c in $(awk -v p="$CTR_RUN/" 'index($5, p) == 1 { print $5 }' /proc/self/mountinfo | sort -r); do
		umount -l "$c" 2>/dev/null
	done
	rm -rf "$CTR_RUN"
	CTR_EXTRA_ENV=
	CTR_LAYER_EXTRA=
	[ -n "$what" ] && echo "VMTEST-CLEANUP containers:$what"
}

# journal_summary: the journal's entries on one line ("none" without a journal): the kinds of
# change it names, and the prerequisite modules.
journal_summary() {
	[ -e "$JOURNAL" ] || { echo none; return; }
	local keys mods
	keys=$(grep -o '^  "[a-zA-Z]*"' "$JOURNAL" | tr -d ' "' | grep -v -e '^format$' -e '^pid$' | tr '\n' ',' | sed 's/,$//')
	mods=$(tr -d ' \n' <"$JOURNAL" | sed -n 's/.*"prerequisites":\[\([^]]*\)\].*/\1/p' | tr -d '"')
	echo "${keys:-empty}${mods:+ (prerequisites $mods)}"
}

# ctr_check_clean: after the last container's teardown, the node as it booted: lib.sh's
# check_clean, the firmware search path, and no PID file or journal.
ctr_check_clean() {
	check_clean
	check_eq "host: firmware search path after teardown" "$(firmware_path)" ""
	[ -e "$PIDFILE" ] && fail "host: $PIDFILE left"
	[ -e "$JOURNAL" ] && fail "host: $JOURNAL left: $(journal_summary)"
}

# ctr_check_ready NAME: what the host (the guest's root namespace) sees of a Ready container.
ctr_check_ready() {
	local m dev
	for m in nvidia nvidia_uvm nvidia_modeset; do
		mod_loaded "$m" || fail "host: $m not loaded"
	done
	mod_loaded nvidia_drm && fail "host: nvidia_drm loaded"
	check_eq "host: /sys/module/nvidia/version" "$(readv /sys/module/nvidia/version)" "$CTR_VERSION"
	mounted "$DRIVER_ROOT" || fail "host: $DRIVER_ROOT is not a mount point"
	check_eq "host: $DRIVER_ROOT/etc/os-release is the image's" "$(md5sum <"$DRIVER_ROOT/etc/os-release" 2>/dev/null)" "$(md5sum <"$CTR_IMAGE/etc/os-release")"
	[ -x "$DRIVER_ROOT/usr/local/bin/driver-agent" ] || fail "host: no $DRIVER_ROOT/usr/local/bin/driver-agent"
	[ -e "$DRIVER_ROOT/usr/src/nvidia-$CTR_IMAGE_VERSION/kernel/nvidia/nv-kernel.o_binary" ] ||
		fail "host: no $DRIVER_ROOT/usr/src/nvidia-$CTR_IMAGE_VERSION (the image's NVIDIA sources) for the GDS/GDRCopy sidecars"
	# The agent makes /sys's submounts unbindable before the rbind (as NVIDIA's script does): the
	# container's cgroupfs and the /sys volumes must not show under the exported root.
	m=$(awk -v p="$DRIVER_ROOT/sys/" 'index($5, p) == 1 { printf "%s ", $5 }' /proc/self/mountinfo)
	[ -z "$m" ] && [ -d "$DRIVER_ROOT/sys/module" ] || fail "host: mounts under $DRIVER_ROOT/sys: '$m' (want sysfs alone)"
	# nvidia-smi from the host side, as the toolkit and the validator run it (the stand-in here).
	chroot "$DRIVER_ROOT" nvidia-smi -q >/tmp/smi.out 2>&1 || fail "host: chroot $DRIVER_ROOT nvidia-smi -q failed: $(readv /tmp/smi.out | cut -c1-200)"
	grep -q "Driver Version *: $CTR_VERSION" /tmp/smi.out || fail "host: nvidia-smi -q under $DRIVER_ROOT does not show driver $CTR_VERSION"
	# Device nodes: the agent makes them in the container's /dev; the host sees them under the
	# exported root, and (when the agent also makes them on the host) in /dev.
	dev=$(ls -d "$DRIVER_ROOT"/dev/nvidia* 2>/dev/null | sed "s|$DRIVER_ROOT||" | tr '\n' ' ' | sed 's/ $//')
	check_eq "host: device nodes under $DRIVER_ROOT/dev" "$dev" "/dev/nvidia-modeset /dev/nvidia-uvm /dev/nvidia-uvm-tools /dev/nvidia0 /dev/nvidiactl"
	# The container's /dev is its own tmpfs (a privileged pod's, like containerd's): nodes made
	# there are not in the host's /dev (NVIDIA's toolkit makes those on the host).
	[ -n "$(nv_devices)" ] && note "host /dev has $(nv_devices)"
	check_eq "host: firmware search path" "$(firmware_path)" "$FIRMWARE_WANT"
	check_eq "host: $PIDFILE is the agent's host PID" "$(readv "$PIDFILE")" "$AGENT_PID"
	check_eq "host: $STATE" "$(readv "$STATE")" "$1"
	# The daemon runs in the container (its PID file in the container's /var/run), in the host's
	# PID namespace.
	alive "$(cat "$DRIVER_ROOT/run/nvidia-persistenced/nvidia-persistenced.pid" 2>/dev/null)" || fail "host: the nvidia-persistenced stand-in is not running (PID file $DRIVER_ROOT$PERSISTENCED_PIDFILE: $(readv "$DRIVER_ROOT/run/nvidia-persistenced/nvidia-persistenced.pid"))"
}

# container-precompiled: the image under the operator's spec reaches Ready on the precompiled
# path; the startup probe passes through crun exec and writes .driver-ctr-ready; the host sees
# modules, device nodes, the exported root and nvidia-smi; preStop + SIGTERM end it within the
# grace period with exit 0 and a clean node.
scn_container_precompiled() {
	ctr_precompiled
	ctr_cleanup
}
ctr_precompiled() {
	CTR_EXTRA_ENV=DRIVER_AGENT_LOG_LEVEL=debug
	ctr_start c1 vmtest-c1 || return
	if ! ctr_wait_ready 120; then
		fail "not Ready within 120 s (status '$(readv "$STATUS")'): $(last_error "$CTR_LOG")"
		return
	fi
	CTR_READY_NOTE="Ready (operator file, precompiled path)"
	ctr_probe
	check_eq "startup probe (crun exec $POD_STARTUP_PROBE) exit status" "$CTR_PROBE_RC" 0
	[ "$CTR_PROBE_RC" = 0 ] || note "probe said: $CTR_PROBE_OUT"
	check_eq "host: /run/nvidia/validations/.driver-ctr-ready" "$(readv /run/nvidia/validations/.driver-ctr-ready)" "GDRCOPY_ENABLED: false GDS_ENABLED: false GPU_DIRECT_RDMA_ENABLED: false"
	grep -q 'path=precompiled' "$CTR_LOG" || fail "the log does not say path=precompiled"
	ctr_check_ready vmtest-c1
	CTR_PERSISTENCED=$(cat "$DRIVER_ROOT/run/nvidia-persistenced/nvidia-persistenced.pid" 2>/dev/null)
	ctr_stop
	alive "$CTR_PERSISTENCED" && fail "host: the nvidia-persistenced stand-in ($CTR_PERSISTENCED) still runs"
	check_eq "exit status after preStop + SIGTERM (grace ${POD_GRACE_SECONDS} s)" "$CTR_RC" 0
	note "checked: $CTR_READY_NOTE; startup probe via crun exec rc 0 wrote .driver-ctr-ready; host sees nvidia/uvm/modeset, $DRIVER_ROOT = image root (os-release, agent, NVIDIA $CTR_IMAGE_VERSION sources, nvidia-smi -q via chroot, device nodes under $DRIVER_ROOT/dev, no /sys submounts), firmware path, PID file = agent host PID, digest, persistenced; preStop + SIGTERM: exit $CTR_RC in ${CTR_STOP_MS}ms (grace ${POD_GRACE_SECONDS}s), node clean"
	[ -e /run/nvidia/validations/.driver-ctr-ready ] && fail "host: .driver-ctr-ready left after preStop"
	ctr_check_clean
}

# The crash-only scenarios: container-crash-<point>-<who>. A first container (c1) is SIGKILLed
# at <point>, either whole (crun kill KILL: its init, the agent, and crun delete kills the rest of
# its cgroup) or the agent alone (kill -KILL from the host; then the runtime ends the
# container as it does when its init dies). A new container (c2, same digest) must then reach
# Ready, pass the startup probe, show the host what container-precompiled checks, and after
# preStop + SIGTERM leave the node as it booted. From `coming` on, c1 has journaled what it changed
# outside its container (prerequisites, the firmware search path, the mount), and c2 must say
# that it adopts it.
#   link      the precompiled path's ld runs (an ld wrapper first in PATH holds it 3 s)
#   coming    nvidia's init runs (/sys/module/nvidia/initstate is "coming"; the slow package)
#   loaded    nvidia_modeset is loaded, before the device nodes (status.json phase load/devices)
#   daemons   nvidia-persistenced has started (its PID file in the container root)
#   rbind     /run/nvidia/driver is mounted, before the Ready file
#   ready     at Ready
ctr_point_reached() {
	case $1 in
	link) [ -e /run/nvidia/vmtest-ld-running ] ;;
	coming) [ "$(cat /sys/module/nvidia/initstate 2>/dev/null)" = coming ] ;;
	loaded) mod_loaded nvidia_modeset ;;
	daemons) [ -s "$CTR_RUN/c1/rootfs/run/nvidia-persistenced/nvidia-persistenced.pid" ] ;;
	rbind) mounted "$DRIVER_ROOT" ;;
	ready) agent_ready "$CTR_LOG" ;;
	esac
}
ctr_point_or_gone() { ctr_point_reached "$CTR_POINT" || ! alive "$CRUN_PID"; }

# ctr_crash_at POINT WHO
ctr_crash_at() {
	local point=$1 who=$2 phase left journal adopted
	CTR_POINT=$point
	CTR_LAYER_EXTRA=
	case $point in
	link) CTR_LAYER_EXTRA=ctr_slow_ld ;;
	coming) use_package slow ;;
	esac
	ctr_start c1 vmtest-c1 || return
	wait_until 120 ctr_point_or_gone
	if ! ctr_point_reached "$point"; then
		fail "c1 never reached '$point' (status '$(readv "$STATUS")'): $(last_error "$CTR_LOG")"
		return
	fi
	phase=$(sed -n 's/.*"phase": *"\([a-z-]*\)".*/\1/p' "$STATUS_JSON" 2>/dev/null | head -n1)
	ctr_crash "$who"
	left="modules '$(nv_modules)', $(mounted "$DRIVER_ROOT" && echo "$DRIVER_ROOT mounted, ")PID file $(readv "$PIDFILE"), status '$(readv "$STATUS")', work dirs $(ls -d "$CTR_RUN"/c1/upper/tmp/driver-agent-* 2>/dev/null | wc -l), firmware path '$(firmware_path)', journal: $(journal_summary)"
	journal=$(journal_summary)
	[ "$point" = coming ] && use_package standard
	CTR_LAYER_EXTRA=
	ctr_start c2 vmtest-c1 || return
	if ! ctr_wait_ready 120; then
		fail "c2 not Ready within 120 s after c1 was killed at $point (status '$(readv "$STATUS")'): $(last_error "$CTR_LOG")"
		return
	fi
	adopted=no
	grep -q 'adopting what an earlier agent left' "$CTR_LOG" && adopted=yes
	if [ "$point" != link ]; then
		[ "$journal" != none ] || fail "c1 left no journal at $point"
		check_eq "c2 adopts what c1 journaled" "$adopted" yes
	fi
	ctr_probe
	check_eq "c2 startup probe exit status" "$CTR_PROBE_RC" 0
	ctr_check_ready vmtest-c1
	ctr_stop
	check_eq "c2 exit status after preStop + SIGTERM" "$CTR_RC" 0
	ctr_check_clean
	note "checked: c1 SIGKILLed ($who) at $point (phase ${phase:-?}), leaving $left; c2 Ready (adopted: $adopted), probe rc 0, host view as container-precompiled; c2 SIGTERM exit 0 in ${CTR_STOP_MS}ms; node at its boot state (modules, devices, mounts, firmware path, no PID file, digest or journal)"
}

# ctr_slow_ld UPPER: an ld first in the container's PATH that marks /run/nvidia/vmtest-ld-running
# and waits 3 s before running the image's ld.
ctr_slow_ld() {
	mkdir -p "$1/usr/local/bin"
	cat >"$1/usr/local/bin/ld" <<'LD'
#!/bin/sh
: >/run/nvidia/vmtest-ld-running
sleep 3
exec /usr/bin/ld "$@"
LD
	chmod 0755 "$1/usr/local/bin/ld"
}

for p in link coming loaded daemons rbind ready; do
	for w in container agent; do
		eval "scn_container_crash_${p}_$w() { ctr_crash_at $p $w; rm -f /run/nvidia/vmtest-ld-running; ctr_cleanup; }"
	done
done

# container-upgrade: c1 (the stand-ins' version) is Ready and SIGKILLed, so its modules stay
# loaded and unused; c2 comes with another DRIVER_VERSION (and its own package): it must unload
# the old modules, load its own (version and load id change), store its digest, pass the probe,
# and tear down to the boot state.
scn_container_upgrade() {
	ctr_upgrade
	ctr_cleanup
}
ctr_upgrade() {
	local old_id
	ctr_start c1 vmtest-c1 || return
	ctr_wait_ready 120 || { fail "c1 not Ready: $(last_error "$CTR_LOG")"; return; }
	old_id=$(load_id)
	ctr_crash container
	check_eq "host: nvidia left loaded by c1" "$(readv /sys/module/nvidia/version)" "$VMTEST_DRIVER_VERSION"
	ctr_start c2 vmtest-c2 "$VMTEST_UPGRADE_VERSION" || return
	ctr_wait_ready 120 || { fail "c2 ($VMTEST_UPGRADE_VERSION) not Ready: $(last_error "$CTR_LOG")"; return; }
	[ "$(load_id)" != "$old_id" ] || fail "nvidia was not reloaded (load id $old_id unchanged)"
	grep -q 'Unloading NVIDIA driver kernel modules' "$CTR_LOG" || fail "c2's log does not say it unloaded the old modules"
	ctr_probe
	check_eq "c2 startup probe exit status" "$CTR_PROBE_RC" 0
	ctr_check_ready vmtest-c2
	ctr_stop
	check_eq "c2 exit status after preStop + SIGTERM" "$CTR_RC" 0
	# What c1 loaded or set besides the driver (prerequisites, the firmware path), c2 adopted
	# from c1's journal and undid.
	grep -q 'adopting what an earlier agent left' "$CTR_LOG" || fail "c2's log does not say it adopted what c1 journaled"
	ctr_check_clean
	[ -e "$STATE" ] && fail "host: $STATE left"
	note "checked: c1 ($VMTEST_DRIVER_VERSION) Ready then SIGKILLed, modules left loaded; c2 DRIVER_VERSION=$VMTEST_UPGRADE_VERSION unloaded them and loaded its own (version, load id), adopted c1's journal, digest vmtest-c2, probe rc 0; SIGTERM exit 0, node at its boot state (modules, devices, mounts, firmware path, no PID file, digest or journal)"
}

# container-compile: the image has no precompiled package for the guest kernel, so the agent takes
# the compile path inside the container, against the host's kernel build tree
# (/usr/lib/modules/<release>/build in the guest's root, which the agent reaches as
# /proc/1/root/...; the harness's merge of Debian's headers for the guest kernel into one tree, as
# Flatcar ships it). The sources it compiles are the stand-ins laid out as NVIDIA's kernel source
# directory (/vmtest/compile-src: NVIDIA's Makefile command line, per-module Kbuild fragments,
# prebuilt core objects), in the container's layer at /usr/src/nvidia-<version>/kernel{,-open}.
# The agent's own compile code, the image's gcc, make and binutils, kbuild and the tree's helpers
# run for real; only the driver sources are stand-ins. It must copy the tree (the host's stays as
# it was), build nvidia, nvidia-uvm and nvidia-modeset, store them in the host cache, load them and
# reach Ready; the probe, the host's view and the teardown are container-precompiled's.
CTR_COMPILE_READY_S=480 # under TCG: the copy of the 60 MiB tree, the helpers' checks, kbuild

# ctr_compile_layer UPPER VERSION: the stand-ins' sources instead of the precompiled package.
ctr_compile_layer() {
	local f
	for f in kernel kernel-open; do
		rm -rf "$1/usr/src/nvidia-$2/$f"
		cp -a /vmtest/compile-src "$1/usr/src/nvidia-$2/$f"
	done
}

# tree_listing DIR: the names, sizes and times of everything under DIR, as one checksum.
tree_listing() { find "$1" -exec stat -c '%n %s %Y' {} + | sort | md5sum | cut -d' ' -f1; }

scn_container_compile() {
	ctr_compile
	ctr_cleanup
}
ctr_compile() {
	local tree=/usr/lib/modules/$VMTEST_KERNEL_RELEASE/build before t0 ready_ms built prep entry work helpers flavor m
	[ -f "$tree/Makefile" ] || { fail "host: no kernel build tree at $tree"; return; }
	before=$(tree_listing "$tree")
	CTR_EXTRA_ENV=DRIVER_AGENT_LOG_LEVEL=debug
	CTR_LAYER_EXTRA=ctr_compile_layer
	t0=$(now_ms)
	ctr_start c1 vmtest-c1 || return
	if ! ctr_wait_ready "$CTR_COMPILE_READY_S"; then
		fail "not Ready within $CTR_COMPILE_READY_S s (status '$(readv "$STATUS")'): $(last_error "$CTR_LOG")"
		return
	fi
	ready_ms=$(($(now_ms) - t0))
	grep -q 'path=compile' "$CTR_LOG" || fail "the log does not say path=compile"
	grep -q "compile against the build tree at /proc/1/root$tree (host)" "$CTR_LOG" ||
		fail "the agent did not plan to compile against the host's tree /proc/1/root$tree: $(grep -m1 'install path chosen' "$CTR_LOG" | cut -c1-400)"
	grep -q "copying the host's kernel build tree.*dir=/proc/1/root$tree" "$CTR_LOG" || fail "the log does not say it copied /proc/1/root$tree"
	helpers=$(sed -n 's/.*msg="build helpers ready".* \(relocated=[0-9]* runnable=[0-9]* static=[0-9]*\).*/\1/p' "$CTR_LOG" | head -n1)
	[ -n "$helpers" ] || fail "the log has no 'build helpers ready' record"
	built=$(sed -n 's/.*msg="kernel modules built".* modules=\([0-9]*\) seconds=\([0-9]*\).*/\1 modules in \2 s/p' "$CTR_LOG" | head -n1)
	case $built in "3 modules in "*) ;; *) fail "the log does not say the build made 3 modules: '${built:-no record}'" ;; esac
	for m in nvidia nvidia_uvm nvidia_modeset; do
		grep -q "msg=\"loading kernel module\".* module=$m path=/tmp/driver-agent-[0-9]*/compile/build/" "$CTR_LOG" ||
			fail "the log does not say $m was loaded from the build's work dir"
	done
	prep=$(sed -n 's/.*msg="phase finished".* phase=prepare result=ok duration=\([^ ]*\).*/\1/p' "$CTR_LOG" | head -n1)
	flavor=$(sed -n 's/.*msg="install path chosen".* flavor=\([a-z-]*\).*/\1/p' "$CTR_LOG" | head -n1)
	grep -q 'msg="stored the modules in the host cache"' "$CTR_LOG" || fail "the log does not say the modules were stored in the host cache"
	entry=$(ls -d "$AGENT_CACHE"/*/ 2>/dev/null | wc -l)
	[ "$entry" -ge 1 ] || fail "host: no entry in the module cache $AGENT_CACHE"
	ctr_probe
	check_eq "startup probe (crun exec $POD_STARTUP_PROBE) exit status" "$CTR_PROBE_RC" 0
	check_eq "host: /run/nvidia/validations/.driver-ctr-ready" "$(readv /run/nvidia/validations/.driver-ctr-ready)" "GDRCOPY_ENABLED: false GDS_ENABLED: false GPU_DIRECT_RDMA_ENABLED: false"
	ctr_check_ready vmtest-c1
	ctr_stop
	check_eq "exit status after preStop + SIGTERM (grace ${POD_GRACE_SECONDS} s)" "$CTR_RC" 0
	work=$(ls -d "$CTR_RUN"/c1/upper/tmp/driver-agent-* 2>/dev/null | wc -l)
	check_eq "work dirs left in the container's layer" "$work" 0
	check_eq "host: the build tree $tree after the run (names, sizes, times)" "$(tree_listing "$tree")" "$before"
	ctr_check_clean
	note "checked: compile path in the container (flavour ${flavor:-?}) against the host's build tree /proc/1/root$tree (the harness's merge of Debian's $VMTEST_KERNEL_RELEASE headers, as Flatcar ships it; real kbuild, helpers $helpers, the image's gcc), stand-in driver sources in NVIDIA's layout (not NVIDIA's code): $built, loaded from the work dir, prepare phase (tree copy, helper checks, build) ${prep:-?}; Ready after ${ready_ms}ms; cached ($entry entry); startup probe rc 0; host view as container-precompiled; host tree unchanged; preStop + SIGTERM: exit $CTR_RC in ${CTR_STOP_MS}ms, no work dir, node clean"
}
