//go:build vmtest && vmbench

package vm

import (
	"fmt"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestVMBench prints the figures of `make vm-bench`; it is a measurement, not a test: it fails
// only when the bench boot does not complete, never on a time. One boot runs guest/bench.sh's
// "bench" scenario: VMTEST_BENCH_RUNS (DRIVER_AGENT_VM_BENCH_RUNS, default 7) rounds of the
// agent's precompiled path (empty cache, so it links), the same from the cache, and busybox
// scripts doing only the same insmods and mknods (script-min), and also the link, firmware path,
// daemon and mount (script-full). DRIVER_AGENT_VM_BENCH_KERNEL=6.12 runs it on the second kernel.
func TestVMBench(t *testing.T) {
	kernels, err := findKernels()
	if err != nil {
		t.Fatal(err)
	}
	tl := kernels[0]
	if v := os.Getenv("DRIVER_AGENT_VM_BENCH_KERNEL"); v != "" {
		i := slices.IndexFunc(kernels, func(k *tools) bool { return k.name == v })
		if i < 0 {
			t.Fatalf("DRIVER_AGENT_VM_BENCH_KERNEL=%q: want %s or %s", v, kernels[0].name, kernels[1].name)
		}
		tl = kernels[i]
	}
	h := setup(t, []*tools{tl}, true)[0]
	h.kernelBanner(t)
	runs := 7
	if v := os.Getenv("DRIVER_AGENT_VM_BENCH_RUNS"); v != "" {
		if runs, err = strconv.Atoi(v); err != nil || runs < 1 {
			t.Fatalf("DRIVER_AGENT_VM_BENCH_RUNS=%q: want a positive number", v)
		}
	}
	g := group{name: "bench", packages: true, bench: true, benchRuns: runs, scenarios: []string{"bench"}, timeout: 15 * time.Minute}
	if g.benchB = os.Getenv("DRIVER_AGENT_VM_BENCH_B"); g.benchB != "" {
		if static, err := isStatic(g.benchB); err != nil || !static {
			t.Fatalf("DRIVER_AGENT_VM_BENCH_B=%s: want a static executable (%v)", g.benchB, err)
		}
	}
	res := h.boot(t, g)
	results, _, _, ended := parse(res.lines)
	r, ok := results["bench"]
	if res.err != nil || !ended || !ok || !r.pass {
		t.Fatalf("the bench boot failed (%v, ended %v, result %+v); console:\n%s", res.err, ended, r, res.log())
	}
	recs := parseBench(res.lines)
	if len(recs) == 0 {
		t.Fatalf("no VMTEST-BENCH lines; console:\n%s", res.log())
	}
	cpus, _ := vmCPUs() // the boot checked it
	fmt.Fprint(os.Stdout, benchReport(recs, runs, cpus, r.details))
	if v := os.Getenv("DRIVER_AGENT_VM_ICOUNT"); v != "" {
		fmt.Printf("qemu -icount %s: the figures are guest time counted in instructions, not the host's time\n", v)
	}
}

var benchLine = regexp.MustCompile(`VMTEST-BENCH (.*)$`)

// benchRecord is one VMTEST-BENCH line: kind, run and the numeric fields; phases separately.
type benchRecord struct {
	kind   string
	values map[string]float64
	phases map[string]float64
	order  []string // phase names in order
}

func parseBench(lines []consoleLine) []benchRecord {
	var out []benchRecord
	for _, l := range lines {
		m := benchLine.FindStringSubmatch(l.text)
		if m == nil {
			continue
		}
		rec := benchRecord{values: map[string]float64{}, phases: map[string]float64{}}
		for _, f := range strings.Fields(m[1]) {
			k, v, _ := strings.Cut(f, "=")
			switch k {
			case "kind":
				rec.kind = v
			case "phases":
				for _, p := range strings.Split(v, ",") {
					name, ms, _ := strings.Cut(p, ":")
					if n, err := strconv.ParseFloat(ms, 64); err == nil && name != "" {
						rec.phases[name] = n
						rec.order = append(rec.order, name)
					}
				}
			default:
				if n, err := strconv.ParseFloat(v, 64); err == nil {
					rec.values[k] = n
				}
			}
		}
		out = append(out, rec)
	}
	return out
}

// stats are the median, mean, min and max of a set of values.
type stats struct{ median, mean, min, max float64 }

func summarize(v []float64) stats {
	if len(v) == 0 {
		return stats{}
	}
	s := slices.Clone(v)
	sort.Float64s(s)
	var sum float64
	for _, x := range s {
		sum += x
	}
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return stats{median: med, mean: sum / float64(len(s)), min: s[0], max: s[len(s)-1]}
}

func (s stats) String() string {
	return fmt.Sprintf("median %8.1f  mean %8.1f  min %8.1f  max %8.1f", s.median, s.mean, s.min, s.max)
}

// benchReport renders the figures: per kind the time to Ready and the teardown, the agent's
// peak RSS, its threads' CPU time and time slices, its phases, and the ratios and overheads
// against the scripts (medians).
func benchReport(recs []benchRecord, runs, cpus int, notes string) string {
	field := func(kind, key string) []float64 {
		var v []float64
		for _, r := range recs {
			if x, ok := r.values[key]; r.kind == kind && ok {
				v = append(v, x)
			}
		}
		return v
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nvm-bench: %d runs of each, in one boot (qemu TCG, %d vCPU); milliseconds unless noted\n%s\n\n", runs, cpus, notes)
	kinds := []string{"precompiled", "cached", "script-min", "script-full"}
	if len(field("cached-b", "ready_ms")) > 0 {
		kinds = append(kinds, "precompiled-b", "cached-b")
	}
	for _, k := range kinds {
		fmt.Fprintf(&b, "%-12s start to Ready   %s  (n=%d)\n", k, summarize(field(k, "ready_ms")), len(field(k, "ready_ms")))
		if a := field(k, "agent_ms"); len(a) > 0 {
			fmt.Fprintf(&b, "%-12s   by its own log %s\n", "", summarize(a))
		}
		if l := field(k, "link_ms"); len(l) > 0 {
			fmt.Fprintf(&b, "%-12s   of which ld    %s\n", "", summarize(l))
		}
		if l := field(k, "persistenced_ms"); len(l) > 0 {
			fmt.Fprintf(&b, "%-12s   persistenced   %s\n", "", summarize(l))
		}
		fmt.Fprintf(&b, "%-12s teardown        %s\n", "", summarize(field(k, "teardown_ms")))
		if hwm := field(k, "hwm_kb"); len(hwm) > 0 {
			m := summarize(hwm)
			fmt.Fprintf(&b, "%-12s peak RSS (VmHWM) max %.1f MiB, median %.1f MiB (VmRSS at Ready median %.1f MiB)\n", "",
				m.max/1024, m.median/1024, summarize(field(k, "rss_kb")).median/1024)
		}
		if c := field(k, "cpu_ms"); len(c) > 0 {
			fmt.Fprintf(&b, "%-12s its threads at Ready: CPU median %.0f ms (10 ms ticks); those alive %.1f ms, time slices median %.0f\n", "",
				summarize(c).median, summarize(field(k, "live_cpu_ms")).median, summarize(field(k, "slices")).median)
		}
	}
	if e := field("agent-exec", "exec_ms"); len(e) > 0 {
		fmt.Fprintf(&b, "%-12s `driver-agent version`, exec to exit %s\n", "agent-exec", summarize(e))
	}
	med := func(kind, key string) float64 { return summarize(field(kind, key)).median }
	fmt.Fprintf(&b, "\nratios of medians (start to Ready):\n")
	for _, k := range []string{"precompiled", "cached"} {
		for _, s := range []string{"script-min", "script-full"} {
			a, base := med(k, "ready_ms"), med(s, "ready_ms")
			if base > 0 {
				fmt.Fprintf(&b, "  %-12s / %-12s %5.2fx  (agent overhead %+8.1f ms)\n", k, s, a/base, a-base)
			}
		}
	}
	if full, base := med("precompiled", "ready_ms"), med("script-full", "ready_ms"); base > 0 {
		fmt.Fprintf(&b, "  goal: precompiled / script-full %.2fx (target <= 1.2x)\n", full/base)
	}
	if pd := field("script-full", "persistenced_ms"); len(pd) > 0 {
		fmt.Fprintf(&b, "  goal: cached - (script-min + persistenced's own start) %+.1f ms (target <= 100 ms)\n",
			med("cached", "ready_ms")-med("script-min", "ready_ms")-summarize(pd).median)
	}
	// The same goals from each round's own figures (the kinds of a round run one after the other),
	// which a slow or fast stretch of the boot moves together: the median over the rounds.
	// perRound gives f's result for each round that has every figure f asks at for.
	perRound := func(f func(at func(kind, key string) float64) float64) []float64 {
		var out []float64
		for run := 1; run <= runs; run++ {
			ok := true
			at := func(kind, key string) float64 {
				for _, r := range recs {
					if x, has := r.values[key]; r.kind == kind && has && r.values["run"] == float64(run) {
						return x
					}
				}
				ok = false
				return 0
			}
			if v := f(at); ok {
				out = append(out, v)
			}
		}
		return out
	}
	ratios := perRound(func(at func(kind, key string) float64) float64 {
		return at("precompiled", "ready_ms") / at("script-full", "ready_ms")
	})
	overs := perRound(func(at func(kind, key string) float64) float64 {
		return at("cached", "ready_ms") - at("script-min", "ready_ms") - at("script-full", "persistenced_ms")
	})
	if len(ratios) > 0 && len(overs) > 0 {
		fmt.Fprintf(&b, "  goal, paired by round (median of %d rounds): precompiled / script-full %.2fx; cached - (script-min + persistenced) %+.1f ms\n",
			len(ratios), summarize(ratios).median, summarize(overs).median)
	}
	// Agent B against A: each round runs both, in turn first, so the difference of each round
	// is free of the boot's drift.
	for _, k := range []string{"precompiled", "cached"} {
		diffs := perRound(func(at func(kind, key string) float64) float64 { return at(k+"-b", "ready_ms") - at(k, "ready_ms") })
		if len(diffs) > 0 {
			d := summarize(diffs)
			fmt.Fprintf(&b, "  B - A, %-11s paired by round (%d): median %+.1f ms, mean %+.1f, min %+.1f, max %+.1f\n", k, len(diffs), d.median, d.mean, d.min, d.max)
		}
	}
	fmt.Fprintf(&b, "teardown ratios of medians:\n")
	for _, k := range []string{"precompiled", "cached"} {
		for _, s := range []string{"script-min", "script-full"} {
			a, base := med(k, "teardown_ms"), med(s, "teardown_ms")
			if base > 0 {
				fmt.Fprintf(&b, "  %-12s / %-12s %5.2fx  (%+8.1f ms)\n", k, s, a/base, a-base)
			}
		}
	}
	for _, k := range []string{"precompiled", "cached", "precompiled-b", "cached-b"} {
		var order []string
		all := map[string][]float64{}
		for _, r := range recs {
			if r.kind != k {
				continue
			}
			for _, p := range r.order {
				if _, seen := all[p]; !seen {
					order = append(order, p)
				}
				all[p] = append(all[p], r.phases[p])
			}
		}
		if len(order) == 0 {
			continue
		}
		fmt.Fprintf(&b, "%s phases (status.json, median ms):", k)
		for _, p := range order {
			fmt.Fprintf(&b, " %s %.0f", p, summarize(all[p]).median)
		}
		b.WriteString("\n")
	}
	return b.String()
}
