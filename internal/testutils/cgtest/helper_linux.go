package cgtest

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// runChild is the child's whole life: join the cgroup, enter the network
// namespace, announce itself, then serve requests until stdin closes.
func runChild() int {
	// First of all, before any socket exists: the cgroup. clone3 already
	// created the process inside it; writing the pid again is a no-op
	// then, and the move itself when the parent could not use clone3.
	cgDir := os.Getenv(CgroupEnv)
	if err := os.WriteFile(filepath.Join(cgDir, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		fmt.Fprintf(os.Stderr, "cgtest child: join cgroup %s: %v\n", cgDir, err)
		return 2
	}
	// setns moves only the calling thread: every socket is made on this
	// goroutine, locked to it for good.
	runtime.LockOSThread()
	if err := unix.Setns(netnsFD, unix.CLONE_NEWNET); err != nil {
		fmt.Fprintf(os.Stderr, "cgtest child: setns: %v\n", err)
		return 2
	}
	unix.Close(netnsFD)

	c := &child{socks: map[int]*sock{}}
	out := json.NewEncoder(os.Stdout)
	if err := out.Encode(c.info()); err != nil {
		return 2
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for in.Scan() {
		var req Request
		var res Result
		if err := json.Unmarshal(in.Bytes(), &req); err != nil {
			res = Result{Stage: "op", Err: fmt.Sprintf("bad request: %v", err)}
		} else {
			res = c.do(req)
		}
		if err := out.Encode(res); err != nil {
			return 2
		}
	}
	for _, s := range c.socks {
		unix.Close(s.fd)
	}
	return 0
}

type sock struct {
	fd     int
	family int
	stream bool
}

type child struct {
	socks map[int]*sock
	next  int
}

func (c *child) info() Result {
	r := Result{Pid: os.Getpid()}
	if b, err := os.ReadFile("/proc/self/cgroup"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if p, ok := strings.CutPrefix(l, "0::"); ok {
				r.Cgroup = p
			}
		}
	}
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err == nil {
		r.NetNS = st.Ino
	}
	return r
}

func fail(r Result, stage string, err error) Result {
	r.Stage, r.Err = stage, err.Error()
	var errno unix.Errno
	if errors.As(err, &errno) {
		r.Errno = unix.ErrnoName(errno)
		if errno == unix.EWOULDBLOCK {
			r.Errno = "EAGAIN"
		}
	}
	return r
}

func (c *child) do(req Request) Result {
	timeout := 2 * time.Second
	if req.TimeoutMS > 0 {
		timeout = time.Duration(req.TimeoutMS) * time.Millisecond
	}
	switch req.Op {
	case OpTCP, OpUDP, OpUDPConnected:
		return c.open(req, timeout)
	case OpSend, OpGetpeername, OpClose:
		s, ok := c.socks[req.Sock]
		if !ok {
			return Result{Sock: req.Sock, Stage: "sock", Err: fmt.Sprintf("no socket %d", req.Sock)}
		}
		r := Result{Sock: req.Sock}
		switch req.Op {
		case OpClose:
			delete(c.socks, req.Sock)
			unix.Close(s.fd)
			return r
		case OpGetpeername:
			r.Local = sockname(s.fd)
			p, err := unix.Getpeername(s.fd)
			if err != nil {
				return fail(r, "getpeername", err)
			}
			r.Peer = format(p)
			return r
		}
		var to unix.Sockaddr
		if req.Addr != "" {
			sa, _, err := parse(req.Addr)
			if err != nil {
				return fail(r, "addr", err)
			}
			to = sa
		}
		if err := setTimeout(s.fd, timeout); err != nil {
			return fail(r, "socket", err)
		}
		return exchange(r, s, to, req)
	case OpInfo:
		return c.info()
	case OpConnectLoop:
		return connectLoop(req)
	}
	return Result{Stage: "op", Err: fmt.Sprintf("unknown op %q", req.Op)}
}

// open makes a socket for OpTCP, OpUDP or OpUDPConnected and runs the
// first exchange on it.
func (c *child) open(req Request, timeout time.Duration) (r Result) {
	dst, family, err := parse(req.Addr)
	if err != nil {
		return fail(r, "addr", err)
	}
	s := &sock{family: family, stream: req.Op == OpTCP}
	typ := unix.SOCK_DGRAM
	if s.stream {
		typ = unix.SOCK_STREAM
	}
	if s.fd, err = unix.Socket(family, typ|unix.SOCK_CLOEXEC, 0); err != nil {
		return fail(r, "socket", err)
	}
	defer func() {
		if req.Keep && r.Stage != "socket" {
			c.next++
			c.socks[c.next] = s
			r.Sock = c.next
		} else {
			unix.Close(s.fd)
		}
	}()
	if family == unix.AF_INET6 {
		if err := unix.SetsockoptInt(s.fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0); err != nil {
			return fail(r, "socket", err)
		}
	}
	if err := setTimeout(s.fd, timeout); err != nil {
		return fail(r, "socket", err)
	}
	if req.Bind != "" {
		sa, _, err := parse(req.Bind)
		if err == nil {
			err = unix.Bind(s.fd, sa)
		}
		if err != nil {
			return fail(r, "bind", err)
		}
	}
	if req.Op == OpUDP {
		return exchange(r, s, dst, req)
	}
	if err := connect(s.fd, dst); err != nil {
		r.Local = sockname(s.fd)
		return fail(r, "connect", err)
	}
	r.Local = sockname(s.fd)
	p, err := unix.Getpeername(s.fd)
	if err != nil {
		return fail(r, "getpeername", err)
	}
	r.Peer = format(p)
	return exchange(r, s, nil, req)
}

// connectLoop runs OpConnectLoop.
func connectLoop(req Request) (r Result) {
	if req.Count < 1 || req.Count > 1_000_000 {
		return fail(r, "op", fmt.Errorf("count %d out of 1..1000000", req.Count))
	}
	if len(req.Addrs) < 1 || len(req.Addrs) > 16 {
		return fail(r, "op", fmt.Errorf("%d addresses: 1..16", len(req.Addrs)))
	}
	type dest struct {
		sa     unix.Sockaddr
		family int
	}
	dests := make([]dest, len(req.Addrs))
	for i, a := range req.Addrs {
		sa, family, err := parse(a)
		if err != nil {
			return fail(r, "addr", err)
		}
		dests[i] = dest{sa, family}
	}
	reset := &unix.Linger{Onoff: 1, Linger: 0}
	r.ElapsedNS = make([]int64, len(dests))
	each := make([][]int64, len(dests))
	for i := range each {
		each[i] = make([]int64, 0, req.Count/len(dests)+1)
	}
	for n := range req.Count {
		i := n % len(dests)
		start := time.Now()
		fd, err := unix.Socket(dests[i].family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fail(r, "socket", err)
		}
		err = connect(fd, dests[i].sa)
		if err == nil {
			_, err = unix.Getpeername(fd)
		}
		if err == nil {
			err = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, reset)
		}
		unix.Close(fd)
		if err != nil {
			return fail(r, "connect", fmt.Errorf("%s: %w", req.Addrs[i], err))
		}
		took := time.Since(start).Nanoseconds()
		r.ElapsedNS[i] += took
		each[i] = append(each[i], took)
	}
	for _, e := range each {
		slices.Sort(e)
		r.MedianNS = append(r.MedianNS, e[len(e)/2])
	}
	return r
}

