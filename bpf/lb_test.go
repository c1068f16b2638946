package bpf

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/maglev"
)

const (
	ipTCP = 6
	ipUDP = 17
	sid   = 7 // the service under test
)

// variant is one address family × protocol combination of the matrix.
type variant struct {
	name     string
	proto    uint8
	client   netip.Addr
	vip      netip.AddrPort
	backends []netip.AddrPort
	other    netip.Addr // an address that is no VIP
}

func variants() []variant {
	v4 := variant{
		client: netip.MustParseAddr("10.0.0.1"),
		vip:    netip.MustParseAddrPort("10.96.0.10:80"),
		backends: []netip.AddrPort{
			netip.MustParseAddrPort("10.1.0.1:8080"),
			netip.MustParseAddrPort("10.1.0.2:8080"),
			netip.MustParseAddrPort("10.1.0.3:8081"),
		},
		other: netip.MustParseAddr("10.96.0.99"),
	}
	v6 := variant{
		client: netip.MustParseAddr("fd00::1"),
		vip:    netip.MustParseAddrPort("[fd00:96::10]:80"),
		backends: []netip.AddrPort{
			netip.MustParseAddrPort("[fd00:1::1]:8080"),
			netip.MustParseAddrPort("[fd00:1::2]:8080"),
			netip.MustParseAddrPort("[fd00:1::3]:8081"),
		},
		other: netip.MustParseAddr("fd00:96::99"),
	}
	var out []variant
	for _, base := range []struct {
		fam string
		v   variant
	}{{"ipv4", v4}, {"ipv6", v6}} {
		for _, p := range []struct {
			name  string
			proto uint8
		}{{"tcp", ipTCP}, {"udp", ipUDP}} {
			v := base.v
			v.name = base.fam + "_" + p.name
			v.proto = p.proto
			out = append(out, v)
		}
	}
	return out
}

var payload = []byte("fluxvm")

// frame builds a packet of the variant's protocol; flags apply to TCP.
func (v variant) frame(src, dst netip.AddrPort, flags pkt.TCPFlags) []byte {
	if v.proto == ipTCP {
		return pkt.TCP(src, dst, flags, payload)
	}
	return pkt.UDP(src, dst, payload)
}

func (v variant) clientAt(port uint16) netip.AddrPort { return netip.AddrPortFrom(v.client, port) }

// fwd is client:port -> VIP; reply is backend -> client:port.
func (v variant) fwd(port uint16, f pkt.TCPFlags) []byte { return v.frame(v.clientAt(port), v.vip, f) }
func (v variant) reply(b netip.AddrPort, port uint16, f pkt.TCPFlags) []byte {
	return v.frame(b, v.clientAt(port), f)
}
func (v variant) flow(port uint16) tuple { return tuple{v.clientAt(port), v.vip, v.proto} }
func (v variant) natKey(b netip.AddrPort, port uint16) tuple {
	return tuple{b, v.clientAt(port), v.proto}
}

// setup installs the service with backends 1..3 (all Ready) and a table
// that sends every new flow to backend 1.
func (v variant) setup(h *harness) { v.setupAt(h, sid, 1) }

// setupAt is setup with service id s and backend ids first, first+1, ...
// (the table sends every new flow to first).
func (v variant) setupAt(h *harness, s, first uint32) {
	h.service(s, v.vip, v.proto)
	for i, b := range v.backends {
		h.backend(first+uint32(i), s, b, BackendReady, 0)
	}
	h.table(s, h.fill(first))
}

// expectReply runs a reply of backend b to the client's port through the
// VM-edge egress and requires its source translated back to the VIP, byte
// for byte.
func expectReply(t *testing.T, h *harness, v variant, b netip.AddrPort, port uint16) {
	t.Helper()
	ret, out := h.run(h.objs.FluxvmToVm, v.reply(b, port, pkt.ACK))
	if ret != tcOK {
		t.Fatalf("reply verdict %d, want TC_ACT_OK", int32(ret))
	}
	if want := v.frame(v.vip, v.clientAt(port), pkt.ACK); !bytes.Equal(out, want) {
		t.Fatalf("reply:\n got %x\nwant %x", out, want)
	}
	if err := pkt.VerifyChecksums(out); err != nil {
		t.Fatal(err)
	}
}

