package services

import (
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/revindex"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/maglev"
)

// Program writes svc into the datapath as s, all with the lock held (the
// restore, rollbacks and health-driven reprograms; an apply runs the same
// steps with the table builds outside the lock: Prepare, BuildTables,
// CommitUnlocked). others are services whose frontends may belong to
// svc's name too (the service an apply replaces, or the one a rollback
// undoes). The order keeps the maps consistent for every packet: backends
// exist before a table names them, a table is swapped in whole, a
// frontend appears only once its table is in place, a new frontend's
// guard opens last, and backends leave only after no table names them.
func (p *Programmer) Program(svc intent.Service, s *Service, others ...*Service) error {
	pl, err := p.Prepare(svc, s, others...)
	if err != nil {
		return err
	}
	tables, err := p.BuildTables(pl)
	if err != nil {
		return err
	}
	defer tables.Close()
	if err := p.commit(svc, s, pl, tables, others...); err != nil {
		return err
	}
	delete(p.repairs, svc.Name)
	return nil
}

// Plan is a change of one service between Prepare and its commit.
type Plan struct {
	frontends []planned
	// remove are the service's frontends that the change drops.
	remove []*Frontend
	// health is the effective state of every backend of the intent when
	// Prepare ran; the commit starts over if a health check changed it
	// since.
	health []intent.BackendState
}

// planned is one frontend of a change: its backends are in the datapath,
// its table is to be built from mb.
type planned struct {
	fe     *Frontend
	mb     []maglev.Backend
	listed map[netip.AddrPort]bool
}

// Prepare is the first step of a change, with the lock held: the
// frontends svc needs get their ids (a new frontend's guard is closed),
// and the backends of every frontend are written to fluxvm_backends, new
// ones with new ids. s.Frontends becomes svc's frontends. On an error
// the caller programs what was there again (a rollback).
func (p *Programmer) Prepare(svc intent.Service, s *Service, others ...*Service) (*Plan, error) {
	monoNow, err := conntrack.Now()
	if err != nil {
		return nil, err
	}
	wallNow := time.Now()
	prev := p.withRepairs(svc.Name, p.FrontendsOf(svc.Name, append([]*Service{s}, others...)...))
	pl := &Plan{health: p.healthOf(&svc)}
	keep := map[Key]bool{}
	s.Frontends = nil
	for _, w := range Wanted(&svc) {
		keep[w.Key] = true
		fe := p.frontends[w.Key]
		if fe != nil && fe.service != svc.Name {
			return pl, fmt.Errorf("frontend %s: %w", w.Key, intent.ErrConflict)
		}
		if fe == nil {
			fe = &Frontend{key: w.Key, service: svc.Name, backends: map[netip.AddrPort]uint32{}}
			if fe.sid = p.sids.Get(); fe.sid == 0 {
				return pl, fmt.Errorf("frontend %s: %w: no service id left", w.Key, intent.ErrLimit)
			}
			// A recycled id starts with zero counters and a closed guard.
			if err := p.resetServiceSlot(fe.sid); err != nil {
				p.sids.Release(fe.sid)
				return pl, fmt.Errorf("frontend %s: %w", w.Key, err)
			}
			fe.edt.Zeroed() // resetServiceSlot zeroed it
			p.frontends[w.Key] = fe
		}
		s.Frontends = append(s.Frontends, fe)
		f, err := p.prepareFrontend(svc, fe, w.Backends, monoNow, wallNow)
		if err != nil {
			return pl, fmt.Errorf("frontend %s: %w", w.Key, err)
		}
		pl.frontends = append(pl.frontends, f)
	}
	for _, fe := range prev {
		if !keep[fe.key] {
			pl.remove = append(pl.remove, fe)
		}
	}
	return pl, nil
}

// healthOf is the effective state of every backend of svc.
func (p *Programmer) healthOf(svc *intent.Service) []intent.BackendState {
	if svc.HealthCheck == nil {
		return nil
	}
	out := make([]intent.BackendState, len(svc.Backends))
	for i := range svc.Backends {
		out[i] = p.deps.State(svc, &svc.Backends[i])
	}
	return out
}

