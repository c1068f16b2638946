package conntrack

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/mapscan"
	"github.com/fluxvm/servicefabric/nat"
)

// GCResult counts what one GC run did. Removal counts are exact: entries
// that vanished on their own (LRU eviction) between the read and the
// delete are not counted.
type GCResult struct {
	// Scanned is the number of conntrack entries examined for removal.
	Scanned int
	// Conntrack entries removed, by reason (each entry counts once, under
	// the first reason that applies, in this order):
	Expired     int // (a) idle past its deadline
	Drained     int // (b) its backend is Draining and the drain deadline passed
	BackendGone int // (c) its backend slot is unused or owned by another service
	// PairedNATRemoved is the number of reverse-NAT halves removed
	// together with the conntrack entries above. DSR flows and east-west
	// flows with derived replies (Entry.ReverseDerived) have none, and
	// nothing is looked up or counted for them; an SNAT mapping is
	// removed only while it still maps back to the removed flow (the
	// port may have been given to another flow since).
	PairedNATRemoved int

	// NATScanned is the number of reverse-NAT entries examined for orphans.
	NATScanned int
	// StaleNATRemoved: reverse-NAT entries without a conntrack half that
	// could not be repaired: idle past the established (TCP) or UDP
	// timeout, their backend no longer keeps flows, or their flow's
	// conntrack entry was removed by this run (the entry is an earlier
	// flow's on the same tuple, not a half the LRU evicted; this is how a
	// leftover at the key of a removed flow with derived replies goes).
	// The NAT halves of flows removed as BackendGone are counted here:
	// without the backend slot their key cannot be named from the
	// conntrack side, so this sweep is what finds them.
	StaleNATRemoved int
	// SupersededNATRemoved: reverse-NAT entries whose conntrack half names
	// another backend (the flow failed over), is of another kind (an
	// east-west entry whose flow is now SNAT or DSR, or the reverse), or
	// for an SNAT mapping translates to another SNAT address or port; or
	// whose backend id now has another address; or east-west entries
	// whose conntrack entry has derived replies (Entry.ReverseDerived):
	// that flow has no half, so the entry is a leftover of an earlier,
	// stored flow on the tuple.
	SupersededNATRemoved int
	// CTRepaired: conntrack halves recreated from a fresh reverse-NAT
	// entry (of kind SNAT, with the mapping's address and port, when the
	// entry is an SNAT mapping). A recreated east-west entry is a stored
	// flow's: it never has derived replies.
	CTRepaired int
	// NATRepaired: reverse-NAT halves recreated for a conntrack entry
	// whose backend still exists. DSR flows and east-west flows with
	// derived replies never get one.
	NATRepaired int

	// Shed counts, for Shed, the entries removed before their deadline
	// because it fell within the horizon, by the state they were in:
	// the cheapest flows to lose first. Their sum is part of Expired.
	Shed ShedCounts
}

// ShedCounts are the entries Shed removed early, by state.
type ShedCounts struct {
	// Closed: TCP flows past their FIN or RST; HalfOpen: TCP flows that
	// never completed their handshake; IdleUDP: UDP flows idle long
	// enough for their deadline to be near; Established: TCP flows idle
	// that long (only with a horizon near the established timeout).
	Closed      int `json:"closed"`
	HalfOpen    int `json:"half_open"`
	IdleUDP     int `json:"idle_udp"`
	Established int `json:"established"`
}

func (c *ShedCounts) add(r reason) {
	switch r {
	case shedClosed:
		c.Closed++
	case shedHalfOpen:
		c.HalfOpen++
	case shedUDP:
		c.IdleUDP++
	case shedEstablished:
		c.Established++
	}
}

// Total is the number of entries shed.
func (c ShedCounts) Total() int { return c.Closed + c.HalfOpen + c.IdleUDP + c.Established }

// Removed is the number of conntrack entries removed, for all reasons.
func (r GCResult) Removed() int { return r.Expired + r.Drained + r.BackendGone }

func (r GCResult) String() string {
	return fmt.Sprintf("scanned %d: expired %d, drained %d, backend gone %d (nat halves %d); "+
		"nat scanned %d: stale %d, superseded %d; repaired ct %d, nat %d",
		r.Scanned, r.Expired, r.Drained, r.BackendGone, r.PairedNATRemoved,
		r.NATScanned, r.StaleNATRemoved, r.SupersededNATRemoved, r.CTRepaired, r.NATRepaired)
}

