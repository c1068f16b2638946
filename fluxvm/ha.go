package fluxvm

import (
	"context"
	"fmt"
	"io"
	"net/netip"

	"github.com/fluxvm/servicefabric/ha"
)

// haView is what an export or import needs of one service, copied under
// d.mu so that the long stream runs without it: its frontends' datapath
// ids, and its backends' ids by address per frontend.
type haView struct {
	sids     []uint32
	frontend map[feKey]uint32
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
	v := haView{frontend: map[feKey]uint32{}, backends: map[uint32]map[netip.AddrPort]uint32{}, byID: map[uint32]netip.AddrPort{}}
	for _, fe := range s.frontends {
		if !fe.live {
			continue
		}
		v.sids = append(v.sids, fe.sid)
		v.frontend[fe.key] = fe.sid
		bs := make(map[netip.AddrPort]uint32, len(fe.backends))
		for ap, id := range fe.backends {
			bs[ap] = id
			v.byID[id] = ap
		}
		v.backends[fe.sid] = bs
	}
	if len(v.sids) == 0 {
		return haView{}, fmt.Errorf("fluxvm: %s %q: the service has no frontend programmed: %w", what, service, ErrNotFound)
	}
	return v, nil
}

// ExportFlows writes a snapshot of service's flows (package ha: its
// conntrack entries and their reverse halves, by identity) to w, under
// this edge's lease epoch and with its journal's checkpoint: what a
// standby loads with ImportFlows before it continues with FlowDelta. It
// streams the maps; the service may change meanwhile (flows of backends
// it drops are left out), and what changes during the export is in the
// batches after the checkpoint. A superseded edge exports nothing
// (ha.ErrFenced).
func (d *Dataplane) ExportFlows(ctx context.Context, service string, w io.Writer) (ha.ExportResult, error) {
	if err := d.opened("export flows"); err != nil {
		return ha.ExportResult{}, err
	}
	_, j, err := d.sourceJournal("export flows of", service)
	if err != nil {
		return ha.ExportResult{}, err
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
	// The checkpoint before the scan: every flow learned after it is in a
	// later batch, every flow before it in the maps the scan reads.
	cur, err := j.Checkpoint()
	if err != nil {
		return ha.ExportResult{}, fmt.Errorf("fluxvm: export flows of %s: %w", service, err)
	}
	src := ha.Source{CT: d.ct, ServiceIDs: v.sids, Backend: func(id uint32) (netip.AddrPort, bool) {
		ap, ok := v.byID[id]
		return ap, ok
	}}
	hdr := ha.Header{Node: d.opts.NodeName, Service: service, Epoch: cur.Epoch, Journal: cur.Journal, Seq: cur.Seq}
	res, err := ha.Export(ctx, w, hdr, src)
	if err != nil {
		return res, fmt.Errorf("fluxvm: %w", err)
	}
	return res, nil
}

// ImportFlows applies a snapshot of service's flows from its peer (an
// ExportFlows stream) to this edge: each flow whose frontend and backend
// the service has here, under this node's ids (an SNAT flow only when its
// source is one of this node's SNAT addresses), unless the node has seen
// the flow more recently; with prune, also deleting the service's
// north-south flows the snapshot lacks (the snapshot-diff). A snapshot of
// an epoch older than the newest this edge accepted, or than its own
// lease, is refused before any flow is applied (ha.ErrStaleEpoch). Once
// the whole snapshot is applied, this edge's cursor moves to the
// snapshot's checkpoint: FlowDelta after it continues.
func (d *Dataplane) ImportFlows(ctx context.Context, service string, r io.Reader, prune bool) (ha.ImportResult, error) {
	if err := d.opened("import flows"); err != nil {
		return ha.ImportResult{}, err
	}
	h, err := d.haOn("import flows of " + service)
	if err != nil {
		return ha.ImportResult{}, err
	}
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
	ctx, end := h.beginImport(ctx)
	defer end()
	t.Accept = func(hd ha.Header) error {
		h.mu.Lock()
		floor := h.floor(service)
		h.mu.Unlock()
		if hd.Epoch < floor {
			return fmt.Errorf("snapshot of epoch %d, this edge accepted %d: %w", hd.Epoch, floor, ha.ErrStaleEpoch)
		}
		return nil
	}
	res, err := ha.Import(ctx, r, t)
	if err != nil {
		return res, fmt.Errorf("fluxvm: %w", err)
	}
	if res.Header.Journal != "" {
		h.mu.Lock()
		c := h.cursors[service]
		err := c.Reset(res.Header.Journal, res.Header.Seq, res.Header.Epoch)
		h.mu.Unlock()
		if err == nil {
			err = d.setCursor(service, c)
		}
		if err != nil {
			return res, fmt.Errorf("fluxvm: import flows of %s: applied, but the cursor stays: %w", service, err)
		}
	}
	return res, nil
}

// haTarget is service on this edge as an import's target.
func (d *Dataplane) haTarget(what, service string, prune bool) (ha.Target, error) {
	v, err := d.haView(what, service)
	if err != nil {
		return ha.Target{}, err
	}
	cfg := d.opts.settings()
	var snat []netip.Addr
	for _, a := range []netip.Addr{cfg.SNATAddressFor(false), cfg.SNATAddressFor(true)} {
		if a.IsValid() {
			snat = append(snat, a.Unmap())
		}
	}
	return ha.Target{CT: d.ct, Service: service, Prune: prune, ServiceIDs: v.sids, SNATAddrs: snat,
		Frontend: func(vip netip.AddrPort, proto uint8) (uint32, bool) {
			sid, ok := v.frontend[feKey{vip: vip.Addr().Unmap(), port: vip.Port(), proto: proto}]
			return sid, ok
		},
		BackendID: func(sid uint32, addr netip.AddrPort) (uint32, bool) {
			id, ok := v.backends[sid][netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port())]
			return id, ok
		}}, nil
}
