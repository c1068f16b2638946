//go:build linux

package ecmplab

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"time"

	"github.com/vishvananda/netns"

	"github.com/fluxvm/servicefabric/internal/daemonlog"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
)

// proc is one process of the lab (fluxvmd, bird, the adapter) running in
// a namespace. Its output is kept (bounded) for error messages.
type proc struct {
	name string
	cmd  *exec.Cmd
	Out  *daemonlog.Output
	done chan struct{} // closed when it exited
	err  error         // its exit, once done is closed
}

// startProc runs bin args in ns with env added to ours. It keeps our
// mount namespace (so the host's bpffs and our files), and a process
// group of its own so that a Ctrl-C reaches the lab, which stops it in
// order. It is killed by the kernel if the lab dies first: the
// parent-death signal fires when the thread that started it exits, so it
// is started from a thread of its own, locked for good, that waits for it.
func startProc(ns *nsutil.NS, name string, env []string, bin string, args ...string) (*proc, error) {
	return startProcOut(ns, name, env, nil, bin, args...)
}

// startProcOut is startProc with the process's stdout to stdout (nil:
// kept with its stderr in Out).
func startProcOut(ns *nsutil.NS, name string, env []string, stdout io.Writer, bin string, args ...string) (*proc, error) {
	p := &proc{name: name, Out: daemonlog.New(), done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.Out, p.Out
	if stdout != nil {
		p.cmd.Stdout = stdout
	}
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
		if err := netns.Set(ns.Handle()); err != nil {
			started <- fmt.Errorf("enter netns %s: %w", ns.Name, err)
			return
		}
		if err := p.cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("ecmplab: start %s: %w", name, err)
	}
	return p, nil
}

// exited reports whether the process has ended.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill ends the process with SIGKILL, as a crash would, and waits.
func (p *proc) kill() {
	if p == nil || p.exited() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop sends SIGTERM and waits up to grace, then kills. An exit other
// than 0 on SIGTERM is an error carrying the output's end.
func (p *proc) stop(grace time.Duration) error {
	if p == nil || p.exited() {
		return nil
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		p.kill()
		return fmt.Errorf("ecmplab: %s did not stop on SIGTERM within %v", p.name, grace)
	}
	var ee *exec.ExitError
	if p.err != nil && !(errors.As(p.err, &ee) && !ee.Exited()) {
		return fmt.Errorf("ecmplab: %s exited with %v:\n%s", p.name, p.err, p.Out.Tail(2000))
	}
	return nil
}