// GC removes dead flows and repairs half-flows, as of now on
// CLOCK_MONOTONIC_COARSE (use Now; tests pass any time they like).
//
// It runs three streaming sweeps, each in bounded chunks:
//
//  1. conntrack: remove every entry that is expired (Deadline < now),
//     whose backend is Draining with its drain deadline passed
//     (DrainUntilNs <= now, the datapath's own test), or whose backend
//     slot is unused or owned by another service, together with its
//     reverse-NAT half: (backend -> client) for a stored east-west flow,
//     (backend -> SNAT address:port) for an SNAT flow if that mapping
//     still maps back to the flow, none for a DSR flow and none for an
//     east-west flow with derived replies (bpf.CTFlagRevDerived; nothing
//     is looked up for it: an entry at its key is a leftover, which
//     sweep 2 removes as stale because this sweep removed the flow);
//  2. reverse NAT: an entry whose conntrack half is not its flow (another
//     backend, another kind, for an SNAT mapping another SNAT address
//     or port, or for an east-west entry a flow with derived replies,
//     which has no half: the entry is a leftover of an earlier, stored
//     flow on the tuple) is removed as superseded; an entry without a
//     conntrack half gets it back (state established for TCP, UDP for
//     UDP, deadline LastSeen + that timeout; kind SNAT with the mapping's
//     address and port for an SNAT mapping; never with derived replies:
//     the flow is a stored one) if it is fresh, its backend still keeps
//     flows and sweep 1 did not just remove that conntrack entry, and is
//     removed otherwise. A half that was evicted is repaired; a half
//     whose flow ended is never revived: the tuple's next connection must
//     get a fresh pick, not a phantom flow to a backend the table may no
//     longer name. The conntrack half of an SNAT mapping is keyed by its
//     origin: (Origin -> VIP);
//  3. conntrack again: an SNAT entry or a stored east-west entry (one
//     without derived replies) without its reverse-NAT half whose backend
//     still exists gets it back (created, never overwritten: an SNAT port
//     another flow took meanwhile stays that flow's, and the datapath
//     drops this flow's packets as an SNAT conflict). DSR entries and
//     east-west entries with derived replies have no half to repair, and
//     never get one.
//
// A reverse-NAT entry names exactly one conntrack entry, so when sweep 2
// proves as many pairs as sweep 1 kept entries that need a half (SNAT,
// and east-west without derived replies), every one of them has its half
// and sweep 3 is skipped: it is the price of repairs, paid only when
// something is broken. Entries with derived replies are not counted, so a
// node whose east-west flows are all derived skips it whenever its stored
// halves are complete. (Were the maps changing meanwhile, a NAT half
// evicted while a new flow was learned could balance the count; that
// repair then waits for the next run, or for the datapath, which restores
// a missing NAT half when it next refreshes the flow.)
//
// A repaired reverse-NAT half does not know the service's host_routing
// setting (conntrack does not record it): its replies take the host stack,
// which is host routing's own fallback.
//
// Entries written by program generation 1 have no kind flags and are
// collected as the east-west flows they are; east-west entries written by
// generations 1 to 3, and by generation 4 for a frontend with
// bpf.SvcFlagRevStored, have no bpf.CTFlagRevDerived and are collected
// with their reverse-NAT halves, as stored flows.
//
// Removing before repairing matters when the LRU maps are full: the
// repairs then take the room the removals freed instead of evicting live
// halves. Entries of Unhealthy backends stay: the datapath moves such a
// flow on its next packet, and keeps it if the backend recovered first.
//
// GC runs one at a time per Map. It checks ctx between chunks and returns
// what it did so far with ctx's error.
func (m *Map) GC(ctx context.Context, now time.Duration) (GCResult, error) {
	return m.gc(ctx, now, 0)
}

// Shed is GC that also removes the flows whose deadline falls within
// horizon of now, as if that time had passed for them alone (drains,
// reverse-NAT freshness and repairs keep the true time): under map
// pressure, the flows closest to their end go first — closed TCP flows
// (FIN 30 s, RST 10 s by default), half-open ones and idle UDP flows long
// before any established TCP flow, whose timeout is hours. Result.Shed
// counts them by state.
func (m *Map) Shed(ctx context.Context, now, horizon time.Duration) (GCResult, error) {
	if horizon < 0 {
		return GCResult{}, fmt.Errorf("conntrack: shed: negative horizon %v", horizon)
	}
	return m.gc(ctx, now, horizon)
}

