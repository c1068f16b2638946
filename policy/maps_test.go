package policy

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// testMaps makes maps of the datapath's policy layouts.
func testMaps(t *testing.T) Maps {
	t.Helper()
	testenv.RequirePrivileged(t)
	mk := func(typ ebpf.MapType, k, v uintptr) *ebpf.Map {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: typ, KeySize: uint32(k), ValueSize: uint32(v), MaxEntries: 4096, Flags: unix.BPF_F_NO_PREALLOC})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	return Maps{
		SID4:     mk(ebpf.LPMTrie, unsafe.Sizeof(bpf.SIDKey4{}), unsafe.Sizeof(bpf.SIDValue{})),
		SID6:     mk(ebpf.LPMTrie, unsafe.Sizeof(bpf.SIDKey6{}), unsafe.Sizeof(bpf.SIDValue{})),
		Policies: mk(ebpf.Hash, unsafe.Sizeof(bpf.PolicyKey{}), unsafe.Sizeof(bpf.PolicyValue{})),
	}
}

// mapDecide decides as bpf/lib/policy.h does, from the maps: the header
// of sid, the source's identity by longest prefix, the rule of the
// header's set. ok false: no header (the datapath fails closed).
func mapDecide(t testing.TB, m Maps, sid uint32, src netip.Addr) (a intent.PolicyAction, ok bool) {
	var h bpf.PolicyValue
	if err := m.Policies.Lookup(bpf.PolicyKey{Id: sid, Identity: bpf.PolicyHeader}, &h); err != nil {
		return "", false
	}
	var id bpf.SIDValue
	if src.Is4() {
		_ = m.SID4.Lookup(bpf.SIDKey4{Prefixlen: 32, Addr: bpf.AddrWords(src)[0]}, &id)
	} else {
		_ = m.SID6.Lookup(bpf.SIDKey6{Prefixlen: 128, Addr: bpf.AddrWords(src)}, &id)
	}
	act := h.Action
	var r bpf.PolicyValue
	if err := m.Policies.Lookup(bpf.PolicyKey{Id: h.Rules, Identity: id.Identity}, &r); err == nil {
		act = r.Action
	}
	if act == bpf.PolicyAllow {
		return intent.PolicyAllow, true
	}
	return intent.PolicyDeny, true
}

