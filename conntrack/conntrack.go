package conntrack

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/handoff"
	"github.com/fluxvm/servicefabric/internal/mapscan"
	"github.com/fluxvm/servicefabric/nat"
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrNotFound: no conntrack entry for the key.
	ErrNotFound = errors.New("conntrack entry not found")
	// ErrInvalidMap: a map in Config is missing or is not the map of this
	// schema it should be (type, key or value size, name).
	ErrInvalidMap = errors.New("not a conntrack map of this schema")
	// ErrInvalidKey: a key the datapath could never have written.
	ErrInvalidKey = errors.New("invalid conntrack key")
)

// IP protocols the datapath tracks.
const (
	ProtoTCP = nat.ProtoTCP
	ProtoUDP = nat.ProtoUDP
)

// Family is an address family, as a Filter selects it: the SDK's one
// Family type (bpf.Family), shared with nat.
type Family = bpf.Family

// Families; the zero Family in a Filter selects both.
const (
	IPv4 = bpf.IPv4
	IPv6 = bpf.IPv6
)

// Key names a conntrack entry: the flow as the client sent it, from Client
// to the service's VIP. IPv4-mapped IPv6 addresses are taken as IPv4, the
// way the datapath stores them.
type Key struct {
	Client netip.AddrPort `json:"client"` // the client's address and source port
	VIP    netip.AddrPort `json:"vip"`    // the service frontend the client addressed
	Proto  uint8          `json:"proto"`  // ProtoTCP or ProtoUDP
}

func (k Key) String() string {
	p := "udp"
	if k.Proto == ProtoTCP {
		p = "tcp"
	} else if k.Proto != ProtoUDP {
		p = fmt.Sprintf("proto(%d)", k.Proto)
	}
	return fmt.Sprintf("%s %s->%s", p, k.Client, k.VIP)
}

// Family is the key's address family.
func (k Key) Family() Family {
	if k.Client.Addr().Unmap().Is4() {
		return IPv4
	}
	return IPv6
}

func (k Key) normal() (Key, error) {
	var problem string
	k.Client, k.VIP, problem = bpf.NormalizeEndpoints(k.Client, k.VIP, k.Proto)
	if problem != "" {
		return k, fmt.Errorf("%w: %s: %s", ErrInvalidKey, k, problem)
	}
	return k, nil
}

// Kind is how the datapath forwards a flow, from the kind bits of the
// conntrack value's flags (bpf.CTFlagSNAT, bpf.CTFlagDSR).
type Kind uint8

// Flow kinds. Entries written by program generation 1 have no flags and
// are east-west flows, which is what they are.
const (
	// EastWest: DNAT to the backend. Replies are translated from the
	// conntrack entry itself (Entry.ReverseDerived), or, for a frontend
	// with bpf.SvcFlagRevStored and for flows learned before program
	// generation 4, by a reverse-NAT half keyed by the client itself
	// (backend -> client).
	EastWest Kind = 0
	// SNAT: north-south NAT; DNAT to the backend and SNAT of the source
	// to Entry.SNAT. The reverse-NAT half is keyed by the SNAT address
	// and port (backend -> Entry.SNAT) and carries the client as its
	// origin.
	SNAT = Kind(bpf.CTFlagSNAT)
	// DSR: routed direct server return; nothing is translated and the
	// flow has no reverse-NAT half.
	DSR = Kind(bpf.CTFlagDSR)
	// L7: handed untranslated to an L7 proxy (L7 enforce) on
	// Entry.ProxyIfindex; no backend (BackendID 0) and no reverse-NAT
	// half. GC removes it when it expires, like any entry.
	L7 = Kind(bpf.CTFlagL7)
)

// kindMask selects the kind bits of a conntrack value's flags. A value
// with both bits set is no kind the datapath writes; it reads as
// Kind(kindMask), has no reverse-NAT half GC could name, and the
// datapath relearns the flow on its next packet.
const kindMask = bpf.CTFlagSNAT | bpf.CTFlagDSR | bpf.CTFlagL7

