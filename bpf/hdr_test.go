package bpf

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"testing"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// headerKind wraps a plain frame of a variant's family in IPv4 options or
// a chain of IPv6 extension headers, leaving the upper layer (and its
// checksum, which these headers do not enter) as it was. Applied to the
// expected frame too, it gives the bytes a full computation would.
type headerKind struct {
	name string
	v6   bool
	wrap func([]byte) []byte
}

func headerKinds() []headerKind {
	nop8 := []byte{1, 1, 1, 1, 1, 1, 1, 0}
	// Record route, 39 bytes, then end-of-options: the longest IPv4 header.
	rr := append([]byte{7, 39, 4}, make([]byte, 37)...)
	exts := func(e ...pkt.Ext) func([]byte) []byte {
		return func(b []byte) []byte { return pkt.IPv6Ext(b, e...) }
	}
	do56 := Ext(pkt.DestOpts, 56)
	return []headerKind{
		{"ipv4 options", false, func(b []byte) []byte { return pkt.IPv4Options(b, nop8) }},
		{"ipv4 40 bytes of options", false, func(b []byte) []byte { return pkt.IPv4Options(b, rr) }},
		{"ipv6 hop-by-hop", true, exts(pkt.HopByHop)},
		{"ipv6 hbh+routing+dest", true, exts(pkt.HopByHop, pkt.Routing, pkt.DestOpts)},
		{"ipv6 auth header", true, exts(pkt.AH)},
		// Eight headers with the L4 header near the parser's 512 bytes.
		{"ipv6 eight ext headers", true, exts(pkt.HopByHop, do56, do56, do56, do56, do56, do56, do56)},
	}
}

// verifyChecksumsAnyHeaders is pkt.VerifyChecksums for frames with IPv4
// options or IPv6 extension headers, which also checks ICMP and ICMPv6
// checksums. A routing header with segments left (whose pseudo-header
// would carry the final destination) is an error.
func verifyChecksumsAnyHeaders(frame []byte) error {
	var pseudo, l4 []byte
	var proto byte
	switch binary.BigEndian.Uint16(frame[12:]) {
	case 0x0800:
		ip := frame[14:]
		hl := int(ip[0]&0x0f) * 4
		tot := int(binary.BigEndian.Uint16(ip[2:]))
		if tot < hl || len(ip) < tot {
			return fmt.Errorf("bad IPv4 lengths")
		}
		if pkt.Checksum(ip[:hl]) != 0 {
			return fmt.Errorf("bad IPv4 header checksum")
		}
		proto, l4 = ip[9], ip[hl:tot]
		pseudo = append(append([]byte{}, ip[12:20]...), 0, proto, byte(len(l4)>>8), byte(len(l4)))
	case 0x86dd:
		ip := frame[14:]
		end := 40 + int(binary.BigEndian.Uint16(ip[4:]))
		if len(ip) < end {
			return fmt.Errorf("bad IPv6 length")
		}
		ip = ip[:end] // slicing past end would read beyond the frame's length
		nh, off := ip[6], 40
		for {
			switch nh {
			case 43:
				if ip[off+3] != 0 {
					return fmt.Errorf("routing header with segments left")
				}
				nh, off = ip[off], off+(int(ip[off+1])+1)*8
				continue
			case 0, 60, 135:
				nh, off = ip[off], off+(int(ip[off+1])+1)*8
				continue
			case 51:
				nh, off = ip[off], off+(int(ip[off+1])+2)*4
				continue
			case 44:
				nh, off = ip[off], off+8
				continue
			}
			break
		}
		if off > end {
			return fmt.Errorf("extension headers beyond the payload")
		}
		proto, l4 = nh, ip[off:end]
		pseudo = append(append([]byte{}, ip[8:40]...), 0, 0, byte(len(l4)>>8), byte(len(l4)), 0, 0, 0, proto)
	default:
		return fmt.Errorf("not IP")
	}
	switch proto {
	case 6:
		if len(l4) < 20 {
			return fmt.Errorf("short TCP header")
		}
	case 17:
		if len(l4) < 8 {
			return fmt.Errorf("short UDP header")
		}
	case 1: // ICMP: no pseudo-header
		if len(pseudo) != 12 {
			return nil
		}
		if c := pkt.Checksum(l4); c != 0 {
			return fmt.Errorf("bad ICMP checksum (residue %#04x)", c)
		}
		return nil
	case 58: // ICMPv6: over the pseudo-header
		if len(pseudo) == 12 {
			return nil
		}
	default:
		return nil
	}
	if proto == 17 && binary.BigEndian.Uint16(l4[6:]) == 0 {
		if len(pseudo) == 12 {
			return nil // IPv4: no checksum
		}
		return fmt.Errorf("IPv6 UDP checksum is zero")
	}
	if c := pkt.Checksum(append(pseudo, l4...)); c != 0 {
		return fmt.Errorf("bad L4 checksum (residue %#04x)", c)
	}
	return nil
}

