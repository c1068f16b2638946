package revindex

import (
	"errors"
	"fmt"
	"iter"
	"maps"
	"net/netip"
	"slices"
	"syscall"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
)

// The reverse translation index, fluxvm_be2fe (layout and datapath use in
// bpf/fluxvm_abi_ct.bpf.h; docs/architecture.md, "Reverse translation
// index"): for every backend endpoint (address, port, protocol), the
// frontends that list it, in a stable order. A reply backend:port ->
// client:cport of an east-west flow finds its flow through the slot of
// the flow's frontend, so:
//
//   - east-west NAT frontends list their backends (Indexed); north-south
//     only and DSR ones take no new slot, but keep the ones they have;
//   - a frontend's slot is written before any table of the frontend can
//     name the backend (the services component's Prepare calls Add);
//   - a frontend keeps its slot index as long as it lists the backend; a
//     new one is appended; one that stops listing it is taken out (Remove)
//     only after no table of it names the backend, and the later ones
//     move down. Moving down is safe; moving up past the map's Be2feSlots
//     is not, and never happens;
//   - only the first bpf.Be2feSlots slots are in the map (Count); a longer
//     list is marked Be2feFlagOverflow, and a frontend past the slots of
//     any of its backends has SvcFlagRevStored (PastSlots), set in its
//     live frontend entry before a table naming such a backend goes in
//     (MarkRevStored), and cleared once it moved into the slots
//     everywhere (RefreshRevStored);
//   - Draining and Unhealthy backends stay listed: only leaving the intent
//     (or the frontend going) takes a slot out.
//
// The model and the map agree after every change: a write that fails
// leaves the model as it was. At Open the order is seeded from the map
// pinned then (Seed) and the restore appends what the catalog adds; slots
// the catalog does not confirm go afterwards (Settle).

// Key names a frontend: its VIP, port and IP protocol.
type Key struct {
	VIP   netip.Addr
	Port  uint16
	Proto uint8
}

// String is "vip:port/tcp" or "vip:port/udp", as the facade names a
// frontend.
func (f Key) String() string {
	p := intent.TCP
	if f.Proto == 17 {
		p = intent.UDP
	}
	return fmt.Sprintf("%s/%s", netip.AddrPortFrom(f.VIP, f.Port), p)
}

// Slot is one frontend listing a backend endpoint.
type Slot struct {
	Key       Key
	ServiceID uint32 // the frontend's service id
	BackendID uint32 // the backend's id in that frontend
	// Seeded: read from the pinned map by Seed and not confirmed by Add
	// since (Settle drops it if it never is, with a catalog).
	Seeded bool
}

// Map is fluxvm_be2fe as the index writes it (*ebpf.Map has these
// methods): Put of a bpf.Be2feKey and bpf.Be2feValue, Delete of a
// bpf.Be2feKey (ebpf.ErrKeyNotExist when there is none).
type Map interface {
	Put(key, value any) error
	Delete(key any) error
	MaxEntries() uint32
}

// Frontends reads and writes the frontend entries (fluxvm_svc4/6) for
// SvcFlagRevStored: the services component's writers, called with the
// dataplane's lock held.
type Frontends interface {
	// Lookup reads the entry of f; ok is false when there is none.
	Lookup(f Key) (v bpf.SvcValue, ok bool, err error)
	// Put writes the entry of f.
	Put(f Key, v bpf.SvcValue) error
}

// Config is how the index settles after a restore.
type Config struct {
	// Catalog: the facade restores a catalog, so Settle drops the seeded
	// slots the restore did not confirm. False (no catalog: nothing is
	// restored, and the frontends the adopted maps still serve are
	// unknown): they stay until the embedder applies those frontends
	// again (which confirms each slot in place) or Cleanup, so that their
	// flows' replies keep being translated meanwhile.
	Catalog bool
}

// Deps is what the index writes through.
type Deps struct {
	// Map returns fluxvm_be2fe of the datapath in force.
	Map func() Map
	// Tier names the loaded tier in the error of a full map.
	Tier func() bpf.Tier
	// Frontends writes SvcFlagRevStored into the frontend entries.
	Frontends Frontends
}

// Index is the model of fluxvm_be2fe: for each backend endpoint,
// the frontends listing it in slot order, also past the map's slots.
// Called with the dataplane's lock held; it has no lock of its own.
type Index struct {
	cfg   Config
	deps  Deps
	lists map[bpf.Be2feKey][]Slot
}

// New returns an empty index; it writes nothing.
func New(cfg Config, deps Deps) (*Index, error) {
	if deps.Map == nil || deps.Tier == nil || deps.Frontends == nil {
		return nil, errors.New("reverse translation index: Map, Tier and Frontends are required")
	}
	return &Index{cfg: cfg, deps: deps, lists: map[bpf.Be2feKey][]Slot{}}, nil
}

// KeyOf is the index key of backend endpoint ep of a frontend of protocol
// proto.
func KeyOf(ep netip.AddrPort, proto uint8) bpf.Be2feKey { return bpf.MakeBe2feKey(ep, proto) }

