package fluxvm

import (
	"slices"
	"sort"

	"github.com/fluxvm/servicefabric/bpf"
)

// Status describes the dataplane. It answers after Close too (see
// Close), without Memory: that is the one part read from the kernel (see
// MemoryStatus). Memory costs 1–2 ms at 4,000 Maglev tables; the
// first call after Open, which reads every table once, about 40 µs per
// table (bpf.Datapath.MapMemory caches what cannot change).
func (d *Dataplane) Status() Status {
	if d.unopened() {
		return Status{}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	st := d.dp.Status()
	out := Status{
		SchemaVersion: st.SchemaVersion, Generation: st.Generation, Tier: st.Tier.String(), PinRoot: st.PinRoot,
		Capacities: Capacities(st.Capacities),
		Load: LoadStatus{
			Created: st.Created, SchemaRebuilt: st.SchemaRebuilt, PreviousSchema: st.PreviousSchema,
			Reloaded: st.Reloaded, PreviousGeneration: st.PreviousGeneration, TierChanged: st.TierChanged,
			Migrated: st.Migrated, NotMigrated: st.NotMigrated, Migrations: slices.Clone(st.Migrations),
			HashSeedChanged: st.HashSeedChanged, Features: st.Features.Names(),
		},
		Seeds:         SeedStatus{FlowHash: st.HashSeed, Maglev: d.opts.MaglevSeed},
		Services:      len(d.services),
		SNAT:          d.snatStatus(),
		XDPRouteCache: d.routes.Status(),
		FrontendIndex: d.dp.FrontendIndexStats(),
		Programmed:    d.prog.Status(),
		LastGC:        d.lastGC,
		SocketLB:      d.sock.Status(),
		// Advertiser.Status takes only the advertiser's own lock.
		Advertisements: d.adv.Status(),
	}
	if st.TierChanged {
		out.Load.PreviousTier = st.PreviousTier.String()
	}
	if st.HashSeedChanged {
		prev := st.PreviousHashSeed
		out.Load.PreviousHashSeed = &prev
	}
	for _, ifc := range d.ifaces {
		out.Interfaces = append(out.Interfaces, ifc.status())
	}
	sort.Slice(out.Interfaces, func(i, j int) bool { return out.Interfaces[i].Name < out.Interfaces[j].Name })
	if !d.closed {
		out.Memory = d.memoryStatus()
		if p, err := d.pressureStatus(); err == nil || p.Error != "" {
			out.Pressure = &p
		}
		out.MapSizes = d.mapSizesStatus(out.Pressure)
	}
	out.EDT = d.edtStatus()
	out.HA = d.HA().Status()
	return out
}

// memoryStatus reads the kernel memory of the maps. d.mu must be held,
// so that Close cannot release the maps meanwhile.
func (d *Dataplane) memoryStatus() *MemoryStatus {
	mm, err := d.dp.MapMemory()
	if err != nil {
		return &MemoryStatus{Error: err.Error()}
	}
	return &MemoryStatus{
		Maps: mm.Maps,
		MaglevInner: InnerMapsMemory{
			Count: mm.MaglevInner.Count, Bytes: mm.MaglevInner.Bytes, LargestBytes: mm.MaglevInner.LargestBytes,
		},
		Total: mm.Total,
	}
}

// snatStatus describes what writeSNAT put in fluxvm_snat.
func (d *Dataplane) snatStatus() SNATStatus {
	st := SNATStatus{PortMin: d.snat.PortMin, PortMax: d.snat.PortMax}
	for _, p := range d.snatPeers {
		st.Peers = append(st.Peers, p.Addr)
		if p.Announce {
			st.Announced = append(st.Announced, p.Addr)
		}
	}
	if d.snat.Flags&bpf.SNATFlagV4 != 0 {
		st.Address4 = bpf.Addr([4]uint32{d.snat.Addr4}, bpf.FamilyIPv4)
	}
	if d.snat.Flags&bpf.SNATFlagV6 != 0 {
		st.Address6 = bpf.Addr(d.snat.Addr6, bpf.FamilyIPv6)
	}
	return st
}
