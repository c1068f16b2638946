package fluxvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"sort"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/maglev"
)

// ApplyService creates or updates a service. The request is validated
// against the whole catalog first, so a rejected request changes nothing.
// Applying the same intent again changes nothing either. An update never
// touches conntrack or reverse-NAT state: established flows keep their
// backends as the selection rules say.
func (d *Dataplane) ApplyService(ctx context.Context, svc Service) (ServiceStatus, error) {
	// The dataplane keeps the intent: it must not share the caller's
	// slices and pointers, or a caller that edits its copy afterwards
	// would change the stored intent behind our back.
	svc = svc.Clone()
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("apply " + svc.Name); err != nil {
		return ServiceStatus{}, err
	}
	// The service alone first, so that its errors name its own fields
	// (backends[0].port), then the catalog it would join.
	if err := ValidateService(svc, d.opts.Config); err != nil {
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	next := make([]Service, 0, len(d.services)+1)
	for name, s := range d.services {
		if name != svc.Name {
			next = append(next, s.intent)
		}
	}
	next = append(next, svc)
	if err := validateCatalog(next, d.opts.Config, d.limits, d.legacyNames); err != nil {
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	old := d.services[svc.Name]
	if old != nil && reflect.DeepEqual(old.intent, svc) {
		return d.statusOf(old), nil
	}
	if err := d.checkIDs(svc); err != nil {
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	d.revision++
	s := &service{intent: svc, revision: d.revision, applied: time.Now().UTC()}
	if err := d.program(svc, s); err != nil {
		// Put back what was there, so that maps and catalog agree.
		var rerr error
		if old != nil {
			rerr = d.program(old.intent, old)
		} else {
			rerr = d.unprogram(svc.Name)
		}
		if rerr != nil {
			d.log.Error("fluxvm: rollback failed; guards of the service stay closed", "service", svc.Name, "err", rerr)
		}
		return ServiceStatus{}, fmt.Errorf("fluxvm: apply %s: %w", svc.Name, err)
	}
	d.services[svc.Name] = s
	d.syncHealth(svc.Name)
	d.advertise()
	if err := d.saveCatalog(); err != nil {
		return d.statusOf(s), fmt.Errorf("fluxvm: apply %s: programmed, but the catalog was not saved: %w", svc.Name, err)
	}
	d.log.Info("fluxvm: service applied", "service", svc.Name, "revision", s.revision, "frontends", len(s.frontends))
	return d.statusOf(s), nil
}

// DeleteService removes a service and its frontends. Its flows lose their
// translation; their conntrack entries are collected by GC.
func (d *Dataplane) DeleteService(ctx context.Context, name string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("delete " + name); err != nil {
		return err
	}
	if _, ok := d.services[name]; !ok {
		return fmt.Errorf("fluxvm: delete %s: %w", name, ErrNotFound)
	}
	if err := d.unprogram(name); err != nil {
		return fmt.Errorf("fluxvm: delete %s: %w", name, err)
	}
	delete(d.services, name)
	delete(d.legacyNames, name)
	d.syncHealth(name)
	d.advertise()
	if err := d.saveCatalog(); err != nil {
		return fmt.Errorf("fluxvm: delete %s: removed, but the catalog was not saved: %w", name, err)
	}
	d.log.Info("fluxvm: service deleted", "service", name)
	return nil
}

// Services lists every service, sorted by name.
func (d *Dataplane) Services() []ServiceStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]ServiceStatus, 0, len(d.services))
	for _, s := range d.services {
		out = append(out, d.statusOf(s))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Service.Name < out[j].Service.Name })
	return out
}

// Service returns one service, or an error matching ErrNotFound.
func (d *Dataplane) Service(name string) (ServiceStatus, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	s, ok := d.services[name]
	if !ok {
		return ServiceStatus{}, fmt.Errorf("fluxvm: service %s: %w", name, ErrNotFound)
	}
	return d.statusOf(s), nil
}

