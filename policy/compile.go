package policy

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"

	"github.com/fluxvm/servicefabric/intent"
)

// Errors of the compiler, checkable with errors.Is. Input errors also
// match the intent categories (intent.ErrInvalid, intent.ErrLimit, ...).
var (
	// ErrNoService: a policy names a service the catalog does not have.
	// It wraps intent.ErrPrerequisite.
	ErrNoService = fmt.Errorf("policy: no such service: %w", intent.ErrPrerequisite)
	// ErrNoInterface: an L7 enforce policy names a proxy interface that
	// Input.Interface cannot resolve. It wraps intent.ErrPrerequisite.
	ErrNoInterface = fmt.Errorf("policy: no such proxy interface: %w", intent.ErrPrerequisite)
)

// Limits bound what one Program may hold.
type Limits struct {
	// Policies is the most services with a policy (policy ids 1..Policies).
	Policies int
	// Rules is the most identity rules over all policies (the capacity of
	// fluxvm_spol less one header per policy).
	Rules int
}

// DefaultLimits are the bounds of the datapath's policy maps.
var DefaultLimits = Limits{Policies: 4096, Rules: 65536}

// Input is everything a Program is compiled from.
type Input struct {
	// IPCache maps source prefixes to identities (intent.ValidateIPCache).
	IPCache intent.IPCache
	// Policies, at most one per service.
	Policies []intent.Policy
	// Service returns the catalog's service of that name, or nil.
	Service func(name string) *intent.Service
	// Interface resolves an enabled L7 enforce policy's proxy interface
	// to its ifindex; an error fails the compile (wrapped in
	// ErrNoInterface).
	// 0 with no error means the interface is known to be missing for
	// now: the policy compiles, and its service's new flows drop until
	// a later compile finds it (fail closed; a restore does this). Nil
	// resolves nothing: an enforce policy does not compile.
	Interface func(name string) (uint32, error)
}

// Rule is one identity's verdict under a policy.
type Rule struct {
	Identity intent.Identity
	Action   intent.PolicyAction
}

// Compiled is one service's policy as the datapath applies it.
type Compiled struct {
	// Service is the service's name; ID the policy's id in the datapath
	// (1..Limits.Policies), kept from the previous Program while the
	// service keeps a policy.
	Service string
	ID      uint32
	// Revision changes whenever anything that decides this policy's flows
	// changes (its rules, default, audit, enabled, L7 mode, or the
	// ipcache); a flow admitted under another revision is decided again
	// at its next packet. Never 0.
	Revision uint32
	// Enabled false: the policy is kept but decides nothing.
	Enabled   bool
	Default   intent.PolicyAction
	AuditOnly bool
	// Rules are the identities whose verdict differs from Default (the
	// deny list wins over the allow list), sorted by identity.
	Rules []Rule
	// Unresolved are the listed identities no ipcache entry has: no
	// source can have them now. Sorted; reported, never silently dropped.
	Unresolved []intent.Identity
	// L7, when set, is the policy's L7 part as given.
	L7 *intent.L7Policy
	// ProxyIfindex is, for a policy that Redirects, the ifindex of its
	// proxy interface (Input.Interface); 0 when it is missing (new flows
	// drop).
	ProxyIfindex uint32
	// Policy is the policy as given.
	Policy intent.Policy
}

// Program is a compiled ipcache and policy set: deterministic for its
// Input and the previous Program (ids), applied as one reconcile.
type Program struct {
	// IPv4 and IPv6 are the ipcache's entries by family, sorted by
	// address then prefix length.
	IPv4, IPv6 []intent.IPCacheEntry
	// IPCacheRevision digests the ipcache; part of every Revision.
	IPCacheRevision uint32
	// Policies sorted by service name.
	Policies []Compiled
}

// Policy returns the compiled policy of a service, or nil.
func (p *Program) Policy(service string) *Compiled {
	if p == nil {
		return nil
	}
	i, ok := slices.BinarySearchFunc(p.Policies, service, func(c Compiled, s string) int { return cmp.Compare(c.Service, s) })
	if !ok {
		return nil
	}
	return &p.Policies[i]
}

// Rules returns how many identity rules p holds over all policies.
func (p *Program) Rules() int {
	n := 0
	for i := range p.Policies {
		n += len(p.Policies[i].Rules)
	}
	return n
}

// Compiler compiles Inputs into Programs within its Limits (zero:
// DefaultLimits).
type Compiler struct {
	Limits Limits
}

