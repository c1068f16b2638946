//go:build linux

package scenario

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
)

// perfRunConns runs the short-connection workload from workers goroutines
// for d or maxConns connections, whichever ends first.
func perfRunConns(ctx context.Context, dl *perfDialer, src netip.Addr, addr, want string, workers int, d time.Duration, maxConns int) (PerfSample, error) {
	var (
		budget   atomic.Int64
		mu       sync.Mutex
		lat      []time.Duration
		conn     []time.Duration
		s        PerfSample
		fatal    error
		wg       sync.WaitGroup
		firstErr string
	)
	budget.Store(int64(maxConns))
	start := time.Now()
	deadline := start.Add(d)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var my, myConn []time.Duration
			var ok, failed int
			var ferr string
			buf := make([]byte, 256)
			for ctx.Err() == nil && time.Now().Before(deadline) && budget.Add(-1) >= 0 {
				t0 := time.Now()
				dt, err := perfOneConn(ctx, dl, src, addr, want, buf)
				if errors.Is(err, errStrayThread) {
					mu.Lock()
					fatal = err
					mu.Unlock()
					// Returning while locked retires the
					// thread that is in the wrong namespace.
					return
				}
				if err != nil {
					if ctx.Err() != nil {
						break
					}
					failed++
					if ferr == "" {
						ferr = err.Error()
					}
					continue
				}
				ok++
				my = append(my, time.Since(t0))
				myConn = append(myConn, dt)
			}
			mu.Lock()
			lat = append(lat, my...)
			conn = append(conn, myConn...)
			s.OK += ok
			s.Failed += failed
			if firstErr == "" {
				firstErr = ferr
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	s.Elapsed = time.Since(start)
	s.FirstError = firstErr
	if fatal != nil {
		return s, fatal
	}
	if err := ctx.Err(); err != nil {
		return s, err
	}
	if len(lat) > 0 {
		slices.Sort(lat)
		s.P50 = lat[len(lat)/2]
		s.P99 = lat[min(len(lat)-1, len(lat)*99/100)]
		slices.Sort(conn)
		s.ConnectP50 = conn[len(conn)/2]
		s.ConnectP99 = conn[min(len(conn)-1, len(conn)*99/100)]
	}
	return s, nil
}

// perfOneConn is one short connection: connect, read the server's identity
// line (it must be want), write 4 bytes, read them back, close.
func perfOneConn(ctx context.Context, dl *perfDialer, src netip.Addr, addr, want string, buf []byte) (connect time.Duration, err error) {
	t0 := time.Now()
	c, err := dl.dial(ctx, src, addr)
	if err != nil {
		return 0, err
	}
	connect = time.Since(t0)
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(perfOpTimeout)); err != nil {
		return connect, err
	}
	n := 0
	for {
		m, err := c.Read(buf[n:])
		n += m
		if i := bytes.IndexByte(buf[:n], '\n'); i >= 0 {
			if string(buf[:i]) != want || i+1 != n {
				return connect, fmt.Errorf("identity %q, want %q", buf[:n], want+"\n")
			}
			break
		}
		if err != nil {
			return connect, fmt.Errorf("identity: %w", err)
		}
		if n == len(buf) {
			return connect, fmt.Errorf("identity too long: %q", buf[:n])
		}
	}
	ping := []byte("ping")
	if _, err := c.Write(ping); err != nil {
		return connect, err
	}
	if _, err := io.ReadFull(c, buf[:len(ping)]); err != nil {
		return connect, fmt.Errorf("echo: %w", err)
	}
	if !bytes.Equal(buf[:len(ping)], ping) {
		return connect, fmt.Errorf("echo %q, want %q", buf[:len(ping)], ping)
	}
	return connect, nil
}

// perfRunBulk runs streams parallel streams into the sink for d.
func perfRunBulk(ctx context.Context, dl *perfDialer, src netip.Addr, addr string, streams int, d time.Duration) (PerfSample, error) {
	type result struct {
		bytes   int64
		elapsed time.Duration
		err     error
	}
	res := make([]result, streams)
	conns := make([]net.Conn, streams)
	var s PerfSample
	for i := range streams {
		// Dial on a goroutine of its own: a failed return to the
		// home namespace must retire its thread, not ours.
		done := make(chan struct{})
		go func() {
			defer close(done)
			conns[i], res[i].err = dl.dial(ctx, src, addr)
		}()
		<-done
		if errors.Is(res[i].err, errStrayThread) {
			perfCloseAll(conns)
			return s, res[i].err
		}
	}
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	for i := range streams {
		if res[i].err != nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i].bytes, res[i].err = perfStream(ctx, conns[i], deadline)
			res[i].elapsed = time.Since(start)
		}()
	}
	wg.Wait()
	perfCloseAll(conns)
	for _, r := range res {
		if r.err != nil {
			s.Failed++
			if s.FirstError == "" {
				s.FirstError = r.err.Error()
			}
			continue
		}
		s.OK++
		s.Bytes += r.bytes
		s.Elapsed = max(s.Elapsed, r.elapsed)
	}
	return s, ctx.Err()
}

func perfCloseAll(cs []net.Conn) {
	for _, c := range cs {
		if c != nil {
			c.Close()
		}
	}
}

