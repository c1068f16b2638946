package bpf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// TC_ACT_REDIRECT, as Program.Run reports a bpf_redirect* verdict. The
// test run does not send the packet; the output bytes are what would leave.
const tcRedirect = 7

// SNAT addresses and the port range of the north-south tests.
var (
	snat4 = netip.MustParseAddr("10.250.0.1")
	snat6 = netip.MustParseAddr("fd00:250::1")
)

const (
	snatMin = 40000
	snatMax = 40007 // eight ports, so that tests can fill the range
)

func (v variant) snatAddr() netip.Addr {
	if v.client.Is4() {
		return snat4
	}
	return snat6
}

// nsSetup installs the variant's service for the north-south edge only,
// with extra flags (DSR, host routing), backends 1..3 and a table that
// sends every new flow to backend 1, plus the node's SNAT configuration.
func (v variant) nsSetup(h *harness, flags uint32) {
	v.setup(h)
	h.svcFlags(sid, v.vip, v.proto, SvcFlagNorthSouth|SvcFlagNoEastWest|flags)
	h.snat(snatMin, snatMax)
}

// svcFlags rewrites the flags of frontend vip and its VIP marker.
func (h *harness) svcFlags(sid uint32, vip netip.AddrPort, proto uint8, flags uint32) {
	h.t.Helper()
	val := SvcValue{ServiceId: sid, Revision: 1, Flags: flags}
	marker := SvcValue{ServiceId: sid, Flags: SvcFlagVIPMarker | flags&(SvcFlagNorthSouth|SvcFlagNoEastWest), Revision: 1}
	w := AddrWords(vip.Addr())
	if vip.Addr().Is4() {
		h.must(h.fe.Put(SvcKey4{Vip: w[0], Port: Port(vip.Port()), Proto: proto}, val))
		h.must(h.fe.Put(SvcKey4{Vip: w[0], Proto: proto}, marker))
		return
	}
	h.must(h.objs.FluxvmSvc6.Put(SvcKey6{Vip: w, Port: Port(vip.Port()), Proto: proto}, val))
	h.must(h.objs.FluxvmSvc6.Put(SvcKey6{Vip: w, Proto: proto}, marker))
}

func (h *harness) snat(min, max uint16) {
	h.t.Helper()
	h.must(h.objs.FluxvmSnat.Put(uint32(0), SNATConfig{
		Addr4: AddrWords(snat4)[0], Addr6: AddrWords(snat6),
		PortMin: min, PortMax: max, Flags: SNATFlagV4 | SNATFlagV6,
	}))
}

func (h *harness) counters() Counters {
	h.t.Helper()
	c, err := ReadCounters(h.objs.FluxvmCounters)
	h.must(err)
	return c
}

// runOn runs prog on frame as if it arrived on interface ifindex of the
// harness's namespace (0: the test run's default, loopback).
func (h *harness) runOn(prog *ebpf.Program, frame []byte, ifindex int) (uint32, []byte) {
	h.t.Helper()
	if ifindex == 0 {
		return h.run(prog, frame)
	}
	// The leading fields of struct __sk_buff up to ifindex; the kernel
	// accepts a context prefix and takes the device from ifindex.
	type skbCtx struct {
		Len, PktType, Mark, QueueMapping, Protocol, VlanPresent, VlanTCI, VlanProto, Priority, IngressIfindex, Ifindex uint32
	}
	return h.runCtx(prog, frame, skbCtx{IngressIfindex: uint32(ifindex), Ifindex: uint32(ifindex)})
}

// runCtx runs prog once on frame with context ctx, on the harness's thread.
func (h *harness) runCtx(prog *ebpf.Program, frame []byte, ctx any) (uint32, []byte) {
	h.t.Helper()
	opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+256), Context: ctx, Repeat: 1}
	var ret uint32
	var err error
	h.th.Do(func() { ret, err = prog.Run(&opts) })
	if err != nil {
		h.t.Fatalf("run: %v", err)
	}
	return ret, opts.DataOut
}

// snatKey is the SNAT mapping's key: backend -> SNAT address:port.
func (v variant) snatKey(b netip.AddrPort, port uint16) tuple {
	return tuple{b, netip.AddrPortFrom(v.snatAddr(), port), v.proto}
}