// expectForward runs a client packet and requires it DNATed to backend b
// byte for byte (addresses, ports and both checksums as a full computation
// would give them).
func expectForward(t *testing.T, h *harness, v variant, port uint16, f pkt.TCPFlags, b netip.AddrPort) {
	t.Helper()
	ret, out := h.run(h.objs.FluxvmFromVm, v.fwd(port, f))
	if ret != tcOK {
		t.Fatalf("verdict %d, want TC_ACT_OK", int32(ret))
	}
	want := v.frame(v.clientAt(port), b, f)
	if !bytes.Equal(out, want) {
		t.Fatalf("forward packet:\n got %x\nwant %x", out, want)
	}
	if err := pkt.VerifyChecksums(out); err != nil {
		t.Fatal(err)
	}
}

func expectUntouched(t *testing.T, h *harness, prog string, frame []byte) {
	t.Helper()
	p := h.objs.FluxvmFromVm
	if prog == "to_vm" {
		p = h.objs.FluxvmToVm
	}
	ret, out := h.run(p, frame)
	if ret != tcNext {
		t.Fatalf("verdict %d, want TC_ACT_UNSPEC (next program)", int32(ret))
	}
	if !bytes.Equal(out, frame) {
		t.Fatalf("packet modified:\n in %x\nout %x", frame, out)
	}
}

// expectDrop is expectDropOn for fluxvm_from_vm that also wants the drop
// counted against the service.
func expectDrop(t *testing.T, h *harness, frame []byte, reason DropReason) {
	t.Helper()
	st := h.stats(sid)
	expectDropOn(t, h, h.objs.FluxvmFromVm, frame, reason)
	if got := h.stats(sid).Drops - st.Drops; got != 1 {
		t.Errorf("service drops +%d, want +1", got)
	}
}

func (v variant) firstState() CTState {
	if v.proto == ipTCP {
		return CTTCPSyn
	}
	return CTUDP
}

