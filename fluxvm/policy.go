package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/fluxvm/internal/policies"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/policy"
)

// Identity policy, L7 enforce included: package fluxvm/internal/policies
// (policies.Enforcer, d.pol) holds the compiled state and writes the
// policy maps; this file wires it to the dataplane. The facade serialises
// policy changes (polMu, then the locks of the services they touch, then
// d.mu) and calls the component under d.mu: its locks come after d.mu, and
// the views it calls back (policyView) run under the caller's d.mu and
// take no lock. Programming attaches a frontend's policy before its flag
// (readyFrontend: Enforcer.Attach) and detaches it after (Detach).

// Identity policy types (aliases of package intent's).
type (
	Policy       = intent.Policy
	PolicyAction = intent.PolicyAction
	Identity     = intent.Identity
	IPCache      = intent.IPCache
	IPCacheEntry = intent.IPCacheEntry
	L7Policy     = intent.L7Policy
	L7Mode       = intent.L7Mode
	L7Protocol   = intent.L7Protocol
)

// Identity policy constants (package intent's).
const (
	PolicyAllow     = intent.PolicyAllow
	PolicyDeny      = intent.PolicyDeny
	IdentityUnknown = intent.IdentityUnknown
	L7Observe       = intent.L7Observe
	L7Enforce       = intent.L7Enforce
	L7HTTP          = intent.L7HTTP
	L7GRPC          = intent.L7GRPC
)

// The identity policy status types (package fluxvm/internal/policies').
type (
	// PoliciesStatus is the node's identity policy state.
	PoliciesStatus = policies.Status
	// PolicyStatus is the compiled state of one service's identity
	// policy.
	PolicyStatus = policies.PolicyStatus
	// PolicyServiceCounters count what one service's policy did, over
	// its frontends, since each was programmed.
	PolicyServiceCounters = policies.ServiceCounters
	// PolicyCounters count what policies did, over every service.
	PolicyCounters = policies.NodeCounters
)

// openPolicies makes the identity policy component over the loaded
// maps (the Writer adopts what they hold), with the compiler's bounds
// from the object.
func (d *Dataplane) openPolicies() error {
	m := d.dp.Maps()
	w, err := policy.NewWriter(policy.Maps{SID4: m.FluxvmSid4, SID6: m.FluxvmSid6, Policies: m.FluxvmSpol})
	if err != nil {
		return fmt.Errorf("fluxvm: %w", err)
	}
	view := policyView{d}
	d.pol, err = policies.New(policies.Config{Services: int(d.caps.Services), PolicyEntries: int(m.FluxvmSpol.MaxEntries()),
		InNamespace: d.opts.InNamespace, Logger: d.log},
		policies.Deps{Writer: w, Services: view, Interfaces: view, Journal: d.journalPolicies,
			Counters: policies.MapCounters{ServiceStats: m.FluxvmSvcStats, Drops: m.FluxvmDrops, Counters: m.FluxvmCounters}})
	if err != nil {
		return fmt.Errorf("fluxvm: %w", err)
	}
	return nil
}

// refreshProxies recompiles the policies when one redirects to interface
// name with another index than it would now (policies.Enforcer.Stale):
// their headers then name the new one.
func (d *Dataplane) refreshProxies(name string) error {
	d.mu.Lock()
	stale := d.pol.Stale(name)
	d.mu.Unlock()
	if !stale {
		return nil
	}
	_, err := d.changePolicies(context.Background(), "refresh the L7 proxy interface "+name, nil, func(*catalogPolicies) error { return nil })
	return err
}

// ReconcilePolicies replaces the node's ipcache and every identity policy
// with ipc and policies, as one reconcile: everything is checked and
// compiled first (the first problem is returned, naming the field, and
// nothing changes), then the maps are written so that no packet meets
// half a policy (package policy's Writer). Flows already admitted are
// decided again at their next packet when their policy's revision moved,
// which it does whenever anything deciding them changed, the ipcache
// included. It returns once the change is durable in the catalog.
func (d *Dataplane) ReconcilePolicies(ctx context.Context, ipc IPCache, policies []Policy) (PoliciesStatus, error) {
	if err := d.opened("reconcile policies"); err != nil {
		return PoliciesStatus{}, err
	}
	return d.changePolicies(ctx, "reconcile identity policies", nil, func(cur *catalogPolicies) error {
		cur.IPCache = ipc
		cur.Policies = policies
		return nil
	})
}