// nsForward runs a client packet through fluxvm_ns_in and requires it
// DNATed to b and SNATed to the SNAT address, byte for byte; it returns the
// SNAT port.
func nsForward(t *testing.T, h *harness, v variant, client netip.AddrPort, f pkt.TCPFlags, b netip.AddrPort) uint16 {
	t.Helper()
	ret, out := h.run(h.objs.FluxvmNsIn, v.frame(client, v.vip, f))
	if ret != tcOK {
		t.Fatalf("verdict %d, want TC_ACT_OK", int32(ret))
	}
	src := srcOf(t, out)
	if src.Addr() != v.snatAddr() || src.Port() < snatMin || src.Port() > snatMax {
		t.Fatalf("source %s, want %s with a port in %d-%d", src, v.snatAddr(), snatMin, snatMax)
	}
	if want := v.frame(src, b, f); !bytes.Equal(out, want) {
		t.Fatalf("forward packet:\n got %x\nwant %x", out, want)
	}
	if err := pkt.VerifyChecksums(out); err != nil {
		t.Fatal(err)
	}
	return src.Port()
}

func srcOf(t *testing.T, frame []byte) netip.AddrPort {
	t.Helper()
	p := pkt.Decode(frame)
	if p.NetworkLayer() == nil || p.TransportLayer() == nil {
		t.Fatalf("undecodable packet %x", frame)
	}
	a, _ := netip.AddrFromSlice(p.NetworkLayer().NetworkFlow().Src().Raw())
	port := binary.BigEndian.Uint16(p.TransportLayer().TransportFlow().Src().Raw())
	return netip.AddrPortFrom(a.Unmap(), port)
}

// TestNorthSouthNAT follows one flow per variant through the north-south
// edge: DNAT + SNAT on the way in, both halves learned together, and the
// reply translated back on each hook that may see it first (the VM edge of
// a local backend, the north-south ingress for a remote one, the
// north-south egress for the node itself), never on the VM-edge egress.
func TestNorthSouthNAT(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			b := v.backends[0]
			in := v.clientAt(snatMin + 3) // in the range: the client keeps its port
			out := v.clientAt(1234)       // outside: a port is derived

			// The VM edge does not serve a north-south-only VIP.
			expectUntouched(t, h, "from_vm", v.frame(in, v.vip, pkt.SYN))

			for _, tc := range []struct {
				name     string
				client   netip.AddrPort
				wantPort uint16
			}{
				{"client port in range is kept", in, in.Port()},
				{"client port outside the range", out, 0},
			} {
				port := nsForward(t, h, v, tc.client, pkt.SYN, b)
				if tc.wantPort != 0 && port != tc.wantPort {
					t.Errorf("%s: SNAT port %d, want %d", tc.name, port, tc.wantPort)
				}
				ct, ok := h.ct(tuple{tc.client, v.vip, v.proto})
				if !ok {
					t.Fatalf("%s: no conntrack entry", tc.name)
				}
				if ct.Flags != CTFlagSNAT || Port(ct.NatPort) != port || Addr(ct.NatAddr, family(v.client)) != v.snatAddr() || ct.BackendId != 1 {
					t.Errorf("%s: conntrack %+v, want SNAT to %s:%d on backend 1", tc.name, ct, v.snatAddr(), port)
				}
				nv, ok := h.nat(v.snatKey(b, port))
				if !ok {
					t.Fatalf("%s: no SNAT mapping", tc.name)
				}
				if nv.Flags != NATFlagSNAT || Addr(nv.Client, family(v.client)) != tc.client.Addr() || Port(nv.Cport) != tc.client.Port() ||
					Addr(nv.Vip, family(v.client)) != v.vip.Addr() || Port(nv.Vport) != v.vip.Port() || nv.BackendId != 1 {
					t.Errorf("%s: mapping %+v", tc.name, nv)
				}

				reply := v.frame(b, netip.AddrPortFrom(v.snatAddr(), port), pkt.SYNACK)
				want := v.frame(v.vip, tc.client, pkt.SYNACK)
				for _, hook := range []struct {
					name string
					prog *ebpf.Program
				}{{"from_vm", h.objs.FluxvmFromVm}, {"ns_in", h.objs.FluxvmNsIn}, {"ns_out", h.objs.FluxvmNsOut}} {
					ret, got := h.run(hook.prog, reply)
					if ret != tcOK || !bytes.Equal(got, want) {
						t.Fatalf("%s: reply on %s: verdict %d\n got %x\nwant %x", tc.name, hook.name, int32(ret), got, want)
					}
				}
				expectUntouched(t, h, "to_vm", reply)
				// The established flow keeps its port and mapping.
				if p := nsForward(t, h, v, tc.client, pkt.ACK, b); p != port {
					t.Errorf("%s: established flow moved to port %d from %d", tc.name, p, port)
				}
			}
			if s := h.stats(sid); s.NewFlows != 2 || s.ReplyPackets != 6 {
				t.Errorf("stats %+v: want 2 new flows, 6 replies", s)
			}
		})
	}
}