func TestForwardingMatrix(t *testing.T) {
	scenarios := []struct {
		name string
		run  func(t *testing.T, h *harness, v variant)
	}{
		{"new flow is DNATed to the Maglev pick and learned", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			ct, ok := h.ct(v.flow(40000))
			if !ok {
				t.Fatal("no conntrack entry")
			}
			if ct.ServiceId != sid || ct.BackendId != 1 || CTState(ct.State) != v.firstState() {
				t.Errorf("conntrack %+v, want service %d backend 1 state %s", ct, sid, v.firstState())
			}
			timeout := uint64(DefaultTimeoutTCPSyn)
			if v.proto == ipUDP {
				timeout = uint64(DefaultTimeoutUDP)
			}
			if got := ct.DeadlineNs - ct.LastSeenNs; got != timeout*1e9 {
				t.Errorf("deadline is last_seen + %v, want %ds", time.Duration(got), timeout)
			}
			if now := monoNow(t); ct.CreatedNs > now || now-ct.CreatedNs > uint64(5*time.Second) {
				t.Errorf("created %d, now %d", ct.CreatedNs, now)
			}
			// One entry: the replies find the flow through fluxvm_be2fe.
			if ct.Flags != CTFlagRevDerived {
				t.Errorf("conntrack flags %#x, want CTFlagRevDerived", ct.Flags)
			}
			if nat, ok := h.nat(v.natKey(v.backends[0], 40000)); ok {
				t.Errorf("a reverse-NAT half was learned: %+v", nat)
			}
			st := h.stats(sid)
			if st.NewFlows != 1 || st.Packets != 1 || st.Bytes != uint64(len(v.fwd(40000, pkt.SYN))) {
				t.Errorf("stats %+v", st)
			}
		}},
		{"established flow keeps its backend", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			h.table(sid, h.fill(2))
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[0])
			if st := h.stats(sid); st.NewFlows != 1 || st.Packets != 2 {
				t.Errorf("stats %+v, want 1 new flow and 2 packets", st)
			}
			if v.proto == ipTCP {
				if ct, _ := h.ct(v.flow(40000)); CTState(ct.State) != CTTCPEstablished {
					t.Errorf("state %s after ACK, want established", CTState(ct.State))
				}
			}
		}},
		{"weight change keeps established flows, new flows follow the table", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			// Backend 1's weight dropped to 0: it left the table but is Ready.
			h.table(sid, h.fill(2))
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[0])
			expectForward(t, h, v, 40001, pkt.SYN, v.backends[1])
		}},
		{"draining keeps its flows until the deadline, then they fail over", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			h.backend(1, sid, v.backends[0], BackendDraining, monoNow(t)+uint64(time.Hour))
			h.table(sid, h.fill(2))
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[0])
			expectForward(t, h, v, 40001, pkt.SYN, v.backends[1])
			h.backend(1, sid, v.backends[0], BackendDraining, monoNow(t)-1)
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[1])
			if st := h.stats(sid); st.Failovers != 1 {
				t.Errorf("failovers %d, want 1", st.Failovers)
			}
		}},
		{"backend removed from the table keeps its flows while draining", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			h.backend(1, sid, v.backends[0], BackendDraining, monoNow(t)+uint64(time.Hour))
			h.table(sid, h.fill(3))
			for range 3 {
				expectForward(t, h, v, 40000, pkt.ACK, v.backends[0])
			}
		}},
		{"unhealthy backend fails over to a new pick", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			h.backend(1, sid, v.backends[0], BackendUnhealthy, 0)
			h.table(sid, h.fill(3))
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[2])
			if ct, _ := h.ct(v.flow(40000)); ct.BackendId != 3 {
				t.Errorf("conntrack still names backend %d", ct.BackendId)
			}
			// Replies follow the conntrack entry: the new backend's are
			// translated, the old backend's no longer are.
			expectReply(t, h, v, v.backends[2], 40000)
			expectUntouched(t, h, "to_vm", v.reply(v.backends[0], 40000, pkt.ACK))
			if st := h.stats(sid); st.Failovers != 1 || st.NewFlows != 2 {
				t.Errorf("stats %+v, want 1 failover, 2 new flows", st)
			}
		}},
		{"removed backend fails over", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			h.must(h.objs.FluxvmBackends.Put(uint32(1), Backend{}))
			h.table(sid, h.fill(2))
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[1])
		}},
		{"no eligible backend drops with a reason", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			h.noTable(sid)
			expectDrop(t, h, v.fwd(40000, pkt.SYN), DropNoBackend)
			h.table(sid, make([]uint32, len(h.fill(0))))
			expectDrop(t, h, v.fwd(40000, pkt.SYN), DropNoBackend)
			if _, ok := h.ct(v.flow(40000)); ok {
				t.Error("a dropped flow was learned")
			}
		}},
		{"table naming a backend that is not ready drops", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			h.backend(1, sid, v.backends[0], BackendUnhealthy, 0)
			expectDrop(t, h, v.fwd(40000, pkt.SYN), DropBackendInvalid)
		}},
		{"guard closed drops, also established flows", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			h.guard(sid, 0)
			expectDrop(t, h, v.fwd(40000, pkt.ACK), DropGuardClosed)
			expectDrop(t, h, v.fwd(40001, pkt.SYN), DropGuardClosed)
			h.guard(sid, GuardOpen)
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[0])
		}},
		{"per-interface statistics count service traffic only", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			h.edge()
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			expectUntouched(t, h, "from_vm", v.frame(v.clientAt(40000), netip.AddrPortFrom(v.other, 80), pkt.SYN))
			h.run(h.objs.FluxvmToVm, v.reply(v.backends[0], 40000, pkt.SYNACK))
			h.guard(sid, 0)
			expectDrop(t, h, v.fwd(40001, pkt.SYN), DropGuardClosed)
			if es := h.edgeStats(); es.Packets != 1 || es.NewFlows != 1 || es.ReplyPackets != 1 || es.Drops != 1 {
				t.Errorf("edge stats %+v, want 1 packet, 1 new flow, 1 reply, 1 drop", es)
			}
		}},
		{"reply is translated back to the VIP", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			in := v.reply(v.backends[0], 40000, pkt.SYNACK)
			ret, out := h.run(h.objs.FluxvmToVm, in)
			if ret != tcOK {
				t.Fatalf("verdict %d, want TC_ACT_OK", int32(ret))
			}
			want := v.frame(v.vip, v.clientAt(40000), pkt.SYNACK)
			if !bytes.Equal(out, want) {
				t.Fatalf("reply:\n got %x\nwant %x", out, want)
			}
			if err := pkt.VerifyChecksums(out); err != nil {
				t.Fatal(err)
			}
			if st := h.stats(sid); st.ReplyPackets != 1 || st.ReplyBytes != uint64(len(in)) {
				t.Errorf("stats %+v", st)
			}
		}},
		{"stale reverse-NAT entry never captures a direct connection", func(t *testing.T, h *harness, v variant) {
			if v.proto != ipTCP {
				return // UDP has no handshake to tell the two flows apart (docs/architecture.md)
			}
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(40000, pkt.RST)); ret != tcOK {
				t.Fatal("RST of the VIP flow not forwarded")
			}
			// The client reuses port 40000 for a direct connection to the
			// backend; the backend's SYN-ACK must reach it unchanged.
			before, _ := ReadCounters(h.objs.FluxvmCounters)
			expectUntouched(t, h, "to_vm", v.reply(v.backends[0], 40000, pkt.SYNACK))
			expectUntouched(t, h, "to_vm", v.reply(v.backends[0], 40000, pkt.ACK))
			after, _ := ReadCounters(h.objs.FluxvmCounters)
			if got := after[CounterNATStale] - before[CounterNATStale]; got != 1 {
				t.Errorf("nat_stale +%d, want +1", got)
			}
			if _, ok := h.nat(v.natKey(v.backends[0], 40000)); ok {
				t.Error("the stale reverse-NAT entry is still there")
			}
		}},
		{"traffic that is not for a service is untouched", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			other := netip.AddrPortFrom(v.other, 80)
			expectUntouched(t, h, "from_vm", v.frame(v.clientAt(40000), other, pkt.SYN))
			expectUntouched(t, h, "from_vm", v.frame(v.clientAt(40000), netip.AddrPortFrom(v.vip.Addr(), 81), pkt.SYN))
			expectUntouched(t, h, "to_vm", v.reply(v.backends[1], 40000, pkt.SYNACK))
			if _, ok := h.ct(v.flow(40000)); ok {
				t.Error("non-service traffic was learned")
			}
		}},
		{"truncated packet to the VIP is untouched", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectUntouched(t, h, "from_vm", cutL4(v.fwd(40000, pkt.SYN), 4))
		}},
		{"fragment addressed to the VIP is dropped", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			f := v.fwd(40000, pkt.SYN)
			var first, later []byte
			if v.vip.Addr().Is4() {
				first, later = pkt.SetIPv4Frag(f, 0, true), pkt.SetIPv4Frag(f, 1480, false)
			} else {
				first, later = pkt.IPv6Ext(f, pkt.Fragment(0, true)), pkt.IPv6Ext(f, pkt.Fragment(1448, false))
			}
			expectDrop(t, h, first, DropFragment)
			expectDrop(t, h, later, DropFragment)
		}},
		{"stored: lost reverse-NAT half is recreated on refresh", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			h.revStored(sid)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			nk := v.natKey(v.backends[0], 40000)
			h.must(h.natMap(nk).Delete(nk.key()))
			// Age the entry past the refresh interval.
			ct, _ := h.ct(v.flow(40000))
			ct.LastSeenNs = 0
			h.must(h.ctMap(v.flow(40000)).Put(v.flow(40000).key(), ct))
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[0])
			if _, ok := h.nat(nk); !ok {
				t.Fatal("reverse-NAT half not recreated")
			}
		}},
		{"stored: lost conntrack half is recreated from a reply", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			h.revStored(sid)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			h.must(h.ctMap(v.flow(40000)).Delete(v.flow(40000).key()))
			nk := v.natKey(v.backends[0], 40000)
			nat, _ := h.nat(nk)
			nat.LastSeenNs = 0
			h.must(h.natMap(nk).Put(nk.key(), nat))
			ret, _ := h.run(h.objs.FluxvmToVm, v.reply(v.backends[0], 40000, pkt.ACK))
			if ret != tcOK {
				t.Fatalf("verdict %d", int32(ret))
			}
			ct, ok := h.ct(v.flow(40000))
			if !ok || ct.BackendId != 1 || ct.ServiceId != sid {
				t.Fatalf("conntrack %+v (present %v), want backend 1", ct, ok)
			}
			// And the flow keeps its backend although the table moved.
			h.table(sid, h.fill(2))
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[0])
		}},
		{"derived: a lost conntrack entry leaves replies untouched, the next packet relearns it", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			h.must(h.ctMap(v.flow(40000)).Delete(v.flow(40000).key()))
			expectUntouched(t, h, "to_vm", v.reply(v.backends[0], 40000, pkt.ACK))
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[0])
			expectReply(t, h, v, v.backends[0], 40000)
		}},
		{"stored: a new flow learns both halves, its replies are translated", func(t *testing.T, h *harness, v variant) {
			v.setup(h)
			h.revStored(sid)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			if ct, _ := h.ct(v.flow(40000)); ct.Flags != 0 {
				t.Errorf("conntrack flags %#x, want none", ct.Flags)
			}
			nat, ok := h.nat(v.natKey(v.backends[0], 40000))
			if !ok {
				t.Fatal("no reverse-NAT entry")
			}
			if Addr(nat.Vip, family(v.vip.Addr())) != v.vip.Addr() || Port(nat.Vport) != v.vip.Port() || nat.BackendId != 1 || nat.ServiceId != sid {
				t.Errorf("reverse NAT %+v, want VIP %s", nat, v.vip)
			}
			expectReply(t, h, v, v.backends[0], 40000)
		}},
		{"a re-pick of a stored flow removes its reverse half", func(t *testing.T, h *harness, v variant) {
			// A flow learned with a half (stored, or by generation 3)
			// that fails over to a derived pick leaves no half behind.
			v.setup(h)
			h.revStored(sid)
			expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			delete(h.stored, sid) // the frontend moves into a slot
			v.setup(h)            // and loses SvcFlagRevStored
			h.backend(1, sid, v.backends[0], BackendUnhealthy, 0)
			h.table(sid, h.fill(2))
			expectForward(t, h, v, 40000, pkt.ACK, v.backends[1])
			if _, ok := h.nat(v.natKey(v.backends[0], 40000)); ok {
				t.Error("the superseded reverse half is still there")
			}
			if ct, _ := h.ct(v.flow(40000)); ct.Flags != CTFlagRevDerived || ct.BackendId != 2 {
				t.Errorf("conntrack %+v, want derived, backend 2", ct)
			}
			expectReply(t, h, v, v.backends[1], 40000)
		}},
	}
	h := newHarness(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			for _, sc := range scenarios {
				t.Run(sc.name, func(t *testing.T) {
					h.t = t
					h.reset()
					sc.run(t, h, v)
				})
			}
		})
	}
}

