package fluxvm

import (
	"fmt"
	"sort"
	"strings"

	"github.com/fluxvm/servicefabric/bpf"
)

// EDT pacing, the control plane's side (the datapath's is bpf/lib/edt.h).
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
// value when svc is not paced. Validation keeps max_egress_mbps within
// the bounds bpf.NewEDTValue accepts and the horizon within its own, so an
// error here means a Service that skipped validation.
func (d *Dataplane) edtValueOf(svc *Service) (bpf.EDTValue, error) {
	if svc.MaxEgressMbps == 0 {
		return bpf.EDTValue{}, nil
	}
	v, err := bpf.NewEDTValue(bpf.MbpsToEDTRate(svc.MaxEgressMbps), d.opts.edtHorizon())
	if err != nil {
		return bpf.EDTValue{}, fmt.Errorf("max_egress_mbps %d: %w", svc.MaxEgressMbps, err)
	}
	return v, nil
}

// sameRate reports whether two fluxvm_edt entries pace alike: rate and
// horizon (the pacer and the clock aside).
func sameRate(a, b bpf.EDTValue) bool {
	return a.Rate == b.Rate && a.NsPerByte == b.NsPerByte && a.HorizonNs == b.HorizonNs
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
	if fe.edtKnown && v.Rate != 0 && sameRate(fe.edt, v) {
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
	if old == nil || old.edt.Pacer == 0 || old.edt.Pacer == pacer || !sameRate(old.edt, want) {
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
	n := d.pacedNorthSouth()
	if d.edtNodeKnown && d.edtNode == n {
		return nil
	}
	if err := d.dp.Maps().FluxvmEdt.Put(bpf.EDTNodeKey, bpf.EDTValue{Rate: n}); err != nil {
		return fmt.Errorf("edt node entry: %w", err)
	}
	d.edtNode, d.edtNodeKnown = n, true
	return nil
}

// syncEDTNode is writeEDTNode after a service changed: the change is
// programmed, so a failure is logged, and the next change or Open writes
// the entry again.
func (d *Dataplane) syncEDTNode() {
	if err := d.writeEDTNode(); err != nil {
		d.log.Error("fluxvm: EDT: the node entry was not updated; north-south replies of paced services may go unpaced (or be looked up in vain) until the next change", "err", err)
	}
}

// serviceEDT is s's pacing with its counters, or nil when it is not
// paced. A counter that cannot be read is left 0 (Stats reports the
// error). d.mu must be held.
func (d *Dataplane) serviceEDT(s *service) *ServiceEDTStatus {
	m := s.intent.MaxEgressMbps
	if m == 0 {
		return nil
	}
	out := &ServiceEDTStatus{MaxEgressMbps: m, RateBytesPerSec: bpf.MbpsToEDTRate(m), Horizon: Duration{d.opts.edtHorizon()}}
	if d.closed {
		return out
	}
	for _, fe := range s.frontends {
		var per []bpf.ServiceStats
		if err := d.dp.Maps().FluxvmSvcStats.Lookup(fe.sid, &per); err != nil {
			continue
		}
		for _, p := range per {
			out.Bytes += p.ReplyBytes
			out.HorizonDrops += p.EdtDrops
		}
	}
	return out
}

// edtStatus is the node's EDT status. d.mu must be held.
func (d *Dataplane) edtStatus() EDTStatus {
	out := EDTStatus{Enabled: d.opts.EDT.Enabled, Horizon: Duration{d.opts.edtHorizon()}}
	if !d.opts.EDT.Enabled || d.closed {
		return out
	}
	managed := map[string]managedFQ{}
	names := map[string]bool{}
	for _, m := range d.fq {
		managed[m.name] = m
		names[m.name] = true
	}
	for _, ifc := range d.ifaces {
		names[ifc.Name] = true
	}
	for _, n := range d.opts.EDT.Interfaces {
		names[n] = true
	}
	_ = d.opts.InNamespace(func() error {
		for n := range names {
			st := EDTInterfaceStatus{Name: n, Mode: EDTModeHorizonPolicing}
			m, isManaged := managed[n]
			st.Managed = isManaged && m.installed
			st.PreviousQdisc = m.previous
			qs, err := qdiscsOf(n)
			kind, fq, other := fqInForce(qs)
			st.Qdisc = kind
			switch {
			case err != nil:
				st.Reason = fmt.Sprintf("root qdisc unknown: %v", err)
			case fq:
				st.Mode = EDTModeFQ
			case m.problem != "":
				st.Reason = m.problem
			case kind == "":
				st.Reason = "no root qdisc: paced packets leave at once, and the horizon polices the rate"
			case kind == "mq":
				st.Reason = fmt.Sprintf("root qdisc is mq, and not every TX queue's is fq (%s): paced packets leave at once, and the horizon polices the rate", strings.Join(other, ", "))
			default:
				st.Reason = fmt.Sprintf("root qdisc is %s, not fq: paced packets leave at once, and the horizon polices the rate", kind)
			}
			out.Interfaces = append(out.Interfaces, st)
		}
		return nil
	})
	sort.Slice(out.Interfaces, func(i, j int) bool { return out.Interfaces[i].Name < out.Interfaces[j].Name })
	return out
}
