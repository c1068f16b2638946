package bpf

import (
	"bytes"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// The SNAT addresses of another edge of the group, in the peer tests.
var (
	peer4 = netip.MustParseAddr("10.250.0.9")
	peer6 = netip.MustParseAddr("fd00:250::9")
)

func (v variant) peerAddr() netip.Addr {
	if v.client.Is4() {
		return peer4
	}
	return peer6
}

// peersOn sets fluxvm_snat's SNATFlagPeers and peer_filter for addrs (on),
// or clears both.
func (h *harness) peersOn(on bool, addrs ...netip.Addr) {
	h.t.Helper()
	var cfg SNATConfig
	h.must(h.objs.FluxvmSnat.Lookup(uint32(0), &cfg))
	cfg.Flags &^= SNATFlagPeers
	cfg.PeerFilter = 0
	if on {
		cfg.Flags |= SNATFlagPeers
		cfg.PeerFilter = SNATPeerFilter(addrs)
	}
	h.must(h.objs.FluxvmSnat.Put(uint32(0), cfg))
}

// moveToPeer rewrites client c's SNAT flow to backend b on port as
// another edge's, translated to peer: the conntrack entry names peer's
// address, the mapping is keyed by it (what an import of that edge's
// snapshot writes). It returns the mapping's key.
func (h *harness) moveToPeer(v variant, c, b netip.AddrPort, port uint16, peer netip.Addr) tuple {
	h.t.Helper()
	own, moved := v.snatKey(b, port), tuple{b, netip.AddrPortFrom(peer, port), v.proto}
	nv, ok := h.nat(own)
	if !ok {
		h.t.Fatalf("%s: no SNAT mapping", c)
	}
	h.must(h.natMap(own).Delete(own.key()))
	h.must(h.natMap(moved).Put(moved.key(), nv))
	flow := tuple{c, v.vip, v.proto}
	ct, _ := h.ct(flow)
	ct.NatAddr = AddrWords(peer)
	h.must(h.ctMap(flow).Put(flow.key(), ct))
	return moved
}

// TestSNATPeers: a flow another edge of the group translated to its own
// SNAT address (brought here as replication writes it: the conntrack
// entry naming that address and port, the mapping keyed by them) is
// continued here only while that address is in fluxvm_snat_peers and the
// SNAT configuration has SNATFlagPeers: its replies are translated back
// on every hook that may see them first, and its packets keep their
// original source. Otherwise its replies are not ours and pass untouched.
func TestSNATPeers(t *testing.T) {
	h := newHarness(t)
	peers, err := NewSNATPeers(h.objs.FluxvmSnatPeers)
	h.must(err)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			b := v.backends[0]
			c := v.clientAt(snatMin + 2)
			port := nsForward(t, h, v, c, pkt.SYN, b)

			// Move the flow to the peer's address, as an import of the
			// peer's snapshot would have written it.
			peer := h.moveToPeer(v, c, b, port, v.peerAddr())

			reply := v.frame(b, peer.dst, pkt.ACK)
			translated := v.frame(v.vip, c, pkt.ACK)
			hooks := []struct {
				name string
				prog *ebpf.Program
			}{{"from_vm", h.objs.FluxvmFromVm}, {"ns_in", h.objs.FluxvmNsIn}, {"ns_out", h.objs.FluxvmNsOut}}
			expect := func(step string, ours bool) {
				t.Helper()
				for _, hook := range hooks {
					ret, got := h.run(hook.prog, reply)
					switch {
					case ours && (ret != tcOK || !bytes.Equal(got, translated)):
						t.Fatalf("%s: reply on %s: verdict %d\n got %x\nwant %x", step, hook.name, int32(ret), got, translated)
					case !ours && (ret != tcNext || !bytes.Equal(got, reply)):
						t.Fatalf("%s: reply on %s: verdict %d, want it untouched\n got %x\n in %x", step, hook.name, int32(ret), got, reply)
					}
				}
			}

			expect("not a peer", false)
			h.must(peers.Put([]SNATPeer{{Addr: v.peerAddr()}}))
			expect("a peer, without the flag", false)
			h.peersOn(true, v.peerAddr())
			expect("a peer", true)
			if err := pkt.VerifyChecksums(translated); err != nil {
				t.Fatal(err)
			}
			// The filter is consulted: without the peer's bit, no lookup.
			var cfg SNATConfig
			h.must(h.objs.FluxvmSnat.Lookup(uint32(0), &cfg))
			full := cfg.PeerFilter
			cfg.PeerFilter = ^full
			h.must(h.objs.FluxvmSnat.Put(uint32(0), cfg))
			expect("a peer whose filter bit is clear", false)
			cfg.PeerFilter = full
			h.must(h.objs.FluxvmSnat.Put(uint32(0), cfg))

			// The client's next packet leaves from the peer's address
			// and port, as on the edge that translated it first.
			ret, out := h.run(h.objs.FluxvmNsIn, v.frame(c, v.vip, pkt.ACK))
			if want := v.frame(peer.dst, b, pkt.ACK); ret != tcOK || !bytes.Equal(out, want) {
				t.Fatalf("forward of the peer's flow: verdict %d\n got %x\nwant %x", int32(ret), out, want)
			}
			// A new flow still takes this node's own address.
			nsForward(t, h, v, v.clientAt(snatMin+5), pkt.SYN, b)

			h.must(peers.Remove([]netip.Addr{v.peerAddr()}))
			expect("no longer a peer", false)
			h.peersOn(false)
		})
	}
}

