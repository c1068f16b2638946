package fluxvm

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/policy"
)

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

// PolicyStatus is the compiled state of one service's identity policy.
type PolicyStatus struct {
	Service string `json:"service"`
	// Enabled false: kept, but not enforced (no frontend has it).
	Enabled bool `json:"enabled"`
	// Revision is what the datapath keeps in the conntrack entry of every
	// flow the policy admitted; a flow admitted under another revision is
	// decided again at its next packet.
	Revision        uint32       `json:"revision"`
	DefaultAction   PolicyAction `json:"default_action"`
	AllowIdentities []Identity   `json:"allow_identities"`
	DenyIdentities  []Identity   `json:"deny_identities"`
	AuditOnly       bool         `json:"audit_only"`
	// Rules is how many identity rules the datapath holds for it: the
	// identities whose verdict differs from the default.
	Rules int `json:"rules"`
	// Unresolved are the listed identities no ipcache entry has: no
	// source has them now, so their rules match nothing.
	Unresolved []Identity `json:"unresolved_identities"`
	// Frontends is how many datapath frontends enforce it.
	Frontends int       `json:"frontends"`
	L7        *L7Policy `json:"l7,omitempty"`
	// ProxyIfindex is, under L7 enforce, the ifindex of the proxy
	// interface new flows are handed to; 0 while it is missing (new
	// flows drop until a reconcile finds it).
	ProxyIfindex *uint32 `json:"proxy_ifindex,omitempty"`
	// Counters are this service's, over its frontends.
	Counters PolicyServiceCounters `json:"counters"`
}

// PolicyServiceCounters count what one service's policy did, over its
// frontends, since each was programmed.
type PolicyServiceCounters struct {
	// Denied counts denied decisions: new flows, and packets of
	// established flows denied at a recheck (revoked).
	Denied uint64 `json:"denied"`
	// Audited counts flows audit_only forwarded though denied.
	Audited uint64 `json:"audited"`
	// L7Redirected counts new flows handed to the L7 proxy.
	L7Redirected uint64 `json:"l7_redirected"`
}

func (c *PolicyServiceCounters) add(o PolicyServiceCounters) {
	c.Denied += o.Denied
	c.Audited += o.Audited
	c.L7Redirected += o.L7Redirected
}

// frontendPolicyCounters reads datapath service sid's policy counts
// (zero when they cannot be read: the status is best effort).
func (d *Dataplane) frontendPolicyCounters(sid uint32) PolicyServiceCounters {
	var per []bpf.ServiceStats
	var c PolicyServiceCounters
	if err := d.dp.Maps().FluxvmSvcStats.Lookup(sid, &per); err != nil {
		return c
	}
	for _, p := range per {
		c.add(PolicyServiceCounters{Denied: p.PolicyDenied, Audited: p.PolicyAudited, L7Redirected: p.L7Redirected})
	}
	return c
}

// PoliciesStatus is the node's identity policy state.
type PoliciesStatus struct {
	// IPCachePrefixes is the number of ipcache entries; IPCacheRevision
	// digests them (part of every policy's revision).
	IPCachePrefixes int    `json:"ipcache_prefixes"`
	IPCacheRevision uint32 `json:"ipcache_revision"`
	// Policies, sorted by service.
	Policies []PolicyStatus `json:"policies"`
	// Counters are node-wide, since the datapath was loaded.
	Counters PolicyCounters `json:"counters"`
}

// PolicyCounters count what policies did, over every service.
type PolicyCounters struct {
	Denied    uint64 `json:"denied"`    // packets dropped: identity denied
	Missing   uint64 `json:"missing"`   // packets dropped: a policy's maps not written (fail closed)
	Audited   uint64 `json:"audited"`   // flows denied but forwarded (audit_only)
	Rechecked uint64 `json:"rechecked"` // packets of established flows decided again (revision moved)
	Revoked   uint64 `json:"revoked"`   // of those, denied
	// L7Redirected counts new flows L7 enforce handed to a proxy;
	// L7Bypass packets the proxies sent on to their VIPs (load-balanced
	// as usual). A loop would show as redirected flows beyond the
	// clients' connections.
	L7Redirected uint64 `json:"l7_redirected"`
	L7Bypass     uint64 `json:"l7_bypass"`
}