// prepareFrontend writes the backends of fe (new ones get ids), lists fe
// for each in the reverse translation index, and returns what its table
// is built from.
func (p *Programmer) prepareFrontend(svc intent.Service, fe *Frontend, backends []intent.Backend, monoNow time.Duration, wallNow time.Time) (planned, error) {
	f := planned{fe: fe, listed: map[netip.AddrPort]bool{}}
	// A frontend still served east-west with NAT lists new backends too
	// while it changes to DSR or north-south only: until the commit writes
	// its new flags, its flows are learned as east-west flows.
	idx := revindex.Indexed(Flags(&svc)) || fe.live && revindex.Indexed(fe.flags)
	for _, b := range backends {
		ep := b.Endpoint()
		f.listed[ep] = true
		id := fe.backends[ep]
		if id == 0 {
			if id = p.bids.Get(); id == 0 {
				return f, fmt.Errorf("%w: no backend id left", intent.ErrLimit)
			}
			fe.backends[ep] = id
		}
		state, drain := bpf.BackendReady, uint64(0)
		// The intent state, with the health overlay (internal/health).
		switch p.deps.State(&svc, &b) {
		case intent.BackendDraining:
			state = bpf.BackendDraining
			left := b.DrainUntil().Sub(wallNow)
			if left < 0 {
				left = -time.Nanosecond // already passed
				p.deps.StaleSockets()
			}
			drain = uint64(monoNow + left)
		case intent.BackendUnhealthy:
			state = bpf.BackendUnhealthy
			// Connected UDP sockets of socket LB cannot leave it by
			// themselves (internal/socklb).
			p.deps.StaleSockets()
		}
		fam := uint8(bpf.FamilyIPv6)
		if ep.Addr().Unmap().Is4() {
			fam = bpf.FamilyIPv4
		}
		v := bpf.Backend{Addr: bpf.AddrWords(ep.Addr()), Port: bpf.Port(ep.Port()), Family: fam,
			State: uint8(state), ServiceId: fe.sid, DrainUntilNs: drain}
		if err := p.deps.Maps.PutBackend(id, v); err != nil {
			return f, fmt.Errorf("backend %s: %w", ep, err)
		}
		// Listed in the reverse translation index before any table of fe
		// can name it.
		if err := p.index.Add(fe.key, fe.sid, ep, id, idx); err != nil {
			return f, err
		}
		f.mb = append(f.mb, maglev.Backend{ID: id, Addr: ep.Addr().Unmap(), Port: ep.Port(), Proto: fe.key.Proto,
			Weight: b.EffectiveWeight(), Ready: state == bpf.BackendReady})
	}
	return f, nil
}

// commit is the last step of a change, with the lock held: the tables
// built for pl go in place, then the frontend entries, markers and
// guards, and the backends and frontends the change drops go. If a health
// check changed the effective state of a backend since Prepare, it
// programs svc again from the start (Program) instead.
func (p *Programmer) commit(svc intent.Service, s *Service, pl *Plan, tables Tables, others ...*Service) error {
	c, done, err := p.commitStart(svc, s, pl, others...)
	if done || err != nil {
		return err
	}
	if err := p.swapTables(pl, tables); err != nil {
		return err
	}
	if err := p.finishFrontends(svc, s, pl, tables, c); err != nil {
		return err
	}
	for _, fe := range pl.remove {
		if err := p.removeFrontend(fe); err != nil {
			return err
		}
	}
	return nil
}

// CommitUnlocked is the commit of an apply: called with the lock held, it
// releases the lock while the tables are swapped in, and again while the
// slots of the frontends the change drops are emptied (RemoveUnlocked, as
// a delete does), and holds it again when it returns. An update of
// fluxvm_maglev (a map of maps) returns only after an RCU grace period,
// so that no program still reads the table it replaced: milliseconds,
// which under the lock would serialise every apply of the node. Without
// the lock, the grace periods of concurrent applies overlap.
//
// The tables are the service's own, and its other writers wait: the
// caller holds the service's lock (NameLocks) and keeps the health
// checks' reprograms of the service off meanwhile. What others may change
// meanwhile, the end of the commit reads afresh: the reverse translation
// index (another service's change may move this one's slots down and
// rewrite its live entry without SvcFlagRevStored) and the observed
// health.
func (p *Programmer) CommitUnlocked(svc intent.Service, s *Service, pl *Plan, tables Tables, others ...*Service) error {
	c, done, err := p.commitStart(svc, s, pl, others...)
	if done || err != nil {
		return err
	}
	p.deps.Lock.Unlock()
	err = p.swapTables(pl, tables)
	p.deps.Lock.Lock()
	if err != nil {
		return err
	}
	if !slices.Equal(pl.health, p.healthOf(&svc)) {
		// A health check changed a backend while the lock was free.
		return p.Program(svc, s, others...)
	}
	if err := p.finishFrontends(svc, s, pl, tables, c); err != nil {
		return err
	}
	// The frontends the change drops go as a delete's do.
	return p.RemoveUnlocked(pl.remove)
}

// commitState is what commitStart hands on to the swaps and the end of
// the commit.
type commitState struct {
	// pacer is the frontend whose departure clock the service's frontends
	// share, and clock the departure time its entry starts from (see
	// pacerClock).
	pacer uint32
	clock uint64
}

