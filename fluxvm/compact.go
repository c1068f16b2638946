package fluxvm

import (
	"fmt"
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
// The reverse-NAT map stays: the GC that follows removes the halves of
// the flows left out (their replies would find no flow) and repairs none
// of the kept ones, which kept their halves. Every other map (services,
// Maglev, policy) is untouched. A flow left out whose client still sends
// is learned again at its next packet, by Maglev onto the same backend
// unless membership changed.

// PressureCompaction is what a round's hard action did.
type PressureCompaction struct {
	// Maps are the flow maps rebuilt, with what each kept and dropped.
	Maps []bpf.FlowMapCompaction `json:"maps,omitempty"`
	// Links are the pinned attachments switched to the reloaded programs.
	Links []string `json:"links,omitempty"`
	// Deferred says why the round could not compact now (a GC or an HA
	// import was writing the flow maps); the next round tries again.
	Deferred string `json:"deferred,omitempty"`
	// Error is why the compaction failed (the maps stay as they were
	// unless it says the generation marker stays cleared).
	Error    string   `json:"error,omitempty"`
	Duration Duration `json:"duration"`
}

// compactionPlan returns the conntrack maps a hard round rebuilds, with
// the entries each keeps: a family's fluxvm_fct map when it or its
// reverse-NAT map is at or above the hard threshold, kept to one point
// below the soft one (the flows learned while it is rebuilt, copied after
// the switch, do not put it straight back above).
func (d *Dataplane) compactionPlan(st PressureStatus) map[string]int {
	c := d.pressure
	keep := map[string]int{}
	for _, fam := range [][2]string{{"fluxvm_fct4", "fluxvm_nat4"}, {"fluxvm_fct6", "fluxvm_nat6"}} {
		ct, nt := st.Maps[fam[0]], st.Maps[fam[1]]
		if c.level(ct.Percent) != PressureHard && c.level(nt.Percent) != PressureHard {
			continue
		}
		keep[fam[0]] = int(int64(ct.MaxEntries) * int64(c.soft-1) / 100)
	}
	return keep
}

// compactFlows runs the hard action on the maps of keep.
func (d *Dataplane) compactFlows(keep map[string]int) (*PressureCompaction, error) {
	start := time.Now()
	pc := &PressureCompaction{}
	// GC, shedding and imports write the flow maps through the views the
	// compaction rebinds: it waits for none of them (a slow import would
	// hold the round), it tries again next round.
	if !d.flowMu.TryLock() {
		pc.Deferred = "a GC or an HA import is writing the flow maps"
		return pc, nil
	}
	defer d.flowMu.Unlock()
	var dropped []conntrack.Entry
	d.mu.Lock()
	if err := d.checkOpen("compact flow maps"); err != nil {
		d.mu.Unlock()
		return nil, err
	}
	res, err := d.dp.CompactFlowMaps(bpf.CompactOptions{Keep: keep, Dropped: func(_ string, k, v []byte) {
		// Replication journals turn the north-south flows left out into
		// deletes for the standby, as they do GC's removals.
		if e, err := conntrack.DecodeRaw(k, v); err == nil && (e.Kind == conntrack.SNAT || e.Kind == conntrack.DSR) {
			dropped = append(dropped, e)
		}
	}})
	pc.Maps, pc.Links = res.Maps, res.Links
	var fm [4]*ebpf.Map
	var cerr error
	if res.Switched {
		// A catch-up error, if any, is reported below.
		fm, cerr = d.cloneFlowMaps()
	}
	d.mu.Unlock()
	if !res.Switched && err == nil {
		return pc, nil // nothing to rebuild
	}
	if !res.Switched {
		pc.Error = err.Error()
		pc.Duration = Duration{time.Since(start)}
		return pc, fmt.Errorf("fluxvm: pressure: %w", err)
	}
	if cerr != nil {
		// The views keep the old maps (still open): flows they write are
		// lost, but nothing breaks; a restart rebinds.
		pc.Error = cerr.Error()
		return pc, fmt.Errorf("fluxvm: pressure: %w", cerr)
	}
	old4, old6, rerr := d.ct.Rebind(fm[0], fm[1])
	old := []*ebpf.Map{old4, old6}
	if rerr == nil {
		var n4, n6 *ebpf.Map
		n4, n6, rerr = d.ct.NAT().Rebind(fm[2], fm[3])
		old = append(old, n4, n6)
	}
	if rerr != nil {
		closeMaps(fm[:])
		pc.Error = rerr.Error()
		return pc, fmt.Errorf("fluxvm: pressure: %w", rerr)
	}
	closeMaps(old)
	d.flowMaps = fm
	for _, e := range dropped {
		d.haRemoved(e.Key, e.ServiceID, e.Kind)
	}
	pc.Duration = Duration{time.Since(start)}
	if err != nil {
		pc.Error = err.Error()
		return pc, fmt.Errorf("fluxvm: pressure: %w", err)
	}
	return pc, nil
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
