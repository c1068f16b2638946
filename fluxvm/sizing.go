package fluxvm

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/intent"
)

// Maps sized by need (docs/operations.md, "Maps sized by need"). The
// tier's object is loaded as the product description says, its capacities
// the ceiling; each map below that nothing in the configuration or the
// catalog can use is loaded at a token size (bpf.Options.Sizes), and the
// flow maps grow to the ceiling, while traffic runs, in the apply of the
// first service that needs them (growFor, before it writes anything).
//
//	map             full when                                   token size
//	fluxvm_fct4     an IPv4 frontend is in the catalog          1,024 entries
//	fluxvm_fct6     an IPv6 frontend is in the catalog          1,024 entries
//	fluxvm_nat4     an IPv4 frontend is north-south in mode
//	                nat (SNAT), or a backend endpoint is listed
//	                by more frontends than fluxvm_be2fe has
//	                slots (their reverse halves are stored)     1,024 entries
//	fluxvm_nat6     the same for IPv6                           1,024 entries
//	fluxvm_sflows   flow_sample_rate is not 0 (Open)            64 slots
//	fluxvm_haq      ha_epoch is set (Open)                      one page
//	fluxvm_sock_*   cgroup_connect is on (Open; bpf.Options.SocketLB)
//
// No map shrinks: one grown stays at the ceiling after its last user
// left, and a restart keeps a pinned map larger than what the catalog
// needs (bpf.Options.Sizes), so a flow it holds is never lost to a
// resize. Shrinking is not done; a tier change moves every map to the new
// tier (to its token size where the new tier's need is token and the
// pinned map held no more).

// Sizing reasons, the prefix of MapSizeStatus.Reason.
const (
	SizeToken = "token"
	SizeFull  = "full"
)

// MapSizeStatus is one map sized by need: its size now, the tier's
// capacity it grows to, and why it has its size.
type MapSizeStatus struct {
	Map string `json:"map"`
	// MaxEntries is the map's size now (fluxvm_haq: bytes).
	MaxEntries uint32 `json:"max_entries"`
	// Ceiling is the tier's capacity (map_tier): what the map grows to.
	Ceiling uint32 `json:"ceiling"`
	// Entries is what a hash map holds now, as the kernel counts it (the
	// figure of Status.Pressure); absent for the ring, the queue, and
	// where the kernel cannot count.
	Entries *int64 `json:"entries,omitempty"`
	// Size is "token" (below the ceiling: nothing configured can use it)
	// or "full" (at the ceiling).
	Size string `json:"size"`
	// Reason says why, e.g. "token: no IPv6 frontend" or "full: IPv6
	// frontend of service web (grown by its apply)".
	Reason string `json:"reason"`
	// ReasonCode is the reason as a fixed code (the reason label of
	// fluxvm_map_size_info): token: no_ipv4_frontend, no_ipv6_frontend,
	// no_reverse_nat, flow_records_off, ha_off, cgroup_connect_off; full:
	// ipv4_frontend, ipv6_frontend, north_south_nat,
	// stored_reverse_halves, flow_records_on, ha_on, cgroup_connect_on,
	// cls_bpf (hooks attached by cls_bpf), catalog_unreadable,
	// grown_by_pressure; kept (a pinned map larger than the need).
	ReasonCode string `json:"reason_code"`
}

// MapGrowth is what the last grow of the flow maps did (an apply that
// brought their first user).
type MapGrowth struct {
	// Cause is what grew them: "apply of service NAME" (its first user
	// arrived) or "map pressure" (a map below its ceiling filled).
	Cause string `json:"cause"`
	// Maps are the grown maps: entries carried over (kept) and caught up
	// (learned by the old programs during the grow); none is dropped.
	Maps []bpf.FlowMapCompaction `json:"maps"`
	// Switch is how long the switch held the dataplane's lock, Duration
	// the whole grow (new maps, copy, program loads, switch, catch-up).
	Switch   Duration  `json:"switch"`
	Duration Duration  `json:"duration"`
	At       time.Time `json:"at"`
}

