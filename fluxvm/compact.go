package fluxvm

import (
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
)

// The hard action of map pressure control (pressure_hard_percent): when a
// round's GC and shedding left a family's conntrack or reverse-NAT map at
// or above the hard threshold, the maps are full of flows no timeout
// reaches (established TCP, busy UDP), and the kernel's LRU is about to
// choose which of them break. The controller chooses instead: it rebuilds
// that family's conntrack map with the flows most costly to lose, up to
// one point below the soft threshold, and reloads the pins
// (bpf.Datapath.CompactFlowMaps):
//
//   - cleared: the pinned set's generation marker, for the duration (a
//     crash midway makes the next start reload everything from the
//     catalog instead of trusting a set half switched), and the flows that
//     do not fit, cheapest first: closed TCP, unanswered handshakes, UDP,
//     and established TCP last, the longest idle first within each;
//   - reloaded: the conntrack map, created anew at its capacity and pinned
//     in place of the old one, and the programs (TC, XDP, socket LB), onto
//     which every attached hook is switched by link update, without a gap;
//     flows the old programs learned meanwhile are copied after the switch.
//
// The reverse-NAT map stays: the halves of the flows left out are deleted
// with them (a GC would otherwise find them fresh and bring the flows
// back). Every other map (services,
// Maglev, policy) is untouched. A flow left out whose client still sends
// is learned again at its next packet, by Maglev onto the same backend
// unless membership changed.
//
// The controller (package fluxvm/internal/pressure) decides which map
// keeps how many entries and when to try again after a failure; this
// file does the compaction, which touches the flow maps, their views and
// d.flowMu.

// compactFlows runs the hard action on the maps of keep (the
// controller's plan, pressure.Controller.Plan); its error is the
// compaction's failure (the controller waits pressure.CompactRetry
// before it tries again).
func (d *Dataplane) compactFlows(keep map[string]int) (*PressureCompaction, error) {
	start := time.Now()
	pc := &PressureCompaction{}
	done := func(err error) (*PressureCompaction, error) {
		pc.Duration = Duration{Duration: time.Since(start)}
		if err != nil {
			pc.Error = err.Error()
		}
		return pc, err
	}
	// GC, shedding and imports write the flow maps through the views the
	// compaction rebinds: it waits for none of them (a slow import would
	// hold the round), it tries again next round.
	if !d.flowMu.TryLock() {
		pc.Deferred = "a GC or an HA import is writing the flow maps"
		return pc, nil
	}
	unlock := unlockOnce(&d.flowMu)
	defer unlock()
	d.mu.Lock()
	err := d.checkOpen("compact flow maps")
	if err == nil {
		for _, ifc := range d.ifaces {
			for _, h := range ifc.hooks {
				if h.Mode == string(bpf.AttachClsBPF) {
					err = fmt.Errorf("%w: %s's hooks are attached by cls_bpf", bpf.ErrCompactUnsupported, ifc.Name)
				}
			}
		}
	}
	d.mu.Unlock()
	if err != nil {
		return done(err)
	}
	// The copy and the program loads run without mu; the switch under it.
	type drop struct{ key, value []byte }
	var dropped []drop
	res, err := d.dp.CompactFlowMaps(bpf.CompactOptions{Keep: keep, Switch: &d.mu,
		Dropped: func(_ string, k, v []byte) { dropped = append(dropped, drop{k, v}) }})
	pc.Maps, pc.Links, pc.Switch = res.Maps, res.Links, Duration{Duration: res.SwitchTime}
	if !res.Switched {
		return done(err)
	}
	// The views take handles of their own on the new conntrack maps.
	d.mu.Lock()
	m := d.dp.Maps()
	c4, cerr := m.FluxvmFct4.Clone()
	var c6 *ebpf.Map
	if cerr == nil {
		if c6, cerr = m.FluxvmFct6.Clone(); cerr != nil {
			c4.Close()
		}
	}
	d.mu.Unlock()
	if cerr != nil {
		// The views keep the old maps (still open): what they write is
		// lost until the next apply or pressure round rebinds them.
		d.setViewsStale(true)
		return done(errors.Join(err, fmt.Errorf("flow map handles: %w", cerr)))
	}
	wait, rerr := d.ct.Rebind(c4, c6)
	if rerr != nil {
		c4.Close()
		c6.Close()
		d.setViewsStale(true)
		return done(errors.Join(err, rerr))
	}
	d.flowMaps[0], d.flowMaps[1] = c4, c6
	// The halves of the flows left out go (GC would find them fresh and
	// bring the flows back), and the journals learn of the north-south
	// ones, as of GC's removals.
	var herr error
	for _, dk := range dropped {
		e, derr := conntrack.DecodeRaw(dk.key, dk.value)
		if derr != nil {
			continue
		}
		// A dropped flow whose client sent again since is learned anew
		// (on the same backend, most often): its half and its standby's
		// copy are its own now.
		if _, lerr := d.ct.Lookup(e.Key); lerr == nil {
			continue
		}
		if err := d.ct.DeleteHalf(dk.key, dk.value); err != nil && herr == nil {
			herr = err
		}
		// Dropped by the compaction, not idle: the delete applies on
		// every target (idle 0).
		d.haRemoved(e.Key, e.ServiceID, e.Kind, 0)
	}
	// The old handles close once no scan uses them: without flowMu (a
	// scan's callback may run a GC, which takes it).
	unlock()
	o4, o6 := wait()
	closeMaps([]*ebpf.Map{o4, o6})
	// The copy's working memory (a tier-L rebuild reads a million
	// entries' times and keeps every dropped entry) goes back to the
	// system now rather than at the runtime's leisure: the node is under
	// pressure already.
	dropped = nil
	debug.FreeOSMemory()
	return done(errors.Join(err, herr))
}

// cloneFlowMaps returns handles of the views' own on the datapath's flow
// maps: fluxvm_fct4, fct6, nat4, nat6.
func (d *Dataplane) cloneFlowMaps() ([4]*ebpf.Map, error) {
	var out [4]*ebpf.Map
	m := d.dp.Maps()
	for i, src := range []*ebpf.Map{m.FluxvmFct4, m.FluxvmFct6, m.FluxvmNat4, m.FluxvmNat6} {
		c, err := src.Clone()
		if err != nil {
			closeMaps(out[:])
			return [4]*ebpf.Map{}, fmt.Errorf("flow map handles: %w", err)
		}
		out[i] = c
	}
	return out, nil
}

// closeMaps closes the maps that are not nil.
func closeMaps(ms []*ebpf.Map) {
	for _, m := range ms {
		if m != nil {
			m.Close()
		}
	}
}
