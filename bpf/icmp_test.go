package bpf

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// Routers on the path that send the ICMP errors of these tests.
var (
	router4 = netip.MustParseAddr("192.0.2.1")
	router6 = netip.MustParseAddr("2001:db8::1")
)

func (v variant) router() netip.Addr {
	if v.client.Is4() {
		return router4
	}
	return router6
}

// icmpKind is one ICMP message type and code of the family.
type icmpKind struct {
	name       string
	typ, code  uint8
	mtu        uint16 // the MTU field (frag needed / packet too big)
	translated bool   // an error type the datapath translates
}

func (v variant) icmpErrors() []icmpKind {
	if v.client.Is4() {
		return []icmpKind{
			{"frag needed", 3, 4, 1400, true},
			{"port unreachable", 3, 3, 0, true},
			{"time exceeded", 11, 0, 0, true},
		}
	}
	return []icmpKind{
		{"packet too big", 2, 0, 1400, true},
		{"port unreachable", 1, 4, 0, true},
		{"time exceeded", 3, 0, 0, true},
	}
}

func (v variant) icmpEchoes() []icmpKind {
	if v.client.Is4() {
		return []icmpKind{{"echo request", 8, 0, 0, false}, {"echo reply", 0, 0, 0, false}}
	}
	return []icmpKind{{"echo request", 128, 0, 0, false}, {"echo reply", 129, 0, 0, false}}
}

// icmpMsg builds an ICMP message of kind k from src to dst whose body (after
// the 8-byte ICMP header) is body, every length and checksum computed.
func icmpMsg(k icmpKind, src, dst netip.Addr, body []byte) []byte {
	if src.Is4() {
		ip := pkt.IP(src, dst, layers.IPProtocolICMPv4)
		return pkt.Serialize(pkt.Ethernet(src), ip.(gopacket.SerializableLayer),
			&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(k.typ, k.code), Seq: k.mtu},
			gopacket.Payload(body))
	}
	ip := pkt.IP(src, dst, layers.IPProtocolICMPv6)
	ic := &layers.ICMPv6{TypeCode: layers.CreateICMPv6TypeCode(k.typ, k.code)}
	if err := ic.SetNetworkLayerForChecksum(ip); err != nil {
		panic(err)
	}
	rest := make([]byte, 4, 4+len(body))
	binary.BigEndian.PutUint32(rest, uint32(k.mtu))
	return pkt.Serialize(pkt.Ethernet(src), ip.(gopacket.SerializableLayer), ic,
		gopacket.Payload(append(rest, body...)))
}

// quote is the IP packet of frame as an ICMP error quotes it: all of it
// (l4 < 0) or its IP header and the first l4 bytes of its L4 header.
func quote(frame []byte, l4 int) []byte {
	ip := frame[14:]
	if l4 < 0 {
		return append([]byte(nil), ip...)
	}
	hl := 40
	if ip[0]>>4 == 4 {
		hl = int(ip[0]&0x0f) * 4
	}
	return append([]byte(nil), ip[:hl+l4]...)
}

// verifyICMP checks the ICMP checksum of frame from scratch (ICMPv6 with
// its pseudo-header) and the outer IPv4 header checksum.
func verifyICMP(frame []byte) error {
	if err := pkt.VerifyChecksums(frame); err != nil {
		return err
	}
	ip := frame[14:]
	if ip[0]>>4 == 4 {
		hl := int(ip[0]&0x0f) * 4
		tot := int(binary.BigEndian.Uint16(ip[2:]))
		if c := pkt.Checksum(ip[hl:tot]); c != 0 {
			return fmt.Errorf("bad ICMP checksum (residue %#04x)", c)
		}
		return nil
	}
	plen := int(binary.BigEndian.Uint16(ip[4:]))
	msg := ip[40 : 40+plen]
	pseudo := append(append([]byte{}, ip[8:40]...), 0, 0, byte(plen>>8), byte(plen), 0, 0, 0, 58)
	if c := pkt.Checksum(append(pseudo, msg...)); c != 0 {
		return fmt.Errorf("bad ICMPv6 checksum (residue %#04x)", c)
	}
	return nil
}

