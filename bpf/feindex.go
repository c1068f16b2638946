package bpf

import (
	"errors"
	"fmt"
	"math/bits"
	"sync"

	"github.com/cilium/ebpf"
)

// The IPv4 frontend index (fluxvm_fe4): fluxvm_svc4 direct-mapped by a
// hash of its key, so that the datapath's frontend stage reads one array
// slot (inlined by the verifier) instead of calling into the hash map.
// fluxvm_svc4 stays the truth; a slot answers for every key that hashes
// to it (no frontend, or exactly one) or sends the lookup to fluxvm_svc4
// (never written, or shared by several keys). The layout, the states and
// the datapath's side are in fluxvm_abi_service.bpf.h and
// lib/lb_frontend.h; the hash and the check below must stay equal to
// theirs (TestFrontendIndex runs the programs on slots written here).
//
// One FrontendIndex writes the index and its fluxvm_svc4 (the
// Datapath's: PutFrontend4, DeleteFrontend4): Put writes fluxvm_svc4 and
// then the slot, Delete the slot and then fluxvm_svc4, so a packet meets
// either the old answer or the new one, as it would with fluxvm_svc4
// alone. Open rebuilds the whole index from fluxvm_svc4 before any
// program of its load runs.
const (
	feHashMul   = 0x9E3779B97F4A7C15
	feCheckMul0 = 0xC2B2AE3D27D4EB4F
	feCheckMul1 = 0x165667B19E3779F9
	feKeyMask   = 1<<56 - 1
)

// Fe4Slot is a slot of the IPv4 frontend index (struct fluxvm_fe4_slot).
type Fe4Slot = serviceFluxvmFe4Slot

// feWord is k's 8 bytes as the datapath loads them (vip, port, protocol;
// the state byte zero).
func feWord(k SvcKey4) uint64 {
	return uint64(k.Vip) | uint64(k.Port)<<32 | uint64(k.Proto)<<48
}

// feSlotOf is the slot of key word w in an index of 1<<bits slots.
func feSlotOf(w uint64, bits uint) uint32 {
	return uint32((w * feHashMul) >> (64 - bits))
}

// feCheck is the check of a slot's first 16 bytes, loaded as w0 and w1.
func feCheck(w0, w1 uint64) uint32 {
	return uint32((w0*feCheckMul0 ^ w1*feCheckMul1) >> 32)
}

// feSlot builds a slot in state st, for key k and value v when st is
// FeOne, with its check.
func feSlot(st uint8, k SvcKey4, v SvcValue) Fe4Slot {
	s := Fe4Slot{State: st}
	if st == FeOne {
		s.Vip, s.Port, s.Proto = k.Vip, k.Port, k.Proto
		s.ServiceId, s.Flags = v.ServiceId, v.Flags
	}
	w0 := uint64(s.Vip) | uint64(s.Port)<<32 | uint64(s.Proto)<<48 | uint64(s.State)<<56
	s.Check = feCheck(w0, uint64(s.ServiceId)|uint64(s.Flags)<<32)
	return s
}

// feValid reports whether s carries a correct check.
func feValid(s Fe4Slot) bool {
	w0 := uint64(s.Vip) | uint64(s.Port)<<32 | uint64(s.Proto)<<48 | uint64(s.State)<<56
	return s.Check == feCheck(w0, uint64(s.ServiceId)|uint64(s.Flags)<<32)
}

// feKey is the key a FeOne slot holds.
func (s Fe4Slot) feKey() SvcKey4 { return SvcKey4{Vip: s.Vip, Port: s.Port, Proto: s.Proto} }

// feBits is log2 of the index's slots (a power of two by construction).
func feBits(m *ebpf.Map) (uint, error) {
	n := m.MaxEntries()
	if n == 0 || n&(n-1) != 0 {
		return 0, fmt.Errorf("fluxvm_fe4 holds %d slots, not a power of two", n)
	}
	return uint(bits.TrailingZeros32(n)), nil
}

// FrontendIndexStats is what the IPv4 frontend index holds.
type FrontendIndexStats struct {
	Slots     int `json:"slots"`
	Frontends int `json:"frontends"` // keys of fluxvm_svc4
	// One counts slots that answer for their one frontend, Shared the
	// slots (and Sharing the frontends) the datapath looks up in
	// fluxvm_svc4 because more than one frontend hashes there.
	One     int `json:"one"`
	Shared  int `json:"shared"`
	Sharing int `json:"sharing"`
}

// FrontendIndex writes fluxvm_svc4 and the IPv4 frontend index
// (fluxvm_fe4) of one object together; its methods are safe for
// concurrent use. Nothing else may write either map.
type FrontendIndex struct {
	mu        sync.Mutex
	svc4, fe4 *ebpf.Map
	bits      uint
}