// ApplyPolicies adds or replaces the policies of the services they name,
// keeping the others and the ipcache; as ReconcilePolicies otherwise.
func (d *Dataplane) ApplyPolicies(ctx context.Context, policies ...Policy) (PoliciesStatus, error) {
	if err := d.opened("apply policies"); err != nil {
		return PoliciesStatus{}, err
	}
	// Each policy on its own first, so that errors name the caller's
	// index (policies[2].deny_identities[0]).
	seen := map[string]int{}
	for i, p := range policies {
		if err := intent.ValidatePolicy(p); err != nil {
			return PoliciesStatus{}, fmt.Errorf("fluxvm: apply identity policies: policies[%d]: %w", i, err)
		}
		if j, ok := seen[p.Service]; ok {
			return PoliciesStatus{}, fmt.Errorf("fluxvm: apply identity policies: policies[%d]: service %q already has policies[%d]: %w",
				i, p.Service, j, ErrConflict)
		}
		seen[p.Service] = i
	}
	named := make([]string, 0, len(policies))
	for _, p := range policies {
		named = append(named, p.Service)
	}
	return d.changePolicies(ctx, "apply identity policies", named, func(cur *catalogPolicies) error {
		for _, p := range policies {
			i := slices.IndexFunc(cur.Policies, func(q Policy) bool { return q.Service == p.Service })
			if i >= 0 {
				cur.Policies[i] = p
			} else {
				cur.Policies = append(cur.Policies, p)
			}
		}
		return nil
	})
}

// SetIPCache replaces the ipcache, keeping the policies; as
// ReconcilePolicies otherwise.
func (d *Dataplane) SetIPCache(ctx context.Context, ipc IPCache) (PoliciesStatus, error) {
	if err := d.opened("set ipcache"); err != nil {
		return PoliciesStatus{}, err
	}
	return d.changePolicies(ctx, "set the ipcache", nil, func(cur *catalogPolicies) error {
		cur.IPCache = ipc
		return nil
	})
}

// DeletePolicy removes the identity policy of service: its frontends stop
// deciding by identity. ErrNotFound when it has none.
func (d *Dataplane) DeletePolicy(ctx context.Context, service string) error {
	if err := d.opened("delete policy"); err != nil {
		return err
	}
	_, err := d.changePolicies(ctx, "delete the identity policy of "+service, nil, func(cur *catalogPolicies) error {
		i := slices.IndexFunc(cur.Policies, func(q Policy) bool { return q.Service == service })
		if i < 0 {
			return fmt.Errorf("service %q has no identity policy: %w", service, ErrNotFound)
		}
		cur.Policies = slices.Delete(cur.Policies, i, i+1)
		return nil
	})
	return err
}

// changePolicies compiles the state edit makes of the current one and
// applies it (policies.Enforcer.Change). The proxy interfaces of the
// policies of services named, and of those the edit adds or alters, must
// resolve.
//
// A ctx that ends before the new state is written into the datapath (on
// entry, or while the change waits for another, for the dataplane's lock
// or for the locks of the services it touches) changes nothing and fails
// with an error wrapping ctx's; from the write on, the change finishes,
// catalog included.
func (d *Dataplane) changePolicies(ctx context.Context, what string, named []string, edit policies.Edit) (_ PoliciesStatus, err error) {
	_, span := d.startSpan(ctx, SpanReconcilePolicies)
	defer endSpan(span, &err)
	if err := ctxErr(ctx, what); err != nil {
		return PoliciesStatus{}, err
	}
	// One change at a time; and the services whose policy it may change
	// are locked as their applies lock them, so that no apply is between
	// its check of the policy (ApplyService) and its commit meanwhile.
	d.polMu.Lock()
	defer d.polMu.Unlock()
	d.mu.Lock()
	if err := d.checkOpen(what); err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, err
	}
	if err := ctxErr(ctx, what); err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, err
	}
	names, err := d.pol.Involved(edit)
	d.mu.Unlock()
	if err != nil {
		return PoliciesStatus{}, fmt.Errorf("fluxvm: %s: %w", what, err)
	}
	for _, name := range names {
		defer d.lockService(name)()
	}
	d.mu.Lock()
	if err := d.checkOpen(what); err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, err
	}
	// The last moment a cancelled change leaves everything as it was.
	if err := ctxErr(ctx, what); err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, err
	}
	// Change edits the state again: a DeleteService may have dropped a
	// policy meanwhile.
	seq, err := d.pol.Change(edit, named)
	if err != nil && !errors.Is(err, policies.ErrUnsaved) {
		d.mu.Unlock()
		return PoliciesStatus{}, fmt.Errorf("fluxvm: %s: %w", what, err)
	}
	st := d.pol.Status()
	span.SetAttributes(AttrPolicies.Int(len(st.Policies)), AttrRevision.Int64(int64(st.IPCacheRevision)))
	d.mu.Unlock()
	if err == nil {
		if perr := d.persist(seq); perr != nil {
			err = fmt.Errorf("%w: %w", policies.ErrUnsaved, perr)
		}
	}
	if err != nil {
		return st, fmt.Errorf("fluxvm: %s: %w", what, err)
	}
	unresolved := 0
	for _, p := range st.Policies {
		unresolved += len(p.Unresolved)
	}
	d.log.Info("fluxvm: identity policies applied", "policies", len(st.Policies), "ipcache_prefixes", st.IPCachePrefixes,
		"unresolved_identities", unresolved)
	return st, nil
}