// TestNorthSouthExposure: a VIP is served on the edges its flags name.
func TestNorthSouthExposure(t *testing.T) {
	h := newHarness(t)
	v := variants()[0]
	for _, tc := range []struct {
		name       string
		flags      uint32
		ns, vmEdge bool
	}{
		{"east-west", 0, false, true},
		{"north-south", SvcFlagNorthSouth | SvcFlagNoEastWest, true, false},
		{"both", SvcFlagNorthSouth, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h.reset()
			v.setup(h)
			h.snat(snatMin, snatMax)
			h.svcFlags(sid, v.vip, v.proto, tc.flags)
			for _, e := range []struct {
				prog  *ebpf.Program
				serve bool
			}{{h.objs.FluxvmNsIn, tc.ns}, {h.objs.FluxvmFromVm, tc.vmEdge}} {
				frame := v.fwd(40000, pkt.SYN)
				ret, out := h.run(e.prog, frame)
				if e.serve != (ret == tcOK) || !e.serve && !bytes.Equal(out, frame) {
					t.Errorf("%s: verdict %d, serve %v", e.prog, int32(ret), e.serve)
				}
				// A fragment to the VIP is dropped where the VIP is served.
				frag := pkt.SetIPv4Frag(v.fwd(40001, pkt.SYN), 0, true)
				if ret, _ := h.run(e.prog, frag); e.serve != (ret == tcShot) {
					t.Errorf("%s: fragment verdict %d, serve %v", e.prog, int32(ret), e.serve)
				}
			}
		})
	}
}

// TestSNATCollisions forces port clashes: many clients whose own port is
// the same one in the range. Each gets a distinct port, the clashes are
// counted, a full range drops the next flow after exactly SNATTries
// candidates without leaving half a flow behind, and another backend tuple
// still gets ports from the same range.
func TestSNATCollisions(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			b := v.backends[0]
			client := func(i int) netip.AddrPort {
				a := v.client.As16()
				a[15] += byte(i)
				return netip.AddrPortFrom(netip.AddrFrom16(a).Unmap(), snatMin) // all want the same port
			}
			before := h.counters()
			used := map[uint16]bool{}
			for i := range snatMax - snatMin + 1 {
				p := nsForward(t, h, v, client(i), pkt.SYN, b)
				if used[p] {
					t.Fatalf("client %d got port %d, already held", i, p)
				}
				used[p] = true
			}
			retries := h.counters()[CounterSNATRetry] - before[CounterSNATRetry]
			if retries < snatMax-snatMin {
				t.Errorf("retries +%d, want at least %d (every client after the first clashed)", retries, snatMax-snatMin)
			}
			t.Logf("%d flows on %d ports: %d retries", len(used), snatMax-snatMin+1, retries)

			// The range is full for this backend tuple.
			full := client(100)
			before = h.counters()
			nat4, nat6 := entryCount(h.objs.FluxvmNat4), entryCount(h.objs.FluxvmNat6)
			expectDropOn(t, h, h.objs.FluxvmNsIn, v.frame(full, v.vip, pkt.SYN), DropSNATFailed)
			if got := h.counters()[CounterSNATRetry] - before[CounterSNATRetry]; got != uint64(SNATTries) {
				t.Errorf("exhausted range: retries +%d, want %d", got, SNATTries)
			}
			if _, ok := h.ct(tuple{full, v.vip, v.proto}); ok {
				t.Error("a flow that could not get a port left a conntrack entry")
			}
			if n4, n6 := entryCount(h.objs.FluxvmNat4), entryCount(h.objs.FluxvmNat6); n4 != nat4 || n6 != nat6 {
				t.Errorf("reverse-NAT entries changed on a failed flow: %d/%d -> %d/%d", nat4, nat6, n4, n6)
			}

			// Another backend tuple has its own port space.
			h.table(sid, h.fill(2))
			p := nsForward(t, h, v, full, pkt.SYN, v.backends[1])
			if !used[p] {
				t.Errorf("port %d for backend 2: expected a port backend 1's flows also hold", p)
			}
		})
	}
}

