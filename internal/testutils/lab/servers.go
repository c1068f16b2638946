//go:build linux

package lab

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Server is a TCP and UDP server inside a VM that tells each client who
// it is: a TCP connection first receives "<vm name>\n" and is then echoed;
// a UDP datagram is answered with "<vm name>\n" followed by its payload.
type Server struct {
	vm    *VM
	ln    net.Listener
	pc    net.PacketConn
	wg    sync.WaitGroup
	mu    sync.Mutex
	conn  map[net.Conn]bool
	peers []netip.AddrPort
	seen  map[netip.AddrPort]bool // the set of peers: a lookup per connection, not a scan
}

// Serve starts a Server on port (TCP and UDP, both address families).
func (vm *VM) Serve(port uint16) (*Server, error) {
	return vm.serve(":" + strconv.Itoa(int(port)))
}

// ServeOn starts a Server bound to one address. A UDP reply then leaves
// from that address, which a backend behind routed DSR needs: a wildcard
// socket would answer from the interface's address instead of the VIP.
func (vm *VM) ServeOn(ap netip.AddrPort) (*Server, error) {
	return vm.serve(ap.String())
}

// Peers returns the client addresses the server has seen, in order of
// first contact: what a backend sees as its client (the SNAT address and
// port for a north-south NAT flow, the client itself otherwise).
func (s *Server) Peers() []netip.AddrPort {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.peers)
}

func (s *Server) sawPeer(a net.Addr) {
	var ap netip.AddrPort
	switch a := a.(type) {
	case *net.TCPAddr:
		ap = a.AddrPort()
	case *net.UDPAddr:
		ap = a.AddrPort()
	default:
		return
	}
	ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.seen[ap] {
		s.seen[ap] = true
		s.peers = append(s.peers, ap)
	}
}

func (vm *VM) serve(addr string) (*Server, error) {
	s := &Server{vm: vm, conn: map[net.Conn]bool{}, seen: map[netip.AddrPort]bool{}}
	err := vm.NS.Do(func() (err error) {
		if s.ln, err = net.Listen("tcp", addr); err != nil {
			return err
		}
		if s.pc, err = net.ListenPacket("udp", addr); err != nil {
			s.ln.Close()
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("lab: serve on %s %s: %w", vm.Name, addr, err)
	}
	s.wg.Add(2)
	go s.acceptLoop()
	go s.udpLoop()
	return s, nil
}

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.sawPeer(c.RemoteAddr())
		s.mu.Lock()
		s.conn[c] = true
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() {
				s.mu.Lock()
				delete(s.conn, c)
				s.mu.Unlock()
				c.Close()
			}()
			if _, err := io.WriteString(c, s.vm.Name+"\n"); err != nil {
				return
			}
			io.Copy(c, c)
		}()
	}
}

func (s *Server) udpLoop() {
	defer s.wg.Done()
	buf := make([]byte, 64<<10)
	for {
		n, from, err := s.pc.ReadFrom(buf)
		if err != nil {
			return
		}
		s.sawPeer(from)
		reply := append([]byte(s.vm.Name+"\n"), buf[:n]...)
		s.pc.WriteTo(reply, from)
	}
}

// Close stops the server and closes its open connections.
func (s *Server) Close() error {
	err := errors.Join(s.ln.Close(), s.pc.Close())
	s.mu.Lock()
	for c := range s.conn {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}

// Conn is a TCP connection from a VM through which the server's identity
// was read.
type Conn struct {
	net.Conn
	r *bufio.Reader
	// Backend is the name of the VM that answered.
	Backend string
}

// DialTCP connects from vm to addr and reads the server's identity line.
func (vm *VM) DialTCP(addr netip.AddrPort, timeout time.Duration) (*Conn, error) {
	c, err := vm.dialTCP(addr, timeout)
	if err != nil {
		return nil, err
	}
	c.SetReadDeadline(time.Now().Add(timeout))
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("lab: identity from %s: %w", addr, err)
	}
	c.SetReadDeadline(time.Time{})
	return &Conn{Conn: c, r: r, Backend: strings.TrimSpace(line)}, nil
}

