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
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := cli.Main(ctx, os.Args, os.Environ(), os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
