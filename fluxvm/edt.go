package fluxvm

import (
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
// clock they all advance. A change that removes the pacer frontend
// repoints the others first. The clocks survive every change but one of
// rate or horizon: a new pacer starts from the old one's, and a restart
// onto kept maps rewrites nothing (fluxvm/internal/edt, entry.go: Entry
// and ClockFrom, which the services component calls).

// edtValueOf is the fluxvm_edt entry of each frontend of svc: the zero
// value when svc is not paced (edt.Pacing.ValueOf).
func (d *Dataplane) edtValueOf(svc *Service) (bpf.EDTValue, error) {
	return d.pacing.ValueOf(svc.MaxEgressMbps)
}

// pacedNorthSouth counts the paced services served on north-south
// interfaces: the node entry's Rate. d.mu must be held.
func (d *Dataplane) pacedNorthSouth() uint64 {
	var n uint64
	for _, s := range d.services {
		if s.Intent.MaxEgressMbps != 0 && s.Intent.IsNorthSouth() {
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
	if c, err := d.scope.Service(s.ServiceIDs()); err == nil {
		out.Bytes, out.HorizonDrops = c.ReplyBytes, c.HorizonDrops
	}
	return out
}

// edtSettings is s's pacing without its counters, or nil when it is not
// paced.
func (d *Dataplane) edtSettings(s *service) *ServiceEDTStatus {
	m := s.Intent.MaxEgressMbps
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