// TestRewriteWithHeaders: DNAT, DNAT + SNAT and both reply translations on
// packets whose L4 header is not right after a bare IP header (IPv4
// options, IPv6 extension headers up to the parser's limits). The output
// must be byte for byte the frame a full computation would give.
func TestRewriteWithHeaders(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants() {
		for _, hk := range headerKinds() {
			if hk.v6 == v.client.Is4() {
				continue
			}
			t.Run(v.name+"/"+hk.name, func(t *testing.T) {
				w := hk.wrap
				check := func(what string, ret uint32, out, want []byte) {
					t.Helper()
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
				b := v.backends[0]

				// East-west: DNAT at the VM edge, reply at to_vm.
				h.reset()
				v.setup(h)
				c := v.clientAt(40000)
				ret, out := h.run(h.objs.FluxvmFromVm, w(v.frame(c, v.vip, pkt.SYN)))
				check("east-west forward", ret, out, w(v.frame(c, b, pkt.SYN)))
				ret, out = h.run(h.objs.FluxvmToVm, w(v.frame(b, c, pkt.SYNACK)))
				check("east-west reply", ret, out, w(v.frame(v.vip, c, pkt.SYNACK)))

				// North-south: DNAT + SNAT at ns_in, the reply at ns_in.
				h.reset()
				v.nsSetup(h, 0)
				c = v.clientAt(snatMin + 2)
				s := netip.AddrPortFrom(v.snatAddr(), c.Port())
				ret, out = h.run(h.objs.FluxvmNsIn, w(v.frame(c, v.vip, pkt.SYN)))
				check("north-south forward", ret, out, w(v.frame(s, b, pkt.SYN)))
				for _, hook := range []struct {
					name string
					run  func([]byte) (uint32, []byte)
				}{
					{"ns_in", func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmNsIn, f) }},
					{"from_vm", func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmFromVm, f) }},
					{"ns_out", func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmNsOut, f) }},
				} {
					ret, out = hook.run(w(v.frame(b, s, pkt.SYNACK)))
					check("north-south reply on "+hook.name, ret, out, w(v.frame(v.vip, c, pkt.SYNACK)))
				}
			})
		}
	}
}

