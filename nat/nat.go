package nat

import (
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
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrNotFound: the table holds no entry for the key.
	ErrNotFound = errors.New("reverse-NAT entry not found")
	// ErrExists: Create found an entry for the key already.
	ErrExists = errors.New("reverse-NAT entry exists")
	// ErrInvalidMap: a map handed to New is not a reverse-NAT map of this
	// schema (type, key or value size).
	ErrInvalidMap = errors.New("not a reverse-NAT map")
	// ErrInvalidEntry: a key or entry that the datapath could never have
	// written (mixed address families, protocol, zero ids or ports).
	ErrInvalidEntry = errors.New("invalid reverse-NAT entry")
)

// IP protocols the datapath translates.
const (
	ProtoTCP = 6
	ProtoUDP = 17
)

// Family is an address family, as a Filter selects it: the SDK's one
// Family type (bpf.Family), shared with conntrack.
type Family = bpf.Family

// Families; the zero Family in a Filter selects both.
const (
	IPv4 = bpf.IPv4
	IPv6 = bpf.IPv6
)

// Key names a reverse-NAT entry: a reply as it leaves the backend, from
// Backend to Client. IPv4-mapped IPv6 addresses are taken as IPv4, the
// way the datapath stores them.
type Key struct {
	Backend netip.AddrPort // the backend's address and port (reply source)
	Client  netip.AddrPort // the client's address and port (reply destination)
	Proto   uint8          // ProtoTCP or ProtoUDP
}

// Entry is one reverse-NAT entry: how to turn a reply from Key.Backend back
// into one from the VIP the client addressed.
//
// An east-west entry (SNAT false) keys the reply by the client itself:
// Key.Client is the client's address and port, and only the reply's source
// is translated (back to VIP). Only stored east-west flows have one (a
// frontend with bpf.SvcFlagRevStored, or a flow learned before program
// generation 4): the replies of the others are derived from their
// conntrack entry. A north-south entry with source NAT (SNAT
// true) is an SNAT mapping: Key.Client is the SNAT address and port the
// backend saw as the flow's source, and Origin is the client's own address
// and port, which the reply's destination is translated back to.
//
// Entries written by program generation 1 have no flags and read as
// east-west entries, which is what they are.
type Entry struct {
	Key
	VIP       netip.AddrPort // the service frontend the client addressed
	ServiceID uint32
	BackendID uint32 // id in fluxvm_backends; never 0
	// LastSeen is when a reply last refreshed the entry, on
	// CLOCK_MONOTONIC_COARSE (time since boot), the clock the datapath
	// stamps with. The datapath refreshes it at most once a second.
	LastSeen time.Duration
	// SNAT marks an SNAT mapping (bpf.NATFlagSNAT): Key.Client is the
	// SNAT address and port, never port 0, and Origin is set.
	SNAT bool
	// Origin is the client's own address and port, of the key's family,
	// for an SNAT mapping; the zero AddrPort for an east-west entry.
	Origin netip.AddrPort
	// HostRouting (bpf.NATFlagHostRouting): translated replies that
	// arrive on an ingress hook are forwarded by FIB lookup and redirect
	// instead of through the host stack. It changes how replies travel,
	// not what they are translated to.
	HostRouting bool
	// Flow is the id of the flow's FluxScope record, as in its conntrack
	// half (conntrack.Entry.Flow); 0 when the flow has none.
	Flow uint32
}

func (k Key) String() string {
	return fmt.Sprintf("%s %s->%s", protoName(k.Proto), k.Backend, k.Client)
}

// Family is the key's address family, taken from the backend address.
func (k Key) Family() Family {
	if k.Backend.Addr().Unmap().Is4() {
		return IPv4
	}
	return IPv6
}

func protoName(p uint8) string {
	switch p {
	case ProtoTCP:
		return "tcp"
	case ProtoUDP:
		return "udp"
	}
	return fmt.Sprintf("proto(%d)", p)
}

