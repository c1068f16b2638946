package policy

import (
	"errors"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"testing"

	"github.com/fluxvm/servicefabric/intent"
)

func svcs(names ...string) func(string) *intent.Service {
	m := map[string]*intent.Service{}
	for _, n := range names {
		m[n] = &intent.Service{Name: n, Ports: []intent.ServicePort{{Port: 80, Protocol: intent.TCP}}}
	}
	return func(n string) *intent.Service { return m[n] }
}

func ipc(entries ...any) intent.IPCache {
	var c intent.IPCache
	for i := 0; i < len(entries); i += 2 {
		c.Entries = append(c.Entries, intent.IPCacheEntry{Prefix: netip.MustParsePrefix(entries[i].(string)), Identity: intent.Identity(entries[i+1].(int))})
	}
	return c
}

func TestCompileDecides(t *testing.T) {
	in := Input{
		IPCache: ipc("10.0.0.0/8", 100, "10.1.0.0/16", 1001, "10.1.2.3/32", 2001, "fd00::/64", 1002),
		Policies: []intent.Policy{
			{Service: "pay", DefaultAction: intent.PolicyDeny, AllowIdentities: []intent.Identity{1001, 1002, 2001, 7777}, DenyIdentities: []intent.Identity{2001}},
			{Service: "web", DefaultAction: intent.PolicyAllow, DenyIdentities: []intent.Identity{100}},
			{Service: "off", Enabled: new(bool), DefaultAction: intent.PolicyDeny},
		},
		Service: svcs("pay", "web", "off"),
	}
	p, err := Compiler{}.Compile(in, nil)
	if err != nil {
		t.Fatal(err)
	}
	pay := p.Policy("pay")
	if want := []Rule{{1001, intent.PolicyAllow}, {1002, intent.PolicyAllow}, {7777, intent.PolicyAllow}}; !reflect.DeepEqual(pay.Rules, want) {
		t.Errorf("pay rules %v, want %v (2001 on both lists is denied, as the default)", pay.Rules, want)
	}
	if want := []intent.Identity{7777}; !reflect.DeepEqual(pay.Unresolved, want) {
		t.Errorf("pay unresolved %v, want %v", pay.Unresolved, want)
	}
	tests := []struct {
		svc, addr string
		id        intent.Identity
		want      intent.PolicyAction
	}{
		{"pay", "10.1.9.9", 1001, intent.PolicyAllow}, // /16 over /8
		{"pay", "10.1.2.3", 2001, intent.PolicyDeny},  // /32 over /16; deny wins
		{"pay", "10.9.9.9", 100, intent.PolicyDeny},   // default
		{"pay", "192.0.2.1", 0, intent.PolicyDeny},    // unknown: default
		{"pay", "fd00::1", 1002, intent.PolicyAllow},  // IPv6
		{"pay", "::ffff:10.1.0.1", 1001, intent.PolicyAllow},
		{"web", "10.9.9.9", 100, intent.PolicyDeny},
		{"web", "10.1.9.9", 1001, intent.PolicyAllow},
		{"web", "192.0.2.1", 0, intent.PolicyAllow},
		{"off", "10.9.9.9", 100, intent.PolicyAllow}, // disabled
	}
	for _, tc := range tests {
		id := p.Identity(netip.MustParseAddr(tc.addr))
		if id != tc.id {
			t.Errorf("identity of %s: %d, want %d", tc.addr, id, tc.id)
		}
		if got := p.Policy(tc.svc).Decide(id); got != tc.want {
			t.Errorf("%s from %s (%d): %s, want %s", tc.svc, tc.addr, id, got, tc.want)
		}
	}
	if got := []uint32{p.Policy("off").ID, p.Policy("pay").ID, p.Policy("web").ID}; !reflect.DeepEqual(got, []uint32{1, 2, 3}) {
		t.Errorf("ids %v, want 1, 2, 3 in name order", got)
	}
}

