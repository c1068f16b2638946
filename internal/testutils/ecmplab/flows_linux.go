//go:build linux

package ecmplab

import (
	"fmt"
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
	tcp     *lab.Conn // the TCP connection (nil for UDP)
}

// Dial opens a flow from client c to vip:port (network "tcp" or "udp")
// and exchanges one message: the backend's identity line (TCP), or one
// datagram and its answer (UDP, retried twice: the first may meet an
// unresolved neighbour).
func Dial(c *lab.VM, network string, vip netip.AddrPort, timeout time.Duration) (*Flow, error) {
	f := &Flow{Client: c, VIP: vip, Proto: conntrack.ProtoTCP}
	switch network {
	case "udp":
	case "tcp":
		tc, err := c.DialTCP(vip, timeout)
		if err != nil {
			return nil, fmt.Errorf("ecmplab: %s tcp %s: %w", c.Name, vip, err)
		}
		f.tcp, f.conn, f.Backend = tc, tc, tc.Backend
		f.Local = netip.MustParseAddrPort(tc.LocalAddr().String())
		return f, nil
	default:
		return nil, fmt.Errorf("ecmplab: network %q: want tcp or udp", network)
	}
	f.Proto = conntrack.ProtoUDP
	err := c.NS.Do(func() (err error) {
		f.conn, err = net.DialTimeout("udp4", vip.String(), timeout)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("ecmplab: %s udp %s: %w", c.Name, vip, err)
	}
	f.Local = netip.MustParseAddrPort(f.conn.LocalAddr().String())
	for range 3 { // the first datagram may meet an unresolved neighbour
		if f.Backend, err = f.ask(timeout); err == nil {
			return f, nil
		}
	}
	f.conn.Close()
	return nil, fmt.Errorf("ecmplab: %s udp %s: first exchange: %w", c.Name, vip, err)
}

// ask sends "who" over the UDP socket and returns the name in the answer
// ("<name>\nwho").
func (f *Flow) ask(timeout time.Duration) (string, error) {
	f.conn.SetDeadline(time.Now().Add(timeout))
	defer f.conn.SetDeadline(time.Time{})
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

// Ping checks the flow still works end to end: a TCP connection echoes
// a message back; a UDP socket is answered by the same backend.
func (f *Flow) Ping(timeout time.Duration) error {
	if f.tcp != nil {
		return f.tcp.Echo([]byte("ping\n"), timeout)
	}
	name, err := f.ask(timeout)
	if err == nil && name != f.Backend {
		err = fmt.Errorf("answered by %s, was %s", name, f.Backend)
	}
	return err
}

// Close closes the flow's socket.
func (f *Flow) Close() error { return f.conn.Close() }

// Key is the flow's conntrack key.
func (f *Flow) Key() conntrack.Key { return conntrack.Key{Client: f.Local, VIP: f.VIP, Proto: f.Proto} }

// EdgeOf returns the edge whose flow table holds f (read from its pinned
// conntrack map) and the entry: the edge the router sent the flow to.
// With the flow on several edges (moved by a route change) it returns the
// one that saw it last; none is an error. The maps are opened once per
// edge; when no edge holds the flow they are opened again and looked up
// once more, since a daemon replaces its maps when it grows them (docs/
// operations.md, "Maps sized by need") or restarts at another tier.
// Safe for concurrent use (the lookups are serialised).
func (l *Lab) EdgeOf(f *Flow) (*Edge, conntrack.Entry, error) {
	l.flowMu.Lock()
	defer l.flowMu.Unlock()
	for try := 0; ; try++ {
		e, en := l.edgeOf(f)
		if e != nil {
			return e, en, nil
		}
		if try == 1 {
			return nil, en, fmt.Errorf("ecmplab: flow %s -> %s on no edge", f.Local, f.VIP)
		}
		for _, e := range l.Edges {
			e.closeMaps()
		}
	}
}

func (l *Lab) edgeOf(f *Flow) (*Edge, conntrack.Entry) {
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
	return best, found
}

// Holders are the running edges whose flow table holds f, with their
// entries: in a group every edge once replicated.
func (l *Lab) Holders(f *Flow) ([]*Edge, []conntrack.Entry) {
	l.flowMu.Lock()
	defer l.flowMu.Unlock()
	var es []*Edge
	var ens []conntrack.Entry
	for _, e := range l.Edges {
		if !e.Running() {
			continue
		}
		ct, err := e.Conntrack()
		if err != nil {
			continue
		}
		if en, err := ct.Lookup(f.Key()); err == nil {
			es, ens = append(es, e), append(ens, en)
		}
	}
	return es, ens
}
