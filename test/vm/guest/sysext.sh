# Scenarios of the sysext group (sourced by /init after lib.sh): the guest's os-release says
# Flatcar $SYSEXT_HOST_VERSION; /vmtest/sysext holds two driver extensions made by pkg/sysext from
# the standard stand-ins, one for this release and one for $SYSEXT_OTHER_VERSION. An extension
# is attached as systemd-sysext attaches it: the image on a loop device, read-only, under
# /run/extensions/<name> (where the agent looks for extensions), then merged by an overlay
# mount onto /usr with the extension's usr/ as the upper lower layer.

. /vmtest/sysext/config
SYSEXT_DIR=/run/extensions

# sysext_attach NAME: mounts /vmtest/sysext/NAME.raw at $SYSEXT_DIR/NAME (loop, squashfs, ro).
sysext_attach() {
	modprobe -a loop squashfs overlay || fail "modprobe loop squashfs overlay failed"
	mkdir -p "$SYSEXT_DIR/$1"
	mount -t squashfs -o ro,loop "/vmtest/sysext/$1.raw" "$SYSEXT_DIR/$1" 2>/tmp/sysext-mount.err ||
		fail "mount of $1.raw failed: $(readv /tmp/sysext-mount.err)"
}

# sysext_detach: unmounts /usr's overlay and every attached image.
sysext_detach() {
	local d
	mounted /usr && umount -l /usr
	for d in "$SYSEXT_DIR"/*; do
		mounted "$d" && umount -l "$d"
	done
	rm -rf "$SYSEXT_DIR"
}

# sysext-refused: the extension for another release, attached, is refused by the agent's check
# (systemd-sysext's): the dry run warns naming both releases and does not take the host path.
scn_sysext_refused() {
	keep_log /tmp/sysext-refused.out /tmp/sysext-refused.err
	sysext_attach "$SYSEXT_OTHER"
	[ -f "$SYSEXT_DIR/$SYSEXT_OTHER/usr/lib/extension-release.d/extension-release.$SYSEXT_OTHER" ] ||
		fail "the attached image has no extension-release.$SYSEXT_OTHER"
	env $AGENT_ENV driver-agent --dry-run >/tmp/sysext-refused.out 2>/tmp/sysext-refused.err
	grep -q "warning       the driver extension $SYSEXT_DIR/$SYSEXT_OTHER is not used: systemd-sysext refuses it: .*it is for flatcar $SYSEXT_OTHER_VERSION, the host runs flatcar $SYSEXT_HOST_VERSION; use the extension built for $SYSEXT_HOST_VERSION" /tmp/sysext-refused.out ||
		fail "the plan does not refuse $SYSEXT_OTHER with the two releases"
	grep -q "Install path: host" /tmp/sysext-refused.out && fail "the plan takes the host path for a refused extension"
	grep -q "level=WARN .*systemd-sysext refuses it" /tmp/sysext-refused.err || fail "the log has no warning about $SYSEXT_OTHER"
	sysext_detach
}

# sysext-host: the extension for this release is attached (the dry run names it), merged onto
# /usr, and its unit's load commands, run as systemd runs them, load the stand-ins from it; the
# agent with --modules=host then reaches Ready naming the extension in its log and status, and
# after SIGTERM exits 0 leaving the modules loaded.
scn_sysext_host() {
	local unit log=/tmp/sysext-host.log cmd ignore id
	keep_log /tmp/sysext-dry.out "$log"
	sysext_attach "$SYSEXT_NAME"
	env $AGENT_ENV driver-agent --dry-run >/tmp/sysext-dry.out 2>&1
	grep -q "host driver   the system extension $SYSEXT_NAME (driver $VMTEST_DRIVER_VERSION, $SYSEXT_DIR/$SYSEXT_NAME, not merged yet) provides the driver" /tmp/sysext-dry.out ||
		fail "the dry run does not name the attached extension"
	grep -q "Install path: host" /tmp/sysext-dry.out || fail "the dry run does not take the host path"

	mount -t overlay overlay -o "ro,lowerdir=$SYSEXT_DIR/$SYSEXT_NAME/usr:/usr" /usr 2>/tmp/sysext-mount.err ||
		fail "overlay onto /usr failed: $(readv /tmp/sysext-mount.err)"
	grep -qx "VERSION_ID=$SYSEXT_HOST_VERSION" "/usr/lib/extension-release.d/extension-release.$SYSEXT_NAME" ||
		fail "the merged /usr has no extension-release for $SYSEXT_HOST_VERSION"
	[ -x /usr/local/bin/driver-agent ] || fail "the merged /usr hides the host's /usr"
	unit=/usr/lib/systemd/system/$SYSEXT_UNIT
	[ -L "/usr/lib/systemd/system/multi-user.target.wants/$SYSEXT_UNIT" ] || fail "$SYSEXT_UNIT is not enabled"
	[ -f "$unit" ] || { fail "no $unit"; sysext_detach; return; }

	# Each ExecStartPre=[-]/bin/sh -c '<command>', run twice: the second run loads nothing.
	for pass in 1 2; do
		grep '^ExecStartPre=' "$unit" >/tmp/sysext-load
		while IFS= read -r cmd; do
			cmd=${cmd#ExecStartPre=}
			ignore=
			case "$cmd" in -*) ignore=1 cmd=${cmd#-} ;; esac
			case "$cmd" in "/bin/sh -c '"*"'") cmd=${cmd#/bin/sh -c \'} cmd=${cmd%\'} ;; *) fail "not /bin/sh -c: $cmd"; continue ;; esac
			sh -c "$cmd" >/tmp/sysext-cmd.out 2>&1 || [ -n "$ignore" ] ||
				fail "pass $pass: '$cmd' failed: $(readv /tmp/sysext-cmd.out | cut -c1-200)"
		done </tmp/sysext-load
		[ "$pass" = 1 ] && id=$(load_id)
	done
	for m in nvidia nvidia_uvm nvidia_modeset; do
		mod_loaded "$m" || fail "the unit's load commands did not load $m"
	done
	check_eq "/sys/module/nvidia/version" "$(readv /sys/module/nvidia/version)" "$VMTEST_DRIVER_VERSION"
	check_eq "load id after the second pass" "$(load_id)" "$id"
	grep -q "/usr/lib/modules/$KVER/updates/nvidia.ko" /tmp/sysext-load || fail "the unit does not load nvidia.ko from the extension"

	# The device nodes, which NVIDIA's userspace (the unit's nvidia-persistenced, running as root)
	# creates on a real host; the agent makes none on the host-managed path.
	[ -e /dev/nvidiactl ] || mknod -m 666 /dev/nvidiactl c 195 255
	[ -e /dev/nvidia0 ] || mknod -m 666 /dev/nvidia0 c 195 0

	agent_start "$log" - --modules=host --host-modules-timeout=10s
	if wait_ready "$log" 60; then
		grep -q "path=host reason=\"--modules=host: the host loads the NVIDIA modules; the system extension $SYSEXT_NAME (driver $VMTEST_DRIVER_VERSION, /usr/lib/extension-release.d/extension-release.$SYSEXT_NAME) provides the driver\"" "$log" ||
			fail "the log does not name the merged extension"
		grep -q "\"pathReason\": *\"[^\"]*the system extension $SYSEXT_NAME" "$STATUS_JSON" || fail "status.json does not name the extension"
		grep -q '"installPath": *"host"' "$STATUS_JSON" || fail "status.json installPath is not host"
		agent_stop TERM $((SHUTDOWN_TIMEOUT_S + 10))
		check_eq "exit code after SIGTERM" "$AGENT_RC" 0
	else
		fail "agent not ready: $(last_error "$log")"
		agent_stop KILL 5
	fi
	for m in nvidia nvidia_uvm nvidia_modeset; do
		mod_loaded "$m" || fail "the agent unloaded $m, which the host owns"
	done
	check_eq "load id after the agent" "$(load_id)" "$id"
	grep -q "Unloading NVIDIA driver kernel modules" "$log" && fail "the agent logged an unload"
	kill_persistenced 2>/dev/null
	rmmod nvidia_modeset nvidia_uvm nvidia 2>/dev/null
	sysext_detach
}
