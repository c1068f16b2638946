package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"reflect"
	"runtime"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/maglev"
)

// ApplyService creates or updates a service. The request is validated
// against the whole catalog first, so a rejected request changes nothing.
// Applying the same intent again changes nothing either, unless a failed
// change left the service's frontends out of place (a failed delete's,
// or one closed for repair: FrontendStatus.RepairPending): then it
// programs them again. An update never touches conntrack or reverse-NAT
// state: established flows keep their backends as the selection rules
// say.
//
// It returns once the change is programmed and durable in the catalog
// (package fluxvm/internal/catalog). Applies of different services run concurrently: the
// dataplane's lock is held to validate and reserve ids and to write the
// frontend entries, but not while the Maglev tables are built and
// written, nor while they are swapped into fluxvm_maglev or the slots of
// frontends it drops are emptied (each update waits for an RCU grace
// period in the kernel, which concurrent updates share), nor while the
// catalog journal is synced (concurrent changes share one fsync).
// Applies and deletes of one service run one at a time, in the order
// they took the service's lock: the last one to return is what the maps
// hold and what the catalog keeps. An apply that failed with
// "programmed, but the catalog was not saved", retried unchanged,
// returns nil only once the catalog is durable again.
//
// The apply of the first service that needs a flow map at its tier's
// capacity (the first IPv6 frontend for fluxvm_fct6, the first north-south
// NAT frontend of a family, or the first frontend storing reverse halves,
// for its reverse-NAT map; sizing.go) grows that map first, while traffic
// runs and without losing a flow: such an apply takes 0.4–1.1 s at tier L
// (bounded by 1.5 s on the reference machine; docs/benchmarks.md) instead
// of about 10 ms, holding the dataplane's lock for the switch alone (0.1–0.2
// ms). Status.MapSizes reports it. Applies under way count: of two
// concurrent applies that together bring a map's first need, one grows it
// before it commits.
//
// ctx bounds the wait: an apply whose context ends before its new tables
// are committed changes no service (a map grown for it stays grown) and
// returns an error wrapping the context's (errors.Is(err,
// context.Canceled)); one that reached the commit finishes, catalog
// included, and returns its outcome.
func (d *Dataplane) ApplyService(ctx context.Context, svc Service) (_ ServiceStatus, err error) {
	if err := d.opened("apply service"); err != nil {
		return ServiceStatus{}, err
	}
	_, span := d.startSpan(ctx, SpanApplyService, AttrService.String(svc.Name), AttrBackends.Int(len(svc.Backends)))
	defer endSpan(span, &err)
	if err := ctx.Err(); err != nil {
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	// The dataplane keeps the intent: it must not share the caller's
	// slices and pointers, or a caller that edits its copy afterwards
	// would change the stored intent behind our back.
	svc = svc.Clone()
	unlock := d.lockService(svc.Name)
	defer unlock()
	// The flow maps its frontends need at full size grow first (sizing.go).
	grows := 0
grow:
	grows++
	// Cancelled while it waited for the service's lock, or while a map
	// grew: nothing of the service has changed yet.
	if err := ctx.Err(); err != nil {
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	planned, err := d.growFor(svc)
	if err != nil {
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	d.mu.Lock()
	if err := d.checkOpen("apply " + svc.Name); err != nil {
		d.mu.Unlock()
		return ServiceStatus{}, err
	}
	if err := ctx.Err(); err != nil {
		d.mu.Unlock()
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	// The service alone first, so that its errors name its own fields
	// (backends[0].port), then the catalog it would join.
	if err := ValidateService(svc, *d.opts.settings()); err != nil {
		d.mu.Unlock()
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	if _, err := d.edtValueOf(&svc); err != nil {
		d.mu.Unlock()
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	// Its identity policy must still fit it (L7 enforce: NAT, TCP only).
	if err := d.pol.Check(&svc); err != nil {
		d.mu.Unlock()
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: the service's identity policy would no longer fit it (change or delete the policy first): %w", svc.Name, err)
	}
	old := d.services[svc.Name]
	if old != nil && reflect.DeepEqual(old.intent, svc) && d.inPlace(old) {
		st := d.statusOf(old)
		span.SetAttributes(AttrChanged.Bool(false), AttrRevision.Int64(int64(st.Revision)), AttrFrontends.Int(len(st.Frontends)))
		// Unchanged, but perhaps not saved: the retry of an apply that
		// answered "programmed, but the catalog was not saved" answers
		// only once its record, or a snapshot, is durable (catchUp).
		seq := d.catchUp(old.seq)
		d.mu.Unlock()
		if err := d.settle(seq); err != nil {
			return st, fmt.Errorf("fluxvm: apply %s: programmed, but the catalog was not saved: %w", svc.Name, err)
		}
		return st, nil
	}
	fp := intent.FootprintOf(&svc)
	var oldFP *intent.Footprint
	if old != nil {
		oldFP = &old.fp
	}
	if err := d.index.Check(&svc, &fp, oldFP, d.limits); err != nil {
		d.mu.Unlock()
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	if err := d.checkIDs(svc); err != nil {
		d.mu.Unlock()
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	// An apply of another service reserved since growFor looked may
	// have brought, with this one, a map's first need (a fifth frontend
	// listing a backend): no apply commits a frontend the maps as loaded
	// cannot serve. The reservation below is made under the same lock,
	// so of two such applies the second sees the first. Without a
	// reservation since the plan there is nothing new to count.
	if d.reservations != planned {
		if need, _ := d.needGrowth(svc); len(need) > 0 {
			d.mu.Unlock()
			if grows < 3 {
				goto grow
			}
			return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: maps %v still below their need after growing them", svc.Name, need)
		}
	}
	d.revision++
	s := &service{intent: svc, revision: d.revision, applied: time.Now().UTC(), fp: fp}
	d.index.Reserve(svc.Name, &fp, oldFP)
	d.reserved[svc.Name] = svc
	d.reservations++
	d.inflight.Add(1)
	defer d.inflight.Done()
	d.busy[svc.Name]++ // health reprograms wait for this apply (recordHealth)

	p, err := d.prepare(svc, s, old)
	if err == nil {
		// The new tables are this service's own: build and fill them
		// without the lock, and put them in place without it too (each
		// swap waits for the kernel's RCU grace period: commitStart).
		d.mu.Unlock()
		var tables []builtTable
		tables, err = d.buildTables(p)
		d.mu.Lock()
		// The last moment a cancelled apply is undone (the old intent
		// put back below); from the commit on it finishes.
		if err == nil {
			err = ctx.Err()
		}
		if err == nil {
			err = d.commitUnlocked(svc, s, p, tables, old)
		}
		closeTables(tables)
	}
	if err != nil {
		// Put back what was there, so that maps and catalog agree.
		var rerr error
		if old != nil {
			rerr = d.program(old.intent, old, s)
		} else {
			rerr = d.unprogram(s)
		}
		if rerr != nil {
			// A mix of the old and new intent must not serve: fail
			// closed until the service is programmed again.
			d.failClosed(svc.Name, d.frontendsOf(svc.Name, s, old), rerr)
			err = fmt.Errorf("%w (and the rollback failed: %w; its frontends are closed until it is applied again)", err, rerr)
		}
		d.index.Abort(svc.Name, &fp, oldFP)
		delete(d.reserved, svc.Name)
		d.doneBusy(svc.Name)
		d.mu.Unlock()
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	d.index.Commit(svc.Name, &fp, oldFP)
	delete(d.reserved, svc.Name)
	d.services[svc.Name] = s
	delete(d.unsaved, svc.Name)
	delete(d.repairs, svc.Name)
	d.syncEDTNode()
	d.syncHA()
	d.doneBusy(svc.Name)
	d.syncHealth(svc.Name)
	d.advertise()
	st := d.statusOf(s)
	span.SetAttributes(AttrChanged.Bool(true), AttrRevision.Int64(int64(st.Revision)), AttrFrontends.Int(len(st.Frontends)))
	seq, jerr := d.journal(svc.Name, s)
	s.seq = seq
	d.mu.Unlock()
	if jerr == nil {
		jerr = d.persist(seq)
	}
	if jerr != nil {
		return st, fmt.Errorf("fluxvm: apply %s: programmed, but the catalog was not saved: %w", svc.Name, jerr)
	}
	// From st, taken under the lock: a health round may reprogram s now.
	d.log.Info("fluxvm: service applied", "service", svc.Name, "revision", st.Revision, "frontends", len(st.Frontends))
	return st, nil
}

// DeleteService removes a service and its frontends. Its flows lose their
// translation; their conntrack entries are collected by GC. It returns
// once the removal is durable in the catalog. Like ApplyService, it does
// not hold the dataplane's lock while its tables' slots of fluxvm_maglev
// are emptied (an RCU grace period each), so deletes and applies of
// different services run concurrently. If emptying them fails, the
// service is kept as it was (programmed again) and the error says so.
// A delete that failed with "removed, but the catalog was not saved",
// retried, returns nil only once the removal is durable (and
// ErrNotFound after that). A delete whose context ends before it starts
// removing (while it waits for the service's lock, say) removes nothing
// and returns an error wrapping the context's; once removing, it
// finishes.
func (d *Dataplane) DeleteService(ctx context.Context, name string) (err error) {
	if err := d.opened("delete service"); err != nil {
		return err
	}
	_, span := d.startSpan(ctx, SpanDeleteService, AttrService.String(name))
	defer endSpan(span, &err)
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("fluxvm: delete %s: %w", name, err)
	}
	unlock := d.lockService(name)
	defer unlock()
	d.mu.Lock()
	if err := d.checkOpen("delete " + name); err != nil {
		d.mu.Unlock()
		return err
	}
	// Cancelled while it waited for the service's lock: nothing removed.
	if err := ctx.Err(); err != nil {
		d.mu.Unlock()
		return fmt.Errorf("fluxvm: delete %s: %w", name, err)
	}
	s, ok := d.services[name]
	if seq := d.unsaved[name]; !ok && seq != 0 {
		// The retry of a delete that answered "removed, but the catalog
		// was not saved": it answers once the removal is durable.
		seq = d.catchUp(seq)
		d.mu.Unlock()
		if err := d.settle(seq); err != nil {
			return fmt.Errorf("fluxvm: delete %s: removed, but the catalog was not saved: %w", name, err)
		}
		d.mu.Lock()
		delete(d.unsaved, name)
		d.mu.Unlock()
		return nil
	}
	if !ok {
		d.mu.Unlock()
		return fmt.Errorf("fluxvm: delete %s: %w", name, ErrNotFound)
	}
	d.inflight.Add(1)
	defer d.inflight.Done()
	d.busy[name]++ // health reprograms wait for this delete (recordHealth)
	err = d.unprogramUnlocked(s)
	d.doneBusy(name)
	if err != nil {
		d.mu.Unlock()
		return fmt.Errorf("fluxvm: delete %s: %w", name, err)
	}
	delete(d.services, name)
	delete(d.repairs, name)
	d.syncEDTNode()
	d.syncHA()
	d.index.Remove(name, &s.fp)
	delete(d.legacyNames, name)
	d.syncHealth(name)
	d.advertise()
	seq, jerr := d.journal(name, nil)
	// Its identity policy goes with it (a policy names a service).
	if jerr == nil && d.pol.Has(name) {
		seq, jerr = d.pol.Drop(name)
	}
	d.mu.Unlock()
	if jerr == nil {
		jerr = d.persist(seq)
	}
	if jerr != nil {
		d.mu.Lock()
		if d.unsaved == nil {
			d.unsaved = map[string]uint64{}
		}
		if seq != 0 {
			d.unsaved[name] = seq
		}
		d.mu.Unlock()
		return fmt.Errorf("fluxvm: delete %s: removed, but the catalog was not saved: %w", name, jerr)
	}
	d.log.Info("fluxvm: service deleted", "service", name)
	return nil
}

// Services lists every service, sorted by name. After Close it lists
// them as they were at Close; after Cleanup the list is empty.
func (d *Dataplane) Services() []ServiceStatus {
	if d.unopened() {
		return []ServiceStatus{}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]ServiceStatus, 0, len(d.services))
	for _, s := range d.services {
		out = append(out, d.statusOf(s))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Service.Name < out[j].Service.Name })
	return out
}

// Service returns one service, or an error matching ErrNotFound (or
// ErrClosed after Close).
func (d *Dataplane) Service(name string) (ServiceStatus, error) {
	if err := d.opened("service"); err != nil {
		return ServiceStatus{}, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("service " + name); err != nil {
		return ServiceStatus{}, err
	}
	s, ok := d.services[name]
	if !ok {
		return ServiceStatus{}, fmt.Errorf("fluxvm: service %s: %w", name, ErrNotFound)
	}
	return d.statusOf(s), nil
}

func (d *Dataplane) statusOf(s *service) ServiceStatus {
	st := ServiceStatus{Service: s.intent, Revision: s.revision, AppliedAt: s.applied, EDT: d.serviceEDT(s)}
	for _, fe := range s.frontends {
		st.Frontends = append(st.Frontends, FrontendStatus{
			VIP: netip.AddrPortFrom(fe.key.vip, fe.key.port), Protocol: protocolOf(fe.key.proto),
			ServiceID: fe.sid, Eligible: fe.eligible, Backends: len(fe.backends), MaglevSize: fe.size, GuardOpen: fe.guard,
			RepairPending: fe.repair,
		})
	}
	return st
}

func protocolOf(n uint8) Protocol {
	if n == 17 {
		return UDP
	}
	return TCP
}

// wanted lists the frontends of svc with the backends of each one's family.
func wanted(svc Service) []struct {
	key      feKey
	backends []Backend
} {
	var out []struct {
		key      feKey
		backends []Backend
	}
	for _, vip := range svc.VIPs {
		vip = vip.Unmap()
		var bs []Backend
		for _, b := range svc.Backends {
			if b.IsEnabled() && b.Address.Unmap().Is4() == vip.Is4() {
				bs = append(bs, b)
			}
		}
		for _, p := range svc.Ports {
			out = append(out, struct {
				key      feKey
				backends []Backend
			}{feKey{vip, p.Port, p.Protocol.Number()}, bs})
		}
	}
	return out
}

// checkIDs fails with ErrLimit when svc needs more new ids than are free.
func (d *Dataplane) checkIDs(svc Service) error {
	needS, needB := 0, 0
	for _, w := range wanted(svc) {
		fe := d.frontends[w.key]
		if fe == nil || fe.service != svc.Name {
			needS++
		}
		for _, b := range w.backends {
			if fe == nil || fe.service != svc.Name || fe.backends[b.Endpoint()] == 0 {
				needB++
			}
		}
	}
	if needS > d.sids.Available() {
		return fmt.Errorf("%w: %d new frontends, %d service ids free in tier %s", ErrLimit, needS, d.sids.Available(), d.dp.Status().Tier)
	}
	if needB > d.bids.Available() {
		return fmt.Errorf("%w: %d new backend entries, %d backend ids free in tier %s", ErrLimit, needB, d.bids.Available(), d.dp.Status().Tier)
	}
	return nil
}

// program writes svc into the datapath as s, all with d.mu held (the
// restore, rollbacks and health-driven reprograms; ApplyService runs the
// same steps with the table builds outside the lock). others are services
// whose frontends may belong to svc's name too (the service an apply
// replaces, or the one a rollback undoes). The order keeps the maps
// consistent for every packet: backends exist before a table names them,
// a table is swapped in whole, a frontend appears only once its table is
// in place, a new frontend's guard opens last, and backends leave only
// after no table names them.
func (d *Dataplane) program(svc Service, s *service, others ...*service) error {
	p, err := d.prepare(svc, s, others...)
	if err != nil {
		return err
	}
	tables, err := d.buildTables(p)
	if err != nil {
		return err
	}
	defer closeTables(tables)
	if err := d.commit(svc, s, p, tables, others...); err != nil {
		return err
	}
	delete(d.repairs, svc.Name)
	return nil
}

// plan is a change of one service between prepare and commit.
type plan struct {
	frontends []planned
	// remove are the service's frontends that the change drops.
	remove []*frontend
	// health is the effective state of every backend of the intent when
	// prepare ran; commit starts over if a health check changed it since.
	health []BackendState
}

// planned is one frontend of a change: its backends are in the datapath,
// its table is to be built from mb.
type planned struct {
	fe     *frontend
	mb     []maglev.Backend
	listed map[netip.AddrPort]bool
}

// builtTable is a frontend's Maglev table, built and written into a new
// inner map that is not in place yet.
type builtTable struct {
	inner    *ebpf.Map // nil: no eligible backend
	size     uint32    // its slots
	eligible int
}

// frontendsOf lists the frontends of service name that ss know of and
// the datapath still has.
func (d *Dataplane) frontendsOf(name string, ss ...*service) []*frontend {
	var out []*frontend
	for _, s := range ss {
		if s == nil {
			continue
		}
		for _, fe := range s.frontends {
			if fe.service == name && d.frontends[fe.key] == fe && !slices.Contains(out, fe) {
				out = append(out, fe)
			}
		}
	}
	return out
}

// prepare is the first step of a change, with d.mu held: the frontends
// svc needs get their ids (a new frontend's guard is closed), and the
// backends of every frontend are written to fluxvm_backends, new ones
// with new ids. s.frontends becomes svc's frontends.
func (d *Dataplane) prepare(svc Service, s *service, others ...*service) (*plan, error) {
	monoNow, err := conntrack.Now()
	if err != nil {
		return nil, err
	}
	wallNow := time.Now()
	prev := d.withRepairs(svc.Name, d.frontendsOf(svc.Name, append([]*service{s}, others...)...))
	p := &plan{health: d.healthOf(&svc)}
	keep := map[feKey]bool{}
	s.frontends = nil
	for _, w := range wanted(svc) {
		keep[w.key] = true
		fe := d.frontends[w.key]
		if fe != nil && fe.service != svc.Name {
			return p, fmt.Errorf("frontend %s: %w", w.key, ErrConflict)
		}
		if fe == nil {
			fe = &frontend{key: w.key, service: svc.Name, backends: map[netip.AddrPort]uint32{}}
			if fe.sid = d.sids.Get(); fe.sid == 0 {
				return p, fmt.Errorf("frontend %s: %w: no service id left", w.key, ErrLimit)
			}
			// A recycled id starts with zero counters and a closed guard.
			if err := d.resetServiceSlot(fe.sid); err != nil {
				d.sids.Release(fe.sid)
				return p, fmt.Errorf("frontend %s: %w", w.key, err)
			}
			fe.edtKnown = true // resetServiceSlot zeroed it
			d.frontends[w.key] = fe
		}
		s.frontends = append(s.frontends, fe)
		pl, err := d.prepareFrontend(svc, fe, w.backends, monoNow, wallNow)
		if err != nil {
			return p, fmt.Errorf("frontend %s: %w", w.key, err)
		}
		p.frontends = append(p.frontends, pl)
	}
	for _, fe := range prev {
		if !keep[fe.key] {
			p.remove = append(p.remove, fe)
		}
	}
	return p, nil
}

// healthOf is the effective state of every backend of svc. d.mu must be
// held.
func (d *Dataplane) healthOf(svc *Service) []BackendState {
	if svc.HealthCheck == nil {
		return nil
	}
	out := make([]BackendState, len(svc.Backends))
	for i := range svc.Backends {
		out[i] = d.effectiveState(svc, &svc.Backends[i])
	}
	return out
}

// commit is the last step of a change, with d.mu held: the tables built
// for p go in place, then the frontend entries, markers and guards, and
// the backends and frontends the change drops go. If a health check
// changed the effective state of a backend since prepare, it programs svc
// again from the start (program) instead.
func (d *Dataplane) commit(svc Service, s *service, p *plan, tables []builtTable, others ...*service) error {
	c, done, err := d.commitStart(svc, s, p, tables, others...)
	if done || err != nil {
		return err
	}
	if err := swapTables(c.outer, p, tables); err != nil {
		return err
	}
	return d.commitEnd(svc, s, p, tables, c)
}

// commitUnlocked is commit for ApplyService: called with d.mu held, it
// releases the lock while the tables are swapped in, and again while the
// slots of the frontends the change drops are emptied (removeUnlocked,
// as a delete does), and holds it again when it returns. An update of
// fluxvm_maglev (a map of maps) returns only after an RCU grace period,
// so that no program still reads the table it replaced: milliseconds,
// which under d.mu would serialise every apply of the node. Without the
// lock, the grace periods of concurrent applies overlap.
//
// The tables are the service's own, and its other writers wait: changes
// of the same name, and identity policy changes that touch it, hold its
// lock (lockService), and a health-driven reprogram waits while d.busy
// counts the apply. What others may change meanwhile, commitEnd reads
// afresh: the reverse translation index (another service's change may
// move this one's slots down and rewrite its live entry without
// SvcFlagRevStored: refreshRevStored) and the observed health.
func (d *Dataplane) commitUnlocked(svc Service, s *service, p *plan, tables []builtTable, others ...*service) error {
	c, done, err := d.commitStart(svc, s, p, tables, others...)
	if done || err != nil {
		return err
	}
	d.mu.Unlock()
	err = swapTables(c.outer, p, tables)
	d.mu.Lock()
	if err != nil {
		return err
	}
	if !slices.Equal(p.health, d.healthOf(&svc)) {
		// A health check changed a backend while the lock was free.
		return d.program(svc, s, others...)
	}
	if err := d.finishFrontends(svc, s, p, tables, c); err != nil {
		return err
	}
	// The frontends the change drops go as a delete's do.
	return d.removeUnlocked(p.remove)
}

// commitState is what commitStart hands on to the swaps and commitEnd.
type commitState struct {
	outer *ebpf.Map // fluxvm_maglev
	// pacer is the frontend whose departure clock the service's frontends
	// share, and clock the departure time its entry starts from (see
	// pacerClock).
	pacer uint32
	clock uint64
}

// commitStart readies p's frontends for their new tables, with d.mu held
// (readyFrontend). done reports that it programmed svc from the start
// instead (program), because a health check changed the effective state
// of a backend since prepare: nothing is left to do.
func (d *Dataplane) commitStart(svc Service, s *service, p *plan, tables []builtTable, others ...*service) (c commitState, done bool, err error) {
	if !slices.Equal(p.health, d.healthOf(&svc)) {
		return c, true, d.program(svc, s, others...)
	}
	// The service's frontends pace on one clock, that of its frontend
	// with the lowest id (bpf/lib/edt.h), so that max_egress_mbps caps
	// the service.
	for _, pl := range p.frontends {
		if c.pacer == 0 || pl.fe.sid < c.pacer {
			c.pacer = pl.fe.sid
		}
	}
	c.clock = d.pacerClock(svc, p, c.pacer)
	c.outer = d.dp.Maps().FluxvmMaglev
	for _, pl := range p.frontends {
		flags, err := d.readyFrontend(svc, pl, c.pacer, c.clock)
		if err != nil {
			return c, false, fmt.Errorf("frontend %s: %w", pl.fe.key, err)
		}
		if d.beforeSwap != nil {
			d.beforeSwap(pl.fe, flags)
		}
	}
	return c, false, nil
}

// commitEnd finishes p with d.mu held, once its tables are in place: the
// frontend entries, markers and guards (finishFrontends), then the
// frontends the change drops.
func (d *Dataplane) commitEnd(svc Service, s *service, p *plan, tables []builtTable, c commitState) error {
	if err := d.finishFrontends(svc, s, p, tables, c); err != nil {
		return err
	}
	for _, fe := range p.remove {
		if err := d.removeFrontend(fe); err != nil {
			return err
		}
	}
	return nil
}

// finishFrontends writes the frontend entries, markers and guards of p
// (finishFrontend), with d.mu held, once its tables are in place. It
// readies each frontend again first, from the state as it is now (what
// readyFrontend wrote already is left as is), so that it writes the
// flags of now.
func (d *Dataplane) finishFrontends(svc Service, s *service, p *plan, tables []builtTable, c commitState) error {
	for i, pl := range p.frontends {
		flags, err := d.readyFrontend(svc, pl, c.pacer, c.clock)
		if err == nil {
			err = d.finishFrontend(svc, s, pl, tables[i], flags)
		}
		if err != nil {
			return fmt.Errorf("frontend %s: %w", pl.fe.key, err)
		}
	}
	return nil
}

// swapTables puts the tables of p's frontends in place in outer
// (fluxvm_maglev), each as a whole: the complete new inner map replaces
// the old one, or, with no eligible backend, the slot is emptied. It
// reads nothing that d.mu guards, so it may run without it.
func swapTables(outer *ebpf.Map, p *plan, tables []builtTable) error {
	for i, pl := range p.frontends {
		if err := swapTable(outer, pl.fe.sid, tables[i].inner); err != nil {
			return fmt.Errorf("frontend %s: %w", pl.fe.key, err)
		}
	}
	return nil
}

func (k feKey) String() string {
	return fmt.Sprintf("%s/%s", netip.AddrPortFrom(k.vip, k.port), protocolOf(k.proto))
}

// prepareFrontend writes the backends of fe (new ones get ids), lists fe
// for each in the reverse translation index, and returns what its table
// is built from.
func (d *Dataplane) prepareFrontend(svc Service, fe *frontend, backends []Backend, monoNow time.Duration, wallNow time.Time) (planned, error) {
	pl := planned{fe: fe, listed: map[netip.AddrPort]bool{}}
	// A frontend still served east-west with NAT lists new backends too
	// while it changes to DSR or north-south only: until the commit writes
	// its new flags, its flows are learned as east-west flows.
	idx := indexed(&svc) || fe.live && services.Indexed(fe.flags)
	for _, b := range backends {
		ep := b.Endpoint()
		pl.listed[ep] = true
		id := fe.backends[ep]
		if id == 0 {
			if id = d.bids.Get(); id == 0 {
				return pl, fmt.Errorf("%w: no backend id left", ErrLimit)
			}
			fe.backends[ep] = id
		}
		state, drain := bpf.BackendReady, uint64(0)
		// The intent state, with the health overlay (internal/health).
		switch d.effectiveState(&svc, &b) {
		case BackendDraining:
			state = bpf.BackendDraining
			left := b.DrainUntil().Sub(wallNow)
			if left < 0 {
				left = -time.Nanosecond // already passed
				d.staleSockets()
			}
			drain = uint64(monoNow + left)
		case BackendUnhealthy:
			state = bpf.BackendUnhealthy
			// Connected UDP sockets of socket LB cannot leave it by
			// themselves (socklb.go).
			d.staleSockets()
		}
		fam := uint8(bpf.FamilyIPv6)
		if ep.Addr().Unmap().Is4() {
			fam = bpf.FamilyIPv4
		}
		v := bpf.Backend{Addr: bpf.AddrWords(ep.Addr()), Port: bpf.Port(ep.Port()), Family: fam,
			State: uint8(state), ServiceId: fe.sid, DrainUntilNs: drain}
		if err := d.dp.Maps().FluxvmBackends.Put(id, v); err != nil {
			return pl, fmt.Errorf("backend %s: %w", ep, err)
		}
		// Listed in the reverse translation index before any table of fe
		// can name it (be2fe.go).
		if err := d.addSlot(fe, ep, id, idx); err != nil {
			return pl, err
		}
		pl.mb = append(pl.mb, maglev.Backend{ID: id, Addr: ep.Addr().Unmap(), Port: ep.Port(), Proto: fe.key.proto,
			Weight: b.EffectiveWeight(), Ready: state == bpf.BackendReady})
	}
	return pl, nil
}

// readyFrontend is what goes before fe's frontend entry is written, and
// before its new table goes in: its EDT rate, its identity policy's
// header, and SvcFlagRevStored in its live entry when it is past the
// index slots of one of its backends (revStoredOf). It returns the flags
// its entry is to get. pacer is the frontend whose departure clock the
// service's frontends share, and clock the departure time its entry
// starts from when it is written (see pacerClock). Running it again
// writes only what changed since (putEDT, Attach and markRevStored keep
// what is in place). d.mu must be held.
func (d *Dataplane) readyFrontend(svc Service, pl planned, pacer uint32, clock uint64) (uint32, error) {
	fe := pl.fe
	edt, err := d.edtValueOf(&svc)
	if err != nil {
		return 0, err
	}
	if edt.Rate != 0 {
		edt.Pacer = pacer
		if fe.sid == pacer {
			edt.LastDeparture = clock
		}
	}
	// A paced frontend's rate is in place before its flag (edt.go).
	if edt.Rate != 0 {
		if err := d.putEDT(fe, edt); err != nil {
			return 0, err
		}
	}
	// A frontend of a service that enforces an identity policy gets the
	// policy's header before its flag (policy.go).
	pflag, err := d.pol.Attach(svc.Name, fe.sid)
	if err != nil {
		return 0, err
	}
	flags := svcFlags(&svc) | d.revStoredOf(fe) | pflag
	if flags&bpf.SvcFlagRevStored != 0 {
		if err := d.markRevStored(fe); err != nil {
			return 0, err
		}
	}
	return flags, nil
}

// finishFrontend writes fe's frontend entry with flags (from
// readyFrontend), its marker and guard, once its table t is in place, and
// removes the backends that left it. d.mu must be held.
func (d *Dataplane) finishFrontend(svc Service, s *service, pl planned, t builtTable, flags uint32) error {
	fe := pl.fe
	fe.eligible = t.eligible
	fe.size = 0
	if t.inner != nil {
		fe.size = t.size
	}
	val := bpf.SvcValue{ServiceId: fe.sid, Flags: flags, Revision: uint32(s.revision)}
	if err := d.putFrontend(fe.key, val); err != nil {
		return err
	}
	fe.flags, fe.rev, fe.live = flags, val.Revision, true
	if flags&bpf.SvcFlagPolicy == 0 {
		// Its policy's header goes only once the flag is off.
		if err := d.pol.Detach(fe.sid); err != nil {
			return err
		}
	}
	// An unpaced one loses its rate only once its flag is gone.
	if edt, err := d.edtValueOf(&svc); err != nil {
		return err
	} else if edt.Rate == 0 {
		if err := d.putEDT(fe, bpf.EDTValue{}); err != nil {
			return err
		}
	}
	if err := d.addMarker(fe); err != nil {
		return err
	}
	fe.guard = svc.IsEnabled()
	g := bpf.Guard{Revision: uint32(s.revision)}
	if fe.guard {
		g.State = bpf.GuardOpen
	}
	if err := d.dp.Maps().FluxvmSguard.Put(fe.sid, g); err != nil {
		return fmt.Errorf("guard: %w", err)
	}
	fe.repair = false

	// Backends that left the intent go only now that no table names them,
	// and so do their slots in the reverse translation index.
	for ep, id := range fe.backends {
		if !pl.listed[ep] {
			if err := d.dp.Maps().FluxvmBackends.Put(id, bpf.Backend{}); err != nil {
				return fmt.Errorf("remove backend %s: %w", ep, err)
			}
			if err := d.removeSlot(fe, ep); err != nil {
				return err
			}
			delete(fe.backends, ep)
			d.bids.Release(id)
			d.staleSockets()
		}
	}
	return nil
}

// buildTables builds the table of every frontend of p and writes each
// into a new inner map. It needs no lock: the inner maps are new, and the
// Maglev tables come from the dataplane's pool.
func (d *Dataplane) buildTables(p *plan) ([]builtTable, error) {
	out := make([]builtTable, 0, len(p.frontends))
	for _, pl := range p.frontends {
		t, err := d.buildTable(pl.mb)
		if err != nil {
			closeTables(out)
			return nil, fmt.Errorf("frontend %s: %w", pl.fe.key, err)
		}
		out = append(out, t)
	}
	return out, nil
}

// buildTable builds the Maglev table of backends mb and writes it into a
// new inner map with one batch update. The table has maglev.SizeFor(len(mb))
// slots, up to the tier's size: what the frontend needs for an even spread,
// not the tier's largest (a frontend of 3 backends takes 509 slots, 2 KiB,
// instead of 65,537 at tier M); the datapath reads each table's size from
// its inner map.
//
// At most GOMAXPROCS builds run at once, each with a table of the pool
// (kept per size): a table keeps its build scratch, about 10 bytes per
// slot, so the dataplane keeps a few rather than one per frontend.
func (d *Dataplane) buildTable(mb []maglev.Backend) (builtTable, error) {
	size := maglev.SizeFor(len(mb), d.caps.MaglevSize)
	tp := &d.tables
	tp.once.Do(func() {
		tp.sem = make(chan struct{}, runtime.GOMAXPROCS(0))
		tp.free = map[uint32][]*maglev.Table{}
		tp.slots = make([]uint32, d.caps.MaglevSize)
		for i := range tp.slots {
			tp.slots[i] = uint32(i)
		}
	})
	tp.sem <- struct{}{}
	defer func() { <-tp.sem }()
	tp.mu.Lock()
	var t *maglev.Table
	if free := tp.free[size]; len(free) > 0 {
		t, tp.free[size] = free[len(free)-1], free[:len(free)-1]
	}
	tp.mu.Unlock()
	var err error
	if t == nil {
		t, err = maglev.New(maglev.Config{Size: size, Seed: d.opts.MaglevSeed}, mb)
		if err != nil {
			return builtTable{}, err
		}
	} else if err = t.Rebuild(mb); err != nil {
		tp.put(size, t)
		return builtTable{}, err
	}
	defer tp.put(size, t)
	bt := builtTable{size: size}
	for _, c := range t.SlotCounts() {
		if c.Slots > 0 {
			bt.eligible++
		}
	}
	entries := t.Entries()
	if len(entries) == 0 {
		return bt, nil
	}
	ms := d.inner.Copy()
	ms.MaxEntries = size
	inner, err := ebpf.NewMap(ms)
	if err != nil {
		return builtTable{}, fmt.Errorf("maglev table: %w", err)
	}
	if _, err := inner.BatchUpdate(tp.slots[:len(entries)], entries, nil); err != nil {
		inner.Close()
		return builtTable{}, fmt.Errorf("maglev table: fill: %w", err)
	}
	bt.inner = inner
	return bt, nil
}

// tablePool holds the Maglev tables that buildTable builds in, by size.
type tablePool struct {
	once  sync.Once
	sem   chan struct{} // one token per build under way
	slots []uint32      // the inner maps' keys, 0..M−1 for the largest M
	mu    sync.Mutex
	free  map[uint32][]*maglev.Table
}

func (tp *tablePool) put(size uint32, t *maglev.Table) {
	tp.mu.Lock()
	tp.free[size] = append(tp.free[size], t)
	tp.mu.Unlock()
}

func closeTables(ts []builtTable) {
	for _, t := range ts {
		if t.inner != nil {
			t.inner.Close()
		}
	}
}

// swapTable puts the table of datapath service sid in place in outer
// (fluxvm_maglev): the complete new inner map replaces the old one in a
// single update, or the slot is emptied when no backend is eligible
// (inner nil; new flows then drop as no_backend). Either returns only
// after an RCU grace period (the kernel waits for the programs that may
// still read the old table), which concurrent callers share.
func swapTable(outer *ebpf.Map, sid uint32, inner *ebpf.Map) error {
	if swapFault != nil {
		if err := swapFault(sid, inner); err != nil {
			return fmt.Errorf("maglev table: %w", err)
		}
	}
	if inner == nil {
		if err := outer.Delete(sid); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("maglev table: %w", err)
		}
		return nil
	}
	if err := outer.Put(sid, inner); err != nil {
		return fmt.Errorf("maglev table: swap: %w", err)
	}
	return nil
}

// swapFault is for tests alone (nil otherwise): swapTable calls it before
// it updates slot sid of fluxvm_maglev (inner nil: empties it), and fails
// with its error, as a failed map update would, without touching the map.
var swapFault func(sid uint32, inner *ebpf.Map) error

func (d *Dataplane) putFrontend(k feKey, v bpf.SvcValue) error {
	var err error
	if k.vip.Is4() {
		w := bpf.AddrWords(k.vip)
		err = d.dp.PutFrontend4(bpf.SvcKey4{Vip: w[0], Port: bpf.Port(k.port), Proto: k.proto}, v)
	} else {
		err = d.dp.Maps().FluxvmSvc6.Put(bpf.SvcKey6{Vip: bpf.AddrWords(k.vip), Port: bpf.Port(k.port), Proto: k.proto}, v)
	}
	if err != nil {
		return fmt.Errorf("frontend entry: %w", err)
	}
	return nil
}

// lookupFrontend reads the frontend entry of k; ok is false when there is
// none.
func (d *Dataplane) lookupFrontend(k feKey) (v bpf.SvcValue, ok bool, err error) {
	if k.vip.Is4() {
		w := bpf.AddrWords(k.vip)
		err = d.dp.Maps().FluxvmSvc4.Lookup(bpf.SvcKey4{Vip: w[0], Port: bpf.Port(k.port), Proto: k.proto}, &v)
	} else {
		err = d.dp.Maps().FluxvmSvc6.Lookup(bpf.SvcKey6{Vip: bpf.AddrWords(k.vip), Port: bpf.Port(k.port), Proto: k.proto}, &v)
	}
	switch {
	case errors.Is(err, ebpf.ErrKeyNotExist):
		return v, false, nil
	case err != nil:
		return v, false, fmt.Errorf("frontend entry: %w", err)
	}
	return v, true, nil
}

func (d *Dataplane) deleteFrontend(k feKey) error {
	var err error
	if k.vip.Is4() {
		w := bpf.AddrWords(k.vip)
		err = d.dp.DeleteFrontend4(bpf.SvcKey4{Vip: w[0], Port: bpf.Port(k.port), Proto: k.proto})
	} else {
		err = d.dp.Maps().FluxvmSvc6.Delete(bpf.SvcKey6{Vip: bpf.AddrWords(k.vip), Port: bpf.Port(k.port), Proto: k.proto})
	}
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("frontend entry: %w", err)
	}
	return nil
}

// svcFlags are the SvcValue flags of every frontend of svc: where it is
// served and how it forwards. A frontend adds SvcFlagRevStored where the
// reverse translation index says so (revStoredOf, be2fe.go).
func svcFlags(svc *Service) uint32 {
	var f uint32
	switch svc.Exposure {
	case ExposureNorthSouth:
		f |= bpf.SvcFlagNorthSouth | bpf.SvcFlagNoEastWest
	case ExposureBoth:
		f |= bpf.SvcFlagNorthSouth
	}
	if svc.Mode == ModeDSR {
		f |= bpf.SvcFlagDSR
	}
	if svc.HostRouting {
		f |= bpf.SvcFlagHostRouting
	}
	if svc.MaxEgressMbps != 0 {
		f |= bpf.SvcFlagPaced
	}
	return f
}

// markerFlags are the flags of the (VIP, 0, proto) entry shared by the
// frontends fes: the datapath reads only where it is served (for
// fragments), so it is north-south if any of them is, and off the VM
// edges only if all of them are.
func markerFlags(fes []*frontend) uint32 {
	f := uint32(bpf.SvcFlagVIPMarker)
	noEW := len(fes) > 0
	for _, fe := range fes {
		f |= fe.flags & bpf.SvcFlagNorthSouth
		if fe.flags&bpf.SvcFlagNoEastWest == 0 {
			noEW = false
		}
	}
	if noEW {
		f |= bpf.SvcFlagNoEastWest
	}
	return f
}

// addMarker makes sure the (VIP, 0, proto) entry that recognises fragments
// exists with the flags of every frontend on the VIP (fe's may have
// changed); several services may share a VIP, and the marker names the
// first.
func (d *Dataplane) addMarker(fe *frontend) error {
	mk := markerKey{fe.key.vip, fe.key.proto}
	if !slices.Contains(d.markers[mk], fe) {
		d.markers[mk] = append(d.markers[mk], fe)
	}
	return d.putMarker(mk)
}

func (d *Dataplane) putMarker(mk markerKey) error {
	fes := d.markers[mk]
	return d.putFrontend(feKey{mk.vip, 0, mk.proto}, bpf.SvcValue{ServiceId: fes[0].sid, Flags: markerFlags(fes)})
}

func (d *Dataplane) dropMarker(fe *frontend) error {
	mk := markerKey{fe.key.vip, fe.key.proto}
	rest := slices.DeleteFunc(slices.Clone(d.markers[mk]), func(o *frontend) bool { return o == fe })
	if len(rest) == 0 {
		delete(d.markers, mk)
		return d.deleteFrontend(feKey{fe.key.vip, 0, fe.key.proto})
	}
	d.markers[mk] = rest
	return d.putMarker(mk)
}

// removeFrontend takes a frontend out of the datapath, with d.mu held:
// first the entry that makes packets match it (retireFrontend), then its
// table, then its backends and guard (dropFrontend).
func (d *Dataplane) removeFrontend(fe *frontend) error {
	if err := d.retireFrontend(fe); err != nil {
		return err
	}
	if err := swapTable(d.dp.Maps().FluxvmMaglev, fe.sid, nil); err != nil {
		return err
	}
	return d.dropFrontend(fe)
}

// retireFrontend is the first step of removeFrontend: the entry that
// makes packets match fe goes, then its policy header, EDT entry and
// marker. d.mu must be held.
func (d *Dataplane) retireFrontend(fe *frontend) error {
	if err := d.deleteFrontend(fe.key); err != nil {
		return err
	}
	fe.live = false
	if err := d.pol.Detach(fe.sid); err != nil {
		return err
	}
	if err := d.putEDT(fe, bpf.EDTValue{}); err != nil {
		return err
	}
	return d.dropMarker(fe)
}

// dropFrontend is the last step of removeFrontend, once fe's slot of
// fluxvm_maglev is empty: its backends (and their slots in the reverse
// translation index) and guard go, and its ids are released. d.mu must
// be held.
func (d *Dataplane) dropFrontend(fe *frontend) error {
	for ep, id := range fe.backends {
		if err := d.dp.Maps().FluxvmBackends.Put(id, bpf.Backend{}); err != nil {
			return fmt.Errorf("remove backend %s: %w", ep, err)
		}
		if err := d.removeSlot(fe, ep); err != nil {
			return err
		}
		// Forget it as it goes, so that a retry after a failure further
		// on never releases an id twice.
		delete(fe.backends, ep)
		d.bids.Release(id)
		d.staleSockets()
	}
	if err := d.dp.Maps().FluxvmSguard.Put(fe.sid, bpf.Guard{}); err != nil {
		return fmt.Errorf("guard: %w", err)
	}
	delete(d.frontends, fe.key)
	d.sids.Release(fe.sid)
	return nil
}

// resetServiceSlot zeroes the per-service slots of a newly allocated id.
func (d *Dataplane) resetServiceSlot(sid uint32) error {
	if err := d.dp.Maps().FluxvmSguard.Put(sid, bpf.Guard{}); err != nil {
		return fmt.Errorf("guard: %w", err)
	}
	zero := make([]bpf.ServiceStats, ebpf.MustPossibleCPU())
	if err := d.dp.Maps().FluxvmSvcStats.Put(sid, zero); err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	// And unpaced: nothing of a frontend that had the id before remains.
	if err := d.dp.Maps().FluxvmEdt.Put(sid, bpf.EDTValue{}); err != nil {
		return fmt.Errorf("edt entry: %w", err)
	}
	return nil
}

// unprogram removes the frontends of the services ss (one name).
func (d *Dataplane) unprogram(ss ...*service) error {
	if len(ss) == 0 {
		return nil
	}
	for _, fe := range d.frontendsOf(ss[0].intent.Name, ss...) {
		if err := d.removeFrontend(fe); err != nil {
			return err
		}
	}
	return nil
}

// unprogramUnlocked is unprogram for DeleteService: called with d.mu
// held, it takes the frontends of s out of the datapath with
// removeUnlocked. When that fails, the service stays (DeleteService
// fails and keeps it listed and in the catalog), so what already went is
// put back: s is programmed again with the lock held, as an apply's
// rollback does; if that fails too, its frontends are closed
// (failClosed) until it is programmed again.
func (d *Dataplane) unprogramUnlocked(s *service) error {
	err := d.removeUnlocked(d.withRepairs(s.intent.Name, d.frontendsOf(s.intent.Name, s)))
	if err == nil {
		return nil
	}
	if rerr := d.program(s.intent, s); rerr != nil {
		d.failClosed(s.intent.Name, d.frontendsOf(s.intent.Name, s), rerr)
		return fmt.Errorf("%w (and restoring the service failed: %w; its frontends are closed until it is applied again)", err, rerr)
	}
	return fmt.Errorf("%w (the service is kept as it was)", err)
}

// removeUnlocked is removeFrontend for the frontends fes of one service,
// without d.mu while their slots of fluxvm_maglev are emptied: called
// with d.mu held, it retires them all (their entries go first), releases
// the lock while their slots are emptied (each update waits for an RCU
// grace period: see commitUnlocked), and holds it again to drop their
// backends and guards and release their ids. Until then the ids stay
// taken, so no other frontend gets one and puts a table in the slot
// meanwhile; the frontends stay in d.frontends, so another service's
// change that wants one of their keys meanwhile is refused with
// ErrConflict, as it would have been a moment earlier. The caller holds
// the service's lock and counts itself in d.busy, so no other change of
// the service runs meanwhile. On an error it returns with d.mu held and
// the frontends retired, some slots perhaps emptied: the caller programs
// the service again.
func (d *Dataplane) removeUnlocked(fes []*frontend) error {
	if len(fes) == 0 {
		return nil
	}
	for _, fe := range fes {
		if err := d.retireFrontend(fe); err != nil {
			return err
		}
	}
	outer := d.dp.Maps().FluxvmMaglev
	d.mu.Unlock()
	var err error
	for _, fe := range fes {
		if err = swapTable(outer, fe.sid, nil); err != nil {
			err = fmt.Errorf("frontend %s: %w", fe.key, err)
			break
		}
	}
	d.mu.Lock()
	if err != nil {
		return err
	}
	for _, fe := range fes {
		if err := d.dropFrontend(fe); err != nil {
			return err
		}
	}
	return nil
}

// inPlace reports whether every frontend of s is in the datapath as its
// last change left it: its entry written (a failed delete may have
// retired it) and none of the service's frontends closed for repair
// (failClosed). ApplyService does nothing for an unchanged intent only
// then. d.mu must be held.
func (d *Dataplane) inPlace(s *service) bool {
	if len(d.repairs[s.intent.Name]) > 0 {
		return false
	}
	for _, fe := range s.frontends {
		if !fe.live || fe.repair {
			return false
		}
	}
	return true
}

// withRepairs adds to fes, frontends of service name, those of its
// frontends closed for repair (d.repairs) that the datapath still has.
// d.mu must be held.
func (d *Dataplane) withRepairs(name string, fes []*frontend) []*frontend {
	for _, fe := range d.repairs[name] {
		if d.frontends[fe.key] == fe && !slices.Contains(fes, fe) {
			fes = append(fes, fe)
		}
	}
	return fes
}

// failClosed is the last resort of a change that failed and could not
// put back what was there (cause: why not): the frontends fes of service
// name may hold a mix of tables, entries and backends of two intents, so
// their guards are closed (their packets drop as guard_closed, new and
// established flows alike) and they are marked for repair: Status shows
// them (FrontendStatus.RepairPending), the next apply of the service
// programs it even with an unchanged intent, and its next health round
// reprograms it. d.mu must be held.
func (d *Dataplane) failClosed(name string, fes []*frontend, cause error) {
	var errs []error
	if d.repairs == nil {
		d.repairs = map[string][]*frontend{}
	}
	d.repairs[name] = d.withRepairs(name, slices.Clone(fes))
	for _, fe := range fes {
		fe.repair, fe.guard = true, false
		if err := d.dp.Maps().FluxvmSguard.Put(fe.sid, bpf.Guard{Revision: fe.rev}); err != nil {
			errs = append(errs, fmt.Errorf("frontend %s: close guard: %w", fe.key, err))
		}
	}
	d.health.Retry(name)
	d.log.Error("fluxvm: a change failed and putting back what was there failed too; the service's frontends are closed (their packets drop) until it is programmed again",
		"service", name, "frontends", len(fes), "err", cause, "close_err", errors.Join(errs...))
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
