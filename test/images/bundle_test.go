package images

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

var update = flag.Bool("update", false, "rewrite test/vm/bundle from the operator's DaemonSet")

const (
	operatorDaemonSet = "testdata/gpu-operator-v26.7.0-driver-daemonset.yaml"
	bundleDir         = repo + "/test/vm/bundle"
)

// The OCI runtime spec (runtime-spec 1.0.2), as much of it as a privileged pod's container uses.
type ociSpec struct {
	OCIVersion string     `json:"ociVersion"`
	Process    ociProcess `json:"process"`
	Root       ociRoot    `json:"root"`
	Hostname   string     `json:"hostname"`
	Mounts     []ociMount `json:"mounts"`
	Linux      ociLinux   `json:"linux"`
}

type ociProcess struct {
	Terminal        bool       `json:"terminal"`
	User            ociUser    `json:"user"`
	Args            []string   `json:"args"`
	Env             []string   `json:"env"`
	Cwd             string     `json:"cwd"`
	Capabilities    ociCaps    `json:"capabilities"`
	NoNewPrivileges bool       `json:"noNewPrivileges"`
	Rlimits         []ociLimit `json:"rlimits,omitempty"`
}

type ociUser struct {
	UID uint32 `json:"uid"`
	GID uint32 `json:"gid"`
}

type ociCaps struct {
	Bounding    []string `json:"bounding"`
	Effective   []string `json:"effective"`
	Permitted   []string `json:"permitted"`
	Inheritable []string `json:"inheritable"`
}

type ociLimit struct {
	Type string `json:"type"`
	Hard uint64 `json:"hard"`
	Soft uint64 `json:"soft"`
}

type ociRoot struct {
	Path     string `json:"path"`
	Readonly bool   `json:"readonly"`
}

type ociMount struct {
	Destination string   `json:"destination"`
	Type        string   `json:"type"`
	Source      string   `json:"source"`
	Options     []string `json:"options,omitempty"`
}

type ociLinux struct {
	Namespaces        []ociNamespace `json:"namespaces"`
	CgroupsPath       string         `json:"cgroupsPath"`
	Devices           []ociDevice    `json:"devices,omitempty"`
	RootfsPropagation string         `json:"rootfsPropagation"`
	MaskedPaths       []string       `json:"maskedPaths"`
	ReadonlyPaths     []string       `json:"readonlyPaths"`
}

type ociNamespace struct {
	Type string `json:"type"`
}

type ociDevice struct {
	Path  string `json:"path"`
	Type  string `json:"type"`
	Major int64  `json:"major"`
	Minor int64  `json:"minor"`
}

// capabilities is every capability of Linux 6.1 (CAP_LAST_CAP 40): a privileged container gets
// them all.
var capabilities = []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
	"CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
	"CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
	"CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
	"CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
	"CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
	"CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE"}

// The bundle's placeholders, filled in by the guest (test/vm/guest/container.sh) per container.
const (
	podDir  = "@POD_DIR@" // the "kubelet's" directory of this pod: hosts, hostname, termination log, volumes
	rootDir = "@ROOTFS@"  // the container's root: an overlay of the image's ext4 root
	// nodeName and nodeIP are what the downward API gives spec.nodeName and status.hostIP.
	nodeName = "vmtest-node"
	nodeIP   = "127.0.0.1"
)

