package maglev

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"net/netip"
	"slices"
	"strconv"
	"sync"
)

// Table sizes offered for the datapath's map tiers. Each is prime; by the
// evenness rule (see the package documentation) they serve up to about 163,
// 655 and 1310 equally weighted backends with an imbalance within about 1%.
const (
	SizeS uint32 = 16381  // largest prime below 2^14
	SizeM uint32 = 65537  // Fermat prime 2^16 + 1
	SizeL uint32 = 131071 // Mersenne prime 2^17 − 1
)

// Bounds on Config.Size.
const (
	// MinSize is the smallest table: below 3 every backend would walk the
	// slots in the same order (the only skip is 1), which is not Maglev.
	MinSize uint32 = 3
	// MaxSize is the largest table, the largest prime below 2^24. It keeps a
	// table below 128 MiB and keeps size·weight products within 64 bits.
	MaxSize uint32 = 16777213
)

// Errors returned by New and Rebuild, wrapped with context; test for them
// with errors.Is.
var (
	// ErrSizeNotPrime: Config.Size is not a prime number.
	ErrSizeNotPrime = errors.New("table size is not prime")
	// ErrSizeOutOfRange: Config.Size is below MinSize or above MaxSize, or
	// the Table was not made by New.
	ErrSizeOutOfRange = errors.New("table size out of range")
	// ErrTooManyBackends: more eligible backends than table slots.
	ErrTooManyBackends = errors.New("too many backends")
	// ErrInvalidBackend: a backend has an invalid, zoned or unspecified
	// address, protocol 0, or ID 0.
	ErrInvalidBackend = errors.New("invalid backend")
	// ErrDuplicateBackend: two backends share an identity or an ID.
	ErrDuplicateBackend = errors.New("duplicate backend")
)

// Backend is one destination of a service.
//
// Its identity is (Addr, Port, Proto); the identity, not the slice position
// or the ID, decides where the backend's slots go, so the same set of
// backends yields the same table whatever order it is given in. An IPv4
// address and its IPv4-mapped IPv6 form (::ffff:a.b.c.d) are the same
// identity.
type Backend struct {
	// ID is the opaque datapath backend id that Entries stores in the slots.
	// It must be unique within a table and must not be 0: 0 is what a
	// zeroed BPF map reads as, so it must never alias a real backend.
	ID uint32
	// Addr is the backend's address; it must be valid, specified and
	// without a zone.
	Addr netip.Addr
	// Port is the backend's port, 0 for protocols without ports.
	Port uint16
	// Proto is the IP protocol number (6 TCP, 17 UDP, 132 SCTP); 0 is
	// rejected as unset.
	Proto uint8
	// Weight is the backend's relative share of slots; 0 takes no slots.
	Weight uint32
	// Ready marks a backend that may receive traffic; one that is not ready
	// takes no slots.
	Ready bool
}

// Eligible reports whether the backend takes slots: it is ready and has a
// positive weight.
func (b Backend) Eligible() bool { return b.Ready && b.Weight > 0 }

// String formats the backend as "addr:port/proto#id".
func (b Backend) String() string {
	return netip.AddrPortFrom(b.Addr, b.Port).String() + "/" +
		strconv.Itoa(int(b.Proto)) + "#" + strconv.FormatUint(uint64(b.ID), 10)
}

// Config sets the shape of a table. The zero Config is invalid: Size must be
// set.
type Config struct {
	// Size is M, the number of slots: a prime in [MinSize, MaxSize]. The
	// datapath picks a backend by slot hash % M. See SizeS, SizeM and SizeL.
	Size uint32
	// Seed is a per-cluster seed for the backend hashes. Every node that
	// must agree on the table (an active node and its standby) uses the
	// same seed; different clusters may use different seeds so that they do
	// not all shift the same flows when the same backend fails.
	Seed uint64
}

// SlotCount is the number of slots one eligible backend holds.
type SlotCount struct {
	Backend Backend
	Slots   int
}

// Table is a Maglev lookup table: Size slots, each naming one eligible
// backend, or no slot at all when no backend is eligible.
//
// Lookup, Entries, SlotCounts, Empty, Size and Measure only read the table
// and may run concurrently with one another, but not with Rebuild.
type Table struct {
	cfg Config

	// The live table. backends and ids are parallel and in canonical
	// identity order; counts[i] is the number of slots of backends[i].
	// byID finds a backend by its ID (see indexOf).
	backends []Backend
	ids      []identity
	counts   []uint32
	byID     []uint64
	idShift  uint8
	entries  []uint32 // len Size when not empty: the ID of each slot's backend

	// Scratch kept across Rebuilds so that a steady-state Rebuild allocates
	// nothing. spareBackends and spareIDs receive the next backend set while
	// the live one stays intact, so that a Rebuild that fails on validation
	// leaves the table as it was.
	spareBackends []Backend
	spareIDs      []identity
	sorted        []sortItem
	idSorted      []uint32 // the IDs of the caller's backends, sorted
	remainders    []remainder
	cursors       []cursor
	windows       []window
	tails         []tailCursor
	occ           []byte   // occupancy of the slots during a fill, 1 if taken, two copies (see window)
	work          []uint32 // the order of turns; the tail's rank bitmaps and list of empty slots
	quota, filled []uint32
	members       []member
	groups        []group
	heap          []int32
}