// TestCompileDeterministic: the order of the input does not matter, and
// revisions move exactly when a policy's decisions may.
func TestCompileDeterministic(t *testing.T) {
	in := Input{
		IPCache: ipc("10.0.0.0/8", 100, "10.1.0.0/16", 1001, "fd00::/64", 1002, "192.0.2.0/24", 5),
		Policies: []intent.Policy{
			{Service: "a", DefaultAction: intent.PolicyDeny, AllowIdentities: []intent.Identity{1001, 1002, 5}},
			{Service: "b", DefaultAction: intent.PolicyAllow, DenyIdentities: []intent.Identity{100, 5}},
			{Service: "c", DefaultAction: intent.PolicyAllow, AuditOnly: true, DenyIdentities: []intent.Identity{1001}},
		},
		Service: svcs("a", "b", "c"),
	}
	want, err := Compiler{}.Compile(in, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 20 {
		sh := in
		sh.IPCache.Entries = slices.Clone(in.IPCache.Entries)
		sh.Policies = slices.Clone(in.Policies)
		for i := range sh.Policies {
			sh.Policies[i] = sh.Policies[i].Clone()
			r.Shuffle(len(sh.Policies[i].AllowIdentities), func(a, b int) {
				sh.Policies[i].AllowIdentities[a], sh.Policies[i].AllowIdentities[b] = sh.Policies[i].AllowIdentities[b], sh.Policies[i].AllowIdentities[a]
			})
		}
		r.Shuffle(len(sh.IPCache.Entries), func(a, b int) {
			sh.IPCache.Entries[a], sh.IPCache.Entries[b] = sh.IPCache.Entries[b], sh.IPCache.Entries[a]
		})
		got, err := Compiler{}.Compile(sh, want)
		if err != nil {
			t.Fatal(err)
		}
		for i := range got.Policies {
			got.Policies[i].Policy, want.Policies[i].Policy = intent.Policy{}, intent.Policy{}
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("shuffled input compiled differently:\n got %+v\nwant %+v", got, want)
		}
	}
	rev := func(p *Program) map[string]uint32 {
		m := map[string]uint32{}
		for _, c := range p.Policies {
			m[c.Service] = c.Revision
		}
		return m
	}
	base := rev(want)
	changes := []struct {
		name    string
		edit    func(in *Input)
		changed []string
	}{
		{"an identity revoked", func(in *Input) { in.Policies[0].AllowIdentities = []intent.Identity{1002, 5} }, []string{"a"}},
		{"default flipped", func(in *Input) { in.Policies[1].DefaultAction = intent.PolicyDeny }, []string{"b"}},
		{"audit off", func(in *Input) { in.Policies[2].AuditOnly = false }, []string{"c"}},
		{"a redundant entry (deny under default deny)", func(in *Input) {
			in.Policies[0].DenyIdentities = []intent.Identity{100}
		}, nil},
		{"an address moved to another identity", func(in *Input) {
			in.IPCache.Entries[1].Identity = 5
		}, []string{"a", "b", "c"}},
	}
	for _, ch := range changes {
		in2 := in
		in2.Policies = slices.Clone(in.Policies)
		for i := range in2.Policies {
			in2.Policies[i] = in2.Policies[i].Clone()
		}
		in2.IPCache.Entries = slices.Clone(in.IPCache.Entries)
		ch.edit(&in2)
		p, err := Compiler{}.Compile(in2, want)
		if err != nil {
			t.Fatal(err)
		}
		var changed []string
		for s, r := range rev(p) {
			if r != base[s] {
				changed = append(changed, s)
			}
		}
		slices.Sort(changed)
		if !slices.Equal(changed, ch.changed) {
			t.Errorf("%s: revisions changed for %v, want %v", ch.name, changed, ch.changed)
		}
	}
}

// TestCompileKeepsIDs: a service keeps its policy id while it has a
// policy; a new one takes the lowest free id.
func TestCompileKeepsIDs(t *testing.T) {
	pol := func(names ...string) Input {
		in := Input{Service: svcs("a", "b", "c", "d")}
		for _, n := range names {
			in.Policies = append(in.Policies, intent.Policy{Service: n, DefaultAction: intent.PolicyAllow})
		}
		return in
	}
	ids := func(p *Program) map[string]uint32 {
		m := map[string]uint32{}
		for _, c := range p.Policies {
			m[c.Service] = c.ID
		}
		return m
	}
	p1, _ := Compiler{}.Compile(pol("b", "c"), nil)
	p2, _ := Compiler{}.Compile(pol("a", "c"), p1)
	p3, _ := Compiler{}.Compile(pol("a", "c", "d", "b"), p2)
	if got, want := ids(p2), map[string]uint32{"a": 1, "c": 2}; !reflect.DeepEqual(got, want) {
		t.Errorf("after b left and a came: %v, want %v", got, want)
	}
	if got, want := ids(p3), map[string]uint32{"a": 1, "c": 2, "b": 3, "d": 4}; !reflect.DeepEqual(got, want) {
		t.Errorf("after b and d came: %v, want %v", got, want)
	}
}

func TestCompileRejects(t *testing.T) {
	many := make([]intent.Identity, 300)
	for i := range many {
		many[i] = intent.Identity(i + 1)
	}
	tests := []struct {
		name string
		in   Input
		lim  Limits
		want error
	}{
		{"no such service", Input{Policies: []intent.Policy{{Service: "zz", DefaultAction: intent.PolicyAllow}}, Service: svcs("a")}, Limits{}, ErrNoService},
		{"two policies for one service", Input{Policies: []intent.Policy{
			{Service: "a", DefaultAction: intent.PolicyAllow}, {Service: "a", DefaultAction: intent.PolicyDeny}}, Service: svcs("a")}, Limits{}, intent.ErrConflict},
		{"bad policy", Input{Policies: []intent.Policy{{Service: "a", DefaultAction: "maybe"}}, Service: svcs("a")}, Limits{}, intent.ErrInvalid},
		{"bad ipcache", Input{IPCache: ipc("10.0.0.1/8", 1)}, Limits{}, intent.ErrInvalid},
		{"ipcache identity 0", Input{IPCache: ipc("10.0.0.0/8", 0)}, Limits{}, intent.ErrInvalid},
		{"ipcache repeats a prefix", Input{IPCache: ipc("10.0.0.0/8", 1, "10.0.0.0/8", 2)}, Limits{}, intent.ErrConflict},
		{"too many policies", Input{Policies: []intent.Policy{{Service: "a", DefaultAction: intent.PolicyAllow}, {Service: "b", DefaultAction: intent.PolicyAllow}},
			Service: svcs("a", "b")}, Limits{Policies: 1, Rules: 10}, intent.ErrLimit},
		{"too many rules", Input{Policies: []intent.Policy{{Service: "a", DefaultAction: intent.PolicyDeny, AllowIdentities: many},
			{Service: "b", DefaultAction: intent.PolicyAllow, DenyIdentities: many}}, Service: svcs("a", "b")}, Limits{Policies: 10, Rules: 500}, intent.ErrLimit},
		{"enforce on UDP", Input{Policies: []intent.Policy{{Service: "u", DefaultAction: intent.PolicyAllow,
			L7: &intent.L7Policy{Mode: intent.L7Enforce, Protocol: intent.L7HTTP, ProxyInterface: "p0"}}},
			Service: func(string) *intent.Service {
				return &intent.Service{Name: "u", Ports: []intent.ServicePort{{Port: 53, Protocol: intent.UDP}}}
			}}, Limits{}, intent.ErrUnsupported},
	}
	for _, tc := range tests {
		p, err := Compiler{Limits: tc.lim}.Compile(tc.in, nil)
		if !errors.Is(err, tc.want) || p != nil {
			t.Errorf("%s: %v (program %v), want %v", tc.name, err, p != nil, tc.want)
		}
	}
}

// TestCompileL7Enforce: an enforce policy's proxy interface is resolved at
// compile (a failure fails the compile, checkable; 0 is a missing interface
// that compiles fail-closed), the ifindex is part of the revision, and only
// an enabled enforce policy redirects.
func TestCompileL7Enforce(t *testing.T) {
	enforce := func(mode intent.L7Mode, enabled bool) []intent.Policy {
		return []intent.Policy{{Service: "a", DefaultAction: intent.PolicyAllow, Enabled: &enabled,
			L7: &intent.L7Policy{Mode: mode, Protocol: intent.L7HTTP, ProxyInterface: "p0"}}}
	}
	resolve := func(i uint32, err error) func(string) (uint32, error) {
		return func(name string) (uint32, error) {
			if name != "p0" {
				t.Errorf("resolved %q, want p0", name)
			}
			return i, err
		}
	}
	gone := errors.New("no such device")
	for _, tc := range []struct {
		name      string
		pols      []intent.Policy
		iface     func(string) (uint32, error)
		err       error
		ifindex   uint32
		redirects bool
	}{
		{"enforce", enforce(intent.L7Enforce, true), resolve(7, nil), nil, 7, true},
		{"enforce, disabled: nothing resolved", enforce(intent.L7Enforce, false), nil, nil, 0, false},
		{"enforce, interface missing for now", enforce(intent.L7Enforce, true), resolve(0, nil), nil, 0, true},
		{"enforce, interface not found", enforce(intent.L7Enforce, true), resolve(0, gone), ErrNoInterface, 0, false},
		{"enforce, no resolver", enforce(intent.L7Enforce, true), nil, intent.ErrPrerequisite, 0, false},
		{"observe resolves nothing", enforce(intent.L7Observe, true), nil, nil, 0, false},
	} {
		p, err := Compiler{}.Compile(Input{Policies: tc.pols, Service: svcs("a"), Interface: tc.iface}, nil)
		if tc.err != nil {
			if !errors.Is(err, tc.err) || !errors.Is(err, intent.ErrPrerequisite) || p != nil {
				t.Errorf("%s: %v, want %v", tc.name, err, tc.err)
			}
			if tc.iface != nil && !errors.Is(err, gone) {
				t.Errorf("%s: %v does not wrap the resolver's error", tc.name, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		c := p.Policy("a")
		if c.ProxyIfindex != tc.ifindex || c.Redirects() != tc.redirects {
			t.Errorf("%s: ifindex %d, redirects %v; want %d, %v", tc.name, c.ProxyIfindex, c.Redirects(), tc.ifindex, tc.redirects)
		}
	}
	// The ifindex moves the revision (a recreated proxy interface).
	rev := func(i uint32) uint32 {
		p, err := Compiler{}.Compile(Input{Policies: enforce(intent.L7Enforce, true), Service: svcs("a"), Interface: resolve(i, nil)}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return p.Policy("a").Revision
	}
	if rev(7) == rev(8) {
		t.Error("the proxy's ifindex does not move the revision")
	}
}