// ValueOf is the map value of a list: its first Be2feSlots slots, and
// Be2feFlagOverflow when it has more.
func ValueOf(list []Slot) bpf.Be2feValue {
	var v bpf.Be2feValue
	n := min(len(list), bpf.Be2feSlots)
	v.Count = uint8(n)
	if len(list) > bpf.Be2feSlots {
		v.Flags |= bpf.Be2feFlagOverflow
	}
	for i, s := range list[:n] {
		v.Slots[i] = bpf.Be2feSlot{Vip: bpf.AddrWords(s.Key.VIP), Vport: bpf.Port(s.Key.Port), ServiceId: s.ServiceID, BackendId: s.BackendID}
	}
	return v
}

// Indexed reports whether a frontend of SvcValue flags is listed for its
// backends: those whose east-west replies are translated back on the VM
// edges. A north-south-only frontend is never served there (its replies
// meet the SNAT mapping), and DSR translates nothing, so neither takes a
// slot another frontend could use.
func Indexed(flags uint32) bool {
	return flags&(bpf.SvcFlagNoEastWest|bpf.SvcFlagDSR) == 0
}

func slotIndex(list []Slot, f Key) int {
	return slices.IndexFunc(list, func(s Slot) bool { return s.Key == f })
}

// Len is the number of backend endpoints listed.
func (x *Index) Len() int { return len(x.lists) }

// Overflowed is how many endpoints are listed by more frontends than the
// map's slots (Be2feFlagOverflow).
func (x *Index) Overflowed() int {
	n := 0
	for _, l := range x.lists {
		if len(l) > bpf.Be2feSlots {
			n++
		}
	}
	return n
}

// All yields every backend endpoint's list, in no order; a list is not
// to be changed.
func (x *Index) All() iter.Seq2[bpf.Be2feKey, []Slot] { return maps.All(x.lists) }

// Reset empties the model (Cleanup removed the map); it writes nothing.
func (x *Index) Reset() { x.lists = map[bpf.Be2feKey][]Slot{} }

// set makes the list of k new, writing the map first when its value
// changes; on a failed write the model keeps the old list.
func (x *Index) set(k bpf.Be2feKey, old, new []Slot) error {
	if ValueOf(old) != ValueOf(new) {
		if err := x.write(k, new); err != nil {
			return err
		}
	}
	if len(new) == 0 {
		delete(x.lists, k)
	} else {
		x.lists[k] = new
	}
	return nil
}

// write writes the map entry of list (none when it is empty).
func (x *Index) write(k bpf.Be2feKey, list []Slot) error {
	m := x.deps.Map()
	if len(list) == 0 {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("reverse translation index: %w", err)
		}
		return nil
	}
	if err := m.Put(k, ValueOf(list)); err != nil {
		if errors.Is(err, syscall.E2BIG) {
			return fmt.Errorf("%w: reverse translation index fluxvm_be2fe is full (%d backend endpoints in tier %s)",
				intent.ErrLimit, m.MaxEntries(), x.deps.Tier())
		}
		return fmt.Errorf("reverse translation index: %w", err)
	}
	return nil
}

// Add lists frontend f (service id sid) for backend endpoint ep with
// backend id bid: f keeps its slot if it has one (a seeded one is
// confirmed), else it is appended if listNew. A frontend that needs no
// slot (Indexed) keeps the one it has: flows it learned before a change
// of mode or exposure may still need it.
func (x *Index) Add(f Key, sid uint32, ep netip.AddrPort, bid uint32, listNew bool) error {
	k := KeyOf(ep, f.Proto)
	old := x.lists[k]
	s := Slot{Key: f, ServiceID: sid, BackendID: bid}
	i := slotIndex(old, f)
	if i >= 0 && old[i] == s || i < 0 && !listNew {
		return nil
	}
	var list []Slot
	if i >= 0 {
		list = slices.Clone(old)
		list[i] = s
	} else {
		list = append(slices.Clip(old), s)
	}
	if err := x.set(k, old, list); err != nil {
		return fmt.Errorf("backend %s: %w", ep, err)
	}
	return nil
}

// Remove takes f out of the list of backend endpoint ep (the later slots
// move down) and returns the frontends whose SvcFlagRevStored may be due
// to go (RefreshRevStored): the one that moved into the last slot, if
// any, and f itself. Nothing when f was not listed.
func (x *Index) Remove(f Key, ep netip.AddrPort) (recheck []Key, err error) {
	k := KeyOf(ep, f.Proto)
	old := x.lists[k]
	i := slotIndex(old, f)
	if i < 0 {
		return nil, nil
	}
	if err := x.set(k, old, slices.Delete(slices.Clone(old), i, i+1)); err != nil {
		return nil, fmt.Errorf("backend %s: %w", ep, err)
	}
	if i < bpf.Be2feSlots && len(old) > bpf.Be2feSlots {
		recheck = append(recheck, old[bpf.Be2feSlots].Key)
	}
	return append(recheck, f), nil
}

// PastSlots reports whether f is past the map's slots in the list of any
// of its backend endpoints eps: its flows must store reverse-NAT halves.
func (x *Index) PastSlots(f Key, eps iter.Seq[netip.AddrPort]) bool {
	for ep := range eps {
		if slotIndex(x.lists[KeyOf(ep, f.Proto)], f) >= bpf.Be2feSlots {
			return true
		}
	}
	return false
}
