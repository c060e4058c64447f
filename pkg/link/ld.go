package link

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// outputTail is how much of the linker's output an error keeps.
const outputTail = 4 << 10

// waitDelay bounds how long Link waits for the linker's output pipes after
// the linker exits or is killed.
const waitDelay = 5 * time.Second

// runLD runs the linker in its own process group and waits for it. When ctx
// is cancelled the whole group is killed and ctx's error is returned.
func runLD(ctx context.Context, ld string, args []string) error {
	cmd := exec.CommandContext(ctx, ld, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error {
		// The group's id is the leader's pid; kill everything it started too.
		return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	cmd.WaitDelay = waitDelay
	var out tail
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if ctxErr := ctx.Err(); ctxErr != nil && err != nil {
		return fmt.Errorf("%s cancelled: %w", ld, ctxErr)
	}
	if err != nil {
		msg := strings.TrimSpace(out.String())
		if msg != "" {
			msg = ": " + msg
		}
		var exitErr *exec.ExitError
		if errors.As(err, &exitErr) {
			return fmt.Errorf("%w: %s %s: %w%s", ErrLink, ld, strings.Join(args, " "), err, msg)
		}
		return fmt.Errorf("%w: run %s: %w%s", ErrLink, ld, err, msg)
	}
	return nil
}

// tail keeps the last outputTail bytes written to it.
type tail struct {
	b         []byte
	truncated bool
}

func (t *tail) Write(p []byte) (int, error) {
	n := len(p)
	t.b = append(t.b, p...)
	if over := len(t.b) - outputTail; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
		t.truncated = true
	}
	return n, nil
}

func (t *tail) String() string {
	if t.truncated {
		return "..." + string(t.b)
	}
	return string(t.b)
}
