package metrics

// Tests for the monitoring assets in images/monitoring: the alert rules pass promtool (check and
// unit tests), the PrometheusRule carries the same rules, the dashboard is valid JSON whose
// queries parse and name only metrics the agent exports, and the monitors select and scrape the
// driver pods. No YAML library is in go.mod: promtool parses the rules files for real, and
// parseYAMLSubset below reads the small block-style subset the manifests are written in (it
// rejects anything outside it rather than guessing).

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

const assetsDir = "../../images/monitoring"

// The labels a scrape by podmonitor.yaml or servicemonitor.yaml attaches to every series; the
// agent itself exports none of them.
var targetLabels = []string{"job", "instance", "namespace", "pod", "container", "node", "endpoint", "service"}

// The series Prometheus itself writes for each target.
var scrapeSeries = []string{"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_samples_post_metric_relabeling", "scrape_series_added"}

// The job the monitors give the driver pods (jobLabel: app.kubernetes.io/component).
const driverJob = "nvidia-driver"

// The agent's port: --metrics-address defaults to :9402.
const metricsPort = "9402"

func readAsset(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(assetsDir, name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// runPromtool runs promtool in dir and fails the test with its output when it fails.
func runPromtool(t *testing.T, dir string, args ...string) {
	t.Helper()
	bin, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool not found: run make deps (apt-get install prometheus)")
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// exported is what a query may name: each metric with its label names.
type exported map[string]map[string]bool

// exportedMetrics reads the agent's own metrics from testdata/agent.golden, the go_ and process_
// metrics from the collectors Registry registers, and adds the series Prometheus writes itself.
func exportedMetrics(t *testing.T) exported {
	t.Helper()
	golden, err := os.Open("testdata/agent.golden")
	if err != nil {
		t.Fatal(err)
	}
	defer golden.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(golden)
	if err != nil {
		t.Fatalf("testdata/agent.golden: %v", err)
	}
	known := exported{}
	add := func(name string, typ string, labels map[string]bool) {
		names := []string{name}
		switch typ {
		case "SUMMARY":
			names = append(names, name+"_sum", name+"_count")
			labels["quantile"] = true
		case "HISTOGRAM", "GAUGE_HISTOGRAM":
			names = append(names, name+"_sum", name+"_count", name+"_bucket")
			labels["le"] = true
		}
		for _, n := range names {
			if known[n] == nil {
				known[n] = map[string]bool{}
			}
			for l := range labels {
				known[n][l] = true
			}
		}
	}
	for name, f := range families {
		if !strings.HasPrefix(name, ns+"_") {
			t.Fatalf("testdata/agent.golden has %s, not an agent metric", name)
		}
		labels := map[string]bool{}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = true
			}
		}
		add(name, f.GetType().String(), labels)
	}
	gathered, err := Registry(NewCollector(emptySource{})).Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range gathered {
		if name := f.GetName(); strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_") {
			labels := map[string]bool{}
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					labels[l.GetName()] = true
				}
			}
			add(name, f.GetType().String(), labels)
		}
	}
	if known["process_start_time_seconds"] == nil || known["go_goroutines"] == nil {
		t.Fatal("the Go and process collectors are not registered")
	}
	for _, s := range scrapeSeries {
		add(s, "GAUGE", map[string]bool{})
	}
	return known
}

type emptySource struct{}

func (emptySource) Snapshot() Snapshot { return Snapshot{} }

// checkQuery fails unless every metric expr names is exported, every label it matches on is one
// of that metric's or a target label, and every label it groups by exists on one of its metrics.
// It returns the labels the result may carry, for legends and alert templates.
func (k exported) checkQuery(t *testing.T, where, expr string) map[string]bool {
	t.Helper()
	q, err := scanPromQL(expr)
	if err != nil {
		t.Errorf("%s: %v in %q", where, err, expr)
		return nil
	}
	if len(q.selectors) == 0 {
		t.Errorf("%s: no metric in %q", where, expr)
	}
	avail := map[string]bool{}
	for _, l := range targetLabels {
		avail[l] = true
	}
	for _, l := range q.created {
		avail[l] = true
	}
	for _, s := range q.selectors {
		labels, ok := k[s.metric]
		if !ok {
			t.Errorf("%s: %s is not exported by the agent (testdata/agent.golden, go_/process_ collectors): %q", where, s.metric, expr)
			continue
		}
		for l := range labels {
			avail[l] = true
		}
		for _, l := range s.labels {
			if !labels[l] && !slices.Contains(targetLabels, l) {
				t.Errorf("%s: %s has no label %q: %q", where, s.metric, l, expr)
			}
		}
	}
	for _, l := range q.grouping {
		if !avail[l] {
			t.Errorf("%s: no metric in the query has label %q: %q", where, l, expr)
		}
	}
	return avail
}

// TestAlertRulesPromtool: promtool accepts the rules file and its unit tests pass.
func TestAlertRulesPromtool(t *testing.T) {
	runPromtool(t, assetsDir, "check", "rules", "driver-agent.rules.yaml")
	runPromtool(t, assetsDir, "test", "rules", "alert-rules.test.yaml")
}