// normal returns k with mapped addresses unmapped, or an error if the
// datapath could never have written it.
func (k Key) normal() (Key, error) {
	var problem string
	k.Backend, k.Client, problem = bpf.NormalizeEndpoints(k.Backend, k.Client, k.Proto)
	if problem != "" {
		return k, fmt.Errorf("%w: %s: %s", ErrInvalidEntry, k, problem)
	}
	return k, nil
}

func (e Entry) normal() (Entry, error) {
	k, err := e.Key.normal()
	if err != nil {
		return e, err
	}
	e.Key, e.VIP = k, netip.AddrPortFrom(e.VIP.Addr().Unmap(), e.VIP.Port())
	switch {
	case !e.VIP.Addr().IsValid() || e.VIP.Addr().Is4() != k.Backend.Addr().Is4():
		return e, fmt.Errorf("%w: %s: VIP %s is not of the key's family", ErrInvalidEntry, k, e.VIP)
	case e.VIP.Port() == 0:
		// Port 0 marks a VIP in the frontend map; it is never a service port.
		return e, fmt.Errorf("%w: %s: VIP port 0", ErrInvalidEntry, k)
	case e.BackendID == 0:
		return e, fmt.Errorf("%w: %s: backend id 0 is never used", ErrInvalidEntry, k)
	case e.LastSeen < 0:
		return e, fmt.Errorf("%w: %s: negative last-seen time", ErrInvalidEntry, k)
	}
	if !e.SNAT {
		if e.Origin != (netip.AddrPort{}) {
			return e, fmt.Errorf("%w: %s: origin %s set on an entry without SNAT", ErrInvalidEntry, k, e.Origin)
		}
		return e, nil
	}
	e.Origin = netip.AddrPortFrom(e.Origin.Addr().Unmap(), e.Origin.Port())
	switch o := e.Origin.Addr(); {
	case !o.IsValid():
		return e, fmt.Errorf("%w: %s: SNAT entry without an origin", ErrInvalidEntry, k)
	case o.Is4() != k.Backend.Addr().Is4():
		return e, fmt.Errorf("%w: %s: origin %s is not of the key's family", ErrInvalidEntry, k, e.Origin)
	case o.Zone() != "":
		return e, fmt.Errorf("%w: %s: zoned origin %s", ErrInvalidEntry, k, e.Origin)
	case k.Client.Port() == 0:
		// The datapath allocates SNAT ports from a range that starts
		// above 0.
		return e, fmt.Errorf("%w: %s: SNAT port 0", ErrInvalidEntry, k)
	}
	return e, nil
}

// Filter selects entries for Scan and List. The zero Filter selects all.
type Filter struct {
	Family     Family   // 0: both families
	ServiceIDs []uint32 // nil: any service; empty but non-nil: none
	BackendIDs []uint32 // nil: any backend; empty but non-nil: none
}

func (f Filter) matches(fam Family, sid, bid uint32) bool {
	return (f.Family == 0 || f.Family == fam) &&
		(f.ServiceIDs == nil || slices.Contains(f.ServiceIDs, sid)) &&
		(f.BackendIDs == nil || slices.Contains(f.BackendIDs, bid))
}

// Table is the typed view of the reverse-NAT maps fluxvm_nat4 and
// fluxvm_nat6. It is safe for concurrent use; the datapath writes the same
// maps concurrently (see the package documentation for what that means).
type Table struct {
	maps  *handoff.Value[natMaps]
	mode  mapscan.Mode
	chunk int
}

// natMaps are the maps a Table works on; Rebind replaces them.
type natMaps struct{ nat4, nat6 *ebpf.Map }