func (k Kind) String() string {
	switch k {
	case EastWest:
		return "east-west"
	case SNAT:
		return "snat"
	case DSR:
		return "dsr"
	case L7:
		return "l7"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// needsNAT reports whether the flow of conntrack value v has a
// reverse-NAT half: an SNAT flow (its mapping), an east-west flow unless
// its replies are derived from v (bpf.CTFlagRevDerived). DSR flows and
// values of no kind have none.
func needsNAT(v *bpf.CTValue) bool {
	switch kindOf(v) {
	case SNAT:
		return true
	case EastWest:
		return !revDerived(v)
	}
	return false
}

// Entry is one conntrack entry: which backend a flow is pinned to, in which
// protocol state, and until when. Times are on CLOCK_MONOTONIC_COARSE (time
// since boot; see Now), the clock the datapath stamps with.
type Entry struct {
	Key
	ServiceID uint32
	BackendID uint32 // id in fluxvm_backends
	State     bpf.CTState
	Created   time.Duration // when the datapath learned the flow
	LastSeen  time.Duration // last refresh; at most one a second per flow
	Deadline  time.Duration // LastSeen + the timeout of State; GC removes the entry after it
	// Kind is how the flow is forwarded: EastWest, SNAT, DSR or L7.
	Kind Kind
	// SNAT is, for a flow of Kind SNAT, the address and port its source
	// is translated to (the source the backend sees); the zero AddrPort
	// for every other kind.
	SNAT netip.AddrPort
	// ReverseDerived marks an east-west flow whose replies the datapath
	// translates from this entry, found through the fluxvm_be2fe index
	// (bpf.CTFlagRevDerived): the flow has no reverse-NAT half and GC
	// never gives it one. It is not a kind: a new east-west flow has it
	// unless its frontend has bpf.SvcFlagRevStored; east-west flows
	// learned before program generation 4, and entries GC recreated from
	// a reverse-NAT half, do not. Always false for other kinds.
	ReverseDerived bool
	// ProxyIfindex is, for a flow of Kind L7, the interface toward the
	// proxy the flow is handed to; 0 for every other kind.
	ProxyIfindex uint32
	// HAUntil is, for a flow of Kind SNAT or DSR while HA replication is
	// on, the time (datapath clock, whole seconds) until which a standby
	// holds the flow once its last queued record is applied: the datapath
	// queues a refresh only when the deadline passes it (package ha). 0:
	// none queued yet, and always for east-west flows.
	HAUntil time.Duration
	// Audited marks a flow its service's identity policy denied and
	// audit_only let through (bpf.CTFlagAudited).
	Audited bool
	// Flow is the id of the flow's FluxScope record (the low 32 bits of
	// its seq in fluxvm_sflows), 0 when the flow has none; the record is
	// the flow's only while its seq still matches (package flows).
	Flow uint32
}

// HasNATHalf reports whether the flow has a reverse-NAT half: an SNAT
// flow its mapping, an east-west flow unless ReverseDerived. DSR flows
// have none.
func (e Entry) HasNATHalf() bool {
	return e.Kind == SNAT || (e.Kind == EastWest && !e.ReverseDerived)
}

// Expired reports whether GC at now removes the entry for its deadline.
func (e Entry) Expired(now time.Duration) bool { return e.Deadline < now }

// Filter selects entries for Scan and List. The zero Filter selects all.
type Filter struct {
	Family     Family   // 0: both families
	ServiceIDs []uint32 // nil: any service; empty but non-nil: none
	BackendIDs []uint32 // nil: any backend; empty but non-nil: none
	Kinds      []Kind   // nil: any kind; empty but non-nil: none
}

func (f Filter) matches(fam Family, v *bpf.CTValue) bool {
	return (f.Family == 0 || f.Family == fam) &&
		(f.ServiceIDs == nil || slices.Contains(f.ServiceIDs, v.ServiceId)) &&
		(f.BackendIDs == nil || slices.Contains(f.BackendIDs, v.BackendId)) &&
		(f.Kinds == nil || slices.Contains(f.Kinds, kindOf(v)))
}

// Config names the maps a Map works on; all are required. The Map does not
// close them.
type Config struct {
	// CT4 and CT6 are fluxvm_fct4 and fluxvm_fct6. In user space only
	// this package reads or writes their entries.
	CT4, CT6 *ebpf.Map
	// Backends is fluxvm_backends, read to find a flow's backend address
	// and state. The Map never writes it.
	Backends *ebpf.Map
	// NAT is the table over fluxvm_nat4/6, the other half of every flow.
	NAT *nat.Table
	// Timeouts are the timeouts the loader writes into the meta map (see
	// Timeouts.ApplyTo). GC uses them to judge whether a reverse-NAT entry
	// without its conntrack half is fresh. The zero value means
	// DefaultTimeouts.
	Timeouts Timeouts
	// Removed, when set, is told of every flow GC removed (expired,
	// drained or of a backend gone) once its entry is deleted, with its
	// datapath service id, kind and how long it had been idle (GC's now
	// less its LastSeen): what a replication journal turns into deletes
	// for a standby, which keeps a copy it saw more recently. It runs on
	// GC's goroutine and must not block for long.
	Removed func(k Key, serviceID uint32, kind Kind, idle time.Duration)
}

// Map is the typed view of the conntrack maps fluxvm_fct4/6 and their
// garbage collector. It is safe for concurrent use; GC runs one at a time.
type Map struct {
	flows    *handoff.Value[ctMaps]
	backends *ebpf.Map
	nat      *nat.Table
	timeouts Timeouts
	mode     mapscan.Mode
	chunk    int
	gcMu     sync.Mutex
	removed  func(Key, uint32, Kind, time.Duration)
}

// NAT returns the reverse-NAT table the Map pairs its flows with
// (Config.NAT).
func (m *Map) NAT() *nat.Table { return m.nat }

// New checks the configuration (map types, layouts and names, timeouts) and
// returns the Map. It does not take ownership of the maps: closing them
// is the caller's business.
func New(cfg Config) (*Map, error) {
	var errs []error
	check := func(name string, m *ebpf.Map, types []ebpf.MapType, key, val uintptr) {
		switch {
		case m == nil:
			errs = append(errs, fmt.Errorf("%s: %w: nil map", name, ErrInvalidMap))
		case !slices.Contains(types, m.Type()):
			errs = append(errs, fmt.Errorf("%s: %w: type %s", name, ErrInvalidMap, m.Type()))
		case uintptr(m.KeySize()) != key || uintptr(m.ValueSize()) != val:
			errs = append(errs, fmt.Errorf("%s: %w: key/value size %d/%d, want %d/%d",
				name, ErrInvalidMap, m.KeySize(), m.ValueSize(), key, val))
		default:
			// fluxvm_fct4 and fluxvm_nat4 have the same layout; only the
			// name tells them apart. Maps made without a name pass.
			if info, err := m.Info(); err == nil && info.Name != "" && info.Name != name {
				errs = append(errs, fmt.Errorf("%s: %w: map is named %s", name, ErrInvalidMap, info.Name))
			}
		}
	}
	hashes := []ebpf.MapType{ebpf.LRUHash, ebpf.Hash}
	ctv := unsafe.Sizeof(bpf.CTValue{})
	check("fluxvm_fct4", cfg.CT4, hashes, unsafe.Sizeof(bpf.Tuple4{}), ctv)
	check("fluxvm_fct6", cfg.CT6, hashes, unsafe.Sizeof(bpf.Tuple6{}), ctv)
	check("fluxvm_backends", cfg.Backends, []ebpf.MapType{ebpf.Array}, 4, unsafe.Sizeof(bpf.Backend{}))
	if cfg.NAT == nil {
		errs = append(errs, fmt.Errorf("%w: nil nat.Table", ErrInvalidMap))
	}
	to := cfg.Timeouts
	if to == (Timeouts{}) {
		to = DefaultTimeouts()
	}
	if err := to.Validate(); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("conntrack: new: %w", errors.Join(errs...))
	}
	return &Map{
		flows: handoff.New(ctMaps{cfg.CT4, cfg.CT6}), backends: cfg.Backends, nat: cfg.NAT,
		timeouts: to, chunk: mapscan.DefaultChunk, removed: cfg.Removed,
	}, nil
}

// ctMaps are the conntrack maps a Map works on; Rebind replaces them.
type ctMaps struct{ ct4, ct6 *ebpf.Map }

// Rebind points the Map at other conntrack maps of the same layouts (the
// datapath rebuilt them: bpf.Datapath.CompactFlowMaps; the reverse-NAT
// maps are rebound through NAT().Rebind). It takes effect at once for new
// operations and returns the function that waits until no operation of
// the Map uses the previous maps any more and returns them: the caller may
// close them then. Operations already running (a GC, a scan) finish on the
// previous maps; what they write there is lost with them. The wait lasts
// as long as the longest of them: call it without holding locks that a
// scan's callback may take.
func (m *Map) Rebind(ct4, ct6 *ebpf.Map) (wait func() (old4, old6 *ebpf.Map), err error) {
	cfg := Config{CT4: ct4, CT6: ct6, Backends: m.backends, NAT: m.nat, Timeouts: m.timeouts}
	if _, err := New(cfg); err != nil {
		return nil, fmt.Errorf("conntrack: rebind: %w", err)
	}
	w := m.flows.Swap(ctMaps{ct4, ct6})
	return func() (*ebpf.Map, *ebpf.Map) {
		old := w()
		return old.ct4, old.ct6
	}, nil
}

// Timeouts returns the timeouts the Map was configured with.
func (m *Map) Timeouts() Timeouts { return m.timeouts }

// Lookup returns the entry for k, or an error matching ErrNotFound.
func (m *Map) Lookup(k Key) (Entry, error) {
	k, err := k.normal()
	if err != nil {
		return Entry{}, fmt.Errorf("conntrack: lookup: %w", err)
	}
	v, err := m.lookupRaw(k)
	if err != nil {
		return Entry{}, notFound("lookup", k, err)
	}
	return entry(k, &v), nil
}

func (m *Map) lookupRaw(k Key) (v bpf.CTValue, err error) {
	c, done := m.flows.Borrow()
	defer done()
	return c.lookup(k)
}

func (c ctMaps) lookup(k Key) (v bpf.CTValue, err error) {
	if k.Family() == IPv4 {
		err = c.ct4.Lookup(key4(k), &v)
	} else {
		err = c.ct6.Lookup(key6(k), &v)
	}
	return v, err
}

// createRaw writes v for k only if k has no entry, so that a repair never
// overwrites what the datapath wrote meanwhile. It reports whether it wrote.
func (m *Map) createRaw(k Key, v *bpf.CTValue) (bool, error) {
	var err error
	c, done := m.flows.Borrow()
	defer done()
	if k.Family() == IPv4 {
		err = c.ct4.Update(key4(k), v, ebpf.UpdateNoExist)
	} else {
		err = c.ct6.Update(key6(k), v, ebpf.UpdateNoExist)
	}
	if errors.Is(err, ebpf.ErrKeyExist) {
		return false, nil
	}
	return err == nil, err
}

// Restore writes entry e as it was learned elsewhere (an HA peer's
// snapshot or delta); with keepFresher, not when the map holds a fresher
// one for its key (last seen at or after e's): a flow this node saw since
// is its own. It reports whether it wrote. Kinds EastWest, SNAT and DSR only; the flow's
// reverse-NAT half is the caller's (nat.Table). The entry keeps no policy
// revision (a flow of a service with a policy is decided again at its
// next packet) and no flow record. The read and the write are two
// operations: a packet of the flow between them loses to the restore,
// which matters only on a node the flow reaches, not on a standby.
func (m *Map) Restore(e Entry, keepFresher bool) (bool, error) {
	k, err := e.Key.normal()
	if err != nil {
		return false, fmt.Errorf("conntrack: restore: %w", err)
	}
	switch {
	case e.Kind != EastWest && e.Kind != SNAT && e.Kind != DSR:
		return false, fmt.Errorf("conntrack: restore %s: kind %s is not restored", k, e.Kind)
	case e.ServiceID == 0 || e.BackendID == 0:
		return false, fmt.Errorf("conntrack: restore %s: service %d, backend %d: ids are never 0", k, e.ServiceID, e.BackendID)
	case e.Kind == SNAT && (!e.SNAT.IsValid() || e.SNAT.Addr().Unmap().Is4() != (k.Family() == IPv4)):
		return false, fmt.Errorf("conntrack: restore %s: SNAT source %s", k, e.SNAT)
	case e.Created < 0 || e.LastSeen < e.Created || e.Deadline < e.LastSeen:
		return false, fmt.Errorf("conntrack: restore %s: times out of order", k)
	}
	if cur, err := m.lookupRaw(k); keepFresher && err == nil && time.Duration(cur.LastSeenNs) >= e.LastSeen {
		return false, nil
	}
	// L7Ifindex stays 0: in a restored (never L7) entry it is the
	// datapath's HA bookkeeping, and 0 reads "never queued", so the
	// flow's next refresh queues it for this node's own standby.
	v := bpf.CTValue{ServiceId: e.ServiceID, BackendId: e.BackendID, CreatedNs: uint64(e.Created),
		LastSeenNs: uint64(e.LastSeen), DeadlineNs: uint64(e.Deadline), State: uint8(e.State), Flags: uint8(e.Kind)}
	if e.Kind == EastWest && e.ReverseDerived {
		v.Flags |= bpf.CTFlagRevDerived
	}
	if e.Audited {
		v.Flags |= bpf.CTFlagAudited
	}
	if e.Kind == SNAT {
		v.NatAddr, v.NatPort = bpf.AddrWords(e.SNAT.Addr().Unmap()), bpf.Port(e.SNAT.Port())
	}
	c, done := m.flows.Borrow()
	defer done()
	if k.Family() == IPv4 {
		err = c.ct4.Put(key4(k), &v)
	} else {
		err = c.ct6.Put(key6(k), &v)
	}
	if err != nil {
		return false, fmt.Errorf("conntrack: restore %s: %w", k, err)
	}
	return true, nil
}

// Delete removes the flow k: its conntrack entry and, when its backend is
// still known, its reverse-NAT half, so that no half outlives the other.
// The NAT half is removed only while it still belongs to this flow (for an
// SNAT flow: the mapping of its SNAT port names this client); a DSR flow
// has none. It returns an error matching ErrNotFound when k has no entry.
// A flow that is still sending is learned again by the datapath on its
// next packet.
//
// A flow with derived replies (Entry.ReverseDerived) has no half either.
// An east-west entry at its NAT key that names its VIP and backend is a
// leftover of an earlier, stored flow on the tuple (GC removes it as
// superseded while the entry lives) and is removed too: once the entry is
// gone, GC could not tell it from a stored flow whose conntrack half was
// evicted, and would bring the deleted flow back.
func (m *Map) Delete(k Key) error {
	k, err := k.normal()
	if err != nil {
		return fmt.Errorf("conntrack: delete: %w", err)
	}
	c, done := m.flows.Borrow()
	defer done()
	v, err := c.lookup(k)
	if err != nil {
		return notFound("delete", k, err)
	}
	if k.Family() == IPv4 {
		err = c.ct4.Delete(key4(k))
	} else {
		err = c.ct6.Delete(key6(k))
	}
	if err != nil {
		return notFound("delete", k, err)
	}
	if err := m.deleteHalf(k, &v); err != nil {
		return fmt.Errorf("conntrack: delete %s: %w", k, err)
	}
	return nil
}

// DeleteHalf removes the reverse-NAT half of a flow whose conntrack entry
// is gone already (a raw entry of fluxvm_fct4/6, as DecodeRaw reads it:
// bpf.CompactOptions.Dropped tells of them), on the same terms as Delete:
// only while the half still belongs to that flow. Without it, GC would
// find the half fresh and bring the flow back.
func (m *Map) DeleteHalf(key, value []byte) error {
	e, err := DecodeRaw(key, value)
	if err != nil {
		return err
	}
	var v bpf.CTValue
	if _, err := binary.Decode(value, binary.NativeEndian, &v); err != nil {
		return fmt.Errorf("conntrack: decode value: %w", err)
	}
	if err := m.deleteHalf(e.Key, &v); err != nil {
		return fmt.Errorf("conntrack: delete the half of %s: %w", e.Key, err)
	}
	return nil
}

// deleteHalf removes the reverse-NAT half of flow k (value v), or the
// leftover at its key, when it belongs to the flow.
func (m *Map) deleteHalf(k Key, v *bpf.CTValue) error {
	var b bpf.Backend
	if err := m.backends.Lookup(v.BackendId, &b); err != nil || !owns(&b, v.ServiceId) {
		// Without its backend the NAT half cannot be named; GC's sweep
		// of the NAT maps finds it as an orphan.
		return nil
	}
	nk, ok := natKey(k, v, &b)
	if revDerived(v) {
		// No half; where one would be, maybe an earlier flow's leftover.
		nk, ok = ewNATKey(k, &b), true
	}
	if !ok {
		return nil // DSR: no NAT half
	}
	// Delete the NAT entry only if it is this flow's (or its tuple's
	// leftover): a failover, a reused tuple or a reallocated SNAT port
	// may have given the key to another flow.
	if e, err := m.nat.Lookup(nk); err == nil && natOwnedBy(&e, k, v) {
		if err := m.nat.Delete(nk); err != nil && !errors.Is(err, nat.ErrNotFound) {
			return err
		}
	}
	return nil
}

// Scan streams the entries that match f to fn in chunks of at most a few
// thousand, IPv4 first. The slice is reused for the next chunk, so fn must
// copy what it keeps; fn may Delete entries of its chunk without
// disturbing the scan. An error from fn stops the scan and is returned as
// is.
//
// Memory stays bounded by the chunk size however large the maps are. The
// scan is not a snapshot: entries the datapath adds or the LRU evicts
// meanwhile may or may not be seen.
func (m *Map) Scan(f Filter, fn func([]Entry) error) error {
	buf := make([]Entry, 0, m.chunk)
	c, done := m.flows.Borrow()
	defer done()
	if f.Family == 0 || f.Family == IPv4 {
		if err := scanEntries(mapscan.NewScanner[bpf.Tuple4, bpf.CTValue](c.ct4, &m.mode, m.chunk), f, IPv4, buf, key4From, fn); err != nil {
			return err
		}
	}
	if f.Family == 0 || f.Family == IPv6 {
		if err := scanEntries(mapscan.NewScanner[bpf.Tuple6, bpf.CTValue](c.ct6, &m.mode, m.chunk), f, IPv6, buf, key6From, fn); err != nil {
			return err
		}
	}
	return nil
}

func scanEntries[K any](s *mapscan.Scanner[K, bpf.CTValue], f Filter, fam Family, buf []Entry,
	decode func(*K) Key, fn func([]Entry) error) error {
	return mapscan.Each(s, "conntrack: scan "+fam.String(), buf, func(k *K, v *bpf.CTValue) (Entry, bool) {
		if !f.matches(fam, v) {
			return Entry{}, false
		}
		return entry(decode(k), v), true
	}, fn)
}

// List returns all entries that match f. It holds them all in memory; use
// Scan for maps that may be large.
func (m *Map) List(f Filter) ([]Entry, error) {
	var out []Entry
	err := m.Scan(f, func(es []Entry) error {
		out = append(out, es...)
		return nil
	})
	return out, err
}

// Now returns the current time on CLOCK_MONOTONIC_COARSE: time since boot,
// in the resolution of the kernel tick. It is the clock the datapath stamps
// entries with (bpf_ktime_get_coarse_ns) and the one GC's now is read on.
// Wall-clock time (time.Now) is a different clock and cannot be compared
// with entry times.
func Now() (time.Duration, error) {
	now, err := bpf.Now()
	if err != nil {
		return 0, fmt.Errorf("conntrack: %w", err)
	}
	return now, nil
}

func notFound(op string, k Key, err error) error {
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("conntrack: %s %s: %w (%w)", op, k, ErrNotFound, err)
	}
	return fmt.Errorf("conntrack: %s %s: %w", op, k, err)
}