// TestPrometheusRuleMatchesRulesFile: alert-rules.yaml is a PrometheusRule whose spec is the
// plain rules file, indented.
func TestPrometheusRuleMatchesRulesFile(t *testing.T) {
	pr := readAsset(t, "alert-rules.yaml")
	head, spec, ok := strings.Cut(pr, "\nspec:\n")
	if !ok {
		t.Fatal("alert-rules.yaml: no top-level spec:")
	}
	docs, err := parseYAMLSubset(head + "\nspec: {}\n")
	if err != nil || len(docs) != 1 {
		t.Fatalf("alert-rules.yaml: %v (%d documents)", err, len(docs))
	}
	expectFields(t, "alert-rules.yaml", docs[0], map[string]string{
		"apiVersion":         "monitoring.coreos.com/v1",
		"kind":               "PrometheusRule",
		"metadata.namespace": "gpu-operator",
	})
	var unindented []string
	for i, line := range strings.Split(spec, "\n") {
		if line != "" && !strings.HasPrefix(line, "  ") {
			t.Fatalf("alert-rules.yaml: spec line %d is not indented: %q", i+1, line)
		}
		unindented = append(unindented, strings.TrimPrefix(line, "  "))
	}
	rules := readAsset(t, "driver-agent.rules.yaml")
	i := strings.Index(rules, "\ngroups:\n")
	if i < 0 {
		t.Fatal("driver-agent.rules.yaml: no top-level groups:")
	}
	if got, want := strings.Join(unindented, "\n"), rules[i+1:]; got != want {
		t.Errorf("alert-rules.yaml's spec differs from driver-agent.rules.yaml's groups; regenerate it:\n" +
			"  sed -n '/^groups:/,$p' driver-agent.rules.yaml | sed 's/^\\(.\\)/  \\1/'")
	}
}

// TestAlertRulesReferenceExportedMetrics: every alert expression names only exported metrics and
// labels, templates use labels the expression keeps, and the alerts the issue asks for exist.
func TestAlertRulesReferenceExportedMetrics(t *testing.T) {
	known := exportedMetrics(t)
	docs, err := parseYAMLSubset(readAsset(t, "driver-agent.rules.yaml"))
	if err != nil || len(docs) != 1 {
		t.Fatalf("driver-agent.rules.yaml: %v (%d documents)", err, len(docs))
	}
	alerts := map[string]bool{}
	templateLabel := regexp.MustCompile(`\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)`)
	metricInTemplate := regexp.MustCompile(`\b(driver_agent_[a-z0-9_]+|go_[a-z0-9_]+|process_[a-z0-9_]+)`)
	groups, _ := yget(docs[0], "groups").([]any)
	if len(groups) == 0 {
		t.Fatal("driver-agent.rules.yaml: no groups")
	}
	for _, g := range groups {
		rules, _ := yget(g, "rules").([]any)
		for _, r := range rules {
			name, _ := yget(r, "alert").(string)
			if name == "" {
				name, _ = yget(r, "record").(string)
			}
			expr, _ := yget(r, "expr").(string)
			if name == "" || expr == "" {
				t.Errorf("rule without name or expr: %v", r)
				continue
			}
			alerts[name] = true
			avail := known.checkQuery(t, name, expr)
			if q, _ := scanPromQL(expr); q != nil {
				for _, s := range q.selectors {
					if !strings.HasPrefix(s.metric, ns+"_") && !slices.Contains(s.matchers, `job="`+driverJob+`"`) {
						t.Errorf("%s: %s is not only the agent's; select it with job=%q: %q", name, s.metric, driverJob, expr)
					}
				}
			}
			for _, key := range []string{"labels", "annotations"} {
				m, _ := yget(r, key).(map[string]any)
				for field, v := range m {
					text, _ := v.(string)
					for _, l := range templateLabel.FindAllStringSubmatch(text, -1) {
						if avail != nil && !avail[l[1]] {
							t.Errorf("%s: %s.%s uses $labels.%s, which the expression does not keep", name, key, field, l[1])
						}
					}
					for _, mm := range metricInTemplate.FindAllString(text, -1) {
						if known[mm] == nil {
							t.Errorf("%s: %s.%s names %s, which is not exported", name, key, field, mm)
						}
					}
				}
			}
			if _, ok := yget(r, "labels", "severity").(string); strings.HasPrefix(name, "Nvidia") && !ok {
				t.Errorf("%s: no severity label", name)
			}
		}
	}
	for _, want := range []string{"NvidiaDriverNotReady", "NvidiaDriverDaemonDown", "NvidiaDriverDaemonRestarting",
		"NvidiaDriverInUseAtLastShutdown", "NvidiaDriverAgentErrors", "NvidiaDriverPreviousRunFailed",
		"NvidiaDriverAgentRestarting", "NvidiaDriverAgentDown"} {
		if !alerts[want] {
			t.Errorf("alert %s is missing", want)
		}
	}
}

// grafanaVar is a dashboard variable in a query: $name, ${name} or ${name:format}.
var grafanaVar = regexp.MustCompile(`\$(?:\{([A-Za-z0-9_]+)(?::[a-z]+)?\}|([A-Za-z0-9_]+))`)

