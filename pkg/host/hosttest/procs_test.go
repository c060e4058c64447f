package hosttest_test

import (
	"context"
	"errors"
	"os"
	"syscall"
	"testing"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/host/hosttest"
)

var _ host.Procs = (*hosttest.FakeProcs)(nil)

func TestFakeProcs(t *testing.T) {
	t.Parallel()
	f := &hosttest.FakeProcs{Handle: func(_ context.Context, c host.Cmd) ([]byte, error) {
		if c.Path == "/bin/false" {
			return nil, errors.New("exit status 1")
		}
		return []byte("out"), nil
	}}
	if b, err := f.Output(context.Background(), host.Cmd{Path: "/bin/echo"}); err != nil || string(b) != "out" {
		t.Errorf("Output = %q, %v", b, err)
	}
	if err := f.Run(context.Background(), host.Cmd{Path: "/bin/false"}, nil); err == nil {
		t.Error("Run of /bin/false succeeded")
	}
	a, err := f.Start(context.Background(), host.Cmd{Path: "/usr/bin/a"}, host.StartOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := f.Start(context.Background(), host.Cmd{Path: "/usr/bin/b"}, host.StartOptions{})
	if a.Pid() == b.Pid() {
		t.Errorf("two processes with pid %d", a.Pid())
	}
	if err := a.Signal(syscall.SIGHUP); err != nil || len(f.Running()) != 2 {
		t.Fatalf("SIGHUP: %v, running %d; want both still running", err, len(f.Running()))
	}
	if err := a.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-a.Done()
	if err := a.Wait(); err == nil || err.Error() != "killed by signal SIGTERM" {
		t.Errorf("Wait = %v", err)
	}
	if err := a.Signal(syscall.SIGKILL); !errors.Is(err, os.ErrProcessDone) {
		t.Errorf("Signal after exit = %v", err)
	}
	b.(*hosttest.FakeProcess).Exit(nil)
	if err := b.Wait(); err != nil || len(f.Running()) != 0 {
		t.Errorf("Exit(nil): Wait = %v, running %d", err, len(f.Running()))
	}
	if got := f.Cmds(); len(got) != 4 || got[2].Path != "/usr/bin/a" {
		t.Errorf("Cmds = %+v", got)
	}
}