func (m *Map) gc(ctx context.Context, now, horizon time.Duration) (GCResult, error) {
	if now < 0 {
		return GCResult{}, fmt.Errorf("conntrack: gc: negative time %v", now)
	}
	m.gcMu.Lock()
	defer m.gcMu.Unlock()
	c, done := m.flows.Borrow()
	defer done()
	g := &gcRun{m: m, cts: c, ctx: ctx, now: uint64(now), ahead: uint64(horizon), backends: make(map[uint32]cachedBackend),
		removed: make(map[uint64]struct{}), seed: maphash.MakeSeed()}
	err := g.do(
		func() error { return sweep(g, c.ct4, IPv4, key4From) },
		func() error { return sweep(g, c.ct6, IPv6, key6From) },
		g.sweepNAT,
	)
	if err == nil && g.kept != g.paired {
		if testHookRepairSweep != nil {
			testHookRepairSweep()
		}
		err = g.do(
			func() error { return repair(g, c.ct4, IPv4, key4From) },
			func() error { return repair(g, c.ct6, IPv6, key6From) },
		)
	}
	if err != nil {
		return g.res, fmt.Errorf("conntrack: gc: %w", err)
	}
	return g.res, nil
}

// testHookRepairSweep, when set (by tests), is called each time GC runs
// sweep 3: the shortcut that skips it leaves no other trace.
var testHookRepairSweep func()

func (g *gcRun) do(steps ...func() error) error {
	for _, step := range steps {
		if err := step(); err != nil {
			return err
		}
	}
	return nil
}

// gcRun is the state of one GC run.
type gcRun struct {
	m   *Map
	cts ctMaps // the conntrack maps of the run (borrowed)
	ctx context.Context
	now uint64
	// ahead is Shed's horizon: entries whose deadline is within it of
	// now are removed as expired (0: GC).
	ahead uint64
	res   GCResult

	// backends caches backend slots for the run, so that a million flows
	// over a few hundred backends cost a few hundred lookups. Only slots
	// that keep their flows are trusted for the whole run; a slot that
	// condemns flows (unused, drained) is trusted only within the chunk it
	// was read in (gen), so that a slot reused in the meantime is read
	// again before its new flows could be taken for old ones.
	backends map[uint32]cachedBackend
	gen      uint64

	// kept counts the conntrack entries that need a reverse-NAT half
	// (SNAT, and east-west without derived replies: needsNAT) that sweep 1
	// kept, paired the NAT entries sweep 2 found with their conntrack half.
	kept, paired int

	// removed holds the keys (hashed) of the conntrack entries sweep 1
	// removed. A reverse-NAT entry of such a flow is not repaired in
	// sweep 2: its conntrack half did not vanish by eviction, it ended
	// (or the entry was another, older flow's on the same tuple).
	removed map[uint64]struct{}
	seed    maphash.Seed

	natDel, natStale, natSuperseded []nat.Key
	// snatSuperseded are the SNAT mappings of natSuperseded's chunk,
	// checked again just before they go (see sweepNAT).
	snatSuperseded []nat.Entry

	// Scratch for single lookups, allocated once per run rather than per
	// call (a key passed as any escapes to the heap).
	k4 bpf.Tuple4
	k6 bpf.Tuple6
	v  bpf.CTValue
}

// lookupCT reads the conntrack entry of k into g.v.
func (g *gcRun) lookupCT(k Key) error {
	if k.Family() == IPv4 {
		g.k4 = key4(k)
		return g.cts.ct4.Lookup(&g.k4, &g.v)
	}
	g.k6 = key6(k)
	return g.cts.ct6.Lookup(&g.k6, &g.v)
}

type cachedBackend struct {
	b   bpf.Backend
	gen uint64
}

// backend returns slot id of fluxvm_backends; an id beyond the array
// reads as an unused slot.
func (g *gcRun) backend(id uint32) (bpf.Backend, error) {
	if c, ok := g.backends[id]; ok && (c.gen == g.gen || g.keepsAny(&c.b)) {
		return c.b, nil
	}
	var b bpf.Backend
	if err := g.m.backends.Lookup(id, &b); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return b, fmt.Errorf("backend %d: %w", id, err)
	}
	g.backends[id] = cachedBackend{b: b, gen: g.gen}
	return b, nil
}