// verifyQuote checks the IPv4 header checksum of the quoted packet, and its
// L4 checksum when the whole packet is quoted.
func verifyQuote(frame []byte, whole bool) error {
	ip := frame[14:]
	off := 40 + 8
	if ip[0]>>4 == 4 {
		off = int(ip[0]&0x0f)*4 + 8
	}
	in := append(append([]byte(nil), frame[:14]...), ip[off:]...)
	if in[14]>>4 == 4 {
		binary.BigEndian.PutUint16(in[12:], 0x0800)
		hl := int(in[14]&0x0f) * 4
		if pkt.Checksum(in[14:14+hl]) != 0 {
			return fmt.Errorf("bad quoted IPv4 header checksum")
		}
	} else {
		binary.BigEndian.PutUint16(in[12:], 0x86dd)
	}
	if !whole {
		return nil
	}
	if err := pkt.VerifyChecksums(in); err != nil {
		return fmt.Errorf("quoted packet: %w", err)
	}
	return nil
}

func (h *harness) icmpTranslated() uint64 {
	h.t.Helper()
	return h.counters()[CounterICMPErrorsTranslated]
}

// quoteLens are the quote sizes a router may send: the whole packet, and
// the 8 bytes of L4 header RFC 792 guarantees (no TCP checksum in it).
var quoteLens = []struct {
	name string
	l4   int
}{{"whole quote", -1}, {"8-byte quote", 8}}

// expectICMP runs frame through prog and requires exactly want, with every
// checksum verifying, and the counter moved by one.
func expectICMP(t *testing.T, h *harness, prog *ebpf.Program, frame, want []byte, whole bool) {
	t.Helper()
	before := h.icmpTranslated()
	ret, out := h.run(prog, frame)
	if ret != tcOK {
		t.Fatalf("%s: verdict %d, want TC_ACT_OK", prog, int32(ret))
	}
	if !bytes.Equal(out, want) {
		t.Fatalf("%s: ICMP error:\n got %x\nwant %x", prog, out, want)
	}
	if err := verifyICMP(out); err != nil {
		t.Fatalf("%s: %v", prog, err)
	}
	if err := verifyQuote(out, whole); err != nil {
		t.Fatalf("%s: %v", prog, err)
	}
	if got := h.icmpTranslated() - before; got != 1 {
		t.Fatalf("%s: icmp_errors_translated +%d, want +1", prog, got)
	}
}

// expectICMPUntouched runs frame through prog and requires it passed on
// unmodified, without counting it as translated.
func expectICMPUntouched(t *testing.T, h *harness, prog *ebpf.Program, frame []byte) {
	t.Helper()
	before := h.icmpTranslated()
	ret, out := h.run(prog, frame)
	if ret != tcNext {
		t.Fatalf("%s: verdict %d, want TC_ACT_UNSPEC (next program)", prog, int32(ret))
	}
	if !bytes.Equal(out, frame) {
		t.Fatalf("%s: packet modified:\n in %x\nout %x", prog, frame, out)
	}
	if got := h.icmpTranslated() - before; got != 0 {
		t.Fatalf("%s: icmp_errors_translated +%d, want +0", prog, got)
	}
}

// TestICMPErrorEastWest: an error about an east-west flow, on its way to
// the client, quotes client -> backend; the client must see client -> VIP.
// The flow is found as its replies find it: derived (through its slot and
// conntrack entry), or by its stored half (a frontend past the slots).
func TestICMPErrorEastWest(t *testing.T) {
	h := newHarness(t)
	for _, mode := range []string{"derived", "stored"} {
		for _, v := range variants() {
			t.Run(mode+"/"+v.name, func(t *testing.T) {
				h.reset()
				v.setup(h)
				if mode == "stored" {
					h.revStored(sid)
				}
				c, b := v.clientAt(40000), v.backends[0]
				expectForward(t, h, v, c.Port(), pkt.SYN, b)
				nat, _ := h.nat(v.natKey(b, c.Port()))
				ct, _ := h.ct(v.flow(c.Port()))
				sent := v.frame(c, b, pkt.SYN)     // as it left us
				orig := v.frame(c, v.vip, pkt.SYN) // as the client sent it
				for _, k := range v.icmpErrors() {
					for _, q := range quoteLens {
						t.Run(k.name+"/"+q.name, func(t *testing.T) {
							in := icmpMsg(k, v.router(), c.Addr(), quote(sent, q.l4))
							want := icmpMsg(k, v.router(), c.Addr(), quote(orig, q.l4))
							expectICMP(t, h, h.objs.FluxvmToVm, in, want, q.l4 < 0)
							// Not for the north-south hooks: the destination
							// is no SNAT address.
							for _, p := range []*ebpf.Program{h.objs.FluxvmFromVm, h.objs.FluxvmNsIn, h.objs.FluxvmNsOut} {
								expectICMPUntouched(t, h, p, in)
							}
						})
					}
				}
				// A quoted IPv4 header with options.
				if v.client.Is4() {
					opts := []byte{1, 1, 1, 1, 1, 1, 1, 0}
					in := icmpMsg(v.icmpErrors()[0], v.router(), c.Addr(), quote(pkt.IPv4Options(sent, opts), -1))
					want := icmpMsg(v.icmpErrors()[0], v.router(), c.Addr(), quote(pkt.IPv4Options(orig, opts), -1))
					expectICMP(t, h, h.objs.FluxvmToVm, in, want, true)
				}
				// Nothing learned or refreshed from an ICMP error.
				if nat2, _ := h.nat(v.natKey(b, c.Port())); nat2 != nat {
					t.Errorf("reverse NAT changed: %+v -> %+v", nat, nat2)
				}
				if ct2, _ := h.ct(v.flow(c.Port())); ct2 != ct {
					t.Errorf("conntrack changed: %+v -> %+v", ct, ct2)
				}
			})
		}
	}
}