func countKeys(t *testing.T, m *ebpf.Map) int {
	t.Helper()
	n := 0
	k := make([]byte, m.KeySize())
	var v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

var sources = []netip.Addr{
	netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("10.9.0.1"),
	netip.MustParseAddr("192.0.2.7"), netip.MustParseAddr("fd00::5"), netip.MustParseAddr("fd01::1"),
}

// check requires the maps to decide for every source and datapath
// service as p does, and services without a policy to have no header.
func check(t *testing.T, m Maps, p *Program, sids map[string][]uint32) {
	t.Helper()
	for svc, ss := range sids {
		c := p.Policy(svc)
		for _, sid := range ss {
			for _, src := range sources {
				got, ok := mapDecide(t, m, sid, src)
				if c == nil || !c.Enabled {
					if ok {
						t.Errorf("%s (service %d): a header without an enabled policy", svc, sid)
					}
					continue
				}
				if want := c.Decide(p.Identity(src)); !ok || got != want {
					t.Errorf("%s (service %d) from %s (identity %d): maps say %q (header %v), program %q", svc, sid, src, p.Identity(src), got, ok, want)
				}
			}
		}
	}
}

// TestWriter: what the maps hold decides as the Program does, through
// rule changes (a new rule set, the old one gone), a policy removed, a
// disabled one, an ipcache change, and a restart that adopts the maps.
func TestWriter(t *testing.T) {
	m := testMaps(t)
	svcs := svcs("a", "b", "c")
	sids := map[string][]uint32{"a": {1, 2}, "b": {3}, "c": {4}}
	in := Input{
		IPCache: ipc("10.1.0.0/16", 1001, "10.1.2.3/32", 2001, "10.0.0.0/8", 100, "fd00::/64", 1002),
		Policies: []intent.Policy{
			{Service: "a", DefaultAction: intent.PolicyDeny, AllowIdentities: []intent.Identity{1001, 1002}},
			{Service: "b", DefaultAction: intent.PolicyAllow, DenyIdentities: []intent.Identity{2001, 100}},
		},
		Service: svcs,
	}
	apply := func(w *Writer, in Input, prev *Program) *Program {
		t.Helper()
		p, err := Compiler{}.Compile(in, prev)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.SetIPCache(p); err != nil {
			t.Fatal(err)
		}
		keep := map[uint32]bool{}
		for svc, ss := range sids {
			if c := p.Policy(svc); c != nil && c.Enabled {
				if err := w.Attach(c, ss); err != nil {
					t.Fatal(err)
				}
				for _, s := range ss {
					keep[s] = true
				}
			}
		}
		if err := w.Prune(p, func(s uint32) bool { return keep[s] }); err != nil {
			t.Fatal(err)
		}
		return p
	}
	w, err := NewWriter(m)
	if err != nil {
		t.Fatal(err)
	}
	w.Grace = 0
	p := apply(w, in, nil)
	check(t, m, p, sids)
	if n := countKeys(t, m.Policies); n != 3+2+2 { // headers 1, 2, 3; a's 2 rules, b's 2
		t.Errorf("fluxvm_spol holds %d entries, want 7", n)
	}
	var h1 bpf.PolicyValue
	if err := m.Policies.Lookup(bpf.PolicyKey{Id: 1, Identity: bpf.PolicyHeader}, &h1); err != nil {
		t.Fatal(err)
	}

	// a revokes 1001: its headers switch to the other rule set, the old
	// one goes.
	in.Policies[0].AllowIdentities = []intent.Identity{1002}
	p = apply(w, in, p)
	check(t, m, p, sids)
	var h2 bpf.PolicyValue
	if err := m.Policies.Lookup(bpf.PolicyKey{Id: 2, Identity: bpf.PolicyHeader}, &h2); err != nil {
		t.Fatal(err)
	}
	if h2.Rules == h1.Rules || h2.Revision == h1.Revision {
		t.Errorf("header after a rule change %+v, before %+v: want another rule set and revision", h2, h1)
	}
	if n := countKeys(t, m.Policies); n != 3+1+2 {
		t.Errorf("fluxvm_spol holds %d entries after the change, want 6 (the old set gone)", n)
	}

	// b removed, c added disabled, an address moved to another identity.
	in.Policies = []intent.Policy{in.Policies[0], {Service: "c", Enabled: new(bool), DefaultAction: intent.PolicyDeny}}
	in.IPCache = ipc("10.1.0.0/16", 1002, "10.0.0.0/8", 100, "fd00::/64", 1002)
	p = apply(w, in, p)
	check(t, m, p, sids)
	if n := countKeys(t, m.Policies); n != 2+1 {
		t.Errorf("fluxvm_spol holds %d entries, want 3 (a's headers and rule)", n)
	}
	if n := countKeys(t, m.SID4) + countKeys(t, m.SID6); n != 3 {
		t.Errorf("ipcache holds %d prefixes, want 3", n)
	}

	// A restart: a new Writer adopts the maps, rules included: the same
	// Program (same ids) writes nothing, not even a new rule set.
	var before bpf.PolicyValue
	if err := m.Policies.Lookup(bpf.PolicyKey{Id: 1, Identity: bpf.PolicyHeader}, &before); err != nil {
		t.Fatal(err)
	}
	w2, err := NewWriter(m)
	if err != nil {
		t.Fatal(err)
	}
	w2.Grace = 0
	p = apply(w2, in, p)
	check(t, m, p, sids)
	var after bpf.PolicyValue
	if err := m.Policies.Lookup(bpf.PolicyKey{Id: 1, Identity: bpf.PolicyHeader}, &after); err != nil || after != before {
		t.Errorf("header after a restart %+v (%v), before %+v: want it untouched", after, err, before)
	}
	if w2.IPCacheChanges(p) {
		t.Error("the adopted ipcache differs from the Program it was written from")
	}
	if n := countKeys(t, m.Policies); n != 2+1 {
		t.Errorf("after a restart fluxvm_spol holds %d entries, want 3", n)
	}
}

// TestWriterNoHalfPolicy: while a policy changes again and again between
// rule sets that all deny one identity, a reader deciding from the maps
// as the datapath does never sees it allowed.
func TestWriterNoHalfPolicy(t *testing.T) {
	m := testMaps(t)
	w, err := NewWriter(m)
	if err != nil {
		t.Fatal(err)
	}
	w.Grace = DefaultGrace
	denied := netip.MustParseAddr("10.1.2.3")
	in := Input{IPCache: ipc("10.1.2.3/32", 2001, "10.1.0.0/16", 1001), Service: svcs("a")}
	var p *Program
	step := func(i int) {
		// Default allow with 2001 denied, and a changing second rule.
		in.Policies = []intent.Policy{{Service: "a", DefaultAction: intent.PolicyAllow,
			DenyIdentities: []intent.Identity{2001, intent.Identity(3000 + i%7)}}}
		var err error
		if p, err = (Compiler{}).Compile(in, p); err != nil {
			t.Fatal(err)
		}
		if err := w.SetIPCache(p); err != nil {
			t.Fatal(err)
		}
		if err := w.Attach(p.Policy("a"), []uint32{1}); err != nil {
			t.Fatal(err)
		}
		if err := w.Prune(p, func(s uint32) bool { return s == 1 }); err != nil {
			t.Fatal(err)
		}
	}
	step(0)
	var stop atomic.Bool
	var allowed, reads atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		for !stop.Load() {
			start := time.Now()
			a, ok := mapDecide(t, m, 1, denied)
			// A reader preempted for longer than the grace (userspace,
			// a loaded machine) is not what the grace covers: a BPF
			// program runs its lookups within microseconds.
			if time.Since(start) > w.Grace/2 {
				continue
			}
			if !ok || a == intent.PolicyAllow {
				allowed.Add(1)
			}
			reads.Add(1)
		}
	})
	for i := 1; i <= 30; i++ {
		step(i)
	}
	stop.Store(true)
	wg.Wait()
	if allowed.Load() != 0 {
		t.Errorf("the denied identity was allowed (or had no header) in %d of %d reads", allowed.Load(), reads.Load())
	}
	t.Logf("%d reads over 30 changes", reads.Load())
}