// owns reports whether backend slot b is in use by service sid.
func owns(b *bpf.Backend, sid uint32) bool {
	return bpf.BackendState(b.State) != bpf.BackendUnused && b.ServiceId == sid
}

// kindOf is the kind of conntrack value v.
func kindOf(v *bpf.CTValue) Kind { return Kind(v.Flags & kindMask) }

// revDerived reports whether conntrack value v is an east-west flow whose
// replies are derived from it (bpf.CTFlagRevDerived). The datapath sets
// the flag on east-west entries only; on any other kind it means nothing.
func revDerived(v *bpf.CTValue) bool {
	return kindOf(v) == EastWest && v.Flags&bpf.CTFlagRevDerived != 0
}

// snatOf is the SNAT address and port of conntrack value v of flow k, read
// in the flow's family as the datapath writes them.
func snatOf(k Key, v *bpf.CTValue) netip.AddrPort {
	return netip.AddrPortFrom(bpf.Addr(v.NatAddr, uint8(k.Family())), bpf.Port(v.NatPort))
}

// backendAddr is backend b's address and port, read in family fam as the
// datapath writes them.
func backendAddr(fam Family, b *bpf.Backend) netip.AddrPort {
	return netip.AddrPortFrom(bpf.Addr(b.Addr, uint8(fam)), bpf.Port(b.Port))
}