// Echo writes msg and reads it back.
func (c *Conn) Echo(msg []byte, timeout time.Duration) error {
	c.SetDeadline(time.Now().Add(timeout))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write(msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c.r, got); err != nil {
		return err
	}
	if string(got) != string(msg) {
		return fmt.Errorf("lab: echo differs")
	}
	return nil
}

// AskUDP sends one datagram from vm to addr and returns the name of the VM
// that answered.
func (vm *VM) AskUDP(addr netip.AddrPort, timeout time.Duration) (string, error) {
	return vm.AskUDPFrom(addr, 0, timeout)
}

// AskUDPFrom is AskUDP from local port port (0: any). A test that wants a
// new flow names a port no earlier flow of its used: a socket on a port
// the kernel gives again continues the datapath's flow of that 5-tuple,
// which may still be pinned to another backend.
func (vm *VM) AskUDPFrom(addr netip.AddrPort, port uint16, timeout time.Duration) (string, error) {
	var c net.Conn
	err := vm.NS.Do(func() (err error) {
		d := net.Dialer{LocalAddr: &net.UDPAddr{Port: int(port)}}
		c, err = d.Dial("udp", addr.String())
		return err
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte("who")); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		return "", err
	}
	name, _, _ := strings.Cut(string(buf[:n]), "\n")
	return name, nil
}

// ServeBulk starts, on port (TCP, both families), a source that sends a
// stream of bytes to every client until the client goes away: the far end
// of a download. The source stops when the returned function is called
// (or the VM goes away).
func (vm *VM) ServeBulk(port uint16) (stop func(), err error) {
	var ln net.Listener
	err = vm.NS.Do(func() (err error) {
		ln, err = net.Listen("tcp", ":"+strconv.Itoa(int(port)))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("lab: bulk source on %s port %d: %w", vm.Name, port, err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	wg.Go(func() {
		buf := make([]byte, 256<<10)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				for {
					if _, err := c.Write(buf); err != nil {
						return // the client went away, or the source stopped
					}
				}
			})
		}
	})
	return func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}, nil
}

// Download reads from a TCP connection of vm to addr in the background,
// counting the bytes, until Close.
type Download struct {
	c    net.Conn
	n    atomic.Int64
	done chan struct{}
	err  error
}

// StartDownload connects from vm to addr and reads whatever comes.
func (vm *VM) StartDownload(addr netip.AddrPort, timeout time.Duration) (*Download, error) {
	c, err := vm.dialTCP(addr, timeout)
	if err != nil {
		return nil, err
	}
	d := &Download{c: c, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		buf := make([]byte, 256<<10)
		for {
			n, err := c.Read(buf)
			d.n.Add(int64(n))
			if err != nil {
				d.err = err
				return
			}
		}
	}()
	return d, nil
}

// Bytes is how many bytes have arrived so far.
func (d *Download) Bytes() int64 { return d.n.Load() }

// Mbps measures the download's rate over the next interval, in Mbit/s.
func (d *Download) Mbps(interval time.Duration) float64 {
	start := d.Bytes()
	time.Sleep(interval)
	return float64(d.Bytes()-start) * 8 / interval.Seconds() / 1e6
}

// Err is why the download ended, or nil while it runs.
func (d *Download) Err() error {
	select {
	case <-d.done:
		if d.err == nil {
			return io.EOF
		}
		return d.err
	default:
		return nil
	}
}

// Close ends the download.
func (d *Download) Close() error {
	err := d.c.Close()
	<-d.done
	return err
}

// dialTCP connects from inside vm's network namespace.
func (vm *VM) dialTCP(addr netip.AddrPort, timeout time.Duration) (c net.Conn, err error) {
	err = vm.NS.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", addr.String(), timeout)
		return err
	})
	return c, err
}
