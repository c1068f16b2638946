package ha

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net/netip"
	"slices"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/nat"
)

// ErrService: a snapshot of another service than the one it is imported
// into.
var ErrService = errors.New("ha: snapshot of another service")

// Source is one service on the exporting node.
type Source struct {
	// CT is the node's conntrack map (and through it the NAT table).
	CT *conntrack.Map
	// ServiceIDs are the service's datapath frontends.
	ServiceIDs []uint32
	// Backend names backend id of the service by address and port;
	// false for an id the service does not have (its flows are left
	// out: the datapath re-picks them anyway).
	Backend func(id uint32) (netip.AddrPort, bool)
	// Now is the node's datapath clock (conntrack.Now when nil).
	Now func() (time.Duration, error)
}

// ExportResult counts what an export wrote and left out.
type ExportResult struct {
	Flows uint64 `json:"flows"` // written
	// Expired flows (past their deadline) and flows of kinds not
	// replicated (L7) or whose backend the service no longer has are
	// left out.
	Expired    uint64 `json:"expired"`
	NotCarried uint64 `json:"not_carried"`
	NoBackend  uint64 `json:"no_backend"`
}

// Export writes a snapshot of src's flows to w under header h (its
// Service, Node, Epoch and journal cursor; Created is set), streaming the
// maps chunk by chunk. The journal cursor in h must be one the snapshot
// includes: take it before the export starts, so that the deltas after it
// replay whatever changed during the export.
func Export(ctx context.Context, w io.Writer, h Header, src Source) (ExportResult, error) {
	var res ExportResult
	if src.CT == nil || src.Backend == nil || len(src.ServiceIDs) == 0 {
		return res, errors.New("ha: export: a source needs its conntrack map, backends and service ids")
	}
	clock := clockOr(src.Now)
	now, err := clock()
	if err != nil {
		return res, fmt.Errorf("ha: export: %w", err)
	}
	h.Created = time.Now().UTC()
	sw, err := NewWriter(w, h)
	if err != nil {
		return res, fmt.Errorf("ha: export %s: %w", h.Service, err)
	}
	err = src.CT.Scan(conntrack.Filter{ServiceIDs: src.ServiceIDs}, func(es []conntrack.Entry) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		for i := range es {
			f, why := flowOf(&es[i], now, src)
			switch why {
			case "":
				if err := sw.Write(&f); err != nil {
					return err
				}
				res.Flows++
			case "expired":
				res.Expired++
			case "backend":
				res.NoBackend++
			default:
				res.NotCarried++
			}
		}
		return nil
	})
	if err == nil {
		err = sw.Close()
	}
	if err != nil {
		return res, fmt.Errorf("ha: export %s: %w", h.Service, err)
	}
	return res, nil
}

// flowOf is e as a Flow at the exporter's clock now, or why it is left
// out.
func flowOf(e *conntrack.Entry, now time.Duration, src Source) (Flow, string) {
	if e.Deadline < now {
		return Flow{}, "expired"
	}
	if e.Kind != conntrack.EastWest && e.Kind != conntrack.SNAT && e.Kind != conntrack.DSR {
		return Flow{}, "kind"
	}
	be, ok := src.Backend(e.BackendID)
	if !ok {
		return Flow{}, "backend"
	}
	f := Flow{Client: e.Client, VIP: e.VIP, Proto: e.Proto, Backend: be, Kind: e.Kind, SNAT: e.SNAT, State: e.State,
		ReverseDerived: e.ReverseDerived, Audited: e.Audited,
		Age: max(now-e.Created, 0), Idle: max(now-e.LastSeen, 0), TTL: max(e.Deadline, e.HAUntil) - now}
	// TTL: the datapath queues the flow's next refresh only once its
	// deadline passes HAUntil, what its last record gave the standby;
	// a snapshot must give as much, or the copy could expire first.
	if e.HasNATHalf() {
		// The half's own clock; a half the LRU evicted is the flow's
		// (GC would recreate it so).
		f.NAT = &NATHalf{Idle: f.Idle}
		if n, err := src.CT.NAT().Lookup(natKey(&f)); err == nil {
			f.NAT.Idle = max(now-n.LastSeen, 0)
		}
	}
	if err := f.check(); err != nil {
		return Flow{}, "kind"
	}
	return f, ""
}

// natKey is the key of f's reverse-NAT half: the reply from the backend to
// the client, or to the SNAT source of an SNAT flow.
func natKey(f *Flow) nat.Key {
	if f.Kind == conntrack.SNAT {
		return nat.Key{Backend: f.Backend, Client: f.SNAT, Proto: f.Proto}
	}
	return nat.Key{Backend: f.Backend, Client: f.Client, Proto: f.Proto}
}