func entryCount(m *ebpf.Map) int {
	n := 0
	k, val := make([]byte, m.KeySize()), make([]byte, m.ValueSize())
	it := m.Iterate()
	for it.Next(&k, &val) {
		n++
	}
	return n
}

// expectDropOn is expectDrop for any program.
func expectDropOn(t *testing.T, h *harness, prog *ebpf.Program, frame []byte, reason DropReason) {
	t.Helper()
	before := h.drops()
	ret, _ := h.run(prog, frame)
	if ret != tcShot {
		t.Fatalf("verdict %d, want TC_ACT_SHOT", int32(ret))
	}
	after := h.drops()
	for r := range NumDropReasons {
		want := uint64(0)
		if DropReason(r) == reason {
			want = 1
		}
		if got := after[r] - before[r]; got != want {
			t.Errorf("drop %s: +%d, want +%d", DropReason(r), got, want)
		}
	}
}

// TestSNATMappingLost: an established flow whose mapping the LRU evicted
// gets it back on its next packet; one whose port another flow took since
// is mapped afresh (counted) rather than mixing two flows' replies, and the
// other flow keeps its mapping.
func TestSNATMappingLost(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			b := v.backends[0]
			c := v.clientAt(snatMin + 1)
			port := nsForward(t, h, v, c, pkt.SYN, b)
			key := v.snatKey(b, port)

			h.must(h.natMap(key).Delete(key.key()))
			if p := nsForward(t, h, v, c, pkt.ACK, b); p != port {
				t.Errorf("evicted mapping: flow moved to port %d from %d", p, port)
			}
			if _, ok := h.nat(key); !ok {
				t.Fatal("evicted mapping was not recreated")
			}

			other := v.clientAt(9)
			stolen, _ := h.nat(key)
			stolen.Client, stolen.Cport = AddrWords(other.Addr()), Port(other.Port())
			h.must(h.natMap(key).Put(key.key(), stolen))
			before := h.counters()
			p := nsForward(t, h, v, c, pkt.ACK, b)
			if p == port {
				t.Fatalf("flow kept port %d that another flow holds", p)
			}
			if got := h.counters()[CounterSNATConflicts] - before[CounterSNATConflicts]; got != 1 {
				t.Errorf("snat_conflicts +%d, want +1", got)
			}
			if nv, _ := h.nat(key); nv != stolen {
				t.Errorf("the other flow's mapping changed: %+v", nv)
			}
			if ct, _ := h.ct(tuple{c, v.vip, v.proto}); Port(ct.NatPort) != p {
				t.Errorf("conntrack names port %d, packets use %d", Port(ct.NatPort), p)
			}
			if _, ok := h.nat(v.snatKey(b, p)); !ok {
				t.Error("no mapping for the new port")
			}
		})
	}
}

// TestSNATUnconfigured: without an SNAT address for the family, or with an
// empty range, a new north-south NAT flow drops.
func TestSNATUnconfigured(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants()[:1] {
		for _, tc := range []struct {
			name string
			cfg  SNATConfig
		}{
			{"no configuration", SNATConfig{}},
			{"no IPv4 address", SNATConfig{Addr6: AddrWords(snat6), PortMin: snatMin, PortMax: snatMax, Flags: SNATFlagV6}},
			{"empty range", SNATConfig{Addr4: AddrWords(snat4)[0], PortMin: snatMax, PortMax: snatMin, Flags: SNATFlagV4}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				h.reset()
				v.nsSetup(h, 0)
				h.must(h.objs.FluxvmSnat.Put(uint32(0), tc.cfg))
				expectDropOn(t, h, h.objs.FluxvmNsIn, v.fwd(40000, pkt.SYN), DropSNATFailed)
			})
		}
	}
}

// fibLab is the harness namespace set up for FIB lookups: packets arrive
// on "in"; backends 1 and 2 of each family are routed out of "out", with a
// permanent neighbour for backend 1 only; backend 3 has no route.
type fibLab struct {
	in, out     int
	outMAC, nbr net.HardwareAddr
}

