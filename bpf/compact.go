package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unsafe"

	"github.com/cilium/ebpf"
)

// FlowMaps are the lifecycle maps that hold flows (conntrack and reverse
// NAT): the maps CompactFlowMaps can rebuild.
var FlowMaps = []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"}

// ErrCompactUnsupported: this datapath cannot rebuild its flow maps in
// place (hooks attached by cls_bpf are not links that can be switched to
// new programs; a staged Open is not active yet).
var ErrCompactUnsupported = errors.New("flow-map compaction unsupported")

// FlowClass orders the entries of a flow map by what losing one costs,
// cheapest first: a closed TCP flow (its connection is over), an
// unanswered handshake (the client retries it), a UDP flow (its next
// datagram picks again, most often the same backend), an established TCP
// flow (its connection breaks if its next packet picks another backend,
// or, under SNAT, if its reply finds no translation). Reverse-NAT halves
// carry no state and rank by last seen alone (FlowClassNAT).
type FlowClass uint8

// Flow classes, cheapest first.
const (
	FlowClassClosed FlowClass = iota
	FlowClassHalfOpen
	FlowClassUDP
	FlowClassEstablished
	FlowClassNAT
	numFlowClasses
)

func (c FlowClass) String() string {
	switch c {
	case FlowClassClosed:
		return "closed"
	case FlowClassHalfOpen:
		return "half_open"
	case FlowClassUDP:
		return "udp"
	case FlowClassEstablished:
		return "established"
	case FlowClassNAT:
		return "nat"
	}
	return fmt.Sprintf("class(%d)", uint8(c))
}

// flowClassOf classifies a raw value of flow map name.
func flowClassOf(name string, v []byte) FlowClass {
	if strings.HasPrefix(name, "fluxvm_nat") {
		return FlowClassNAT
	}
	switch CTState(v[unsafe.Offsetof(CTValue{}.State)]) {
	case CTTCPEstablished:
		return FlowClassEstablished
	case CTUDP:
		return FlowClassUDP
	case CTTCPSyn, CTNone:
		return FlowClassHalfOpen
	}
	return FlowClassClosed
}

// CompactOptions say which flow maps CompactFlowMaps rebuilds and how many
// entries each keeps.
type CompactOptions struct {
	// Keep maps a flow map's name (FlowMaps) to the entries its rebuilt
	// map keeps at most. A map not named is not rebuilt.
	Keep map[string]int
	// Dropped, when set, is told of every entry the rebuild left out,
	// after the switch (the new programs run): a replication journal
	// turns conntrack entries into deletes. key and value are the raw
	// entry, valid during the call only.
	Dropped func(name string, key, value []byte)
}

// FlowMapCompaction is what CompactFlowMaps did to one flow map.
type FlowMapCompaction struct {
	Map string `json:"map"`
	// Entries were in the old map when the copy read it; Kept of them
	// went into the new one, Dropped did not, by class (FlowClass names).
	Entries   int            `json:"entries"`
	Kept      int            `json:"kept"`
	Dropped   int            `json:"dropped"`
	DroppedBy map[string]int `json:"dropped_by,omitempty"`
	// CaughtUp are the flows the old programs learned or changed between
	// the copy and the switch, copied after it (Migration.CaughtUp).
	CaughtUp int `json:"caught_up"`
	// MapID and PreviousMapID are the kernel's ids of the pinned map after
	// and before: the pin names another map now.
	MapID         ebpf.MapID `json:"map_id"`
	PreviousMapID ebpf.MapID `json:"previous_map_id"`
}

// Compaction is what CompactFlowMaps did.
type Compaction struct {
	Maps []FlowMapCompaction `json:"maps"`
	// Links are the pinned attachments switched to the reloaded programs.
	Links []string `json:"links,omitempty"`
	// Switched: the new maps and programs are in place (Maps names
	// them), also when CompactFlowMaps returns an error after the switch
	// (a catch-up that failed).
	Switched bool `json:"switched"`
}