func family(a netip.Addr) uint8 {
	if a.Is4() {
		return FamilyIPv4
	}
	return FamilyIPv6
}

// TestSameVIPDistinctProtocols: TCP and UDP on one VIP and port are two
// services with their own backends.
func TestSameVIPDistinctProtocols(t *testing.T) {
	h := newHarness(t)
	vip := netip.MustParseAddrPort("10.96.0.53:53")
	cli := netip.MustParseAddrPort("10.0.0.1:5353")
	tcpB, udpB := netip.MustParseAddrPort("10.1.0.1:5300"), netip.MustParseAddrPort("10.1.0.2:5301")
	h.service(1, vip, ipTCP)
	h.service(2, vip, ipUDP)
	h.backend(10, 1, tcpB, BackendReady, 0)
	h.backend(20, 2, udpB, BackendReady, 0)
	h.table(1, h.fill(10))
	h.table(2, h.fill(20))

	_, out := h.run(h.objs.FluxvmFromVm, pkt.TCP(cli, vip, pkt.SYN, nil))
	if want := pkt.TCP(cli, tcpB, pkt.SYN, nil); !bytes.Equal(out, want) {
		t.Errorf("TCP went elsewhere:\n got %x\nwant %x", out, want)
	}
	_, out = h.run(h.objs.FluxvmFromVm, pkt.UDP(cli, vip, payload))
	if want := pkt.UDP(cli, udpB, payload); !bytes.Equal(out, want) {
		t.Errorf("UDP went elsewhere:\n got %x\nwant %x", out, want)
	}
	if a, b := h.stats(1), h.stats(2); a.NewFlows != 1 || b.NewFlows != 1 {
		t.Errorf("stats tcp %+v udp %+v", a, b)
	}
}

