package bpf

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/pkt"
	"github.com/fluxvm/servicefabric/internal/testenv"
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
}

// newSeamHarness is newHarness on the test object.
func newSeamHarness(t *testing.T) (*harness, *seams) {
	t.Helper()
	h := &harness{t: t, th: testenv.NewThread(t)}
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
