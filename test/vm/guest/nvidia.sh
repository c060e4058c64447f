# The scenarios of `make nvidia-test` (test/vm/nvidia_test.go): NVIDIA's real driver, built from
# Debian's nvidia-kernel-source on the host, in a guest with no GPU. busybox ash, sourced by /init
# after lib.sh and scenarios.sh. nvidia.ko's init fails with ENODEV ("NVRM: No NVIDIA GPU found.")
# after the kernel accepted the module and resolved its symbols; each scenario checks that the agent
# got that far, said so, exited with the no-GPU code and left no module loaded.
#
# Besides its result line, each agent scenario prints the agent's log and the kernel's NVIDIA lines
# as "VMTEST-LOG <scenario> <line>" (the host reads the link time from them), and its ld calls as
# "VMTEST-LD <scenario> <start> <end> <rc> <args>" (guest uptime in seconds).

NV_CACHE=/vmtest/nvcache # <flavour>/<entry>: cache entries made on the host by pkg/cache
NV_EXIT_NO_GPU=5

scn_nvidia_banner() {
	check_eq "first line of /proc/version vs the banner the package and cache entries were made for" "$(head -n1 /proc/version)" "$(cat /vmtest/banner)"
}

# nv_ld_timer: an `ld` first in PATH that runs the real one and records each call with its start
# and end (guest uptime) and exit status in /tmp/ld-calls.
nv_ld_timer() {
	cat >/usr/local/bin/ld <<'EOF'
#!/bin/sh
read -r t0 _ </proc/uptime
/usr/bin/ld "$@"
rc=$?
read -r t1 _ </proc/uptime
echo "$t0 $t1 $rc $*" >>/tmp/ld-calls
exit $rc
EOF
	chmod 755 /usr/local/bin/ld
	: >/tmp/ld-calls
}
nv_ld_ms() { awk '{ s += ($2 - $1) * 1000 } END { printf "%d", s }' /tmp/ld-calls; }

# nv_agent NAME LOG ARGS...: runs `driver-agent init ARGS` until it exits (15 min at most, the
# guest is slow with a 70 MB module); sets AGENT_RC and NV_AGENT_MS.
nv_agent() {
	local name=$1 log=$2 t0
	shift 2
	NV_BEFORE=$(modules_snapshot)
	t0=$(now_ms)
	agent_run "$log" nvidia-test 900 "$@"
	NV_AGENT_MS=$(($(now_ms) - t0))
	sed "s|^|VMTEST-LOG $name |" "$log"
	dmesg | tail -n +$((DMESG_START + 1)) | grep -E 'NVRM|nvidia|Unknown symbol|disagrees' | sed "s|^|VMTEST-LOG $name dmesg: |"
	[ -f /tmp/ld-calls ] && sed "s|^|VMTEST-LD $name |" /tmp/ld-calls
}

# nv_check_no_gpu LOG: the kernel accepted nvidia.ko and resolved its symbols, and its init found
# no GPU (ENODEV, not ENOEXEC or ENOENT); the agent said so with the kernel's lines, exited with
# the no-GPU code, and unloaded everything it loaded, the prerequisites (drm) included.
nv_check_no_gpu() {
	local log=$1 m loaded
	check_eq "exit code" "$AGENT_RC" "$NV_EXIT_NO_GPU"
	grep -q 'load nvidia: the kernel found no NVIDIA GPU this driver supports: no such device' "$log" ||
		fail "the log has no 'load nvidia: ... no such device' (ENODEV): $(last_error "$log")"
	grep 'no such device' "$log" | grep -q 'kernel log: .*NVRM: No NVIDIA GPU found\.' ||
		fail "the agent's error does not quote the kernel's 'NVRM: No NVIDIA GPU found.'"
	grep -qiE 'invalid module format|exec format error|unknown symbol|no such file or directory' "$log" &&
		fail "the log shows ENOEXEC or ENOENT: $(grep -iE -m1 'invalid module format|exec format error|unknown symbol|no such file or directory' "$log" | cut -c1-300)"
	dmesg | tail -n +$((DMESG_START + 1)) | grep -q 'NVRM: No NVIDIA GPU found\.' || fail "dmesg has no 'NVRM: No NVIDIA GPU found.'"
	dmesg | tail -n +$((DMESG_START + 1)) | grep -qE 'Unknown symbol|disagrees about version' &&
		fail "dmesg: $(dmesg | tail -n +$((DMESG_START + 1)) | grep -E -m1 'Unknown symbol|disagrees about version')"
	# What the agent loaded, from its log: drm (nvidia.ko's depends=) must be among them.
	loaded=$(sed -n 's/.*msg="loading kernel module" .*module=\([^ ]*\) path=.*/\1/p' "$log" | tr '\n' ' ')
	case " $loaded " in
	*" drm "*) ;;
	*) fail "the agent did not load drm, which nvidia.ko depends on (it loaded: $loaded)" ;;
	esac
	case " $loaded " in
	*" nvidia "*) ;;
	*) fail "the agent never loaded nvidia (it loaded: $loaded)" ;;
	esac
	for m in $loaded; do
		mod_loaded "$m" && fail "$m, loaded by the agent, is still loaded"
	done
	check_eq "/proc/modules after the agent vs before" "$(modules_snapshot)" "$NV_BEFORE"
	note "agent loaded: $loaded"
	check_clean
}