// TestTCPStates walks a connection through its states and checks each
// state's deadline, with timeouts configured in the meta map.
func TestTCPStates(t *testing.T) {
	h := newHarness(t)
	v := variants()[0] // ipv4 tcp
	v.setup(h)
	h.meta(Meta{SchemaVersion: SchemaVersion, TimeoutTcpSynS: 11, TimeoutTcpEstablishedS: 22, TimeoutTcpFinS: 33, TimeoutTcpRstS: 44, TimeoutUdpS: 55})
	steps := []struct {
		name    string
		frame   func() []byte
		prog    string
		want    CTState
		timeout uint64
	}{
		{"client SYN", func() []byte { return v.fwd(40000, pkt.SYN) }, "from_vm", CTTCPSyn, 11},
		{"backend SYN-ACK keeps SYN", func() []byte { return v.reply(v.backends[0], 40000, pkt.SYNACK) }, "to_vm", CTTCPSyn, 11},
		{"client ACK establishes", func() []byte { return v.fwd(40000, pkt.ACK) }, "from_vm", CTTCPEstablished, 22},
		{"backend FIN", func() []byte { return v.reply(v.backends[0], 40000, pkt.FIN) }, "to_vm", CTTCPFin, 33},
		{"client ACK keeps FIN", func() []byte { return v.fwd(40000, pkt.ACK) }, "from_vm", CTTCPFin, 33},
		{"client RST", func() []byte { return v.fwd(40000, pkt.RST) }, "from_vm", CTTCPRst, 44},
	}
	for _, s := range steps {
		p := h.objs.FluxvmFromVm
		if s.prog == "to_vm" {
			p = h.objs.FluxvmToVm
		}
		if ret, _ := h.run(p, s.frame()); ret != tcOK {
			t.Fatalf("%s: verdict %d", s.name, int32(ret))
		}
		ct, _ := h.ct(v.flow(40000))
		if CTState(ct.State) != s.want || ct.DeadlineNs-ct.LastSeenNs != s.timeout*1e9 {
			t.Errorf("%s: state %s deadline +%v, want %s +%ds", s.name, CTState(ct.State), time.Duration(ct.DeadlineNs-ct.LastSeenNs), s.want, s.timeout)
		}
	}

	// A new SYN on the closed entry is a new connection: it takes the
	// current table's pick instead of the old backend.
	h.table(sid, h.fill(2))
	expectForward(t, h, v, 40000, pkt.SYN, v.backends[1])

	u := variants()[1] // ipv4 udp
	u.setup(h)
	if ret, _ := h.run(h.objs.FluxvmFromVm, u.fwd(41000, pkt.TCPFlags{})); ret != tcOK {
		t.Fatal("udp not forwarded")
	}
	if ct, _ := h.ct(u.flow(41000)); CTState(ct.State) != CTUDP || ct.DeadlineNs-ct.LastSeenNs != 55e9 {
		t.Errorf("udp: state %s deadline +%v", CTState(ct.State), time.Duration(ct.DeadlineNs-ct.LastSeenNs))
	}
}

