package fabric_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/daemon/daemontest"
	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/fabric"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

// smiRunner answers each `nvidia-smi -q` with the next of its replies, the last one again once
// they are used up: a file under testdata/nvidia-smi, or "error" for a failing nvidia-smi.
type smiRunner struct {
	host.Procs // Start and Run, which WaitState does not use
	t          *testing.T
	smi        string
	replies    []string
	mu         sync.Mutex
	calls      int
}

func (r *smiRunner) Output(ctx context.Context, c host.Cmd) ([]byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c.Path != r.smi || !reflect.DeepEqual(c.Args, []string{"-q"}) {
		r.t.Errorf("ran %s %q, want %s -q", c.Path, c.Args, r.smi)
	}
	if _, ok := ctx.Deadline(); !ok {
		r.t.Error("nvidia-smi -q runs without a deadline")
	}
	reply := r.replies[min(r.calls, len(r.replies)-1)]
	r.calls++
	if reply == "error" {
		return nil, errors.New("exit status 9")
	}
	data, err := os.ReadFile(filepath.Join("testdata/nvidia-smi", reply))
	if err != nil {
		r.t.Fatal(err)
	}
	return data, nil
}

// report is one state WaitState reported.
type report struct {
	state  fabric.State
	detail string
}

// stateOptions returns options for an nvidia-smi that answers replies in turn, and where the
// reports go.
func stateOptions(t *testing.T, replies ...string) (fabric.StateOptions, *smiRunner, *[]report) {
	smi := filepath.Join(t.TempDir(), "nvidia-smi")
	if err := os.WriteFile(smi, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	r := &smiRunner{t: t, smi: smi, replies: replies}
	var reports []report
	o := fabric.StateOptions{
		NvidiaSMI: smi, Procs: r, Poll: 5 * time.Second, Timeout: time.Minute,
		Report: func(s fabric.State, d string) { reports = append(reports, report{s, d}) },
	}
	return o, r, &reports
}

// TestWaitState runs the poll on an instant clock: what each sequence of nvidia-smi answers
// makes of the run (nil, or an error of exit code 9 saying why), what is reported, how often
// nvidia-smi runs and how long it waits between.
func TestWaitState(t *testing.T) {
	t.Parallel()
	const inProgress = "1 of 2 GPUs: GPU 00000000:2A:00.0: In Progress/N/A"
	cases := []struct {
		name    string
		replies []string
		shared  bool
		timeout time.Duration // 0: 1m
		wantErr string        // "" for nil
		reports []report
		waits   int // poll intervals waited
		log     string
	}{
		{name: "completed at once", replies: []string{"h100-completed.txt"},
			reports: []report{{fabric.StateCompleted, "2 GPUs Completed/Success"}}, log: "the NVSwitch fabric is up"},
		{name: "completed but degraded", replies: []string{"gb200-health.txt"},
			reports: []report{{fabric.StateCompleted, "2 GPUs Completed/Success"}}, log: `a GPU's fabric health is degraded" gpu=00000009:01:00.0 health=Unhealthy`},
		{name: "not supported", replies: []string{"pcie-na.txt"},
			reports: []report{{fabric.StateNotSupported, "1 GPU N/A/N/A"}}, log: "the GPUs report no fabric state"},
		{name: "failure", replies: []string{"h100-insufficient-resources.txt"},
			wantErr: "the NVSwitch fabric reports a failure although nv-fabricmanager is running: 1 of 2 GPUs: GPU 00000000:2A:00.0: Completed/Insufficient Resources",
			reports: []report{{fabric.StateFailed, "1 of 2 GPUs: GPU 00000000:2A:00.0: Completed/Insufficient Resources"}}},
		{name: "in progress, then completed", replies: []string{"h100-not-started.txt", "h100-in-progress.txt", "h100-completed.txt"},
			reports: []report{{fabric.StateInProgress, "2 of 2 GPUs: GPU 00000000:18:00.0: Not Started/N/A; GPU 00000000:2A:00.0: Not Started/N/A"},
				{fabric.StateInProgress, inProgress}, {fabric.StateCompleted, "2 GPUs Completed/Success"}},
			waits: 2, log: "waiting for the GPUs to register with the NVSwitch fabric"},
		{name: "in progress, then a failure", replies: []string{"h100-in-progress.txt", "h100-insufficient-resources.txt"},
			wantErr: "reports a failure",
			reports: []report{{fabric.StateInProgress, inProgress}, {fabric.StateFailed, "1 of 2 GPUs: GPU 00000000:2A:00.0: Completed/Insufficient Resources"}},
			waits:   1},
		{name: "in progress past the timeout", replies: []string{"h100-in-progress.txt"}, timeout: 20 * time.Second,
			wantErr: "the NVSwitch fabric is still in progress 20s after nv-fabricmanager came up: " + inProgress,
			reports: []report{{fabric.StateInProgress, inProgress}, {fabric.StateInProgress, inProgress}, {fabric.StateInProgress, inProgress},
				{fabric.StateInProgress, inProgress}, {fabric.StateInProgress, inProgress}},
			waits: 4, log: "the NVSwitch fabric did not settle"},
		{name: "in progress in shared mode", replies: []string{"h100-in-progress.txt"}, shared: true,
			reports: []report{{fabric.StateInProgress, inProgress}}, log: "as expected with FABRIC_MODE=1"},
		{name: "nvidia-smi failing", replies: []string{"error"},
			reports: []report{{fabric.StateUnknown, "nvidia-smi -q: exit status 9"}},
			waits:   2, log: "the fabric state cannot be checked; going on without it"},
		{name: "no GPU in the output", replies: []string{"no-devices.txt"},
			reports: []report{{fabric.StateUnknown, "nvidia-smi -q: " + fabric.ErrNoGPU.Error()}}, waits: 2},
		{name: "failing twice, then completed", replies: []string{"error", "no-devices.txt", "h100-completed.txt"},
			reports: []report{{fabric.StateCompleted, "2 GPUs Completed/Success"}}, waits: 2},
		{name: "attempts count failures in a row", replies: []string{"error", "error", "h100-in-progress.txt", "error", "error", "h100-completed.txt"},
			reports: []report{{fabric.StateInProgress, inProgress}, {fabric.StateCompleted, "2 GPUs Completed/Success"}}, waits: 5},
		{name: "in progress, then failing at the timeout", replies: []string{"h100-in-progress.txt", "h100-in-progress.txt", "h100-in-progress.txt", "h100-in-progress.txt", "error"}, timeout: 20 * time.Second,
			reports: []report{{fabric.StateInProgress, inProgress}, {fabric.StateInProgress, inProgress}, {fabric.StateInProgress, inProgress},
				{fabric.StateInProgress, inProgress}, {fabric.StateUnknown, "nvidia-smi -q: exit status 9"}},
			waits: 4},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			o, r, reports := stateOptions(t, c.replies...)
			clock := daemontest.NewInstant(time.Unix(0, 0))
			log, buf := hosttest.NewLog()
			o.Clock, o.Log, o.Shared = clock, log, c.shared
			if c.timeout != 0 {
				o.Timeout = c.timeout
			}
			err := fabric.WaitState(context.Background(), o)
			switch {
			case c.wantErr == "" && err != nil:
				t.Fatalf("WaitState = %v, want nil", err)
			case c.wantErr != "" && (!errors.Is(err, exitcode.ErrDaemon) || !strings.Contains(err.Error(), c.wantErr)):
				t.Fatalf("WaitState = %v, want exit code 9 and %q", err, c.wantErr)
			}
			if !reflect.DeepEqual(*reports, c.reports) {
				t.Errorf("reported\n%v\nwant\n%v", *reports, c.reports)
			}
			if want := c.waits + 1; r.calls != want {
				t.Errorf("nvidia-smi ran %d times, want %d", r.calls, want)
			}
			waits := clock.Waits()
			if len(waits) != c.waits {
				t.Errorf("waited %v, want %d polls", waits, c.waits)
			}
			for _, w := range waits {
				if w != o.Poll {
					t.Errorf("waited %s, want the poll interval %s", w, o.Poll)
				}
			}
			if !strings.Contains(buf.String(), c.log) {
				t.Errorf("the log lacks %q:\n%s", c.log, buf)
			}
		})
	}
}