// Compile checks in completely and compiles it; prev (nil at first) keeps
// every service's policy id stable. It is pure: it reads only its
// arguments, and the same arguments give the same Program. Nothing is
// compiled from a bad input: the first problem is returned, naming the
// field ("policies[2].deny_identities[0]", "ipcache.entries[7].prefix").
func (c Compiler) Compile(in Input, prev *Program) (*Program, error) {
	lim := c.Limits
	if lim == (Limits{}) {
		lim = DefaultLimits
	}
	if err := intent.ValidateIPCache(in.IPCache); err != nil {
		return nil, fmt.Errorf("policy: compile: ipcache: %w", err)
	}
	if len(in.Policies) > lim.Policies {
		return nil, fmt.Errorf("policy: compile: %d policies: %w", len(in.Policies), &intent.ValidationError{Field: "policies",
			Reason: fmt.Sprintf("at most %d services may have a policy", lim.Policies), Kind: intent.ErrLimit})
	}
	out := &Program{}
	ids := make(map[intent.Identity]bool, len(in.IPCache.Entries))
	for _, e := range in.IPCache.Entries {
		ids[e.Identity] = true
		if e.Prefix.Addr().Is4() {
			out.IPv4 = append(out.IPv4, e)
		} else {
			out.IPv6 = append(out.IPv6, e)
		}
	}
	byPrefix := func(a, b intent.IPCacheEntry) int {
		if c := a.Prefix.Addr().Compare(b.Prefix.Addr()); c != 0 {
			return c
		}
		return cmp.Compare(a.Prefix.Bits(), b.Prefix.Bits())
	}
	slices.SortFunc(out.IPv4, byPrefix)
	slices.SortFunc(out.IPv6, byPrefix)
	out.IPCacheRevision = ipcacheDigest(out.IPv4, out.IPv6)

	seen := make(map[string]int, len(in.Policies))
	rules := 0
	for i, p := range in.Policies {
		field := fmt.Sprintf("policies[%d]", i)
		var svc *intent.Service
		if in.Service != nil {
			svc = in.Service(p.Service)
		}
		if svc == nil {
			return nil, fmt.Errorf("policy: compile: %s: service %q: %w", field, p.Service, ErrNoService)
		}
		if err := intent.ValidatePolicyFor(p, svc); err != nil {
			return nil, fmt.Errorf("policy: compile: %s: %w", field, err)
		}
		if j, ok := seen[p.Service]; ok {
			return nil, fmt.Errorf("policy: compile: %s: %w", field, &intent.ValidationError{Field: "service",
				Reason: fmt.Sprintf("service %q already has policies[%d]", p.Service, j), Kind: intent.ErrConflict})
		}
		seen[p.Service] = i
		var ifindex uint32
		if p.L7 != nil && p.L7.Mode == intent.L7Enforce && p.IsEnabled() {
			var err error
			if in.Interface == nil {
				err = errors.New("no resolver")
			} else {
				ifindex, err = in.Interface(p.L7.ProxyInterface)
			}
			if err != nil {
				return nil, fmt.Errorf("policy: compile: %s.l7.proxy_interface: %q: %w: %w", field, p.L7.ProxyInterface, ErrNoInterface, err)
			}
		}
		cp := compileOne(p.Clone(), ids, out.IPCacheRevision, ifindex)
		rules += len(cp.Rules)
		if rules > lim.Rules {
			return nil, fmt.Errorf("policy: compile: %s: %w", field, &intent.ValidationError{Field: "policies",
				Reason: fmt.Sprintf("more than %d identity rules over all policies", lim.Rules), Kind: intent.ErrLimit})
		}
		out.Policies = append(out.Policies, cp)
	}
	slices.SortFunc(out.Policies, func(a, b Compiled) int { return cmp.Compare(a.Service, b.Service) })
	if err := assignIDs(out, prev, lim.Policies); err != nil {
		return nil, err
	}
	return out, nil
}

