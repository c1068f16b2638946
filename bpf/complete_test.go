package bpf

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// The test object: fluxvm_service.bpf.c with the seams described in
// testdata/fluxvm_test.bpf.c.
//
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_test serviceTest testdata/fluxvm_test.bpf.c -- -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu

// checksumComplete is ip_summed's CHECKSUM_COMPLETE.
const checksumComplete = 2

// seams are the test object's global variables.
type seams struct {
	Summed  *ebpf.Variable `ebpf:"fluxvm_test_summed"`
	Csum    *ebpf.Variable `ebpf:"fluxvm_test_csum"`
	Updates *ebpf.Variable `ebpf:"fluxvm_test_csum_updates"`

	Recycle     *ebpf.Variable `ebpf:"fluxvm_test_recycle"`
	RecycleKey4 *ebpf.Variable `ebpf:"fluxvm_test_recycle_key4"`
	RecycleKey6 *ebpf.Variable `ebpf:"fluxvm_test_recycle_key6"`
	RecycleVal  *ebpf.Variable `ebpf:"fluxvm_test_recycle_val"`
}

// newSeamHarness is newHarness on the test object.
func newSeamHarness(t *testing.T) (*harness, *seams) {
	t.Helper()
	h := &harness{t: t, th: testenv.NewThread(t), fes: map[uint32][]harnessFrontend{}, bes: map[uint32]harnessBackend{}, stored: map[uint32]bool{}}
	spec, err := loadServiceTest()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"} {
		spec.Maps[name].MaxEntries = 4096
	}
	h.spec = spec
	var objs struct {
		serviceObjects
		seams
	}
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		t.Fatalf("load: %v", err)
	}
	h.objs = objs.serviceObjects
	t.Cleanup(func() { h.objs.Close() })
	h.indexFrontends()
	s := objs.seams
	return h, &s
}

