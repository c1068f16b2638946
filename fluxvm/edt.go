package fluxvm

import (
	"fmt"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
)

// ErrNoFQ is returned (wrapped) by Open when edt_manage_fq cannot install
// fq because the kernel has no fq qdisc (rtnetlink answers ENOENT: an
// unknown qdisc kind), unless edt_horizon_fallback is set: the interface
// then runs in horizon-policing mode, and Status.EDT says why. Any other
// failure to install fq fails Open, fallback or not.
var ErrNoFQ = edt.ErrNoFQ

// EDT modes of an interface, as EDTInterfaceStatus.Mode reports them
// (package edt: ModeFQ, ModeHorizonPolicing).
const (
	EDTModeFQ              = edt.ModeFQ
	EDTModeHorizonPolicing = edt.ModeHorizonPolicing
)

// EDT pacing, the control plane's side (the datapath's is bpf/lib/edt.h):
// the node's part (fq, the node entry, the interfaces' modes) is the
// component fluxvm/internal/edt (d.pacing); what follows is each
// frontend's entry, which the services' programming writes.
//
// A service with max_egress_mbps has, for each of its frontends (each has
// a service id of its own, and fluxvm_edt is indexed by service id), a
// fluxvm_edt entry with its rate in bytes per second and the node's
// horizon, and SvcFlagPaced in the frontend entry, which fluxvm_ns_out
// needs to find north-south replies by their source. The entry is written
// before the flag is set, and the flag cleared before the entry is
// zeroed, so that a packet that finds the flag always finds the rate. The
// node's entry (bpf.EDTNodeKey) counts the paced north-south services:
// fluxvm_ns_out looks sources up only while it is not zero.
//
// The cap holds for the service as a whole: its frontends' entries name
// one pacer, the service's frontend with the lowest id, whose departure
// clock they all advance (commit). A change that removes the pacer
// frontend repoints the others first. The clocks survive every change
// but one of rate or horizon: a new pacer starts from the old one's
// (pacerClock), and a restart onto kept maps rewrites nothing (putEDT).

// edtValueOf is the fluxvm_edt entry of each frontend of svc: the zero
// value when svc is not paced (edt.Pacing.ValueOf).
func (d *Dataplane) edtValueOf(svc *Service) (bpf.EDTValue, error) {
	return d.pacing.ValueOf(svc.MaxEgressMbps)
}

// putEDT writes fe's fluxvm_edt entry, unless it holds v already (a
// rewrite would reset the departure clock). v.LastDeparture is the clock
// the entry is written with (commit passes the old pacer's to a new
// pacer: pacerClock); the other fields are compared and remembered
// without it.
//
// The departure clock, as written:
//   - a rate or horizon change (or pacing turned on or off) starts it
//     empty: the next packet goes at once, then the new rate holds;
//   - a change of the pacer alone keeps it: the entry's own clock, or
//     the one passed in (the old pacer's), whichever is later;
//   - at Open (fe's entry not known yet: the maps may be an earlier
//     start's, kept) the entry is read first, and one that holds v
//     already is not rewritten, so a restart keeps every clock.
func (d *Dataplane) putEDT(fe *frontend, v bpf.EDTValue) error {
	m := d.dp.Maps().FluxvmEdt
	clock := v.LastDeparture
	v.LastDeparture = 0
	if !fe.edtKnown {
		var cur bpf.EDTValue
		if err := m.Lookup(fe.sid, &cur); err == nil {
			cur.LastDeparture = 0
			fe.edt, fe.edtKnown = cur, true
		}
	}
	if fe.edtKnown && fe.edt == v {
		return nil
	}
	if fe.edtKnown && v.Rate != 0 && edt.SameRate(fe.edt, v) {
		var cur bpf.EDTValue
		if err := m.Lookup(fe.sid, &cur); err == nil {
			clock = max(clock, cur.LastDeparture)
		}
	}
	w := v
	w.LastDeparture = clock
	if err := m.Put(fe.sid, w); err != nil {
		return fmt.Errorf("edt entry: %w", err)
	}
	fe.edt, fe.edtKnown = v, true
	return nil
}