// sizeNeed is whether a map sized by need must be at its ceiling, and why
// (reason: prose; code: MapSizeStatus.ReasonCode).
type sizeNeed struct {
	full   bool
	reason string
	code   string
}

// sizeReason is why a map has its size now: MapSizeStatus.Reason and
// ReasonCode.
type sizeReason struct {
	text, code string
}

// sizingState is what the dataplane knows of its maps' sizes (under mu).
type sizingState struct {
	// reason of each map's size now (bpf.SizedMaps), from Open or the
	// grow that made it so; nil when Open did not size the maps.
	reason map[string]sizeReason
	// last is the last grow.
	last *MapGrowth
	// viewsStale: a rebind of the flow views after a grow failed, they
	// may write replaced maps; the next apply or pressure round rebinds
	// them (rebindStale).
	viewsStale bool
}

// sizeNeeds computes, from the node's settings and the catalog svcs,
// which maps sized by need must be at their ceiling. ha is whether
// flow-state replication is on.
func sizeNeeds(opts *Options, ha bool, svcs []Service) map[string]sizeNeed {
	out := map[string]sizeNeed{
		"fluxvm_fct4":   {reason: "no IPv4 frontend", code: "no_ipv4_frontend"},
		"fluxvm_fct6":   {reason: "no IPv6 frontend", code: "no_ipv6_frontend"},
		"fluxvm_nat4":   {reason: "no IPv4 frontend is north-south (SNAT) or stores reverse halves", code: "no_reverse_nat"},
		"fluxvm_nat6":   {reason: "no IPv6 frontend is north-south (SNAT) or stores reverse halves", code: "no_reverse_nat"},
		"fluxvm_sflows": {reason: "flow_sample_rate is 0", code: "flow_records_off"},
		"fluxvm_haq":    {reason: "ha_epoch is not set", code: "ha_off"},
	}
	set := func(name, code, why string) {
		if !out[name].full {
			out[name] = sizeNeed{full: true, reason: why, code: code}
		}
	}
	if opts.FlowSampleRate > 0 {
		set("fluxvm_sflows", "flow_records_on", fmt.Sprintf("flow_sample_rate is %d", opts.FlowSampleRate))
	}
	if ha {
		set("fluxvm_haq", "ha_on", "ha_epoch is set")
	}
	fam := func(a netip.Addr) (string, string) {
		if a.Unmap().Is4() {
			return "4", "IPv4"
		}
		return "6", "IPv6"
	}
	feCode := map[string]string{"4": "ipv4_frontend", "6": "ipv6_frontend"}
	// Frontends per backend endpoint: past bpf.Be2feSlots of them, some
	// frontend's flows store reverse halves (be2fe.go). Every frontend
	// listing the endpoint counts, whatever its mode and exposure: a
	// frontend keeps its slot when it stops taking new ones.
	type epKey struct {
		ep    netip.AddrPort
		proto uint8
	}
	lists := map[epKey]map[feKey]bool{}
	for i := range svcs {
		svc := &svcs[i]
		for _, w := range wanted(*svc) {
			f, name := fam(w.key.vip)
			set("fluxvm_fct"+f, feCode[f], fmt.Sprintf("%s frontend of service %s", name, svc.Name))
			if svc.IsNorthSouth() && svc.Mode != ModeDSR {
				set("fluxvm_nat"+f, "north_south_nat", fmt.Sprintf("%s frontend of service %s is north-south in mode nat (SNAT)", name, svc.Name))
			}
			for _, b := range w.backends {
				k := epKey{netip.AddrPortFrom(b.Address.Unmap(), b.Port), w.key.proto}
				if lists[k] == nil {
					lists[k] = map[feKey]bool{}
				}
				lists[k][w.key] = true
				if len(lists[k]) > bpf.Be2feSlots {
					set("fluxvm_nat"+f, "stored_reverse_halves", fmt.Sprintf("backend %s is listed by more than %d frontends (service %s): their reverse halves are stored",
						k.ep, bpf.Be2feSlots, svc.Name))
				}
			}
		}
	}
	return out
}

