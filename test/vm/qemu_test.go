//go:build vmtest

package vm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// consoleLine is one line of the guest's serial console with the time since qemu started.
type consoleLine struct {
	at   time.Duration
	text string
}

// bootResult is what one boot printed and how it ended.
type bootResult struct {
	lines    []consoleLine
	wall     time.Duration
	timedOut bool
	err      error // qemu failed or was killed
}

func (b bootResult) log() string {
	var s strings.Builder
	for _, l := range b.lines {
		fmt.Fprintf(&s, "%7.2fs %s\n", l.at.Seconds(), l.text)
	}
	return s.String()
}

// defaultMemMiB is the guest's memory unless a group asks for more.
const defaultMemMiB = 1024

// vmCPUs is the guest's vCPUs: DRIVER_AGENT_VM_CPUS, default 1.
func vmCPUs() (int, error) {
	v := os.Getenv("DRIVER_AGENT_VM_CPUS")
	if v == "" {
		return 1, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > 64 {
		return 0, fmt.Errorf("DRIVER_AGENT_VM_CPUS=%q: want a number of vCPUs from 1 to 64", v)
	}
	return n, nil
}

// qemuArgs is the command line of one boot: TCG (KVM does not work on these machines), cpus
// vCPUs, no network, no reboot (with panic=-1 a dead /init ends qemu), the console on the serial
// port.
func qemuArgs(kernel, initrd string, memMiB, cpus int) []string {
	if memMiB <= 0 {
		memMiB = defaultMemMiB
	}
	var icount []string // DRIVER_AGENT_VM_ICOUNT: guest time from instructions, not the host's clock
	if v := os.Getenv("DRIVER_AGENT_VM_ICOUNT"); v != "" {
		icount = []string{"-icount", v}
	}
	return append(icount,
		"-accel", "tcg", "-m", strconv.Itoa(memMiB), "-smp", strconv.Itoa(cpus),
		"-nodefaults", "-no-user-config", "-display", "none", "-monitor", "none",
		"-serial", "stdio", "-nic", "none", "-no-reboot",
		"-kernel", kernel, "-initrd", initrd,
		"-append", "console=ttyS0 panic=-1 loglevel=4 rdinit=/init",
	)
}

// bootArgs runs qemu with its command line args (qemuArgs and more) until the guest powers off,
// reading the console, and kills it after timeout. live, when not nil, gets each line as it arrives.
func bootArgs(ctx context.Context, qemu string, args []string, timeout time.Duration, live func(consoleLine)) bootResult {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, qemu, args...)
	cmd.WaitDelay = 5 * time.Second
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return bootResult{err: err}
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return bootResult{err: fmt.Errorf("start %s: %w", qemu, err)}
	}
	var res bootResult
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		l := consoleLine{at: time.Since(start), text: strings.TrimRight(sc.Text(), "\r")}
		res.lines = append(res.lines, l)
		if live != nil {
			live(l)
		}
	}
	if err := sc.Err(); err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrClosedPipe) {
		res.err = fmt.Errorf("reading the console: %w", err)
	}
	werr := cmd.Wait()
	res.wall = time.Since(start)
	if ctx.Err() != nil {
		res.timedOut = true
		res.err = fmt.Errorf("the guest did not power off within %s; qemu was killed", timeout)
	} else if werr != nil && res.err == nil {
		res.err = fmt.Errorf("qemu: %w: %s", werr, strings.TrimSpace(stderr.String()))
	}
	return res
}