// New returns the Table over the reverse-NAT maps of a loaded (or pinned)
// TC object. It checks that they are hash maps with this schema's key and
// value layouts (and names, when the kernel reports one) and returns an
// ErrInvalidMap error otherwise. The Table
// does not own the maps: closing them is the caller's business.
func New(nat4, nat6 *ebpf.Map) (*Table, error) {
	if err := checkMap("fluxvm_nat4", nat4, unsafe.Sizeof(bpf.Tuple4{})); err != nil {
		return nil, err
	}
	if err := checkMap("fluxvm_nat6", nat6, unsafe.Sizeof(bpf.Tuple6{})); err != nil {
		return nil, err
	}
	return &Table{maps: handoff.New(natMaps{nat4, nat6}), chunk: mapscan.DefaultChunk}, nil
}

// Rebind points the Table at other maps of the same layouts (the datapath
// rebuilt them: bpf.Datapath.CompactFlowMaps). It takes effect at once
// for new operations and returns the function that waits until no
// operation of the Table uses the previous maps any more and returns them:
// the caller may close them then. Operations already running finish on
// the previous maps.
func (t *Table) Rebind(nat4, nat6 *ebpf.Map) (wait func() (old4, old6 *ebpf.Map), err error) {
	if err := checkMap("fluxvm_nat4", nat4, unsafe.Sizeof(bpf.Tuple4{})); err != nil {
		return nil, err
	}
	if err := checkMap("fluxvm_nat6", nat6, unsafe.Sizeof(bpf.Tuple6{})); err != nil {
		return nil, err
	}
	w := t.maps.Swap(natMaps{nat4, nat6})
	return func() (*ebpf.Map, *ebpf.Map) {
		old := w()
		return old.nat4, old.nat6
	}, nil
}

func checkMap(name string, m *ebpf.Map, keySize uintptr) error {
	valSize := unsafe.Sizeof(bpf.NATValue{})
	switch {
	case m == nil:
		return fmt.Errorf("nat: %s: %w: nil map", name, ErrInvalidMap)
	case m.Type() != ebpf.LRUHash && m.Type() != ebpf.Hash:
		return fmt.Errorf("nat: %s: %w: type %s, want LRU hash", name, ErrInvalidMap, m.Type())
	case uintptr(m.KeySize()) != keySize || uintptr(m.ValueSize()) != valSize:
		return fmt.Errorf("nat: %s: %w: key/value size %d/%d, want %d/%d",
			name, ErrInvalidMap, m.KeySize(), m.ValueSize(), keySize, valSize)
	}
	// fluxvm_nat4 and fluxvm_fct4 have the same layout; only the name
	// tells them apart. Maps made without a name pass.
	if info, err := m.Info(); err == nil && info.Name != "" && info.Name != name {
		return fmt.Errorf("nat: %s: %w: map is named %s", name, ErrInvalidMap, info.Name)
	}
	return nil
}

// Lookup returns the entry for k, or an error matching ErrNotFound.
func (t *Table) Lookup(k Key) (Entry, error) {
	k, err := k.normal()
	if err != nil {
		return Entry{}, fmt.Errorf("nat: lookup: %w", err)
	}
	var v bpf.NATValue
	m, done := t.maps.Borrow()
	defer done()
	if k.Family() == IPv4 {
		err = m.nat4.Lookup(key4(k), &v)
	} else {
		err = m.nat6.Lookup(key6(k), &v)
	}
	if err != nil {
		return Entry{}, wrapNotFound("lookup", k, err)
	}
	return entry(k, &v), nil
}

// Put creates the entry or replaces the one with the same key.
func (t *Table) Put(e Entry) error {
	return t.update("put", e, ebpf.UpdateAny)
}

// Create adds the entry only if its key is free, and otherwise returns an
// error matching ErrExists. Repairs use it so that they never overwrite
// what the datapath wrote in the meantime.
func (t *Table) Create(e Entry) error {
	return t.update("create", e, ebpf.UpdateNoExist)
}

