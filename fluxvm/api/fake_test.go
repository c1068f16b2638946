package api_test

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/policy"
)

// fakeDataplane is an in-memory dataplane for handler tests: every role
// but Replication (fakeReplication, fake_ha_test.go). Errors set in
// its fields are returned by the matching method.
type fakeDataplane struct {
	mu         sync.Mutex
	services   map[string]fluxvm.ServiceStatus
	revision   uint64
	applied    []fluxvm.Service // every service ApplyService received
	deleted    []string
	gcRuns     int
	reconciles int
	health     fluxvm.HealthReport
	// ReconcilePressure: its answer or error, and the rounds run.
	pressureRound  fluxvm.PressureRound
	pressureErr    error
	pressureRounds int
	reconcileErr   error
	adverts        advert.Snapshot

	applyErr    error
	statsErr    error
	statusPanic bool
	statusAbort bool // Status panics with http.ErrAbortHandler
	gcErr       error
	// SetSNATPeers: its error.
	snatPeersErr error
	status       fluxvm.Status
	stats        fluxvm.Stats
	vms          map[string]fluxvm.VMStats
	flows        []flows.Record // what Flows returns, before limit and filter
	flowsErr     error
	flowReads    []flowRead      // every Flows call
	lastCtx      context.Context // the context of the last ApplyService or GC

	// Identity policies.
	policies      map[string]fluxvm.Policy
	ipcache       fluxvm.IPCache
	policyApplies [][]fluxvm.Policy // every ApplyPolicies call
	ipcacheSets   []fluxvm.IPCache  // every SetIPCache call
	policyDeletes []string
	policyErr     error // returned by ApplyPolicies and SetIPCache
	policyCounts  fluxvm.PolicyCounters

	// Flow-state replication (fake_ha_test.go).
	ha fakeHA
}

// flowRead is one call of Flows.
type flowRead struct {
	limit  int
	filter flows.Filter
}

// Flows returns the fake's records that f keeps (by service, verdict and
// backend address; since by LastSeen), at most limit.
func (f *fakeDataplane) Flows(_ context.Context, limit int, flt flows.Filter) ([]flows.Record, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.flowReads = append(f.flowReads, flowRead{limit, flt})
	if f.flowsErr != nil {
		return nil, f.flowsErr
	}
	var out []flows.Record
	for _, r := range f.flows {
		if len(out) == limit {
			break
		}
		if (flt.Service == "" || r.Service == flt.Service) && (flt.Verdict == "" || r.Verdict == flt.Verdict) &&
			(!flt.Backend.IsValid() || r.Backend.Addr() == flt.Backend) && (flt.Since.IsZero() || !r.LastSeen.Before(flt.Since)) {
			out = append(out, r)
		}
	}
	return out, nil
}

// roles are every role of the fake: f itself, and its replication.
func (f *fakeDataplane) roles() api.Roles {
	return api.Roles{Services: f, Observer: f, Admin: f, Flows: f, Policies: f, Snapshots: f, Replication: fakeReplication{f}}
}

func newFake() *fakeDataplane {
	return &fakeDataplane{
		services: map[string]fluxvm.ServiceStatus{},
		vms:      map[string]fluxvm.VMStats{},
		policies: map[string]fluxvm.Policy{},
		// The target's cursor at the start of j1, as a snapshot's import
		// leaves it.
		ha: fakeHA{journal: "j1", lastSeq: 5, exportFlows: 3, cursor: ha.Cursor{Journal: "j1"},
			status: fluxvm.HAStatus{Epoch: 3, Interval: fluxvm.Duration{Duration: time.Second}}},
		status: fluxvm.Status{
			SchemaVersion: 4, Generation: 8, Tier: "M", PinRoot: "/sys/fs/bpf/fluxvm/service",
		},
	}
}

