package fluxvm

import (
	"context"
	"fmt"
	"net/netip"
	"reflect"
	"sort"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
	"github.com/fluxvm/servicefabric/intent"
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
	if old != nil && reflect.DeepEqual(old.Intent, svc) && d.prog.InPlace(old) {
		st := d.statusOf(old)
		span.SetAttributes(AttrChanged.Bool(false), AttrRevision.Int64(int64(st.Revision)), AttrFrontends.Int(len(st.Frontends)))
		// Unchanged, but perhaps not saved: the retry of an apply that
		// answered "programmed, but the catalog was not saved" answers
		// only once its record, or a snapshot, is durable (catchUp).
		seq := d.catchUp(old.Seq)
		d.mu.Unlock()
		if err := d.settle(seq); err != nil {
			return st, fmt.Errorf("fluxvm: apply %s: programmed, but the catalog was not saved: %w", svc.Name, err)
		}
		return st, nil
	}
	fp := intent.FootprintOf(&svc)
	var oldFP *intent.Footprint
	if old != nil {
		oldFP = &old.Footprint
	}
	if err := d.index.Check(&svc, &fp, oldFP, d.limits); err != nil {
		d.mu.Unlock()
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	if err := d.prog.CheckIDs(&svc); err != nil {
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
	s := &service{Intent: svc, Revision: d.revision, Applied: time.Now().UTC(), Footprint: fp}
	d.index.Reserve(svc.Name, &fp, oldFP)
	d.reserved[svc.Name] = svc
	d.reservations++
	d.inflight.Add(1)
	defer d.inflight.Done()
	d.busy[svc.Name]++ // health reprograms wait for this apply (recordHealth)

	p, err := d.prog.Prepare(svc, s, old)
	if err == nil {
		// The new tables are this service's own: build and fill them
		// without the lock, and put them in place without it too (each
		// swap waits for the kernel's RCU grace period: services.Programmer.CommitUnlocked).
		d.mu.Unlock()
		var tables services.Tables
		tables, err = d.prog.BuildTables(p)
		d.mu.Lock()
		// The last moment a cancelled apply is undone (the old intent
		// put back below); from the commit on it finishes.
		if err == nil {
			err = ctx.Err()
		}
		if err == nil {
			err = d.prog.CommitUnlocked(svc, s, p, tables, old)
		}
		tables.Close()
	}
	if err != nil {
		// Put back what was there, so that maps and catalog agree.
		var rerr error
		if old != nil {
			rerr = d.prog.Program(old.Intent, old, s)
		} else {
			rerr = d.prog.Unprogram(s)
		}
		if rerr != nil {
			// A mix of the old and new intent must not serve: fail
			// closed until the service is programmed again.
			d.prog.FailClosed(svc.Name, rerr, s, old)
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
	d.prog.Forget(svc.Name)
	d.syncEDTNode()
	d.syncHA()
	d.doneBusy(svc.Name)
	d.syncHealth(svc.Name)
	d.advertise()
	st := d.statusOf(s)
	span.SetAttributes(AttrChanged.Bool(true), AttrRevision.Int64(int64(st.Revision)), AttrFrontends.Int(len(st.Frontends)))
	seq, jerr := d.journal(svc.Name, s)
	s.Seq = seq
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
	err = d.prog.UnprogramUnlocked(s)
	d.doneBusy(name)
	if err != nil {
		d.mu.Unlock()
		return fmt.Errorf("fluxvm: delete %s: %w", name, err)
	}
	delete(d.services, name)
	d.prog.Forget(name)
	d.syncEDTNode()
	d.syncHA()
	d.index.Remove(name, &s.Footprint)
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
	st := ServiceStatus{Service: s.Intent, Revision: s.Revision, AppliedAt: s.Applied, EDT: d.serviceEDT(s)}
	for _, fe := range s.Frontends {
		k := fe.Key()
		st.Frontends = append(st.Frontends, FrontendStatus{
			VIP: netip.AddrPortFrom(k.VIP, k.Port), Protocol: protocolOf(k.Proto),
			ServiceID: fe.ID(), Eligible: fe.Eligible(), Backends: fe.BackendCount(), MaglevSize: fe.TableSize(), GuardOpen: fe.GuardOpen(),
			RepairPending: fe.RepairPending(),
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