func newFIBLab(t testing.TB, h *harness) fibLab {
	t.Helper()
	l := fibLab{nbr: net.HardwareAddr{0x02, 0xfb, 0, 0, 0, 0x01}}
	h.th.Do(func() {
		err := func() error {
			for _, f := range []string{"/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"} {
				if err := os.WriteFile(f, []byte("1"), 0o644); err != nil {
					return err
				}
			}
			for _, pair := range [][2]string{{"fibin", "fibin-p"}, {"fibout", "fibout-p"}} {
				la := netlink.NewLinkAttrs()
				la.Name = pair[0]
				if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: pair[1]}); err != nil {
					return err
				}
				for _, n := range pair {
					ln, err := netlink.LinkByName(n)
					if err != nil {
						return err
					}
					if err := netlink.LinkSetUp(ln); err != nil {
						return err
					}
				}
			}
			in, err := netlink.LinkByName("fibin")
			if err != nil {
				return err
			}
			out, err := netlink.LinkByName("fibout")
			if err != nil {
				return err
			}
			l.in, l.out, l.outMAC = in.Attrs().Index, out.Attrs().Index, out.Attrs().HardwareAddr
			for _, v := range []variant{variants()[0], variants()[2]} {
				for _, b := range v.backends[:2] {
					bits := 32
					if !b.Addr().Is4() {
						bits = 128
					}
					if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.out, Dst: &net.IPNet{IP: b.Addr().AsSlice(), Mask: net.CIDRMask(bits, bits)}}); err != nil {
						return fmt.Errorf("route %s: %w", b.Addr(), err)
					}
				}
				if err := netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.out, State: netlink.NUD_PERMANENT, IP: v.backends[0].Addr().AsSlice(), HardwareAddr: l.nbr}); err != nil {
					return fmt.Errorf("neighbour: %w", err)
				}
			}
			return nil
		}()
		if err != nil {
			t.Fatalf("fib lab: %v", err)
		}
	})
	return l
}

// forwarded is frame as the host would forward it out of l.out: our MACs,
// one less TTL (and the IPv4 header checksum patched to match).
func (l fibLab) forwarded(frame []byte, dmac net.HardwareAddr) []byte {
	out := append([]byte(nil), frame...)
	copy(out[0:6], dmac)
	copy(out[6:12], l.outMAC)
	if out[12] == 0x08 {
		out[14+8]--
		pkt.FixIPv4Checksum(out)
	} else {
		out[14+7]--
	}
	return out
}

// TestDSR: the packet keeps the VIP and is redirected toward the backend's
// next hop with the L2 header of that hop; nothing is translated, no
// reverse-NAT half exists, the affinity is the same as with NAT, and a
// backend without a route drops (the host would route by the VIP).
func TestDSR(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, SvcFlagDSR)
			frame := v.fwd(40000, pkt.SYN)
			before := h.counters()
			ret, out := h.runOn(h.objs.FluxvmNsIn, frame, l.in)
			if ret != tcRedirect {
				t.Fatalf("verdict %d, want TC_ACT_REDIRECT", int32(ret))
			}
			if want := l.forwarded(frame, l.nbr); !bytes.Equal(out, want) {
				t.Fatalf("DSR packet:\n got %x\nwant %x", out, want)
			}
			if err := pkt.VerifyChecksums(out); err != nil {
				t.Fatal(err)
			}
			if got := h.counters()[CounterDSRForwarded] - before[CounterDSRForwarded]; got != 1 {
				t.Errorf("dsr_forwarded +%d, want +1", got)
			}
			ct, ok := h.ct(v.flow(40000))
			if !ok || ct.Flags != CTFlagDSR || ct.BackendId != 1 {
				t.Fatalf("conntrack %+v (present %v), want DSR on backend 1", ct, ok)
			}
			if n := entryCount(h.natMap(v.flow(40000))); n != 0 {
				t.Errorf("%d reverse-NAT entries for a DSR flow", n)
			}

			// Affinity: the table now names backend 2, the flow stays.
			h.table(sid, h.fill(2))
			if ret, _ := h.runOn(h.objs.FluxvmNsIn, v.fwd(40000, pkt.ACK), l.in); ret != tcRedirect {
				t.Fatalf("established DSR flow: verdict %d", int32(ret))
			}
			if ct, _ := h.ct(v.flow(40000)); ct.BackendId != 1 {
				t.Errorf("established flow moved to backend %d", ct.BackendId)
			}
			// A new flow to backend 2, routed but without a known
			// neighbour, is handed to the kernel's neighbour resolution.
			ret, out = h.runOn(h.objs.FluxvmNsIn, v.fwd(40001, pkt.SYN), l.in)
			if ret != tcRedirect {
				t.Fatalf("unresolved neighbour: verdict %d, want TC_ACT_REDIRECT", int32(ret))
			}
			if want := v.fwd(40001, pkt.SYN); !bytes.Equal(out[12:], l.forwarded(want, l.nbr)[12:]) {
				t.Errorf("unresolved neighbour: L3 changed beyond the TTL:\n got %x\nwant %x", out[12:], l.forwarded(want, l.nbr)[12:])
			}
			// Backend 3 has no route.
			h.table(sid, h.fill(3))
			before2 := h.drops()
			ret, _ = h.runOn(h.objs.FluxvmNsIn, v.fwd(40002, pkt.SYN), l.in)
			if ret != tcShot || h.drops()[DropDSRNoRoute]-before2[DropDSRNoRoute] != 1 {
				t.Errorf("no route: verdict %d, dsr_no_route +%d", int32(ret), h.drops()[DropDSRNoRoute]-before2[DropDSRNoRoute])
			}
		})
	}
}