// Without nvidia-smi in the image the state is unknown and nothing runs.
func TestWaitStateWithoutNvidiaSMI(t *testing.T) {
	t.Parallel()
	o, r, reports := stateOptions(t, "h100-completed.txt")
	o.NvidiaSMI += ".missing"
	if err := fabric.WaitState(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if want := []report{{fabric.StateUnknown, "nvidia-smi is not in the image"}}; !reflect.DeepEqual(*reports, want) || r.calls != 0 {
		t.Errorf("reported %v after %d runs, want %v and none", *reports, r.calls, want)
	}
}

// The zero Poll and Timeout take 5s and 2m.
func TestWaitStateDefaults(t *testing.T) {
	t.Parallel()
	o, r, _ := stateOptions(t, "h100-in-progress.txt")
	clock := daemontest.NewInstant(time.Unix(0, 0))
	o.Clock, o.Poll, o.Timeout = clock, 0, 0
	err := fabric.WaitState(context.Background(), o)
	if !errors.Is(err, exitcode.ErrDaemon) || !strings.Contains(err.Error(), "still in progress 2m0s after") {
		t.Fatalf("WaitState = %v", err)
	}
	if waits := clock.Waits(); len(waits) != 24 || waits[0] != 5*time.Second || r.calls != 25 {
		t.Errorf("waited %v over %d runs, want 24 times 5s over 25", waits, r.calls)
	}
}

// failingDaemons is a supervisor whose required daemon has failed for good.
type failingDaemons struct{ failed chan struct{} }

func (d failingDaemons) Failed() <-chan struct{} { return d.failed }
func (d failingDaemons) Err() error              { return errors.New("nv-fabricmanager failed 5 times") }

// A daemon that fails for good, or the context ending, stops the wait between two reads.
func TestWaitStateStops(t *testing.T) {
	t.Parallel()
	for _, daemonFails := range []bool{true, false} {
		o, r, _ := stateOptions(t, "h100-in-progress.txt")
		clock := daemontest.NewClock(time.Unix(0, 0))
		o.Clock = clock
		d := failingDaemons{make(chan struct{})}
		o.Daemons = d
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- fabric.WaitState(ctx, o) }()
		poll := clock.Next(t) // the first read said in progress
		if daemonFails {
			close(d.failed)
		} else {
			cancel()
		}
		err := <-done
		cancel()
		switch {
		case daemonFails && (!errors.Is(err, exitcode.ErrDaemon) || !strings.Contains(err.Error(), "nv-fabricmanager failed 5 times")):
			t.Errorf("a daemon failed: WaitState = %v", err)
		case !daemonFails && !errors.Is(err, context.Canceled):
			t.Errorf("cancelled: WaitState = %v", err)
		}
		if !poll.Stopped() || r.calls != 1 {
			t.Errorf("daemon fails %v: poll timer stopped %v, %d runs", daemonFails, poll.Stopped(), r.calls)
		}
	}
}
