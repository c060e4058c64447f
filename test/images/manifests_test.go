package images

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/config"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

const imagesDir = repo + "/images"

// Files in images/ that are YAML but not Kubernetes objects, and who checks them.
var otherYAML = map[string]string{
	"flatcar/values.yaml":                "helm",
	"talos/values.yaml":                  "helm",
	"monitoring/driver-agent.rules.yaml": "promtool (pkg/metrics)",
	"monitoring/alert-rules.test.yaml":   "promtool (pkg/metrics)",
}

// newObject returns an empty object of the kind a manifest declares; kinds not listed here are
// errors (add them with their Go type).
func newObject(gvk schema.GroupVersionKind) (any, bool) {
	switch gvk {
	case corev1.SchemeGroupVersion.WithKind("Namespace"):
		return &corev1.Namespace{}, true
	case corev1.SchemeGroupVersion.WithKind("ConfigMap"):
		return &corev1.ConfigMap{}, true
	case corev1.SchemeGroupVersion.WithKind("Pod"):
		return &corev1.Pod{}, true
	case corev1.SchemeGroupVersion.WithKind("Service"):
		return &corev1.Service{}, true
	case appsv1.SchemeGroupVersion.WithKind("DaemonSet"):
		return &appsv1.DaemonSet{}, true
	case monitoringv1.SchemeGroupVersion.WithKind("PodMonitor"):
		return &monitoringv1.PodMonitor{}, true
	case monitoringv1.SchemeGroupVersion.WithKind("ServiceMonitor"):
		return &monitoringv1.ServiceMonitor{}, true
	case monitoringv1.SchemeGroupVersion.WithKind("PrometheusRule"):
		return &monitoringv1.PrometheusRule{}, true
	}
	return nil, false
}

// object is one decoded manifest document.
type object struct {
	file string
	obj  any
}

// yamlDocs splits a multi-document YAML file.
func yamlDocs(t *testing.T, path string) [][]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	var docs [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) > 0 {
			docs = append(docs, doc)
		}
	}
}

func stripComments(doc []byte) []byte {
	var out [][]byte
	for l := range bytes.SplitSeq(doc, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(l), []byte("#")) {
			out = append(out, l)
		}
	}
	return bytes.Join(out, []byte("\n"))
}