// policyState is the dataplane's identity policy state; under d.mu.
type policyState struct {
	// mu serialises policy changes (taken before the service locks and
	// d.mu; see changePolicies).
	mu   sync.Mutex
	w    *policy.Writer
	comp policy.Compiler
	// in is what the last reconcile compiled, prog the result (an empty
	// Program until one is set), set whether one ever was (the catalog
	// records the state only then).
	in   catalogPolicies
	prog *policy.Program
	set  bool
}

// saved is the state the catalog records, or nil.
func (p *policyState) saved() *catalogPolicies {
	if !p.set {
		return nil
	}
	c := catalogPolicies{IPCache: IPCache{Entries: slices.Clone(p.in.IPCache.Entries)}, IDs: map[string]uint32{}}
	for _, pol := range p.in.Policies {
		c.Policies = append(c.Policies, pol.Clone())
	}
	for _, cp := range p.prog.Policies {
		c.IDs[cp.Service] = cp.ID
	}
	return &c
}

// withIDs is a Program that only names the policy ids of ids, for the
// compiler to keep them.
func withIDs(ids map[string]uint32) *policy.Program {
	p := &policy.Program{}
	for name, id := range ids {
		p.Policies = append(p.Policies, policy.Compiled{Service: name, ID: id})
	}
	slices.SortFunc(p.Policies, func(a, b policy.Compiled) int { return strings.Compare(a.Service, b.Service) })
	return p
}

// openPolicies sets up the policy state over the loaded maps, with the
// compiler's bounds from the object.
func (d *Dataplane) openPolicies() error {
	m := d.dp.Maps()
	w, err := policy.NewWriter(policy.Maps{SID4: m.FluxvmSid4, SID6: m.FluxvmSid6, Policies: m.FluxvmSpol})
	if err != nil {
		return fmt.Errorf("fluxvm: %w", err)
	}
	// fluxvm_spol holds every rule, a header per datapath service, and
	// room for one policy's second rule set (bpf/fluxvm_service_maps.bpf.h).
	rules := int(m.FluxvmSpol.MaxEntries()) - int(d.caps.Services) - 2*intent.MaxPolicyIdentities
	d.pol.w = w
	d.pol.comp = policy.Compiler{Limits: policy.Limits{Policies: int(d.caps.Services), Rules: rules}}
	d.pol.prog = &policy.Program{}
	return nil
}

// restorePolicies compiles the catalog's policy state against the
// restored services and writes the ipcache, before the services are
// programmed (readyFrontend attaches each frontend's policy before its
// flag, so a restored service enforces its policy from its first packet).
func (d *Dataplane) restorePolicies(cp *catalogPolicies) error {
	if cp == nil {
		return nil
	}
	// A policy whose service the catalog lacks (its delete was recorded,
	// the policy's removal not) cannot be compiled: it goes, with a
	// warning, rather than keep the node from starting.
	kept := cp.Policies[:0:0]
	for _, pol := range cp.Policies {
		if d.services[pol.Service] == nil {
			d.log.Warn("fluxvm: restore: dropped the identity policy of a service the catalog no longer has", "service", pol.Service)
			continue
		}
		kept = append(kept, pol)
	}
	cp.Policies = kept
	// The interfaces are not attached yet (Open attaches them next, and
	// refreshProxies corrects an index then): a proxy interface resolves
	// by its device alone here, so that a restart leaves the adopted
	// headers as they were. One that cannot be used is 0: new flows drop
	// rather than reach the backends unproxied.
	in := d.policyInput(*cp, nil)
	in.Interface = func(name string) (uint32, error) {
		i, err := d.proxyIfindex(name)
		if err != nil {
			d.log.Warn("fluxvm: restore: L7 enforce: the proxy interface cannot be used; new flows of its services drop until it is attached",
				"interface", name, "err", err)
			return 0, nil
		}
		return i, nil
	}
	prog, err := d.pol.comp.Compile(in, withIDs(cp.IDs))
	if err != nil {
		return fmt.Errorf("fluxvm: restore identity policies: %w", err)
	}
	if err := d.pol.w.SetIPCache(prog); err != nil {
		return fmt.Errorf("fluxvm: restore identity policies: %w", err)
	}
	d.pol.in, d.pol.prog, d.pol.set = *cp, prog, true
	return nil
}

