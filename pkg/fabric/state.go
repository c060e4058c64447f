package fabric

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
)

// State is the fabric state the agent reports: the value of status.json's "fabric" and of the
// state label of driver_agent_fabric_state.
type State string

// The fabric states, from the GPUs' point of view.
const (
	// StateCompleted: every GPU that reports a fabric state finished registering with the fabric
	// and reports no error ("State: Completed", "Status: Success").
	StateCompleted State = "completed"
	// StateInProgress: a GPU has not finished registering yet ("Not Started" or "In Progress").
	StateInProgress State = "in_progress"
	// StateFailed: a GPU finished registering with an error ("State: Completed" with a Status
	// other than Success), or reports a state this parser does not know.
	StateFailed State = "failed"
	// StateNotSupported: no GPU reports a fabric state (no NVSwitch fabric, or a driver whose
	// nvidia-smi has no Fabric section).
	StateNotSupported State = "not_supported"
)

// GPUFabric is one GPU's "Fabric" section in `nvidia-smi -q`, as printed:
//
//	GPU 00000000:18:00.0
//	    ...
//	    Fabric
//	        State                             : Completed
//	        Status                            : Success
//	        CliqueId                          : 0
//	        ClusterUUID                       : 00000000-0000-0000-0000-000000000000
//	        Health
//	            Summary                       : Healthy
//	            Bandwidth                     : Full
//
// Values are kept verbatim (trimmed); a GPU without a Fabric section has empty fields.
type GPUFabric struct {
	// GPU is the PCI address from the GPU's header line, e.g. "00000000:18:00.0".
	GPU string
	// State is the registration state: "Completed", "In Progress", "Not Started",
	// "Not Supported" or "N/A".
	State string
	// Status is the registration result, meaningful once State is Completed: "Success", "N/A", or
	// NVML's text for the error (e.g. "Insufficient Resources", "Timeout").
	Status string
	// CliqueID and ClusterUUID identify the GPU's fabric partition (newer drivers only).
	CliqueID, ClusterUUID string
	// Health is the Health section's Summary (newer drivers only), e.g. "Healthy", "Unhealthy".
	Health string
}

// Classify maps the GPU's State and Status to the reported state.
func (g GPUFabric) Classify() State {
	switch norm(g.State) {
	case "completed":
		switch norm(g.Status) {
		case "success", "n/a", "":
			return StateCompleted
		}
		return StateFailed
	case "in progress", "not started":
		return StateInProgress
	case "not supported", "n/a", "":
		return StateNotSupported
	}
	return StateFailed
}

// String renders the GPU for logs and errors: "GPU 00000000:18:00.0: Completed/Success".
func (g GPUFabric) String() string {
	return fmt.Sprintf("GPU %s: %s", orNA(g.GPU), g.pair())
}

func (g GPUFabric) pair() string { return orNA(g.State) + "/" + orNA(g.Status) }

func norm(s string) string { return strings.ToLower(strings.Join(strings.Fields(s), " ")) }

func orNA(s string) string {
	if s == "" {
		return "N/A"
	}
	return s
}

// ErrNoGPU is returned by ParseFabricState for output that lists no GPU (for example "No devices
// were found", or not `nvidia-smi -q` output at all).
var ErrNoGPU = errors.New("no GPU in the nvidia-smi -q output")

// ParseFabricState reads `nvidia-smi -q` output and returns every GPU in it, in order, with its
// Fabric section. A section is found by its indentation: "GPU <address>" at the left margin
// starts a GPU, a "Fabric" header inside it opens the section, and the section's
// "Key : value" lines (and its Health subsection's Summary) are read until the indentation
// returns to the header's level. A line is "Key : value" when a colon follows a blank; other
// non-blank lines are headers.
func ParseFabricState(r io.Reader) ([]GPUFabric, error) {
	var gpus []GPUFabric
	var cur *GPUFabric
	fabricIndent := -1 // indentation of the open Fabric header; -1 when none is open
	subIndent := -1    // indentation of the open subsection header inside it (Health, ...)
	subName := ""
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), " \t\r")
		text := strings.TrimLeft(line, " \t")
		if text == "" {
			continue
		}
		indent := len(line) - len(text)
		key, value, isValue := splitValue(text)
		if indent == 0 && !isValue && strings.HasPrefix(text, "GPU ") {
			gpus = append(gpus, GPUFabric{GPU: strings.TrimSpace(strings.TrimPrefix(text, "GPU "))})
			cur = &gpus[len(gpus)-1]
			fabricIndent, subIndent = -1, -1
			continue
		}
		if cur == nil {
			continue
		}
		if subIndent >= 0 && indent <= subIndent {
			subIndent = -1
		}
		if fabricIndent >= 0 && indent <= fabricIndent {
			fabricIndent = -1
		}
		switch {
		case fabricIndent < 0:
			if !isValue && text == "Fabric" {
				fabricIndent = indent
			}
		case !isValue:
			if subIndent < 0 {
				subIndent, subName = indent, text
			}
		case subIndent >= 0:
			if subName == "Health" && key == "Summary" {
				cur.Health = value
			}
		default:
			switch strings.ReplaceAll(key, " ", "") {
			case "State":
				cur.State = value
			case "Status":
				cur.Status = value
			case "CliqueId", "CliqueID":
				cur.CliqueID = value
			case "ClusterUUID", "ClusterUuid":
				cur.ClusterUUID = value
			}
		}
	}
	if err := sc.Err(); err != nil {
		return gpus, fmt.Errorf("read nvidia-smi -q output: %w", err)
	}
	if len(gpus) == 0 {
		return nil, ErrNoGPU
	}
	return gpus, nil
}

