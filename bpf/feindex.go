package bpf

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
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
	x := w * feHashMul
	x ^= x >> 29
	x *= feCheckMul0
	return uint32(x >> (64 - bits))
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
	s.Check = s.check()
	return s
}

// check is the check s's first 16 bytes call for, loaded as the datapath
// loads them.
func (s Fe4Slot) check() uint32 {
	return feCheck(feWord(s.feKey())|uint64(s.State)<<56, uint64(s.ServiceId)|uint64(s.Flags)<<32)
}

// feValid reports whether s carries a correct check.
func feValid(s Fe4Slot) bool { return s.Check == s.check() }

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
// concurrent use. Nothing else may write either map. It keeps which keys
// of fluxvm_svc4 hash to each slot, read by Rebuild and kept by Put and
// Delete, so that every slot it writes says exactly what fluxvm_svc4
// holds: a slot two frontends shared answers again for the one left when
// the other goes.
type FrontendIndex struct {
	mu        sync.Mutex
	svc4, fe4 *ebpf.Map
	bits      uint
	// built: Rebuild ran, and keys is what fluxvm_svc4 holds. Before,
	// Put and Delete write fluxvm_svc4 alone and leave every slot as it
	// is (they cannot know which other keys share it).
	built bool
	keys  map[SvcKey4]SvcValue
	slots map[uint32][]SvcKey4 // the keys of each slot that has any
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
// as it was (right for every other key, the old answer for k until the
// next write of the slot or Rebuild), and says so.
func (x *FrontendIndex) Put(k SvcKey4, v SvcValue) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if err := x.svc4.Put(k, v); err != nil {
		return fmt.Errorf("bpf: frontend: %w", err)
	}
	if !x.built {
		return nil
	}
	idx := feSlotOf(feWord(k), x.bits)
	if _, ok := x.keys[k]; !ok {
		x.slots[idx] = append(x.slots[idx], k)
	}
	x.keys[k] = v
	return x.write(idx)
}

// Delete removes the IPv4 frontend k: its slot of the index first, then
// the fluxvm_svc4 entry. A frontend that does not exist is not an error.
func (x *FrontendIndex) Delete(k SvcKey4) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if _, ok := x.keys[k]; x.built && ok {
		idx := feSlotOf(feWord(k), x.bits)
		delete(x.keys, k)
		x.slots[idx] = slices.DeleteFunc(x.slots[idx], func(o SvcKey4) bool { return o == k })
		if len(x.slots[idx]) == 0 {
			delete(x.slots, idx)
		}
		if err := x.write(idx); err != nil {
			return err
		}
	}
	if err := x.svc4.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("bpf: frontend: %w", err)
	}
	return nil
}

// slot is what slot idx must say for the keys that hash to it.
func (x *FrontendIndex) slot(idx uint32) Fe4Slot {
	switch ks := x.slots[idx]; len(ks) {
	case 0:
		return feSlot(FeEmpty, SvcKey4{}, SvcValue{})
	case 1:
		return feSlot(FeOne, ks[0], x.keys[ks[0]])
	default:
		return feSlot(FeShared, SvcKey4{}, SvcValue{})
	}
}

func (x *FrontendIndex) write(idx uint32) error {
	if err := x.fe4.Put(idx, x.slot(idx)); err != nil {
		return fmt.Errorf("bpf: frontend index: slot %d: %w", idx, err)
	}
	return nil
}

// Stats says what the index holds now (zero before Rebuild).
func (x *FrontendIndex) Stats() FrontendIndexStats {
	x.mu.Lock()
	defer x.mu.Unlock()
	st := FrontendIndexStats{Slots: int(x.fe4.MaxEntries()), Frontends: len(x.keys)}
	for _, ks := range x.slots {
		if len(ks) == 1 {
			st.One++
		} else {
			st.Shared++
			st.Sharing += len(ks)
		}
	}
	return st
}

// Rebuild reads fluxvm_svc4 and rewrites every slot of the index from it.
// Programs running on a kept index meet each slot old or new, both right
// for the frontends of the moment.
func (x *FrontendIndex) Rebuild() (FrontendIndexStats, error) {
	x.mu.Lock()
	keys := map[SvcKey4]SvcValue{}
	slots := map[uint32][]SvcKey4{}
	var (
		k SvcKey4
		v SvcValue
	)
	it := x.svc4.Iterate()
	for it.Next(&k, &v) {
		keys[k] = v
		idx := feSlotOf(feWord(k), x.bits)
		slots[idx] = append(slots[idx], k)
	}
	if err := it.Err(); err != nil {
		x.mu.Unlock()
		return FrontendIndexStats{}, fmt.Errorf("bpf: frontend index: read fluxvm_svc4: %w", err)
	}
	x.keys, x.slots, x.built = keys, slots, true
	n := x.fe4.MaxEntries()
	idxs := make([]uint32, n)
	vals := make([]Fe4Slot, n)
	for i := range n {
		idxs[i], vals[i] = i, x.slot(i)
	}
	err := x.writeAll(idxs, vals)
	x.mu.Unlock()
	if err != nil {
		return FrontendIndexStats{}, err
	}
	return x.Stats(), nil
}

func (x *FrontendIndex) writeAll(idxs []uint32, vals []Fe4Slot) error {
	if _, err := x.fe4.BatchUpdate(idxs, vals, nil); err == nil {
		return nil
	} else if !errors.Is(err, ebpf.ErrNotSupported) {
		return fmt.Errorf("bpf: frontend index: write: %w", err)
	}
	for i := range idxs {
		if err := x.fe4.Put(idxs[i], vals[i]); err != nil {
			return fmt.Errorf("bpf: frontend index: write slot %d: %w", idxs[i], err)
		}
	}
	return nil
}

// PutFrontend4 writes the IPv4 frontend k -> v and its index slot
// (FrontendIndex.Put).
func (d *Datapath) PutFrontend4(k SvcKey4, v SvcValue) error { return d.fe.Put(k, v) }

// DeleteFrontend4 removes the IPv4 frontend k and updates its index slot
// (FrontendIndex.Delete).
func (d *Datapath) DeleteFrontend4(k SvcKey4) error { return d.fe.Delete(k) }

// FrontendIndexStats says what the IPv4 frontend index holds now.
func (d *Datapath) FrontendIndexStats() FrontendIndexStats { return d.fe.Stats() }