func (f *fakeDataplane) ApplyService(ctx context.Context, svc fluxvm.Service) (fluxvm.ServiceStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastCtx = ctx
	f.applied = append(f.applied, svc)
	if f.applyErr != nil {
		return fluxvm.ServiceStatus{}, f.applyErr
	}
	f.revision++
	st := fluxvm.ServiceStatus{
		Service:   svc,
		Revision:  f.revision,
		AppliedAt: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
	}
	for _, vip := range svc.VIPs {
		for _, p := range svc.Ports {
			st.Frontends = append(st.Frontends, fluxvm.FrontendStatus{
				VIP: netip.AddrPortFrom(vip, p.Port), Protocol: p.Protocol, ServiceID: uint32(f.revision),
				Eligible: len(svc.Backends), Backends: len(svc.Backends), GuardOpen: true,
			})
		}
	}
	f.services[svc.Name] = st
	return st, nil
}

func (f *fakeDataplane) DeleteService(_ context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.services[name]; !ok {
		return fmt.Errorf("service %q: %w", name, fluxvm.ErrNotFound)
	}
	delete(f.services, name)
	f.deleted = append(f.deleted, name)
	return nil
}

func (f *fakeDataplane) Services() []fluxvm.ServiceStatus {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []fluxvm.ServiceStatus
	for _, s := range f.services {
		out = append(out, s)
	}
	return out
}

func (f *fakeDataplane) Service(name string) (fluxvm.ServiceStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.services[name]
	if !ok {
		return fluxvm.ServiceStatus{}, fmt.Errorf("service %q: %w", name, fluxvm.ErrNotFound)
	}
	return s, nil
}

func (f *fakeDataplane) Status() fluxvm.Status {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.statusPanic {
		panic("status exploded")
	}
	if f.statusAbort {
		panic(http.ErrAbortHandler)
	}
	st := f.status
	st.Services = len(f.services)
	return st
}

func (f *fakeDataplane) Stats(context.Context) (fluxvm.Stats, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stats, f.statsErr
}

func (f *fakeDataplane) VMStats(_ context.Context, vmID string) (fluxvm.VMStats, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.vms[vmID]
	if !ok {
		return fluxvm.VMStats{}, fmt.Errorf("vm %q: %w", vmID, fluxvm.ErrNotFound)
	}
	return s, nil
}

func (f *fakeDataplane) SetSNATPeers(ctx context.Context, p fluxvm.SNATPeers) (fluxvm.SNATStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastCtx = ctx
	if f.snatPeersErr != nil {
		return fluxvm.SNATStatus{}, f.snatPeersErr
	}
	f.status.SNAT.Peers, f.status.SNAT.Announced = slices.Clone(p.Addresses), slices.Clone(p.Announce)
	return f.status.SNAT, nil
}

func (f *fakeDataplane) GC(ctx context.Context) (fluxvm.GCResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastCtx = ctx
	f.gcRuns++
	if f.gcErr != nil {
		return fluxvm.GCResult{}, f.gcErr
	}
	res := fluxvm.GCResult{
		At: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Duration: 1500 * time.Microsecond,
		Scanned: 10, Expired: 3, Drained: 1,
	}
	f.status.LastGC = &res
	return res, nil
}

func (f *fakeDataplane) Health() fluxvm.HealthReport {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.health
}

func (f *fakeDataplane) ReconcileHealth(context.Context) (fluxvm.HealthReport, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reconciles++
	if f.reconcileErr != nil {
		return fluxvm.HealthReport{}, f.reconcileErr
	}
	return f.health, nil
}

func (f *fakeDataplane) ReconcilePressure(context.Context) (fluxvm.PressureRound, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pressureRounds++
	if f.pressureErr != nil {
		return fluxvm.PressureRound{}, f.pressureErr
	}
	return f.pressureRound, nil
}

func (f *fakeDataplane) Advertisements() advert.Snapshot {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.adverts.Clone()
}