// policyInput is in as the compiler takes it, services from the catalog.
// The proxy interfaces of enforce policies the change adds or alters
// (strict) must resolve and be VM-edge interfaces of the dataplane; those
// of the policies it keeps resolve as they can: a proxy interface gone
// since must not block every other policy change (or a service's
// delete), and its services' new flows drop meanwhile (index 0).
func (d *Dataplane) policyInput(in catalogPolicies, strict map[string]bool) policy.Input {
	return policy.Input{IPCache: in.IPCache, Policies: in.Policies, Service: func(name string) *intent.Service {
		if s := d.services[name]; s != nil {
			return &s.intent
		}
		return nil
	}, Interface: func(name string) (uint32, error) {
		i, err := d.proxyInterface(name)
		if err != nil && !strict[name] {
			d.log.Warn("fluxvm: L7 enforce: the proxy interface cannot be used; new flows of its services drop until it is attached",
				"interface", name, "err", err)
			return 0, nil
		}
		return i, err
	}}
}

// proxyInterface is the index of L7 proxy interface name: a VM-edge
// interface of the dataplane, attached under the index it has now (a
// veth recreated but not attached again has none of our programs: the
// proxy's own connections would not be load-balanced), and a pair whose
// peer is in another namespace. d.mu must be held.
func (d *Dataplane) proxyInterface(name string) (uint32, error) {
	ifc := d.ifaces[name]
	if ifc == nil || ifc.kind != InterfaceVMEdge {
		return 0, fmt.Errorf("interface %q is not a VM-edge interface of the dataplane: %w: attach it (Options.VMEdgeInterfaces, AddInterface) so that the proxy's own connections to the VIP are load-balanced",
			name, ErrPrerequisite)
	}
	i, err := d.proxyIfindex(name)
	if err != nil {
		return 0, err
	}
	if int(i) != ifc.index {
		return 0, fmt.Errorf("interface %q has index %d, but the dataplane attached index %d: %w: attach it again (AddInterface)",
			name, i, ifc.index, ErrPrerequisite)
	}
	return i, nil
}

// strictProxies names the proxy interfaces of the enabled enforce
// policies of next that cur does not have as they are, or whose services
// the caller named (an explicit apply resolves what it applies).
func strictProxies(cur, next []Policy, named []string) map[string]bool {
	out := map[string]bool{}
	for _, p := range next {
		if p.L7 == nil || p.L7.Mode != L7Enforce || !p.IsEnabled() {
			continue
		}
		i := slices.IndexFunc(cur, func(q Policy) bool { return q.Service == p.Service })
		if i < 0 || !reflect.DeepEqual(cur[i], p) || slices.Contains(named, p.Service) {
			out[p.L7.ProxyInterface] = true
		}
	}
	return out
}

// proxyIfindex resolves an L7 proxy interface in the dataplane's
// namespace.
func (d *Dataplane) proxyIfindex(name string) (uint32, error) {
	var i uint32
	err := d.opts.InNamespace(func() error {
		var err error
		i, err = proxyIfindex(name)
		return err
	})
	return i, err
}

// proxyNames are the proxy interfaces the policies redirect to.
func (d *Dataplane) proxyNames() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []string
	for _, c := range d.pol.prog.Policies {
		if c.Redirects() && !slices.Contains(out, c.L7.ProxyInterface) {
			out = append(out, c.L7.ProxyInterface)
		}
	}
	return out
}