func compileOne(p intent.Policy, known map[intent.Identity]bool, ipcacheRev, proxy uint32) Compiled {
	c := Compiled{Service: p.Service, Enabled: p.IsEnabled(), Default: p.DefaultAction, AuditOnly: p.AuditOnly, L7: p.L7,
		ProxyIfindex: proxy, Policy: p}
	verdict := make(map[intent.Identity]intent.PolicyAction, len(p.AllowIdentities)+len(p.DenyIdentities))
	for _, id := range p.AllowIdentities {
		verdict[id] = intent.PolicyAllow
	}
	for _, id := range p.DenyIdentities {
		verdict[id] = intent.PolicyDeny // the deny list wins
	}
	for id, a := range verdict {
		if !known[id] {
			c.Unresolved = append(c.Unresolved, id)
		}
		if a != c.Default {
			c.Rules = append(c.Rules, Rule{Identity: id, Action: a})
		}
	}
	slices.SortFunc(c.Rules, func(a, b Rule) int { return cmp.Compare(a.Identity, b.Identity) })
	slices.Sort(c.Unresolved)
	c.Revision = revision(&c, ipcacheRev)
	return c
}

// assignIDs gives each policy its previous id, and new policies the
// lowest free ids in service-name order.
func assignIDs(p, prev *Program, max int) error {
	used := make(map[uint32]bool, len(p.Policies))
	for i := range p.Policies {
		if old := prev.Policy(p.Policies[i].Service); old != nil && old.ID != 0 && int(old.ID) <= max {
			p.Policies[i].ID = old.ID
			used[old.ID] = true
		}
	}
	next := uint32(1)
	for i := range p.Policies {
		if p.Policies[i].ID != 0 {
			continue
		}
		for used[next] {
			next++
		}
		if int(next) > max {
			return fmt.Errorf("policy: compile: %w", &intent.ValidationError{Field: "policies",
				Reason: fmt.Sprintf("no free policy id in 1..%d", max), Kind: intent.ErrLimit})
		}
		p.Policies[i].ID = next
		used[next] = true
	}
	return nil
}

func ipcacheDigest(v4, v6 []intent.IPCacheEntry) uint32 {
	h := fnv.New32a()
	var b [24]byte
	for _, l := range [][]intent.IPCacheEntry{v4, v6} {
		for _, e := range l {
			a := e.Prefix.Addr().As16()
			copy(b[:16], a[:])
			binary.LittleEndian.PutUint32(b[16:], uint32(e.Prefix.Bits()))
			binary.LittleEndian.PutUint32(b[20:], uint32(e.Identity))
			h.Write(b[:])
		}
		h.Write([]byte{0xff}) // the families apart
	}
	return h.Sum32()
}

func revision(c *Compiled, ipcacheRev uint32) uint32 {
	h := fnv.New32a()
	var b [8]byte
	put := func(v uint32) {
		binary.LittleEndian.PutUint32(b[:4], v)
		h.Write(b[:4])
	}
	put(ipcacheRev)
	h.Write([]byte(c.Default))
	flags := uint32(0)
	if c.Enabled {
		flags |= 1
	}
	if c.AuditOnly {
		flags |= 2
	}
	if c.L7 != nil {
		h.Write([]byte(c.L7.Mode))
		h.Write([]byte(c.L7.ProxyInterface))
		put(c.ProxyIfindex)
	}
	put(flags)
	for _, r := range c.Rules {
		put(uint32(r.Identity))
		h.Write([]byte(r.Action))
	}
	if r := h.Sum32(); r != 0 {
		return r
	}
	return 1
}

// Identity returns the identity the ipcache of p gives address a: the
// longest prefix covering it, or intent.IdentityUnknown. The datapath's
// tries decide the same way.
func (p *Program) Identity(a netip.Addr) intent.Identity {
	a = a.Unmap()
	l := p.IPv6
	if a.Is4() {
		l = p.IPv4
	}
	best, bits := intent.IdentityUnknown, -1
	for _, e := range l {
		if e.Prefix.Bits() > bits && e.Prefix.Contains(a) {
			best, bits = e.Identity, e.Prefix.Bits()
		}
	}
	return best
}

// Redirects reports whether the datapath hands c's new flows to an L7
// proxy: an enabled policy with L7 enforce.
func (c *Compiled) Redirects() bool {
	return c.Enabled && c.L7 != nil && c.L7.Mode == intent.L7Enforce
}

// Decide returns what policy c does with a new flow from identity id:
// allow, or deny (before AuditOnly, which forwards a denied flow as
// audited; a disabled policy allows everything).
func (c *Compiled) Decide(id intent.Identity) intent.PolicyAction {
	if !c.Enabled {
		return intent.PolicyAllow
	}
	i, ok := slices.BinarySearchFunc(c.Rules, id, func(r Rule, id intent.Identity) int { return cmp.Compare(r.Identity, id) })
	if ok {
		return c.Rules[i].Action
	}
	return c.Default
}