// TestSNATPeersMap: List, Put and Remove on the real map, bounded by its
// size; the announce flag round-trips.
func TestSNATPeersMap(t *testing.T) {
	h := newHarness(t)
	peers, err := NewSNATPeers(h.objs.FluxvmSnatPeers)
	h.must(err)
	h.must(peers.Remove([]netip.Addr{peer4, peer6}))
	ten := netip.MustParseAddr("10.250.0.10")
	h.must(peers.Put([]SNATPeer{{Addr: peer6, Announce: true}, {Addr: peer4}, {Addr: netip.MustParseAddr("::ffff:10.250.0.10")}}))
	got, err := peers.List()
	h.must(err)
	want := []SNATPeer{{Addr: peer4}, {Addr: ten}, {Addr: peer6, Announce: true}}
	if !slices.Equal(got, want) {
		t.Fatalf("List = %v, want %v", got, want)
	}
	h.must(peers.Put([]SNATPeer{{Addr: peer6}, {Addr: peer4, Announce: true}}))
	got, _ = peers.List()
	if want := []SNATPeer{{Addr: peer4, Announce: true}, {Addr: ten}, {Addr: peer6}}; !slices.Equal(got, want) {
		t.Fatalf("after a flag change: %v, want %v", got, want)
	}
	h.must(peers.Remove([]netip.Addr{peer4, ten, peer6, netip.MustParseAddr("10.1.1.1")}))
	if got, _ := peers.List(); len(got) != 0 {
		t.Fatalf("after Remove: %v", got)
	}
	// One more than the map holds: Put fails on the last one.
	var many []SNATPeer
	for i := range SNATPeersMax + 1 {
		many = append(many, SNATPeer{Addr: netip.AddrFrom4([4]byte{10, 251, byte(i >> 8), byte(i)})})
	}
	if err := peers.Put(many); err == nil {
		t.Fatal("Put of more addresses than the map holds succeeded")
	}
	if got, _ := peers.List(); len(got) != SNATPeersMax {
		t.Fatalf("after a Put past the size: %d entries, want %d", len(got), SNATPeersMax)
	}
	h.reset()
	if _, err := NewSNATPeers(nil); err == nil {
		t.Fatal("NewSNATPeers(nil) succeeded")
	}
}

