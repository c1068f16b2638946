package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/mapscan"
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

// flowClassOf classifies a conntrack entry by its state.
func flowClassOf(st CTState) FlowClass {
	switch st {
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
	// after the switch and the catch-up (an entry the catch-up brought
	// back, because the datapath used it meanwhile, is not dropped): a
	// replication journal turns conntrack entries into deletes, and the
	// caller removes their reverse-NAT halves. key and value are the raw
	// entry as the old map last held it, the caller's to keep.
	Dropped func(name string, key, value []byte)
	// Switch, when set, is locked around the switch only (pins, links and
	// the Datapath's handles change under it): the lock under which the
	// caller uses the Datapath. The copy and the program loads, the long
	// part, run without it. Without it the caller must not use the
	// Datapath during the whole call.
	Switch sync.Locker
	// all (GrowFlowMaps) keeps every entry the walk of a map returns, up
	// to its new map's size, whatever Keep says: a walk under live writes
	// may return more entries than the map held when the grow counted
	// them, and a grow drops none by rank.
	all bool
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
	// SwitchTime is how long the switch held CompactOptions.Switch.
	SwitchTime time.Duration `json:"switch_ns"`
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
func (d *Datapath) CompactFlowMaps(o CompactOptions) (res Compaction, err error) {
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
		if !o.all && (keep < 0 || uint32(keep) > d.coll.Maps[name].MaxEntries()) {
			return res, fmt.Errorf("bpf: compact: %s: keep %d outside 0..%d", name, keep, d.coll.Maps[name].MaxEntries())
		}
		names = append(names, name)
	}
	if len(names) == 0 {
		return res, nil
	}
	slices.Sort(names)
	lock, unlock := func() {}, func() {}
	if o.Switch != nil {
		lock, unlock = o.Switch.Lock, o.Switch.Unlock
	}

	// 1. The generation marker, cleared until the end. A failure before
	// the switch writes it back; one during the switch that cannot be
	// undone leaves it cleared, for the next Open to reload.
	meta, err := d.ReadMeta()
	if err != nil {
		return res, fmt.Errorf("bpf: compact: %w", err)
	}
	meta.ProgramGeneration = 0
	if err := d.maps.FluxvmMeta.Put(uint32(0), meta); err != nil {
		return res, fmt.Errorf("bpf: compact: clear the generation marker: %w", err)
	}
	meta.ProgramGeneration = ProgramGeneration
	marker := func() error { return d.maps.FluxvmMeta.Put(uint32(0), meta) }
	since, err := monotonicCoarse()
	if err != nil {
		return res, errors.Join(fmt.Errorf("bpf: compact: %w", err), marker())
	}

	// 2. The new maps, filled by rank from the old ones.
	fresh := map[string]*ebpf.Map{}
	drops := make([][]droppedKey, len(names))
	res.Maps = make([]FlowMapCompaction, len(names))
	abort := func(err error, colls ...*ebpf.Collection) (Compaction, error) {
		for _, m := range fresh {
			m.Close()
		}
		for _, c := range colls {
			c.Close()
		}
		return res, errors.Join(fmt.Errorf("bpf: compact: %w", err), marker())
	}
	for i, name := range names {
		old := d.coll.Maps[name]
		nm, err := ebpf.NewMap(d.spec.Maps[name])
		if err != nil {
			return abort(fmt.Errorf("create %s: %w", name, err))
		}
		fresh[name] = nm
		keep := o.Keep[name]
		if o.all {
			keep = int(nm.MaxEntries())
		}
		mc, dk, err := rankedCopy(name, old, nm, keep)
		if err != nil {
			return abort(fmt.Errorf("%s: %w", name, err))
		}
		if info, err := old.Info(); err == nil {
			mc.PreviousMapID, _ = info.ID()
		}
		if info, err := nm.Info(); err == nil {
			mc.MapID, _ = info.ID()
		}
		res.Maps[i], drops[i] = mc, dk
	}

	// 3. The programs, on the new maps and every other map as it is (the
	// side objects' own maps, such as XDP's next-hop cache, too).
	repl := maps.Clone(d.coll.Maps)
	maps.DeleteFunc(repl, func(name string, _ *ebpf.Map) bool { return dataSection(name) })
	maps.Copy(repl, fresh)
	coll, err := ebpf.NewCollectionWithOptions(d.spec, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		return abort(fmt.Errorf("load programs: %w", err))
	}
	side := func(old *ebpf.Collection, load func(Options, *ebpf.Collection) (*ebpf.Collection, error)) (*ebpf.Collection, error) {
		base := &ebpf.Collection{Maps: maps.Clone(old.Maps)}
		maps.Copy(base.Maps, coll.Maps)
		return load(d.opts, base)
	}
	xcoll, err := side(d.xcoll, loadXDP)
	if err != nil {
		return abort(err, coll)
	}
	ccoll, err := side(d.ccoll, loadConnect)
	if err != nil {
		return abort(err, coll, xcoll)
	}
	// The new collections take the old objects of the maps not rebuilt
	// (whoever holds them keeps valid handles) in place of their clones.
	transplant := func(c, old *ebpf.Collection) map[string]*ebpf.Map {
		clones := map[string]*ebpf.Map{}
		for name, m := range old.Maps {
			// A data section (.rodata: the load-time features) is the
			// new load's own, as its programs use it.
			if _, rebuilt := fresh[name]; rebuilt || c.Maps[name] == nil || dataSection(name) {
				continue
			}
			clones[name] = c.Maps[name]
			c.Maps[name] = m
		}
		return clones
	}
	clones := []map[string]*ebpf.Map{transplant(coll, d.coll), transplant(xcoll, d.xcoll), transplant(ccoll, d.ccoll)}
	closeNew := func() {
		// The old objects go back out of the new collections first.
		for i, c := range []*ebpf.Collection{coll, xcoll, ccoll} {
			maps.Copy(c.Maps, clones[i])
			c.Close()
		}
	}
	var (
		newMaps Maps
		progs   Programs
		xprogs  XDPPrograms
		cprogs  ConnectPrograms
	)
	if err := errors.Join(assignTyped(&newMaps, coll), assignTyped(&progs, coll), assignTyped(&xprogs, xcoll), assignTyped(&cprogs, ccoll)); err != nil {
		closeNew()
		return abort(err)
	}
	for _, cl := range clones {
		for _, m := range cl {
			m.Close()
		}
	}
	closeNew = func() {
		// The new collections' programs and their handles of the rebuilt
		// maps; the rest of their maps are the old objects, which live on.
		for _, c := range []*ebpf.Collection{coll, xcoll, ccoll} {
			for _, p := range c.Programs {
				p.Close()
			}
			for name := range fresh {
				if m := c.Maps[name]; m != nil {
					m.Close()
				}
			}
		}
		for _, m := range fresh {
			m.Close()
		}
	}

	// 3b. What the old programs learned or changed during the copy and the
	// loads (a second or more), copied now, while they still run: after
	// the switch, a reply whose flow the new map lacks is not translated,
	// so the catch-up after it is left with what the last moments added.
	// Twice: the first pass takes as long as a walk of the old map.
	for range 2 {
		pass, err := monotonicCoarse()
		if err != nil {
			closeNew()
			return abort(err)
		}
		for i, name := range names {
			learned, changed, err := catchUp(name, d.coll.Maps[name], fresh[name], since)
			if err != nil {
				closeNew()
				return abort(fmt.Errorf("catch up %s: %w", name, err))
			}
			res.Maps[i].CaughtUp += learned + changed
		}
		since = pass
	}

	// 4. The switch, under the caller's lock and the Datapath's own
	// (goroutines that read the handles without the caller's lock: the
	// route cache, the socket iterator).
	lock()
	d.live.Lock()
	switchStart := time.Now()
	oldProgs, oldX, oldC := d.progs, d.xprogs, d.cprogs
	oldMaps := map[string]*ebpf.Map{}
	root := d.opts.PinRoot
	repin := func(m map[string]*ebpf.Map) error {
		var errs []error
		for _, name := range names {
			path := filepath.Join(mapDir(root), name)
			if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
				continue
			}
			errs = append(errs, m[name].Pin(path))
		}
		return errors.Join(errs...)
	}
	for _, name := range names {
		oldMaps[name] = d.coll.Maps[name]
	}
	err = repin(fresh)
	if err == nil {
		d.progs, d.xprogs, d.cprogs = progs, xprogs, cprogs
		res.Links, _, err = d.updateLinks()
	}
	if err != nil {
		// Back to the old programs and the old pins; only if that fails
		// too does the marker stay cleared.
		d.progs, d.xprogs, d.cprogs = oldProgs, oldX, oldC
		_, _, lerr := d.updateLinks()
		perr := repin(oldMaps)
		res.SwitchTime = time.Since(switchStart)
		d.live.Unlock()
		unlock()
		closeNew()
		res.Links = nil
		if lerr != nil || perr != nil {
			return res, fmt.Errorf("bpf: compact: %w (undoing it failed: %w; the generation marker stays cleared: open again to reload)",
				err, errors.Join(lerr, perr))
		}
		return res, errors.Join(fmt.Errorf("bpf: compact: %w", err), marker())
	}
	oldColl, oldXColl, oldCColl := d.coll, d.xcoll, d.ccoll
	d.coll, d.xcoll, d.ccoll, d.maps = coll, xcoll, ccoll, newMaps
	// The side programs loaded at first use hold handles of every map
	// their objects declare, the rebuilt ones too: they load again.
	d.sd.close()
	d.mc.close()
	res.Switched = true
	res.SwitchTime = time.Since(switchStart)
	d.live.Unlock()
	unlock()

	// 5. After the switch: the old collections' programs and rebuilt maps
	// go (the objects of the maps not rebuilt live on in the new ones);
	// the flows the old programs learned or changed meanwhile are copied;
	// what is left out is told; the marker is written back.
	var errs []error
	for i, name := range names {
		learned, changed, err := catchUp(name, oldMaps[name], d.coll.Maps[name], since)
		if err != nil {
			errs = append(errs, fmt.Errorf("catch up %s: %w", name, err))
		}
		res.Maps[i].CaughtUp += learned + changed
		res.Maps[i].settle(d.coll.Maps[name], drops[i], name, o.Dropped)
	}
	for _, c := range []*ebpf.Collection{oldColl, oldXColl, oldCColl} {
		for _, p := range c.Programs {
			p.Close()
		}
	}
	for _, m := range oldMaps {
		m.Close()
	}
	for _, m := range fresh {
		m.Close() // pinned, and held by the new collections
	}
	for _, c := range []*ebpf.Collection{oldColl, oldXColl, oldCColl} {
		// The side objects' clones of the TC object's maps, and every
		// object's data sections (their own maps live on in the new
		// collections).
		for name, m := range c.Maps {
			if oldMaps[name] == m {
				continue // closed above
			}
			if coll.Maps[name] != m && xcoll.Maps[name] != m && ccoll.Maps[name] != m {
				m.Close()
			}
		}
	}
	errs = append(errs, marker())
	if err := errors.Join(errs...); err != nil {
		return res, fmt.Errorf("bpf: compact: %w", err)
	}
	return res, nil
}