type sortItem struct {
	id identity
	in int32 // index into the caller's slice
}

// New builds the table for backends. Only backends that are Ready and have a
// positive Weight take slots; if there is none, the table is empty (see
// Empty), which is a valid result, not an error.
//
// New does not keep backends; the caller may reuse the slice.
func New(cfg Config, backends []Backend) (*Table, error) {
	if err := checkSize(cfg.Size); err != nil {
		return nil, err
	}
	t := &Table{cfg: cfg}
	// The fill's largest scratch comes from a pool and goes back to it:
	// the table does not need it once built, and a later Rebuild grows
	// its own.
	sc, _ := scratchPool.Get().(*scratch)
	if sc == nil {
		sc = new(scratch)
	}
	t.occ, t.windows, t.work = sc.occ, sc.windows, sc.work
	err := t.Rebuild(backends)
	sc.occ, sc.windows, sc.work = t.occ, t.windows, t.work
	t.occ, t.windows, t.work = nil, nil, nil
	scratchPool.Put(sc)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// scratch is the part of a fill's scratch that New borrows from
// scratchPool: the occupancy (2 bytes per slot), the order of turns and
// the tail's bitmaps (4 bytes per slot) and the windows (280 bytes per
// backend).
type scratch struct {
	occ     []byte
	windows []window
	work    []uint32
}

var scratchPool sync.Pool

func checkSize(m uint32) error {
	if m < MinSize || m > MaxSize {
		return fmt.Errorf("maglev: size %d not in [%d, %d]: %w", m, MinSize, MaxSize, ErrSizeOutOfRange)
	}
	if !IsPrime(m) {
		return fmt.Errorf("maglev: size %d: %w (try %d)", m, ErrSizeNotPrime, NextPrime(m))
	}
	return nil
}

// Rebuild replaces the table's contents with the table for backends, with
// the table's existing Config. It reuses the table's storage: once the table
// has been rebuilt with a backend set at least as large, Rebuild allocates
// nothing. (The first Rebuild of a table made by New allocates the fill's
// scratch, which New borrows from a pool instead.)
//
// On error the table is left exactly as it was. On success, slices
// previously returned by Entries see the new contents.
func (t *Table) Rebuild(backends []Backend) error {
	if err := checkSize(t.cfg.Size); err != nil {
		return err
	}
	n, err := t.validate(backends)
	if err != nil {
		return err
	}
	t.commit(backends, n)
	return nil
}

// validate checks every backend and the set as a whole without touching the
// live table. It leaves all backends in canonical order in t.sorted and
// returns the number of eligible ones.
func (t *Table) validate(backends []Backend) (n int, err error) {
	if len(backends) > math.MaxInt32 {
		return 0, fmt.Errorf("maglev: %d backends: %w", len(backends), ErrTooManyBackends)
	}
	items := withCap(t.sorted, len(backends))
	ids := withCap(t.idSorted, len(backends))
	for i := range backends {
		b := &backends[i]
		if err := checkBackend(i, b); err != nil {
			return 0, err
		}
		items = append(items, sortItem{id: identityOf(b.Addr, b.Port, b.Proto), in: int32(i)})
		ids = append(ids, b.ID)
		if b.Eligible() {
			n++
		}
	}
	t.sorted, t.idSorted = items, ids // keep grown capacity even on error

	if n > int(t.cfg.Size) {
		return 0, fmt.Errorf("maglev: %d eligible backends for size %d: %w", n, t.cfg.Size, ErrTooManyBackends)
	}
	slices.SortFunc(items, func(a, b sortItem) int { return a.id.compare(b.id) })
	for k := 1; k < len(items); k++ {
		if items[k].id == items[k-1].id {
			i, j := min(items[k-1].in, items[k].in), max(items[k-1].in, items[k].in)
			return 0, fmt.Errorf("maglev: backends %d and %d: %w: same identity %s",
				i, j, ErrDuplicateBackend, backends[i].identityString())
		}
	}
	slices.Sort(ids)
	for k := 1; k < len(ids); k++ {
		if ids[k] == ids[k-1] {
			return 0, fmt.Errorf("maglev: %w: ID %d used twice", ErrDuplicateBackend, ids[k])
		}
	}
	return n, nil
}

func checkBackend(i int, b *Backend) error {
	var why string
	switch {
	case !b.Addr.IsValid():
		why = "address not set"
	case b.Addr.Zone() != "":
		why = "address has a zone"
	case b.Addr.Unmap().IsUnspecified():
		why = "address unspecified"
	case b.Proto == 0:
		why = "protocol 0"
	case b.ID == 0:
		why = "ID 0 is reserved"
	default:
		return nil
	}
	return fmt.Errorf("maglev: backend %d (%s): %w: %s", i, b, ErrInvalidBackend, why)
}

func (b *Backend) identityString() string {
	return netip.AddrPortFrom(b.Addr, b.Port).String() + "/" + strconv.Itoa(int(b.Proto))
}

// commit installs the validated backend set; nothing in it can fail.
func (t *Table) commit(backends []Backend, n int) {
	nb, nk := withCap(t.spareBackends, n), withCap(t.spareIDs, n)
	for _, it := range t.sorted {
		if b := &backends[it.in]; b.Eligible() {
			nb = append(nb, *b)
			nk = append(nk, it.id)
		}
	}
	t.spareBackends, t.backends = t.backends, nb
	t.spareIDs, t.ids = t.ids, nk
	t.indexIDs()
	t.counts = grow(t.counts, n)
	if n == 0 {
		t.entries = t.entries[:0]
		return
	}
	t.apportion()
	t.populate()
}

// grow returns s with length n, reusing its storage when it is large enough.
func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// Lookup returns the backend of the slot hash % Size, as the datapath would
// pick it. ok is false when the table is empty.
//
// The table stores only the datapath's entries (backend IDs), so Lookup
// finds the backend by its ID, in a hash index of the backends.
func (t *Table) Lookup(hash uint32) (b Backend, ok bool) {
	if len(t.backends) == 0 {
		return Backend{}, false
	}
	return t.backends[t.indexOf(t.entries[hash%t.cfg.Size])], true
}

// indexIDs indexes t.backends by ID for indexOf: byID is an open
// addressing hash table of 2^k ≥ 2N entries ID<<32 | index, 0 for none (no
// ID is 0), with linear probing from idHome.
func (t *Table) indexIDs() {
	if len(t.backends) == 0 {
		t.byID = t.byID[:0]
		return
	}
	k := bits.Len(uint(2*len(t.backends) - 1)) // 2^k ≥ 2N
	t.byID = grow(t.byID, 1<<k)
	clear(t.byID)
	t.idShift = uint8(32 - k)
	mask := uint32(len(t.byID) - 1)
	for i := range t.backends {
		id := t.backends[i].ID
		h := idHome(id, t.idShift)
		for t.byID[h] != 0 {
			h = (h + 1) & mask
		}
		t.byID[h] = uint64(id)<<32 | uint64(i)
	}
}

// idHome is the first entry of byID to look at for id: the top bits of
// a multiplicative hash, after folding the high half of id into the low
// one so that IDs differing only in high bits spread too.
func idHome(id uint32, shift uint8) uint32 {
	return (id ^ id>>16) * 0x9e3779b1 >> shift
}

// indexOf returns the index into t.backends of the eligible backend with
// the given ID. Every entry of the table is such an ID; any other is a
// broken invariant (say, Entries modified by a caller) and panics rather
// than being searched for forever.
func (t *Table) indexOf(id uint32) int {
	mask := uint32(len(t.byID) - 1)
	h := idHome(id, t.idShift)
	for {
		switch v := t.byID[h]; {
		case v>>32 == uint64(id):
			return int(uint32(v))
		case v == 0:
			panic(fmt.Sprintf("maglev: ID %d is not a backend of the table", id))
		}
		h = (h + 1) & mask
	}
}

// Entries returns the table as the datapath indexes it: Size backend IDs,
// entry hash % Size being the ID of the backend for that hash. It returns nil
// when the table is empty; the datapath must then drop (and count) rather
// than read a slot.
//
// The slice belongs to the table: do not modify it, and note that Rebuild
// overwrites it in place. Copy it to keep it.
func (t *Table) Entries() []uint32 {
	if len(t.backends) == 0 {
		return nil
	}
	return t.entries
}

// Empty reports whether no backend is eligible, in which case Lookup fails
// and Entries is empty.
func (t *Table) Empty() bool { return len(t.backends) == 0 }

// Size returns M, the number of slots (also of an empty table).
func (t *Table) Size() uint32 { return t.cfg.Size }

// Config returns the table's configuration.
func (t *Table) Config() Config { return t.cfg }

// SlotCounts returns, for each eligible backend in canonical identity order
// (address bytes, then port, then protocol), the number of slots it holds.
// A backend whose weight is too small for a single slot is listed with 0.
// The counts sum to Size unless the table is empty.
func (t *Table) SlotCounts() []SlotCount {
	out := make([]SlotCount, len(t.backends))
	for i, b := range t.backends {
		out[i] = SlotCount{Backend: b, Slots: int(t.counts[i])}
	}
	return out
}