// decodeAll decodes every Kubernetes manifest under images/ into its API type with unknown and
// duplicate fields rejected, and fails on YAML files it cannot classify.
func decodeAll(t *testing.T) []object {
	t.Helper()
	var objs []object
	seen := map[string]bool{}
	err := filepath.WalkDir(imagesDir, func(p string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() || (filepath.Ext(p) != ".yaml" && filepath.Ext(p) != ".yml") {
			return err
		}
		rel, _ := filepath.Rel(imagesDir, p)
		if _, ok := otherYAML[rel]; ok {
			seen[rel] = true
			return nil
		}
		for i, doc := range yamlDocs(t, p) {
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal(doc, &tm); err != nil {
				t.Errorf("%s #%d: %v", rel, i, err)
				continue
			}
			if tm.APIVersion == "" || tm.Kind == "" {
				t.Errorf("%s #%d: no apiVersion/kind; if it is not a Kubernetes object, list it in otherYAML with what checks it", rel, i)
				continue
			}
			obj, ok := newObject(tm.GroupVersionKind())
			if !ok {
				t.Errorf("%s #%d: %s is not a kind this test knows; add it to newObject", rel, i, tm.GroupVersionKind())
				continue
			}
			if err := strictDecode(doc, obj); err != nil {
				t.Errorf("%s #%d (%s): %v", rel, i, tm.Kind, err)
				continue
			}
			objs = append(objs, object{file: rel, obj: obj})
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for f := range otherYAML {
		if !seen[f] {
			t.Errorf("images/%s is listed in otherYAML but does not exist", f)
		}
	}
	return objs
}

func TestManifestsDecodeStrictly(t *testing.T) {
	objs := decodeAll(t)
	kinds := map[string]int{}
	for _, o := range objs {
		kinds[fmt.Sprintf("%T", o.obj)]++
	}
	// images/standalone and images/monitoring: at least these.
	for _, k := range []string{"*v1.DaemonSet", "*v1.ConfigMap", "*v1.Namespace", "*v1.PodMonitor", "*v1.Service", "*v1.Pod"} {
		if kinds[k] == 0 {
			t.Errorf("no %s decoded from images/ (found %v)", k, kinds)
		}
	}
}

// strictDecode decodes a YAML document the way the API server's strict decoding does: field
// names are case-sensitive, unknown and duplicate fields are errors.
func strictDecode(doc []byte, obj any) error {
	j, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	strict, err := sigsjson.UnmarshalStrict(j, obj, sigsjson.DisallowUnknownFields, sigsjson.DisallowDuplicateFields)
	return errors.Join(append(strict, err)...)
}

// Strict decoding is what catches a misspelt or misplaced field (encoding/json alone would take
// hostPid for hostPID).
func TestStrictDecodingRejects(t *testing.T) {
	for name, doc := range map[string]string{
		"case":            "apiVersion: apps/v1\nkind: DaemonSet\nspec:\n  template:\n    spec:\n      hostPid: true\n",
		"unknown field":   "apiVersion: apps/v1\nkind: DaemonSet\nspec:\n  template:\n    spec:\n      hostPIDs: true\n",
		"misplaced field": "apiVersion: apps/v1\nkind: DaemonSet\nspec:\n  hostPID: true\n",
		"duplicate field": "apiVersion: apps/v1\nkind: DaemonSet\nspec:\n  minReadySeconds: 1\n  minReadySeconds: 2\n",
	} {
		if err := strictDecode([]byte(doc), &appsv1.DaemonSet{}); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	var ds appsv1.DaemonSet
	if err := strictDecode([]byte("apiVersion: apps/v1\nkind: DaemonSet\nspec:\n  template:\n    spec:\n      hostPID: true\n"), &ds); err != nil || !ds.Spec.Template.Spec.HostPID {
		t.Errorf("a valid document: %v", err)
	}
}

// The check pod asks for one GPU and runs once.
func TestVectorAddPod(t *testing.T) {
	var found bool
	for _, o := range decodeAll(t) {
		pod, ok := o.obj.(*corev1.Pod)
		if !ok || pod.Name != "cuda-vectoradd" {
			continue
		}
		found = true
		if pod.Spec.RestartPolicy == corev1.RestartPolicyAlways || pod.Spec.RestartPolicy == "" {
			t.Errorf("restartPolicy %q: the check would run forever", pod.Spec.RestartPolicy)
		}
		if len(pod.Spec.Containers) != 1 {
			t.Fatalf("%d containers", len(pod.Spec.Containers))
		}
		if q := pod.Spec.Containers[0].Resources.Limits["nvidia.com/gpu"]; q.Value() != 1 {
			t.Errorf("limits nvidia.com/gpu=%v, want 1", q.String())
		}
	}
	if !found {
		t.Error("no cuda-vectoradd pod in images/")
	}
}

// agentConfig is the agent's configuration for a container: the image's ENV (from
// Dockerfile.build) and the container's env and args, through the agent's own parser.
func agentConfig(t *testing.T, where string, env []corev1.EnvVar, command, args []string) *config.Config {
	t.Helper()
	d := parseDockerfile(t, "Dockerfile.build", buildArgs)
	_, imageEnv := d.final()
	var environ []string
	for _, k := range []string{"DRIVER_VERSION", "NVIDIA_VISIBLE_DEVICES"} {
		environ = append(environ, k+"="+imageEnv[k])
	}
	for _, e := range env {
		v := e.Value
		if e.ValueFrom != nil {
			v = "from-" + e.Name
		}
		environ = append(environ, e.Name+"="+v)
	}
	argv := append(slices.Clone(command), args...)
	if len(argv) > 0 && (argv[0] == "nvidia-driver" || argv[0] == "driver-agent") {
		argv = argv[1:]
	}
	if len(argv) > 0 && argv[0] == "init" {
		argv = argv[1:]
	}
	c, rest, err := config.Parse("init", argv, environ, io.Discard)
	if err != nil {
		t.Fatalf("%s: the agent rejects this configuration: %v", where, err)
	}
	if len(rest) > 0 {
		t.Errorf("%s: arguments left over: %q", where, rest)
	}
	if err := c.ValidateInit(); err != nil {
		t.Errorf("%s: init would refuse to start: %v", where, err)
	}
	return c
}

// The tag scheme, as scripts/matrix checks it.
var tagRe = regexp.MustCompile(`^(?:(edge|v[0-9]+\.[0-9]+\.[0-9]+(?:-rc\.[0-9]+)?)-)?([0-9]{3}\.[0-9]+(?:\.[0-9]+)?)-(?:flatcar([0-9]+\.[0-9]\.[0-9]+)?|talos(v[0-9]+\.[0-9]+\.[0-9]+))$`)

func TestDaemonSets(t *testing.T) {
	var n int
	objs := decodeAll(t)
	for _, o := range objs {
		ds, ok := o.obj.(*appsv1.DaemonSet)
		if !ok {
			continue
		}
		n++
		t.Run(o.file+"/"+ds.Name, func(t *testing.T) { checkDaemonSet(t, o.file, ds, objs) })
	}
	if n == 0 {
		t.Fatal("no DaemonSet in images/")
	}
}

func checkDaemonSet(t *testing.T, file string, ds *appsv1.DaemonSet, objs []object) {
	spec := ds.Spec.Template.Spec
	sel, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
	if err != nil || sel.Empty() || !sel.Matches(labels.Set(ds.Spec.Template.Labels)) {
		t.Errorf("selector %v does not select the pod template's labels %v", ds.Spec.Selector, ds.Spec.Template.Labels)
	}
	if ds.Spec.UpdateStrategy.Type != appsv1.OnDeleteDaemonSetStrategyType {
		t.Errorf("updateStrategy %q: a new image must not unload a driver in use on its own; use OnDelete like the operator", ds.Spec.UpdateStrategy.Type)
	}
	if !spec.HostPID {
		t.Error("hostPID is off: the agent reaches the host through /proc/1/root")
	}
	if spec.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q", spec.PriorityClassName)
	}

	var ctr *corev1.Container
	for i := range spec.Containers {
		if spec.Containers[i].Name == "nvidia-driver-ctr" {
			ctr = &spec.Containers[i]
		}
	}
	if ctr == nil {
		t.Fatal("no container nvidia-driver-ctr (the monitoring objects and kubectl's default-container expect that name)")
	}
	if sc := ctr.SecurityContext; sc == nil || sc.Privileged == nil || !*sc.Privileged {
		t.Error("nvidia-driver-ctr is not privileged")
	}
	if tag := ctr.Image[strings.LastIndex(ctr.Image, ":")+1:]; !tagRe.MatchString(tag) {
		t.Errorf("image %s: tag %q is not in the scheme scripts/matrix checks", ctr.Image, tag)
	}
	cfg := agentConfig(t, file, ctr.Env, ctr.Command, ctr.Args)
	if got := slices.Concat(ctr.Command, ctr.Args); len(got) < 2 || got[0] != "nvidia-driver" || got[1] != "init" {
		t.Errorf("the container runs %q, want nvidia-driver init", got)
	}
	envs := map[string]string{}
	for _, e := range ctr.Env {
		envs[e.Name] = e.Value
	}
	if envs["NVIDIA_VISIBLE_DEVICES"] != "void" {
		t.Error("NVIDIA_VISIBLE_DEVICES is not void")
	}

	// The pod outlives the agent's own teardown deadline.
	grace := int64(30)
	if spec.TerminationGracePeriodSeconds != nil {
		grace = *spec.TerminationGracePeriodSeconds
	}
	if float64(grace) <= cfg.ShutdownTimeout.Seconds() {
		t.Errorf("terminationGracePeriodSeconds %d is not above the agent's shutdown deadline %s", grace, cfg.ShutdownTimeout)
	}

	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	used := map[string]bool{}
	mounts := map[string]corev1.VolumeMount{}
	for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
		for _, m := range c.VolumeMounts {
			if _, ok := volumes[m.Name]; !ok {
				t.Errorf("%s mounts volume %q, which is not defined", c.Name, m.Name)
			}
			used[m.Name] = true
		}
	}
	for name := range volumes {
		if !used[name] {
			t.Errorf("volume %q is not mounted", name)
		}
	}
	for _, m := range ctr.VolumeMounts {
		mounts[m.MountPath] = m
	}
	hostPath := func(mountPath string) string {
		m, ok := mounts[mountPath]
		if !ok {
			return ""
		}
		if hp := volumes[m.Name].HostPath; hp != nil {
			return hp.Path
		}
		return ""
	}

	// The operator's mounts, the first with Bidirectional propagation so that the root the
	// agent shares at /run/nvidia/driver reaches the host.
	if m := mounts["/run/nvidia"]; m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationBidirectional || hostPath("/run/nvidia") != "/run/nvidia" {
		t.Errorf("/run/nvidia: %+v from host %q, want the host's /run/nvidia with Bidirectional propagation", m, hostPath("/run/nvidia"))
	}
	for ctrPath, host := range map[string]string{
		"/run/nvidia-fabricmanager":                  "/run/nvidia-fabricmanager",
		"/run/nvidia-topologyd":                      "/run/nvidia-topologyd",
		"/var/log":                                   "/var/log",
		"/host-etc/os-release":                       "/etc/os-release",
		"/lib/firmware":                              "/run/nvidia/driver/lib/firmware",
		"/sys/module/firmware_class/parameters/path": "/sys/module/firmware_class/parameters/path",
		"/run/mellanox/drivers":                      "/run/mellanox/drivers",
	} {
		if got := hostPath(ctrPath); got != host {
			t.Errorf("%s is mounted from host %q, want %q", ctrPath, got, host)
		}
	}
	if !mounts["/host-etc/os-release"].ReadOnly {
		t.Error("/host-etc/os-release is writable")
	}

	// The cache is a hostPath on the node's disk, where the agent looks.
	if cfg.CacheDir == "" {
		t.Error("DRIVER_AGENT_CACHE_DIR is not set: the cache would be on tmpfs under /run")
	} else if hp := hostPath(cfg.CacheDir); hp == "" || strings.HasPrefix(hp, "/run/") {
		t.Errorf("the cache %s is not a hostPath on disk (host path %q)", cfg.CacheDir, hp)
	}

	// The operator's startup probe script, from a ConfigMap in the same file, valid sh; the
	// readiness probe on the agent's /readyz.
	sp := ctr.StartupProbe
	if sp == nil || sp.Exec == nil {
		t.Fatal("no exec startup probe")
	}
	if !slices.Equal(sp.Exec.Command, []string{"sh", "/usr/local/bin/startup-probe.sh"}) {
		t.Errorf("startup probe runs %q", sp.Exec.Command)
	}
	if budget := sp.InitialDelaySeconds + sp.PeriodSeconds*sp.FailureThreshold; budget < 20*60 {
		t.Errorf("the startup probe allows %ds; a compile needs up to 20 minutes like the operator's", budget)
	}
	probeMount := mounts["/usr/local/bin/startup-probe.sh"]
	cmName := ""
	if v := volumes[probeMount.Name]; v.ConfigMap != nil {
		cmName = v.ConfigMap.Name
	}
	script := ""
	for _, o := range objs {
		if cm, ok := o.obj.(*corev1.ConfigMap); ok && o.file == file && cm.Name == cmName && cm.Namespace == ds.Namespace {
			script = cm.Data[probeMount.SubPath]
		}
	}
	if script == "" {
		t.Fatalf("no ConfigMap %q with key %q next to the DaemonSet", cmName, probeMount.SubPath)
	}
	checkProbeScript(t, script)
	rp := ctr.ReadinessProbe
	if rp == nil || rp.HTTPGet == nil || rp.HTTPGet.Path != "/readyz" {
		t.Fatalf("readiness probe %+v, want GET /readyz", rp)
	}
	port := rp.HTTPGet.Port.String()
	for _, p := range ctr.Ports {
		if p.Name == port {
			port = fmt.Sprint(p.ContainerPort)
		}
	}
	if !strings.HasSuffix(cfg.MetricsAddress, ":"+port) {
		t.Errorf("readiness probe on port %s, the agent listens on %q", port, cfg.MetricsAddress)
	}

	ps := ctr.Lifecycle
	if ps == nil || ps.PreStop == nil || ps.PreStop.Exec == nil {
		t.Fatal("no preStop hook")
	}
	pre := strings.Join(ps.PreStop.Exec.Command, " ")
	for _, f := range []string{"/run/nvidia/validations/.driver-ctr-ready", "/run/nvidia/validations/.driver-daemons-status"} {
		if !strings.Contains(pre, f) {
			t.Errorf("preStop %q does not remove %s", pre, f)
		}
	}

	// The GSP firmware reaches the host directory the kernel reads before the driver starts.
	var fw bool
	for _, c := range spec.InitContainers {
		if strings.Contains(strings.Join(c.Command, " "), "/usr/share/driver-agent/firmware/") && c.Image == ctr.Image {
			for _, m := range c.VolumeMounts {
				fw = fw || (m.MountPath == "/lib/firmware" && m.Name == mounts["/lib/firmware"].Name)
			}
		}
	}
	if !fw {
		t.Error("no init container copies the image's firmware into the /lib/firmware hostPath")
	}
}

// checkProbeScript checks the probe with sh -n, then runs it against fake roots: not ready
// without the module, not ready while the daemons are not, ready after nvidia-smi works, and
// then it has written .driver-ctr-ready.
func checkProbeScript(t *testing.T, script string) {
	t.Helper()
	if out, err := exec.Command("sh", "-n", "-c", script).CombinedOutput(); err != nil {
		t.Fatalf("startup probe is not valid sh: %v\n%s", err, out)
	}
	for _, want := range []string{"/sys/module/nvidia/refcnt", "/run/nvidia/validations", ".driver-daemons-status", "nvidia-smi", ".driver-ctr-ready", "GPU_DIRECT_RDMA_ENABLED"} {
		if !strings.Contains(script, want) {
			t.Errorf("startup probe does not use %s", want)
		}
	}
	dir := t.TempDir()
	sys, run := filepath.Join(dir, "sys"), filepath.Join(dir, "run")
	moved := strings.ReplaceAll(strings.ReplaceAll(script, "/sys/module", sys+"/module"), "/run/nvidia", run+"/nvidia")
	log := filepath.Join(dir, "log")
	bin := fakeTools(t, log, map[string]string{"nvidia-smi": "exit 0"})
	for _, tool := range []string{"mkdir", "cat", "mktemp", "mv", "printf"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	probe := func() error {
		cmd := exec.Command("sh", "-c", moved)
		cmd.Env = []string{"PATH=" + bin, "GPU_DIRECT_RDMA_ENABLED=true"}
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}
	ready := filepath.Join(run, "nvidia/validations/.driver-ctr-ready")
	if err := probe(); err == nil {
		t.Error("probe passes without the nvidia module")
	}
	write := func(p, s string) {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(sys, "module/nvidia/refcnt"), "0\n")
	write(filepath.Join(run, "nvidia/validations/.driver-daemons-status"), "NotReady")
	if err := probe(); err == nil {
		t.Error("probe passes while the daemons are NotReady")
	}
	if _, err := os.Stat(ready); err == nil {
		t.Error(".driver-ctr-ready written before the probe passed")
	}
	write(filepath.Join(run, "nvidia/validations/.driver-daemons-status"), "Ready")
	if err := probe(); err != nil {
		t.Fatalf("probe fails on a ready node: %v", err)
	}
	b, err := os.ReadFile(ready)
	if err != nil {
		t.Fatal(err)
	}
	if want := "GDRCOPY_ENABLED: false\nGDS_ENABLED: false\nGPU_DIRECT_RDMA_ENABLED: true\n"; string(b) != want {
		t.Errorf(".driver-ctr-ready is %q, want %q", b, want)
	}
	if entries, _ := os.ReadDir(filepath.Dir(ready)); len(entries) != 2 {
		t.Errorf("temporary files left in validations: %v", entries)
	}
}