// settle corrects mc once the catch-up ran: an entry the rank left out
// that the catch-up copied (the datapath used it during the copy) or that
// the copy reached twice is in the new map after all. The rest are told
// to dropped.
func (mc *FlowMapCompaction) settle(nm *ebpf.Map, drops []droppedKey, name string, dropped func(string, []byte, []byte)) {
	cur := make([]byte, nm.ValueSize())
	for _, dk := range drops {
		if nm.Lookup(dk.key, &cur) == nil {
			mc.Dropped--
			mc.DroppedBy[dk.class.String()]--
			if mc.DroppedBy[dk.class.String()] == 0 {
				delete(mc.DroppedBy, dk.class.String())
			}
			continue
		}
		if dropped != nil {
			dropped(name, dk.key, dk.value)
		}
	}
	// Kept: what the new map holds of what the copy read (entries learned
	// meanwhile are in CaughtUp).
	mc.Kept = mc.Entries - mc.Dropped
}

// droppedKey is an entry the rebuild left out, kept for settle.
type droppedKey struct {
	key, value []byte
	class      FlowClass
}

// rankedCopy fills nm with the keep most costly entries of old (by class,
// then most recently seen), in two batched passes over old: one that finds
// the cut, one that copies. It returns what it did and, when wantDrops,
// the entries it left out.
func rankedCopy(name string, old, nm *ebpf.Map, keep int) (FlowMapCompaction, []droppedKey, error) {
	ct := func(v *CTValue) (FlowClass, uint64) { return flowClassOf(CTState(v.State)), v.LastSeenNs }
	nt := func(v *NATValue) (FlowClass, uint64) { return FlowClassNAT, v.LastSeenNs }
	switch name {
	case "fluxvm_fct4":
		return rankedCopyOf[Tuple4](name, old, nm, keep, ct)
	case "fluxvm_fct6":
		return rankedCopyOf[Tuple6](name, old, nm, keep, ct)
	case "fluxvm_nat4":
		return rankedCopyOf[Tuple4](name, old, nm, keep, nt)
	case "fluxvm_nat6":
		return rankedCopyOf[Tuple6](name, old, nm, keep, nt)
	}
	return FlowMapCompaction{}, nil, fmt.Errorf("%s is not a flow map", name)
}