// splitValue splits "Key      : value" at the first colon that follows a space or a tab; ok is
// false for a header line ("GPU 00000000:18:00.0" has colons, but none after a blank).
func splitValue(text string) (key, value string, ok bool) {
	for i := 1; i < len(text); i++ {
		if text[i] == ':' && (text[i-1] == ' ' || text[i-1] == '\t') {
			return strings.TrimSpace(text[:i]), strings.TrimSpace(text[i+1:]), true
		}
	}
	return "", "", false
}

// Summary is the node's fabric state over all its GPUs.
type Summary struct {
	// State is the worst of the GPUs' states: failed, then in progress, then completed; not
	// supported only when no GPU reports a fabric state.
	State State
	// GPUs are the parsed GPUs.
	GPUs []GPUFabric
	// Detail says in words what the GPUs report: the failing GPUs by address when State is
	// failed, the GPUs not done when it is in progress, counts otherwise.
	Detail string
}

// Summarize aggregates the GPUs' states into the node's.
func Summarize(gpus []GPUFabric) Summary {
	s := Summary{State: StateNotSupported, GPUs: gpus}
	by := map[State][]GPUFabric{}
	for _, g := range gpus {
		st := g.Classify()
		by[st] = append(by[st], g)
	}
	switch {
	case len(by[StateFailed]) > 0:
		s.State = StateFailed
		s.Detail = listGPUs(by[StateFailed], len(gpus))
	case len(by[StateInProgress]) > 0:
		s.State = StateInProgress
		s.Detail = listGPUs(by[StateInProgress], len(gpus))
	case len(by[StateCompleted]) > 0:
		s.State = StateCompleted
		s.Detail = countPairs(gpus)
	default:
		s.Detail = countPairs(gpus)
	}
	return s
}

// Unhealthy lists the GPUs whose Health Summary is present and not "Healthy" (nor N/A or
// Not Supported): the fabric is up but degraded.
func (s Summary) Unhealthy() []GPUFabric {
	var out []GPUFabric
	for _, g := range s.GPUs {
		switch norm(g.Health) {
		case "", "healthy", "n/a", "not supported":
		default:
			out = append(out, g)
		}
	}
	return out
}

func listGPUs(gs []GPUFabric, total int) string {
	parts := make([]string, 0, len(gs))
	for _, g := range gs {
		parts = append(parts, g.String())
	}
	return fmt.Sprintf("%d of %d GPUs: %s", len(gs), total, strings.Join(parts, "; "))
}

// countPairs renders "8 GPUs Completed/Success" or "6 GPUs Completed/Success, 2 GPUs N/A/N/A".
func countPairs(gs []GPUFabric) string {
	if len(gs) == 0 {
		return "no GPU"
	}
	counts := map[string]int{}
	var order []string
	for _, g := range gs {
		p := g.pair()
		if counts[p] == 0 {
			order = append(order, p)
		}
		counts[p]++
	}
	sort.SliceStable(order, func(i, j int) bool { return counts[order[i]] > counts[order[j]] })
	parts := make([]string, 0, len(order))
	for _, p := range order {
		unit := "GPUs"
		if counts[p] == 1 {
			unit = "GPU"
		}
		parts = append(parts, fmt.Sprintf("%d %s %s", counts[p], unit, p))
	}
	return strings.Join(parts, ", ")
}