// TestUDPZeroChecksumStaysZero: an IPv4 UDP checksum of 0 means "none";
// the rewrite must not invent one.
func TestUDPZeroChecksumStaysZero(t *testing.T) {
	h := newHarness(t)
	v := variants()[1]
	v.setup(h)
	in := v.fwd(40000, pkt.TCPFlags{})
	binary.BigEndian.PutUint16(in[14+20+6:], 0)
	ret, out := h.run(h.objs.FluxvmFromVm, in)
	if ret != tcOK {
		t.Fatalf("verdict %d", int32(ret))
	}
	if c := binary.BigEndian.Uint16(out[14+20+6:]); c != 0 {
		t.Errorf("UDP checksum became %#04x", c)
	}
	if err := pkt.VerifyChecksums(out); err != nil {
		t.Error(err)
	}
}

// TestMaglevDistribution sends many new flows through a real weighted
// Maglev table and checks that the shares follow the weights.
// TestMaglevDistribution: new flows follow the weights through tables of
// every size the control plane builds (the program reads each table's own
// size), from the smallest rung of the ladder to the tier's largest.
func TestMaglevDistribution(t *testing.T) {
	h := newHarness(t)
	for _, size := range []uint32{maglev.SizeFor(3, maglev.SizeM), 4093, h.spec.Maps["fluxvm_maglev"].InnerMap.MaxEntries} {
		for _, v := range []variant{variants()[0], variants()[3]} {
			t.Run(fmt.Sprintf("%s/M=%d", v.name, size), func(t *testing.T) {
				h.reset()
				testMaglevDistribution(t, h, v, size)
			})
		}
	}
}

