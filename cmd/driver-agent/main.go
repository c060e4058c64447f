// Command driver-agent is the entrypoint of the NVIDIA driver container (also installed as
// nvidia-driver). Everything but signal wiring and the exit code lives in pkg/cli.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/driver-agent/driver-agent/pkg/cli"
)

func main() {
	// The signals NVIDIA's script traps: each one stops the agent as SIGTERM does.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGPIPE)
	code := cli.Main(ctx, os.Args, os.Environ(), os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