// bundleSpec turns the driver container of ds into the OCI runtime spec that the kubelet and a
// CRI runtime (containerd's CRI plugin) would give crun, with the image's ENV from
// Dockerfile.build. It follows what they do for a privileged container: all capabilities, no
// masked or read-only paths, sysfs and cgroupfs read-write; hostPID shares the PID namespace;
// hostPath volumes are rbind mounts whose propagation is rprivate (None), rslave
// (HostToContainer) or rshared (Bidirectional, which makes the root rshared too); a ConfigMap
// subPath is a bind of the kubelet's copy of that key; mounts are sorted parents first; the
// kubelet's /etc/hosts, /etc/hostname and /dev/termination-log are bind mounts from the pod's
// directory; PATH defaults to containerd's when the image sets none.
func bundleSpec(ds *appsv1.DaemonSet, imageEnv []string) (ociSpec, error) {
	pod := ds.Spec.Template.Spec
	var ctr *corev1.Container
	for i := range pod.Containers {
		if pod.Containers[i].Name == "nvidia-driver-ctr" {
			ctr = &pod.Containers[i]
		}
	}
	if ctr == nil {
		return ociSpec{}, fmt.Errorf("no nvidia-driver-ctr container")
	}
	if ctr.SecurityContext == nil || ctr.SecurityContext.Privileged == nil || !*ctr.SecurityContext.Privileged {
		return ociSpec{}, fmt.Errorf("nvidia-driver-ctr is not privileged; this generator only knows privileged containers")
	}
	env := slices.Clone(imageEnv)
	if !slices.ContainsFunc(env, func(e string) bool { return strings.HasPrefix(e, "PATH=") }) {
		env = append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, env...)
	}
	env = append(env, "HOSTNAME="+ds.Name+"-vmtest")
	for _, e := range ctr.Env {
		v := e.Value
		if e.ValueFrom != nil {
			switch {
			case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName":
				v = nodeName
			case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.hostIP":
				v = nodeIP
			default:
				return ociSpec{}, fmt.Errorf("env %s: valueFrom %+v is not supported", e.Name, e.ValueFrom)
			}
		}
		env = slices.DeleteFunc(env, func(s string) bool { return strings.HasPrefix(s, e.Name+"=") })
		env = append(env, e.Name+"="+v)
	}

	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = v
	}
	rootProp := "rprivate"
	var vols []ociMount
	for _, m := range ctr.VolumeMounts {
		v, ok := volumes[m.Name]
		if !ok {
			return ociSpec{}, fmt.Errorf("volumeMount %s: no such volume", m.Name)
		}
		var src string
		switch {
		case v.HostPath != nil:
			src = v.HostPath.Path
		case v.ConfigMap != nil && m.SubPath != "":
			src = path.Join(podDir, "volumes", m.Name, m.SubPath)
		default:
			return ociSpec{}, fmt.Errorf("volume %s: only hostPath and ConfigMap subPath volumes are supported", m.Name)
		}
		prop := "rprivate"
		if m.MountPropagation != nil {
			switch *m.MountPropagation {
			case corev1.MountPropagationBidirectional:
				prop, rootProp = "rshared", "rshared"
			case corev1.MountPropagationHostToContainer:
				prop = "rslave"
				if rootProp != "rshared" {
					rootProp = "rslave"
				}
			}
		}
		opts := []string{"rbind", prop}
		if m.ReadOnly {
			opts = append(opts, "ro")
		}
		vols = append(vols, ociMount{Destination: m.MountPath, Type: "bind", Source: src, Options: opts})
	}
	mounts := []ociMount{
		{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
		{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "rw"}},
		{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup", Options: []string{"nosuid", "noexec", "nodev", "relatime", "rw"}},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
		{Destination: "/etc/hosts", Type: "bind", Source: podDir + "/etc-hosts", Options: []string{"rbind", "rprivate", "rw"}},
		{Destination: "/etc/hostname", Type: "bind", Source: podDir + "/hostname", Options: []string{"rbind", "rprivate", "rw"}},
		{Destination: "/dev/termination-log", Type: "bind", Source: podDir + "/termination-log", Options: []string{"rbind", "rprivate", "rw"}},
	}
	mounts = append(mounts, vols...)
	// Parents before children, as containerd orders them (stable for equal depth).
	slices.SortStableFunc(mounts, func(a, b ociMount) int {
		return strings.Count(path.Clean(a.Destination), "/") - strings.Count(path.Clean(b.Destination), "/")
	})

	ns := []ociNamespace{{"ipc"}, {"uts"}, {"mount"}, {"network"}, {"cgroup"}}
	if !pod.HostPID {
		ns = append([]ociNamespace{{"pid"}}, ns...)
	}
	return ociSpec{
		OCIVersion: "1.0.2",
		Process: ociProcess{
			User: ociUser{}, Args: append(slices.Clone(ctr.Command), ctr.Args...), Env: env, Cwd: "/",
			Capabilities: ociCaps{Bounding: capabilities, Effective: capabilities, Permitted: capabilities, Inheritable: capabilities},
			Rlimits:      []ociLimit{{Type: "RLIMIT_NOFILE", Hard: 1048576, Soft: 1048576}},
		},
		Root:     ociRoot{Path: rootDir},
		Hostname: ds.Name + "-vmtest",
		Mounts:   mounts,
		Linux: ociLinux{
			Namespaces:  ns,
			CgroupsPath: "/kubepods/" + ds.Name + "/nvidia-driver-ctr",
			// A privileged container gets the host's devices; the agent reads the kernel log.
			Devices:           []ociDevice{{Path: "/dev/kmsg", Type: "c", Major: 1, Minor: 11}},
			RootfsPropagation: rootProp,
			MaskedPaths:       []string{},
			ReadonlyPaths:     []string{},
		},
	}, nil
}