// pacerClock is the departure clock a change hands on to the service's
// new pacer: when the pacer changes (its frontend removed, or a frontend
// with a lower id added) and the rate and horizon stay, the new pacer's
// entry starts from the old pacer's clock, read now (what the datapath
// adds to it between this read and the write is lost: at most the
// packets of that moment go early). Otherwise 0: no clock to hand on.
// d.mu must be held.
func (d *Dataplane) pacerClock(svc Service, p *plan, pacer uint32) uint64 {
	want, err := d.edtValueOf(&svc)
	if err != nil || want.Rate == 0 {
		return 0
	}
	var old *frontend
	for _, pl := range p.frontends {
		if pl.fe.edtKnown && pl.fe.edt.Rate != 0 {
			old = pl.fe
			break
		}
	}
	for _, fe := range p.remove {
		if old == nil && fe.edtKnown && fe.edt.Rate != 0 {
			old = fe
		}
	}
	if old == nil || old.edt.Pacer == 0 || old.edt.Pacer == pacer || !edt.SameRate(old.edt, want) {
		return 0
	}
	var cur bpf.EDTValue
	if err := d.dp.Maps().FluxvmEdt.Lookup(old.edt.Pacer, &cur); err != nil {
		return 0
	}
	return cur.LastDeparture
}

// pacedNorthSouth counts the paced services served on north-south
// interfaces: the node entry's Rate. d.mu must be held.
func (d *Dataplane) pacedNorthSouth() uint64 {
	var n uint64
	for _, s := range d.services {
		if s.intent.MaxEgressMbps != 0 && s.intent.IsNorthSouth() {
			n++
		}
	}
	return n
}

// writeEDTNode writes the node's fluxvm_edt entry (bpf.EDTNodeKey) from
// the catalog, after every change of it and at every Open (the maps may
// be new). d.mu must be held.
func (d *Dataplane) writeEDTNode() error {
	return d.pacing.SyncNode(d.pacedNorthSouth(), func(n uint64) error {
		return d.dp.Maps().FluxvmEdt.Put(bpf.EDTNodeKey, bpf.EDTValue{Rate: n})
	})
}

// syncEDTNode is writeEDTNode after a service changed: the change is
// programmed, so a failure is logged, and the next change or Open writes
// the entry again.
func (d *Dataplane) syncEDTNode() {
	if err := d.writeEDTNode(); err != nil {
		d.log.Error("fluxvm: EDT: the node entry was not updated; north-south replies of paced services may go unpaced (or be looked up in vain) until the next change", "err", err)
	}
}

// serviceEDT is s's pacing with its counters (summed by the flows
// component), or nil when it is not paced. Counters that cannot be read
// are left 0 (Stats reports the error). d.mu must be held.
func (d *Dataplane) serviceEDT(s *service) *ServiceEDTStatus {
	out := d.edtSettings(s)
	if out == nil || d.closed {
		return out
	}
	if c, err := d.scope.Service(s.serviceIDs()); err == nil {
		out.Bytes, out.HorizonDrops = c.ReplyBytes, c.HorizonDrops
	}
	return out
}

// edtSettings is s's pacing without its counters, or nil when it is not
// paced.
func (d *Dataplane) edtSettings(s *service) *ServiceEDTStatus {
	m := s.intent.MaxEgressMbps
	if m == 0 {
		return nil
	}
	return &ServiceEDTStatus{MaxEgressMbps: m, RateBytesPerSec: bpf.MbpsToEDTRate(m), Horizon: Duration{Duration: d.opts.edtHorizon()}}
}

// edtStatus is the node's EDT status. d.mu must be held.
func (d *Dataplane) edtStatus() EDTStatus {
	out := EDTStatus{Enabled: d.opts.EDT.Enabled, Horizon: Duration{Duration: d.opts.edtHorizon()}}
	if d.pacing == nil || d.closed {
		return out
	}
	attached := make([]string, 0, len(d.ifaces))
	for _, ifc := range d.ifaces {
		attached = append(attached, ifc.Name)
	}
	out.Interfaces = d.pacing.Interfaces(attached)
	return out
}
