package bpf

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// TestSNATRangeEdges: ranges at the edges of the port space. Every flow
// that fits gets a distinct port inside the range (no u16 overflow at
// 65535), and the first flow beyond drops after SNATTries candidates
// without leaving either half behind.
func TestSNATRangeEdges(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants() {
		for _, tc := range []struct {
			name     string
			min, max uint16
		}{
			{"one port", 40000, 40000},
			{"only 65535", 65535, 65535},
			{"top two ports", 65534, 65535},
			{"31 ports", 65505, 65535},
		} {
			t.Run(v.name+"/"+tc.name, func(t *testing.T) {
				h.reset()
				v.nsSetup(h, 0)
				h.snat(tc.min, tc.max)
				b := v.backends[0]
				n := int(tc.max-tc.min) + 1
				used := map[uint16]bool{}
				for i := range n {
					c := v.clientAt(uint16(1000 + i))
					ret, out := h.run(h.objs.FluxvmNsIn, v.frame(c, v.vip, pkt.SYN))
					if ret != tcOK {
						t.Fatalf("flow %d of %d: verdict %d", i+1, n, int32(ret))
					}
					src := srcOf(t, out)
					if src.Port() < tc.min || src.Port() > tc.max || used[src.Port()] {
						t.Fatalf("flow %d: port %d (range %d-%d, used %v)", i, src.Port(), tc.min, tc.max, used)
					}
					used[src.Port()] = true
					if want := v.frame(src, b, pkt.SYN); !bytes.Equal(out, want) {
						t.Fatalf("flow %d:\n got %x\nwant %x", i, out, want)
					}
				}
				ct4, nat4 := entryCount(h.ctMap(v.flow(0))), entryCount(h.natMap(v.flow(0)))
				before := h.counters()
				expectDropOn(t, h, h.objs.FluxvmNsIn, v.frame(v.clientAt(2000), v.vip, pkt.SYN), DropSNATFailed)
				if got := h.counters()[CounterSNATRetry] - before[CounterSNATRetry]; got != uint64(SNATTries) {
					t.Errorf("retries +%d, want %d", got, SNATTries)
				}
				if c, n := entryCount(h.ctMap(v.flow(0))), entryCount(h.natMap(v.flow(0))); c != ct4 || n != nat4 {
					t.Errorf("entries %d/%d -> %d/%d after a failed flow", ct4, nat4, c, n)
				}
			})
		}
	}
}

// TestSNATReplyEdges: the SNAT reply path recreates a lost conntrack half
// with the flow's SNAT address and port (so the flow keeps its port),
// drops a first fragment, and leaves alone later fragments, ICMP, and the
// reply at the VM-edge egress.
func TestSNATReplyEdges(t *testing.T) {
	h := newHarness(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			b := v.backends[0]
			c := v.clientAt(1234)
			port := nsForward(t, h, v, c, pkt.SYN, b)
			nsForward(t, h, v, c, pkt.ACK, b)
			flow := tuple{c, v.vip, v.proto}
			h.must(h.ctMap(flow).Delete(flow.key()))

			// Old enough to refresh: the reply rebuilds conntrack.
			key := v.snatKey(b, port)
			nv, _ := h.nat(key)
			nv.LastSeenNs = 0
			h.must(h.natMap(key).Put(key.key(), nv))
			s := netip.AddrPortFrom(v.snatAddr(), port)
			ret, out := h.run(h.objs.FluxvmNsIn, v.frame(b, s, pkt.ACK))
			if want := v.frame(v.vip, c, pkt.ACK); ret != tcOK || !bytes.Equal(out, want) {
				t.Fatalf("reply: verdict %d\n got %x\nwant %x", int32(ret), out, want)
			}
			ct, ok := h.ct(flow)
			if !ok {
				t.Fatal("conntrack not recreated from the reply")
			}
			if ct.Flags != CTFlagSNAT || Port(ct.NatPort) != port || Addr(ct.NatAddr, family(v.client)) != v.snatAddr() || ct.BackendId != 1 || ct.ServiceId != sid {
				t.Errorf("recreated conntrack %+v, want SNAT %s on backend 1", ct, s)
			}
			before := h.counters()
			if p := nsForward(t, h, v, c, pkt.ACK, b); p != port {
				t.Errorf("flow moved to port %d from %d after the recreation", p, port)
			}
			if d := h.counters()[CounterSNATConflicts] - before[CounterSNATConflicts]; d != 0 {
				t.Errorf("snat_conflicts +%d", d)
			}

			// Fragments of replies.
			reply := v.frame(b, s, pkt.ACK)
			var first, later []byte
			if v.client.Is4() {
				first, later = pkt.SetIPv4Frag(reply, 0, true), pkt.SetIPv4Frag(reply, 1480, false)
			} else {
				first, later = pkt.IPv6Ext(reply, pkt.Fragment(0, true)), pkt.IPv6Ext(reply, pkt.Fragment(1448, false))
			}
			expectDropOn(t, h, h.objs.FluxvmNsIn, first, DropFragment)
			if ret, out := h.run(h.objs.FluxvmNsIn, later); ret != tcNext || !bytes.Equal(out, later) {
				t.Errorf("later fragment: verdict %d, modified %v", int32(ret), !bytes.Equal(out, later))
			}
			// The VM-edge egress never translates an SNAT mapping.
			expectUntouched(t, h, "to_vm", reply)
		})
	}
}

