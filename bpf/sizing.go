package bpf

import (
	"errors"
	"fmt"
	"math/bits"
	"os"
	"slices"
	"sync"

	"github.com/cilium/ebpf"
)

// Maps sized by need (Options.Sizes). Each map of SizedMaps is compiled at
// its tier's capacity, which stays its ceiling; a node that cannot use a
// map (no IPv6 frontend: fluxvm_fct6 and fluxvm_nat6; no frontend whose
// reverse half is stored: fluxvm_nat4/6; flow records off: fluxvm_sflows;
// HA off: fluxvm_haq) loads it at a token size instead. The flow maps grow
// while traffic runs when their first user arrives (GrowFlowMaps); no map
// shrinks below what it holds (a pinned map larger than the size wanted is
// kept, up to the ceiling).

// SizedMaps are the maps Options.Sizes may load below the tier's capacity.
var SizedMaps = []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6", "fluxvm_sflows", "fluxvm_haq"}

// Token sizes: what a map of SizedMaps holds while nothing can use it.
const (
	// TokenFlowEntries is the token size of the conntrack and reverse-NAT
	// maps (fluxvm_fct4/6, fluxvm_nat4/6): under 0.1% of tier M's
	// 262,144, about 100 KiB of memory for an IPv6 map, and still an LRU
	// that evicts rather than refuses should an entry land before its
	// grow (none does by design: the grow runs before the frontend that
	// needs it is written).
	TokenFlowEntries = 1024
	// TokenFlowSlots is the token size of the flow-record ring
	// (fluxvm_sflows) while flow_sample_rate is 0: nothing writes it
	// then. A power of two, as the ring's readers require.
	TokenFlowSlots = 64
)

// TokenHAQueueBytes is the token size of the HA mutation queue (a ring
// buffer: a power of two pages): one page. Nothing writes it while HA is
// off.
func TokenHAQueueBytes() uint32 { return uint32(os.Getpagesize()) }

// Sizes are the sizes Options.Sizes loads the maps of SizedMaps with: 0
// is the tier's capacity.
type Sizes struct {
	CT4, CT6   uint32 // fluxvm_fct4, fluxvm_fct6: entries
	NAT4, NAT6 uint32 // fluxvm_nat4, fluxvm_nat6: entries
	// FlowSlots is fluxvm_sflows's slots, a power of two. Below the
	// ceiling only with FeatureFlowRecords omitted (Options.OmitFeatures):
	// the programs pick a record's slot by the compiled size, not the
	// loaded one, so a smaller ring would lose most records. Open refuses
	// it otherwise (ErrMapSize).
	FlowSlots uint32
	HAQueue   uint32 // fluxvm_haq: bytes, a power of two pages
}

// Map returns the sizes by map name, without the maps at 0.
func (s Sizes) Map() map[string]uint32 {
	out := map[string]uint32{}
	for name, n := range map[string]uint32{
		"fluxvm_fct4": s.CT4, "fluxvm_fct6": s.CT6, "fluxvm_nat4": s.NAT4, "fluxvm_nat6": s.NAT6,
		"fluxvm_sflows": s.FlowSlots, "fluxvm_haq": s.HAQueue,
	} {
		if n != 0 {
			out[name] = n
		}
	}
	return out
}

// Set sets the size of map name (one of SizedMaps), reporting whether it
// is one.
func (s *Sizes) Set(name string, n uint32) bool {
	p := map[string]*uint32{
		"fluxvm_fct4": &s.CT4, "fluxvm_fct6": &s.CT6, "fluxvm_nat4": &s.NAT4, "fluxvm_nat6": &s.NAT6,
		"fluxvm_sflows": &s.FlowSlots, "fluxvm_haq": &s.HAQueue,
	}[name]
	if p == nil {
		return false
	}
	*p = n
	return true
}

// ErrMapSize: Options.Sizes gives a map that cannot be sized, or a size
// it cannot have.
var ErrMapSize = errors.New("invalid map size")

