package fluxvm

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
	"github.com/fluxvm/servicefabric/intent"
)

// restoreOpenMeta puts back into m the fields Open writes from its
// options (timeouts, flow sample rate, the HA flag) as prev had them.
func restoreOpenMeta(m *bpf.Meta, prev bpf.Meta) {
	m.TimeoutTcpSynS, m.TimeoutTcpEstablishedS, m.TimeoutTcpFinS = prev.TimeoutTcpSynS, prev.TimeoutTcpEstablishedS, prev.TimeoutTcpFinS
	m.TimeoutTcpRstS, m.TimeoutUdpS = prev.TimeoutTcpRstS, prev.TimeoutUdpS
	m.FlowSampleRate = prev.FlowSampleRate
	m.Flags = m.Flags&^bpf.MetaFlagHA | prev.Flags&bpf.MetaFlagHA
}

// writeSNAT writes the SNAT addresses and port range of the configuration
// to fluxvm_snat. Without an address of a family, new north-south NAT
// flows of that family drop (snat_failed); validation keeps services that
// would need one out.
func (d *Dataplane) writeSNAT() error {
	cfg := d.opts.settings()
	v := cfg.SNATConfig()
	if len(d.snatPeers) > 0 {
		v.Flags |= bpf.SNATFlagPeers
		v.PeerFilter = peerFilter(d.snatPeers)
	}
	if err := d.dp.Maps().FluxvmSnat.Put(uint32(0), v); err != nil {
		return fmt.Errorf("snat config: %w", err)
	}
	d.snat = v
	d.log.Info("fluxvm: SNAT configured", "address_v4", cfg.SNATAddressFor(false), "address_v6", cfg.SNATAddressFor(true),
		"port_min", v.PortMin, "port_max", v.PortMax)
	return nil
}

// restore re-applies the catalog (the snapshot and its journal, package
// fluxvm/internal/catalog) with the ids it recorded. After a plain
// restart every write repeats what the adopted maps already hold; after
// a generation reload or tier change it reprograms the recreated maps. A
// journal that held changes is then compacted into the snapshot, and the
// store starts compacting in the background.
//
// A service whose name has become reserved since it was applied (the
// catalog of an older version, or edited by hand) is restored with a
// warning rather than refused: refusing would stop the node from starting
// while the datapath keeps forwarding for the service. It keeps serving,
// is listed, and can be deleted (DeleteService; REST DELETE
// /v1/network/services/{name}), but not read by name over REST nor
// applied again under that name: delete it and apply it again under
// another name.
func (d *Dataplane) restore() (err error) {
	_, span := d.startSpan(context.Background(), SpanRestore)
	defer endSpan(span, &err)
	d.index = intent.NewCatalogIndex()
	d.busy = map[string]int{}
	d.reserved = map[string]Service{}
	if d.opts.CatalogPath == "" {
		return nil
	}
	st, err := d.openCatalog()
	if err != nil {
		return err
	}
	cat, dirty, err := st.Load()
	if err != nil {
		return err
	}
	var intents []Service
	for _, cs := range cat.Services {
		intents = append(intents, cs.Service)
		if IsReservedName(cs.Service.Name) {
			if d.legacyNames == nil {
				d.legacyNames = map[string]bool{}
			}
			d.legacyNames[cs.Service.Name] = true
			d.log.Warn("fluxvm: restored a service whose name is reserved for the REST API; it keeps serving but cannot be read by name over REST or applied again: delete it and apply it again under another name",
				"service", cs.Service.Name, "catalog", d.opts.CatalogPath, "reserved", ReservedNames())
		}
	}
	if err := intent.ValidateRestoredCatalog(intents, d.opts.settings().Node(), d.limits, d.legacyNames); err != nil {
		return fmt.Errorf("fluxvm: restore catalog %s: %w", d.opts.CatalogPath, err)
	}
	for _, cs := range cat.Services {
		s := &service{Intent: cs.Service, Revision: cs.Revision, Applied: cs.AppliedAt, Footprint: intent.FootprintOf(&cs.Service)}
		for _, cf := range cs.Frontends {
			backends := make(map[netip.AddrPort]uint32, len(cf.Backends))
			for _, cb := range cf.Backends {
				backends[cb.Endpoint] = cb.BackendID
			}
			if err := d.prog.Adopt(s, services.Key{VIP: cf.VIP, Port: cf.Port, Proto: cf.Protocol.Number()}, cf.ServiceID, backends); err != nil {
				return fmt.Errorf("fluxvm: restore catalog: %w", err)
			}
		}
		d.services[cs.Service.Name] = s
		d.index.Add(cs.Service.Name, &s.Footprint)
		if cs.Revision > d.revision {
			d.revision = cs.Revision
		}
	}
	// Identity policies first: each frontend attaches its service's
	// policy before its flag goes in (readyFrontend).
	if err := d.pol.Restore(cat.Policies); err != nil {
		return fmt.Errorf("fluxvm: restore identity policies: %w", err)
	}
	for _, cs := range cat.Services {
		if err := d.prog.Program(cs.Service, d.services[cs.Service.Name]); err != nil {
			return fmt.Errorf("fluxvm: restore %s: %w", cs.Service.Name, err)
		}
	}
	// What a previous process left in the policy maps and nothing uses
	// now goes (after a plain restart the maps were kept).
	if err := d.pol.Write(); err != nil {
		return fmt.Errorf("fluxvm: restore identity policies: %w", err)
	}
	d.store = st
	if dirty {
		if err := st.Compact(); err != nil {
			return fmt.Errorf("fluxvm: restore catalog: %w", err)
		}
	}
	st.Start()
	span.SetAttributes(AttrServices.Int(len(cat.Services)))
	d.log.Info("fluxvm: catalog restored", "services", len(cat.Services), "journal_seq", cat.Seq)
	return nil
}