// Policies reports the node's identity policy state (its counters read
// from the datapath). A ctx that ended before the read fails with an
// error wrapping ctx's.
func (d *Dataplane) Policies(ctx context.Context) (PoliciesStatus, error) {
	if err := d.begin(ctx, "policies"); err != nil {
		return PoliciesStatus{}, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("policies"); err != nil {
		return PoliciesStatus{}, err
	}
	if err := ctxErr(ctx, "policies"); err != nil {
		return PoliciesStatus{}, err
	}
	return d.pol.Status(), nil
}

// Policy reports the identity policy of service: ErrNotFound when it has
// none. A ctx that ended before the read fails with an error wrapping
// ctx's.
func (d *Dataplane) Policy(ctx context.Context, service string) (PolicyStatus, error) {
	if err := d.begin(ctx, "policy"); err != nil {
		return PolicyStatus{}, err
	}
	st, err := d.Policies(ctx)
	if err != nil {
		return PolicyStatus{}, err
	}
	for _, p := range st.Policies {
		if p.Service == service {
			return p, nil
		}
	}
	return PolicyStatus{}, fmt.Errorf("fluxvm: policy of %q: %w", service, ErrNotFound)
}

// journalPolicies records the policy state st in the catalog
// (policies.Deps.Journal). d.mu must be held.
func (d *Dataplane) journalPolicies(st *catalogPolicies) (uint64, error) {
	return d.appendRecord(catalog.Record{Policies: st})
}

// policyView is the view of the services and interfaces the policy
// component declares (policies.Services, policies.Interfaces). Its
// methods run under the caller's d.mu and take no lock.
type policyView struct{ d *Dataplane }

// Service is the intent of service name, or nil.
func (v policyView) Service(name string) *Service {
	if s := v.d.services[name]; s != nil {
		return &s.Intent
	}
	return nil
}

// Frontends are the live frontends of every service.
func (v policyView) Frontends() []policies.Frontend {
	var out []policies.Frontend
	for name, s := range v.d.services {
		for _, fe := range s.Frontends {
			if fe.Live() {
				out = append(out, policies.Frontend{Service: name, SID: fe.ID(), Flags: fe.Flags()})
			}
		}
	}
	return out
}

// SetPolicyFlags writes the live entry of frontend sid of service with
// on as its policy flags (services.Programmer.SetPolicyFlags).
func (v policyView) SetPolicyFlags(service string, sid uint32, on uint32) error {
	s := v.d.services[service]
	if s == nil {
		return fmt.Errorf("service %q: %w", service, ErrNotFound)
	}
	return v.d.prog.SetPolicyFlags(s, sid, on)
}

// CloseGuards closes the guards of the live guarded frontends of
// services; reopen opens them again (services.Programmer.CloseGuards).
func (v policyView) CloseGuards(names []string) (func() error, error) {
	var ss []*service
	for _, name := range names {
		if s := v.d.services[name]; s != nil {
			ss = append(ss, s)
		}
	}
	return v.d.prog.CloseGuards(ss)
}

// VMEdge is the index VM-edge interface name is attached under.
func (v policyView) VMEdge(name string) (int, bool) {
	ifc := v.d.ifaces[name]
	if ifc == nil || ifc.kind != InterfaceVMEdge {
		return 0, false
	}
	return ifc.index, true
}