// TestFIBWithHeaders: routed DSR and host routing of packets with IPv4
// options or IPv6 extension headers: only the L2 header and the TTL / hop
// limit change (and the IPv4 header checksum with it).
func TestFIBWithHeaders(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	for _, v := range variants() {
		for _, hk := range headerKinds() {
			if hk.v6 == v.client.Is4() {
				continue
			}
			t.Run(v.name+"/"+hk.name, func(t *testing.T) {
				w := hk.wrap
				h.reset()
				v.nsSetup(h, SvcFlagDSR)
				in := w(v.fwd(40000, pkt.SYN))
				ret, out := h.runOn(h.objs.FluxvmNsIn, in, l.in)
				if ret != tcRedirect {
					t.Fatalf("DSR: verdict %d, want TC_ACT_REDIRECT", int32(ret))
				}
				if want := l.forwarded(in, l.nbr); !bytes.Equal(out, want) {
					t.Fatalf("DSR:\n got %x\nwant %x", out, want)
				}

				h.reset()
				v.setup(h)
				h.svcFlags(sid, v.vip, v.proto, SvcFlagHostRouting)
				ret, out = h.runOn(h.objs.FluxvmFromVm, w(v.fwd(40000, pkt.SYN)), l.in)
				if ret != tcRedirect {
					t.Fatalf("host routing: verdict %d, want TC_ACT_REDIRECT", int32(ret))
				}
				want := l.forwarded(w(v.frame(v.clientAt(40000), v.backends[0], pkt.SYN)), l.nbr)
				if !bytes.Equal(out, want) {
					t.Fatalf("host routing:\n got %x\nwant %x", out, want)
				}
				if err := verifyChecksumsAnyHeaders(out); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

// withActiveRouting turns frame (built to final, so that its L4 checksum
// is over final's pseudo-header, as RFC 8200 §8.1 wants with a routing
// header) into a packet whose current destination is dst with a type-0
// routing header listing final and one segment left.
func withActiveRouting(frame []byte, dst, final netip.Addr) []byte {
	out := pkt.IPv6Ext(frame, pkt.Routing)
	rh := out[14+40:]
	rh[3] = 1 // segments left
	a, f := dst.As16(), final.As16()
	copy(rh[8:24], f[:])
	copy(out[14+24:14+40], a[:])
	return out
}

// TestActiveRoutingHeaderUntouched: an IPv6 packet whose routing header
// still has segments left is addressed to its current destination only
// as a waypoint; its transport header belongs to the final destination,
// and its L4 checksum is over that address. Such a packet to a VIP (or to
// the SNAT address) is no service traffic: it passes untouched, in either
// direction, on every hook.
func TestActiveRoutingHeaderUntouched(t *testing.T) {
	h := newHarness(t)
	final := netip.MustParseAddr("fd00:77::1")
	for _, v := range variants()[2:] {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.setup(h)
			h.svcFlags(sid, v.vip, v.proto, SvcFlagNorthSouth) // east-west and north-south
			h.snat(snatMin, snatMax)
			c := v.clientAt(snatMin + 1)
			b := v.backends[0]
			fwd := withActiveRouting(v.frame(c, netip.AddrPortFrom(final, v.vip.Port()), pkt.SYN), v.vip.Addr(), final)
			for _, p := range []struct {
				name string
				run  func([]byte) (uint32, []byte)
			}{
				{"from_vm", func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmFromVm, f) }},
				{"ns_in", func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmNsIn, f) }},
			} {
				ret, out := p.run(fwd)
				if ret != tcNext || !bytes.Equal(out, fwd) {
					t.Errorf("%s: verdict %d\n in %x\nout %x", p.name, int32(ret), fwd, out)
				}
			}
			if n := entryCount(h.ctMap(v.flow(0))); n != 0 {
				t.Errorf("%d conntrack entries learned from a waypoint packet", n)
			}

			// Replies: a real flow's reverse-NAT entries exist, and a
			// packet from the backend routed through the client or the
			// SNAT address as a waypoint is still not theirs.
			expectForward(t, h, v, c.Port(), pkt.SYN, b)
			nsForward(t, h, v, c, pkt.SYN, b)
			for _, r := range []struct {
				name string
				prog func([]byte) (uint32, []byte)
				dst  netip.AddrPort
			}{
				{"to_vm", func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmToVm, f) }, c},
				{"ns_in", func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmNsIn, f) }, netip.AddrPortFrom(v.snatAddr(), c.Port())},
			} {
				rep := withActiveRouting(v.frame(b, netip.AddrPortFrom(final, r.dst.Port()), pkt.ACK), r.dst.Addr(), final)
				ret, out := r.prog(rep)
				if ret != tcNext || !bytes.Equal(out, rep) {
					t.Errorf("reply on %s: verdict %d\n in %x\nout %x", r.name, int32(ret), rep, out)
				}
			}
		})
	}
}