// TestWriterBoundedRoom: a reconcile that changes every policy at once
// fits a map with room for the live rules, the headers and Spare: old
// rule sets go (after the grace) whenever the next new one would not fit.
func TestWriterBoundedRoom(t *testing.T) {
	testenv.RequirePrivileged(t)
	m := testMaps(t)
	const n, rules, spare = 5, 2, 3
	small, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: uint32(unsafe.Sizeof(bpf.PolicyKey{})),
		ValueSize: uint32(unsafe.Sizeof(bpf.PolicyValue{})), MaxEntries: n*rules + n + spare, Flags: unix.BPF_F_NO_PREALLOC})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { small.Close() })
	m.Policies = small
	w, err := NewWriter(m)
	if err != nil {
		t.Fatal(err)
	}
	w.Grace, w.Spare = 0, spare
	names := []string{"a", "b", "c", "d", "e"}
	var p *Program
	for round := range 3 {
		in := Input{Service: svcs(names...)}
		for i, name := range names {
			in.Policies = append(in.Policies, intent.Policy{Service: name, DefaultAction: intent.PolicyDeny,
				AllowIdentities: []intent.Identity{intent.Identity(100*round + 1), intent.Identity(100*round + 2 + i)}})
		}
		if p, err = (Compiler{}).Compile(in, p); err != nil {
			t.Fatal(err)
		}
		for i, name := range names {
			if err := w.Attach(p.Policy(name), []uint32{uint32(i + 1)}); err != nil {
				t.Fatalf("round %d, %s: %v", round, name, err)
			}
		}
		if err := w.Prune(p, func(uint32) bool { return true }); err != nil {
			t.Fatal(err)
		}
		if got := countKeys(t, small); got != n*rules+n {
			t.Errorf("round %d: %d entries, want %d", round, got, n*rules+n)
		}
	}
}

// TestWriterL7Header: a policy that redirects has PolicyFlagL7 and its
// proxy's ifindex in its headers; switched to observe, neither.
func TestWriterL7Header(t *testing.T) {
	m := testMaps(t)
	w, err := NewWriter(m)
	if err != nil {
		t.Fatal(err)
	}
	head := func(mode intent.L7Mode) bpf.PolicyValue {
		t.Helper()
		in := Input{Policies: []intent.Policy{{Service: "a", DefaultAction: intent.PolicyAllow,
			L7: &intent.L7Policy{Mode: mode, Protocol: intent.L7HTTP, ProxyInterface: "p0"}}},
			Service: svcs("a"), Interface: func(string) (uint32, error) { return 7, nil }}
		p, err := Compiler{}.Compile(in, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Attach(p.Policy("a"), []uint32{5}); err != nil {
			t.Fatal(err)
		}
		var h bpf.PolicyValue
		if err := m.Policies.Lookup(bpf.PolicyKey{Id: 5, Identity: bpf.PolicyHeader}, &h); err != nil {
			t.Fatal(err)
		}
		return h
	}
	if h := head(intent.L7Enforce); h.Flags&bpf.PolicyFlagL7 == 0 || h.ProxyIfindex != 7 {
		t.Errorf("enforce header %+v: want PolicyFlagL7 toward 7", h)
	}
	if h := head(intent.L7Observe); h.Flags&bpf.PolicyFlagL7 != 0 || h.ProxyIfindex != 0 {
		t.Errorf("observe header %+v: want no L7", h)
	}
}
