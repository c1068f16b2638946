//go:build linux

package ecmplab

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// Flow is one client connection (TCP) or socket (UDP) to a VIP, with the
// backend that answered its first exchange.
type Flow struct {
	Client *lab.VM
	Proto  uint8 // conntrack.ProtoTCP or ProtoUDP
	// Local is the client's address and source port, VIP the frontend.
	Local, VIP netip.AddrPort
	// Backend is the name of the backend that answered first.
	Backend string
	conn    net.Conn
	rd      *bufio.Reader
}

// Dial opens a flow from client c to vip:port (network "tcp" or "udp")
// and exchanges one message: the backend's identity line (TCP), or one
// datagram and its answer (UDP, retried twice: the first may meet an
// unresolved neighbour).
func Dial(c *lab.VM, network string, vip netip.AddrPort, timeout time.Duration) (*Flow, error) {
	f := &Flow{Client: c, VIP: vip, Proto: conntrack.ProtoTCP}
	if network == "udp" {
		f.Proto = conntrack.ProtoUDP
	}
	err := c.NS.Do(func() (err error) {
		f.conn, err = net.DialTimeout(network+"4", vip.String(), timeout)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("ecmplab: %s dial %s %s: %w", c.Name, network, vip, err)
	}
	f.Local = netip.MustParseAddrPort(f.conn.LocalAddr().String())
	f.rd = bufio.NewReader(f.conn)
	for try := 0; ; try++ {
		if f.Backend, err = f.exchange(timeout); err == nil || f.Proto == conntrack.ProtoTCP || try == 2 {
			break
		}
	}
	if err != nil {
		f.conn.Close()
		return nil, fmt.Errorf("ecmplab: %s %s -> %s: first exchange: %w", c.Name, network, vip, err)
	}
	return f, nil
}

// exchange is the first message: TCP reads the identity line, UDP sends
// "who" and reads "<name>\nwho".
func (f *Flow) exchange(timeout time.Duration) (string, error) {
	f.conn.SetDeadline(time.Now().Add(timeout))
	defer f.conn.SetDeadline(time.Time{})
	if f.Proto == conntrack.ProtoUDP {
		if _, err := f.conn.Write([]byte("who")); err != nil {
			return "", err
		}
		buf := make([]byte, 512)
		n, err := f.conn.Read(buf)
		if err != nil {
			return "", err
		}
		name, _, _ := strings.Cut(string(buf[:n]), "\n")
		return name, nil
	}
	line, err := f.rd.ReadString('\n')
	return strings.TrimSpace(line), err
}

// Ping checks the flow still works end to end: a TCP connection echoes
// a message back; a UDP socket is answered by the same backend.
func (f *Flow) Ping(timeout time.Duration) error {
	if f.Proto == conntrack.ProtoUDP {
		name, err := f.exchange(timeout)
		if err == nil && name != f.Backend {
			err = fmt.Errorf("answered by %s, was %s", name, f.Backend)
		}
		return err
	}
	msg := []byte("ping\n")
	f.conn.SetDeadline(time.Now().Add(timeout))
	defer f.conn.SetDeadline(time.Time{})
	if _, err := f.conn.Write(msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(f.rd, got); err != nil {
		return err
	}
	if string(got) != string(msg) {
		return errors.New("echo differs")
	}
	return nil
}

// Close closes the flow's socket.
func (f *Flow) Close() error { return f.conn.Close() }

// Key is the flow's conntrack key.
func (f *Flow) Key() conntrack.Key { return conntrack.Key{Client: f.Local, VIP: f.VIP, Proto: f.Proto} }

// EdgeOf returns the edge whose flow table holds f (read from its pinned
// conntrack map) and the entry: the edge the router sent the flow to.
// With the flow on several edges (moved by a route change) it returns the
// one that saw it last; none is an error.
func (l *Lab) EdgeOf(f *Flow) (*Edge, conntrack.Entry, error) {
	var best *Edge
	var found conntrack.Entry
	for _, e := range l.Edges {
		ct, err := e.Conntrack()
		if err != nil {
			continue // not started yet
		}
		en, err := ct.Lookup(f.Key())
		if err != nil {
			continue
		}
		if best == nil || en.LastSeen > found.LastSeen {
			best, found = e, en
		}
	}
	if best == nil {
		return nil, found, fmt.Errorf("ecmplab: flow %s -> %s on no edge", f.Local, f.VIP)
	}
	return best, found, nil
}