// tokenSize is the token size of a map sized by need.
func tokenSize(name string) uint32 {
	switch name {
	case "fluxvm_sflows":
		return bpf.TokenFlowSlots
	case "fluxvm_haq":
		return bpf.TokenHAQueueBytes()
	}
	return bpf.TokenFlowEntries
}

// openSizes returns the sizes Open loads the maps with (bpf.Options.Sizes:
// a token size for each map nothing needs), from the settings and the
// catalog at CatalogPath, and the reasons. With hooks attached by cls_bpf
// (AttachMode cls_bpf, or the automatic mode on a kernel without TCX) a
// map cannot grow while traffic runs: every map is loaded at its ceiling
// then.
func openSizes(opts *Options, ha bool) (bpf.Sizes, map[string]sizeReason) {
	reason := map[string]sizeReason{}
	mode := opts.Loader.AttachMode
	if mode == bpf.AttachClsBPF || mode == "" && !bpf.HaveTCX() {
		why := "attach_mode cls_bpf"
		if mode == "" {
			why = "the kernel has no TCX: hooks attach by cls_bpf"
		}
		for _, name := range bpf.SizedMaps {
			reason[name] = sizeReason{SizeFull + ": " + why + " (its filters cannot be switched to grown maps)", "cls_bpf"}
		}
		return bpf.Sizes{}, reason
	}
	var svcs []Service
	if opts.CatalogPath != "" {
		cat, err := catalog.Read(opts.CatalogPath, opts.Logger)
		if err != nil {
			// The restore reports it; meanwhile nothing is left small.
			for _, name := range bpf.SizedMaps {
				reason[name] = sizeReason{SizeFull + ": the catalog could not be read to size the maps", "catalog_unreadable"}
			}
			return bpf.Sizes{}, reason
		}
		for _, cs := range cat.Services {
			svcs = append(svcs, cs.Service)
		}
	}
	var sizes bpf.Sizes
	for name, n := range sizeNeeds(opts, ha, svcs) {
		if n.full {
			reason[name] = sizeReason{SizeFull + ": " + n.reason, n.code}
			continue
		}
		sizes.Set(name, tokenSize(name))
		reason[name] = sizeReason{SizeToken + ": " + n.reason, n.code}
	}
	return sizes, reason
}

// MapSizesStatus is Status.MapSizes.
type MapSizesStatus struct {
	Maps []MapSizeStatus `json:"maps"`
	// LastGrowth is the last grow since Open, if any.
	LastGrowth *MapGrowth `json:"last_growth,omitempty"`
	// Error says why the sizes could not be read.
	Error string `json:"error,omitempty"`
}

// mapSizesStatus is Status.MapSizes, with the entries of p (nil: none).
// d.mu must be held.
func (d *Dataplane) mapSizesStatus(p *PressureStatus) *MapSizesStatus {
	sizes, err := d.dp.MapSizes()
	if err != nil {
		return &MapSizesStatus{Error: err.Error()}
	}
	out := make([]MapSizeStatus, 0, len(sizes))
	for _, s := range sizes {
		r := d.sizing.reason[s.Map]
		st := MapSizeStatus{Map: s.Map, MaxEntries: s.MaxEntries, Ceiling: s.Ceiling, Size: SizeToken, Reason: r.text, ReasonCode: r.code}
		if s.MaxEntries >= s.Ceiling {
			st.Size = SizeFull
		}
		if mp, ok := pressureEntries(p, s.Map); ok {
			st.Entries = &mp
		}
		switch {
		case s.Map == "fluxvm_sock_fwd" || s.Map == "fluxvm_sock_rev":
			st.Reason, st.ReasonCode = SizeToken+": cgroup_connect is off", "cgroup_connect_off"
			if d.opts.SocketLB.CgroupConnect {
				st.Reason, st.ReasonCode = SizeFull+": cgroup_connect is on", "cgroup_connect_on"
			}
		case strings.HasPrefix(st.Reason, SizeToken+":") && s.MaxEntries > tokenSize(s.Map):
			// A pinned map of an earlier start, larger than the need:
			// kept, as maps do not shrink.
			st.ReasonCode = "kept"
			st.Reason = fmt.Sprintf("kept: the pinned map was this large (maps do not shrink); need: %s", strings.TrimPrefix(st.Reason, SizeToken+": "))
		}
		out = append(out, st)
	}
	return &MapSizesStatus{Maps: out, LastGrowth: d.sizing.last}
}

