package fluxvm

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// seeds are the two seeds that decide a new flow's backend.
type seeds struct{ hash, maglev uint64 }

// seedNode is one node of a would-be HA pair: a dataplane with a pin root
// and catalog of its own, whose programs run in a network namespace of
// their own, serving seedService.
type seedNode struct {
	d             *Dataplane
	th            *testenv.Thread
	root, catalog string
}

var (
	seedVIP4 = netip.AddrPortFrom(netip.MustParseAddr("10.96.0.20"), 80)
	seedVIP6 = netip.AddrPortFrom(netip.MustParseAddr("fd00:96::20"), 80)
)

// seedService has ten backends per family, so that most tuples that
// change slot also change backend.
func seedService() Service {
	s := Service{Name: "pair", VIPs: []netip.Addr{seedVIP4.Addr(), seedVIP6.Addr()}, Ports: []ServicePort{{Port: 80, Protocol: TCP}}}
	for i := range 10 {
		s.Backends = append(s.Backends,
			Backend{Address: netip.AddrFrom4([4]byte{10, 200, byte(10 + i), 2}), Port: 8080},
			Backend{Address: netip.MustParseAddr(fmt.Sprintf("fd00:200:%x::2", 10+i)), Port: 8080})
	}
	return s
}

// newSeedNode opens a node on a fresh pin root with the seeds and applies
// seedService.
func newSeedNode(t *testing.T, s seeds) *seedNode {
	t.Helper()
	n := &seedNode{th: testenv.NewThread(t), root: filepath.Join(testenv.PinRoot(t), "service"),
		catalog: filepath.Join(t.TempDir(), "catalog.json")}
	n.open(t, s)
	if _, err := n.d.ApplyService(context.Background(), seedService()); err != nil {
		t.Fatal(err)
	}
	return n
}

// open (re)opens the node's dataplane with the seeds.
func (n *seedNode) open(t *testing.T, s seeds) {
	t.Helper()
	d, err := Open(context.Background(), Options{
		Loader:              bpf.Options{PinRoot: n.root, Tier: bpf.TierS, HashSeed: s.hash},
		MaglevSeed:          s.maglev,
		CatalogPath:         n.catalog,
		ConntrackGCInterval: -1,
		Logger:              slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	n.d = d
}

// send runs the node's from_vm program on one TCP segment from client to
// the VIP of its family and returns the backend it was sent to: the
// datapath answers "which backend", not a second implementation.
func (n *seedNode) send(t *testing.T, client netip.AddrPort, f pkt.TCPFlags) netip.AddrPort {
	t.Helper()
	vip := seedVIP4
	if client.Addr().Is6() {
		vip = seedVIP6
	}
	frame := pkt.TCP(client, vip, f, []byte("seed"))
	opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+256), Repeat: 1}
	var ret uint32
	var err error
	n.th.Do(func() { ret, err = n.d.dp.Programs().FluxvmFromVm.Run(&opts) })
	if err != nil {
		t.Fatal(err)
	}
	if ret != 0 { // TC_ACT_OK: translated
		t.Fatalf("%s -> %s: verdict %d, want TC_ACT_OK", client, vip, int32(ret))
	}
	p := pkt.Decode(opts.DataOut)
	nl, tl := p.NetworkLayer(), p.TransportLayer()
	if nl == nil || tl == nil {
		t.Fatalf("%s -> %s: undecodable output", client, vip)
	}
	a, _ := netip.AddrFromSlice(nl.NetworkFlow().Dst().Raw())
	port := tl.TransportFlow().Dst().Raw()
	return netip.AddrPortFrom(a.Unmap(), uint16(port[0])<<8|uint16(port[1]))
}

// picks sends a SYN from every client and returns where each went.
func (n *seedNode) picks(t *testing.T, clients []netip.AddrPort) []netip.AddrPort {
	t.Helper()
	out := make([]netip.AddrPort, len(clients))
	for i, c := range clients {
		out[i] = n.send(t, c, pkt.SYN)
	}
	return out
}

// seedClients returns count client tuples per family, starting at from.
func seedClients(from, count int) []netip.AddrPort {
	var out []netip.AddrPort
	for i := from; i < from+count; i++ {
		port := uint16(30000 + i)
		out = append(out,
			netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), port),
			netip.AddrPortFrom(netip.MustParseAddr(fmt.Sprintf("fd00:1::%x", i+1)), port))
	}
	return out
}