// MapSize is one map of SizedMaps as loaded.
type MapSize struct {
	Map string `json:"map"`
	// MaxEntries is the map's size now (for fluxvm_haq, bytes).
	MaxEntries uint32 `json:"max_entries"`
	// Ceiling is the tier's capacity: what the object was compiled
	// with, and the most the map grows to.
	Ceiling uint32 `json:"ceiling"`
}

var (
	ceilMu    sync.Mutex
	ceilCache = map[Tier]map[string]uint32{}
)

// Ceilings returns the tier's capacity of each map of SizedMaps and of
// the socket LB maps (fluxvm_sock_fwd, fluxvm_sock_rev): their max_entries
// as compiled into the embedded object of tier t.
func Ceilings(t Tier) (map[string]uint32, error) {
	ceilMu.Lock()
	defer ceilMu.Unlock()
	if c, ok := ceilCache[t]; ok {
		return c, nil
	}
	spec, err := Spec(t)
	if err != nil {
		return nil, err
	}
	c := map[string]uint32{}
	for _, name := range append(slices.Clone(SizedMaps), "fluxvm_sock_fwd", "fluxvm_sock_rev") {
		ms := spec.Maps[name]
		if ms == nil {
			return nil, fmt.Errorf("bpf: object of tier %s has no map %s", t, name)
		}
		c[name] = ms.MaxEntries
	}
	ceilCache[t] = c
	return c, nil
}

