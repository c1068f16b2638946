package fluxvm

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
)

// Growing a map sized by need when a change or pressure needs it: the
// maps replaced, the flow views rebound (sizing.go says why they grow).

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
	unlock := unlockOnce(&d.flowMu)
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
		oldFP = &old.Footprint
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
		svcs = append(svcs, s.Intent)
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
