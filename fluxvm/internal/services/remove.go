package services

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/fluxvm/servicefabric/bpf"
)

// Unprogram removes the frontends of the services ss (one name), with
// the lock held.
func (p *Programmer) Unprogram(ss ...*Service) error {
	if len(ss) == 0 {
		return nil
	}
	for _, fe := range p.FrontendsOf(ss[0].Intent.Name, ss...) {
		if err := p.removeFrontend(fe); err != nil {
			return err
		}
	}
	return nil
}

// UnprogramUnlocked is Unprogram for a delete: called with the lock
// held, it takes the frontends of s out of the datapath with
// RemoveUnlocked. When that fails, the service stays (the delete fails
// and keeps it listed and in the catalog), so what already went is put
// back: s is programmed again with the lock held, as an apply's rollback
// does; if that fails too, its frontends are closed (FailClosed) until
// it is programmed again.
func (p *Programmer) UnprogramUnlocked(s *Service) error {
	name := s.Intent.Name
	err := p.RemoveUnlocked(p.withRepairs(name, p.FrontendsOf(name, s)))
	if err == nil {
		return nil
	}
	if rerr := p.Program(s.Intent, s); rerr != nil {
		p.FailClosed(name, rerr, s)
		return fmt.Errorf("%w (and restoring the service failed: %w; its frontends are closed until it is applied again)", err, rerr)
	}
	return fmt.Errorf("%w (the service is kept as it was)", err)
}

// RemoveUnlocked is removeFrontend for the frontends fes of one service,
// without the lock while their slots of fluxvm_maglev are emptied: called
// with the lock held, it retires them all (their entries go first),
// releases the lock while their slots are emptied (each update waits for
// an RCU grace period: see CommitUnlocked), and holds it again to drop
// their backends and guards and release their ids. Until then the ids
// stay taken, so no other frontend gets one and puts a table in the slot
// meanwhile; the frontends stay listed, so another service's change that
// wants one of their keys meanwhile is refused with intent.ErrConflict,
// as it would have been a moment earlier. The caller holds the service's
// lock and keeps the health checks' reprograms of it off, so no other
// change of the service runs meanwhile. On an error it returns with the
// lock held and the frontends retired, some slots perhaps emptied: the
// caller programs the service again.
func (p *Programmer) RemoveUnlocked(fes []*Frontend) error {
	if len(fes) == 0 {
		return nil
	}
	for _, fe := range fes {
		if err := p.retireFrontend(fe); err != nil {
			return err
		}
	}
	p.deps.Lock.Unlock()
	var err error
	for _, fe := range fes {
		if err = p.swapTable(fe.sid, nil); err != nil {
			err = fmt.Errorf("frontend %s: %w", fe.key, err)
			break
		}
	}
	p.deps.Lock.Lock()
	if err != nil {
		return err
	}
	for _, fe := range fes {
		if err := p.dropFrontend(fe); err != nil {
			return err
		}
	}
	return nil
}

// removeFrontend takes a frontend out of the datapath: first the entry
// that makes packets match it (retireFrontend), then its table, then its
// backends and guard (dropFrontend).
func (p *Programmer) removeFrontend(fe *Frontend) error {
	if err := p.retireFrontend(fe); err != nil {
		return err
	}
	if err := p.swapTable(fe.sid, nil); err != nil {
		return err
	}
	return p.dropFrontend(fe)
}

// retireFrontend is the first step of removeFrontend: the entry that
// makes packets match fe goes, then its policy header, EDT entry and
// marker.
func (p *Programmer) retireFrontend(fe *Frontend) error {
	if err := p.deps.Maps.DeleteFrontend(fe.key); err != nil {
		return err
	}
	fe.live = false
	if err := p.deps.Policy.Detach(fe.sid); err != nil {
		return err
	}
	if err := p.putEDT(fe, bpf.EDTValue{}); err != nil {
		return err
	}
	return p.dropMarker(fe)
}

// dropFrontend is the last step of removeFrontend, once fe's slot of
// fluxvm_maglev is empty: its backends (and their slots in the reverse
// translation index) and guard go, and its ids are released.
func (p *Programmer) dropFrontend(fe *Frontend) error {
	for ep := range fe.backends {
		if err := p.dropBackend(fe, ep); err != nil {
			return err
		}
	}
	if err := p.putGuard(fe.sid, bpf.Guard{}); err != nil {
		return err
	}
	delete(p.frontends, fe.key)
	p.sids.Release(fe.sid)
	return nil
}

// dropBackend removes backend endpoint ep of fe, which no table of fe
// names any more: its entry, its slot in the reverse translation index,
// and its id. It forgets the backend as it goes, so that a retry after a
// failure further on never releases an id twice.
func (p *Programmer) dropBackend(fe *Frontend, ep netip.AddrPort) error {
	id := fe.backends[ep]
	if err := p.deps.Maps.PutBackend(id, bpf.Backend{}); err != nil {
		return fmt.Errorf("remove backend %s: %w", ep, err)
	}
	if err := p.removeSlot(fe, ep); err != nil {
		return err
	}
	delete(fe.backends, ep)
	p.bids.Release(id)
	// Connected UDP sockets of socket LB may name it.
	p.deps.StaleSockets()
	return nil
}

// resetServiceSlot zeroes the per-service slots of a newly allocated id:
// a closed guard, zero counters, unpaced, so that nothing of a frontend
// that had the id before remains.
func (p *Programmer) resetServiceSlot(sid uint32) error {
	if err := p.putGuard(sid, bpf.Guard{}); err != nil {
		return err
	}
	if err := p.deps.Maps.ResetStats(sid); err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	if err := p.deps.Maps.PutEDT(sid, bpf.EDTValue{}); err != nil {
		return fmt.Errorf("edt entry: %w", err)
	}
	return nil
}

func (p *Programmer) putGuard(sid uint32, g bpf.Guard) error {
	if err := p.deps.Maps.PutGuard(sid, g); err != nil {
		return fmt.Errorf("guard: %w", err)
	}
	return nil
}

// addMarker makes sure the (VIP, 0, proto) entry that recognises
// fragments exists with the flags of every frontend on the VIP (fe's may
// have changed); several services may share a VIP, and the marker names
// the first.
func (p *Programmer) addMarker(fe *Frontend) error {
	mk := markerKey{fe.key.VIP, fe.key.Proto}
	if !slices.Contains(p.markers[mk], fe) {
		p.markers[mk] = append(p.markers[mk], fe)
	}
	return p.putMarker(mk)
}

func (p *Programmer) putMarker(mk markerKey) error {
	fes := p.markers[mk]
	return p.deps.Maps.Put(Key{VIP: mk.vip, Proto: mk.proto}, bpf.SvcValue{ServiceId: fes[0].sid, Flags: markerFlags(fes)})
}

func (p *Programmer) dropMarker(fe *Frontend) error {
	mk := markerKey{fe.key.VIP, fe.key.Proto}
	rest := slices.DeleteFunc(slices.Clone(p.markers[mk]), func(o *Frontend) bool { return o == fe })
	if len(rest) == 0 {
		delete(p.markers, mk)
		return p.deps.Maps.DeleteFrontend(Key{VIP: fe.key.VIP, Proto: fe.key.Proto})
	}
	p.markers[mk] = rest
	return p.putMarker(mk)
}