func differing(a, b []netip.AddrPort) int {
	n := 0
	for i := range a {
		if a[i] != b[i] {
			n++
		}
	}
	return n
}

func checkSeeds(t *testing.T, what string, st Status, want seeds) {
	t.Helper()
	if st.Seeds != (SeedStatus{FlowHash: want.hash, Maglev: want.maglev}) {
		t.Errorf("%s: status seeds %+v, want hash %#x, maglev %#x", what, st.Seeds, want.hash, want.maglev)
	}
}

// TestSeedsAreConfiguration: two nodes (pin roots and network namespaces
// of their own) opened with the same seeds, the defaults included, send
// the same tuples to the same backends, as an HA pair must; another flow
// hash seed or another Maglev seed sends some elsewhere; the status
// reports both seeds. Reopening a node with other seeds applies them to
// new flows while its established flows keep their backends. It failed
// when a seed of 0 meant "random per node" and a seed in the pins won
// over the configuration.
func TestSeedsAreConfiguration(t *testing.T) {
	def, other := seeds{}, seeds{hash: 0x5eed_f00d_1234, maglev: 7}
	clients := seedClients(0, 100)

	a := newSeedNode(t, def)
	b := newSeedNode(t, def)
	checkSeeds(t, "default seeds", a.d.Status(), def)
	pa, pb := a.picks(t, clients), b.picks(t, clients)
	if n := differing(pa, pb); n != 0 {
		t.Errorf("two nodes with the default seeds disagree on %d of %d tuples", n, len(clients))
	}
	// More than one backend is in use, or agreeing would prove nothing.
	used := map[netip.AddrPort]bool{}
	for _, p := range pa {
		used[p] = true
	}
	if len(used) < 10 {
		t.Fatalf("%d tuples went to only %d backends", len(clients), len(used))
	}

	for _, s := range []seeds{other, {hash: other.hash}, {maglev: other.maglev}} {
		n1, n2 := newSeedNode(t, s), newSeedNode(t, s)
		checkSeeds(t, "configured seeds", n1.d.Status(), s)
		p1, p2 := n1.picks(t, clients), n2.picks(t, clients)
		if n := differing(p1, p2); n != 0 {
			t.Errorf("seeds %+v: two nodes disagree on %d of %d tuples", s, n, len(clients))
		}
		if n := differing(pa, p1); n < len(clients)/2 {
			t.Errorf("seeds %+v: only %d of %d tuples moved from where the default seeds send them", s, n, len(clients))
		}
		if s == other {
			pb = p1 // where new flows go under other
		}
	}

	// Reopen node a with the other seeds: its established flows (the
	// SYNs above, now acknowledged) stay put, new ones follow the seeds.
	for i, c := range clients {
		if got := a.send(t, c, pkt.ACK); got != pa[i] {
			t.Fatalf("%s: ACK went to %s, SYN to %s", c, got, pa[i])
		}
	}
	if err := a.d.Close(); err != nil {
		t.Fatal(err)
	}
	a.open(t, other)
	st := a.d.Status()
	checkSeeds(t, "reopened with other seeds", st, other)
	if !st.Load.HashSeedChanged || st.Load.PreviousHashSeed == nil || *st.Load.PreviousHashSeed != def.hash {
		t.Errorf("reopened: load %+v, want hash_seed_changed and previous_hash_seed %#x", st.Load, def.hash)
	}
	moved := 0
	for i, c := range clients {
		if got := a.send(t, c, pkt.ACK); got != pa[i] {
			t.Errorf("established %s moved from %s to %s when the seeds changed", c, pa[i], got)
		}
		if pa[i] != pb[i] {
			moved++
		}
	}
	if moved == 0 {
		t.Fatal("no established tuple would pick another backend under the new seeds: the test proves nothing")
	}
	fresh := seedClients(1000, 100)
	want := newSeedNode(t, other).picks(t, fresh)
	if n := differing(a.picks(t, fresh), want); n != 0 {
		t.Errorf("after reopening with other seeds, %d of %d new tuples went elsewhere than a node opened with them sends them", n, len(fresh))
	}

	// The same seeds again: nothing changed.
	if err := a.d.Close(); err != nil {
		t.Fatal(err)
	}
	a.open(t, other)
	if st := a.d.Status(); st.Load.HashSeedChanged || st.Load.PreviousHashSeed != nil {
		t.Errorf("reopened with the same seeds: load %+v", st.Load)
	}
}
