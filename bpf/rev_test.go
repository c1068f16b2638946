package bpf

import (
	"bytes"
	"fmt"
	"net/netip"
	"testing"

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