// Target is one service on the importing node.
type Target struct {
	// CT is the node's conntrack map (and through it the NAT table).
	CT *conntrack.Map
	// Service is the service's name: a snapshot of another is refused.
	Service string
	// Frontend is the datapath service id of the service's frontend
	// (VIP, port, protocol) on this node; false when it has none there.
	Frontend func(vip netip.AddrPort, proto uint8) (uint32, bool)
	// BackendID is the id of the backend at addr of datapath service
	// sid on this node; false when the service has no such backend.
	BackendID func(sid uint32, addr netip.AddrPort) (uint32, bool)
	// Seeds, when set, are this edge's seeds: a snapshot naming others
	// is refused before anything else is judged or applied (ErrSeeds);
	// one of format 1, which names none, is taken (FormatV1).
	Seeds *Seeds
	// Accept, when set, judges the header before any flow is applied
	// (the lease epoch and the journal cursor: Cursor.Reset).
	Accept func(Header) error
	// SNATAddrs, when set, are this node's SNAT addresses: an SNAT flow
	// translated to another source is skipped (counted), since replies
	// to that address would not come back through this node. The pair
	// shares its SNAT addresses.
	SNATAddrs []netip.Addr
	// Prune makes an import a snapshot-diff: once the whole snapshot is
	// verified and applied, the service's north-south flows on this node
	// (SNAT and DSR kinds of its datapath frontends: ServiceIDs) that the
	// snapshot lacks and that were last seen before the export are
	// deleted, so that the node holds exactly the source's. East-west
	// flows belong to the node's own VMs and are never pruned. It is the backstop for records
	// the mutation queue dropped (fluxvm_hadrop) and deletes a journal
	// missed.
	Prune      bool
	ServiceIDs []uint32
	// Now is the node's datapath clock (conntrack.Now when nil).
	Now func() (time.Duration, error)
}

// check reports a Target missing what op needs.
func (t *Target) check(op string) error {
	if t.CT == nil || t.Frontend == nil || t.BackendID == nil || t.Service == "" {
		return fmt.Errorf("ha: %s: a target needs its conntrack map, service, frontends and backends", op)
	}
	return nil
}

// clockOr is the datapath clock now, or conntrack.Now when now is nil.
func clockOr(now func() (time.Duration, error)) func() (time.Duration, error) {
	if now == nil {
		return conntrack.Now
	}
	return now
}

// ImportResult counts what an import did.
type ImportResult struct {
	Header Header `json:"header"`
	Flows  uint64 `json:"flows"` // read
	// Written flows; Fresher ones the node has seen since (kept as they
	// are); flows whose frontend or backend this node does not have, or
	// whose SNAT port another flow holds here, or whose SNAT source is
	// not this node's (ForeignSNAT), are skipped.
	Written       uint64 `json:"written"`
	Fresher       uint64 `json:"fresher"`
	NoFrontend    uint64 `json:"no_frontend"`
	NoBackend     uint64 `json:"no_backend"`
	PortConflicts uint64 `json:"port_conflicts"`
	ForeignSNAT   uint64 `json:"foreign_snat,omitempty"`
	// Pruned counts the flows a snapshot-diff (Target.Prune) deleted.
	Pruned uint64 `json:"pruned,omitempty"`
}

