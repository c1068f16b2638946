package bpf

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/cilium/ebpf"
)

// MaglevMap is the array of maps that holds one Maglev table (an inner
// array map) per frontend, indexed by service id.
const MaglevMap = "fluxvm_maglev"

// MapMemory is the kernel memory of a datapath's maps, in bytes.
//
// Every figure is the kernel's own accounting for a map: the memlock
// field of the map's fdinfo (MapInfo.Memlock), which since Linux 6.4 is
// the kernel's bpf_map_memory_usage of the map, and which is what the
// map's allocation charges to the memory cgroup of the process that
// created it. They are read from the kernel, not estimated here from
// key sizes and capacities.
type MapMemory struct {
	// Maps holds each map of the loaded object by name. Its MaglevMap
	// entry is the outer array alone (one slot per service id), not the
	// tables its slots point to: those are MaglevInner.
	Maps map[string]uint64
	// MaglevInner sums the Maglev tables, the inner maps in MaglevMap.
	MaglevInner InnerMapMemory
	// Total is the sum of Maps and MaglevInner.Bytes.
	Total uint64
}

// InnerMapMemory sums the inner maps of an array of maps.
type InnerMapMemory struct {
	// Count is the number of inner maps in the outer map's slots; a map
	// in several slots counts (and its bytes count) once.
	Count int
	// Bytes is their total, LargestBytes the largest of them.
	Bytes        uint64
	LargestBytes uint64
}

// memoryCache remembers the memlock of the Maglev inner maps by map id.
// An array map's memory is fixed when it is created, and the kernel hands
// out map ids cyclically (reused only after 2^31 maps), so the figure read
// once for an id stays that map's figure for as long as the id is in an
// outer slot.
type memoryCache struct {
	mu    sync.Mutex
	inner map[ebpf.MapID]uint64
}

// MapMemory reads the kernel memory of every map of the datapath and of
// the Maglev tables its MaglevMap holds (see MapMemory for what the
// figures are).
//
// The top-level maps are read at every call (one fdinfo read each). For
// the Maglev tables the call reads the map id in each outer slot, and
// the memory of each id it has not seen before: the table is opened by
// id, its figure read and the handle closed. A table that the control
// plane swapped out and the kernel released between the two reads is
// not an error: the slot is read again (and left out of this call should
// that keep happening). Figures of tables seen before come from a cache
// of the ids still in the outer map, exact for array tables, whose
// memory never changes; so a repeated call costs one batch read of the
// outer map plus one open per table swapped in since the last call.
//
// It returns ErrClosed after Close.
func (d *Datapath) MapMemory() (MapMemory, error) {
	coll := d.coll
	if coll == nil {
		return MapMemory{}, ErrClosed
	}
	out := MapMemory{Maps: make(map[string]uint64, len(coll.Maps))}
	for name, m := range coll.Maps {
		b, _, err := memlock(m)
		if err != nil {
			return MapMemory{}, fmt.Errorf("bpf: map memory: %s: %w", name, err)
		}
		out.Maps[name] = b
		out.Total += b
	}
	outer := coll.Maps[MaglevMap]
	if outer == nil {
		return MapMemory{}, fmt.Errorf("bpf: map memory: object has no %s", MaglevMap)
	}
	in, err := d.innerMemory(outer)
	if err != nil {
		return MapMemory{}, fmt.Errorf("bpf: map memory: %s: %w", MaglevMap, err)
	}
	out.MaglevInner = in
	out.Total += in.Bytes
	return out, nil
}

// innerMemory sums the inner maps in the slots of the array of maps
// outer, with the cache of d.
func (d *Datapath) innerMemory(outer *ebpf.Map) (InnerMapMemory, error) {
	d.mem.mu.Lock()
	defer d.mem.mu.Unlock()
	slots, ids, err := slotIDs(outer, true)
	if err != nil {
		return InnerMapMemory{}, err
	}
	seen := make(map[ebpf.MapID]uint64, len(ids))
	counted := make(map[ebpf.MapID]bool, len(ids))
	var out InnerMapMemory
	for i, slot := range slots {
		id, b, ok, err := d.innerSlot(outer, slot, ebpf.MapID(ids[i]), seen)
		if err != nil {
			return InnerMapMemory{}, fmt.Errorf("slot %d: %w", slot, err)
		}
		// A table in several slots (shared by frontends) is one map.
		if ok && !counted[id] {
			counted[id] = true
			out.add(b)
		}
	}
	d.mem.inner = seen
	return out, nil
}