// keepsAny: slot b condemns none of the flows of its service at g.now.
func (g *gcRun) keepsAny(b *bpf.Backend) bool {
	switch bpf.BackendState(b.State) {
	case bpf.BackendReady, bpf.BackendUnhealthy:
		return true
	case bpf.BackendDraining:
		return g.now < b.DrainUntilNs
	}
	return false
}

// keeps: the datapath keeps a flow of service sid on b at g.now.
func (g *gcRun) keeps(b *bpf.Backend, sid uint32) bool {
	if b.ServiceId != sid {
		return false
	}
	switch bpf.BackendState(b.State) {
	case bpf.BackendReady:
		return true
	case bpf.BackendDraining:
		return g.now < b.DrainUntilNs
	}
	return false
}

type reason uint8

const (
	keep reason = iota
	expired
	drained
	gone
	// Shed's early removals, by the entry's state (expired, for counts).
	shedClosed
	shedHalfOpen
	shedUDP
	shedEstablished
)

// classify decides the fate of conntrack entry v in sweep 1.
func (g *gcRun) classify(v *bpf.CTValue, b *bpf.Backend) reason {
	switch {
	case v.DeadlineNs < g.now:
		return expired
	case g.ahead > 0 && v.DeadlineNs < g.now+g.ahead && kindOf(v) != L7:
		return shedReason(v)
	case kindOf(v) == L7:
		// No backend: it lives until it expires.
		return keep
	case !owns(b, v.ServiceId):
		return gone
	case bpf.BackendState(b.State) == bpf.BackendDraining && b.DrainUntilNs <= g.now:
		return drained
	}
	return keep
}

// shedReason is the reason of an entry Shed removes before its
// deadline: its state.
func shedReason(v *bpf.CTValue) reason {
	switch bpf.CTState(v.State) {
	case bpf.CTTCPFin, bpf.CTTCPRst:
		return shedClosed
	case bpf.CTTCPSyn:
		return shedHalfOpen
	case bpf.CTUDP:
		return shedUDP
	}
	return shedEstablished
}

func (g *gcRun) nextChunk() error {
	g.gen++
	return g.ctx.Err()
}

// eachChunk reads conntrack map s chunk by chunk, honouring g's context
// between chunks, and hands fn the number of entries in s.Keys/s.Vals.
func eachChunk[K any](g *gcRun, s *mapscan.Scanner[K, bpf.CTValue], fam Family, fn func(n int) error) error {
	for {
		if err := g.nextChunk(); err != nil {
			return err
		}
		n, err := s.Chunk()
		if err != nil {
			return fmt.Errorf("scan %s conntrack: %w", fam, err)
		}
		if n == 0 {
			return nil
		}
		if err := fn(n); err != nil {
			return err
		}
	}
}

// removedFlow names a flow GC removes, for Config.Removed.
type removedFlow struct {
	key  Key
	sid  uint32
	kind Kind
	idle time.Duration
}

