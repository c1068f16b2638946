package bpf

import (
	"bytes"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// TestReverseIndexOverflow: one backend endpoint behind more frontends than
// fluxvm_be2fe has slots. The frontends in the slots learn one entry per
// flow and their replies are derived; the frontend past them stores a
// reverse-NAT half, which the reply path finds through the overflow mark.
// Every client gets its replies from the VIP it used, and a connection
// that did not go through a VIP is left alone.
func TestReverseIndexOverflow(t *testing.T) {
	for _, fam := range []struct {
		name            string
		vip             func(i int) netip.AddrPort
		client, backend netip.AddrPort
	}{
		{"ipv4", func(i int) netip.AddrPort { return netip.MustParseAddrPort(fmt.Sprintf("10.96.0.%d:80", i)) },
			netip.MustParseAddrPort("10.0.0.1:0"), netip.MustParseAddrPort("10.1.0.1:8080")},
		{"ipv6", func(i int) netip.AddrPort { return netip.MustParseAddrPort(fmt.Sprintf("[fd00:96::%d]:80", i)) },
			netip.MustParseAddrPort("[fd00::1]:0"), netip.MustParseAddrPort("[fd00:1::1]:8080")},
	} {
		t.Run(fam.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			n := Be2feSlots + 1
			for i := 1; i <= n; i++ {
				s := uint32(i)
				h.service(s, fam.vip(i), ipTCP)
				h.backend(10*s, s, fam.backend, BackendReady, 0)
				h.table(s, h.fill(10*s))
			}
			h.revStored(uint32(n)) // the frontend past the slots
			client := func(i int) netip.AddrPort { return netip.AddrPortFrom(fam.client.Addr(), uint16(40000+i)) }

			for i := 1; i <= n; i++ {
				ret, out := h.run(h.objs.FluxvmFromVm, pkt.TCP(client(i), fam.vip(i), pkt.SYN, payload))
				if want := pkt.TCP(client(i), fam.backend, pkt.SYN, payload); ret != tcOK || !bytes.Equal(out, want) {
					t.Fatalf("frontend %d: verdict %d, packet %x, want %x", i, int32(ret), out, want)
				}
				ct, ok := h.ct(tuple{client(i), fam.vip(i), ipTCP})
				_, half := h.nat(tuple{fam.backend, client(i), ipTCP})
				stored := i > Be2feSlots
				if !ok || (ct.Flags == CTFlagRevDerived) == stored || half != stored {
					t.Errorf("frontend %d: conntrack %+v (present %v), reverse half %v; want stored=%v", i, ct, ok, half, stored)
				}
			}
			for i := 1; i <= n; i++ {
				ret, out := h.run(h.objs.FluxvmToVm, pkt.TCP(fam.backend, client(i), pkt.SYNACK, payload))
				if want := pkt.TCP(fam.vip(i), client(i), pkt.SYNACK, payload); ret != tcOK || !bytes.Equal(out, want) {
					t.Errorf("reply to frontend %d's client: verdict %d, packet %x, want %x", i, int32(ret), out, want)
				}
			}
			direct := netip.AddrPortFrom(fam.client.Addr(), 41000)
			expectUntouched(t, h, "to_vm", pkt.TCP(fam.backend, direct, pkt.SYNACK, payload))
		})
	}
}

// TestDerivedSynAck: a SYN-ACK on a derived flow. During the handshake,
// and as a retransmission on an established flow (the client's ACK was
// lost on its way to the backend), it is translated so that the client's
// stack answers it; after the flow ended it is a direct connection on a
// reused port, and its entry goes.
func TestDerivedSynAck(t *testing.T) {
	for _, tt := range []struct {
		name      string
		after     []pkt.TCPFlags // client packets after the SYN
		translate bool
	}{
		{"handshake", nil, true},
		{"retransmission on an established flow", []pkt.TCPFlags{pkt.ACK}, true},
		{"after FIN", []pkt.TCPFlags{pkt.ACK, pkt.FIN}, false},
		{"after RST", []pkt.TCPFlags{pkt.RST}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v := variants()[0] // ipv4_tcp
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			for _, f := range tt.after {
				expectForward(t, h, v, 40000, f, v.backends[0])
			}
			in := v.reply(v.backends[0], 40000, pkt.SYNACK)
			ret, out := h.run(h.objs.FluxvmToVm, in)
			_, kept := h.ct(v.flow(40000))
			if tt.translate {
				if want := v.frame(v.vip, v.clientAt(40000), pkt.SYNACK); ret != tcOK || !bytes.Equal(out, want) {
					t.Fatalf("verdict %d, packet %x, want %x", int32(ret), out, want)
				}
				if !kept {
					t.Error("the flow's entry is gone")
				}
				return
			}
			if ret == tcOK || !bytes.Equal(out, in) {
				t.Fatalf("verdict %d, packet %x: want it untouched", int32(ret), out)
			}
			if kept {
				t.Error("the ended flow's entry is still there")
			}
		})
	}
}

