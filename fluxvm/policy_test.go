package fluxvm

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
)

// policyIPCache gives the client VM's IPv4 address identity 1001 and its
// IPv6 address 2001, so that one VM is an allowed and a denied source.
func (e *env) policyIPCache() IPCache {
	return IPCache{Entries: []IPCacheEntry{
		{Prefix: netip.PrefixFrom(e.cli.Addr4, 32), Identity: 1001},
		{Prefix: netip.PrefixFrom(e.cli.Addr6, 128), Identity: 2001},
	}}
}

// sawPeer reports whether any backend server saw a connection or datagram
// from address a.
func (e *env) sawPeer(a netip.Addr) bool {
	for _, s := range e.servers {
		for _, p := range s.Peers() {
			if p.Addr() == a {
				return true
			}
		}
	}
	return false
}

// TestPolicyLabTraffic: an identity policy decides real connections
// through the VIP by the source's identity (TCP and UDP, both families);
// revoking the identity stops an open connection at its next packet;
// status reports the compiled state and the unresolved identities; a
// restart restores the policies from the catalog; deleting the policy
// lets everyone in again.
func TestPolicyLabTraffic(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	web := Policy{Service: "web", DefaultAction: PolicyDeny, AllowIdentities: []Identity{1001, 7777}}
	st, err := d.ReconcilePolicies(ctx, e.policyIPCache(), []Policy{web})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Policies) != 1 || st.Policies[0].Frontends != 4 || !slices.Equal(st.Policies[0].Unresolved, []Identity{7777}) ||
		st.Policies[0].Revision == 0 || st.IPCachePrefixes != 2 {
		t.Fatalf("status %+v: want web enforced on its 4 frontends, 7777 unresolved", st)
	}
	// The identity tries' fill in the pressure status: the prefixes
	// written (the kernel does not count an LPM trie's entries).
	if ps, err := d.Pressure(context.Background()); err != nil {
		t.Fatal(err)
	} else if s4, s6 := ps.Maps["fluxvm_sid4"], ps.Maps["fluxvm_sid6"]; s4.Entries != 1 || s6.Entries != 1 || s4.MaxEntries == 0 {
		t.Errorf("pressure of the identity tries: %+v, %+v; want one prefix each", s4, s6)
	}
	allowed := func(vip netip.Addr) bool {
		c, err := e.cli.DialTCP(netip.AddrPortFrom(vip, 80), 400*time.Millisecond)
		if err != nil {
			return false
		}
		defer c.Close()
		return c.Echo([]byte("hi"), time.Second) == nil
	}
	udp := func(vip netip.Addr) bool {
		_, err := e.cli.AskUDP(netip.AddrPortFrom(vip, 80), 400*time.Millisecond)
		return err == nil
	}
	if !allowed(vip4) || !udp(vip4) {
		t.Fatal("identity 1001 (the client's IPv4) was not let through")
	}
	if allowed(vip6) || udp(vip6) || e.sawPeer(e.cli.Addr6) {
		t.Fatal("identity 2001 (the client's IPv6) reached a backend")
	}
	if st, _ := d.Policies(context.Background()); st.Counters.Denied == 0 {
		t.Errorf("no policy_denied drops counted: %+v", st.Counters)
	}

	// Revoked while a connection is open: its next packet is dropped.
	c := e.dial(t, vip4)
	echo(t, c, "before")
	if _, err := d.ApplyPolicies(ctx, Policy{Service: "web", DefaultAction: PolicyDeny, AllowIdentities: []Identity{7777}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Echo([]byte("after"), 500*time.Millisecond); err == nil {
		t.Fatal("an open connection of a revoked identity went on")
	}
	st, _ = d.Policies(context.Background())
	if st.Counters.Revoked == 0 || st.Counters.Rechecked == 0 {
		t.Errorf("counters %+v: want the revoked flow counted", st.Counters)
	}
	// Audit only: the denied identity is forwarded, counted.
	if _, err := d.ApplyPolicies(ctx, Policy{Service: "web", DefaultAction: PolicyDeny, AuditOnly: true}); err != nil {
		t.Fatal(err)
	}
	if !allowed(vip6) {
		t.Error("audit_only dropped a denied identity")
	}
	if st, _ := d.Policies(context.Background()); st.Counters.Audited == 0 {
		t.Errorf("counters %+v: want audited flows", st.Counters)
	}
	if _, err := d.ApplyPolicies(ctx, web); err != nil {
		t.Fatal(err)
	}

	// A restart restores the policy from the catalog before any packet.
	d.Close()
	d = e.open(t)
	if p, err := d.Policy(context.Background(), "web"); err != nil || !slices.Equal(p.AllowIdentities, web.AllowIdentities) || p.Frontends != 4 {
		t.Fatalf("after a restart: %+v, %v", p, err)
	}
	if !allowed(vip4) || allowed(vip6) {
		t.Fatal("after a restart the policy no longer decides")
	}

	// A service change that the policy no longer fits is refused; the
	// policy goes with its service.
	l7 := web
	l7.L7 = &L7Policy{Mode: L7Enforce, Protocol: L7HTTP, ProxyInterface: "proxy0"}
	if _, err := d.ApplyPolicies(ctx, l7); !errors.Is(err, ErrUnsupported) {
		t.Errorf("L7 enforce on a service with a UDP port: %v, want ErrUnsupported", err)
	}
	if err := d.DeletePolicy(ctx, "web"); err != nil {
		t.Fatal(err)
	}
	if !allowed(vip6) {
		t.Error("with the policy deleted, the IPv6 client is still denied")
	}
	if err := d.DeletePolicy(ctx, "web"); !errors.Is(err, ErrNotFound) {
		t.Errorf("deleting it again: %v, want ErrNotFound", err)
	}
	if _, err := d.ApplyPolicies(ctx, Policy{Service: "nosuch", DefaultAction: PolicyAllow}); err == nil {
		t.Error("a policy for a service that does not exist was accepted")
	}
	if st, _ := d.Policies(context.Background()); len(st.Policies) != 0 {
		t.Errorf("policies after the failed apply: %+v", st.Policies)
	}
}

// TestPolicyFailClosed: a denied source sends continuously while its
// service's policy is reconciled again and again (other rules changing,
// the ipcache growing), and while the dataplane restarts, with a program
// generation reload (every map but conntrack and reverse NAT recreated):
// not one of its packets reaches a backend, and the allowed source keeps
// being served.
func TestPolicyFailClosed(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	web := Policy{Service: "web", DefaultAction: PolicyAllow, DenyIdentities: []Identity{2001}}
	if _, err := d.ReconcilePolicies(ctx, e.policyIPCache(), []Policy{web}); err != nil {
		t.Fatal(err)
	}
	var stop atomic.Bool
	var sent, served atomic.Int64
	var wg sync.WaitGroup
	// The denied source: UDP datagrams, each from a new socket (a new
	// flow), and one long-lived TCP attempt after another.
	wg.Go(func() {
		for !stop.Load() {
			_, _ = e.cli.AskUDP(netip.AddrPortFrom(vip6, 80), 5*time.Millisecond)
			sent.Add(1)
		}
	})
	// The allowed source keeps being served (between restarts).
	wg.Go(func() {
		for !stop.Load() {
			if _, err := e.cli.AskUDP(netip.AddrPortFrom(vip4, 80), 50*time.Millisecond); err == nil {
				served.Add(1)
			}
		}
	})
	ipc := e.policyIPCache()
	for i := range 20 {
		web.DenyIdentities = []Identity{2001, Identity(3000 + i)}
		ipc.Entries = append(ipc.Entries[:2], IPCacheEntry{Prefix: netip.MustParsePrefix("192.0.2.0/24"), Identity: Identity(3000 + i)})
		if _, err := d.ReconcilePolicies(ctx, ipc, []Policy{web}); err != nil {
			t.Fatal(err)
		}
	}
	// The denied source's identity and the rules change together: old
	// (its identity 7, 5 allowed) and new (its identity 5, 9 allowed)
	// each deny it; a packet decided by the new ipcache and the old rules
	// would pass.
	strict := Policy{Service: "web", DefaultAction: PolicyAllow, DenyIdentities: []Identity{7, 5, 2001}}
	for i := range 20 {
		id, allow := Identity(7), Identity(5)
		if i%2 == 1 {
			id, allow = 5, 9
		}
		strict.DenyIdentities = []Identity{7, 5, 2001}
		strict.DenyIdentities = slices.DeleteFunc(strict.DenyIdentities, func(x Identity) bool { return x == allow })
		ipc := IPCache{Entries: []IPCacheEntry{
			{Prefix: netip.PrefixFrom(e.cli.Addr4, 32), Identity: 1001},
			{Prefix: netip.PrefixFrom(e.cli.Addr6, 128), Identity: id},
		}}
		if _, err := d.ReconcilePolicies(ctx, ipc, []Policy{strict}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.ReconcilePolicies(ctx, e.policyIPCache(), []Policy{web}); err != nil {
		t.Fatal(err)
	}
	root := e.opts.Loader.PinRoot
	for _, reload := range []bool{false, true} {
		d.Close()
		if reload {
			setPinnedGeneration(t, root, bpf.ProgramGeneration-1)
		}
		d = e.open(t)
		if reload && !d.Status().Load.Reloaded {
			t.Fatalf("load status %+v: want a generation reload", d.Status().Load)
		}
		time.Sleep(200 * time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	if e.sawPeer(e.cli.Addr6) {
		t.Errorf("the denied source reached a backend (of %d datagrams sent)", sent.Load())
	}
	if served.Load() == 0 {
		t.Error("the allowed source was never served")
	}
	t.Logf("%d datagrams from the denied source, %d answers to the allowed one", sent.Load(), served.Load())
}

// TestPolicyIDsSurviveRestart: policy ids are kept in the catalog, so a
// restart with the maps kept writes each service's policy over its own
// rule sets (ids handed out again in name order would make one service's
// header name another's rules while the restore runs).
func TestPolicyIDsSurviveRestart(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	beta := e.service(1, 1, 1)
	beta.Name = "beta"
	alpha := e.service(1, 1, 1)
	alpha.Name = "alpha"
	alpha.VIPs = []netip.Addr{netip.MustParseAddr("10.96.0.20"), netip.MustParseAddr("fd00:96::20")}
	for _, s := range []Service{beta, alpha} {
		if _, err := d.ApplyService(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	// beta first: it takes id 1, alpha id 2 (name order would swap them).
	if _, err := d.ReconcilePolicies(ctx, e.policyIPCache(), []Policy{{Service: "beta", DefaultAction: PolicyDeny, AllowIdentities: []Identity{2001}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ApplyPolicies(ctx, Policy{Service: "alpha", DefaultAction: PolicyDeny, AllowIdentities: []Identity{1001}}); err != nil {
		t.Fatal(err)
	}
	ids := func(d *Dataplane) map[string]uint32 { return d.pol.Saved().IDs }
	before := ids(d)
	if before["beta"] != 1 || before["alpha"] != 2 {
		t.Fatalf("ids %v: want beta 1, alpha 2", before)
	}
	d.Close()
	d = e.open(t)
	if after := ids(d); after["beta"] != 1 || after["alpha"] != 2 {
		t.Fatalf("ids after a restart %v, before %v", after, before)
	}
	// Each still decides by its own rules: alpha lets the IPv4 client
	// (1001) in, beta only the IPv6 one (2001).
	if _, err := e.cli.DialTCP(netip.AddrPortFrom(alpha.VIPs[0], 80), 400*time.Millisecond); err != nil {
		t.Errorf("alpha refused identity 1001: %v", err)
	}
	if c, err := e.cli.DialTCP(netip.AddrPortFrom(vip4, 80), 400*time.Millisecond); err == nil {
		c.Close()
		t.Error("beta let identity 1001 in")
	}
}

// TestApplyServiceKeepsItsPolicyFitting: a service change that its
// identity policy would no longer fit (L7 enforce needs TCP and NAT) is
// refused, and nothing of it is applied.
func TestApplyServiceKeepsItsPolicyFitting(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 1, 1)
	svc.Ports = []ServicePort{{Port: 80, Protocol: TCP}}
	st0, err := d.ApplyService(ctx, svc)
	if err != nil {
		t.Fatal(err)
	}
	enforce := Policy{Service: "web", DefaultAction: PolicyAllow,
		L7: &L7Policy{Mode: L7Enforce, Protocol: L7HTTP, ProxyInterface: "proxy0"}}
	// The proxy interface must exist, and be a veth (its peer in the
	// proxy's namespace): nothing is applied otherwise.
	if _, err := d.ApplyPolicies(ctx, enforce); !errors.Is(err, ErrPrerequisite) {
		t.Fatalf("enforce toward a missing interface: %v, want ErrPrerequisite", err)
	}
	enforce.L7.ProxyInterface = "lo"
	if _, err := d.ApplyPolicies(ctx, enforce); !errors.Is(err, ErrPrerequisite) {
		t.Fatalf("enforce toward loopback (no VM-edge interface): %v, want ErrPrerequisite", err)
	}
	if st, _ := d.Policies(context.Background()); len(st.Policies) != 0 {
		t.Fatalf("policies after the refused applies: %+v", st.Policies)
	}
	enforce.L7.ProxyInterface = e.backends[2].NodeIf
	if _, err := d.ApplyPolicies(ctx, enforce); err != nil {
		t.Fatal(err)
	}
	if p, _ := d.Policy(context.Background(), "web"); p.ProxyIfindex == nil || *p.ProxyIfindex != uint32(e.backends[2].NodeIfIndex) {
		t.Errorf("proxy ifindex %v, want %d", p.ProxyIfindex, e.backends[2].NodeIfIndex)
	}
	// The Envoy document: a listener per VIP (port 80, TCP), the six
	// backends (three VMs, both families), one virtual host for any host.
	doc, err := d.Envoy("web")
	if err != nil {
		t.Fatal(err)
	}
	if len(doc.Listeners) != 2 || len(doc.Cluster.Endpoints) != 6 || doc.Mode != L7Enforce || doc.Revision == 0 ||
		len(doc.Routes.VirtualHosts) != 1 || doc.Routes.VirtualHosts[0].Domains[0] != "*" {
		t.Errorf("envoy document %+v", doc)
	}
	if _, err := d.Envoy("nosuch"); !errors.Is(err, ErrNotFound) {
		t.Errorf("document of a service that does not exist: %v", err)
	}
	withUDP := svc.Clone()
	withUDP.Ports = append(withUDP.Ports, ServicePort{Port: 53, Protocol: UDP})
	if _, err := d.ApplyService(ctx, withUDP); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("adding a UDP port under L7 enforce: %v, want ErrUnsupported", err)
	}
	dsr := svc.Clone()
	dsr.Mode = ModeDSR
	dsr.Ports = []ServicePort{{Port: 8080, Protocol: TCP}} // DSR keeps the port: backends' ports equal
	if _, err := d.ApplyService(ctx, dsr); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("DSR under L7 enforce: %v, want ErrUnsupported", err)
	}
	if st, _ := d.Service("web"); st.Revision != st0.Revision || len(st.Frontends) != len(st0.Frontends) {
		t.Errorf("service after the refused changes %+v, before %+v", st, st0)
	}
}