// BenchmarkSNATPeers: what a group costs the datapath, in alternate
// blocks on fluxvm_ns_in (IPv4 TCP). A reply to the node's own SNAT
// address with no peers and with eight peers listed (its own address is
// checked first: *own-peers-minus-none-ns* should be about 0); a reply of
// a flow another edge translated, to that edge's address (the peer
// lookup: *peer-minus-own-ns*, the price of continuing another edge's
// flow); and a packet that is neither to a VIP nor to an SNAT address,
// with no peers and with peers (the hash miss every such packet of a group
// node pays: *pass-peers-minus-none-ns*).
func BenchmarkSNATPeers(b *testing.B) {
	h := newHarnessSized(b, 0)
	v := variants()[0]
	v.nsSetup(h, 0)
	peers, err := NewSNATPeers(h.objs.FluxvmSnatPeers)
	h.must(err)
	var list []SNATPeer
	for i := range 8 {
		list = append(list, SNATPeer{Addr: netip.AddrFrom4([4]byte{10, 250, 1, byte(i + 1)})})
	}
	list[3].Addr = peer4
	h.must(peers.Put(list))
	addrs := make([]netip.Addr, len(list))
	for i, p := range list {
		addrs[i] = p.Addr
	}
	setFlag := func(on bool) func() { return func() { h.peersOn(on, addrs...) } }
	// An own flow, and a flow moved to the peer's address as an import
	// writes it.
	b4 := v.backends[0]
	learn := func(c netip.AddrPort) uint16 {
		if ret, _ := h.run(h.objs.FluxvmNsIn, v.frame(c, v.vip, pkt.SYN)); ret != tcOK {
			b.Fatalf("%s: flow not set up", c)
		}
		ct, ok := h.ct(tuple{c, v.vip, v.proto})
		if !ok {
			b.Fatalf("%s: no conntrack entry", c)
		}
		return Port(ct.NatPort)
	}
	c, moved := v.clientAt(snatMin+1), v.clientAt(snatMin+2)
	port, mport := learn(c), learn(moved)
	peer := h.moveToPeer(v, moved, b4, mport, peer4)

	ownReply := func(int) []byte { return v.frame(b4, netip.AddrPortFrom(snat4, port), pkt.ACK) }
	peerReply := func(int) []byte { return v.frame(b4, peer.dst, pkt.ACK) }
	other := func(int) []byte {
		return v.frame(netip.MustParseAddrPort("192.0.2.9:443"), netip.MustParseAddrPort("198.51.100.9:5555"), pkt.ACK)
	}
	cases := []*benchCase{
		{name: "reply to the own SNAT address, no peers", metric: "own", prog: h.objs.FluxvmNsIn, frame: ownReply, want: tcOK, before: setFlag(false)},
		{name: "reply to the own SNAT address, 8 peers", metric: "own-peers", prog: h.objs.FluxvmNsIn, frame: ownReply, want: tcOK, before: setFlag(true)},
		{name: "reply to a peer's SNAT address", metric: "peer", prog: h.objs.FluxvmNsIn, frame: peerReply, want: tcOK, before: setFlag(true)},
		{name: "pass-through (not a VIP, not SNAT), no peers", metric: "pass", prog: h.objs.FluxvmNsIn, frame: other, want: tcNext, before: setFlag(false)},
		{name: "pass-through (not a VIP, not SNAT), 8 peers", metric: "pass-peers", prog: h.objs.FluxvmNsIn, frame: other, want: tcNext, before: setFlag(true)},
	}
	measureInterleaved(b, h.th, benchCalls(b), cases, false)
	avg := func(i int) float64 { return float64(cases[i].sum) / float64(cases[i].n) }
	b.ReportMetric(avg(1)-avg(0), "own-peers-minus-none-ns")
	b.ReportMetric(avg(2)-avg(1), "peer-minus-own-ns")
	b.ReportMetric(avg(4)-avg(3), "pass-peers-minus-none-ns")
}

// TestSNATPeerFilter: the filter word the control plane computes holds the
// bit the datapath checks for every address: 256 peer addresses of each
// family, each alone in the map with the word of its own set, all
// translated; and the word has one bit an address (so 8 peers leave most
// bits clear).
func TestSNATPeerFilter(t *testing.T) {
	h := newHarness(t)
	peers, err := NewSNATPeers(h.objs.FluxvmSnatPeers)
	h.must(err)
	for _, v := range []variant{variants()[0], variants()[2]} {
		h.reset()
		v.nsSetup(h, 0)
		b := v.backends[0]
		c := v.clientAt(snatMin + 3)
		port := nsForward(t, h, v, c, pkt.SYN, b)
		own := v.snatKey(b, port)
		nv, _ := h.nat(own)
		for i := range 256 {
			a := netip.AddrFrom4([4]byte{10, 250, byte(i), byte(i*7 + 1)})
			if !v.client.Is4() {
				a = netip.AddrFrom16([16]byte{0xfd, 0, 2, 0x50, 0, 0, 0, 0, 0, 0, 0, 0, byte(i), byte(i * 3), byte(i * 5), byte(i*7 + 1)})
			}
			f := SNATPeerFilter([]netip.Addr{a})
			if f == 0 || f&(f-1) != 0 {
				t.Fatalf("%s: filter %#x, want one bit", a, f)
			}
			key := tuple{b, netip.AddrPortFrom(a, port), v.proto}
			h.must(h.natMap(key).Put(key.key(), nv))
			h.must(peers.Put([]SNATPeer{{Addr: a}}))
			var cfg SNATConfig
			h.must(h.objs.FluxvmSnat.Lookup(uint32(0), &cfg))
			cfg.Flags, cfg.PeerFilter = cfg.Flags|SNATFlagPeers, f
			h.must(h.objs.FluxvmSnat.Put(uint32(0), cfg))
			ret, out := h.run(h.objs.FluxvmNsIn, v.frame(b, key.dst, pkt.ACK))
			if want := v.frame(v.vip, c, pkt.ACK); ret != tcOK || !bytes.Equal(out, want) {
				t.Fatalf("%s: reply to peer %s not translated (verdict %d): Go's filter bit %#x is not the datapath's", v.name, a, int32(ret), f)
			}
			h.must(peers.Remove([]netip.Addr{a}))
			h.must(h.natMap(key).Delete(key.key()))
		}
	}
}