// commitStart readies pl's frontends for their new tables
// (readyFrontend). done reports that it programmed svc from the start
// instead (Program), because a health check changed the effective state
// of a backend since Prepare: nothing is left to do.
func (p *Programmer) commitStart(svc intent.Service, s *Service, pl *Plan, others ...*Service) (c commitState, done bool, err error) {
	if !slices.Equal(pl.health, p.healthOf(&svc)) {
		return c, true, p.Program(svc, s, others...)
	}
	// The service's frontends pace on one clock, that of its frontend
	// with the lowest id (bpf/lib/edt.h), so that max_egress_mbps caps
	// the service.
	for _, f := range pl.frontends {
		if c.pacer == 0 || f.fe.sid < c.pacer {
			c.pacer = f.fe.sid
		}
	}
	c.clock = p.pacerClock(svc, pl, c.pacer)
	for _, f := range pl.frontends {
		flags, err := p.readyFrontend(svc, f, c.pacer, c.clock)
		if err != nil {
			return c, false, fmt.Errorf("frontend %s: %w", f.fe.key, err)
		}
		if p.deps.BeforeSwap != nil {
			p.deps.BeforeSwap(f.fe, flags)
		}
	}
	return c, false, nil
}

// finishFrontends writes the frontend entries, markers and guards of pl
// (finishFrontend) once its tables are in place. It readies each
// frontend again first, from the state as it is now (what readyFrontend
// wrote already is left as is), so that it writes the flags of now.
func (p *Programmer) finishFrontends(svc intent.Service, s *Service, pl *Plan, tables Tables, c commitState) error {
	for i, f := range pl.frontends {
		flags, err := p.readyFrontend(svc, f, c.pacer, c.clock)
		if err == nil {
			err = p.finishFrontend(svc, s, f, tables[i], flags)
		}
		if err != nil {
			return fmt.Errorf("frontend %s: %w", f.fe.key, err)
		}
	}
	return nil
}

// readyFrontend is what goes before a frontend's entry is written, and
// before its new table goes in: its EDT rate, its identity policy's
// header, and SvcFlagRevStored in its live entry when it is past the
// index slots of one of its backends (revStoredOf). It returns the flags
// its entry is to get. pacer is the frontend whose departure clock the
// service's frontends share, and clock the departure time its entry
// starts from when it is written (see pacerClock). Running it again
// writes only what changed since (putEDT, Attach and markRevStored keep
// what is in place).
func (p *Programmer) readyFrontend(svc intent.Service, f planned, pacer uint32, clock uint64) (uint32, error) {
	fe := f.fe
	v, err := p.deps.Pacing.ValueOf(svc.MaxEgressMbps)
	if err != nil {
		return 0, err
	}
	// A paced frontend's rate is in place before its flag (edt.go).
	if v.Rate != 0 {
		v.Pacer = pacer
		if fe.sid == pacer {
			v.LastDeparture = clock
		}
		if err := p.putEDT(fe, v); err != nil {
			return 0, err
		}
	}
	// A frontend of a service that enforces an identity policy gets the
	// policy's header before its flag.
	pflag, err := p.deps.Policy.Attach(svc.Name, fe.sid)
	if err != nil {
		return 0, err
	}
	flags := Flags(&svc) | p.revStoredOf(fe) | pflag
	if flags&bpf.SvcFlagRevStored != 0 {
		if err := p.markRevStored(fe); err != nil {
			return 0, err
		}
	}
	return flags, nil
}

// finishFrontend writes fe's frontend entry with flags (from
// readyFrontend), its marker and guard, once its table t is in place, and
// removes the backends that left it.
func (p *Programmer) finishFrontend(svc intent.Service, s *Service, f planned, t builtTable, flags uint32) error {
	fe := f.fe
	fe.eligible = t.eligible
	fe.size = 0
	if t.inner != nil {
		fe.size = t.size
	}
	val := bpf.SvcValue{ServiceId: fe.sid, Flags: flags, Revision: uint32(s.Revision)}
	if err := p.deps.Maps.Put(fe.key, val); err != nil {
		return err
	}
	fe.flags, fe.rev, fe.live = flags, val.Revision, true
	if flags&bpf.SvcFlagPolicy == 0 {
		// Its policy's header goes only once the flag is off.
		if err := p.deps.Policy.Detach(fe.sid); err != nil {
			return err
		}
	}
	// An unpaced one loses its rate only once its flag is gone.
	if v, err := p.deps.Pacing.ValueOf(svc.MaxEgressMbps); err != nil {
		return err
	} else if v.Rate == 0 {
		if err := p.putEDT(fe, bpf.EDTValue{}); err != nil {
			return err
		}
	}
	if err := p.addMarker(fe); err != nil {
		return err
	}
	fe.guard = svc.IsEnabled()
	g := bpf.Guard{Revision: uint32(s.Revision)}
	if fe.guard {
		g.State = bpf.GuardOpen
	}
	if err := p.putGuard(fe.sid, g); err != nil {
		return err
	}
	fe.repair = false

	// Backends that left the intent go only now that no table names them,
	// and so do their slots in the reverse translation index.
	for ep := range fe.backends {
		if !f.listed[ep] {
			if err := p.dropBackend(fe, ep); err != nil {
				return err
			}
		}
	}
	return nil
}