// growFor grows the flow maps that the catalog with svc applied needs at
// their ceiling and does not have there yet, before the apply writes
// anything: the first IPv6 frontend grows fluxvm_fct6, the first
// north-south NAT frontend of a family its reverse-NAT map. A request that
// validation would reject grows nothing. The grow runs while traffic does
// (bpf.Datapath.GrowFlowMaps: new maps, entries copied, programs reloaded
// onto them, links switched, caught up): flows keep their entries. d.mu
// is held around the switch only (see MapGrowth.Switch). seq is the
// d.reservations its plan counted: an apply that reserves at the same
// count has nothing new to count (reserveChanged).
func (d *Dataplane) growFor(svc Service) (seq uint64, err error) {
	if err := d.rebindStale(false); err != nil {
		return 0, err
	}
	grow, _, seq := d.growPlan(svc)
	if len(grow) == 0 {
		return seq, nil
	}
	start := time.Now()
	// GC, shedding and imports write the flow maps through the views the
	// grow rebinds, and a compaction replaces them too: the grow waits
	// for them (flowMu before mu, as compactFlows and Close take them).
	d.flowMu.Lock()
	// Another apply may have grown them meanwhile.
	grow, reasons, seq := d.growPlan(svc)
	if len(grow) == 0 {
		d.flowMu.Unlock()
		return seq, nil
	}
	return seq, d.growMaps("apply of service "+svc.Name, grow, reasons, start)
}

// growMaps grows the flow maps grow to their ceiling, for what
// (MapGrowth.Cause), recording reasons. d.flowMu must be held; growMaps
// lets it go (before it waits for the views' operations on the old maps
// to end: a scan's callback may run a GC, which takes it).
func (d *Dataplane) growMaps(what string, grow []string, reasons map[string]sizeNeed, start time.Time) (err error) {
	locked := true
	unlock := func() {
		if locked {
			locked = false
			d.flowMu.Unlock()
		}
	}
	defer unlock()
	sizes := map[string]uint32{}
	for _, name := range grow {
		sizes[name] = 0 // the ceiling
	}
	res, gerr := d.dp.GrowFlowMaps(sizes, &d.mu)
	if !res.Switched {
		if gerr != nil {
			err = fmt.Errorf("grow %v: %w", grow, gerr)
			return err
		}
		return nil
	}
	// The views take handles of their own on the new maps; the old ones
	// close once no operation uses them. Should that fail, the datapath
	// runs on the grown maps while the views write the old ones: the next
	// apply or pressure round rebinds them (rebindStale).
	release, rerr := d.rebindFlowViews()
	unlock()
	release()
	g := &MapGrowth{Cause: what, Maps: res.Maps, Switch: Duration{Duration: res.SwitchTime}, Duration: Duration{Duration: time.Since(start)}, At: time.Now().UTC()}
	d.mu.Lock()
	for _, name := range grow {
		d.sizing.reason[name] = sizeReason{SizeFull + ": " + reasons[name].reason + " (grown by " + what + ")", reasons[name].code}
	}
	d.sizing.last = g
	d.mu.Unlock()
	d.log.Info("fluxvm: flow maps grown to the tier's capacity", "cause", what, "maps", grow,
		"duration", g.Duration.Duration, "switch", g.Switch.Duration)
	if err = errors.Join(gerr, rerr); err != nil {
		err = fmt.Errorf("grow %v: %w", grow, err)
	}
	return err
}