func (d *Dataplane) statusOf(s *service) ServiceStatus {
	st := ServiceStatus{Service: s.intent, Revision: s.revision, AppliedAt: s.applied}
	for _, fe := range s.frontends {
		st.Frontends = append(st.Frontends, FrontendStatus{
			VIP: netip.AddrPortFrom(fe.key.vip, fe.key.port), Protocol: protocolOf(fe.key.proto),
			ServiceID: fe.sid, Eligible: fe.eligible, Backends: len(fe.backends), GuardOpen: fe.guard,
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
	if needS > d.sids.available() {
		return fmt.Errorf("%w: %d new frontends, %d service ids free in tier %s", ErrLimit, needS, d.sids.available(), d.dp.Status().Tier)
	}
	if needB > d.bids.available() {
		return fmt.Errorf("%w: %d new backend entries, %d backend ids free in tier %s", ErrLimit, needB, d.bids.available(), d.dp.Status().Tier)
	}
	return nil
}

// program writes svc into the datapath as s. The order keeps the maps
// consistent for every packet: backends exist before a table names them,
// a table is swapped in whole, a frontend appears only once its table is
// in place, a new frontend's guard opens last, and backends leave only
// after no table names them.
func (d *Dataplane) program(svc Service, s *service) error {
	monoNow, err := conntrack.Now()
	if err != nil {
		return err
	}
	wallNow := time.Now()
	keep := map[feKey]bool{}
	s.frontends = s.frontends[:0]
	for _, w := range wanted(svc) {
		keep[w.key] = true
		fe := d.frontends[w.key]
		if fe != nil && fe.service != svc.Name {
			return fmt.Errorf("frontend %s: %w", w.key, ErrConflict)
		}
		if fe == nil {
			fe = &frontend{key: w.key, service: svc.Name, backends: map[netip.AddrPort]uint32{}}
			if fe.sid = d.sids.get(); fe.sid == 0 {
				return fmt.Errorf("frontend %s: %w: no service id left", w.key, ErrLimit)
			}
			// A recycled id starts with zero counters and a closed guard.
			if err := d.resetServiceSlot(fe.sid); err != nil {
				return err
			}
			d.frontends[w.key] = fe
		}
		s.frontends = append(s.frontends, fe)
		if err := d.programFrontend(svc, s, fe, w.backends, monoNow, wallNow); err != nil {
			return fmt.Errorf("frontend %s: %w", w.key, err)
		}
	}
	for key, fe := range d.frontends {
		if fe.service == svc.Name && !keep[key] {
			if err := d.removeFrontend(fe); err != nil {
				return err
			}
		}
	}
	return nil
}

func (k feKey) String() string {
	return fmt.Sprintf("%s/%s", netip.AddrPortFrom(k.vip, k.port), protocolOf(k.proto))
}

func (d *Dataplane) programFrontend(svc Service, s *service, fe *frontend, backends []Backend, monoNow time.Duration, wallNow time.Time) error {
	listed := map[netip.AddrPort]bool{}
	var mb []maglev.Backend
	for _, b := range backends {
		ep := b.Endpoint()
		listed[ep] = true
		id := fe.backends[ep]
		if id == 0 {
			if id = d.bids.get(); id == 0 {
				return fmt.Errorf("%w: no backend id left", ErrLimit)
			}
			fe.backends[ep] = id
		}
		state, drain := bpf.BackendReady, uint64(0)
		// The intent state, with the health overlay (health.go).
		switch d.effectiveState(&svc, &b) {
		case BackendDraining:
			state = bpf.BackendDraining
			left := b.DrainUntil().Sub(wallNow)
			if left < 0 {
				left = -time.Nanosecond // already passed
			}
			drain = uint64(monoNow + left)
		case BackendUnhealthy:
			state = bpf.BackendUnhealthy
		}
		fam := uint8(bpf.FamilyIPv6)
		if ep.Addr().Unmap().Is4() {
			fam = bpf.FamilyIPv4
		}
		v := bpf.Backend{Addr: bpf.AddrWords(ep.Addr()), Port: bpf.Port(ep.Port()), Family: fam,
			State: uint8(state), ServiceId: fe.sid, DrainUntilNs: drain}
		if err := d.dp.Map("fluxvm_backends").Put(id, v); err != nil {
			return fmt.Errorf("backend %s: %w", ep, err)
		}
		mb = append(mb, maglev.Backend{ID: id, Addr: ep.Addr().Unmap(), Port: ep.Port(), Proto: fe.key.proto,
			Weight: b.EffectiveWeight(), Ready: state == bpf.BackendReady})
	}

	var err error
	if d.maglev == nil {
		d.maglev, err = maglev.New(maglev.Config{Size: d.caps.MaglevSize, Seed: d.opts.MaglevSeed}, mb)
	} else {
		err = d.maglev.Rebuild(mb)
	}
	if err != nil {
		return err
	}
	if err := d.swapTable(fe); err != nil {
		return err
	}
	fe.eligible = 0
	for _, c := range d.maglev.SlotCounts() {
		if c.Slots > 0 {
			fe.eligible++
		}
	}

	fe.flags = svcFlags(&svc)
	val := bpf.SvcValue{ServiceId: fe.sid, Flags: fe.flags, Revision: uint32(s.revision)}
	if err := d.putFrontend(fe.key, val); err != nil {
		return err
	}
	if err := d.addMarker(fe); err != nil {
		return err
	}
	fe.guard = svc.IsEnabled()
	g := bpf.Guard{Revision: uint32(s.revision)}
	if fe.guard {
		g.State = bpf.GuardOpen
	}
	if err := d.dp.Map("fluxvm_sguard").Put(fe.sid, g); err != nil {
		return fmt.Errorf("guard: %w", err)
	}

	// Backends that left the intent go only now that no table names them.
	for ep, id := range fe.backends {
		if !listed[ep] {
			if err := d.dp.Map("fluxvm_backends").Put(id, bpf.Backend{}); err != nil {
				return fmt.Errorf("remove backend %s: %w", ep, err)
			}
			delete(fe.backends, ep)
			d.bids.release(id)
		}
	}
	return nil
}

// swapTable programs fe's Maglev table, just built in d.maglev: a
// complete new inner map replaces the old one in a single update, or the
// slot is emptied when no backend is eligible (new flows then drop as
// no_backend).
func (d *Dataplane) swapTable(fe *frontend) error {
	outer := d.dp.Map("fluxvm_maglev")
	entries := d.maglev.Entries()
	if len(entries) == 0 {
		if err := outer.Delete(fe.sid); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("maglev table: %w", err)
		}
		return nil
	}
	inner, err := ebpf.NewMap(d.inner)
	if err != nil {
		return fmt.Errorf("maglev table: %w", err)
	}
	defer inner.Close()
	if len(d.slots) != len(entries) {
		d.slots = make([]uint32, len(entries))
		for i := range d.slots {
			d.slots[i] = uint32(i)
		}
	}
	if _, err := inner.BatchUpdate(d.slots, entries, nil); err != nil {
		return fmt.Errorf("maglev table: fill: %w", err)
	}
	if err := outer.Put(fe.sid, inner); err != nil {
		return fmt.Errorf("maglev table: swap: %w", err)
	}
	return nil
}

func (d *Dataplane) putFrontend(k feKey, v bpf.SvcValue) error {
	var err error
	if k.vip.Is4() {
		w := bpf.AddrWords(k.vip)
		err = d.dp.Map("fluxvm_svc4").Put(bpf.SvcKey4{Vip: w[0], Port: bpf.Port(k.port), Proto: k.proto}, v)
	} else {
		err = d.dp.Map("fluxvm_svc6").Put(bpf.SvcKey6{Vip: bpf.AddrWords(k.vip), Port: bpf.Port(k.port), Proto: k.proto}, v)
	}
	if err != nil {
		return fmt.Errorf("frontend entry: %w", err)
	}
	return nil
}

func (d *Dataplane) deleteFrontend(k feKey) error {
	var err error
	if k.vip.Is4() {
		w := bpf.AddrWords(k.vip)
		err = d.dp.Map("fluxvm_svc4").Delete(bpf.SvcKey4{Vip: w[0], Port: bpf.Port(k.port), Proto: k.proto})
	} else {
		err = d.dp.Map("fluxvm_svc6").Delete(bpf.SvcKey6{Vip: bpf.AddrWords(k.vip), Port: bpf.Port(k.port), Proto: k.proto})
	}
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("frontend entry: %w", err)
	}
	return nil
}

// svcFlags are the SvcValue flags of every frontend of svc: where it is
// served and how it forwards.
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

// removeFrontend takes a frontend out of the datapath: first the entry
// that makes packets match it, then its table, backends and guard.
func (d *Dataplane) removeFrontend(fe *frontend) error {
	if err := d.deleteFrontend(fe.key); err != nil {
		return err
	}
	if err := d.dropMarker(fe); err != nil {
		return err
	}
	if err := d.dp.Map("fluxvm_maglev").Delete(fe.sid); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("maglev table: %w", err)
	}
	for ep, id := range fe.backends {
		if err := d.dp.Map("fluxvm_backends").Put(id, bpf.Backend{}); err != nil {
			return fmt.Errorf("remove backend %s: %w", ep, err)
		}
		// Forget it as it goes, so that a retry after a failure further
		// on never releases an id twice.
		delete(fe.backends, ep)
		d.bids.release(id)
	}
	if err := d.dp.Map("fluxvm_sguard").Put(fe.sid, bpf.Guard{}); err != nil {
		return fmt.Errorf("guard: %w", err)
	}
	delete(d.frontends, fe.key)
	d.sids.release(fe.sid)
	return nil
}