// natKey names the reverse-NAT half of flow k (conntrack value v) pinned
// to backend b: the reply from the backend to the client, or for an SNAT
// flow to the SNAT address and port. It reports false for flows without a
// NAT half (DSR, east-west with derived replies, or kind bits the
// datapath never writes).
func natKey(k Key, v *bpf.CTValue, b *bpf.Backend) (nat.Key, bool) {
	if !needsNAT(v) {
		return nat.Key{}, false
	}
	nk := ewNATKey(k, b)
	switch kindOf(v) {
	case EastWest:
		return nk, true
	case SNAT:
		nk.Client = snatOf(k, v)
		return nk, true
	}
	return nat.Key{}, false
}

// ewNATKey is the east-west reverse-NAT key of flow k on backend b: the
// reply from the backend to the client.
func ewNATKey(k Key, b *bpf.Backend) nat.Key {
	return nat.Key{Backend: backendAddr(k.Family(), b), Client: k.Client, Proto: k.Proto}
}

// natOwnedBy reports whether reverse-NAT entry e, found at the NAT key of
// flow k (conntrack value v), is that flow's half: the same backend and
// VIP, and for an SNAT flow a mapping back to this client. The datapath
// makes the same check on every packet of an SNAT flow.
func natOwnedBy(e *nat.Entry, k Key, v *bpf.CTValue) bool {
	if e.BackendID != v.BackendId || e.VIP != k.VIP {
		return false
	}
	if kindOf(v) == SNAT {
		return e.SNAT && e.Origin == k.Client
	}
	return !e.SNAT
}

