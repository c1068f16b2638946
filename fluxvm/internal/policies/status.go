package policies

import (
	"slices"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
)

// PolicyStatus is the compiled state of one service's identity policy.
type PolicyStatus struct {
	Service string `json:"service"`
	// Enabled false: kept, but not enforced (no frontend has it).
	Enabled bool `json:"enabled"`
	// Revision is what the datapath keeps in the conntrack entry of every
	// flow the policy admitted; a flow admitted under another revision is
	// decided again at its next packet.
	Revision        uint32              `json:"revision"`
	DefaultAction   intent.PolicyAction `json:"default_action"`
	AllowIdentities []intent.Identity   `json:"allow_identities"`
	DenyIdentities  []intent.Identity   `json:"deny_identities"`
	AuditOnly       bool                `json:"audit_only"`
	// Rules is how many identity rules the datapath holds for it: the
	// identities whose verdict differs from the default.
	Rules int `json:"rules"`
	// Unresolved are the listed identities no ipcache entry has: no
	// source has them now, so their rules match nothing.
	Unresolved []intent.Identity `json:"unresolved_identities"`
	// Frontends is how many datapath frontends enforce it.
	Frontends int              `json:"frontends"`
	L7        *intent.L7Policy `json:"l7,omitempty"`
	// ProxyIfindex is, under L7 enforce, the ifindex of the proxy
	// interface new flows are handed to; 0 while it is missing (new
	// flows drop until a reconcile finds it).
	ProxyIfindex *uint32 `json:"proxy_ifindex,omitempty"`
	// Counters are this service's, over its frontends.
	Counters ServiceCounters `json:"counters"`
}

// ServiceCounters count what one service's policy did, over its
// frontends, since each was programmed.
type ServiceCounters struct {
	// Denied counts denied decisions: new flows, and packets of
	// established flows denied at a recheck (revoked).
	Denied uint64 `json:"denied"`
	// Audited counts flows audit_only forwarded though denied.
	Audited uint64 `json:"audited"`
	// L7Redirected counts new flows handed to the L7 proxy.
	L7Redirected uint64 `json:"l7_redirected"`
}

func (c *ServiceCounters) add(o ServiceCounters) {
	c.Denied += o.Denied
	c.Audited += o.Audited
	c.L7Redirected += o.L7Redirected
}

// Status is the node's identity policy state.
type Status struct {
	// IPCachePrefixes is the number of ipcache entries; IPCacheRevision
	// digests them (part of every policy's revision).
	IPCachePrefixes int    `json:"ipcache_prefixes"`
	IPCacheRevision uint32 `json:"ipcache_revision"`
	// Policies, sorted by service.
	Policies []PolicyStatus `json:"policies"`
	// Counters are node-wide, since the datapath was loaded.
	Counters NodeCounters `json:"counters"`
}

// NodeCounters count what policies did, over every service.
type NodeCounters struct {
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

// Counters reads the policy counters of the datapath.
type Counters interface {
	// Service is what the policy of datapath service sid did (zero
	// when it cannot be read: the status is best effort).
	Service(sid uint32) ServiceCounters
	// Node is what the policies did over every service.
	Node() NodeCounters
}

// MapCounters reads the counters from the datapath's maps: fluxvm_svc_stats
// (per service), fluxvm_drops and fluxvm_counters (node-wide).
type MapCounters struct {
	ServiceStats, Drops, Counters *ebpf.Map
}

// Service sums sid's policy counts over the CPUs.
func (m MapCounters) Service(sid uint32) ServiceCounters {
	var per []bpf.ServiceStats
	var c ServiceCounters
	if err := m.ServiceStats.Lookup(sid, &per); err != nil {
		return c
	}
	for _, p := range per {
		c.add(ServiceCounters{Denied: p.PolicyDenied, Audited: p.PolicyAudited, L7Redirected: p.L7Redirected})
	}
	return c
}

// Node reads the node-wide policy drops and counters (those that cannot
// be read are zero).
func (m MapCounters) Node() NodeCounters {
	var n NodeCounters
	if drops, err := bpf.ReadDrops(m.Drops); err == nil {
		n.Denied, n.Missing = drops[bpf.DropPolicyDenied], drops[bpf.DropPolicyMissing]
	}
	if c, err := bpf.ReadCounters(m.Counters); err == nil {
		n.Audited, n.Rechecked, n.Revoked = c[bpf.CounterPolicyAudited], c[bpf.CounterPolicyRechecked], c[bpf.CounterPolicyRevoked]
		n.L7Redirected, n.L7Bypass = c[bpf.CounterL7Redirected], c[bpf.CounterL7Bypass]
	}
	return n
}

// Status is the policy state now: what was compiled last, with the
// frontends that enforce each policy (Deps.Services) and the counters.
// It runs Deps calls: the caller holds what they need.
func (e *Enforcer) Status() Status {
	e.mu.Lock()
	prog := e.prog
	e.mu.Unlock()
	st := Status{IPCachePrefixes: len(prog.IPv4) + len(prog.IPv6), IPCacheRevision: prog.IPCacheRevision, Policies: []PolicyStatus{}}
	frontends := map[string][]Frontend{}
	for _, fe := range e.svc.Frontends() {
		frontends[fe.Service] = append(frontends[fe.Service], fe)
	}
	for _, c := range prog.Policies {
		ps := PolicyStatus{Service: c.Service, Enabled: c.Enabled, Revision: c.Revision, DefaultAction: c.Default,
			AllowIdentities: orEmpty(c.Policy.AllowIdentities), DenyIdentities: orEmpty(c.Policy.DenyIdentities),
			AuditOnly: c.AuditOnly, Rules: len(c.Rules), Unresolved: orEmpty(c.Unresolved), L7: c.Policy.Clone().L7}
		if c.Redirects() {
			i := c.ProxyIfindex
			ps.ProxyIfindex = &i
		}
		for _, fe := range frontends[c.Service] {
			if fe.Flags&bpf.SvcFlagPolicy != 0 {
				ps.Frontends++
			}
			if e.counts != nil {
				ps.Counters.add(e.counts.Service(fe.SID))
			}
		}
		st.Policies = append(st.Policies, ps)
	}
	if e.counts != nil {
		st.Counters = e.counts.Node()
	}
	return st
}

// orEmpty is a copy of ids, [] rather than nil.
func orEmpty(ids []intent.Identity) []intent.Identity {
	if ids == nil {
		return []intent.Identity{}
	}
	return slices.Clone(ids)
}