// CompactFlowMaps is the map-pressure controller's hard action: it
// rebuilds the named flow maps (CompactOptions.Keep) and reloads the
// programs onto them, while traffic runs. In order:
//
//  1. The generation marker of the pinned set (the meta map's program
//     generation) is cleared: until the last step, a crash or a failure
//     leaves pins that the next Open treats as another generation, and
//     reloads (lifecycle maps migrated, every other map recreated and the
//     control plane's state written again) rather than trusting a set
//     half switched.
//  2. Each named map is created anew at its capacity, and filled from the
//     old one, which the attached programs keep using meanwhile: entries
//     ranked by FlowClass, most costly to lose first, and within a class
//     the most recently seen first, up to its Keep. The rest are dropped
//     and counted by class.
//  3. The programs (TC, XDP, socket LB) are loaded anew on the new maps
//     and every other map as it is, the new maps are pinned in place of
//     the old ones, and every pinned attachment is switched to the new
//     programs (no gap: link updates).
//  4. Entries the old programs learned or changed between the copy and
//     the switch are copied (catch-up), and the generation marker is
//     written again.
//
// Only the flow maps are recreated: every other map (services, backends,
// Maglev tables, policy, counters) is the same map throughout, and the
// typed handles of Maps for them stay valid; those of the rebuilt maps are
// replaced (callers holding them, as conntrack.Map does, take the new ones
// from Maps). The new maps coexist with the old for the duration: their
// memory is needed twice until the old ones are released.
func (d *Datapath) CompactFlowMaps(o CompactOptions) (Compaction, error) {
	var res Compaction
	if d.coll == nil {
		return res, ErrClosed
	}
	if d.staged != nil {
		return res, fmt.Errorf("bpf: compact: %w: the datapath is not active yet", ErrCompactUnsupported)
	}
	if d.clsAttached {
		return res, fmt.Errorf("bpf: compact: %w: hooks attached by cls_bpf cannot be switched to new programs", ErrCompactUnsupported)
	}
	var names []string
	for name, keep := range o.Keep {
		if !slices.Contains(FlowMaps, name) {
			return res, fmt.Errorf("bpf: compact: %s is not a flow map (%v)", name, FlowMaps)
		}
		if keep < 0 || uint32(keep) > d.coll.Maps[name].MaxEntries() {
			return res, fmt.Errorf("bpf: compact: %s: keep %d outside 0..%d", name, keep, d.coll.Maps[name].MaxEntries())
		}
		names = append(names, name)
	}
	if len(names) == 0 {
		return res, nil
	}
	slices.Sort(names)

	meta, err := d.ReadMeta()
	if err != nil {
		return res, fmt.Errorf("bpf: compact: %w", err)
	}
	cleared := meta
	cleared.ProgramGeneration = 0
	if err := d.maps.FluxvmMeta.Put(uint32(0), cleared); err != nil {
		return res, fmt.Errorf("bpf: compact: clear the generation marker: %w", err)
	}
	// Until the switch, a failure restores the marker: the pins still name
	// the maps the running programs use.
	restoreMarker := func() { _ = d.maps.FluxvmMeta.Put(uint32(0), meta) }

	since, err := monotonicCoarse()
	if err != nil {
		restoreMarker()
		return res, fmt.Errorf("bpf: compact: %w", err)
	}
	fresh := map[string]*ebpf.Map{}
	closeFresh := func() {
		for _, m := range fresh {
			m.Close()
		}
	}
	res.Maps = make([]FlowMapCompaction, len(names))
	drops := make([][]droppedKey, len(names))
	for i, name := range names {
		old := d.coll.Maps[name]
		nm, err := ebpf.NewMap(d.spec.Maps[name])
		if err != nil {
			closeFresh()
			restoreMarker()
			return res, fmt.Errorf("bpf: compact: create %s: %w", name, err)
		}
		fresh[name] = nm
		mc, dk, err := rankedCopy(name, old, nm, o.Keep[name], o.Dropped != nil)
		if err != nil {
			closeFresh()
			restoreMarker()
			return res, fmt.Errorf("bpf: compact: %s: %w", name, err)
		}
		if info, err := old.Info(); err == nil {
			mc.PreviousMapID, _ = info.ID()
		}
		res.Maps[i], drops[i] = mc, dk
	}

	// Programs on the new flow maps and every other map as it is. The
	// side objects' own maps (XDP's next-hop cache) are theirs as well.
	repl := make(map[string]*ebpf.Map, len(d.coll.Maps))
	for name, m := range d.coll.Maps {
		repl[name] = m
	}
	for name, m := range fresh {
		repl[name] = m
	}
	coll, err := ebpf.NewCollectionWithOptions(d.spec, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		closeFresh()
		restoreMarker()
		return res, fmt.Errorf("bpf: compact: load programs: %w", err)
	}
	closeFresh() // the collection holds its own references
	side := func(old *ebpf.Collection, load func(Options, *ebpf.Collection) (*ebpf.Collection, error)) (*ebpf.Collection, error) {
		base := &ebpf.Collection{Maps: map[string]*ebpf.Map{}}
		if old != nil {
			for name, m := range old.Maps {
				base.Maps[name] = m
			}
		}
		for name, m := range coll.Maps {
			base.Maps[name] = m
		}
		return load(d.opts, base)
	}
	xcoll, err := side(d.xcoll, loadXDP)
	if err != nil {
		coll.Close()
		restoreMarker()
		return res, fmt.Errorf("bpf: compact: %w", err)
	}
	ccoll, err := side(d.ccoll, loadConnect)
	if err != nil {
		coll.Close()
		xcoll.Close()
		restoreMarker()
		return res, fmt.Errorf("bpf: compact: %w", err)
	}
	var progs Programs
	var xprogs XDPPrograms
	var cprogs ConnectPrograms
	if err := errors.Join(assignTyped(&progs, coll), assignTyped(&xprogs, xcoll), assignTyped(&cprogs, ccoll)); err != nil {
		coll.Close()
		xcoll.Close()
		ccoll.Close()
		restoreMarker()
		return res, fmt.Errorf("bpf: compact: %w", err)
	}

	// The switch: pins first (what a restart from here on adopts), then
	// the links. From the first pin on, a failure leaves the marker
	// cleared: the next Open reloads.
	root := d.opts.PinRoot
	for _, name := range names {
		path := filepath.Join(mapDir(root), name)
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			coll.Close()
			xcoll.Close()
			ccoll.Close()
			return res, fmt.Errorf("bpf: compact: replace pin %s: %w (the generation marker stays cleared: open again to reload)", name, err)
		}
		if err := coll.Maps[name].Pin(path); err != nil {
			coll.Close()
			xcoll.Close()
			ccoll.Close()
			return res, fmt.Errorf("bpf: compact: pin %s: %w (the generation marker stays cleared: open again to reload)", name, err)
		}
	}
	oldProgs, oldX, oldC := d.progs, d.xprogs, d.cprogs
	d.progs, d.xprogs, d.cprogs = progs, xprogs, cprogs
	links, _, err := d.updateLinks()
	res.Links = links
	if err != nil {
		// Back to the old programs where the links took the new ones; the
		// pins name the new maps, which the marker makes the next Open
		// reload.
		d.progs, d.xprogs, d.cprogs = oldProgs, oldX, oldC
		_, _, _ = d.updateLinks()
		coll.Close()
		xcoll.Close()
		ccoll.Close()
		return res, fmt.Errorf("bpf: compact: %w (the generation marker stays cleared: open again to reload)", err)
	}
	// A catch-up that fails loses only the flows it did not copy (their
	// next packets pick again): the switch stands, the error is returned.
	var catchErrs []error
	for i, name := range names {
		learned, changed, err := catchUp(name, d.coll.Maps[name], coll.Maps[name], since)
		if err != nil {
			catchErrs = append(catchErrs, fmt.Errorf("bpf: compact: catch up %s: %w", name, err))
		}
		res.Maps[i].CaughtUp = learned + changed
		if info, err := coll.Maps[name].Info(); err == nil {
			res.Maps[i].MapID, _ = info.ID()
		}
	}

	// The maps that were not rebuilt keep their objects (callers hold
	// them); the rebuilt ones and the old programs go.
	for name, m := range d.coll.Maps {
		if _, rebuilt := fresh[name]; rebuilt {
			continue
		}
		coll.Maps[name].Close()
		coll.Maps[name] = m
		delete(d.coll.Maps, name)
	}
	for name, m := range d.xcoll.Maps {
		if nm := xcoll.Maps[name]; nm != nil && coll.Maps[name] == nil {
			nm.Close()
			xcoll.Maps[name] = m
			delete(d.xcoll.Maps, name)
		}
	}
	for name, m := range d.ccoll.Maps {
		if nm := ccoll.Maps[name]; nm != nil && coll.Maps[name] == nil {
			nm.Close()
			ccoll.Maps[name] = m
			delete(d.ccoll.Maps, name)
		}
	}
	oldColl, oldXColl, oldCColl := d.coll, d.xcoll, d.ccoll
	d.coll, d.xcoll, d.ccoll = coll, xcoll, ccoll
	res.Switched = true
	var maps Maps
	if err := assignTyped(&maps, coll); err != nil {
		return res, fmt.Errorf("bpf: compact: %w", err)
	}
	d.maps = maps
	if err := d.maps.FluxvmMeta.Put(uint32(0), meta); err != nil {
		return res, fmt.Errorf("bpf: compact: write the generation marker: %w", err)
	}
	if o.Dropped != nil {
		for i, name := range names {
			for _, k := range drops[i] {
				o.Dropped(name, k.key, k.value)
			}
		}
	}
	oldColl.Close()
	oldXColl.Close()
	oldCColl.Close()
	return res, errors.Join(catchErrs...)
}

