package cgtest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Child is a helper process inside a test's cgroup and network namespace
// that opens sockets on request (see the package documentation).
type Child struct {
	tb     testing.TB
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan []byte
	stderr *syncBuffer
	info   Result
	done   chan struct{} // closed once the process has been waited for
	werr   error
}

// Start runs a Child in cg and in the network namespace ns (for example
// testenv.NetNS.Handle(), or netns.GetFromPath). The child is stopped when
// the test ends; registered after cg, it goes before cg is removed. The
// calling package's TestMain must call Main or RunHelperIfChild.
func Start(tb testing.TB, cg *Cgroup, ns netns.NsHandle) *Child {
	tb.Helper()
	if !helperRouted {
		tb.Fatalf("cgtest: this package's TestMain must call cgtest.Main(m) or cgtest.RunHelperIfChild() for the child to run")
	}
	exe, err := os.Executable()
	if err != nil {
		tb.Fatalf("cgtest: %v", err)
	}
	nsfd, err := unix.FcntlInt(uintptr(ns), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		tb.Fatalf("cgtest: netns handle %d: %v", ns, err)
	}
	nsFile := os.NewFile(uintptr(nsfd), "netns")
	defer nsFile.Close()
	cgDir, err := os.Open(cg.Path)
	if err != nil {
		tb.Fatalf("cgtest: %v", err)
	}
	defer cgDir.Close()

	c := &Child{tb: tb, lines: make(chan []byte, 16), stderr: &syncBuffer{}, done: make(chan struct{})}
	// -test.run=^$: should the routing in TestMain be missing after all,
	// the binary runs no tests instead of recursing.
	c.cmd = exec.Command(exe, "-test.run=^$")
	c.cmd.Env = append(os.Environ(), HelperEnv+"=1", CgroupEnv+"="+cg.Path)
	c.cmd.ExtraFiles = []*os.File{nsFile} // fd 3 = netnsFD
	c.cmd.Stderr = c.stderr
	c.cmd.SysProcAttr = &syscall.SysProcAttr{
		// Created inside the cgroup: it never runs anywhere else.
		UseCgroupFD: true,
		CgroupFD:    int(cgDir.Fd()),
		Pdeathsig:   syscall.SIGKILL,
	}
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		tb.Fatalf("cgtest: %v", err)
	}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		tb.Fatalf("cgtest: %v", err)
	}
	if err := c.cmd.Start(); err != nil {
		tb.Fatalf("cgtest: start child: %v", err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		for sc.Scan() {
			c.lines <- bytes.Clone(sc.Bytes())
		}
		close(c.lines)
	}()
	go func() {
		c.werr = c.cmd.Wait()
		close(c.done)
	}()
	tb.Cleanup(func() {
		if err := c.Stop(); err != nil {
			tb.Errorf("cgtest: %v", err)
		}
	})
	c.info = c.read(10 * time.Second)
	return c
}

// Pid is the child's process id.
func (c *Child) Pid() int { return c.cmd.Process.Pid }

// Info is what the child reported about itself once it had joined the
// cgroup and entered the namespace: Pid, Cgroup and NetNS.
func (c *Child) Info() Result { return c.info }

// Do sends req and returns the child's answer. Socket errors come back in
// the Result; Do fails the test (call it from the test goroutine) only
// when the child does not answer. One request at a time: a Child is not
// for concurrent use.
func (c *Child) Do(req Request) Result {
	c.tb.Helper()
	b, err := json.Marshal(req)
	if err != nil {
		c.tb.Fatalf("cgtest: %v", err)
	}
	if _, err := c.stdin.Write(append(b, '\n')); err != nil {
		c.tb.Fatalf("cgtest: write to child: %v (stderr: %s)", err, c.stderr)
	}
	timeout := 2 * time.Second
	if req.TimeoutMS > 0 {
		timeout = time.Duration(req.TimeoutMS) * time.Millisecond
	}
	// Connect, send and every TCP read may each take the timeout.
	return c.read(4*timeout + 5*time.Second)
}

func (c *Child) read(timeout time.Duration) Result {
	c.tb.Helper()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case line, ok := <-c.lines:
		if !ok {
			<-c.done
			c.tb.Fatalf("cgtest: child exited (%v); stderr: %s", c.werr, c.stderr)
		}
		var r Result
		if err := json.Unmarshal(line, &r); err != nil {
			c.tb.Fatalf("cgtest: child said %q: %v", line, err)
		}
		return r
	case <-t.C:
		c.tb.Fatalf("cgtest: child did not answer within %v; stderr: %s", timeout, c.stderr)
	}
	return Result{}
}

// TCP connects to addr, sends send and reads what one read returns.
func (c *Child) TCP(addr, send string) Result {
	c.tb.Helper()
	return c.Do(Request{Op: OpTCP, Addr: addr, Send: send})
}

// UDP sends send to addr from an unconnected socket and reads one reply.
func (c *Child) UDP(addr, send string) Result {
	c.tb.Helper()
	return c.Do(Request{Op: OpUDP, Addr: addr, Send: send})
}

// UDPConnected connects a UDP socket to addr, sends send and reads one
// reply; the socket stays open (Result.Sock) for Send until Close.
func (c *Child) UDPConnected(addr, send string) Result {
	c.tb.Helper()
	return c.Do(Request{Op: OpUDPConnected, Addr: addr, Send: send, Keep: true})
}

// Send exchanges send once more on the kept socket sock.
func (c *Child) Send(sock int, send string) Result {
	c.tb.Helper()
	return c.Do(Request{Op: OpSend, Sock: sock, Send: send})
}

// Close closes the kept socket sock.
func (c *Child) Close(sock int) Result {
	c.tb.Helper()
	return c.Do(Request{Op: OpClose, Sock: sock})
}

// Stop ends the child: it closes its stdin, waits up to 5 s for it to
// exit, then kills it. It is safe to call more than once.
func (c *Child) Stop() error {
	c.stdin.Close()
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
		c.cmd.Process.Kill()
		<-c.done
		return fmt.Errorf("child %d did not exit on EOF and was killed; stderr: %s", c.Pid(), c.stderr)
	}
	var exit *exec.ExitError
	if errors.As(c.werr, &exit) && !exit.Exited() {
		return nil // killed from outside (cgroup.kill, the test): not the child's fault
	}
	if c.werr != nil {
		return fmt.Errorf("child %d: %v; stderr: %s", c.Pid(), c.werr, c.stderr)
	}
	return nil
}

// Exited reports whether the child process has ended and been reaped.
func (c *Child) Exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
