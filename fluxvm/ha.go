package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"

	"github.com/fluxvm/servicefabric/fluxvm/internal/hasync"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
	"github.com/fluxvm/servicefabric/ha"
)

// haView is what an export or import needs of one service, copied under
// d.mu so that the long stream runs without it: its frontends' datapath
// ids, and its backends' ids by address per frontend.
type haView struct {
	sids     []uint32
	frontend map[services.Key]uint32
	backends map[uint32]map[netip.AddrPort]uint32
	byID     map[uint32]netip.AddrPort
}

func (d *Dataplane) haView(what, service string) (haView, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen(what); err != nil {
		return haView{}, err
	}
	s := d.services[service]
	if s == nil {
		return haView{}, fmt.Errorf("fluxvm: %s %q: no such service: %w", what, service, ErrNotFound)
	}
	v := haView{frontend: map[services.Key]uint32{}, backends: map[uint32]map[netip.AddrPort]uint32{}, byID: map[uint32]netip.AddrPort{}}
	for _, fe := range s.Frontends {
		if !fe.Live() {
			continue
		}
		v.sids = append(v.sids, fe.ID())
		v.frontend[fe.Key()] = fe.ID()
		bs := make(map[netip.AddrPort]uint32, fe.BackendCount())
		for ap, id := range fe.Backends() {
			bs[ap] = id
			v.byID[id] = ap
		}
		v.backends[fe.ID()] = bs
	}
	if len(v.sids) == 0 {
		return haView{}, fmt.Errorf("fluxvm: %s %q: the service has no frontend programmed: %w", what, service, ErrNotFound)
	}
	return v, nil
}

// ExportFlows writes a snapshot of service's flows (package ha: its
// conntrack entries and their reverse halves, by identity) to w, streaming
// the maps; the service may change meanwhile (flows of backends it drops
// are left out). Its only prerequisite is the north-south edge
// (NorthSouth.Interfaces, or AddNorthSouthInterface; else an error
// wrapping ErrPrerequisite that names north_south_interfaces): a planned
// move of a service's flows to another node (ExportFlows there,
// ImportFlows on the other, with prune) needs no replication.
//
// With replication on (HAOptions.Epoch), the snapshot carries this edge's
// lease epoch and its journal's checkpoint, taken before the scan: what a
// standby loads with ImportFlows before it continues with FlowDelta, the
// batches after the checkpoint holding what changed during the export. A
// superseded edge exports nothing (ha.ErrFenced). With replication off
// the edge holds no lease and keeps no journal: the header's epoch is 0,
// its journal empty and its seq 0, which an edge holding a lease refuses
// (ha.ErrStaleEpoch) and an edge without one applies.
func (d *Dataplane) ExportFlows(ctx context.Context, service string, w io.Writer) (ha.ExportResult, error) {
	if err := d.opened("export flows"); err != nil {
		return ha.ExportResult{}, err
	}
	if err := d.needNorthSouth("export flows of " + service); err != nil {
		return ha.ExportResult{}, err
	}
	var j *ha.Journal
	if d.ha != nil {
		var err error
		if j, err = d.sourceJournal(ctx, "export flows of", service); err != nil {
			return ha.ExportResult{}, err
		}
	}
	ctx, done, err := d.haBegin(ctx, "export flows of "+service)
	if err != nil {
		return ha.ExportResult{}, err
	}
	defer done()
	v, err := d.haView("export flows of", service)
	if err != nil {
		return ha.ExportResult{}, err
	}
	seeds := d.seeds()
	hdr := ha.Header{Node: d.opts.NodeName, Service: service, Seeds: &seeds}
	if j != nil {
		// The checkpoint before the scan: every flow learned after it is
		// in a later batch, every flow before it in the maps the scan
		// reads.
		cur, err := j.Checkpoint()
		if err != nil {
			return ha.ExportResult{}, fmt.Errorf("fluxvm: export flows of %s: %w", service, err)
		}
		hdr.Epoch, hdr.Journal, hdr.Seq = cur.Epoch, cur.Journal, cur.Seq
	}
	src := ha.Source{CT: d.ct, ServiceIDs: v.sids, Backend: func(id uint32) (netip.AddrPort, bool) {
		ap, ok := v.byID[id]
		return ap, ok
	}}
	res, err := ha.Export(ctx, w, hdr, src)
	if err != nil {
		return res, fmt.Errorf("fluxvm: %w", err)
	}
	return res, nil
}