// droppedKey is an entry the rebuild left out, kept for
// CompactOptions.Dropped.
type droppedKey struct{ key, value []byte }

// rankedCopy fills nm with the keep most costly entries of old (by class,
// then most recently seen), in two passes over old: one that finds the
// cut, one that copies. It returns what it did and, when wantDrops, the
// entries it left out.
func rankedCopy(name string, old, nm *ebpf.Map, keep int, wantDrops bool) (FlowMapCompaction, []droppedKey, error) {
	mc := FlowMapCompaction{Map: name, DroppedBy: map[string]int{}}
	off := lastSeenOffset(name)
	k, v := make([]byte, old.KeySize()), make([]byte, old.ValueSize())
	// Pass 1: last-seen times by class.
	var seen [numFlowClasses][]uint64
	it := old.Iterate()
	for it.Next(&k, &v) {
		c := flowClassOf(name, v)
		seen[c] = append(seen[c], binary.LittleEndian.Uint64(v[off:]))
	}
	if err := it.Err(); err != nil {
		return mc, nil, err
	}
	// The cut: every class above cutClass whole, cutClass's entries seen
	// after cutSeen, and ties at cutSeen while ties lasts.
	cutClass, cutSeen, ties := FlowClass(0), uint64(0), 0
	left := keep
	for c := numFlowClasses - 1; ; c-- {
		s := seen[c]
		if len(s) <= left {
			left -= len(s)
			if c == 0 {
				cutClass, cutSeen, ties = 0, 0, len(s) // everything fits
				break
			}
			continue
		}
		slices.Sort(s)
		slices.Reverse(s)
		cutClass = c
		if left == 0 {
			cutSeen, ties = ^uint64(0), 0
			break
		}
		cutSeen = s[left-1]
		above := 0
		for _, t := range s[:left] {
			if t > cutSeen {
				above++
			}
		}
		ties = left - above
		break
	}
	// Pass 2: copy what makes the cut. Entries learned since pass 1 are
	// judged by the same cut (and caught up after the switch if they are
	// newer than the copy): Kept may exceed keep by what the datapath
	// learned during the copy.
	nv := make([]byte, nm.ValueSize())
	var drops []droppedKey
	it = old.Iterate()
	for it.Next(&k, &v) {
		mc.Entries++
		c := flowClassOf(name, v)
		t := binary.LittleEndian.Uint64(v[off:])
		in := c > cutClass || (c == cutClass && (t > cutSeen || (t == cutSeen && ties > 0)))
		if c == cutClass && t == cutSeen && ties > 0 {
			ties--
		}
		// Not capped at keep: an entry learned or refreshed since pass 1
		// that ranks above the cut is kept too, rather than one the
		// iteration reaches later.
		if in {
			copy(nv, v)
			err := nm.Update(k, nv, ebpf.UpdateNoExist)
			switch {
			case err == nil:
				mc.Kept++
				continue
			case errors.Is(err, ebpf.ErrKeyExist):
				mc.Entries-- // returned twice by an iteration under changes
				continue
			default:
				return mc, nil, fmt.Errorf("copy: %w", err)
			}
		}
		mc.Dropped++
		mc.DroppedBy[c.String()]++
		if wantDrops {
			drops = append(drops, droppedKey{slices.Clone(k), slices.Clone(v)})
		}
	}
	if err := it.Err(); err != nil {
		return mc, nil, err
	}
	return mc, drops, nil
}