func testMaglevDistribution(t *testing.T, h *harness, v variant, size uint32) {
	h.service(sid, v.vip, v.proto)
	weights := []uint32{1, 1, 2}
	var mb []maglev.Backend
	for i, b := range v.backends {
		h.backend(uint32(i+1), sid, b, BackendReady, 0)
		mb = append(mb, maglev.Backend{ID: uint32(i + 1), Addr: b.Addr(), Port: b.Port(), Proto: v.proto, Weight: weights[i], Ready: true})
	}
	tbl, err := maglev.New(maglev.Config{Size: size, Seed: 42}, mb)
	if err != nil {
		t.Fatal(err)
	}
	h.table(sid, tbl.Entries())
	h.meta(Meta{SchemaVersion: SchemaVersion, HashSeed: 0x5eed})

	const flows = 4000
	got := map[netip.AddrPort]int{}
	for i := range flows {
		_, out := h.run(h.objs.FluxvmFromVm, v.fwd(uint16(10000+i), pkt.SYN))
		got[dstOf(t, out)]++
	}
	for i, b := range v.backends {
		want := float64(flows) * float64(weights[i]) / 4
		if d := float64(got[b]) - want; d > 0.1*want || d < -0.1*want {
			t.Errorf("backend %s got %d flows, want %.0f ±10%%", b, got[b], want)
		}
	}
	t.Logf("distribution over weights %v: %v", weights, got)
}

func dstOf(t *testing.T, frame []byte) netip.AddrPort {
	t.Helper()
	p := pkt.Decode(frame)
	nl, tl := p.NetworkLayer(), p.TransportLayer()
	if nl == nil || tl == nil {
		t.Fatalf("cannot decode %x", frame)
	}
	a, _ := netip.AddrFromSlice(nl.NetworkFlow().Dst().Raw())
	port := binary.BigEndian.Uint16(tl.TransportFlow().Dst().Raw())
	return netip.AddrPortFrom(a.Unmap(), port)
}