// sweep is pass 1 over one conntrack map: remove dead flows, both halves.
func sweep[K any](g *gcRun, ctm *ebpf.Map, fam Family, decode func(*K) Key) error {
	s := mapscan.NewScanner[K, bpf.CTValue](ctm, &g.m.mode, g.m.chunk)
	del := make([]K, 0, len(s.Keys))
	why := make([]reason, 0, len(s.Keys))
	var flows []removedFlow // for Config.Removed
	return eachChunk(g, s, fam, func(n int) error {
		g.res.Scanned += n
		del, why, g.natDel, flows = del[:0], why[:0], g.natDel[:0], flows[:0]
		for i := range n {
			v := &s.Vals[i]
			b, err := g.backend(v.BackendId)
			if err != nil {
				return err
			}
			r := g.classify(v, &b)
			if r == keep {
				if needsNAT(v) {
					g.kept++
				}
				continue
			}
			del = append(del, s.Keys[i])
			why = append(why, r)
			k := decode(&s.Keys[i])
			if g.m.removed != nil {
				flows = append(flows, removedFlow{k, v.ServiceId, kindOf(v), time.Duration(g.now - min(g.now, v.LastSeenNs))})
			}
			g.removed[maphash.Comparable(g.seed, k)] = struct{}{}
			if !owns(&b, v.ServiceId) {
				// The NAT half cannot be named from here; sweep 2 finds
				// it without its conntrack half and a backend that keeps
				// no flows, and removes it.
				continue
			}
			nk, ok := natKey(k, v, &b)
			if !ok {
				continue // DSR or derived replies: no NAT half
			}
			if kindOf(v) == SNAT {
				// The port may have been given to another flow since
				// this one's mapping was evicted: remove only our own.
				e, err := g.m.nat.Lookup(nk)
				if errors.Is(err, nat.ErrNotFound) {
					continue
				}
				if err != nil {
					return err
				}
				if !natOwnedBy(&e, k, v) {
					continue
				}
			}
			g.natDel = append(g.natDel, nk)
		}
		// An entry already gone (evicted since the read) is not counted.
		if _, err := mapscan.DeleteKeys(ctm, &g.m.mode, del, func(i int) { why[i] = keep }); err != nil {
			return fmt.Errorf("delete %s conntrack: %w", fam, err)
		}
		for i, r := range why {
			if r != keep && g.m.removed != nil {
				g.m.removed(flows[i].key, flows[i].sid, flows[i].kind, flows[i].idle)
			}
			switch r {
			case shedClosed, shedHalfOpen, shedUDP, shedEstablished:
				g.res.Expired++
				g.res.Shed.add(r)
			case expired:
				g.res.Expired++
			case drained:
				g.res.Drained++
			case gone:
				g.res.BackendGone++
			}
		}
		nd, err := g.m.nat.DeleteKeys(g.natDel)
		g.res.PairedNATRemoved += nd
		return err
	})
}

// ctKeyOf is the conntrack key of the flow reverse-NAT entry e belongs to:
// the client's view, from the client (an SNAT mapping's origin) to the VIP.
func ctKeyOf(e *nat.Entry) Key {
	if e.SNAT {
		return Key{Client: e.Origin, VIP: e.VIP, Proto: e.Proto}
	}
	return Key{Client: e.Client, VIP: e.VIP, Proto: e.Proto}
}

// pairs reports whether conntrack value ct (at ctKeyOf(e)) is the other
// half of reverse-NAT entry e: the same service and backend, and the
// matching kind: an east-west entry pairs only with a stored east-west
// flow (one without derived replies), an SNAT mapping only with an SNAT
// flow translated to the mapping's own address and port (the key's
// destination). DSR flows and flows with derived replies pair with
// nothing.
func pairs(e *nat.Entry, ck Key, ct *bpf.CTValue) bool {
	if ct.BackendId != e.BackendID || ct.ServiceId != e.ServiceID {
		return false
	}
	if e.SNAT {
		return kindOf(ct) == SNAT && snatOf(ck, ct) == e.Client
	}
	return kindOf(ct) == EastWest && !revDerived(ct)
}