// NewFrontendIndex returns the writer of svc4 (fluxvm_svc4) and its
// index fe4 (fluxvm_fe4). It writes nothing: Rebuild makes the index
// answer; until then every slot sends the datapath to fluxvm_svc4.
func NewFrontendIndex(svc4, fe4 *ebpf.Map) (*FrontendIndex, error) {
	b, err := feBits(fe4)
	if err != nil {
		return nil, fmt.Errorf("bpf: frontend index: %w", err)
	}
	return &FrontendIndex{svc4: svc4, fe4: fe4, bits: b}, nil
}

// Put writes the IPv4 frontend k -> v into fluxvm_svc4, then its slot of
// the index. A failed slot write leaves fluxvm_svc4 written and the slot
// as it was (right for every other key, stale for k until the next
// Rebuild or Put of k), and says so.
func (x *FrontendIndex) Put(k SvcKey4, v SvcValue) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if err := x.svc4.Put(k, v); err != nil {
		return fmt.Errorf("bpf: frontend: %w", err)
	}
	return x.update(k, &v)
}

// Delete removes the IPv4 frontend k: its slot of the index first, then
// the fluxvm_svc4 entry. A frontend that does not exist is not an error.
func (x *FrontendIndex) Delete(k SvcKey4) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if err := x.update(k, nil); err != nil {
		return err
	}
	if err := x.svc4.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("bpf: frontend: %w", err)
	}
	return nil
}

// update moves k's slot to what it must say once k maps to *v (v nil:
// once k is gone). A slot never written stays so (keys of fluxvm_svc4
// the index does not know may hash there); a shared slot stays shared
// until the next Rebuild.
func (x *FrontendIndex) update(k SvcKey4, v *SvcValue) error {
	idx := feSlotOf(feWord(k), x.bits)
	var cur Fe4Slot
	if err := x.fe4.Lookup(idx, &cur); err != nil {
		return fmt.Errorf("bpf: frontend index: slot %d: %w", idx, err)
	}
	st := cur.State
	if !feValid(cur) {
		st = FeShared
	}
	var next Fe4Slot
	switch {
	case st == FeUnknown || st == FeShared:
		return nil
	case v == nil && st == FeOne && cur.feKey() == k:
		next = feSlot(FeEmpty, k, SvcValue{})
	case v == nil:
		return nil
	case st == FeEmpty || (st == FeOne && cur.feKey() == k):
		next = feSlot(FeOne, k, *v)
	default: // another key's slot
		next = feSlot(FeShared, k, SvcValue{})
	}
	if next == cur {
		return nil
	}
	if err := x.fe4.Put(idx, next); err != nil {
		return fmt.Errorf("bpf: frontend index: slot %d: %w", idx, err)
	}
	return nil
}

// Rebuild rewrites every slot of the index from fluxvm_svc4 as it is now.
// Programs running on a kept index meet each slot old or new, both right
// for the frontends of the moment.
func (x *FrontendIndex) Rebuild() (FrontendIndexStats, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	n := int(x.fe4.MaxEntries())
	slots := make([]Fe4Slot, n)
	count := make([]int, n)
	st := FrontendIndexStats{Slots: n}
	var (
		k SvcKey4
		v SvcValue
	)
	it := x.svc4.Iterate()
	for it.Next(&k, &v) {
		st.Frontends++
		i := feSlotOf(feWord(k), x.bits)
		if count[i]++; count[i] == 1 {
			slots[i] = feSlot(FeOne, k, v)
		}
	}
	if err := it.Err(); err != nil {
		return st, fmt.Errorf("bpf: frontend index: read fluxvm_svc4: %w", err)
	}
	keys := make([]uint32, n)
	for i := range slots {
		keys[i] = uint32(i)
		switch c := count[i]; {
		case c == 0:
			slots[i] = feSlot(FeEmpty, SvcKey4{}, SvcValue{})
		case c == 1:
			st.One++
		default:
			slots[i] = feSlot(FeShared, SvcKey4{}, SvcValue{})
			st.Shared++
			st.Sharing += c
		}
	}
	if _, err := x.fe4.BatchUpdate(keys, slots, nil); err != nil {
		if !errors.Is(err, ebpf.ErrNotSupported) {
			return st, fmt.Errorf("bpf: frontend index: write: %w", err)
		}
		for i := range slots {
			if err := x.fe4.Put(keys[i], slots[i]); err != nil {
				return st, fmt.Errorf("bpf: frontend index: write slot %d: %w", i, err)
			}
		}
	}
	return st, nil
}

// PutFrontend4 writes the IPv4 frontend k -> v and its index slot
// (FrontendIndex.Put).
func (d *Datapath) PutFrontend4(k SvcKey4, v SvcValue) error { return d.fe.Put(k, v) }

// DeleteFrontend4 removes the IPv4 frontend k and updates its index slot
// (FrontendIndex.Delete).
func (d *Datapath) DeleteFrontend4(k SvcKey4) error { return d.fe.Delete(k) }
