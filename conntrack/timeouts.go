package conntrack

import (
	"errors"
	"fmt"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
)

// ErrInvalidTimeout reports a timeout out of bounds; see Timeouts.Validate.
var ErrInvalidTimeout = errors.New("invalid conntrack timeout")

// Bounds of every timeout.
const (
	// MinTimeout is twice the datapath's refresh interval: a flow that
	// sends all the time has its deadline pushed at most once a second, so
	// a shorter timeout would let GC remove busy flows between refreshes.
	MinTimeout = 2 * time.Second
	// MaxTimeout caps how long an idle entry may hold a slot of the LRU
	// maps. A week is far beyond any sensible idle timeout; longer values
	// are a unit mistake more often than an intent.
	MaxTimeout = 7 * 24 * time.Hour
)

// Timeouts are the idle timeouts of conntrack entries by protocol state:
// the datapath sets an entry's deadline to its last packet plus the
// timeout of its state, and GC removes it once the deadline has passed.
//
// The datapath reads them from the meta map (ApplyTo fills its fields), in
// whole seconds. The zero Timeouts is not valid; start from
// DefaultTimeouts and change what you need.
type Timeouts struct {
	TCPSyn         time.Duration // handshake begun, not complete (default 60 s)
	TCPEstablished time.Duration // handshake complete (default 6 h)
	TCPFin         time.Duration // a FIN seen in either direction (default 30 s)
	TCPRst         time.Duration // a RST seen in either direction (default 10 s)
	UDP            time.Duration // any UDP flow (default 60 s)
}

// DefaultTimeouts returns the datapath's built-in timeouts
// (bpf.DefaultTimeout*), which it also uses wherever the meta map holds 0.
func DefaultTimeouts() Timeouts {
	return Timeouts{
		TCPSyn:         time.Duration(bpf.DefaultTimeoutTCPSyn) * time.Second,
		TCPEstablished: time.Duration(bpf.DefaultTimeoutTCPEstablished) * time.Second,
		TCPFin:         time.Duration(bpf.DefaultTimeoutTCPFin) * time.Second,
		TCPRst:         time.Duration(bpf.DefaultTimeoutTCPRst) * time.Second,
		UDP:            time.Duration(bpf.DefaultTimeoutUDP) * time.Second,
	}
}

func (t Timeouts) fields() [5]struct {
	name string
	d    time.Duration
} {
	return [5]struct {
		name string
		d    time.Duration
	}{{"tcp syn", t.TCPSyn}, {"tcp established", t.TCPEstablished}, {"tcp fin", t.TCPFin}, {"tcp rst", t.TCPRst}, {"udp", t.UDP}}
}

// Validate checks that every timeout lies in [MinTimeout, MaxTimeout] and
// is a whole number of seconds (the meta map stores seconds, and rounding
// silently would make the datapath disagree with what was configured).
// Errors match ErrInvalidTimeout.
func (t Timeouts) Validate() error {
	var errs []error
	for _, f := range t.fields() {
		switch {
		case f.d == 0:
			errs = append(errs, fmt.Errorf("%s timeout is not set", f.name))
		case f.d < MinTimeout || f.d > MaxTimeout:
			errs = append(errs, fmt.Errorf("%s timeout %v is outside [%v, %v]", f.name, f.d, MinTimeout, MaxTimeout))
		case f.d%time.Second != 0:
			errs = append(errs, fmt.Errorf("%s timeout %v is not a whole number of seconds", f.name, f.d))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("conntrack: %w: %w", ErrInvalidTimeout, errors.Join(errs...))
	}
	return nil
}

// For returns the timeout of state s. States the datapath does not define
// take the UDP timeout, as the datapath's own lookup does.
func (t Timeouts) For(s bpf.CTState) time.Duration {
	switch s {
	case bpf.CTTCPSyn:
		return t.TCPSyn
	case bpf.CTTCPEstablished:
		return t.TCPEstablished
	case bpf.CTTCPFin:
		return t.TCPFin
	case bpf.CTTCPRst:
		return t.TCPRst
	}
	return t.UDP
}

// ApplyTo validates t and writes it into the timeout fields of a meta map
// value, leaving every other field alone. The loader owns the meta map:
// it reads the current value, applies the timeouts and writes it back.
func (t Timeouts) ApplyTo(m *bpf.Meta) error {
	if m == nil {
		return errors.New("conntrack: apply timeouts: nil meta")
	}
	if err := t.Validate(); err != nil {
		return err
	}
	secs := func(d time.Duration) uint32 { return uint32(d / time.Second) }
	m.TimeoutTcpSynS = secs(t.TCPSyn)
	m.TimeoutTcpEstablishedS = secs(t.TCPEstablished)
	m.TimeoutTcpFinS = secs(t.TCPFin)
	m.TimeoutTcpRstS = secs(t.TCPRst)
	m.TimeoutUdpS = secs(t.UDP)
	return nil
}

// TimeoutsFromMeta returns the timeouts the datapath uses with meta value
// m: its fields in seconds, with the built-in default wherever a field
// is 0.
func TimeoutsFromMeta(m bpf.Meta) Timeouts {
	def := DefaultTimeouts()
	pick := func(s uint32, d time.Duration) time.Duration {
		if s == 0 {
			return d
		}
		return time.Duration(s) * time.Second
	}
	return Timeouts{
		TCPSyn:         pick(m.TimeoutTcpSynS, def.TCPSyn),
		TCPEstablished: pick(m.TimeoutTcpEstablishedS, def.TCPEstablished),
		TCPFin:         pick(m.TimeoutTcpFinS, def.TCPFin),
		TCPRst:         pick(m.TimeoutTcpRstS, def.TCPRst),
		UDP:            pick(m.TimeoutUdpS, def.UDP),
	}
}