// TestDashboard: the dashboard is valid JSON for import (a ${DS_PROMETHEUS} input, no fixed
// data source), its panels are laid out, every query parses (promtool) and names only exported
// metrics and labels, and every agent metric has a panel.
func TestDashboard(t *testing.T) {
	known := exportedMetrics(t)
	raw := readAsset(t, "grafana-dashboard.json")
	var dash map[string]any
	if err := json.Unmarshal([]byte(raw), &dash); err != nil {
		t.Fatalf("grafana-dashboard.json: %v", err)
	}
	for _, key := range []string{"title", "uid"} {
		if s, _ := dash[key].(string); s == "" {
			t.Errorf("dashboard has no %s", key)
		}
	}
	if v, _ := dash["schemaVersion"].(float64); v < 36 {
		t.Errorf("schemaVersion %v: want a Grafana 9+ dashboard", dash["schemaVersion"])
	}
	inputs, _ := dash["__inputs"].([]any)
	if len(inputs) != 1 || yget(inputs[0], "name") != "DS_PROMETHEUS" || yget(inputs[0], "pluginId") != "prometheus" {
		t.Errorf("__inputs = %v, want one Prometheus data source named DS_PROMETHEUS", inputs)
	}
	if dash["id"] != nil {
		t.Errorf("dashboard id = %v, want null (Grafana assigns it)", dash["id"])
	}

	// Every data source reference is the input, never a fixed uid.
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case map[string]any:
			if ds, ok := v["datasource"]; ok && !strings.HasPrefix(path, "annotations") {
				uid, _ := yget(ds, "uid").(string)
				if uid != "${DS_PROMETHEUS}" {
					t.Errorf("%s: datasource %v, want uid ${DS_PROMETHEUS}", path, ds)
				}
			}
			for k, c := range v {
				walk(path+"."+k, c)
			}
		case []any:
			for i, c := range v {
				walk(fmt.Sprintf("%s[%d]", path, i), c)
			}
		}
	}
	for k, v := range dash {
		if k != "templating" {
			walk(k, v)
		}
	}
	dsVariable := false
	tlist, _ := yget(dash, "templating", "list").([]any)
	for i, v := range tlist {
		if yget(v, "type") == "datasource" { // the DS_PROMETHEUS variable itself picks the data source
			dsVariable = dsVariable || yget(v, "name") == "DS_PROMETHEUS" && yget(v, "query") == "prometheus"
			continue
		}
		walk(fmt.Sprintf("templating.list[%d]", i), v)
	}
	if !dsVariable {
		t.Error("no DS_PROMETHEUS data source variable: a provisioned dashboard (no import inputs) would have no data source")
	}

	// Variables: what a query may use besides Grafana's own.
	vars := map[string]string{"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
	type query struct{ where, expr, legend string }
	var queries []query
	templating, _ := yget(dash, "templating", "list").([]any)
	labelValues := regexp.MustCompile(`^label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$`)
	for _, v := range templating {
		name, _ := yget(v, "name").(string)
		vars[name] = ".*"
		if yget(v, "type") != "query" {
			continue
		}
		q, _ := yget(v, "query", "query").(string)
		if q == "" {
			q, _ = yget(v, "query").(string)
		}
		m := labelValues.FindStringSubmatch(q)
		if m == nil {
			t.Errorf("variable %s: query %q, want label_values(<selector>, <label>)", name, q)
			continue
		}
		queries = append(queries, query{where: "variable " + name, expr: m[1], legend: "{{" + m[2] + "}}"})
	}
	if vars["node"] == "" || vars["DS_PROMETHEUS"] == "" {
		t.Error("dashboard variables: want DS_PROMETHEUS (data source) and node")
	}
	substitute := func(where, s string) string {
		return grafanaVar.ReplaceAllStringFunc(s, func(m string) string {
			sub := grafanaVar.FindStringSubmatch(m)
			name := sub[1] + sub[2]
			if val, ok := vars[name]; ok {
				return val
			}
			t.Errorf("%s: unknown variable %s in %q", where, m, s)
			return m
		})
	}

	// Panels: unique ids, a grid position inside 24 columns, queries.
	ids := map[float64]bool{}
	var collect func(panels []any)
	collect = func(panels []any) {
		for _, p := range panels {
			id, _ := yget(p, "id").(float64)
			title, _ := yget(p, "title").(string)
			where := fmt.Sprintf("panel %q", title)
			if id == 0 || ids[id] {
				t.Errorf("%s: id %v missing or not unique", where, yget(p, "id"))
			}
			ids[id] = true
			x, _ := yget(p, "gridPos", "x").(float64)
			w, _ := yget(p, "gridPos", "w").(float64)
			h, _ := yget(p, "gridPos", "h").(float64)
			if w <= 0 || h <= 0 || x+w > 24 {
				t.Errorf("%s: gridPos %v", where, yget(p, "gridPos"))
			}
			kind, _ := yget(p, "type").(string)
			targets, _ := yget(p, "targets").([]any)
			if kind != "row" && len(targets) == 0 {
				t.Errorf("%s: no queries", where)
			}
			refs := map[string]bool{}
			for _, tg := range targets {
				expr, _ := yget(tg, "expr").(string)
				ref, _ := yget(tg, "refId").(string)
				legend, _ := yget(tg, "legendFormat").(string)
				if expr == "" || ref == "" || refs[ref] {
					t.Errorf("%s: query %v: no expr, or refId missing or repeated", where, tg)
				}
				refs[ref] = true
				queries = append(queries, query{where: where + " " + ref, expr: expr, legend: legend})
			}
			if sub, _ := yget(p, "panels").([]any); len(sub) > 0 {
				collect(sub)
			}
		}
	}
	panels, _ := dash["panels"].([]any)
	if len(panels) < 10 {
		t.Fatalf("dashboard has %d panels", len(panels))
	}
	collect(panels)

	legendLabel := regexp.MustCompile(`\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}`)
	used := map[string]bool{}
	seen := map[string]bool{}
	var rules strings.Builder
	rules.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	for _, q := range queries {
		expr := substitute(q.where, q.expr)
		avail := known.checkQuery(t, q.where, expr)
		for _, l := range legendLabel.FindAllStringSubmatch(q.legend, -1) {
			if avail != nil && !avail[l[1]] {
				t.Errorf("%s: legend %q uses %s, which the query does not keep", q.where, q.legend, l[1])
			}
		}
		if s, err := scanPromQL(expr); err == nil {
			for _, sel := range s.selectors {
				used[sel.metric] = true
			}
		}
		if !seen[expr] {
			seen[expr] = true
			quoted, _ := json.Marshal(expr)
			fmt.Fprintf(&rules, "      - record: dashboard:query_%d\n        expr: %s\n", len(seen), quoted)
		}
	}
	// promtool parses every query (as a recording rule).
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "dashboard.rules.yaml"), []byte(rules.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	runPromtool(t, dir, "check", "rules", "dashboard.rules.yaml")

	var missing []string
	for name := range known {
		if strings.HasPrefix(name, ns+"_") && !used[name] {
			missing = append(missing, name)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("no dashboard panel shows %v: add one to images/monitoring/grafana-dashboard.json", missing)
	}
}

// TestMonitorManifests: the PodMonitor, Service and ServiceMonitor select the driver pods in the
// gpu-operator namespace, scrape port 9402 (the PodMonitor without a declared container port)
// and label the series with job="nvidia-driver" and the node.
func TestMonitorManifests(t *testing.T) {
	parse := func(name string) any {
		docs, err := parseYAMLSubset(readAsset(t, name))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if len(docs) != 1 {
			t.Fatalf("%s: %d documents, want 1", name, len(docs))
		}
		return docs[0]
	}
	const component = "app.kubernetes.io/component"

	pm := parse("podmonitor.yaml")
	expectFields(t, "podmonitor.yaml", pm, map[string]string{
		"apiVersion":         "monitoring.coreos.com/v1",
		"kind":               "PodMonitor",
		"metadata.namespace": "gpu-operator",
		"spec.jobLabel":      component,
	})
	expectSelector(t, "podmonitor.yaml", pm, component, driverJob)
	eps, _ := yget(pm, "spec", "podMetricsEndpoints").([]any)
	if len(eps) != 1 {
		t.Fatalf("podmonitor.yaml: %d podMetricsEndpoints, want 1", len(eps))
	}
	for _, f := range []string{"port", "portNumber", "targetPort"} {
		if yget(eps[0], f) != nil {
			t.Errorf("podmonitor.yaml: %s keeps only pods that declare the port, and the gpu-operator declares none", f)
		}
	}
	if yget(eps[0], "path") != "/metrics" {
		t.Errorf("podmonitor.yaml: path %v", yget(eps[0], "path"))
	}
	relabelings, _ := yget(eps[0], "relabelings").([]any)
	var keepsDriver, address, v6, node bool
	for _, r := range relabelings {
		src := fmt.Sprint(yget(r, "sourceLabels"))
		action, _ := yget(r, "action").(string)
		target, _ := yget(r, "targetLabel").(string)
		repl, _ := yget(r, "replacement").(string)
		switch {
		case action == "keep" && src == "[__meta_kubernetes_pod_container_name]":
			keepsDriver = yget(r, "regex") == "nvidia-driver-ctr"
		case target == "__address__" && src == "[__meta_kubernetes_pod_ip]":
			address = address || repl == "${1}:"+metricsPort
			v6 = v6 || repl == "[${1}]:"+metricsPort
		case target == "node":
			node = src == "[__meta_kubernetes_pod_node_name]"
		}
	}
	if !keepsDriver || !address || !v6 || !node {
		t.Errorf("podmonitor.yaml relabelings: keep nvidia-driver-ctr %v, <pod IP>:%s %v (IPv6 %v), node label %v",
			keepsDriver, metricsPort, address, v6, node)
	}

	svc := parse("service.yaml")
	expectFields(t, "service.yaml", svc, map[string]string{
		"apiVersion":                    "v1",
		"kind":                          "Service",
		"metadata.namespace":            "gpu-operator",
		"spec.clusterIP":                "None",
		"spec.publishNotReadyAddresses": "true",
		"spec.selector." + component:    driverJob,
	})
	ports, _ := yget(svc, "spec", "ports").([]any)
	if len(ports) != 1 || yget(ports[0], "port") != metricsPort || yget(ports[0], "targetPort") != metricsPort {
		t.Fatalf("service.yaml: ports %v, want one on %s", ports, metricsPort)
	}
	portName, _ := yget(ports[0], "name").(string)

	sm := parse("servicemonitor.yaml")
	expectFields(t, "servicemonitor.yaml", sm, map[string]string{
		"apiVersion":         "monitoring.coreos.com/v1",
		"kind":               "ServiceMonitor",
		"metadata.namespace": "gpu-operator",
		"spec.jobLabel":      component,
	})
	if got := fmt.Sprint(yget(sm, "spec", "namespaceSelector", "matchNames")); got != "[gpu-operator]" {
		t.Errorf("servicemonitor.yaml: namespaceSelector %s", got)
	}
	jobLabel, _ := yget(sm, "spec", "jobLabel").(string)
	if yget(svc, "metadata", "labels", jobLabel) != driverJob {
		t.Errorf("service.yaml: label %s must be %q (the ServiceMonitor's jobLabel)", jobLabel, driverJob)
	}
	sel, _ := yget(sm, "spec", "selector", "matchLabels").(map[string]any)
	if len(sel) == 0 {
		t.Error("servicemonitor.yaml: no selector")
	}
	for k, v := range sel {
		if yget(svc, "metadata", "labels", k) != v {
			t.Errorf("servicemonitor.yaml selects %s=%v, which service.yaml does not carry", k, v)
		}
	}
	smEps, _ := yget(sm, "spec", "endpoints").([]any)
	if len(smEps) != 1 || yget(smEps[0], "port") != portName || yget(smEps[0], "path") != "/metrics" {
		t.Errorf("servicemonitor.yaml: endpoints %v, want port %q path /metrics", smEps, portName)
	} else {
		node = false
		smRelabelings, _ := yget(smEps[0], "relabelings").([]any)
		for _, r := range smRelabelings {
			node = node || yget(r, "targetLabel") == "node" && fmt.Sprint(yget(r, "sourceLabels")) == "[__meta_kubernetes_pod_node_name]"
		}
		if !node {
			t.Error("servicemonitor.yaml: no node label from __meta_kubernetes_pod_node_name")
		}
	}
}

func expectFields(t *testing.T, file string, doc any, want map[string]string) {
	t.Helper()
	for path, w := range want {
		var keys []string
		// Label keys contain dots: "spec.selector.app.kubernetes.io/component" splits after selector.
		if i := strings.Index(path, "app.kubernetes.io/"); i > 0 {
			keys = append(strings.Split(path[:i-1], "."), path[i:])
		} else {
			keys = strings.Split(path, ".")
		}
		if got := yget(doc, keys...); got != w {
			t.Errorf("%s: %s = %v, want %q", file, path, got, w)
		}
	}
}

func expectSelector(t *testing.T, file string, doc any, key, value string) {
	t.Helper()
	if got := yget(doc, "spec", "selector", "matchLabels", key); got != value {
		t.Errorf("%s: selector %s = %v, want %q", file, key, got, value)
	}
	if got := fmt.Sprint(yget(doc, "spec", "namespaceSelector", "matchNames")); got != "[gpu-operator]" {
		t.Errorf("%s: namespaceSelector %s, want [gpu-operator]", file, got)
	}
}

// yget walks maps by key; nil where a key is missing.
func yget(v any, keys ...string) any {
	for _, k := range keys {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

// ---- PromQL: the names a query uses. promtool checks the syntax; this only finds the names.

type promSelector struct {
	metric   string
	labels   []string // label names it matches on
	matchers []string // e.g. job="nvidia-driver", spaces removed
}

type promQuery struct {
	selectors []promSelector
	grouping  []string // by, without, on, ignoring, group_left, group_right
	created   []string // label_replace / label_join destinations
}

var promKeywords = map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true,
	"inf": true, "nan": true, "atan2": true}
var promAggregators = map[string]bool{"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true,
	"stdvar": true, "count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true, "limitk": true, "limit_ratio": true}
var promGrouping = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true}

type promToken struct {
	kind byte // i identifier, s string, n number, r range/subquery, p punctuation
	text string
}

func lexPromQL(expr string) ([]promToken, error) {
	var toks []promToken
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	isIdent := func(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == '#':
			for i < len(expr) && expr[i] != '\n' {
				i++
			}
		case c == '"' || c == '\'' || c == '`':
			j := i + 1
			for j < len(expr) && expr[j] != c {
				if expr[j] == '\\' && c != '`' {
					j++
				}
				j++
			}
			if j >= len(expr) {
				return nil, fmt.Errorf("unterminated string at %d", i)
			}
			s := expr[i+1 : j]
			if c != '`' {
				if u, err := strconv.Unquote(`"` + strings.ReplaceAll(s, `"`, `\"`) + `"`); err == nil {
					s = u
				}
			}
			toks = append(toks, promToken{'s', s})
			i = j + 1
		case c >= '0' && c <= '9' || c == '.' && i+1 < len(expr) && expr[i+1] >= '0' && expr[i+1] <= '9':
			j := i
			for j < len(expr) && (isIdent(expr[j]) || expr[j] == '.') {
				j++
			}
			toks = append(toks, promToken{'n', expr[i:j]})
			i = j
		case isIdentStart(c):
			j := i
			for j < len(expr) && isIdent(expr[j]) {
				j++
			}
			toks = append(toks, promToken{'i', expr[i:j]})
			i = j
		case c == '[':
			j := strings.IndexByte(expr[i:], ']')
			if j < 0 {
				return nil, fmt.Errorf("unterminated [ at %d", i)
			}
			toks = append(toks, promToken{'r', expr[i : i+j+1]})
			i += j + 1
		default:
			toks = append(toks, promToken{'p', string(c)})
			i++
		}
	}
	return toks, nil
}

func scanPromQL(expr string) (*promQuery, error) {
	toks, err := lexPromQL(expr)
	if err != nil {
		return nil, err
	}
	q := &promQuery{}
	next := func(i int) promToken {
		if i < len(toks) {
			return toks[i]
		}
		return promToken{}
	}
	// matchers reads {name op "value", ...} from toks[i] == "{"; it returns the index after "}".
	matchers := func(i int, sel *promSelector) (int, error) {
		for i++; i < len(toks); i++ {
			tk := toks[i]
			switch {
			case tk.kind == 'p' && tk.text == "}":
				return i + 1, nil
			case tk.kind == 'p' && tk.text == ",":
			case tk.kind == 'i':
				op := ""
				j := i + 1
				for ; next(j).kind == 'p' && strings.Contains("=!~", next(j).text); j++ {
					op += next(j).text
				}
				if next(j).kind != 's' || op == "" {
					return 0, fmt.Errorf("bad matcher after %s", tk.text)
				}
				if tk.text == "__name__" {
					return 0, fmt.Errorf("select metrics by name, not __name__")
				}
				sel.labels = append(sel.labels, tk.text)
				sel.matchers = append(sel.matchers, tk.text+op+strconv.Quote(next(j).text))
				i = j
			default:
				return 0, fmt.Errorf("unexpected %q in a selector", tk.text)
			}
		}
		return 0, fmt.Errorf("unterminated selector")
	}
	for i := 0; i < len(toks); {
		tk := toks[i]
		switch {
		case tk.kind == 'i' && promGrouping[tk.text]:
			i++
			if next(i).text != "(" {
				continue // group_left without labels
			}
			for i++; i < len(toks) && toks[i].text != ")"; i++ {
				if toks[i].kind == 'i' {
					q.grouping = append(q.grouping, toks[i].text)
				}
			}
			i++
		case tk.kind == 'i' && promKeywords[strings.ToLower(tk.text)]:
			i++
		case tk.kind == 'i' && (next(i+1).text == "(" || promAggregators[tk.text] && promGrouping[next(i+1).text]):
			if tk.text == "label_replace" || tk.text == "label_join" {
				// The destination is the first string argument at the call's own depth.
				depth := 0
				for j := i + 1; j < len(toks); j++ {
					if toks[j].text == "(" {
						depth++
					} else if toks[j].text == ")" {
						depth--
					} else if depth == 1 && toks[j].kind == 's' {
						q.created = append(q.created, toks[j].text)
						break
					}
				}
			}
			i++
		case tk.kind == 'i':
			sel := promSelector{metric: tk.text}
			i++
			if next(i).text == "{" {
				if i, err = matchers(i, &sel); err != nil {
					return nil, err
				}
			}
			q.selectors = append(q.selectors, sel)
		case tk.kind == 'p' && tk.text == "{":
			return nil, fmt.Errorf("a selector without a metric name")
		default:
			i++
		}
	}
	return q, nil
}

func TestScanPromQL(t *testing.T) {
	q, err := scanPromQL(`sum by (node, phase) (increase(driver_agent_errors_total{job=~"$job", phase!="x"}[5m] offset 1h))
		/ on (node) group_left (version) label_replace(go_info, "ver", "$1", "version", "(.*)") > bool 0.5e1 # comment x_total`)
	if err != nil {
		t.Fatal(err)
	}
	got := fmt.Sprint(q.selectors, q.grouping, q.created)
	want := `[{driver_agent_errors_total [job phase] [job=~"$job" phase!="x"]} {go_info [] []}] [node phase node version] [ver]`
	if got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
	for _, bad := range []string{`{__name__="up"}`, `up{job="x"`, `up{job}`, `up{job="x}`} {
		if _, err := scanPromQL(bad); err == nil {
			t.Errorf("scanPromQL(%q) accepted", bad)
		}
	}
}

// ---- A YAML subset: block mappings and sequences, plain and quoted scalars, empty or simple
// flow collections ([], {}, [a, "b"]), block scalars (|, |-, >, >-), comments and ---. Scalars
// stay strings. Anchors, tags, multi-line plain scalars, nested flow collections and tabs are
// errors, as are duplicate keys and stray indentation.

type yamlParser struct {
	lines []string
	i     int
}

func parseYAMLSubset(src string) ([]any, error) {
	var docs []any
	var cur []string
	flush := func() error {
		p := &yamlParser{lines: cur}
		if _, _, ok := p.peek(); ok {
			indent, _, _ := p.peek()
			v, err := p.node(indent)
			if err != nil {
				return err
			}
			if _, text, ok := p.peek(); ok {
				return fmt.Errorf("line %q: unexpected indentation", text)
			}
			docs = append(docs, v)
		}
		cur = nil
		return nil
	}
	for _, line := range strings.Split(strings.ReplaceAll(src, "\r\n", "\n"), "\n") {
		if line == "---" || strings.HasPrefix(line, "--- ") {
			if err := flush(); err != nil {
				return nil, err
			}
			continue
		}
		cur = append(cur, line)
	}
	if err := flush(); err != nil {
		return nil, err
	}
	return docs, nil
}

// stripComment drops a # comment that starts the line or follows a space, outside quotes.
func stripComment(s string) string {
	var quote byte
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case quote != 0:
			if c == quote {
				quote = 0
			} else if c == '\\' && quote == '"' {
				i++
			}
		case c == '"' || c == '\'':
			if i == 0 || s[i-1] == ' ' || s[i-1] == '[' || s[i-1] == ',' {
				quote = c
			}
		case c == '#' && (i == 0 || s[i-1] == ' '):
			return strings.TrimRight(s[:i], " ")
		}
	}
	return strings.TrimRight(s, " ")
}