// resetServiceSlot zeroes the per-service slots of a newly allocated id.
func (d *Dataplane) resetServiceSlot(sid uint32) error {
	if err := d.dp.Map("fluxvm_sguard").Put(sid, bpf.Guard{}); err != nil {
		return fmt.Errorf("guard: %w", err)
	}
	zero := make([]bpf.ServiceStats, ebpf.MustPossibleCPU())
	if err := d.dp.Map("fluxvm_svc_stats").Put(sid, zero); err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	return nil
}

func (d *Dataplane) unprogram(name string) error {
	for _, fe := range d.frontends {
		if fe.service == name {
			if err := d.removeFrontend(fe); err != nil {
				return err
			}
		}
	}
	return nil
}

func (d *Dataplane) saveCatalog() error {
	if d.opts.CatalogPath == "" {
		return nil
	}
	cat := catalogFile{Version: catalogVersion}
	names := make([]string, 0, len(d.services))
	for name := range d.services {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		s := d.services[name]
		cs := catalogService{Service: s.intent, Revision: s.revision, AppliedAt: s.applied}
		for _, fe := range s.frontends {
			cf := catalogFrontend{VIP: fe.key.vip, Port: fe.key.port, Protocol: protocolOf(fe.key.proto), ServiceID: fe.sid}
			for ep, id := range fe.backends {
				cf.Backends = append(cf.Backends, catalogBackend{Endpoint: ep, BackendID: id})
			}
			sort.Slice(cf.Backends, func(i, j int) bool { return cf.Backends[i].BackendID < cf.Backends[j].BackendID })
			cs.Frontends = append(cs.Frontends, cf)
		}
		cat.Services = append(cat.Services, cs)
	}
	data, err := json.MarshalIndent(cat, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(d.opts.CatalogPath, data, 0o600)
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