// csumLE is the kernel's csum_partial of b on a little-endian machine: the
// one's complement sum of its 16-bit words as loaded in host order (an odd
// last byte is the low byte of a word), not folded.
func csumLE(b []byte) uint32 {
	var s uint64
	for i := 0; i+1 < len(b); i += 2 {
		s += uint64(binary.LittleEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint64(b[len(b)-1])
	}
	for s>>32 != 0 {
		s = s&0xffffffff + s>>32
	}
	return uint32(s)
}

// csumEqual compares two partial sums as one's complement numbers: folded
// to 16 bits, with 0 and 0xffff both zero.
func csumEqual(a, b uint32) bool {
	fold := func(s uint32) uint32 {
		s = s&0xffff + s>>16
		s = s&0xffff + s>>16
		if s == 0xffff {
			s = 0
		}
		return s
	}
	return fold(a) == fold(b)
}

// runComplete runs frame through prog (on interface ifindex when not 0) as
// a CHECKSUM_COMPLETE packet whose skb->csum is right (the sum from the IP
// header on), and requires skb->csum to be right for the output as well.
func runComplete(t *testing.T, h *harness, s *seams, prog *ebpf.Program, frame []byte, ifindex int) (uint32, []byte) {
	t.Helper()
	h.must(s.Summed.Set(uint32(checksumComplete)))
	defer func() { h.must(s.Summed.Set(uint32(0))) }()
	seed := csumLE(frame[14:])
	h.must(s.Csum.Set(seed))
	h.must(s.Updates.Set(uint32(0)))
	ret, out := h.runOn(prog, frame, ifindex)
	var got, updates uint32
	h.must(s.Csum.Get(&got))
	h.must(s.Updates.Get(&updates))
	if want := csumLE(out[14:]); !csumEqual(got, want) {
		t.Fatalf("%s: skb->csum %#08x after %d bpf_csum_update, want %#08x (the output's sum; %#08x before)",
			prog, got, updates, want, seed)
	}
	return ret, out
}

// TestChecksumComplete runs every translation that writes to a packet on
// CHECKSUM_COMPLETE packets (see testdata/fluxvm_test.bpf.c for how): DNAT,
// DNAT + SNAT, both reply translations, and ICMP errors of both kinds, with
// IPv4 options and IPv6 extension headers. The output must be the bytes a
// full computation gives, and skb->csum the sum of those bytes.
func TestChecksumComplete(t *testing.T) {
	h, s := newSeamHarness(t)
	expect := func(t *testing.T, what string, p *ebpf.Program, in, want []byte) {
		t.Helper()
		ret, out := runComplete(t, h, s, p, in, 0)
		if ret != tcOK {
			t.Fatalf("%s: verdict %d, want TC_ACT_OK", what, int32(ret))
		}
		if !bytes.Equal(out, want) {
			t.Fatalf("%s:\n got %x\nwant %x", what, out, want)
		}
		if err := verifyChecksumsAnyHeaders(out); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	plain := headerKind{name: "plain", wrap: func(b []byte) []byte { return b }}
	for _, v := range variants() {
		for _, hk := range append([]headerKind{plain}, headerKinds()...) {
			if hk.name != "plain" && hk.v6 == v.client.Is4() {
				continue
			}
			t.Run(v.name+"/"+hk.name, func(t *testing.T) {
				w, b := hk.wrap, v.backends[0]

				h.reset()
				v.setup(h)
				c := v.clientAt(40000)
				expect(t, "east-west forward", h.objs.FluxvmFromVm, w(v.frame(c, v.vip, pkt.SYN)), w(v.frame(c, b, pkt.SYN)))
				expect(t, "east-west reply", h.objs.FluxvmToVm, w(v.frame(b, c, pkt.SYNACK)), w(v.frame(v.vip, c, pkt.SYNACK)))
				if hk.name == "plain" {
					sent, orig := v.frame(c, b, pkt.SYN), v.frame(c, v.vip, pkt.SYN)
					for _, k := range v.icmpErrors() {
						for _, q := range quoteLens {
							expect(t, "east-west ICMP "+k.name+"/"+q.name, h.objs.FluxvmToVm,
								icmpMsg(k, v.router(), c.Addr(), quote(sent, q.l4)),
								icmpMsg(k, v.router(), c.Addr(), quote(orig, q.l4)))
						}
					}
				}

				h.reset()
				v.nsSetup(h, 0)
				c = v.clientAt(snatMin + 2)
				sn := netip.AddrPortFrom(v.snatAddr(), c.Port())
				expect(t, "north-south forward", h.objs.FluxvmNsIn, w(v.frame(c, v.vip, pkt.SYN)), w(v.frame(sn, b, pkt.SYN)))
				for _, p := range []*ebpf.Program{h.objs.FluxvmNsIn, h.objs.FluxvmFromVm, h.objs.FluxvmNsOut} {
					expect(t, "north-south reply", p, w(v.frame(b, sn, pkt.SYNACK)), w(v.frame(v.vip, c, pkt.SYNACK)))
				}
				if hk.name == "plain" {
					sent, orig := v.frame(sn, b, pkt.SYN), v.frame(c, v.vip, pkt.SYN)
					for _, k := range v.icmpErrors() {
						for _, q := range quoteLens {
							expect(t, "SNAT ICMP "+k.name+"/"+q.name, h.objs.FluxvmNsIn,
								icmpMsg(k, v.router(), sn.Addr(), quote(sent, q.l4)),
								icmpMsg(k, v.router(), c.Addr(), quote(orig, q.l4)))
						}
					}
				}
			})
		}
	}
}

// TestChecksumCompleteSeam: the seam works, so a test above cannot pass
// because skb->csum was never asked to move: a DNAT of an IPv4 flow moves
// the sum by minus the address change (the header checksum absorbs the
// address, the L4 checksum its pseudo-header) and calls bpf_csum_update
// once. (With IPv6 the address and the L4 checksum cancel out, and no call
// is made.)
func TestChecksumCompleteSeam(t *testing.T) {
	h, s := newSeamHarness(t)
	v := variants()[0]
	v.setup(h)
	if ret, _ := runComplete(t, h, s, h.objs.FluxvmFromVm, v.fwd(40000, pkt.SYN), 0); ret != tcOK {
		t.Fatalf("verdict %d", int32(ret))
	}
	var n uint32
	h.must(s.Updates.Get(&n))
	if n != 1 {
		t.Fatalf("%d bpf_csum_update calls, want 1", n)
	}
}

// l4Residue is the sum of the L4 segment of an IPv6 frame without
// extension headers together with its pseudo-header: zero (as a one's
// complement number) when its checksum is right, and otherwise the error.
func l4Residue(frame []byte) uint32 {
	ip := frame[14:]
	plen := int(binary.BigEndian.Uint16(ip[4:]))
	pseudo := append(append([]byte{}, ip[8:40]...), 0, 0, byte(plen>>8), byte(plen), 0, 0, 0, ip[6])
	return csumLE(append(pseudo, ip[40:40+plen]...))
}

// TestIPv6UDPZeroChecksumPatched: a UDP checksum of zero means "none" in
// IPv4 only; in IPv6 it is a wrong checksum like any other (RFC 8200 8.1).
// DNAT and reverse NAT patch it, so the receiver sees the error it would
// have seen (the residue is the same), and not a zero over other addresses
// and ports -- on CHECKSUM_COMPLETE packets too.
func TestIPv6UDPZeroChecksumPatched(t *testing.T) {
	h, s := newSeamHarness(t)
	v := variants()[3] // ipv6 udp
	v.setup(h)
	c, b := v.clientAt(40000), v.backends[0]
	for _, tc := range []struct {
		name string
		prog *ebpf.Program
		in   []byte
	}{
		{"forward", h.objs.FluxvmFromVm, v.frame(c, v.vip, pkt.TCPFlags{})},
		{"reply", h.objs.FluxvmToVm, v.frame(b, c, pkt.TCPFlags{})},
	} {
		for _, complete := range []bool{false, true} {
			in := append([]byte(nil), tc.in...)
			binary.BigEndian.PutUint16(in[14+40+6:], 0)
			var ret uint32
			var out []byte
			if complete {
				ret, out = runComplete(t, h, s, tc.prog, in, 0)
			} else {
				ret, out = h.run(tc.prog, in)
			}
			if ret != tcOK {
				t.Fatalf("%s: verdict %d", tc.name, int32(ret))
			}
			if got, want := l4Residue(out), l4Residue(in); !csumEqual(got, want) {
				t.Errorf("%s (complete %v): checksum %#04x, residue %#08x, want the input's %#08x",
					tc.name, complete, binary.BigEndian.Uint16(out[14+40+6:]), got, want)
			}
		}
	}
}

// TestChecksumCompleteFIB: forwarding by FIB lookup (routed DSR, host
// routing) decrements the TTL / hop limit. The IPv4 header checksum absorbs
// the TTL, so skb->csum stays; the IPv6 hop limit is in no checksum but in
// skb->csum, which must move with it under CHECKSUM_COMPLETE.
func TestChecksumCompleteFIB(t *testing.T) {
	h, s := newSeamHarness(t)
	l := newFIBLab(t, h)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, SvcFlagDSR)
			in := v.fwd(40000, pkt.SYN)
			ret, out := runComplete(t, h, s, h.objs.FluxvmNsIn, in, l.in)
			if ret != tcRedirect {
				t.Fatalf("DSR: verdict %d, want TC_ACT_REDIRECT", int32(ret))
			}
			if want := l.forwarded(in, l.nbr); !bytes.Equal(out, want) {
				t.Fatalf("DSR:\n got %x\nwant %x", out, want)
			}

			h.reset()
			v.setup(h)
			h.svcFlags(sid, v.vip, v.proto, SvcFlagHostRouting)
			ret, out = runComplete(t, h, s, h.objs.FluxvmFromVm, v.fwd(40000, pkt.SYN), l.in)
			if ret != tcRedirect {
				t.Fatalf("host routing: verdict %d, want TC_ACT_REDIRECT", int32(ret))
			}
			if want := l.forwarded(v.frame(v.clientAt(40000), v.backends[0], pkt.SYN), l.nbr); !bytes.Equal(out, want) {
				t.Fatalf("host routing:\n got %x\nwant %x", out, want)
			}
		})
	}
}