// refreshProxies recompiles the policies when one redirects to interface
// name with another index than it would now (the proxy's veth was
// attached again under a new index, or detached: 0): their headers then
// name the new one.
func (d *Dataplane) refreshProxies(name string) error {
	d.mu.Lock()
	want, _ := d.proxyInterface(name)
	stale := false
	for _, c := range d.pol.prog.Policies {
		if c.Redirects() && c.L7.ProxyInterface == name && c.ProxyIfindex != want {
			stale = true
		}
	}
	d.mu.Unlock()
	if !stale {
		return nil
	}
	_, err := d.changePolicies(context.Background(), "refresh the L7 proxy interface "+name, nil, func(*catalogPolicies) error { return nil })
	return err
}

// policyFlags are the frontend flags that turn policy c on (none for nil
// or a disabled policy).
func policyFlags(c *policy.Compiled) uint32 {
	switch {
	case c == nil || !c.Enabled:
		return 0
	case c.Redirects():
		return bpf.SvcFlagPolicy | bpf.SvcFlagL7
	}
	return bpf.SvcFlagPolicy
}

// policyFlag attaches service name's enforced policy, if it has one, to
// datapath service sid and returns the frontend flag that turns it on
// (finishFrontend puts the flag after this). d.mu must be held.
func (d *Dataplane) policyFlag(name string, sid uint32) (uint32, error) {
	c := d.pol.prog.Policy(name)
	if policyFlags(c) == 0 {
		return 0, nil
	}
	if err := d.pol.w.Attach(c, []uint32{sid}); err != nil {
		return 0, err
	}
	return policyFlags(c), nil
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
// applies it. The proxy interfaces of the policies of services named, and
// of those the edit adds or alters, must resolve (strictProxies).
//
// A ctx that ends before the new state is written into the datapath (on
// entry, or while the change waits for another, for the dataplane's lock
// or for the locks of the services it touches) changes nothing and fails
// with an error wrapping ctx's; from the write on, the change finishes,
// catalog included.
func (d *Dataplane) changePolicies(ctx context.Context, what string, named []string, edit func(*catalogPolicies) error) (_ PoliciesStatus, err error) {
	_, span := d.startSpan(ctx, SpanReconcilePolicies)
	defer endSpan(span, &err)
	if err := ctxErr(ctx, what); err != nil {
		return PoliciesStatus{}, err
	}
	// One change at a time; and the services whose policy it may change
	// are locked as their applies lock them, so that no apply is between
	// its check of the policy (ApplyService) and its commit meanwhile.
	d.pol.mu.Lock()
	defer d.pol.mu.Unlock()
	d.mu.Lock()
	if err := d.checkOpen(what); err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, err
	}
	if err := ctxErr(ctx, what); err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, err
	}
	next, err := d.nextPolicies(edit)
	var names []string
	if err == nil {
		for _, s := range [][]Policy{d.pol.in.Policies, next.Policies} {
			for _, p := range s {
				names = append(names, p.Service)
			}
		}
	}
	d.mu.Unlock()
	if err != nil {
		return PoliciesStatus{}, fmt.Errorf("fluxvm: %s: %w", what, err)
	}
	slices.Sort(names)
	for _, name := range slices.Compact(names) {
		defer d.lockService(name)()
	}
	d.mu.Lock()
	if err := d.checkOpen(what); err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, err
	}
	// Again: a DeleteService may have dropped a policy meanwhile.
	if next, err = d.nextPolicies(edit); err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, fmt.Errorf("fluxvm: %s: %w", what, err)
	}
	prog, err := d.pol.comp.Compile(d.policyInput(next, strictProxies(d.pol.in.Policies, next.Policies, named)), d.pol.prog)
	if err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, fmt.Errorf("fluxvm: %s: %w", what, err)
	}
	// The last moment a cancelled change leaves everything as it was.
	if err := ctxErr(ctx, what); err != nil {
		d.mu.Unlock()
		return PoliciesStatus{}, err
	}
	old := d.pol.prog
	if err := d.writePolicies(prog); err != nil {
		// Put back what was there, so that maps and catalog agree.
		if rerr := d.writePolicies(old); rerr != nil {
			d.log.Error("fluxvm: identity policy rollback failed; reconcile again", "err", rerr)
		}
		d.mu.Unlock()
		return PoliciesStatus{}, fmt.Errorf("fluxvm: %s: %w", what, err)
	}
	d.pol.in, d.pol.prog, d.pol.set = next, prog, true
	st := d.policiesStatus()
	span.SetAttributes(AttrPolicies.Int(len(prog.Policies)), AttrRevision.Int64(int64(prog.IPCacheRevision)))
	seq, jerr := d.journalPolicies()
	d.mu.Unlock()
	if jerr == nil {
		jerr = d.persist(seq)
	}
	if jerr != nil {
		return st, fmt.Errorf("fluxvm: %s: applied, but the catalog was not saved: %w", what, jerr)
	}
	unresolved := 0
	for _, p := range st.Policies {
		unresolved += len(p.Unresolved)
	}
	d.log.Info("fluxvm: identity policies applied", "policies", len(st.Policies), "ipcache_prefixes", st.IPCachePrefixes,
		"unresolved_identities", unresolved)
	return st, nil
}

