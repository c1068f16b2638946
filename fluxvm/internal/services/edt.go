package services

import (
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
	"github.com/fluxvm/servicefabric/intent"
)

// putEDT writes fe's fluxvm_edt entry, keeping its departure clock as the
// EDT component's rules say (edt.Entry.Put).
func (p *Programmer) putEDT(fe *Frontend, v bpf.EDTValue) error {
	return fe.edt.Put(p.deps.Maps, fe.sid, v)
}

// pacerClock is the departure clock the change pl hands on to the
// service's new pacer (edt.ClockFrom): the old pacer's, read from the
// entry of a frontend paced before the change.
func (p *Programmer) pacerClock(svc intent.Service, pl *Plan, pacer uint32) uint64 {
	want, err := p.deps.Pacing.ValueOf(svc.MaxEgressMbps)
	if err != nil {
		return 0
	}
	var old *edt.Entry
	for _, f := range pl.frontends {
		if f.fe.edt.Paced() {
			old = &f.fe.edt
			break
		}
	}
	for _, fe := range pl.remove {
		if old == nil && fe.edt.Paced() {
			old = &fe.edt
		}
	}
	return edt.ClockFrom(p.deps.Maps, want, old, pacer)
}