// The conversions between typed entries and the raw map layout.

func key4(k Key) bpf.Tuple4 { return bpf.MakeTuple4(k.Client, k.VIP, k.Proto) }
func key6(k Key) bpf.Tuple6 { return bpf.MakeTuple6(k.Client, k.VIP, k.Proto) }

func key4From(t *bpf.Tuple4) Key {
	c, v := t.Endpoints()
	return Key{Client: c, VIP: v, Proto: t.Proto}
}

func key6From(t *bpf.Tuple6) Key {
	c, v := t.Endpoints()
	return Key{Client: c, VIP: v, Proto: t.Proto}
}

// entry decodes a raw entry. The SNAT words are read only for the SNAT
// kind: generation-1 entries were zero-extended, and only the flag says
// the words mean something. bpf.CTFlagRevDerived is read only on
// east-west entries.
func entry(k Key, v *bpf.CTValue) Entry {
	e := Entry{
		Key:       k,
		ServiceID: v.ServiceId,
		BackendID: v.BackendId,
		State:     bpf.CTState(v.State),
		Created:   time.Duration(v.CreatedNs),
		LastSeen:  time.Duration(v.LastSeenNs),
		Deadline:  time.Duration(v.DeadlineNs),
		Kind:      kindOf(v),
		// Not read from the flags alone: see revDerived.
		ReverseDerived: revDerived(v),
		Flow:           v.Flow,
	}
	switch e.Kind {
	case SNAT:
		e.SNAT = snatOf(k, v)
	case L7:
		// Only here: in an entry of any other kind the field is the
		// datapath's HA bookkeeping (bpf/lib/ha.h), no interface.
		e.ProxyIfindex = v.L7Ifindex
	}
	if e.Kind != L7 {
		e.HAUntil = time.Duration(v.L7Ifindex) * time.Second
	}
	e.Audited = v.Flags&bpf.CTFlagAudited != 0
	return e
}