// podShell is what the guest's "kubelet" needs besides the spec, as shell variables: the
// hostPath directories to create (DirectoryOrCreate), the grace period, the startup probe
// (timing included) and the preStop hook.
func podShell(ds *appsv1.DaemonSet) string {
	pod := ds.Spec.Template.Spec
	var create []string
	for _, v := range pod.Volumes {
		if v.HostPath != nil && v.HostPath.Type != nil && *v.HostPath.Type == corev1.HostPathDirectoryOrCreate {
			create = append(create, v.HostPath.Path)
		}
	}
	grace := int64(30) // the Kubernetes default
	if pod.TerminationGracePeriodSeconds != nil {
		grace = *pod.TerminationGracePeriodSeconds
	}
	var ctr corev1.Container
	for _, c := range pod.Containers {
		if c.Name == "nvidia-driver-ctr" {
			ctr = c
		}
	}
	sp := ctr.StartupProbe
	q := func(a []string) string {
		var s []string
		for _, x := range a {
			s = append(s, "'"+strings.ReplaceAll(x, "'", `'\''`)+"'")
		}
		return strings.Join(s, " ")
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Generated by test/images (go test -run TestDriverBundle -update) from %s. Do not edit.\n", operatorDaemonSet)
	fmt.Fprintf(&b, "POD_HOSTPATH_CREATE=%q\n", strings.Join(create, " "))
	fmt.Fprintf(&b, "POD_GRACE_SECONDS=%d\n", grace)
	fmt.Fprintf(&b, "POD_STARTUP_PROBE=%q\n", q(sp.Exec.Command))
	fmt.Fprintf(&b, "POD_STARTUP_PROBE_PERIOD=%d\nPOD_STARTUP_PROBE_TIMEOUT=%d\nPOD_STARTUP_PROBE_FAILURES=%d\n", sp.PeriodSeconds, sp.TimeoutSeconds, sp.FailureThreshold)
	fmt.Fprintf(&b, "POD_PRESTOP=%q\n", q(ctr.Lifecycle.PreStop.Exec.Command))
	return b.String()
}

// TestDriverBundle checks that test/vm/bundle is what the operator's DaemonSet
// (testdata/gpu-operator-*-driver-daemonset.yaml) and Dockerfile.build's ENV make; -update
// rewrites it. The startup probe script is the one of images/standalone's ConfigMap, which
// makes the same checks and the same file as the operator's.
func TestDriverBundle(t *testing.T) {
	var ds appsv1.DaemonSet
	docs := yamlDocs(t, operatorDaemonSet)
	if len(docs) != 1 {
		t.Fatalf("%s: %d documents, want 1", operatorDaemonSet, len(docs))
	}
	if err := strictDecode(docs[0], &ds); err != nil {
		t.Fatalf("%s: %v", operatorDaemonSet, err)
	}
	d := parseDockerfile(t, "Dockerfile.build", map[string]string{"DRIVER_VERSION": "@DRIVER_VERSION@", "TARGETARCH": "amd64", "TARGETOS": "linux", "BUILDPLATFORM": "linux/amd64"})
	final, _ := d.final()
	var imageEnv []string
	for _, e := range commands[*instructions.EnvCommand](final) {
		for _, kv := range e.Env {
			imageEnv = append(imageEnv, kv.Key+"="+kv.Value)
		}
	}
	spec, err := bundleSpec(&ds, imageEnv)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	cfg = append(cfg, '\n')

	var probe string
	for _, o := range decodeAll(t) {
		if cm, ok := o.obj.(*corev1.ConfigMap); ok && o.file == "standalone/daemonset.yaml" && cm.Name == "nvidia-driver-startup-probe" {
			probe = cm.Data["startup-probe.sh"]
		}
	}
	if probe == "" {
		t.Fatal("no startup-probe.sh in images/standalone/daemonset.yaml's ConfigMap")
	}
	want := map[string][]byte{"config.json": cfg, "pod.sh": []byte(podShell(&ds)), "startup-probe.sh": []byte(probe)}
	for name, b := range want {
		file := filepath.Join(bundleDir, name)
		if *update {
			if err := os.WriteFile(file, b, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(file)
		if err != nil || !bytes.Equal(got, b) {
			t.Errorf("test/vm/bundle/%s is not what %s makes (err %v); regenerate it: cd test/images && go test -run TestDriverBundle -update", name, operatorDaemonSet, err)
		}
	}

	// What the VM's scenarios rely on.
	has := func(dst, src string, opts ...string) {
		t.Helper()
		for _, m := range spec.Mounts {
			if m.Destination == dst && m.Source == src && !slices.ContainsFunc(opts, func(o string) bool { return !slices.Contains(m.Options, o) }) {
				return
			}
		}
		t.Errorf("no mount %s -> %s with %v", src, dst, opts)
	}
	has("/run/nvidia", "/run/nvidia", "rshared")
	has("/lib/firmware", "/run/nvidia/driver/lib/firmware", "rprivate")
	has("/run/mellanox/drivers", "/run/mellanox/drivers", "rslave")
	has("/sys/module/firmware_class/parameters/path", "/sys/module/firmware_class/parameters/path")
	has("/dev/log", "/dev/log")
	has("/var/log", "/var/log")
	has("/host-etc/os-release", "/etc/os-release", "ro")
	if spec.Linux.RootfsPropagation != "rshared" {
		t.Errorf("rootfsPropagation %q, want rshared (a Bidirectional mount)", spec.Linux.RootfsPropagation)
	}
	if slices.Contains(spec.Linux.Namespaces, ociNamespace{"pid"}) {
		t.Error("a pid namespace: hostPID is true")
	}
	if !slices.Equal(spec.Process.Args, []string{"nvidia-driver", "init"}) {
		t.Errorf("args %q", spec.Process.Args)
	}
	for _, e := range []string{"NODE_NAME=" + nodeName, "KERNEL_MODULE_TYPE=auto", "DRIVER_CONFIG_DIGEST=@DRIVER_CONFIG_DIGEST@", "DRIVER_VERSION=@DRIVER_VERSION@", "NVIDIA_VISIBLE_DEVICES=void"} {
		if !slices.Contains(spec.Process.Env, e) {
			t.Errorf("env has no %s: %q", e, spec.Process.Env)
		}
	}
}