// checkSizes validates Options.Sizes against the tier's ceilings and the
// features loaded (on).
func checkSizes(sizes map[string]uint32, ceil map[string]uint32, on Features) error {
	var errs []error
	for name, n := range sizes {
		c, ok := ceil[name]
		switch {
		case !ok || !slices.Contains(SizedMaps, name):
			errs = append(errs, fmt.Errorf("%s: %w: not a map sized by need (%v)", name, ErrMapSize, SizedMaps))
		case n > c:
			errs = append(errs, fmt.Errorf("%s: %w: %d entries, more than the tier's capacity %d", name, ErrMapSize, n, c))
		case name == "fluxvm_sflows" && bits.OnesCount32(n) != 1:
			errs = append(errs, fmt.Errorf("%s: %w: %d slots, not a power of two", name, ErrMapSize, n))
		case name == "fluxvm_sflows" && n < c && on.Has(FeatureFlowRecords):
			// flows.h picks the slot as id & (FLUXVM_FLOW_SLOTS-1), the
			// compiled size: records past a smaller ring are lost.
			errs = append(errs, fmt.Errorf("%s: %w: %d slots, fewer than the compiled %d while %s is loaded (omit it: Options.OmitFeatures)",
				name, ErrMapSize, n, c, FeatureFlowRecords))
		case name == "fluxvm_haq" && (bits.OnesCount32(n) != 1 || n < TokenHAQueueBytes()):
			errs = append(errs, fmt.Errorf("%s: %w: %d bytes, not a power of two pages", name, ErrMapSize, n))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("bpf: open: map sizes: %w", err)
	}
	return nil
}

// sizeSpec sets the max_entries of the maps Options.Sizes names in spec,
// which holds the tier's capacities: the size wanted, or, for a lifecycle
// map (conntrack, reverse NAT) pinned with entries, the size of the
// pinned map when that is larger (its entries fit, and a map never
// shrinks below what it held), at most the tier's capacity. A pinned map
// without entries is no reason to stay large (a node upgraded from
// objects without sizing has every map at the tier's capacity, the IPv6
// ones empty on an IPv4-only node): it is replaced at the size wanted. A pinned map of another size is then
// recreated at this one and its entries migrated (Open), as at a tier
// change.
func sizeSpec(spec *ebpf.CollectionSpec, tier Tier, s Sizes, on Features, pinned map[string]*ebpf.Map) error {
	sizes := s.Map()
	if len(sizes) == 0 {
		return nil
	}
	ceil, err := Ceilings(tier)
	if err != nil {
		return err
	}
	if err := checkSizes(sizes, ceil, on); err != nil {
		return err
	}
	for name, n := range sizes {
		ms := spec.Maps[name]
		if ms == nil {
			return fmt.Errorf("bpf: open: map sizes: object has no map %s", name)
		}
		if m := pinned[name]; m != nil && m.Type() == ms.Type && slices.Contains(LifecycleMaps, name) && !isEmpty(m) {
			n = max(n, min(m.MaxEntries(), ceil[name]))
		}
		ms.MaxEntries = n
	}
	return nil
}

// isEmpty reports whether m holds no entry (false when that cannot be
// read: the map is then kept as it is).
func isEmpty(m *ebpf.Map) bool {
	k := make([]byte, m.KeySize())
	return errors.Is(m.NextKey(nil, &k), ebpf.ErrKeyNotExist)
}

// MapSizes reports each map of SizedMaps and the socket LB maps: its size
// now and its tier's capacity.
func (d *Datapath) MapSizes() ([]MapSize, error) {
	if d.coll == nil {
		return nil, ErrClosed
	}
	ceil, err := Ceilings(d.opts.Tier)
	if err != nil {
		return nil, err
	}
	d.live.RLock()
	defer d.live.RUnlock()
	var out []MapSize
	for _, name := range append(slices.Clone(SizedMaps), "fluxvm_sock_fwd", "fluxvm_sock_rev") {
		m := d.coll.Maps[name]
		if m == nil {
			continue
		}
		out = append(out, MapSize{Map: name, MaxEntries: m.MaxEntries(), Ceiling: ceil[name]})
	}
	return out, nil
}

// GrowFlowMaps makes each flow map (FlowMaps) named in sizes hold at least
// that many entries (0: the tier's capacity; never more than it), while
// traffic runs. A map already that large is left alone. The others are
// replaced as CompactFlowMaps replaces them, keeping every entry: a new
// map at the new size, the entries copied into it while the attached
// programs keep using the old one, the programs (TC, XDP, socket LB)
// loaded anew onto it, the pins and every pinned attachment switched (link
// updates, no gap), and what the old programs learned or changed in the
// meantime copied before and after the switch (catch-up), so that no
// entry is lost: each arrives byte for byte. (A reply that reaches the
// new programs between the switch and the last catch-up, to a flow
// learned in the last moments before the switch, finds no entry yet and
// goes out untranslated; a change made in the same tick of the coarse
// clock as the version copied has its last-seen time, and the catch-up
// keeps the version copied.) The result's Maps say, per grown map, the
// entries carried over (Kept) and caught up; none is dropped.
//
// switchLock, as CompactOptions.Switch, is held around the switch alone.
// It fails with ErrCompactUnsupported where CompactFlowMaps does (hooks
// attached by cls_bpf, a staged Open not activated). After a failure
// before the switch (Compaction.Switched false) the maps are as they
// were.
func (d *Datapath) GrowFlowMaps(sizes map[string]uint32, switchLock sync.Locker) (Compaction, error) {
	if d.coll == nil {
		return Compaction{}, ErrClosed
	}
	ceil, err := Ceilings(d.opts.Tier)
	if err != nil {
		return Compaction{}, err
	}
	keep := map[string]int{}
	prev := map[string]uint32{}
	for name, n := range sizes {
		if !slices.Contains(FlowMaps, name) {
			return Compaction{}, fmt.Errorf("bpf: grow: %s is not a flow map (%v)", name, FlowMaps)
		}
		if n == 0 || n > ceil[name] {
			n = ceil[name]
		}
		cur := d.coll.Maps[name].MaxEntries()
		if n <= cur {
			continue
		}
		prev[name] = d.spec.Maps[name].MaxEntries
		d.spec.Maps[name].MaxEntries = n
		keep[name] = int(n) // every entry (CompactOptions.all)
	}
	if len(keep) == 0 {
		return Compaction{}, nil
	}
	res, err := d.CompactFlowMaps(CompactOptions{Keep: keep, Switch: switchLock, all: true})
	if !res.Switched {
		for name, n := range prev {
			d.spec.Maps[name].MaxEntries = n
		}
	}
	if err != nil {
		return res, fmt.Errorf("bpf: grow: %w", err)
	}
	return res, nil
}