func (t *Table) update(op string, e Entry, flags ebpf.MapUpdateFlags) error {
	e, err := e.normal()
	if err != nil {
		return fmt.Errorf("nat: %s: %w", op, err)
	}
	v := value(&e)
	m, done := t.maps.Borrow()
	defer done()
	if e.Family() == IPv4 {
		err = m.nat4.Update(key4(e.Key), &v, flags)
	} else {
		err = m.nat6.Update(key6(e.Key), &v, flags)
	}
	if errors.Is(err, ebpf.ErrKeyExist) {
		return fmt.Errorf("nat: %s %s: %w (%w)", op, e.Key, ErrExists, err)
	}
	if err != nil {
		return fmt.Errorf("nat: %s %s: %w", op, e.Key, err)
	}
	return nil
}

// Delete removes the entry for k, or returns an error matching ErrNotFound.
func (t *Table) Delete(k Key) error {
	k, err := k.normal()
	if err != nil {
		return fmt.Errorf("nat: delete: %w", err)
	}
	m, done := t.maps.Borrow()
	defer done()
	if k.Family() == IPv4 {
		err = m.nat4.Delete(key4(k))
	} else {
		err = m.nat6.Delete(key6(k))
	}
	if err != nil {
		return wrapNotFound("delete", k, err)
	}
	return nil
}

// DeleteKeys removes the entries for keys with batch deletes and returns
// how many it removed. Keys without an entry are skipped, not an error:
// the LRU may have evicted them. It stops at the first invalid key or
// failing syscall.
func (t *Table) DeleteKeys(keys []Key) (int, error) {
	// GC calls this once per chunk; pooled buffers keep its garbage from
	// growing with the number of flows.
	b4, b6 := tuple4Pool.Get().(*[]bpf.Tuple4), tuple6Pool.Get().(*[]bpf.Tuple6)
	defer func() {
		*b4, *b6 = (*b4)[:0], (*b6)[:0]
		tuple4Pool.Put(b4)
		tuple6Pool.Put(b6)
	}()
	k4, k6 := *b4, *b6
	for _, k := range keys {
		k, err := k.normal()
		if err != nil {
			return 0, fmt.Errorf("nat: delete keys: %w", err)
		}
		if k.Family() == IPv4 {
			k4 = append(k4, key4(k))
		} else {
			k6 = append(k6, key6(k))
		}
	}
	*b4, *b6 = k4, k6
	m, done := t.maps.Borrow()
	defer done()
	n4, err := mapscan.DeleteKeys(m.nat4, &t.mode, k4, nil)
	if err != nil {
		return n4, fmt.Errorf("nat: delete keys: fluxvm_nat4: %w", err)
	}
	n6, err := mapscan.DeleteKeys(m.nat6, &t.mode, k6, nil)
	if err != nil {
		return n4 + n6, fmt.Errorf("nat: delete keys: fluxvm_nat6: %w", err)
	}
	return n4 + n6, nil
}

var (
	tuple4Pool = sync.Pool{New: func() any { return new([]bpf.Tuple4) }}
	tuple6Pool = sync.Pool{New: func() any { return new([]bpf.Tuple6) }}
)

// Scan streams the entries that match f to fn in chunks of at most a few
// thousand, IPv4 first. The slice is reused for the next chunk, so fn must
// copy what it keeps. fn may delete entries of its chunk (Delete,
// DeleteKeys) without disturbing the scan; an entry it adds may or may not
// be seen later in the same scan. An error from fn stops the scan and is
// returned as is.
//
// Memory stays bounded by the chunk size however large the maps are. The
// scan is not a snapshot: entries the datapath adds or the LRU evicts
// meanwhile may or may not be seen.
func (t *Table) Scan(f Filter, fn func([]Entry) error) error {
	buf := make([]Entry, 0, t.chunk)
	m, done := t.maps.Borrow()
	defer done()
	if f.Family == 0 || f.Family == IPv4 {
		s := mapscan.NewScanner[bpf.Tuple4, bpf.NATValue](m.nat4, &t.mode, t.chunk)
		if err := scan(s, f, IPv4, buf, key4From, fn); err != nil {
			return err
		}
	}
	if f.Family == 0 || f.Family == IPv6 {
		s := mapscan.NewScanner[bpf.Tuple6, bpf.NATValue](m.nat6, &t.mode, t.chunk)
		if err := scan(s, f, IPv6, buf, key6From, fn); err != nil {
			return err
		}
	}
	return nil
}