// slotIDs returns the filled slots of the array of maps outer and the
// ids of the inner maps in them (read from user space, a slot holds the
// inner map's id; an empty slot does not exist). With batch it reads
// them in one batch lookup where the kernel has one for the map type,
// else one lookup per slot.
func slotIDs(outer *ebpf.Map, batch bool) (slots, ids []uint32, err error) {
	n := int(outer.MaxEntries())
	if batch {
		slots, ids = make([]uint32, n), make([]uint32, n)
		var cursor ebpf.MapBatchCursor
		got := 0
		for got < n {
			k, err := outer.BatchLookup(&cursor, slots[got:], ids[got:], nil)
			got += k
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				return slots[:got], ids[:got], nil
			}
			if errors.Is(err, ebpf.ErrNotSupported) {
				break
			}
			if err != nil {
				return nil, nil, fmt.Errorf("batch lookup: %w", err)
			}
			if k == 0 {
				break // no progress: read slot by slot
			}
		}
		if got == n {
			return slots, ids, nil
		}
	}
	slots, ids = slots[:0], ids[:0]
	var id uint32
	for slot := range uint32(n) {
		if err := outer.Lookup(slot, &id); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				continue
			}
			return nil, nil, fmt.Errorf("slot %d: %w", slot, err)
		}
		slots, ids = append(slots, slot), append(ids, id)
	}
	return slots, ids, nil
}

// innerSlot returns the id and memory of the inner map in slot of outer
// (id as read before, read again if that map is gone), false when the
// slot is found empty. It records the figures that are fixed in seen.
func (d *Datapath) innerSlot(outer *ebpf.Map, slot uint32, id ebpf.MapID, seen map[ebpf.MapID]uint64) (ebpf.MapID, uint64, bool, error) {
	// A table replaced and released between the read of its id and its
	// open is gone: read the slot again. Should that keep happening, the
	// slot is left out of this call rather than failing it.
	for try := range 3 {
		if try > 0 {
			var v uint32
			if err := outer.Lookup(slot, &v); err != nil {
				if errors.Is(err, ebpf.ErrKeyNotExist) {
					return 0, 0, false, nil
				}
				return 0, 0, false, err
			}
			id = ebpf.MapID(v)
		}
		if b, ok := seen[id]; ok {
			return id, b, true, nil
		}
		if b, ok := d.mem.inner[id]; ok {
			seen[id] = b
			return id, b, true, nil
		}
		if d.afterInnerLookup != nil {
			d.afterInnerLookup(slot)
		}
		b, fixed, err := memlockByID(id)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return 0, 0, false, fmt.Errorf("inner map %d: %w", id, err)
		}
		if fixed {
			seen[id] = b
		}
		return id, b, true, nil
	}
	return 0, 0, false, nil
}

func (in *InnerMapMemory) add(b uint64) {
	in.Count++
	in.Bytes += b
	in.LargestBytes = max(in.LargestBytes, b)
}

// memlockByID reads the memory of the map with id, holding a handle on it
// only meanwhile. It fails with an error matching os.ErrNotExist when no
// map has that id any more.
func memlockByID(id ebpf.MapID) (uint64, bool, error) {
	m, err := ebpf.NewMapFromID(id)
	if err != nil {
		return 0, false, err
	}
	defer m.Close()
	return memlock(m)
}

// bpfFNoPrealloc is BPF_F_NO_PREALLOC (uapi/linux/bpf.h), here for every
// OS: this file builds everywhere.
const bpfFNoPrealloc = 1 << 0

// memlock returns the kernel's memlock figure of m, and whether m's
// memory is fixed for its lifetime (an array).
func memlock(m *ebpf.Map) (uint64, bool, error) {
	info, err := m.Info()
	if err != nil {
		return 0, false, err
	}
	b, ok := info.Memlock()
	if !ok {
		// A map that allocates as it fills (the identity tries, the
		// policies) reports nothing while it is empty.
		if info.Flags&bpfFNoPrealloc != 0 {
			return 0, false, nil
		}
		return 0, false, fmt.Errorf("kernel reports no memlock: %w", ebpf.ErrNotSupported)
	}
	return b, info.Type == ebpf.Array, nil
}