// TestSNATFlagNotBitZero: the test object moves FLUXVM_NAT_F_SNAT and
// FLUXVM_CT_F_SNAT off bit 0; north-south flows must still be translated
// both ways (a flag compared as a bool held only at bit 0), and east-west
// replies must not take the SNAT path.
func TestSNATFlagNotBitZero(t *testing.T) {
	h, _ := newSeamHarness(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			c, b := v.clientAt(snatMin+2), v.backends[0]
			sn := netip.AddrPortFrom(v.snatAddr(), c.Port())
			if ret, out := h.run(h.objs.FluxvmNsIn, v.frame(c, v.vip, pkt.SYN)); ret != tcOK || !bytes.Equal(out, v.frame(sn, b, pkt.SYN)) {
				t.Fatalf("forward: verdict %d\n got %x\nwant %x", int32(ret), out, v.frame(sn, b, pkt.SYN))
			}
			for _, p := range []*ebpf.Program{h.objs.FluxvmNsIn, h.objs.FluxvmFromVm, h.objs.FluxvmNsOut} {
				want := v.frame(v.vip, c, pkt.SYNACK)
				if ret, out := h.run(p, v.frame(b, sn, pkt.SYNACK)); ret != tcOK || !bytes.Equal(out, want) {
					t.Fatalf("%s reply: verdict %d\n got %x\nwant %x", p, int32(ret), out, want)
				}
			}
			// The SNAT mapping is no east-west reply.
			expectUntouched(t, h, "to_vm", v.frame(b, sn, pkt.ACK))

			h.reset()
			v.setup(h)
			c = v.clientAt(40000)
			expectForward(t, h, v, c.Port(), pkt.SYN, b)
			if ret, out := h.run(h.objs.FluxvmToVm, v.frame(b, c, pkt.SYNACK)); ret != tcOK || !bytes.Equal(out, v.frame(v.vip, c, pkt.SYNACK)) {
				t.Fatalf("east-west reply: verdict %d\n got %x", int32(ret), out)
			}
		})
	}
}

