package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"github.com/fluxvm/servicefabric/conntrack"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
)

// Stats reads the datapath counters: per service (summed over its
// frontends and CPUs), drops by reason and parser counters. After Close
// it fails with ErrClosed; a ctx that ended before the read (or while it
// waited for the dataplane's lock) fails with an error wrapping ctx's.
func (d *Dataplane) Stats(ctx context.Context) (Stats, error) {
	if err := d.begin(ctx, "stats"); err != nil {
		return Stats{}, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("stats"); err != nil {
		return Stats{}, err
	}
	if err := ctxErr(ctx, "stats"); err != nil {
		return Stats{}, err
	}
	out := Stats{Services: map[string]Counters{}, Drops: map[string]uint64{}, Parser: map[string]uint64{}}
	m := d.dp.Maps().FluxvmSvcStats
	for name, s := range d.services {
		var c Counters
		for _, fe := range s.frontends {
			fc, err := readStats(m, fe.sid)
			if err != nil {
				return Stats{}, fmt.Errorf("fluxvm: stats of %s: %w", name, err)
			}
			c.add(fc)
		}
		out.Services[name] = c
		if e := d.serviceEDT(s); e != nil {
			if out.EDT == nil {
				out.EDT = map[string]ServiceEDTStatus{}
			}
			out.EDT[name] = *e
		}
	}
	drops, err := bpf.ReadDrops(d.dp.Maps().FluxvmDrops)
	if err != nil {
		return Stats{}, fmt.Errorf("fluxvm: stats: %w", err)
	}
	for r := 1; r < bpf.NumDropReasons; r++ {
		out.Drops[bpf.DropReason(r).String()] = drops[r]
	}
	parser, err := bpf.ReadCounters(d.dp.Maps().FluxvmCounters)
	if err != nil {
		return Stats{}, fmt.Errorf("fluxvm: stats: %w", err)
	}
	for c := range bpf.NumCounters {
		out.Parser[bpf.Counter(c).String()] = parser[c]
	}
	return out, nil
}

// IsEventCounter reports whether a name in Stats.Parser is a datapath
// event counter (nat_stale, host_routed_packets, host_route_fallbacks,
// snat_retries, dsr_forwarded, snat_conflicts, and any counter added
// later) rather than
// a kind of packet the parser saw (ipv4, tcp, truncated, ...).
func IsEventCounter(name string) bool {
	for c := range bpf.NumCounters {
		if bpf.Counter(c).String() == name {
			return bpf.Counter(c) > bpf.CounterParseLimit
		}
	}
	return true
}

// VMStats sums the service counters of a VM's edge interfaces: what its
// clients sent to VIPs, what came back, and what was dropped. An unknown
// VM is ErrNotFound; after Close it fails with ErrClosed. A ctx that
// ended before the read fails with an error wrapping ctx's.
func (d *Dataplane) VMStats(ctx context.Context, vmID string) (VMStats, error) {
	if err := d.begin(ctx, "vm stats"); err != nil {
		return VMStats{}, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("stats of VM " + vmID); err != nil {
		return VMStats{}, err
	}
	if err := ctxErr(ctx, "stats of VM "+vmID); err != nil {
		return VMStats{}, err
	}
	out := VMStats{VMID: vmID}
	found := false
	for _, ifc := range d.ifaces {
		if ifc.kind != InterfaceVMEdge || ifc.VMID != vmID {
			continue
		}
		found = true
		out.Interfaces = append(out.Interfaces, ifc.Name)
		if ifc.slot == 0 {
			continue
		}
		c, err := readStats(d.dp.Maps().FluxvmEdgeStats, ifc.slot)
		if err != nil {
			return VMStats{}, fmt.Errorf("fluxvm: stats of VM %s: %w", vmID, err)
		}
		out.Counters.add(c)
	}
	if !found {
		return VMStats{}, fmt.Errorf("fluxvm: VM %s: %w", vmID, ErrNotFound)
	}
	return out, nil
}

func (c *Counters) add(o Counters) {
	c.Packets += o.Packets
	c.Bytes += o.Bytes
	c.ReplyPackets += o.ReplyPackets
	c.ReplyBytes += o.ReplyBytes
	c.NewFlows += o.NewFlows
	c.Failovers += o.Failovers
	c.Drops += o.Drops
}

// readStats sums one per-CPU fluxvm_svc_stats_value slot.
func readStats(m *ebpf.Map, slot uint32) (Counters, error) {
	var per []bpf.ServiceStats
	if err := m.Lookup(slot, &per); err != nil {
		return Counters{}, err
	}
	var c Counters
	for _, p := range per {
		c.add(Counters{p.Packets, p.Bytes, p.ReplyPackets, p.ReplyBytes, p.NewFlows, p.Failovers, p.Drops})
	}
	return c, nil
}

// registerEdge gives an attached interface its statistics slot. Two
// interfaces whose ifindexes agree in the low 16 bits cannot both be
// counted; the second one reports the problem instead.
func (d *Dataplane) registerEdge(ifc *iface) error {
	key := uint32(ifc.index) & bpf.EdgeSlotMask
	var cur bpf.EdgeSlot
	if err := d.dp.Maps().FluxvmEdgeSlots.Lookup(key, &cur); err != nil {
		return err
	}
	if cur.Slot != 0 && cur.Ifindex != uint32(ifc.index) {
		ifc.problem = fmt.Sprintf("no per-VM statistics: ifindex %d shares its statistics key with ifindex %d", ifc.index, cur.Ifindex)
		return nil
	}
	if cur.Slot != 0 {
		ifc.slot = cur.Slot // adopted after a restart
		d.edges.reserve(cur.Slot)
		return nil
	}
	if ifc.slot = d.edges.get(); ifc.slot == 0 {
		ifc.problem = "no per-VM statistics: every statistics slot of the tier is in use"
		return nil
	}
	zero := make([]bpf.ServiceStats, ebpf.MustPossibleCPU())
	if err := d.dp.Maps().FluxvmEdgeStats.Put(ifc.slot, zero); err != nil {
		return err
	}
	return d.dp.Maps().FluxvmEdgeSlots.Put(key, bpf.EdgeSlot{Ifindex: uint32(ifc.index), Slot: ifc.slot})
}

func (d *Dataplane) unregisterEdge(ifc *iface) error {
	if ifc.slot == 0 {
		return nil
	}
	key := uint32(ifc.index) & bpf.EdgeSlotMask
	if err := d.dp.Maps().FluxvmEdgeSlots.Put(key, bpf.EdgeSlot{}); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	d.edges.release(ifc.slot)
	d.edges.releaseQuarantined()
	return nil
}

// Conntrack returns the typed view of the flow maps (fluxvm_fct4/6, with
// their reverse-NAT halves through Conntrack().NAT()): to list, look up or
// delete flows. It is valid until Close; the dataplane's own GC runs on the
// same view (conntrack.Map.GC runs one at a time).
func (d *Dataplane) Conntrack() (*conntrack.Map, error) {
	if err := d.opened("conntrack"); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("conntrack"); err != nil {
		return nil, err
	}
	return d.ct, nil
}
