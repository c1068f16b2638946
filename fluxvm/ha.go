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
// the lease epoch this edge holds: what its standby loads with
// ImportFlows. It streams the maps; the service may change meanwhile
// (flows of backends it drops are left out). The snapshot names no
// journal cursor (Header.Journal empty).
func (d *Dataplane) ExportFlows(ctx context.Context, service string, epoch ha.Epoch, w io.Writer) (ha.ExportResult, error) {
	v, err := d.haView("export flows of", service)
	if err != nil {
		return ha.ExportResult{}, err
	}
	src := ha.Source{CT: d.ct, ServiceIDs: v.sids, Backend: func(id uint32) (netip.AddrPort, bool) {
		ap, ok := v.byID[id]
		return ap, ok
	}}
	res, err := ha.Export(ctx, w, ha.Header{Node: d.opts.NodeName, Service: service, Epoch: epoch}, src)
	if err != nil {
		return res, fmt.Errorf("fluxvm: %w", err)
	}
	return res, nil
}

// ImportFlows applies a snapshot of service's flows from its peer (an
// ExportFlows stream) to this node: each flow whose frontend and backend
// the service has here, under this node's ids (an SNAT flow only when its
// source is one of this node's SNAT addresses), unless the node has seen
// the flow more recently; with prune, also deleting the service's
// north-south flows the snapshot lacks (the snapshot-diff). accept, when
// set, judges the snapshot's header first (its lease epoch).
func (d *Dataplane) ImportFlows(ctx context.Context, service string, r io.Reader, prune bool, accept func(ha.Header) error) (ha.ImportResult, error) {
	v, err := d.haView("import flows of", service)
	if err != nil {
		return ha.ImportResult{}, err
	}
	cfg := d.opts.settings()
	var snat []netip.Addr
	for _, a := range []netip.Addr{cfg.SNATAddressFor(false), cfg.SNATAddressFor(true)} {
		if a.IsValid() {
			snat = append(snat, a.Unmap())
		}
	}
	t := ha.Target{CT: d.ct, Service: service, Accept: accept, Prune: prune, ServiceIDs: v.sids, SNATAddrs: snat,
		Frontend: func(vip netip.AddrPort, proto uint8) (uint32, bool) {
			sid, ok := v.frontend[feKey{vip: vip.Addr().Unmap(), port: vip.Port(), proto: proto}]
			return sid, ok
		},
		BackendID: func(sid uint32, addr netip.AddrPort) (uint32, bool) {
			id, ok := v.backends[sid][netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port())]
			return id, ok
		}}
	res, err := ha.Import(ctx, r, t)
	if err != nil {
		return res, fmt.Errorf("fluxvm: %w", err)
	}
	return res, nil
}