// TestICMPErrorSNAT: an error about a north-south flow comes to the SNAT
// address quoting SNAT -> backend; it must reach the client quoting
// client -> VIP, on every hook the flow's replies are translated on.
func TestICMPErrorSNAT(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			c, b := v.clientAt(1234), v.backends[0]
			port := nsForward(t, h, v, c, pkt.SYN, b)
			s := netip.AddrPortFrom(v.snatAddr(), port)
			nat, _ := h.nat(v.snatKey(b, port))
			sent := v.frame(s, b, pkt.SYN)
			orig := v.frame(c, v.vip, pkt.SYN)
			for _, k := range v.icmpErrors() {
				for _, q := range quoteLens {
					t.Run(k.name+"/"+q.name, func(t *testing.T) {
						in := icmpMsg(k, v.router(), s.Addr(), quote(sent, q.l4))
						want := icmpMsg(k, v.router(), c.Addr(), quote(orig, q.l4))
						for _, p := range []*ebpf.Program{h.objs.FluxvmNsIn, h.objs.FluxvmFromVm, h.objs.FluxvmNsOut} {
							expectICMP(t, h, p, in, want, q.l4 < 0)
						}
						// The VM-edge egress translates east-west flows only.
						expectICMPUntouched(t, h, h.objs.FluxvmToVm, in)
					})
				}
			}
			if nat2, _ := h.nat(v.snatKey(b, port)); nat2 != nat {
				t.Errorf("SNAT mapping changed: %+v -> %+v", nat, nat2)
			}
		})
	}
}