// TestSNATReplyICMP: ICMP to the SNAT address passes untouched.
func TestSNATReplyICMP(t *testing.T) {
	h := newHarness(t)
	v := variants()[0]
	v.nsSetup(h, 0)
	nsForward(t, h, v, v.clientAt(1234), pkt.SYN, v.backends[0])
	for _, frame := range [][]byte{icmpTo(v.backends[0].Addr(), snat4), icmpTo(variants()[2].backends[0].Addr(), snat6)} {
		for _, p := range []string{"ns_in", "from_vm", "ns_out"} {
			prog := map[string]func([]byte) (uint32, []byte){
				"ns_in":   func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmNsIn, f) },
				"from_vm": func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmFromVm, f) },
				"ns_out":  func(f []byte) (uint32, []byte) { return h.run(h.objs.FluxvmNsOut, f) },
			}[p]
			if ret, out := prog(frame); ret != tcNext || !bytes.Equal(out, frame) {
				t.Errorf("%s: ICMP verdict %d, modified %v", p, int32(ret), !bytes.Equal(out, frame))
			}
		}
	}
}

// icmpTo is an ICMP echo from src to dst (the ICMPv6 checksum is left as
// it was: the packet only has to come out as it went in).
func icmpTo(src, dst netip.Addr) []byte {
	if dst.Is4() {
		f := icmp4()
		a, b := src.As4(), dst.As4()
		copy(f[14+12:], a[:])
		copy(f[14+16:], b[:])
		pkt.FixIPv4Checksum(f)
		return f
	}
	f := icmp6()
	a, b := src.As16(), dst.As16()
	copy(f[14+8:], a[:])
	copy(f[14+24:], b[:])
	return f
}

// TestDSRSemantics: DSR flows fail over off an Unhealthy backend like NAT
// flows do (counted), keep a Draining one until its deadline, and a
// fragment to a DSR VIP is dropped where the VIP is served.
func TestDSRSemantics(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, SvcFlagDSR)
			if ret, _ := h.runOn(h.objs.FluxvmNsIn, v.fwd(40000, pkt.SYN), l.in); ret != tcRedirect {
				t.Fatalf("verdict %d", int32(ret))
			}
			h.table(sid, h.fill(2))
			h.backend(1, sid, v.backends[0], BackendDraining, monoNow(t)+uint64(3600e9))
			if ret, _ := h.runOn(h.objs.FluxvmNsIn, v.fwd(40000, pkt.ACK), l.in); ret != tcRedirect {
				t.Fatalf("draining: verdict %d", int32(ret))
			}
			if ct, _ := h.ct(v.flow(40000)); ct.BackendId != 1 {
				t.Errorf("draining backend lost its flow to %d", ct.BackendId)
			}
			h.backend(1, sid, v.backends[0], BackendUnhealthy, 0)
			st := h.stats(sid)
			if ret, _ := h.runOn(h.objs.FluxvmNsIn, v.fwd(40000, pkt.ACK), l.in); ret != tcRedirect {
				t.Fatalf("failover: verdict %d", int32(ret))
			}
			if ct, _ := h.ct(v.flow(40000)); ct.BackendId != 2 || ct.Flags != CTFlagDSR {
				t.Errorf("after failover: conntrack %+v, want DSR on backend 2", ct)
			}
			if d := h.stats(sid).Failovers - st.Failovers; d != 1 {
				t.Errorf("failovers +%d, want +1", d)
			}
			var frag []byte
			if v.client.Is4() {
				frag = pkt.SetIPv4Frag(v.fwd(40001, pkt.SYN), 0, true)
			} else {
				frag = pkt.IPv6Ext(v.fwd(40001, pkt.SYN), pkt.Fragment(0, true))
			}
			expectDropOn(t, h, h.objs.FluxvmNsIn, frag, DropFragment)
		})
	}
}
