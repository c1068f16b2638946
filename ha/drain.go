package ha

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
)

// Drainer turns the datapath's mutation queue (fluxvm_haq) into journal
// operations, read with one bpf() call per record through cilium/ebpf's
// ring-buffer reader. While HA replication is on, the datapath (TC only)
// queues a record of a north-south flow (SNAT or DSR: the flows a standby
// edge takes over; east-west flows, the node's own VMs', and L7 flows are
// never queued) when its forward path writes a new conntrack entry (new
// flow, re-pick, failover), when a conntrack hit,
// forward or reply, changes the entry's state (SYN -> ESTABLISHED, FIN,
// RST), and when a hit's refresh pushes the entry's deadline past the one
// the standby holds. Each record is one upsert of the flow: its state, and
// its created/last-seen/deadline as ages and a TTL in which the record's
// hold (half its state's timeout) is included, so that the standby's copy
// never expires before the active's entry while the datapath refreshes it
// only once per half timeout of a busy flow (bpf/lib/ha.h has the rule). A
// record the datapath had no room for is counted in fluxvm_hadrop; Stats
// reports them, and the caller's periodic snapshot-diff (Export against
// the target) is what restores them.
type Drainer struct {
	rd      *ringbuf.Reader
	drop    *ebpf.Map
	journal func(sid uint32) *Journal
	clock   func() (time.Duration, error)
	read    atomic.Uint64
	skipped atomic.Uint64
}

// DrainerConfig names what a Drainer reads and where its operations go.
type DrainerConfig struct {
	// Queue is fluxvm_haq, Drops fluxvm_hadrop.
	Queue, Drops *ebpf.Map
	// Journal is the journal of the service datapath service sid belongs
	// to, nil when the service is not replicated (its records are
	// skipped).
	Journal func(sid uint32) *Journal
	// Now is the node's datapath clock (conntrack.Now when nil).
	Now func() (time.Duration, error)
}

// NewDrainer opens a reader on the queue.
func NewDrainer(cfg DrainerConfig) (*Drainer, error) {
	if cfg.Queue == nil || cfg.Drops == nil || cfg.Journal == nil {
		return nil, errors.New("ha: drainer: the queue, its drop counter and the journals are required")
	}
	rd, err := ringbuf.NewReader(cfg.Queue)
	if err != nil {
		return nil, fmt.Errorf("ha: drainer: %w", err)
	}
	return &Drainer{rd: rd, drop: cfg.Drops, journal: cfg.Journal, clock: clockOr(cfg.Now)}, nil
}

// Close stops the reader; a Run in progress returns.
func (d *Drainer) Close() error { return d.rd.Close() }

// Run drains the queue until ctx ends or the Drainer is closed.
func (d *Drainer) Run(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { d.rd.Close() })
	defer stop()
	for {
		if _, err := d.drainOne(time.Time{}); err != nil {
			if errors.Is(err, ringbuf.ErrClosed) || ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
	}
}

// Drain reads the records queued for at most wait and returns how many it
// turned into operations.
func (d *Drainer) Drain(wait time.Duration) (int, error) {
	n := 0
	deadline := time.Now().Add(wait)
	for {
		ok, err := d.drainOne(deadline)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
		if ok {
			n++
		}
	}
}

// drainOne reads one record (until deadline, zero: no deadline) and
// records it in its service's journal.
func (d *Drainer) drainOne(deadline time.Time) (bool, error) {
	d.rd.SetDeadline(deadline)
	rec, err := d.rd.Read()
	if err != nil {
		return false, err
	}
	d.read.Add(1)
	var r bpf.HARecord
	if len(rec.RawSample) < int(unsafe.Sizeof(r)) {
		d.skipped.Add(1)
		return false, nil
	}
	if err := binary.Read(bytes.NewReader(rec.RawSample[:unsafe.Sizeof(r)]), binary.LittleEndian, &r); err != nil {
		return false, fmt.Errorf("ha: drainer: %w", err)
	}
	j := d.journal(r.Ct.ServiceId)
	if j == nil {
		return false, nil
	}
	now, err := d.clock()
	if err != nil {
		return false, fmt.Errorf("ha: drainer: %w", err)
	}
	f, ok := recordFlow(&r, now)
	if !ok {
		d.skipped.Add(1)
		return false, nil
	}
	// A fenced journal (this edge lost its lease) takes nothing: the
	// record is skipped, the other services' records go on.
	if err := j.Record(Op{Kind: OpUpsert, Flow: &f}); err != nil {
		d.skipped.Add(1)
		return false, nil
	}
	return true, nil
}

// recordFlow is the Flow of datapath record r at the node's clock now;
// false for a record of no flow the package replicates. Every cause
// (bpf.HANew, HATransition, HARefresh) is the same upsert of the whole
// flow. r.Ct.L7Ifindex of a replicated (SNAT or DSR) entry is the
// datapath's own bookkeeping and is not read.
func recordFlow(r *bpf.HARecord, now time.Duration) (Flow, bool) {
	if r.Op != bpf.HAUpsert {
		return Flow{}, false
	}
	fam := r.Family
	kind := conntrack.Kind(r.Ct.Flags & (bpf.CTFlagSNAT | bpf.CTFlagDSR | bpf.CTFlagL7))
	f := Flow{
		Client:         netip.AddrPortFrom(bpf.Addr(r.Client, fam), bpf.Port(r.Cport)),
		VIP:            netip.AddrPortFrom(bpf.Addr(r.Vip, fam), bpf.Port(r.Vport)),
		Backend:        netip.AddrPortFrom(bpf.Addr(r.Backend, fam), bpf.Port(r.Bport)),
		Proto:          r.Proto,
		Kind:           kind,
		State:          bpf.CTState(r.Ct.State),
		ReverseDerived: kind == conntrack.EastWest && r.Ct.Flags&bpf.CTFlagRevDerived != 0,
		Audited:        r.Ct.Flags&bpf.CTFlagAudited != 0,
		Age:            max(now-time.Duration(r.Ct.CreatedNs), 0),
		Idle:           max(now-time.Duration(r.Ct.LastSeenNs), 0),
		// The standby keeps the flow HoldS past the entry's deadline: the
		// datapath sends the next refresh only once the entry's deadline
		// passes that (bpf/lib/ha.h).
		TTL: max(time.Duration(r.Ct.DeadlineNs)+time.Duration(r.HoldS)*time.Second-now, 0),
	}
	if f.Kind == conntrack.SNAT {
		f.SNAT = netip.AddrPortFrom(bpf.Addr(r.Ct.NatAddr, fam), bpf.Port(r.Ct.NatPort))
	}
	if f.Kind == conntrack.SNAT || (f.Kind == conntrack.EastWest && !f.ReverseDerived) {
		f.NAT = &NATHalf{Idle: f.Idle} // learned with the entry
	}
	return f, f.check() == nil
}

// Stats counts what a Drainer did: records read, records skipped (of no
// flow replicated: L7, malformed), and the records the datapath dropped
// (fluxvm_hadrop, since it was loaded).
func (d *Drainer) Stats() (read, skipped, dropped uint64, err error) {
	var per []uint64
	if err := d.drop.Lookup(uint32(0), &per); err != nil {
		return d.read.Load(), d.skipped.Load(), 0, fmt.Errorf("ha: drainer: fluxvm_hadrop: %w", err)
	}
	for _, v := range per {
		dropped += v
	}
	return d.read.Load(), d.skipped.Load(), dropped, nil
}