// DecodeRaw returns the entry of a raw conntrack map entry: a key of
// fluxvm_fct4 (16 bytes) or fluxvm_fct6 (40 bytes) and its value, as a
// map walk outside this package reads them (bpf.CompactOptions.Dropped).
func DecodeRaw(key, value []byte) (Entry, error) {
	var v bpf.CTValue
	if _, err := binary.Decode(value, binary.NativeEndian, &v); err != nil {
		return Entry{}, fmt.Errorf("conntrack: decode value: %w", err)
	}
	switch len(key) {
	case binary.Size(bpf.Tuple4{}):
		var t bpf.Tuple4
		if _, err := binary.Decode(key, binary.NativeEndian, &t); err != nil {
			return Entry{}, fmt.Errorf("conntrack: decode key: %w", err)
		}
		return entry(key4From(&t), &v), nil
	case binary.Size(bpf.Tuple6{}):
		var t bpf.Tuple6
		if _, err := binary.Decode(key, binary.NativeEndian, &t); err != nil {
			return Entry{}, fmt.Errorf("conntrack: decode key: %w", err)
		}
		return entry(key6From(&t), &v), nil
	}
	return Entry{}, fmt.Errorf("conntrack: decode key: %d bytes, want a tuple of 16 or 40", len(key))
}