// sweepNAT is pass 2: every reverse-NAT entry must have its conntrack half.
func (g *gcRun) sweepNAT() error {
	to := g.m.timeouts
	return g.m.nat.Scan(nat.Filter{}, func(es []nat.Entry) error {
		if err := g.nextChunk(); err != nil {
			return err
		}
		g.res.NATScanned += len(es)
		g.natStale, g.natSuperseded, g.snatSuperseded = g.natStale[:0], g.natSuperseded[:0], g.snatSuperseded[:0]
		for i := range es {
			e := &es[i]
			b, err := g.backend(e.BackendID)
			if err != nil {
				return err
			}
			ck := ctKeyOf(e)
			// The backend id may have been given to another address since
			// the flow was learned; replies from the old one are over.
			moved := owns(&b, e.ServiceID) && backendAddr(Family(e.Family()), &b) != e.Backend
			err = g.lookupCT(ck)
			switch {
			case err == nil:
				switch {
				case pairs(e, ck, &g.v) && !moved:
					g.paired++
				case e.SNAT && !moved:
					// The datapath inserts a new flow's mapping just
					// before its conntrack half; checked again below.
					g.snatSuperseded = append(g.snatSuperseded, *e)
				default:
					g.natSuperseded = append(g.natSuperseded, e.Key)
				}
			case !errors.Is(err, ebpf.ErrKeyNotExist):
				return fmt.Errorf("conntrack lookup %s: %w", ck, err)
			default:
				state, timeout := bpf.CTUDP, to.UDP
				if e.Proto == ProtoTCP {
					state, timeout = bpf.CTTCPEstablished, to.TCPEstablished
				}
				last := uint64(e.LastSeen)
				deadline := last + uint64(timeout)
				_, ended := g.removed[maphash.Comparable(g.seed, ck)]
				if ended || moved || !g.keeps(&b, e.ServiceID) || deadline < g.now {
					g.natStale = append(g.natStale, e.Key)
					continue
				}
				// A stored flow's entry: no derived replies.
				// The flow keeps its record (FluxScope): its packets
				// go on counting into it.
				ct := bpf.CTValue{
					ServiceId: e.ServiceID, BackendId: e.BackendID,
					CreatedNs: last, LastSeenNs: last, DeadlineNs: deadline,
					State: uint8(state), Flow: e.Flow,
				}
				if e.SNAT {
					ct.Flags = bpf.CTFlagSNAT
					ct.NatAddr = bpf.AddrWords(e.Client.Addr())
					ct.NatPort = bpf.Port(e.Client.Port())
				}
				ok, err := g.m.createRaw(ck, &ct)
				if err != nil {
					return fmt.Errorf("recreate conntrack %s: %w", ck, err)
				}
				if ok {
					g.res.CTRepaired++
				}
			}
		}
		// An SNAT mapping that does not pair may be a new flow's whose
		// conntrack half the datapath is writing right now (a tuple
		// reused after its old flow closed): look again, after the rest
		// of the chunk, before removing it.
		for i := range g.snatSuperseded {
			e := &g.snatSuperseded[i]
			ck := ctKeyOf(e)
			err := g.lookupCT(ck)
			switch {
			case err == nil && pairs(e, ck, &g.v):
				g.paired++
			case err == nil || errors.Is(err, ebpf.ErrKeyNotExist):
				// Still another flow's (or that flow is gone too): the
				// mapping's own flow is over.
				g.natSuperseded = append(g.natSuperseded, e.Key)
			default:
				return fmt.Errorf("conntrack lookup %s: %w", ck, err)
			}
		}
		n, err := g.m.nat.DeleteKeys(g.natStale)
		g.res.StaleNATRemoved += n
		if err != nil {
			return err
		}
		n, err = g.m.nat.DeleteKeys(g.natSuperseded)
		g.res.SupersededNATRemoved += n
		return err
	})
}

// repair is pass 3 over one conntrack map: give every flow that needs a
// reverse-NAT half (not DSR, not derived replies) and whose backend still
// exists its half.
func repair[K any](g *gcRun, ctm *ebpf.Map, fam Family, decode func(*K) Key) error {
	s := mapscan.NewScanner[K, bpf.CTValue](ctm, &g.m.mode, g.m.chunk)
	return eachChunk(g, s, fam, func(n int) error {
		for i := range n {
			v := &s.Vals[i]
			if !needsNAT(v) {
				continue // DSR or derived replies: never a NAT half
			}
			b, err := g.backend(v.BackendId)
			if err != nil {
				return err
			}
			if g.classify(v, &b) != keep {
				continue // learned since sweep 1 and already dead: next run
			}
			k := decode(&s.Keys[i])
			nk, _ := natKey(k, v, &b)
			_, err = g.m.nat.Lookup(nk)
			if err == nil {
				// Present. If it belongs to another flow (two services
				// sharing a backend address and a client port), the
				// datapath shares the key the same way: leave it. An
				// SNAT port another flow took after this flow's mapping
				// was evicted stays that flow's: the datapath drops this
				// flow's packets as an SNAT conflict rather than mix the
				// two flows' replies.
				continue
			}
			if !errors.Is(err, nat.ErrNotFound) {
				return err
			}
			ne := nat.Entry{
				Key: nk, VIP: k.VIP, ServiceID: v.ServiceId, BackendID: v.BackendId,
				LastSeen: time.Duration(v.LastSeenNs), Flow: v.Flow,
			}
			if kindOf(v) == SNAT {
				ne.SNAT, ne.Origin = true, k.Client
			}
			err = g.m.nat.Create(ne)
			switch {
			case err == nil:
				g.res.NATRepaired++
			case errors.Is(err, nat.ErrExists):
				// The datapath was quicker.
			case errors.Is(err, nat.ErrInvalidEntry):
				// Nothing the datapath could use (a backend without a
				// port, say); the flow fails over on its next packet.
			default:
				return err
			}
		}
		return nil
	})
}