# nv_precompiled NAME FLAVOUR [ENV]: the package `driver-agent build` made on the host for FLAVOUR
# (nv-linux.o, nv-modeset-linux.o, nvidia-uvm.ko, nvidia-peermem.ko), in
# /usr/src/nvidia-<version>/FLAVOUR/precompiled, matches this kernel; the agent links it with
# NVIDIA's nv-kernel.o_binary and nv-modeset-kernel.o_binary of FLAVOUR using the guest's ld, then
# loads.
nv_precompiled() {
	local name=$1 flavour=$2 log=/tmp/$1.log
	AGENT_EXTRA_ENV=$3
	nv_ld_timer
	nv_agent "$name" "$log"
	grep -q "Found NVIDIA driver package nvidia-modules-$KVER" "$log" || fail "the agent did not find the package nvidia-modules-$KVER"
	grep -q "flavor=$flavour " "$log" || fail "not the $flavour flavour: $(grep -m1 'flavor=' "$log" | cut -c1-300)"
	grep -q 'path=precompiled' "$log" || fail "not the precompiled path: $(grep -m1 'install path chosen' "$log")"
	grep -q 'Relinking NVIDIA driver kernel modules' "$log" || fail "no 'Relinking' line"
	check_eq "ld calls (nvidia.ko and nvidia-modeset.ko)" "$(ld_calls)" 2
	awk '$3 != 0 { exit 1 }' /tmp/ld-calls || fail "an ld call failed: $(readv /tmp/ld-calls)"
	grep -q "/$flavour/nvidia/nv-kernel.o_binary" /tmp/ld-calls || fail "ld did not link $flavour/nvidia/nv-kernel.o_binary: $(readv /tmp/ld-calls)"
	note "agent ${NV_AGENT_MS}ms, ld $(nv_ld_ms)ms"
	nv_check_no_gpu "$log"
}

scn_nvidia_precompiled() { nv_precompiled nvidia-precompiled kernel; }
scn_nvidia_open_precompiled() { nv_precompiled nvidia-open-precompiled kernel-open KERNEL_MODULE_TYPE=open; }

# nv_cached NAME FLAVOUR [ENV]: the agent, pointed at the cache entry the host stored for FLAVOUR,
# loads the modules the compile path built, without linking.
nv_cached() {
	local name=$1 flavour=$2 log=/tmp/$1.log
	AGENT_EXTRA_ENV=$3
	nv_ld_timer
	nv_agent "$name" "$log" --cache-dir "$NV_CACHE/$flavour"
	grep -q 'path=cached' "$log" || fail "not the cached path: $(grep -m1 'install path chosen' "$log")"
	grep -q 'Relinking' "$log" && fail "the agent linked although the cache has the modules"
	check_eq "ld calls" "$(ld_calls)" 0
	note "agent ${NV_AGENT_MS}ms"
	nv_check_no_gpu "$log"
}

scn_nvidia_cached() { nv_cached nvidia-cached kernel; }
scn_nvidia_open_cached() { nv_cached nvidia-open-cached kernel-open KERNEL_MODULE_TYPE=open; }