// policiesLocked is the fake's policy state. f.mu must be held.
func (f *fakeDataplane) policiesLocked() fluxvm.PoliciesStatus {
	known := map[fluxvm.Identity]bool{}
	for _, e := range f.ipcache.Entries {
		known[e.Identity] = true
	}
	st := fluxvm.PoliciesStatus{IPCachePrefixes: len(f.ipcache.Entries), IPCacheRevision: uint32(len(f.ipcacheSets)),
		Counters: f.policyCounts}
	names := make([]string, 0, len(f.policies))
	for n := range f.policies {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		p := f.policies[n]
		ps := fluxvm.PolicyStatus{Service: n, Enabled: p.IsEnabled(), Revision: uint32(len(f.policyApplies)),
			DefaultAction: p.DefaultAction, AllowIdentities: p.AllowIdentities, DenyIdentities: p.DenyIdentities,
			AuditOnly: p.AuditOnly, L7: p.L7}
		for _, l := range [][]fluxvm.Identity{p.AllowIdentities, p.DenyIdentities} {
			for _, id := range l {
				if !known[id] && !slices.Contains(ps.Unresolved, id) {
					ps.Unresolved = append(ps.Unresolved, id)
				}
			}
		}
		slices.Sort(ps.Unresolved)
		if s, ok := f.services[n]; ok && ps.Enabled {
			ps.Frontends = len(s.Frontends)
		}
		st.Policies = append(st.Policies, ps)
	}
	return st
}

func (f *fakeDataplane) Policies(context.Context) (fluxvm.PoliciesStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.policiesLocked(), nil
}

func (f *fakeDataplane) Policy(_ context.Context, service string) (fluxvm.PolicyStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, p := range f.policiesLocked().Policies {
		if p.Service == service {
			return p, nil
		}
	}
	return fluxvm.PolicyStatus{}, fmt.Errorf("fluxvm: policy of %q: %w", service, fluxvm.ErrNotFound)
}

func (f *fakeDataplane) ApplyPolicies(ctx context.Context, policies ...fluxvm.Policy) (fluxvm.PoliciesStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastCtx = ctx
	f.policyApplies = append(f.policyApplies, policies)
	if f.policyErr != nil {
		return fluxvm.PoliciesStatus{}, f.policyErr
	}
	for _, p := range policies {
		if _, ok := f.services[p.Service]; !ok {
			return fluxvm.PoliciesStatus{}, fmt.Errorf("fluxvm: apply identity policies: policy: compile: service %q: %w", p.Service, policy.ErrNoService)
		}
	}
	for _, p := range policies {
		f.policies[p.Service] = p.Clone()
	}
	return f.policiesLocked(), nil
}

func (f *fakeDataplane) SetIPCache(ctx context.Context, ipc fluxvm.IPCache) (fluxvm.PoliciesStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastCtx = ctx
	f.ipcacheSets = append(f.ipcacheSets, ipc)
	if f.policyErr != nil {
		return fluxvm.PoliciesStatus{}, f.policyErr
	}
	f.ipcache = ipc
	return f.policiesLocked(), nil
}

func (f *fakeDataplane) DeletePolicy(_ context.Context, service string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.policies[service]; !ok {
		return fmt.Errorf("fluxvm: delete the identity policy of %s: service %q has no identity policy: %w", service, service, fluxvm.ErrNotFound)
	}
	delete(f.policies, service)
	f.policyDeletes = append(f.policyDeletes, service)
	return nil
}

func (f *fakeDataplane) Envoy(service string) (fluxvm.EnvoyDocument, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.policies[service]
	if !ok || p.L7 == nil {
		return fluxvm.EnvoyDocument{}, fmt.Errorf("fluxvm: l7 document of %q: %w", service, fluxvm.ErrNotFound)
	}
	return fluxvm.EnvoyDocument{Service: service, Mode: p.L7.Mode, Protocol: p.L7.Protocol, Listeners: []fluxvm.EnvoyListener{},
		Cluster: fluxvm.EnvoyCluster{Name: service, Endpoints: []fluxvm.EnvoyEndpoint{}}}, nil
}