// TestReverseTwoVIPsOneTuple: the client uses one port toward two VIPs that
// share a backend, so the backend sees one tuple for both flows. The
// replies belong to the newer flow (as the newer stored half did), and a
// SYN-ACK to a new handshake, not to an ended flow on the other VIP.
func TestReverseTwoVIPsOneTuple(t *testing.T) {
	vip1, vip2 := netip.MustParseAddrPort("10.96.0.1:53"), netip.MustParseAddrPort("10.96.0.2:53")
	client := netip.MustParseAddrPort("10.0.0.1:40000")
	backend := netip.MustParseAddrPort("10.1.0.1:5353")
	for _, tt := range []struct {
		name  string
		proto uint8
		// first runs the flow to vip1; the flow to vip2 then starts
		// with a SYN (TCP) or a datagram.
		first []pkt.TCPFlags
		reply pkt.TCPFlags
	}{
		{"udp: the newer flow's replies", ipUDP, []pkt.TCPFlags{{}}, pkt.TCPFlags{}},
		{"tcp: a SYN-ACK after the other VIP's flow ended", ipTCP, []pkt.TCPFlags{pkt.SYN, pkt.ACK, pkt.FIN}, pkt.SYNACK},
		{"tcp: a SYN-ACK while the other VIP's flow is established", ipTCP, []pkt.TCPFlags{pkt.SYN, pkt.ACK}, pkt.SYNACK},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			frame := func(src, dst netip.AddrPort, f pkt.TCPFlags) []byte {
				if tt.proto == ipUDP {
					return pkt.UDP(src, dst, payload)
				}
				return pkt.TCP(src, dst, f, payload)
			}
			for i, vip := range []netip.AddrPort{vip1, vip2} {
				s := uint32(i + 1)
				h.service(s, vip, tt.proto)
				h.backend(10*s, s, backend, BackendReady, 0)
				h.table(s, h.fill(10*s))
			}
			run := func(vip netip.AddrPort, f pkt.TCPFlags) {
				t.Helper()
				if ret, out := h.run(h.objs.FluxvmFromVm, frame(client, vip, f)); ret != tcOK || !bytes.Equal(out, frame(client, backend, f)) {
					t.Fatalf("to %s: verdict %d", vip, int32(ret))
				}
			}
			for _, f := range tt.first {
				run(vip1, f)
			}
			// The flow to vip1 is the older one (the coarse clock
			// would give both the same creation time).
			older := tuple{client, vip1, tt.proto}
			ct, _ := h.ct(older)
			ct.CreatedNs -= uint64(time.Second)
			h.must(h.ctMap(older).Put(older.key(), ct))
			run(vip2, pkt.SYN)
			for range 2 {
				ret, out := h.run(h.objs.FluxvmToVm, frame(backend, client, tt.reply))
				if want := frame(vip2, client, tt.reply); ret != tcOK || !bytes.Equal(out, want) {
					t.Fatalf("reply: verdict %d\n got %x\nwant %x", int32(ret), out, want)
				}
			}
			if _, ok := h.ct(tuple{client, vip2, tt.proto}); !ok {
				t.Error("the flow to vip2 lost its entry")
			}
		})
	}
}

// TestStoredHalfBehindASlot: a flow with a stored half whose frontend has a
// slot (a flow of generation 3 after the upgrade, or of a frontend that
// moved into the slots) and whose conntrack entry the LRU evicted: its
// reply finds no entry through the slot, and the stored path rebuilds the
// entry from the half and translates it.
func TestStoredHalfBehindASlot(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.setup(h)
			h.revStored(sid)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			delete(h.stored, sid) // the frontend moves into a slot
			v.setup(h)
			h.must(h.ctMap(v.flow(40000)).Delete(v.flow(40000).key()))
			// Past the refresh interval, when a reply rebuilds.
			nk := v.natKey(v.backends[0], 40000)
			nat, _ := h.nat(nk)
			nat.LastSeenNs = 0
			h.must(h.natMap(nk).Put(nk.key(), nat))
			expectReply(t, h, v, v.backends[0], 40000)
			if ct, ok := h.ct(v.flow(40000)); !ok || ct.BackendId != 1 || ct.Flags != 0 {
				t.Errorf("conntrack %+v (present %v): want it rebuilt from the half", ct, ok)
			}
		})
	}
}

// TestStoredSynAckRetransmission: the stored path applies the east-west
// SYN-ACK rule too: a retransmitted SYN-ACK on an established flow is
// translated and the half stays.
func TestStoredSynAckRetransmission(t *testing.T) {
	h := newHarness(t)
	h.reset()
	v := variants()[0] // ipv4_tcp
	v.setup(h)
	h.revStored(sid)
	expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
	expectForward(t, h, v, 40000, pkt.ACK, v.backends[0])
	ret, out := h.run(h.objs.FluxvmToVm, v.reply(v.backends[0], 40000, pkt.SYNACK))
	if want := v.frame(v.vip, v.clientAt(40000), pkt.SYNACK); ret != tcOK || !bytes.Equal(out, want) {
		t.Fatalf("verdict %d, packet %x, want %x", int32(ret), out, want)
	}
	if _, ok := h.nat(v.natKey(v.backends[0], 40000)); !ok {
		t.Error("the half was taken for stale")
	}
}