// ImportFlows applies a snapshot of service's flows from another node (an
// ExportFlows stream) to this edge: each flow whose frontend and backend
// the service has here, under this node's ids (an SNAT flow only when its
// source is one of this node's SNAT addresses), unless the node has seen
// the flow more recently; with prune, also deleting the service's
// north-south flows the snapshot lacks (the snapshot-diff). Like
// ExportFlows it needs the north-south edge, not replication.
//
// Fencing holds whenever this edge holds a lease (replication on): a
// snapshot of an epoch older than the newest this edge accepted, or than
// its own lease, is refused before any flow is applied (ha.ErrStaleEpoch),
// and so is one of a source without a lease (epoch 0); once the whole
// snapshot is applied, this edge's cursor moves to the snapshot's
// checkpoint, and FlowDelta after it continues. An edge without a lease
// takes a snapshot of any epoch, and keeps neither its epoch nor its
// cursor (it has no journal to continue).
//
// Whatever the lease, a snapshot written by an edge of other seeds
// (hash_seed, maglev_seed: Status.Seeds) is refused before anything is
// judged or applied, with an error wrapping ha.ErrSeeds that names both
// edges' seeds: the two would send the same new flow to different
// backends. A snapshot of format 1 (an edge before the header carried
// seeds) is taken unchecked, as before (docs/upgrading.md).
func (d *Dataplane) ImportFlows(ctx context.Context, service string, r io.Reader, prune bool) (ha.ImportResult, error) {
	if err := d.opened("import flows"); err != nil {
		return ha.ImportResult{}, err
	}
	if err := d.needNorthSouth("import flows of " + service); err != nil {
		return ha.ImportResult{}, err
	}
	if prune && d.opts.HA.Group {
		return ha.ImportResult{}, fmt.Errorf("fluxvm: %w", verr(ErrInvalid, "prune",
			"import flows of %s: in a group (ha_group) a snapshot-diff would delete the flows of the other edges: import without prune", service))
	}
	h := d.ha
	ctx, done, err := d.haBegin(ctx, "import flows of "+service)
	if err != nil {
		return ha.ImportResult{}, err
	}
	// Writes into the flow maps: not while a compaction replaces them.
	d.flowMu.RLock()
	defer d.flowMu.RUnlock()
	defer done()
	t, err := d.haTarget("import flows of", service, prune)
	if err != nil {
		return ha.ImportResult{}, err
	}
	if h == nil {
		// No lease fences this edge, and no cursor follows the import;
		// one snapshot at a time, so that a snapshot-diff never deletes
		// what another import is writing.
		d.importMu.Lock()
		defer d.importMu.Unlock()
		res, err := ha.Import(ctx, r, t)
		if err != nil {
			return res, fmt.Errorf("fluxvm: %w", err)
		}
		return res, nil
	}
	res, err := h.ImportSnapshot(ctx, service, func(ctx context.Context, accept func(ha.Header) error) (ha.ImportResult, error) {
		t.Accept = accept
		return ha.Import(ctx, r, t)
	})
	if errors.Is(err, hasync.ErrCursorStays) {
		return res, fmt.Errorf("fluxvm: import flows of %s: %w", service, err)
	}
	if err != nil {
		return res, fmt.Errorf("fluxvm: %w", err)
	}
	return res, nil
}

// seeds are this edge's hash_seed and maglev_seed, as a snapshot carries
// them (the values Status.Seeds reports).
func (d *Dataplane) seeds() ha.Seeds {
	return ha.Seeds{FlowHash: d.opts.Loader.HashSeed, Maglev: d.opts.MaglevSeed}
}

// needNorthSouth fails, wrapping ErrPrerequisite, when the dataplane has
// no north-south edge: what flow snapshots need.
func (d *Dataplane) needNorthSouth(what string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen(what); err != nil {
		return err
	}
	if len(d.opts.NorthSouth.Interfaces) == 0 {
		return fmt.Errorf("fluxvm: %w", verr(ErrPrerequisite, "north_south_interfaces",
			"%s: snapshots of a service's flows need the north-south edge: set north_south_interfaces", what))
	}
	return nil
}

// haTarget is service on this edge as an import's target.
func (d *Dataplane) haTarget(what, service string, prune bool) (ha.Target, error) {
	v, err := d.haView(what, service)
	if err != nil {
		return ha.Target{}, err
	}
	cfg := d.opts.settings()
	// The node's own SNAT addresses and its group's (SetSNATPeers).
	snat := d.snatPeerAddrs()
	for _, a := range []netip.Addr{cfg.SNATAddressFor(false), cfg.SNATAddressFor(true)} {
		if a.IsValid() {
			snat = append(snat, a.Unmap())
		}
	}
	seeds := d.seeds()
	return ha.Target{CT: d.ct, Service: service, Prune: prune, ServiceIDs: v.sids, SNATAddrs: snat, Seeds: &seeds,
		Frontend: func(vip netip.AddrPort, proto uint8) (uint32, bool) {
			sid, ok := v.frontend[services.Key{VIP: vip.Addr().Unmap(), Port: vip.Port(), Proto: proto}]
			return sid, ok
		},
		BackendID: func(sid uint32, addr netip.AddrPort) (uint32, bool) {
			id, ok := v.backends[sid][netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port())]
			return id, ok
		}}, nil
}