// rebindFlowViews points the flow views (conntrack, reverse NAT) at the
// datapath's flow maps where a grow or a compaction replaced them: each
// pair whose handles are not of the maps the datapath runs on gets new
// ones. d.flowMu must be held; release closes the views' old handles once
// no operation uses them and must be called without it (a scan's callback
// may run a GC, which takes it). After an error the views not rebound
// keep their old maps and d.viewsStale says so.
func (d *Dataplane) rebindFlowViews() (release func(), err error) {
	var waits []func() (*ebpf.Map, *ebpf.Map)
	release = func() {
		for _, w := range waits {
			o1, o2 := w()
			closeMaps([]*ebpf.Map{o1, o2})
		}
	}
	d.mu.Lock()
	m := d.dp.Maps()
	cur := [4]*ebpf.Map{m.FluxvmFct4, m.FluxvmFct6, m.FluxvmNat4, m.FluxvmNat6}
	var stale [2]bool
	for i, c := range cur {
		if !sameMap(d.flowMaps[i], c) {
			stale[i/2] = true
		}
	}
	var fm [4]*ebpf.Map
	for i := range cur {
		if err == nil && stale[i/2] {
			fm[i], err = cur[i].Clone()
		}
	}
	d.mu.Unlock()
	if err == nil && rebindFault != nil {
		err = rebindFault()
	}
	if err != nil {
		closeMaps(fm[:])
		d.setViewsStale(true)
		return release, fmt.Errorf("flow map handles: %w", err)
	}
	rebind := []func(a, b *ebpf.Map) (func() (*ebpf.Map, *ebpf.Map), error){d.ct.Rebind, d.ct.NAT().Rebind}
	for p, r := range rebind {
		if !stale[p] {
			continue
		}
		w, rerr := r(fm[2*p], fm[2*p+1])
		if rerr != nil {
			closeMaps(fm[2*p:])
			d.setViewsStale(true)
			return release, rerr
		}
		waits = append(waits, w)
		d.flowMaps[2*p], d.flowMaps[2*p+1] = fm[2*p], fm[2*p+1]
	}
	d.setViewsStale(false)
	return release, nil
}

// rebindFault, when set (tests), fails rebindFlowViews after the clones.
var rebindFault func() error

// setViewsStale records whether the flow views may be on replaced maps.
func (d *Dataplane) setViewsStale(v bool) {
	d.mu.Lock()
	d.sizing.viewsStale = v
	d.mu.Unlock()
}

// rebindStale rebinds the flow views if a rebind after a grow failed
// (rebindFlowViews). try: only if no GC or import holds d.flowMu (the
// pressure round); else it waits for them (an apply).
func (d *Dataplane) rebindStale(try bool) error {
	d.mu.Lock()
	stale := d.sizing.viewsStale
	d.mu.Unlock()
	if !stale {
		return nil
	}
	if try {
		if !d.flowMu.TryLock() {
			return nil
		}
	} else {
		d.flowMu.Lock()
	}
	release, err := d.rebindFlowViews()
	d.flowMu.Unlock()
	release()
	if err != nil {
		return fmt.Errorf("rebind the flow views to the grown maps: %w", err)
	}
	return nil
}

// sameMap reports whether a and b are handles of one kernel map.
func sameMap(a, b *ebpf.Map) bool {
	if a == nil || b == nil {
		return a == b
	}
	ia, err := a.Info()
	if err != nil {
		return false
	}
	ib, err := b.Info()
	if err != nil {
		return false
	}
	ida, ok := ia.ID()
	idb, ok2 := ib.ID()
	return ok && ok2 && ida == idb
}

// growPlan returns the flow maps that the catalog with svc applied needs
// at their ceiling and that are smaller now, with the reasons; none when
// svc would be rejected or the dataplane is closed. seq is
// d.reservations when it looked.
func (d *Dataplane) growPlan(svc Service) (_ []string, _ map[string]sizeNeed, seq uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	seq = d.reservations
	if d.checkOpen("apply "+svc.Name) != nil || d.sizing.reason == nil {
		return nil, nil, seq
	}
	if ValidateService(svc, *d.opts.settings()) != nil {
		return nil, nil, seq
	}
	var oldFP *intent.Footprint
	if old := d.services[svc.Name]; old != nil {
		oldFP = &old.fp
	}
	fp := intent.FootprintOf(&svc)
	if d.index.Check(&svc, &fp, oldFP, d.limits) != nil {
		return nil, nil, seq
	}
	grow, reasons := d.needGrowth(svc)
	return grow, reasons, seq
}