// peek returns the next line with content (comments and blanks skipped, the position moved to it).
func (p *yamlParser) peek() (indent int, text string, ok bool) {
	for ; p.i < len(p.lines); p.i++ {
		line := p.lines[p.i]
		content := strings.TrimLeft(line, " ")
		if strings.HasPrefix(content, "\t") {
			return 0, line, true // node() reports it
		}
		if c := stripComment(content); c != "" {
			return len(line) - len(content), c, true
		}
	}
	return 0, "", false
}

func (p *yamlParser) node(indent int) (any, error) {
	_, text, _ := p.peek()
	if strings.HasPrefix(strings.TrimLeft(text, " "), "\t") {
		return nil, fmt.Errorf("line %q: tab in indentation", text)
	}
	if text == "-" || strings.HasPrefix(text, "- ") {
		return p.seq(indent)
	}
	if _, _, ok := splitKey(text); ok {
		return p.mapping(indent)
	}
	p.i++
	return yamlScalar(text)
}

func (p *yamlParser) seq(indent int) (any, error) {
	out := []any{}
	for {
		in, text, ok := p.peek()
		isItem := text == "-" || strings.HasPrefix(text, "- ")
		if !ok || in < indent || in == indent && !isItem {
			return out, nil // the caller checks what follows
		}
		if in > indent {
			return nil, fmt.Errorf("line %q: unexpected indentation", text)
		}
		rest := strings.TrimLeft(strings.TrimPrefix(text, "-"), " ")
		if rest == "" {
			p.i++
			if in2, _, ok := p.peek(); !ok || in2 <= indent {
				out = append(out, nil)
				continue
			}
			in2, _, _ := p.peek()
			v, err := p.node(in2)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
			continue
		}
		if _, _, ok := splitKey(rest); ok || rest == "-" || strings.HasPrefix(rest, "- ") {
			// "- key: value": the mapping continues at the column of key.
			col := indent + len(text) - len(rest)
			p.lines[p.i] = strings.Repeat(" ", col) + rest
			v, err := p.node(col)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
			continue
		}
		if strings.HasPrefix(rest, "|") || strings.HasPrefix(rest, ">") {
			return nil, fmt.Errorf("line %q: block scalar as a sequence item is not supported", text)
		}
		p.i++
		v, err := yamlScalar(rest)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
}

func (p *yamlParser) mapping(indent int) (any, error) {
	out := map[string]any{}
	for {
		in, text, ok := p.peek()
		if !ok || in < indent {
			return out, nil
		}
		key, value, isKey := splitKey(text)
		if in > indent || !isKey || text == "-" || strings.HasPrefix(text, "- ") {
			return nil, fmt.Errorf("line %q: unexpected indentation or not a key", text)
		}
		if _, dup := out[key]; dup {
			return nil, fmt.Errorf("duplicate key %q", key)
		}
		p.i++
		switch {
		case value == "":
			in2, text2, ok := p.peek()
			switch {
			case ok && in2 > indent:
				v, err := p.node(in2)
				if err != nil {
					return nil, err
				}
				out[key] = v
			case ok && in2 == indent && (text2 == "-" || strings.HasPrefix(text2, "- ")):
				v, err := p.seq(indent)
				if err != nil {
					return nil, err
				}
				out[key] = v
			default:
				out[key] = nil
			}
		case value[0] == '|' || value[0] == '>':
			v, err := p.blockScalar(indent, value)
			if err != nil {
				return nil, err
			}
			out[key] = v
		default:
			v, err := yamlScalar(value)
			if err != nil {
				return nil, fmt.Errorf("key %q: %w", key, err)
			}
			out[key] = v
		}
	}
}

// blockScalar reads the lines of a | or > scalar under a key at indent.
func (p *yamlParser) blockScalar(indent int, header string) (string, error) {
	chomp := strings.TrimLeft(header[1:], " ")
	if chomp != "" && chomp != "-" {
		return "", fmt.Errorf("block scalar header %q is not supported", header)
	}
	var lines []string
	block := -1
	for ; p.i < len(p.lines); p.i++ {
		line := p.lines[p.i]
		content := strings.TrimLeft(line, " ")
		if content == "" {
			lines = append(lines, "")
			continue
		}
		in := len(line) - len(content)
		if block < 0 {
			block = in
		}
		if in <= indent || in < block {
			break
		}
		lines = append(lines, line[block:])
	}
	for len(lines) > 0 && lines[len(lines)-1] == "" {
		lines = lines[:len(lines)-1]
	}
	if block < 0 || len(lines) == 0 {
		return "", fmt.Errorf("empty block scalar")
	}
	var s string
	if header[0] == '|' {
		s = strings.Join(lines, "\n")
	} else {
		var b strings.Builder
		for i, l := range lines {
			switch {
			case i == 0:
			case l == "" || lines[i-1] == "":
				b.WriteString("\n")
			default:
				b.WriteString(" ")
			}
			b.WriteString(l)
		}
		s = b.String()
	}
	if chomp == "" {
		s += "\n"
	}
	return s, nil
}

// splitKey splits "key: value" or "key:" (the key plain or quoted).
func splitKey(s string) (key, value string, ok bool) {
	if s == "" || s[0] == '[' || s[0] == '{' {
		return "", "", false
	}
	if s[0] == '"' || s[0] == '\'' {
		end := strings.IndexByte(s[1:], s[0])
		if end < 0 || !strings.HasPrefix(s[end+2:], ":") {
			return "", "", false
		}
		k, err := yamlScalar(s[:end+2])
		rest := s[end+3:]
		if err != nil || rest != "" && rest[0] != ' ' {
			return "", "", false
		}
		return k.(string), strings.TrimSpace(rest), true
	}
	for i := 0; i < len(s); i++ {
		if s[i] == ':' && (i+1 == len(s) || s[i+1] == ' ') {
			return s[:i], strings.TrimSpace(s[i+1:]), true
		}
	}
	return "", "", false
}

func yamlScalar(s string) (any, error) {
	switch {
	case s == "[]":
		return []any{}, nil
	case s == "{}":
		return map[string]any{}, nil
	case s[0] == '"':
		if len(s) < 2 || s[len(s)-1] != '"' {
			return nil, fmt.Errorf("bad double-quoted scalar %s", s)
		}
		return strconv.Unquote(s)
	case s[0] == '\'':
		if len(s) < 2 || s[len(s)-1] != '\'' || strings.Contains(strings.ReplaceAll(s[1:len(s)-1], "''", ""), "'") {
			return nil, fmt.Errorf("bad single-quoted scalar %s", s)
		}
		return strings.ReplaceAll(s[1:len(s)-1], "''", "'"), nil
	case s[0] == '[' && s[len(s)-1] == ']':
		out := []any{}
		for _, item := range strings.Split(s[1:len(s)-1], ",") {
			item = strings.TrimSpace(item)
			if item == "" || strings.ContainsAny(item, "[]{},") {
				return nil, fmt.Errorf("flow sequence %s is not supported", s)
			}
			v, err := yamlScalar(item)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
		}
		return out, nil
	case strings.ContainsRune("[]{}&*!|>%@`", rune(s[0])):
		return nil, fmt.Errorf("scalar %s: not in the supported YAML subset", s)
	case strings.Contains(s, ": ") || strings.HasSuffix(s, ":"):
		return nil, fmt.Errorf("plain scalar %q contains ': '", s)
	}
	return s, nil
}

func TestYAMLSubset(t *testing.T) {
	docs, err := parseYAMLSubset(`# c
a: 1 # c
b:
  - x
  - "y: #z"
  - k: v
    l: 'it''s'
  -
    m: n
c:
- p
d: |
  one
    two

  three
e: >-
  folded
  line
f: []
---
g: {}
`)
	if err != nil {
		t.Fatal(err)
	}
	got := fmt.Sprint(docs)
	want := "[map[a:1 b:[x y: #z map[k:v l:it's] map[m:n]] c:[p] d:one\n  two\n\nthree\n e:folded line f:[]] map[g:map[]]]"
	if got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
	for _, bad := range []string{"a: 1\na: 2", "a:\n  b: 1\n c: 2", "a: &x 1", "a: b: c", "a:\n\t- 1", "- a\nb: c", "a: [x, [y]]", `a: "x`} {
		if _, err := parseYAMLSubset(bad); err == nil {
			t.Errorf("parseYAMLSubset(%q) accepted", bad)
		}
	}
}