// TestICMPUntouched: ICMP that is no error about a tracked flow of the
// hook's kind passes on unmodified and uncounted.
func TestICMPUntouched(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.setup(h)
			h.snat(snatMin, snatMax)
			c, b := v.clientAt(40000), v.backends[0]
			expectForward(t, h, v, c.Port(), pkt.SYN, b)
			sent := v.frame(c, b, pkt.SYN)
			errs := v.icmpErrors()
			pmtu := errs[0]
			allHooks := []*ebpf.Program{h.objs.FluxvmToVm, h.objs.FluxvmFromVm, h.objs.FluxvmNsIn, h.objs.FluxvmNsOut}
			snatHooks := allHooks[1:]

			// An east-west mapping keyed to the SNAT address: an error to
			// the SNAT address quoting it is not ours to translate.
			s := netip.AddrPortFrom(v.snatAddr(), snatMin+1)
			ew := tuple{b, s, v.proto}
			h.must(h.natMap(ew).Put(ew.key(), NATValue{Vip: AddrWords(v.vip.Addr()), Vport: Port(v.vip.Port()), ServiceId: sid, BackendId: 1}))

			for _, tc := range []struct {
				name  string
				frame []byte
				progs []*ebpf.Program
			}{
				{"echo request", icmpMsg(v.icmpEchoes()[0], v.router(), c.Addr(), quote(sent, -1)), allHooks},
				{"echo reply", icmpMsg(v.icmpEchoes()[1], v.router(), c.Addr(), quote(sent, -1)), allHooks},
				{"echo to the SNAT address", icmpMsg(v.icmpEchoes()[0], v.router(), v.snatAddr(), quote(v.frame(s, b, pkt.SYN), -1)), allHooks},
				{"unknown flow", icmpMsg(pmtu, v.router(), c.Addr(), quote(v.frame(v.clientAt(40001), b, pkt.SYN), -1)), allHooks},
				{"unknown backend port", icmpMsg(pmtu, v.router(), c.Addr(), quote(v.frame(c, netip.AddrPortFrom(b.Addr(), 9), pkt.SYN), -1)), allHooks},
				{"quote of 4 L4 bytes", icmpMsg(pmtu, v.router(), c.Addr(), quote(sent, 4)), allHooks},
				{"quote of the IP header only", icmpMsg(pmtu, v.router(), c.Addr(), quote(sent, 0)), allHooks},
				{"error to another address", icmpMsg(pmtu, v.router(), v.other, quote(sent, -1)), allHooks},
				{"error about the reply direction", icmpMsg(pmtu, v.router(), b.Addr(), quote(v.frame(v.vip, c, pkt.SYNACK), -1)), allHooks},
				{"error to the SNAT address, east-west mapping", icmpMsg(pmtu, v.router(), v.snatAddr(), quote(v.frame(s, b, pkt.SYN), -1)), snatHooks},
				{"quote that is a fragment", icmpMsg(pmtu, v.router(), c.Addr(), quote(fragmentOf(sent), -1)), allHooks},
				{"outer fragment", fragmentOf(icmpMsg(pmtu, v.router(), c.Addr(), quote(sent, -1))), allHooks},
			} {
				t.Run(tc.name, func(t *testing.T) {
					for _, p := range tc.progs {
						expectICMPUntouched(t, h, p, tc.frame)
					}
				})
			}

			// An error about a north-south flow, at the VM-edge egress.
			h.reset()
			v.nsSetup(h, 0)
			port := nsForward(t, h, v, v.clientAt(1234), pkt.SYN, b)
			s = netip.AddrPortFrom(v.snatAddr(), port)
			expectICMPUntouched(t, h, h.objs.FluxvmToVm, icmpMsg(pmtu, v.router(), s.Addr(), quote(v.frame(s, b, pkt.SYN), -1)))
		})
	}
}

// fragmentOf marks frame's IP packet a first fragment: IPv4 with the MF
// flag, IPv6 with a fragment header (offset 0, M set).
func fragmentOf(frame []byte) []byte {
	if binary.BigEndian.Uint16(frame[12:]) == 0x0800 {
		return pkt.SetIPv4Frag(frame, 0, true)
	}
	return pkt.IPv6Ext(frame, pkt.Fragment(0, true))
}

// TestICMPCounter: over a mixed sequence the counter moves exactly by the
// number of translated errors.
func TestICMPCounter(t *testing.T) {
	h := newHarness(t)
	v := variants()[0]
	v.nsSetup(h, 0)
	h.svcFlags(sid, v.vip, v.proto, SvcFlagNorthSouth) // east-west too
	c, b := v.clientAt(40000), v.backends[0]
	expectForward(t, h, v, c.Port(), pkt.SYN, b)
	port := nsForward(t, h, v, v.clientAt(1234), pkt.SYN, b)
	s := netip.AddrPortFrom(v.snatAddr(), port)
	pmtu := v.icmpErrors()[0]
	ew := icmpMsg(pmtu, v.router(), c.Addr(), quote(v.frame(c, b, pkt.SYN), -1))
	ns := icmpMsg(pmtu, v.router(), s.Addr(), quote(v.frame(s, b, pkt.SYN), -1))
	echo := icmpMsg(v.icmpEchoes()[0], v.router(), c.Addr(), nil)
	before := h.icmpTranslated()
	want := uint64(0)
	for i := 0; i < 3; i++ {
		for _, r := range []struct {
			prog  *ebpf.Program
			frame []byte
			ok    bool
		}{
			{h.objs.FluxvmToVm, ew, true}, {h.objs.FluxvmNsIn, ew, false},
			{h.objs.FluxvmNsIn, ns, true}, {h.objs.FluxvmFromVm, ns, true}, {h.objs.FluxvmNsOut, ns, true},
			{h.objs.FluxvmToVm, ns, false}, {h.objs.FluxvmToVm, echo, false}, {h.objs.FluxvmNsIn, echo, false},
		} {
			ret, _ := h.run(r.prog, r.frame)
			if (ret == tcOK) != r.ok {
				t.Fatalf("%s: verdict %d, translated want %v", r.prog, int32(ret), r.ok)
			}
			if r.ok {
				want++
			}
		}
	}
	if got := h.icmpTranslated() - before; got != want {
		t.Errorf("icmp_errors_translated +%d, want +%d", got, want)
	}
}