// Import reads a snapshot from r and applies it to t: every verified
// chunk as it comes, so memory stays bounded; an error leaves the chunks
// before it applied (each flow is whole: its conntrack entry and its
// reverse half) and the rest not. Importing the same snapshot twice
// changes nothing the first did not.
func Import(ctx context.Context, r io.Reader, t Target) (ImportResult, error) {
	var res ImportResult
	if err := t.check("import"); err != nil {
		return res, err
	}
	if t.Prune && len(t.ServiceIDs) == 0 {
		return res, errors.New("ha: import: a snapshot-diff needs the service's datapath ids")
	}
	sr, err := NewReader(r)
	if err != nil {
		return res, fmt.Errorf("ha: import into %s: %w", t.Service, err)
	}
	res.Header = sr.Header()
	if res.Header.Service != t.Service {
		return res, fmt.Errorf("ha: import into %s: %w: the snapshot is of %q", t.Service, ErrService, res.Header.Service)
	}
	if t.Seeds != nil {
		if err := res.Header.CheckSeeds(*t.Seeds); err != nil {
			return res, fmt.Errorf("ha: import into %s: %w", t.Service, err)
		}
	}
	if t.Accept != nil {
		if err := t.Accept(res.Header); err != nil {
			return res, fmt.Errorf("ha: import into %s: %w", t.Service, err)
		}
	}
	clock := clockOr(t.Now)
	now, err := clock()
	if err != nil {
		return res, fmt.Errorf("ha: import into %s: %w", t.Service, err)
	}
	// The export's instant on this node's clock: the flows' ages count
	// from it, so that a snapshot imported later is that much older (and
	// the same snapshot imported twice lands on the same times).
	at := now
	if !res.Header.Created.IsZero() {
		at -= min(max(time.Since(res.Header.Created), 0), now)
	}
	var seen []uint64 // the snapshot's keys, hashed, for a snapshot-diff
	for {
		flows, err := sr.Next()
		if err == io.EOF {
			if !t.Prune {
				return res, nil
			}
			// The prune deletes: not for a caller that gave up meanwhile
			// (a lease that advanced under the import).
			if err := ctx.Err(); err != nil {
				return res, fmt.Errorf("ha: import into %s: before the snapshot-diff: %w", t.Service, err)
			}
			return res, prune(&t, seen, at, &res)
		}
		if err == nil {
			err = ctx.Err()
		}
		if err != nil {
			return res, fmt.Errorf("ha: import into %s after %d flows: %w", t.Service, res.Flows, err)
		}
		for i := range flows {
			res.Flows++
			if t.Prune {
				seen = append(seen, keyHash(flows[i].Key()))
			}
			if err := applyFlow(&flows[i], at, false, &t, &res); err != nil {
				return res, fmt.Errorf("ha: import into %s: %s: %w", t.Service, &flows[i], err)
			}
		}
	}
}

// keyHash is a flow key's 64-bit FNV-1a: a snapshot-diff keeps 8 bytes a
// flow (a collision only spares a stale flow until its GC).
func keyHash(k conntrack.Key) uint64 {
	h := fnv.New64a()
	c, v := k.Client.Addr().Unmap().As16(), k.VIP.Addr().Unmap().As16()
	h.Write(c[:])
	h.Write(v[:])
	h.Write([]byte{byte(k.Client.Port() >> 8), byte(k.Client.Port()), byte(k.VIP.Port() >> 8), byte(k.VIP.Port()), k.Proto})
	return h.Sum64()
}