// needGrowth returns the flow maps that the catalog needs at their
// ceiling once svc is applied and that are smaller now, with the reasons.
// The catalog counted is every committed service, every apply reserved
// and not yet committed or aborted (d.reserved: applies of different
// services run concurrently, and two of them may together cross a
// threshold neither crosses alone), and svc. d.mu must be held.
func (d *Dataplane) needGrowth(svc Service) ([]string, map[string]sizeNeed) {
	if d.sizing.reason == nil {
		return nil, nil
	}
	// The catalog as the apply leaves it, and the service as it was: its
	// old frontends keep their slots until the apply removed them.
	// svc last, so that the reasons name it where it is the cause.
	var svcs []Service
	for _, s := range d.services {
		svcs = append(svcs, s.intent)
	}
	for name, s := range d.reserved {
		if name != svc.Name {
			svcs = append(svcs, s)
		}
	}
	slices.SortStableFunc(svcs, func(a, b Service) int { return strings.Compare(a.Name, b.Name) })
	svcs = append(svcs, svc)
	sizes, err := d.dp.MapSizes()
	if err != nil {
		return nil, nil
	}
	needs := sizeNeeds(&d.opts, d.ha != nil, svcs)
	var grow []string
	reasons := map[string]sizeNeed{}
	for _, s := range sizes {
		if !slices.Contains(bpf.FlowMaps, s.Map) || !needs[s.Map].full || s.MaxEntries >= s.Ceiling {
			continue
		}
		grow = append(grow, s.Map)
		reasons[s.Map] = needs[s.Map]
	}
	sort.Strings(grow)
	return grow, reasons
}

// growUnderPressure grows to their ceiling the flow maps of over (at or
// above pressure_soft_percent) that are below it: a map at its token size
// that fills anyway (an entry the sizing did not foresee, such as a flow
// imported from an HA peer whose catalog differs) grows rather than have
// the pressure controller shed or compact its flows. It reports whether it
// grew one. It does not wait for a GC or an import under way (the next
// round tries again). Only a pressure round runs it: with the
// controller's timer off (Options.Pressure.Interval) nothing but
// ReconcilePressure grows such a map, which evicts its oldest entries
// meanwhile (an LRU).
func (d *Dataplane) growUnderPressure(over []string) bool {
	if err := d.rebindStale(true); err != nil {
		d.log.Error("fluxvm: map pressure: the flow views are on replaced maps", "err", err)
	}
	d.mu.Lock()
	sizes, err := d.dp.MapSizes()
	d.mu.Unlock()
	if err != nil {
		return false
	}
	var grow []string
	reasons := map[string]sizeNeed{}
	for _, s := range sizes {
		if slices.Contains(over, s.Map) && slices.Contains(bpf.FlowMaps, s.Map) && s.MaxEntries < s.Ceiling {
			grow = append(grow, s.Map)
			reasons[s.Map] = sizeNeed{full: true, code: "grown_by_pressure",
				reason: fmt.Sprintf("filled to pressure_soft_percent at %d entries' room", s.MaxEntries)}
		}
	}
	if len(grow) == 0 || !d.flowMu.TryLock() {
		return false
	}
	if err := d.growMaps("map pressure", grow, reasons, time.Now()); err != nil {
		d.log.Error("fluxvm: map pressure: growing a map below its tier's capacity failed", "maps", grow, "err", err)
		return false
	}
	return true
}

// pressureEntries is the entries of map name in p, if p counted them.
func pressureEntries(p *PressureStatus, name string) (int64, bool) {
	if p == nil || p.Unsupported || p.Error != "" {
		return 0, false
	}
	m, ok := p.Maps[name]
	return m.Entries, ok
}