// exchange sends req.Send (to dst, or on the connected socket) and reads
// the reply.
func exchange(r Result, s *sock, dst unix.Sockaddr, req Request) Result {
	if req.Send != "" {
		var err error
		if dst != nil {
			err = unix.Sendto(s.fd, []byte(req.Send), unix.MSG_NOSIGNAL, dst)
		} else {
			_, err = unix.SendmsgN(s.fd, []byte(req.Send), nil, nil, unix.MSG_NOSIGNAL)
		}
		if r.Local == "" || strings.HasSuffix(r.Local, ":0") {
			r.Local = sockname(s.fd)
		}
		if err != nil {
			return fail(r, "send", err)
		}
	}
	if s.stream || dst == nil {
		if p, err := unix.Getpeername(s.fd); err == nil {
			r.Peer = format(p)
		}
	}
	if req.NoRecv {
		return r
	}
	buf := make([]byte, 64<<10)
	var data []byte
	for {
		n, from, err := unix.Recvfrom(s.fd, buf, 0)
		if err != nil {
			r.Data = string(data)
			return fail(r, "recv", err)
		}
		data = append(data, buf[:n]...)
		if from != nil {
			r.From = format(from)
		}
		if !s.stream || n == 0 || len(data) >= req.Read {
			break
		}
	}
	r.Data = string(data)
	return r
}

func setTimeout(fd int, d time.Duration) error {
	tv := unix.NsecToTimeval(d.Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return err
	}
	return unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
}

// parse turns "ip:port" into a sockaddr: AF_INET for an IPv4 address,
// AF_INET6 for anything else, IPv4-mapped addresses included.
func parse(s string) (unix.Sockaddr, int, error) {
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return nil, 0, err
	}
	if ap.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}, unix.AF_INET, nil
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}, unix.AF_INET6, nil
}

// format prints a sockaddr as netip does; an AF_INET6 address keeps its
// IPv4-mapped form.
func format(sa unix.Sockaddr) string {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port)).String()
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port)).String()
	}
	return fmt.Sprintf("%T", sa)
}

func sockname(fd int) string {
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return ""
	}
	return format(sa)
}

// connect is a blocking connect(2) that a signal does not fail: the Go
// runtime's preemption signal can interrupt it (EINTR) while the kernel
// goes on connecting, so an interrupted connect waits for the socket to
// become writable and reads the outcome from SO_ERROR.
func connect(fd int, sa unix.Sockaddr) error {
	err := unix.Connect(fd, sa)
	if err != unix.EINTR {
		return err
	}
	n := 0
	for {
		n, err = unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}, 10_000)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return err
	}
	if n == 0 {
		return unix.ETIMEDOUT
	}
	soerr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
	if err != nil {
		return err
	}
	if soerr != 0 {
		return unix.Errno(soerr)
	}
	return nil
}