func scan[K any](s *mapscan.Scanner[K, bpf.NATValue], f Filter, fam Family, buf []Entry,
	decode func(*K) Key, fn func([]Entry) error) error {
	return mapscan.Each(s, "nat: scan "+fam.String(), buf, func(k *K, v *bpf.NATValue) (Entry, bool) {
		if !f.matches(fam, v.ServiceId, v.BackendId) {
			return Entry{}, false
		}
		return entry(decode(k), v), true
	}, fn)
}

// List returns all entries that match f. It holds them all in memory;
// use Scan for maps that may be large.
func (t *Table) List(f Filter) ([]Entry, error) {
	var out []Entry
	err := t.Scan(f, func(es []Entry) error {
		out = append(out, es...)
		return nil
	})
	return out, err
}

func wrapNotFound(op string, k Key, err error) error {
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("nat: %s %s: %w (%w)", op, k, ErrNotFound, err)
	}
	return fmt.Errorf("nat: %s %s: %w", op, k, err)
}

// The conversions between typed entries and the raw map layout. They are
// the only place that knows which tuple field holds what.

func key4(k Key) bpf.Tuple4 { return bpf.MakeTuple4(k.Backend, k.Client, k.Proto) }
func key6(k Key) bpf.Tuple6 { return bpf.MakeTuple6(k.Backend, k.Client, k.Proto) }

func key4From(t *bpf.Tuple4) Key {
	b, c := t.Endpoints()
	return Key{Backend: b, Client: c, Proto: t.Proto}
}

func key6From(t *bpf.Tuple6) Key {
	b, c := t.Endpoints()
	return Key{Backend: b, Client: c, Proto: t.Proto}
}

// entry decodes a raw entry. The client words of an entry without
// NATFlagSNAT are not read: generation-1 entries were zero-extended, and
// only the flag says the words mean something. Flag bits this package
// does not know are dropped.
func entry(k Key, v *bpf.NATValue) Entry {
	fam := uint8(k.Family())
	e := Entry{
		Key:         k,
		VIP:         netip.AddrPortFrom(bpf.Addr(v.Vip, fam), bpf.Port(v.Vport)),
		ServiceID:   v.ServiceId,
		BackendID:   v.BackendId,
		LastSeen:    time.Duration(v.LastSeenNs),
		SNAT:        v.Flags&bpf.NATFlagSNAT != 0,
		HostRouting: v.Flags&bpf.NATFlagHostRouting != 0,
		Flow:        v.Flow,
	}
	if e.SNAT {
		e.Origin = netip.AddrPortFrom(bpf.Addr(v.Client, fam), bpf.Port(v.Cport))
	}
	return e
}

func value(e *Entry) bpf.NATValue {
	v := bpf.NATValue{
		Vip:        bpf.AddrWords(e.VIP.Addr()),
		Vport:      bpf.Port(e.VIP.Port()),
		ServiceId:  e.ServiceID,
		BackendId:  e.BackendID,
		LastSeenNs: uint64(e.LastSeen),
		Flow:       e.Flow,
	}
	if e.SNAT {
		v.Flags |= bpf.NATFlagSNAT
		v.Client = bpf.AddrWords(e.Origin.Addr())
		v.Cport = bpf.Port(e.Origin.Port())
	}
	if e.HostRouting {
		v.Flags |= bpf.NATFlagHostRouting
	}
	return v
}
