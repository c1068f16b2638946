package flows

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
)

// MaxLimit is the most records one Read returns.
const MaxLimit = 4096

// Errors of Read, checkable with errors.Is.
var (
	// ErrLimit: a limit below 1 or above MaxLimit.
	ErrLimit = errors.New("flows: limit out of range")
)

// Filter selects records; its zero value selects all.
type Filter struct {
	// Service keeps the records of the service of that name.
	Service string
	// Backend keeps the records of flows sent to that address (any port).
	Backend netip.Addr
	// Verdict keeps the records with that verdict.
	Verdict Verdict
	// Since keeps the records of flows seen at or after that time.
	Since time.Time
}

func (f Filter) keep(r *Record) bool {
	return (f.Service == "" || r.Service == f.Service) &&
		(!f.Backend.IsValid() || r.Backend.Addr() == f.Backend.Unmap()) &&
		(f.Verdict == "" || r.Verdict == f.Verdict) &&
		(f.Since.IsZero() || !r.LastSeen.Before(f.Since))
}

// Reader reads the records of a datapath's fluxvm_sflows ring.
type Reader struct {
	// Ring and Seq are the maps fluxvm_sflows and fluxvm_flow_seq.
	Ring, Seq *ebpf.Map
	// Service names a service id (a frontend's); nil or "" leaves
	// Record.Service empty.
	Service func(id uint32) string
	// Interface names an interface index; nil or "" gives "if<index>".
	Interface func(index int) string
	// Now returns the datapath's clock (bpf.Now) and the wall clock at
	// the same moment, to date records; nil uses bpf.Now and time.Now.
	Now func() (time.Duration, time.Time, error)
}

// Read returns up to limit records that f keeps, newest first (by when
// the datapath opened them). It walks back through the ring from the
// newest record and stops at limit or at the oldest record the ring still
// holds: at most the ring's size of lookups.
func (r *Reader) Read(limit int, f Filter) ([]Record, error) {
	if limit < 1 || limit > MaxLimit {
		return nil, fmt.Errorf("%w: %d, want 1..%d", ErrLimit, limit, MaxLimit)
	}
	if r.Ring == nil || r.Seq == nil {
		return nil, errors.New("flows: read: no maps")
	}
	var seq uint64
	if err := r.Seq.Lookup(uint32(0), &seq); err != nil {
		return nil, fmt.Errorf("flows: read the sequence: %w", err)
	}
	now := r.Now
	if now == nil {
		now = func() (time.Duration, time.Time, error) {
			mono, err := bpf.Now()
			return mono, time.Now(), err
		}
	}
	mono, wall, err := now()
	if err != nil {
		return nil, fmt.Errorf("flows: read: %w", err)
	}
	slots := uint64(r.Ring.MaxEntries())
	var out []Record
	var rec bpf.FlowRecord
	for n := uint64(0); n < slots && n < seq && len(out) < limit; n++ {
		s := seq - n
		if err := r.Ring.Lookup(uint32(s&(slots-1)), &rec); err != nil {
			return nil, fmt.Errorf("flows: read slot %d: %w", s&(slots-1), err)
		}
		if rec.Seq != s {
			continue // overwritten since the sequence was read, or never written
		}
		out2 := r.record(&rec, mono, wall)
		if f.keep(&out2) {
			out = append(out, out2)
		}
	}
	return out, nil
}

// record converts a datapath record; mono and wall are one moment on the
// datapath's clock and the wall clock.
func (r *Reader) record(f *bpf.FlowRecord, mono time.Duration, wall time.Time) Record {
	at := func(ns uint64) time.Time { return wall.Add(time.Duration(ns) - mono) }
	ap := func(a [4]uint32, p uint16) netip.AddrPort {
		addr := bpf.Addr(a, f.Family)
		if addr.IsUnspecified() && p == 0 {
			return netip.AddrPort{}
		}
		return netip.AddrPortFrom(addr, bpf.Port(p))
	}
	out := Record{
		Seq:       f.Seq,
		ServiceID: f.ServiceId,
		BackendID: f.BackendId,
		Protocol:  protocol(f.Proto),
		Client:    ap(f.Client, f.Cport),
		VIP:       ap(f.Vip, f.Vport),
		Backend:   ap(f.Backend, f.Bport),
		SNAT:      ap(f.Snat, f.SnatPort),
		Verdict:   Verdict(bpf.FlowVerdict(f.Verdict).String()),
		Hook:      bpf.FlowHook(f.Hook).String(),
		FirstSeen: at(f.FirstNs),
		LastSeen:  at(f.LastNs),
		Forward:   Counts{Packets: f.FwdPackets, Bytes: f.FwdBytes},
		Reply:     Counts{Packets: f.RevPackets, Bytes: f.RevBytes},
		Drops:     uint64(f.Drops),
	}
	if f.Reason != 0 {
		out.Reason = bpf.DropReason(f.Reason).String()
	}
	if r.Service != nil {
		out.Service = r.Service(f.ServiceId)
	}
	if f.Ifindex != 0 {
		if r.Interface != nil {
			out.Interface = r.Interface(int(f.Ifindex))
		}
		if out.Interface == "" {
			out.Interface = fmt.Sprintf("if%d", f.Ifindex)
		}
	}
	return out
}

func protocol(p uint8) string {
	switch p {
	case 6:
		return "tcp"
	case 17:
		return "udp"
	}
	return fmt.Sprintf("proto%d", p)
}
