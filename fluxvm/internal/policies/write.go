package policies

import (
	"fmt"
	"reflect"
	"slices"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/policy"
)

// input is in as the compiler takes it: the services from Deps.Services,
// the proxy interfaces through resolve.
func (e *Enforcer) input(in State, resolve func(string) (uint32, error)) policy.Input {
	return policy.Input{IPCache: in.IPCache, Policies: in.Policies, Service: e.svc.Service, Interface: resolve}
}

// resolver resolves proxy interfaces as a change does: those of strict
// must resolve (ProxyInterface); the others resolve as they can, so that
// a proxy interface gone since does not block every other policy change
// (or a service's delete): its services' new flows drop meanwhile (index
// 0).
func (e *Enforcer) resolver(strict map[string]bool) func(string) (uint32, error) {
	return func(name string) (uint32, error) {
		i, err := e.ProxyInterface(name)
		if err != nil && !strict[name] {
			e.log.Warn("fluxvm: L7 enforce: the proxy interface cannot be used; new flows of its services drop until it is attached",
				"interface", name, "err", err)
			return 0, nil
		}
		return i, err
	}
}

// ProxyInterface is the index of L7 proxy interface name: a VM-edge
// interface of the dataplane (Deps.Interfaces), attached under the index
// it has now (a veth recreated but not attached again has none of the
// dataplane's programs: the proxy's own connections would not be
// load-balanced), and a pair whose peer is in another namespace
// (Deps.Device). It runs Deps calls: the caller holds what they need.
func (e *Enforcer) ProxyInterface(name string) (uint32, error) {
	index, ok := e.ifaces.VMEdge(name)
	if !ok {
		return 0, fmt.Errorf("interface %q is not a VM-edge interface of the dataplane: %w: attach it (Options.VMEdgeInterfaces, AddInterface) so that the proxy's own connections to the VIP are load-balanced",
			name, intent.ErrPrerequisite)
	}
	i, err := e.device(name)
	if err != nil {
		return 0, err
	}
	if int(i) != index {
		return 0, fmt.Errorf("interface %q has index %d, but the dataplane attached index %d: %w: attach it again (AddInterface)",
			name, i, index, intent.ErrPrerequisite)
	}
	return i, nil
}

// strictProxies names the proxy interfaces of the enabled enforce
// policies of next that cur does not have as they are, or whose services
// the caller named (an explicit apply resolves what it applies).
func strictProxies(cur, next []intent.Policy, named []string) map[string]bool {
	out := map[string]bool{}
	for _, p := range next {
		if p.L7 == nil || p.L7.Mode != intent.L7Enforce || !p.IsEnabled() {
			continue
		}
		i := slices.IndexFunc(cur, func(q intent.Policy) bool { return q.Service == p.Service })
		if i < 0 || !reflect.DeepEqual(cur[i], p) || slices.Contains(named, p.Service) {
			out[p.L7.ProxyInterface] = true
		}
	}
	return out
}

// ProxyNames are the proxy interfaces the policies redirect to.
func (e *Enforcer) ProxyNames() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []string
	for _, c := range e.prog.Policies {
		if c.Redirects() && !slices.Contains(out, c.L7.ProxyInterface) {
			out = append(out, c.L7.ProxyInterface)
		}
	}
	return out
}

// Stale reports whether a policy redirects to interface name with
// another index than it would now (the proxy's veth was attached again
// under a new index, or detached: 0): a Change with no edit then writes
// the new one in their headers. It runs Deps calls.
func (e *Enforcer) Stale(name string) bool {
	var have []uint32
	e.mu.Lock()
	for _, c := range e.prog.Policies {
		if c.Redirects() && c.L7.ProxyInterface == name {
			have = append(have, c.ProxyIfindex)
		}
	}
	e.mu.Unlock()
	if len(have) == 0 {
		return false
	}
	want, _ := e.ProxyInterface(name)
	return slices.ContainsFunc(have, func(i uint32) bool { return i != want })
}

// write puts prog into the datapath, cur being what is there: the
// ipcache, each enforced policy's rules and headers before its frontends'
// flags, the flags off a frontend whose service no longer enforces one
// before its header goes, then what nothing uses. Called under wmu.
func (e *Enforcer) write(cur, prog *policy.Program) (err error) {
	// An ipcache change is not one map update: the guards of the services
	// that enforce a policy, before or after, stay closed while the
	// identities and the rules change, so that no packet is decided by a
	// mix of old and new (they drop meanwhile: fail closed).
	if e.w.IPCacheChanges(prog) {
		var names []string
		for _, p := range []*policy.Program{cur, prog} {
			for _, c := range p.Policies {
				if c.Enabled && !slices.Contains(names, c.Service) {
					names = append(names, c.Service)
				}
			}
		}
		reopen, err := e.svc.CloseGuards(names)
		if err != nil {
			return fmt.Errorf("close guard: %w", err)
		}
		defer func() {
			if rerr := reopen(); rerr != nil && err == nil {
				err = fmt.Errorf("reopen guard: %w", rerr)
			}
		}()
	}
	if err := e.w.SetIPCache(prog); err != nil {
		return err
	}
	keep := map[uint32]bool{}
	for _, fe := range e.svc.Frontends() {
		c := prog.Policy(fe.Service)
		on := Flags(c)
		// The header first (enforce's proxy interface in it), then the
		// flags: a frontend never has SvcFlagL7 before its header does.
		if on != 0 {
			if err := e.w.Attach(c, []uint32{fe.SID}); err != nil {
				return err
			}
			keep[fe.SID] = true
		}
		if fe.Flags&(bpf.SvcFlagPolicy|bpf.SvcFlagL7) != on {
			if err := e.svc.SetPolicyFlags(fe.Service, fe.SID, on); err != nil {
				return err
			}
		}
	}
	return e.w.Prune(prog, func(sid uint32) bool { return keep[sid] })
}
