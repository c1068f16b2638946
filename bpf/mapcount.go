package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// ErrMapCountUnsupported reports a kernel that cannot count a map's
// entries from BPF (bpf_map_sum_elem_count, Linux 6.6): MapEntries then
// has nothing cheap to offer.
var ErrMapCountUnsupported = errors.New("the kernel cannot count map entries from BPF (bpf_map_sum_elem_count needs Linux 6.6)")

// MapCountObjectName is the file name of the map iterator object as
// operators install it.
const MapCountObjectName = "fluxvm_map_count.bpf.o"

// MapFill is how full one map of the datapath is.
type MapFill struct {
	Entries    int64  `json:"entries"`
	MaxEntries uint32 `json:"max_entries"`
}

// Percent is Entries over MaxEntries, in percent.
func (f MapFill) Percent() float64 {
	if f.MaxEntries == 0 {
		return 0
	}
	return 100 * float64(f.Entries) / float64(f.MaxEntries)
}

// countedTypes are the map types whose entries the kernel counts (hash
// maps of every kind); arrays are always full and LPM tries keep their
// count to themselves.
var countedTypes = map[ebpf.MapType]bool{ebpf.Hash: true, ebpf.LRUHash: true, ebpf.PerCPUHash: true, ebpf.LRUCPUHash: true}

// MapEntries returns how many entries each hash map of the datapath holds
// (conntrack, reverse NAT, socket LB, policy, ...), by map name, as the
// kernel counts them: one walk of the kernel's map table through a map
// iterator (fluxvm_map_count.bpf.c), whatever the maps' sizes. LRU
// evictions are not seen: what is counted is what is there. On a kernel
// before 6.6 it fails with ErrMapCountUnsupported. The iterator is loaded
// at the first call and kept until Close.
func (d *Datapath) MapEntries() (map[string]MapFill, error) {
	if d.coll == nil {
		return nil, ErrClosed
	}
	byID := make(map[ebpf.MapID]string)
	out := make(map[string]MapFill)
	for name, m := range d.coll.Maps {
		if !countedTypes[m.Type()] {
			continue
		}
		info, err := m.Info()
		if err != nil {
			return nil, fmt.Errorf("bpf: map entries: %s: %w", name, err)
		}
		id, ok := info.ID()
		if !ok {
			return nil, fmt.Errorf("bpf: map entries: %s: %w", name, ErrMapCountUnsupported)
		}
		byID[id] = name
		out[name] = MapFill{MaxEntries: m.MaxEntries()}
	}
	d.mc.Lock()
	defer d.mc.Unlock()
	if d.mc.err != nil {
		return nil, d.mc.err // a kernel without the kfunc: not retried
	}
	if d.mc.prog == nil {
		c, err := loadSide(d.opts, d.coll, "map iterator",
			func(Tier) (*ebpf.CollectionSpec, error) { return loadMapCount() },
			func(Tier) string { return MapCountObjectName })
		if err != nil {
			if errors.Is(err, ebpf.ErrNotSupported) {
				d.mc.err = fmt.Errorf("bpf: map entries: %w (%v)", ErrMapCountUnsupported, err)
				return nil, d.mc.err
			}
			return nil, fmt.Errorf("bpf: map entries: load the map iterator: %w", err)
		}
		d.mc.coll, d.mc.prog = c, c.Programs["fluxvm_map_count"]
	}
	l, err := link.AttachIter(link.IterOptions{Program: d.mc.prog})
	if err != nil {
		return nil, fmt.Errorf("bpf: map entries: attach the iterator: %w", err)
	}
	defer l.Close()
	r, err := l.Open()
	if err != nil {
		return nil, fmt.Errorf("bpf: map entries: open the iterator: %w", err)
	}
	defer r.Close()
	// One 16-byte record per map of the node: id, pad, entries.
	var rec [16]byte
	for {
		if _, err := io.ReadFull(r, rec[:]); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return nil, fmt.Errorf("bpf: map entries: read the iterator: %w", err)
		}
		name, ok := byID[ebpf.MapID(binary.LittleEndian.Uint32(rec[0:]))]
		if !ok {
			continue
		}
		f := out[name]
		f.Entries = int64(binary.LittleEndian.Uint64(rec[8:]))
		out[name] = f
	}
	return out, nil
}

// mapCounter is the map iterator, loaded at first use.
type mapCounter = sideProgram