// TestReplyCopiesReverseNAT: the reply path reads its reverse-NAT entry
// before any other map operation. The test object recycles the entry for
// another flow at the reply path's next map operation (as an LRU update on
// another CPU may); the packet must still be translated with the values
// the lookup found, on the established and on the refresh path.
func TestReplyCopiesReverseNAT(t *testing.T) {
	h, s := newSeamHarness(t)
	for _, v := range variants() {
		for _, tc := range []struct {
			name string
			f    pkt.TCPFlags
		}{{"syn-ack (refresh path)", pkt.SYNACK}, {"ack", pkt.ACK}} {
			f := tc.f
			t.Run(v.name+"/"+tc.name, func(t *testing.T) {
				h.reset()
				v.setup(h)
				c, b := v.clientAt(40000), v.backends[0]
				expectForward(t, h, v, c.Port(), pkt.SYN, b)
				key := v.natKey(b, c.Port()).key()
				other := NATValue{Vip: AddrWords(v.other), Vport: Port(9999), ServiceId: sid + 1, BackendId: 3}
				if v.client.Is4() {
					h.must(s.RecycleKey4.Set(key))
					h.must(s.Recycle.Set(uint32(4)))
				} else {
					h.must(s.RecycleKey6.Set(key))
					h.must(s.Recycle.Set(uint32(6)))
				}
				h.must(s.RecycleVal.Set(other))
				ret, out := h.run(h.objs.FluxvmToVm, v.frame(b, c, f))
				var armed uint32
				h.must(s.Recycle.Get(&armed))
				if armed != 0 {
					t.Fatal("the entry was not recycled: the seam did not run")
				}
				if want := v.frame(v.vip, c, f); ret != tcOK || !bytes.Equal(out, want) {
					t.Fatalf("reply: verdict %d\n got %x\nwant %x", int32(ret), out, want)
				}
			})
		}
	}
}