// writePolicies puts prog into the datapath: the ipcache, each enforced
// policy's rules and headers before its frontends' flag, the flag off a
// frontend whose service no longer enforces one before its header goes,
// then what nothing uses. d.mu must be held.
func (d *Dataplane) writePolicies(prog *policy.Program) (err error) {
	// An ipcache change is not one map update: the guards of the services
	// that enforce a policy, before or after, stay closed while the
	// identities and the rules change, so that no packet is decided by a
	// mix of old and new (they drop meanwhile: fail closed).
	if d.pol.w.IPCacheChanges(prog) {
		var closed []*frontend
		defer func() {
			for _, fe := range closed {
				g := bpf.Guard{Revision: fe.rev}
				if fe.guard {
					g.State = bpf.GuardOpen
				}
				if gerr := d.dp.Maps().FluxvmSguard.Put(fe.sid, g); gerr != nil && err == nil {
					err = fmt.Errorf("reopen guard: %w", gerr)
				}
			}
		}()
		for name, s := range d.services {
			old, next := d.pol.prog.Policy(name), prog.Policy(name)
			if (old == nil || !old.Enabled) && (next == nil || !next.Enabled) {
				continue
			}
			for _, fe := range s.frontends {
				if !fe.live || !fe.guard {
					continue
				}
				if err := d.dp.Maps().FluxvmSguard.Put(fe.sid, bpf.Guard{Revision: fe.rev}); err != nil {
					return fmt.Errorf("close guard: %w", err)
				}
				closed = append(closed, fe)
			}
		}
	}
	if err := d.pol.w.SetIPCache(prog); err != nil {
		return err
	}
	keep := map[uint32]bool{}
	for name, s := range d.services {
		c := prog.Policy(name)
		on := policyFlags(c)
		for _, fe := range s.frontends {
			if !fe.live {
				continue
			}
			// The header first (enforce's proxy interface in it), then
			// the flags: a frontend never has SvcFlagL7 before its
			// header does.
			flags := fe.flags &^ (bpf.SvcFlagPolicy | bpf.SvcFlagL7)
			if on != 0 {
				if err := d.pol.w.Attach(c, []uint32{fe.sid}); err != nil {
					return err
				}
				flags |= on
				keep[fe.sid] = true
			}
			if flags != fe.flags {
				if err := d.putFrontend(fe.key, bpf.SvcValue{ServiceId: fe.sid, Flags: flags, Revision: fe.rev}); err != nil {
					return err
				}
				fe.flags = flags
			}
		}
	}
	return d.pol.w.Prune(prog, func(sid uint32) bool { return keep[sid] })
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
	return d.policiesStatus(), nil
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

// policiesStatus is the policy state now. d.mu must be held.
func (d *Dataplane) policiesStatus() PoliciesStatus {
	prog := d.pol.prog
	st := PoliciesStatus{IPCachePrefixes: len(prog.IPv4) + len(prog.IPv6), IPCacheRevision: prog.IPCacheRevision,
		Policies: []PolicyStatus{}}
	for _, c := range prog.Policies {
		ps := PolicyStatus{Service: c.Service, Enabled: c.Enabled, Revision: c.Revision, DefaultAction: c.Default,
			AllowIdentities: slices.Clone(c.Policy.AllowIdentities), DenyIdentities: slices.Clone(c.Policy.DenyIdentities),
			AuditOnly: c.AuditOnly, Rules: len(c.Rules), Unresolved: slices.Clone(c.Unresolved), L7: c.Policy.Clone().L7}
		if c.Redirects() {
			i := c.ProxyIfindex
			ps.ProxyIfindex = &i
		}
		if ps.AllowIdentities == nil {
			ps.AllowIdentities = []Identity{}
		}
		if ps.DenyIdentities == nil {
			ps.DenyIdentities = []Identity{}
		}
		if ps.Unresolved == nil {
			ps.Unresolved = []Identity{}
		}
		if s := d.services[c.Service]; s != nil {
			for _, fe := range s.frontends {
				if fe.live && fe.flags&bpf.SvcFlagPolicy != 0 {
					ps.Frontends++
				}
				if fe.live {
					ps.Counters.add(d.frontendPolicyCounters(fe.sid))
				}
			}
		}
		st.Policies = append(st.Policies, ps)
	}
	if drops, err := bpf.ReadDrops(d.dp.Maps().FluxvmDrops); err == nil {
		st.Counters.Denied, st.Counters.Missing = drops[bpf.DropPolicyDenied], drops[bpf.DropPolicyMissing]
	}
	if c, err := bpf.ReadCounters(d.dp.Maps().FluxvmCounters); err == nil {
		st.Counters.Audited, st.Counters.Rechecked, st.Counters.Revoked =
			c[bpf.CounterPolicyAudited], c[bpf.CounterPolicyRechecked], c[bpf.CounterPolicyRevoked]
		st.Counters.L7Redirected, st.Counters.L7Bypass = c[bpf.CounterL7Redirected], c[bpf.CounterL7Bypass]
	}
	return st
}

// dropPolicyOf removes the policy of service name, deleted with its
// frontends, from the policy state and the maps, and journals the state.
// d.mu must be held.
func (d *Dataplane) dropPolicyOf(name string) (uint64, error) {
	var next catalogPolicies
	if cur := d.pol.saved(); cur != nil {
		next = *cur
	}
	next.Policies = slices.DeleteFunc(next.Policies, func(p Policy) bool { return p.Service == name })
	prog, err := d.pol.comp.Compile(d.policyInput(next, nil), d.pol.prog)
	if err != nil {
		return 0, fmt.Errorf("identity policies without %s: %w", name, err)
	}
	if err := d.writePolicies(prog); err != nil {
		return 0, err
	}
	d.pol.in, d.pol.prog = next, prog
	return d.journalPolicies()
}

// nextPolicies is the policy state edit makes of the current one, sorted,
// sharing nothing with the caller's input. d.mu must be held.
func (d *Dataplane) nextPolicies(edit func(*catalogPolicies) error) (catalogPolicies, error) {
	var next catalogPolicies
	if cur := d.pol.saved(); cur != nil {
		next = *cur
	}
	if err := edit(&next); err != nil {
		return catalogPolicies{}, err
	}
	next.IPCache.Entries = slices.Clone(next.IPCache.Entries)
	for i := range next.Policies {
		next.Policies[i] = next.Policies[i].Clone()
	}
	slices.SortFunc(next.Policies, func(a, b Policy) int { return strings.Compare(a.Service, b.Service) })
	return next, nil
}