func rankedCopyOf[K, V any](name string, old, nm *ebpf.Map, keep int,
	rank func(*V) (FlowClass, uint64)) (FlowMapCompaction, []droppedKey, error) {
	mc := FlowMapCompaction{Map: name, DroppedBy: map[string]int{}}
	var mode mapscan.Mode
	// Pass 1: last-seen times by class.
	var seen [numFlowClasses][]uint64
	err := scanAll(old, &mode, func(_ []K, vals []V) error {
		for i := range vals {
			c, t := rank(&vals[i])
			seen[c] = append(seen[c], t)
		}
		return nil
	})
	if err != nil {
		return mc, nil, err
	}
	cut := findCut(&seen, keep)
	// Pass 2: copy what makes the cut. Entries learned since pass 1 are
	// judged by the same cut (and caught up after the switch if they are
	// newer than the copy): Kept may exceed keep by what the datapath
	// learned during the copy, rather than leave out an entry ranked above
	// the cut that the walk reaches late.
	var drops []droppedKey
	keys, vals := make([]K, 0, compactChunk), make([]V, 0, compactChunk)
	// The new map is written by nothing else: plain updates (the batch
	// command takes no BPF_NOEXIST), a key the walk returns twice (the
	// map changed under it) written twice; Kept is counted afterwards.
	batch := true
	flush := func() error {
		for off := 0; off < len(keys); {
			if !batch {
				if err := nm.Update(&keys[off], &vals[off], ebpf.UpdateAny); err != nil {
					return fmt.Errorf("copy: %w", err)
				}
				off++
				continue
			}
			n, err := nm.BatchUpdate(keys[off:], vals[off:], nil)
			off += n
			switch {
			case err == nil:
			case errors.Is(err, ebpf.ErrNotSupported):
				batch = false
			default:
				return fmt.Errorf("copy: %w", err)
			}
		}
		keys, vals = keys[:0], vals[:0]
		return nil
	}
	err = scanAll(old, &mode, func(ks []K, vs []V) error {
		for i := range ks {
			mc.Entries++
			c, t := rank(&vs[i])
			if cut.in(c, t) {
				keys, vals = append(keys, ks[i]), append(vals, vs[i])
				continue
			}
			mc.Dropped++
			mc.DroppedBy[c.String()]++
			kb, _ := binary.Append(nil, binary.NativeEndian, &ks[i])
			vb, _ := binary.Append(nil, binary.NativeEndian, &vs[i])
			drops = append(drops, droppedKey{kb, vb, c})
		}
		return flush()
	})
	if err == nil {
		err = scanAll(nm, &mode, func(ks []K, _ []V) error {
			mc.Kept += len(ks)
			return nil
		})
	}
	if err != nil {
		return mc, nil, err
	}
	mc.Entries = mc.Kept + mc.Dropped
	return mc, drops, nil
}