// prune deletes t's flows of the service that the snapshot (seen) lacks
// and that were last seen before its export (at): a flow learned since is
// the node's own.
func prune(t *Target, seen []uint64, at time.Duration, res *ImportResult) error {
	slices.Sort(seen)
	var stale []conntrack.Key
	err := t.CT.Scan(conntrack.Filter{ServiceIDs: t.ServiceIDs}, func(es []conntrack.Entry) error {
		for i := range es {
			e := &es[i]
			// East-west flows are the node's own VMs' (never another
			// node's to replicate); L7 flows stay on their node.
			if (e.Kind != conntrack.SNAT && e.Kind != conntrack.DSR) || e.LastSeen >= at {
				continue
			}
			if _, ok := slices.BinarySearch(seen, keyHash(e.Key)); !ok {
				stale = append(stale, e.Key)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("ha: import into %s: snapshot-diff: %w", t.Service, err)
	}
	for _, k := range stale {
		if err := t.CT.Delete(k); err != nil && !errors.Is(err, conntrack.ErrNotFound) {
			return fmt.Errorf("ha: import into %s: snapshot-diff: %w", t.Service, err)
		}
		res.Pruned++
	}
	return nil
}

// slack is how much fresher than the node's own entry a flow must be to
// replace it: two imports of one snapshot place its times up to a tick of
// the coarse monotonic clock apart (4 ms here; the wall clock anchors
// them), and must not count as news.
const slack = 50 * time.Millisecond

// applyFlow writes f (its reverse half first, so that the entry the
// datapath keys its packets by never lacks it), its ages counted from now
// (the export's instant on this node's clock); a flow the node has seen
// more recently is kept unless force (a journal's later operation wins:
// its ages count from its draining, not from one instant).
func applyFlow(f *Flow, now time.Duration, force bool, t *Target, res *ImportResult) error {
	sid, ok := t.Frontend(f.VIP, f.Proto)
	if !ok {
		res.NoFrontend++
		return nil
	}
	if f.Kind == conntrack.SNAT && len(t.SNATAddrs) > 0 && !slices.Contains(t.SNATAddrs, f.SNAT.Addr().Unmap()) {
		res.ForeignSNAT++
		return nil
	}
	bid, ok := t.BackendID(sid, f.Backend)
	if !ok {
		res.NoBackend++
		return nil
	}
	e := conntrack.Entry{Key: f.Key(), ServiceID: sid, BackendID: bid, State: f.State, Kind: f.Kind, SNAT: f.SNAT,
		ReverseDerived: f.ReverseDerived, Audited: f.Audited,
		Created: max(now-f.Age, 0), LastSeen: max(now-f.Idle, 0)}
	e.Created = min(e.Created, e.LastSeen)
	e.Deadline = max(now+f.TTL, e.LastSeen)
	if !force {
		if cur, err := t.CT.Lookup(e.Key); err == nil && cur.LastSeen+slack >= e.LastSeen {
			res.Fresher++
			return nil
		}
	}
	if f.NAT != nil {
		n := nat.Entry{Key: natKey(f), VIP: f.VIP, ServiceID: sid, BackendID: bid, LastSeen: max(now-f.NAT.Idle, 0)}
		if f.Kind == conntrack.SNAT {
			n.SNAT, n.Origin = true, f.Client
			// The port is another flow's here: this one cannot have it.
			if cur, err := t.CT.NAT().Lookup(n.Key); err == nil && cur.Origin != f.Client {
				res.PortConflicts++
				return nil
			}
		}
		if err := t.CT.NAT().Put(n); err != nil {
			return err
		}
	}
	wrote, err := t.CT.Restore(e, !force)
	if err != nil {
		return err
	}
	if wrote {
		res.Written++
	} else {
		res.Fresher++
	}
	return nil
}

// Apply applies delta d's operations to t in order (the caller checked d
// against its Cursor and advances it after): upserts as an import writes
// flows, their ages counted from now (an operation's ages are those of
// its draining, at most a replication interval earlier), a later
// operation always winning over an earlier one; deletes with their
// reverse halves. A delete of a flow the node does not have is no error.
func Apply(ctx context.Context, d Delta, t Target) (ImportResult, error) {
	var res ImportResult
	if err := t.check("apply"); err != nil {
		return res, err
	}
	if d.Service != t.Service {
		return res, fmt.Errorf("ha: apply to %s: %w: the delta is of %q", t.Service, ErrService, d.Service)
	}
	clock := clockOr(t.Now)
	now, err := clock()
	if err != nil {
		return res, fmt.Errorf("ha: apply to %s: %w", t.Service, err)
	}
	for _, b := range d.Batches {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		for i := range b.Ops {
			op := &b.Ops[i]
			switch op.Kind {
			case OpUpsert:
				res.Flows++
				if err := applyFlow(op.Flow, now, true, &t, &res); err != nil {
					return res, fmt.Errorf("ha: apply to %s: batch %d: %s: %w", t.Service, b.Seq, op.Flow, err)
				}
			case OpDelete:
				if op.IdleMS > 0 {
					fresher, err := seenSince(t.CT, op.Key, now, time.Duration(op.IdleMS)*time.Millisecond)
					if err != nil {
						return res, fmt.Errorf("ha: apply to %s: batch %d: delete %s: %w", t.Service, b.Seq, op.Key, err)
					}
					if fresher {
						res.Fresher++
						continue
					}
				}
				if err := t.CT.Delete(op.Key); err != nil && !errors.Is(err, conntrack.ErrNotFound) {
					return res, fmt.Errorf("ha: apply to %s: batch %d: delete %s: %w", t.Service, b.Seq, op.Key, err)
				}
			default:
				return res, fmt.Errorf("ha: apply to %s: batch %d: %w: %s", t.Service, b.Seq, ErrInvalidOp, op.Kind)
			}
		}
	}
	return res, nil
}

// deleteSlack is how much more recently than the source a target must
// have seen a flow to keep it against the source's delete: the datapath
// refreshes an entry's LastSeen at most once a second, so two copies of
// one flow seen at the same moment may differ by that much.
const deleteSlack = 2 * time.Second

// seenSince reports whether the target holds flow k and saw it more
// recently than a source that had not seen it for idle (as of now): then
// the source's delete is of a flow that lives on here.
func seenSince(ct *conntrack.Map, k conntrack.Key, now, idle time.Duration) (bool, error) {
	e, err := ct.Lookup(k)
	if errors.Is(err, conntrack.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return now-e.LastSeen+deleteSlack < idle, nil
}