// TestHostRouting: with host_routing a translated packet is redirected on
// a FIB hit (conntrack already learned) and left to the host stack on a
// miss, never dropped; both are counted.
func TestHostRouting(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.setup(h)
			h.svcFlags(sid, v.vip, v.proto, SvcFlagHostRouting)
			before := h.counters()

			ret, out := h.runOn(h.objs.FluxvmFromVm, v.fwd(40000, pkt.SYN), l.in)
			if ret != tcRedirect {
				t.Fatalf("FIB hit: verdict %d, want TC_ACT_REDIRECT", int32(ret))
			}
			if want := l.forwarded(v.frame(v.clientAt(40000), v.backends[0], pkt.SYN), l.nbr); !bytes.Equal(out, want) {
				t.Fatalf("FIB hit:\n got %x\nwant %x", out, want)
			}
			if _, ok := h.ct(v.flow(40000)); !ok {
				t.Error("no conntrack entry learned before the redirect")
			}

			h.table(sid, h.fill(3)) // no route to backend 3
			ret, out = h.runOn(h.objs.FluxvmFromVm, v.fwd(40001, pkt.SYN), l.in)
			if ret != tcOK {
				t.Fatalf("FIB miss: verdict %d, want TC_ACT_OK", int32(ret))
			}
			if want := v.frame(v.clientAt(40001), v.backends[2], pkt.SYN); !bytes.Equal(out, want) {
				t.Fatalf("FIB miss: translated packet\n got %x\nwant %x", out, want)
			}
			after := h.counters()
			if r, f := after[CounterHostRouted]-before[CounterHostRouted], after[CounterHostRouteFallback]-before[CounterHostRouteFallback]; r != 1 || f != 1 {
				t.Errorf("host_routed_packets +%d, host_route_fallbacks +%d; want +1 each", r, f)
			}
		})
	}
}

// TestSNATReplyHostRouting: an SNAT mapping learned on a host_routing
// service sends its translated replies by FIB too.
func TestSNATReplyHostRouting(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	v := variants()[0]
	v.nsSetup(h, SvcFlagHostRouting)
	// The client sits behind "out" as well in this lab: route it there.
	h.th.Do(func() {
		err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.out, Dst: &net.IPNet{IP: v.client.AsSlice(), Mask: net.CIDRMask(32, 32)}})
		if err == nil {
			err = netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.out, State: netlink.NUD_PERMANENT, IP: v.client.AsSlice(), HardwareAddr: l.nbr})
		}
		if err != nil && !errors.Is(err, os.ErrExist) {
			t.Fatal(err)
		}
	})
	ret, out := h.runOn(h.objs.FluxvmNsIn, v.fwd(40000, pkt.SYN), l.in)
	if ret != tcRedirect {
		t.Fatalf("forward: verdict %d", int32(ret))
	}
	port := srcOf(t, out).Port()
	reply := v.frame(v.backends[0], netip.AddrPortFrom(snat4, port), pkt.SYNACK)
	ret, out = h.runOn(h.objs.FluxvmFromVm, reply, l.in)
	if ret != tcRedirect {
		t.Fatalf("reply: verdict %d, want TC_ACT_REDIRECT", int32(ret))
	}
	if want := l.forwarded(v.frame(v.vip, v.clientAt(40000), pkt.SYNACK), l.nbr); !bytes.Equal(out, want) {
		t.Fatalf("reply:\n got %x\nwant %x", out, want)
	}
}