// compactChunk is how many entries one batch of the ranked copy reads or
// writes.
const compactChunk = 4096

// scanAll calls fn with every chunk of m's entries, read in batches where
// the kernel has them (internal/mapscan).
func scanAll[K, V any](m *ebpf.Map, mode *mapscan.Mode, fn func([]K, []V) error) error {
	s := mapscan.NewScanner[K, V](m, mode, compactChunk)
	for {
		n, err := s.Chunk()
		if err != nil || n == 0 {
			return err
		}
		if err := fn(s.Keys[:n], s.Vals[:n]); err != nil {
			return err
		}
	}
}

// flowCut is where a ranked copy stops: every class above class whole, the
// entries of class seen after seen, and ties of them seen at exactly seen.
type flowCut struct {
	class FlowClass
	seen  uint64
	ties  int
}

// in reports whether an entry of class c last seen at t makes the cut (it
// counts down the ties it lets in).
func (k *flowCut) in(c FlowClass, t uint64) bool {
	switch {
	case c != k.class:
		return c > k.class
	case t > k.seen:
		return true
	case t == k.seen && k.ties > 0:
		k.ties--
		return true
	}
	return false
}

// findCut finds the cut that keeps keep of the entries whose last-seen
// times seen holds by class, the costliest class first.
func findCut(seen *[numFlowClasses][]uint64, keep int) *flowCut {
	left := keep
	for c := numFlowClasses - 1; ; c-- {
		s := seen[c]
		if len(s) <= left {
			left -= len(s)
			if c == 0 {
				return &flowCut{class: 0, seen: 0, ties: len(s)} // everything fits
			}
			continue
		}
		if left == 0 {
			return &flowCut{class: c, seen: ^uint64(0)}
		}
		slices.Sort(s)
		slices.Reverse(s)
		cut := &flowCut{class: c, seen: s[left-1]}
		for _, t := range s[:left] {
			if t == cut.seen {
				cut.ties++
			}
		}
		return cut
	}
}