// perfStream writes into a sink connection until deadline, ends its half and
// returns the byte count the sink reports.
func perfStream(ctx context.Context, c net.Conn, deadline time.Time) (int64, error) {
	buf := make([]byte, 256<<10)
	var sent int64
	for ctx.Err() == nil && time.Now().Before(deadline) {
		if err := c.SetWriteDeadline(time.Now().Add(perfOpTimeout)); err != nil {
			return 0, err
		}
		n, err := c.Write(buf)
		sent += int64(n)
		if err != nil {
			return 0, err
		}
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return 0, err
	}
	if err := c.SetReadDeadline(time.Now().Add(perfFinalTimeout)); err != nil {
		return 0, err
	}
	var count [8]byte
	if _, err := io.ReadFull(c, count[:]); err != nil {
		return 0, fmt.Errorf("sink count: %w", err)
	}
	got := int64(binary.BigEndian.Uint64(count[:]))
	if got != sent {
		return got, fmt.Errorf("sink received %d bytes of %d", got, sent)
	}
	return got, nil
}

// perfSink is a TCP listener in a VM that reads each connection to its end
// and then answers with the number of bytes it read (8 bytes, big endian).
type perfSink struct {
	ln    net.Listener
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]bool
}

func startPerfSink(vm *lab.VM, port uint16) (*perfSink, error) {
	s := &perfSink{conns: map[net.Conn]bool{}}
	err := vm.NS.Do(func() (err error) {
		s.ln, err = net.Listen("tcp4", ":"+strconv.Itoa(int(port)))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("sink on %s: %w", vm.Name, err)
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := s.ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns[c] = true
			s.mu.Unlock()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer func() {
					s.mu.Lock()
					delete(s.conns, c)
					s.mu.Unlock()
					c.Close()
				}()
				buf := make([]byte, 256<<10)
				var n int64
				for {
					m, err := c.Read(buf)
					n += int64(m)
					if err == io.EOF {
						break
					}
					if err != nil {
						return
					}
				}
				var count [8]byte
				binary.BigEndian.PutUint64(count[:], uint64(n))
				c.SetWriteDeadline(time.Now().Add(perfOpTimeout))
				c.Write(count[:])
			}()
		}
	}()
	return s, nil
}

// perfAddAddrs adds IPv4 addresses (/24) to the VM's eth0.
func perfAddAddrs(vm *lab.VM, addrs ...netip.Addr) error {
	h, err := netlink.NewHandleAt(vm.NS.Handle())
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", vm.Name, err)
	}
	defer h.Close()
	l, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("%s eth0: %w", vm.Name, err)
	}
	for _, a := range addrs {
		ipn := &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(24, 32)}
		if err := h.AddrAdd(l, &netlink.Addr{IPNet: ipn}); err != nil {
			return fmt.Errorf("add %s to %s: %w", a, vm.Name, err)
		}
	}
	return nil
}

func (s *perfSink) close() {
	s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// errStrayThread means a dialing thread could not return to the home
// namespace; the goroutine that saw it must end so that the runtime
// retires the thread.
var errStrayThread = errors.New("scenario: could not leave the client namespace")

// perfDialer dials TCP connections whose sockets belong to a VM's network
// namespace. A socket belongs to the namespace of the thread that created
// it, so dial enters ns on a locked thread for socket(2) only and leaves
// in the dialer's Control hook, before connect(2) can park the goroutine:
// everything else runs on ordinary goroutines and threads, as a client
// inside the VM would, without a thread handoff per blocking call.
type perfDialer struct {
	ns   *nsutil.NS
	home netns.NsHandle
}

func newPerfDialer(ns *nsutil.NS) (*perfDialer, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	home, err := netns.Get()
	if err != nil {
		return nil, fmt.Errorf("current netns: %w", err)
	}
	return &perfDialer{ns: ns, home: home}, nil
}

func (d *perfDialer) close() {
	if d.ns != nil {
		d.home.Close()
	}
}

// dial connects from src to addr (IPv4 "a.b.c.d:port") in the namespace.
// The port is chosen at connect(2) (IP_BIND_ADDRESS_NO_PORT), as without
// a bind, so ports are shared between destinations. On errStrayThread the
// calling goroutine stays locked to its thread and must end. A dialer
// without ns (a perf worker's, which runs in the client's namespace)
// dials with the same options and switches nothing.
func (d *perfDialer) dial(ctx context.Context, src netip.Addr, addr string) (net.Conn, error) {
	if d.ns == nil {
		return d.dialerFrom(src, func() error { return nil }).DialContext(ctx, "tcp4", addr)
	}
	runtime.LockOSThread()
	if err := netns.Set(d.ns.Handle()); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("enter %s: %w", d.ns.Name, err)
	}
	inside := true
	var leaveErr error
	leave := func() error {
		if inside {
			inside = false
			if leaveErr = netns.Set(d.home); leaveErr == nil {
				runtime.UnlockOSThread()
			}
		}
		return leaveErr
	}
	nd := d.dialerFrom(src, leave)
	c, err := nd.DialContext(ctx, "tcp4", addr)
	if lerr := leave(); lerr != nil {
		if c != nil {
			c.Close()
		}
		return nil, fmt.Errorf("%w: %v", errStrayThread, lerr)
	}
	return c, err
}

// dialerFrom is the net.Dialer of dial: from src, its port chosen at
// connect(2), leave called after socket(2), before bind(2) and connect(2).
func (d *perfDialer) dialerFrom(src netip.Addr, leave func() error) *net.Dialer {
	return &net.Dialer{
		Timeout:   perfOpTimeout,
		KeepAlive: -1,
		LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0)),
		ControlContext: func(_ context.Context, _, _ string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_BIND_ADDRESS_NO_PORT, 1)
			}); err != nil {
				serr = err
			}
			return errors.Join(leave(), serr)
		},
	}
}
