package fluxvm

import (
	"context"
	"fmt"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	flowview "github.com/fluxvm/servicefabric/fluxvm/internal/flows"
)

// newScope makes the flows component (package fluxvm/internal/flows)
// over the loaded maps: flow records, counters, per-VM edge slots.
func (d *Dataplane) newScope() error {
	m := d.dp.Maps()
	s, err := flowview.New(flowview.Config{EdgeSlots: d.caps.Edges}, flowview.Deps{
		SvcStats:      m.FluxvmSvcStats,
		EdgeStats:     m.FluxvmEdgeStats,
		EdgeSlots:     m.FluxvmEdgeSlots,
		Drops:         func() (bpf.Drops, error) { return bpf.ReadDrops(m.FluxvmDrops) },
		Counters:      func() (bpf.Counters, error) { return bpf.ReadCounters(m.FluxvmCounters) },
		Ring:          m.FluxvmSflows,
		Seq:           m.FluxvmFlowSeq,
		InterfaceName: d.namespaceInterfaceName,
	})
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	d.scope = s
	return nil
}

// Stats reads the datapath counters: per service (summed over its
// frontends and CPUs), drops by reason and parser counters. It takes the
// dataplane's lock only to copy the services' ids; the flows component
// reads the maps. After Close it fails with ErrClosed; a ctx that ended
// before the read (or while it waited for the dataplane's lock) fails
// with an error wrapping ctx's.
func (d *Dataplane) Stats(ctx context.Context) (Stats, error) {
	if err := d.begin(ctx, "stats"); err != nil {
		return Stats{}, err
	}
	ids, paced, err := d.statsView(ctx)
	if err != nil {
		return Stats{}, err
	}
	sums, err := d.scope.Sums(ctx, ids)
	if err != nil {
		return Stats{}, fmt.Errorf("fluxvm: %w", err)
	}
	out := Stats{Services: make(map[string]Counters, len(sums.Services)), Drops: sums.Drops, Parser: sums.Parser}
	for name, c := range sums.Services {
		out.Services[name] = c.Counters
		if e, ok := paced[name]; ok {
			e.Bytes, e.HorizonDrops = c.ReplyBytes, c.HorizonDrops
			if out.EDT == nil {
				out.EDT = map[string]ServiceEDTStatus{}
			}
			out.EDT[name] = e
		}
	}
	return out, nil
}

// statsView copies, under the lock, the services' frontend ids by name
// and the paced ones' EDT settings (without their counters).
func (d *Dataplane) statsView(ctx context.Context) (map[string][]uint32, map[string]ServiceEDTStatus, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("stats"); err != nil {
		return nil, nil, err
	}
	if err := ctxErr(ctx, "stats"); err != nil {
		return nil, nil, err
	}
	ids := make(map[string][]uint32, len(d.services))
	var paced map[string]ServiceEDTStatus
	for name, s := range d.services {
		ids[name] = s.ServiceIDs()
		if e := d.edtSettings(s); e != nil {
			if paced == nil {
				paced = map[string]ServiceEDTStatus{}
			}
			paced[name] = *e
		}
	}
	return ids, paced, nil
}

// IsEventCounter reports whether a name in Stats.Parser is a datapath
// event counter (nat_stale, host_routed_packets, host_route_fallbacks,
// snat_retries, dsr_forwarded, snat_conflicts, and any counter added
// later) rather than
// a kind of packet the parser saw (ipv4, tcp, truncated, ...).
func IsEventCounter(name string) bool { return flowview.IsEventCounter(name) }

// VMStats sums the service counters of a VM's edge interfaces: what its
// clients sent to VIPs, what came back, and what was dropped. An unknown
// VM is ErrNotFound; after Close it fails with ErrClosed. A ctx that
// ended before the read fails with an error wrapping ctx's. The lock is
// held only to copy the VM's interfaces; the flows component reads them.
func (d *Dataplane) VMStats(ctx context.Context, vmID string) (VMStats, error) {
	if err := d.begin(ctx, "vm stats"); err != nil {
		return VMStats{}, err
	}
	edges, err := d.vmEdges(ctx, vmID)
	if err != nil {
		return VMStats{}, err
	}
	out, err := d.scope.VMStats(ctx, vmID, edges)
	if err != nil {
		return VMStats{}, fmt.Errorf("fluxvm: %w", err)
	}
	return out, nil
}

// vmEdges copies, under the lock, vmID's attached VM-edge interfaces.
func (d *Dataplane) vmEdges(ctx context.Context, vmID string) ([]flowview.Edge, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("stats of VM " + vmID); err != nil {
		return nil, err
	}
	if err := ctxErr(ctx, "stats of VM "+vmID); err != nil {
		return nil, err
	}
	var edges []flowview.Edge
	for _, ifc := range d.ifaces {
		if ifc.kind == InterfaceVMEdge && ifc.VMID == vmID {
			edges = append(edges, flowview.Edge{Name: ifc.Name, VMID: ifc.VMID, Slot: ifc.slot})
		}
	}
	return edges, nil
}

// registerEdge gives an attached interface its statistics slot (the
// flows component's Register): ifc.problem says why it has none.
func (d *Dataplane) registerEdge(ifc *iface) error {
	slot, problem, err := d.scope.Register(ifc.index)
	if err != nil {
		return err
	}
	ifc.slot = slot
	if problem != "" {
		ifc.problem = problem
	}
	return nil
}

func (d *Dataplane) unregisterEdge(ifc *iface) error {
	return d.scope.Unregister(ifc.index, ifc.slot)
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
