package bpf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// XDP verdicts as Program.Run reports them.
const (
	xdpDrop     = 1
	xdpPass     = 2
	xdpTX       = 3
	xdpRedirect = 4
)

// newXDP loads the north-south XDP object on the harness's maps, as the
// loader shares the TC object's maps with it, and lets it send on the
// interfaces allow names (its fluxvm_xdp_tx, which the loader fills).
func newXDP(t testing.TB, h *harness, allow ...int) *ebpf.Program {
	return newXDPObjects(t, h, allow...).FluxvmXdpNs
}

func newXDPObjects(t testing.TB, h *harness, allow ...int) *serviceXdpObjects {
	t.Helper()
	spec, err := loadServiceXdp()
	if err != nil {
		t.Fatal(err)
	}
	var objs serviceXdpObjects
	h.loadXDP(t, spec, &objs, allow...)
	return &objs
}

// loadXDP loads the XDP object of spec on the harness's maps into objs (a
// struct of `ebpf`-tagged fields with at least fluxvm_xdp_tx), and lets it
// send on the interfaces allow names.
func (h *harness) loadXDP(t testing.TB, spec *ebpf.CollectionSpec, objs any, allow ...int) {
	t.Helper()
	if err := spec.LoadAndAssign(objs, &ebpf.CollectionOptions{MapReplacements: h.xdpReplacements(spec)}); err != nil {
		t.Fatalf("load the XDP object: %v", err)
	}
	t.Cleanup(func() { objs.(io.Closer).Close() })
	tx := reflect.ValueOf(objs).Elem().FieldByName("FluxvmXdpTx").Interface().(*ebpf.Map)
	// A devmap names devices of the writer's namespace: the harness's.
	for _, ifindex := range allow {
		var err error
		h.th.Do(func() { err = tx.Put(uint32(ifindex), uint32(ifindex)) })
		if err != nil {
			t.Fatalf("fluxvm_xdp_tx: %v", err)
		}
	}
}

// xdpReplacements: the harness's maps that spec (an XDP object) shares
// with the TC object, sized as the harness made them.
func (h *harness) xdpReplacements(spec *ebpf.CollectionSpec) map[string]*ebpf.Map {
	maps := map[string]*ebpf.Map{}
	mv := reflect.ValueOf(h.objs.serviceMaps)
	for i := range mv.NumField() {
		if m, ok := mv.Field(i).Interface().(*ebpf.Map); ok && m != nil {
			maps[mv.Type().Field(i).Tag.Get("ebpf")] = m
		}
	}
	repl := map[string]*ebpf.Map{}
	for name, ms := range spec.Maps {
		if m := maps[name]; m != nil {
			ms.MaxEntries = m.MaxEntries()
			repl[name] = m
		}
	}
	return repl
}

// runXDP runs the XDP program on frame as if it arrived on ifindex.
func (h *harness) runXDP(prog *ebpf.Program, frame []byte, ifindex int) (uint32, []byte) {
	h.t.Helper()
	type xdpMD struct{ Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32 }
	return h.runCtx(prog, frame, xdpMD{DataEnd: uint32(len(frame)), IngressIfindex: uint32(ifindex)})
}

// TestXDPNorthSouth: the XDP object on the TC object's maps, packets
// arriving on the FIB lab's "in" interface. A new flow and then its
// established packets are translated exactly as TC translates them (DNAT
// and SNAT, the SNAT port the client's own), get the next hop's MACs and
// one less TTL, and leave by a redirect to "out"; the flow's conntrack
// entry and SNAT mapping are TC's. What XDP cannot finish passes byte for
// byte untouched and TC finishes it by the same flow state: a backend
// without a route or without a known neighbour, a fragment. A closed guard
// and a service without an eligible backend drop with their reasons, and
// traffic of no service passes.
func TestXDPNorthSouth(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	objs := newXDPObjects(t, h, l.out)
	xdp := objs.FluxvmXdpNs
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			client := v.clientAt(snatMin) // in the SNAT range: the mapping keeps it
			snatted := netip.AddrPortFrom(v.snatAddr(), snatMin)
			before := h.counters()
			for i, f := range []pkt.TCPFlags{pkt.SYN, pkt.ACK, pkt.ACK} {
				in := v.frame(client, v.vip, f)
				ret, out := h.runXDP(xdp, in, l.in)
				want := l.forwarded(v.frame(snatted, v.backends[0], f), l.nbr)
				if ret != xdpRedirect || !bytes.Equal(out, want) {
					t.Fatalf("packet %d: verdict %d\n got %x\nwant %x", i, ret, out, want)
				}
				if err := pkt.VerifyChecksums(out); err != nil {
					t.Fatal(err)
				}
			}
			ct, ok := h.ct(tuple{client, v.vip, v.proto})
			if !ok || ct.Flags != CTFlagSNAT || ct.BackendId != 1 || Port(ct.NatPort) != snatMin {
				t.Fatalf("conntrack %+v (present %v), want SNAT on backend 1, port %d", ct, ok, snatMin)
			}
			if _, ok := h.nat(v.snatKey(v.backends[0], snatMin)); !ok {
				t.Fatal("no SNAT mapping")
			}
			if got := h.counters()[CounterXDPTranslated] - before[CounterXDPTranslated]; got != 3 {
				t.Errorf("xdp_translated +%d, want +3", got)
			}
			if st := h.stats(sid); st.NewFlows != 1 || st.Packets != 3 {
				t.Errorf("stats %+v, want 1 new flow, 3 packets", st)
			}

			// A backend with a route but no known neighbour (2), and one
			// without a route (3): passed untouched, the flow learned;
			// TC then translates the same packet by that state.
			for _, b := range []uint32{2, 3} {
				h.table(sid, h.fill(b))
				c := v.clientAt(snatMin + uint16(b))
				in := v.frame(c, v.vip, pkt.SYN)
				before := h.counters()
				ret, out := h.runXDP(xdp, in, l.in)
				if ret != xdpPass || !bytes.Equal(out[:len(in)], in) {
					t.Fatalf("backend %d: verdict %d, packet %x: want XDP_PASS, untouched", b, ret, out)
				}
				if got := h.counters()[CounterXDPPassNoRoute] - before[CounterXDPPassNoRoute]; got != 1 {
					t.Errorf("backend %d: xdp_pass_no_route +%d, want +1", b, got)
				}
				ret, out = h.run(h.objs.FluxvmNsIn, in)
				want := v.frame(netip.AddrPortFrom(v.snatAddr(), c.Port()), v.backends[b-1], pkt.SYN)
				if ret != tcOK || !bytes.Equal(out[:len(want)], want) {
					t.Fatalf("backend %d: TC after XDP: verdict %d\n got %x\nwant %x", b, int32(ret), out, want)
				}
			}

			// Fragments go to TC, which drops them with the reason.
			h.table(sid, h.fill(1))
			frag := v.fwd(41000, pkt.SYN)
			if v.vip.Addr().Is4() {
				frag = pkt.SetIPv4Frag(frag, 0, true)
			} else {
				frag = pkt.IPv6Ext(frag, pkt.Fragment(0, true))
			}
			before = h.counters()
			if ret, out := h.runXDP(xdp, frag, l.in); ret != xdpPass || !bytes.Equal(out[:len(frag)], frag) {
				t.Fatalf("fragment: verdict %d, want XDP_PASS untouched", ret)
			}
			if got := h.counters()[CounterXDPPassFragment] - before[CounterXDPPassFragment]; got != 1 {
				t.Errorf("xdp_pass_fragment +%d, want +1", got)
			}

			// Traffic of no service passes; the guard and an empty
			// table drop with their reasons.
			other := v.frame(client, netip.AddrPortFrom(v.other, 80), pkt.SYN)
			if ret, out := h.runXDP(xdp, other, l.in); ret != xdpPass || !bytes.Equal(out[:len(other)], other) {
				t.Fatalf("no service: verdict %d, want XDP_PASS untouched", ret)
			}
			// A route out of an interface XDP may not send on: passed.
			h.th.Do(func() { h.must(objs.FluxvmXdpTx.Delete(uint32(l.out))) })
			before = h.counters()
			if in := v.fwd(43000, pkt.SYN); true {
				if ret, out := h.runXDP(xdp, in, l.in); ret != xdpPass || !bytes.Equal(out[:len(in)], in) {
					t.Fatalf("egress not allowed: verdict %d, want XDP_PASS untouched", ret)
				}
			}
			if got := h.counters()[CounterXDPPassEgress] - before[CounterXDPPassEgress]; got != 1 {
				t.Errorf("xdp_pass_egress +%d, want +1", got)
			}
			h.th.Do(func() { h.must(objs.FluxvmXdpTx.Put(uint32(l.out), uint32(l.out))) })
			// The parser's counters count a packet once: XDP counted
			// the ones it finished (here, 3 and the drops below), not
			// those it passed.

			for _, tc := range []struct {
				name   string
				set    func()
				reason DropReason
			}{
				{"guard closed", func() { h.guard(sid, 0) }, DropGuardClosed},
				{"no eligible backend", func() { h.guard(sid, GuardOpen); h.noTable(sid) }, DropNoBackend},
			} {
				tc.set()
				d := h.drops()
				if ret, _ := h.runXDP(xdp, v.fwd(42000, pkt.SYN), l.in); ret != xdpDrop || h.drops()[tc.reason]-d[tc.reason] != 1 {
					t.Errorf("%s: verdict %d, %s +%d; want XDP_DROP, +1", tc.name, ret, tc.reason, h.drops()[tc.reason]-d[tc.reason])
				}
			}
		})
	}
}

// TestXDPTaggedFramesPass: a frame to a north-south VIP that carries its
// 802.1Q or 802.1ad tag in the frame (a driver without VLAN offload, or
// a veth whose peer writes tags in) is no packet of the VIP's: XDP
// passes it byte for byte untouched, learns no flow and counts nothing
// for the service, and TC's ns_in, which parses it again, passes it to
// the next program the same way, counted as non_ip. The same frame
// untagged is translated (the control). A tag the driver kept beside the
// frame is invisible here: the loader keeps XDP off such interfaces
// (ErrXDPOffload).
func TestXDPTaggedFramesPass(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	xdp := newXDPObjects(t, h, l.out).FluxvmXdpNs
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			for _, tag := range []struct {
				name string
				tpid uint16
			}{{"802.1Q", 0x8100}, {"802.1ad", 0x88a8}} {
				client := v.clientAt(snatMin + 1)
				plain := v.frame(client, v.vip, pkt.SYN)
				tagged := append(append(append([]byte(nil), plain[:12]...), byte(tag.tpid>>8), byte(tag.tpid), 0x00, 0x64), plain[12:]...)
				before, st := h.counters(), h.stats(sid)
				if ret, out := h.runXDP(xdp, tagged, l.in); ret != xdpPass || !bytes.Equal(out[:len(tagged)], tagged) {
					t.Fatalf("%s: verdict %d, packet %x: want XDP_PASS, untouched", tag.name, ret, out)
				}
				if ret, out := h.run(h.objs.FluxvmNsIn, tagged); ret != tcNext || !bytes.Equal(out[:len(tagged)], tagged) {
					t.Fatalf("%s: TC ns_in: verdict %d, packet %x: want the next program's, untouched", tag.name, int32(ret), out)
				}
				after := h.counters()
				if _, ok := h.ct(tuple{client, v.vip, v.proto}); ok {
					t.Errorf("%s: a flow was learned", tag.name)
				}
				if got := h.stats(sid); got != st {
					t.Errorf("%s: service stats %+v -> %+v", tag.name, st, got)
				}
				if got := after[CounterNonIP] - before[CounterNonIP]; got != 1 {
					t.Errorf("%s: non_ip +%d, want +1 (counted once, by TC)", tag.name, got)
				}
				if got := after[CounterXDPTranslated] - before[CounterXDPTranslated]; got != 0 {
					t.Errorf("%s: xdp_translated +%d", tag.name, got)
				}
				// The control: the same frame untagged is translated.
				if ret, _ := h.runXDP(xdp, plain, l.in); ret != xdpRedirect {
					t.Fatalf("%s: the untagged frame: verdict %d, want XDP_REDIRECT", tag.name, ret)
				}
				h.reset()
				v.nsSetup(h, 0)
			}
		})
	}
}

// TestXDPMatchesTC: the same packet sequence through XDP and through TC's
// fluxvm_ns_in, each on a fresh datapath, leaves the same L3 and L4 bytes
// and the same flow state (conntrack entry, SNAT mapping), timestamps
// aside. XDP adds only the L2 header and TTL of the route it sends on.
func TestXDPMatchesTC(t *testing.T) {
	hx, ht := newHarness(t), newHarness(t)
	l := newFIBLab(t, hx)
	xdp := newXDP(t, hx, l.out)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			hx.reset()
			ht.reset()
			for _, h := range []*harness{hx, ht} {
				v.nsSetup(h, 0)
			}
			// Client ports in the SNAT range keep their port: the mapping is
			// deterministic (a taken candidate would be retried at random).
			clients := []netip.AddrPort{v.clientAt(snatMin), v.clientAt(snatMin + 1), v.clientAt(snatMin + 2)}
			for _, c := range clients {
				for _, f := range []pkt.TCPFlags{pkt.SYN, pkt.ACK} {
					in := v.frame(c, v.vip, f)
					rx, ox := hx.runXDP(xdp, in, l.in)
					rt, ot := ht.run(ht.objs.FluxvmNsIn, in)
					if rx != xdpRedirect || rt != tcOK {
						t.Fatalf("%s: verdicts XDP %d, TC %d", c, rx, int32(rt))
					}
					// XDP's frame is TC's with the route's MACs and
					// one less TTL.
					if want := l.forwarded(ot[:len(in)], l.nbr); !bytes.Equal(ox[:len(in)], want) {
						t.Fatalf("%s: XDP\n got %x\nwant %x (TC's, routed)", c, ox[:len(in)], want)
					}
				}
				cx, okx := hx.ct(tuple{c, v.vip, v.proto})
				ct, okt := ht.ct(tuple{c, v.vip, v.proto})
				if !okx || !okt {
					t.Fatalf("%s: conntrack present: XDP %v, TC %v", c, okx, okt)
				}
				cx.CreatedNs, cx.LastSeenNs, cx.DeadlineNs = 0, 0, 0
				ct.CreatedNs, ct.LastSeenNs, ct.DeadlineNs = 0, 0, 0
				if cx != ct {
					t.Errorf("%s: conntrack XDP %+v, TC %+v", c, cx, ct)
				}
				k := v.snatKey(v.backends[0], Port(cx.NatPort))
				nx, okx := hx.nat(k)
				nt, okt := ht.nat(k)
				nx.LastSeenNs, nt.LastSeenNs = 0, 0
				if !okx || !okt || nx != nt {
					t.Errorf("%s: SNAT mapping XDP %+v (%v), TC %+v (%v)", c, nx, okx, nt, okt)
				}
			}
		})
	}
}

// TestXDPDSR: routed DSR in XDP: the packet keeps the VIP, gets the next
// hop's MACs and one less TTL and is redirected toward the backend; a
// backend whose neighbour is not known yet is left to TC untouched.
func TestXDPDSR(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	xdp := newXDP(t, h, l.out)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, SvcFlagDSR)
			in := v.fwd(40000, pkt.SYN)
			before := h.counters()
			ret, out := h.runXDP(xdp, in, l.in)
			if want := l.forwarded(in, l.nbr); ret != xdpRedirect || !bytes.Equal(out[:len(in)], want) {
				t.Fatalf("verdict %d\n got %x\nwant %x", ret, out, want)
			}
			if got := h.counters()[CounterDSRForwarded] - before[CounterDSRForwarded]; got != 1 {
				t.Errorf("dsr_forwarded +%d, want +1", got)
			}
			if ct, ok := h.ct(v.flow(40000)); !ok || ct.Flags != CTFlagDSR || ct.BackendId != 1 {
				t.Fatalf("conntrack %+v (present %v), want DSR on backend 1", ct, ok)
			}
			h.table(sid, h.fill(2))
			in = v.fwd(40001, pkt.SYN)
			if ret, out := h.runXDP(xdp, in, l.in); ret != xdpPass || !bytes.Equal(out[:len(in)], in) {
				t.Fatalf("no neighbour: verdict %d, want XDP_PASS untouched", ret)
			}
		})
	}
}

// BenchmarkXDP measures the north-south XDP object the way
// BenchmarkDatapath measures the TC programs (Repeat=1 on a fresh copy,
// kernel-reported durations averaged, an empty XDP program in the same run
// as the floor, interleaved blocks), on the TC object's maps at the tier's
// real capacities: an established SNAT flow, an established DSR flow, new
// DSR flows, and pass-through, arriving on the FIB lab's "in"
// interface.
//
//	go test -run '^$' -bench BenchmarkXDP -benchtime 1x ./bpf/
//
// FLUXVM_BENCH_XDP_VARIANTS=name=obj,... adds other builds of the XDP
// object, loaded on the same maps (identical flow state), their cases
// interleaved with ours; FLUXVM_BENCH_XDP_NOCACHE=name leaves that
// variant's next-hop cache off; FLUXVM_BENCH_XDP_ANY=1 accepts any verdict
// from the variants (builds cut short to see where the time goes).
func BenchmarkXDP(b *testing.B) {
	calls := benchCalls(b)
	h, cases := xdpBenchCases(b, calls)
	measureInterleavedOn(b, h.th, calls, cases, false, ebpf.XDP)
}

// xdpBenchCases sets up BenchmarkXDP's lab and cases (the empty program
// with the context first).
func xdpBenchCases(b *testing.B, calls int) (*harness, []*benchCase) {
	return xdpBenchCasesOmit(b, calls, 0)
}

// xdpBenchCasesOmit is xdpBenchCases with the load-time features omit
// left out of both objects (BenchmarkKatranPair; 0 loads them as built).
func xdpBenchCasesOmit(b *testing.B, calls int, omit Features) (*harness, []*benchCase) {
	spec, err := loadService()
	if err != nil {
		b.Fatal(err)
	}
	xspec, err := loadServiceXdp()
	if err != nil {
		b.Fatal(err)
	}
	if omit != 0 {
		if err := errors.Join(setFeatures(spec, Options{OmitFeatures: omit}, "TC", true),
			setFeatures(xspec, Options{OmitFeatures: omit}, "XDP", false)); err != nil {
			b.Fatal(err)
		}
	}
	h := newHarnessSpec(b, spec, 0)
	l := newFIBLab(b, h)
	var xo serviceXdpObjects
	h.loadXDP(b, xspec, &xo, l.out)
	xdp := xo.FluxvmXdpNs
	// The next-hop cache on, as the control plane runs it.
	if err := xo.FluxvmNhCtl.Put(uint32(0), nhLease(b, 1, time.Hour)); err != nil {
		b.Fatal(err)
	}
	v4 := variants()[0]
	v4.setup(h)
	h.svcFlags(sid, v4.vip, v4.proto, SvcFlagNorthSouth|SvcFlagNoEastWest)
	// A range that holds every new flow's port: the client's own.
	h.snat(1024, 65535)
	dsr := netip.MustParseAddrPort("10.96.0.11:80")
	h.service(sid+1, dsr, v4.proto)
	h.svcFlags(sid+1, dsr, v4.proto, SvcFlagNorthSouth|SvcFlagNoEastWest|SvcFlagDSR)
	h.backend(21, sid+1, v4.backends[0], BackendReady, 0)
	h.table(sid+1, h.fill(21))
	// The context: the frame's extent and the lab's "in" interface (the
	// test run's default device, loopback, has no forwarding answer).
	xdpCtx := func(n int) []byte {
		c := make([]byte, 24)
		binary.NativeEndian.PutUint32(c[4:], uint32(n))
		binary.NativeEndian.PutUint32(c[12:], uint32(l.in))
		return c
	}
	for _, f := range [][]byte{v4.fwd(40000, pkt.SYN), pkt.TCP(v4.clientAt(40000), dsr, pkt.SYN, payload)} {
		var ret uint32
		var err error
		h.th.Do(func() { ret, _, err = progTestRun(xdp, f, xdpCtx(len(f))) })
		if err != nil || ret != xdpRedirect {
			b.Fatalf("flow not set up: verdict %d, %v", ret, err)
		}
	}
	// New flows are DSR flows: an SNAT flow takes a port of the range per
	// backend, and more new flows than ports to one backend (this
	// benchmark makes 200,000) would measure exhaustion. DSR learns the
	// conntrack entry and routes, as Katran's new flow does.
	newFlow := func(i int) []byte {
		f := pkt.TCP(netip.AddrPortFrom(v4.client, uint16(1024+i%60000)), dsr, pkt.SYN, payload)
		binary.BigEndian.PutUint16(f[14+12+2:], uint16(i/60000+2))
		return f
	}
	other := v4.frame(v4.clientAt(40000), netip.AddrPortFrom(v4.other, 80), pkt.ACK)
	// The floor runs without a context; an empty program run with one
	// shows what the context itself costs the test run.
	empty, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, xdpPass), asm.Return()}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { empty.Close() })
	cases := []*benchCase{
		{name: "xdp empty program, with the context", metric: "xdp-empty-ctx", prog: empty, frame: func(int) []byte { return other }, ctx: xdpCtx(len(other)), want: xdpPass},
		{name: "xdp pass-through (not a service)", metric: "xdp-pass", prog: xdp, frame: func(int) []byte { return other }, ctx: xdpCtx(len(other)), want: xdpPass},
		{name: "xdp ipv4 tcp conntrack hit (SNAT)", metric: "xdp-v4-ct-hit", prog: xdp, frame: func(int) []byte { return v4.fwd(40000, pkt.ACK) }, ctx: xdpCtx(60), want: xdpRedirect},
		{name: "xdp ipv4 tcp new flow (DSR)", metric: "xdp-v4-new-flow", prog: xdp, frame: newFlow, ctx: xdpCtx(60), want: xdpRedirect},
		{name: "xdp ipv4 tcp conntrack hit (DSR)", metric: "xdp-v4-dsr-hit", prog: xdp, frame: func(int) []byte { return pkt.TCP(v4.clientAt(40000), dsr, pkt.ACK, payload) }, ctx: xdpCtx(60), want: xdpRedirect},
	}
	// FLUXVM_BENCH_XDP_VARIANTS=name=obj,...: other builds of the XDP
	// object, loaded on the same maps, their cases interleaved with ours
	// (an A/B in one run on identical flow state).
	if vs := os.Getenv("FLUXVM_BENCH_XDP_VARIANTS"); vs != "" {
		n := len(cases)
		for k, v := range strings.Split(vs, ",") {
			name, path, _ := strings.Cut(v, "=")
			spec, err := ebpf.LoadCollectionSpec(path)
			if err != nil {
				b.Fatalf("FLUXVM_BENCH_XDP_VARIANTS: %v", err)
			}
			// Whatever maps the build has beyond the program and the
			// devmap; its next-hop cache, if it has one, on as ours.
			// Its own per-CPU scratch: a work area whose layout is the
			// build's own (it holds no state between packets).
			repl := h.xdpReplacements(spec)
			delete(repl, "fluxvm_scratch")
			coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: repl})
			if err != nil {
				b.Fatalf("FLUXVM_BENCH_XDP_VARIANTS %s: %v", name, err)
			}
			b.Cleanup(coll.Close)
			h.th.Do(func() { err = coll.Maps["fluxvm_xdp_tx"].Put(uint32(l.out), uint32(l.out)) })
			if err != nil {
				b.Fatal(err)
			}
			if m := coll.Maps["fluxvm_nh_ctl"]; m != nil && os.Getenv("FLUXVM_BENCH_XDP_NOCACHE") != name {
				if err := m.Put(uint32(0), nhLease(b, 1, time.Hour)); err != nil {
					b.Fatal(err)
				}
			}
			p := coll.Programs["fluxvm_xdp_ns"]
			for _, c := range cases[1:n] {
				vc := *c
				vc.name, vc.metric, vc.prog = name+" "+c.name, name+"-"+c.metric, p
				vc.any = os.Getenv("FLUXVM_BENCH_XDP_ANY") == "1"
				if c.metric == "xdp-v4-new-flow" {
					// Flows of their own: ours would be hits.
					off := (k + 1) * calls
					vc.frame = func(i int) []byte { return newFlow(i + off) }
				}
				cases = append(cases, &vc)
			}
		}
	}
	return h, cases
}

// benchmarkDatapathXDP is BenchmarkDatapath with FLUXVM_BENCH_HOOK=xdp:
// BenchmarkXDP's routed-DSR cases under BenchmarkDatapath's names, so that
// a tool comparing those names (katrancmp: Katran's XDP forward path, which
// encapsulates toward the real and sends, a direct-return design too)
// measures XDP against XDP. "ipv4 tcp conntrack hit" is an established DSR
// flow, "ipv4 tcp new flow" a new one (conntrack learned, Maglev, FIB,
// redirect); the floor is an empty XDP program.
func benchmarkDatapathXDP(b *testing.B, calls int) {
	h, all := xdpBenchCases(b, calls)
	as := map[string]string{
		"xdp-pass":        "pass-through (not a service)",
		"xdp-v4-dsr-hit":  "ipv4 tcp conntrack hit",
		"xdp-v4-new-flow": "ipv4 tcp new flow",
	}
	var cases []*benchCase
	for _, c := range all {
		if name, ok := as[c.metric]; ok {
			c.name = name
			cases = append(cases, c)
		}
	}
	if len(cases) != len(as) {
		b.Fatalf("BenchmarkXDP has %d of the %d cases", len(cases), len(as))
	}
	measureInterleavedOn(b, h.th, calls, cases, false, ebpf.XDP)
}

// progTestRun is BPF_PROG_TEST_RUN with a context (cilium/ebpf's
// Benchmark, which reports the kernel's duration, takes none): one run of
// prog on data with context ctx; the verdict and the kernel-measured
// duration.
func progTestRun(prog *ebpf.Program, data, ctx []byte) (uint32, time.Duration, error) {
	out := make([]byte, len(data)+256)
	attr := struct {
		ProgFD      uint32
		Retval      uint32
		DataSizeIn  uint32
		DataSizeOut uint32
		DataIn      uint64
		DataOut     uint64
		Repeat      uint32
		Duration    uint32
		CtxSizeIn   uint32
		CtxSizeOut  uint32
		CtxIn       uint64
		CtxOut      uint64
		Flags       uint32
		CPU         uint32
		BatchSize   uint32
		_           uint32
	}{
		ProgFD: uint32(prog.FD()), DataSizeIn: uint32(len(data)), DataSizeOut: uint32(len(out)),
		DataIn: uint64(uintptr(unsafe.Pointer(&data[0]))), DataOut: uint64(uintptr(unsafe.Pointer(&out[0]))),
		Repeat: 1, CtxSizeIn: uint32(len(ctx)), CtxIn: uint64(uintptr(unsafe.Pointer(&ctx[0]))),
	}
	_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_TEST_RUN, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	runtime.KeepAlive(data)
	runtime.KeepAlive(out)
	runtime.KeepAlive(ctx)
	if errno != 0 {
		return 0, 0, errno
	}
	return attr.Retval, time.Duration(attr.Duration), nil
}

// TestXDPTx: a backend routed back out of the interface the packet came in
// on (a remote backend behind the uplink) gets XDP_TX, with that
// interface's MAC as the source.
func TestXDPTx(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	xdp := newXDP(t, h, l.in)
	var inMAC net.HardwareAddr
	h.th.Do(func() {
		in, err := netlink.LinkByIndex(l.in)
		if err != nil {
			t.Error(err)
			return
		}
		inMAC = in.Attrs().HardwareAddr
		for _, v := range []variant{variants()[0], variants()[2]} {
			b := v.backends[2] // no route in the lab: routed via "in" here
			bits := 32
			if !b.Addr().Is4() {
				bits = 128
			}
			if err := netlink.RouteAdd(&netlink.Route{LinkIndex: l.in, Dst: &net.IPNet{IP: b.Addr().AsSlice(), Mask: net.CIDRMask(bits, bits)}}); err != nil {
				t.Error(err)
			}
			if err := netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.in, State: netlink.NUD_PERMANENT, IP: b.Addr().AsSlice(), HardwareAddr: l.nbr}); err != nil {
				t.Error(err)
			}
		}
	})
	if t.Failed() {
		t.FailNow()
	}
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			h.table(sid, h.fill(3))
			c := v.clientAt(snatMin)
			in := v.frame(c, v.vip, pkt.SYN)
			ret, out := h.runXDP(xdp, in, l.in)
			want := l.forwarded(v.frame(netip.AddrPortFrom(v.snatAddr(), snatMin), v.backends[2], pkt.SYN), l.nbr)
			copy(want[6:12], inMAC)
			if ret != xdpTX || !bytes.Equal(out[:len(want)], want) {
				t.Fatalf("verdict %d\n got %x\nwant %x", ret, out, want)
			}
		})
	}
}

// nhLease is a control word of generation gen whose lease ends lease from
// now.
func nhLease(t testing.TB, gen uint32, lease time.Duration) NHControl {
	t.Helper()
	now, err := monotonicCoarse()
	if err != nil {
		t.Fatal(err)
	}
	return NHControl{Gen: gen, Until: uint32((now + uint64(lease)) >> 20)}
}

// nhEntry is struct fluxvm_nh_entry (lib/nh.h).
type nhEntry struct {
	BackendID1, Iif, Oif, Gen, Born uint32
	MTU                             uint16
	Dmac, Smac                      [6]byte
	_                               [6]byte
}

// TestXDPRouteCache: with the next-hop cache on, a flow's packets reuse
// the FIB's answer toward their backend (a neighbour that changed is not
// seen) until the control plane moves the generation on, or the answer
// is a second old; off, every packet asks the FIB. A packet the cached
// route cannot take (TTL expiring, larger than the route's MTU) asks the
// FIB, which leaves it to the stack untouched.
func TestXDPRouteCache(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	xo := newXDPObjects(t, h, l.out)
	if n := xo.FluxvmNh.ValueSize(); n != uint32(unsafe.Sizeof(nhEntry{})) {
		t.Fatalf("fluxvm_nh value %d bytes, Go %d", n, unsafe.Sizeof(nhEntry{}))
	}
	if n := xo.FluxvmNhCtl.ValueSize(); n != uint32(unsafe.Sizeof(NHControl{})) {
		t.Fatalf("fluxvm_nh_ctl value %d bytes, Go %d", n, unsafe.Sizeof(NHControl{}))
	}
	// The cache is per CPU: the packets of one test run on one.
	var err error
	h.th.Do(func() {
		var set unix.CPUSet
		set.Set(0)
		err = unix.SchedSetaffinity(0, &set)
	})
	if err != nil {
		t.Fatal(err)
	}
	gen := uint32(0)
	ctl := func(on uint32) {
		t.Helper()
		gen++
		v := nhLease(t, gen, time.Hour)
		if on == 0 {
			v.Until = 0
		}
		if err := xo.FluxvmNhCtl.Put(uint32(0), v); err != nil {
			t.Fatal(err)
		}
	}
	other := net.HardwareAddr{0x02, 0xfb, 0, 0, 0, 0x02}
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, SvcFlagDSR)
			be := v.backends[0].Addr()
			nbr := func(mac net.HardwareAddr) {
				t.Helper()
				var err error
				h.th.Do(func() {
					err = netlink.NeighSet(&netlink.Neigh{LinkIndex: l.out, State: netlink.NUD_PERMANENT, IP: be.AsSlice(), HardwareAddr: mac})
				})
				if err != nil {
					t.Fatal(err)
				}
			}
			send := func(what string, in []byte, mac net.HardwareAddr) {
				t.Helper()
				ret, out := h.runXDP(xo.FluxvmXdpNs, in, l.in)
				if mac == nil {
					if ret != xdpPass || !bytes.Equal(out[:len(in)], in) {
						t.Fatalf("%s: verdict %d, want XDP_PASS untouched\n got %x\nwant %x", what, ret, out, in)
					}
					return
				}
				if want := l.forwarded(in, mac); ret != xdpRedirect || !bytes.Equal(out[:len(in)], want) {
					t.Fatalf("%s: verdict %d\n got %x\nwant %x", what, ret, out, want)
				}
			}
			ack := v.fwd(40000, pkt.ACK)
			nbr(l.nbr)
			ctl(1)
			send("first packet", v.fwd(40000, pkt.SYN), l.nbr)
			// The answer learned, on the CPU that ran the packet.
			var per []nhEntry
			if err := xo.FluxvmNh.Lookup(uint32(1), &per); err != nil {
				t.Fatal(err)
			}
			learned := false
			for _, e := range per {
				if e.BackendID1 == 2 && e.Iif == uint32(l.in) && e.Oif == uint32(l.out) && e.Gen == gen &&
					e.MTU == 1500 && bytes.Equal(e.Dmac[:], l.nbr) && bytes.Equal(e.Smac[:], l.outMAC) {
					learned = true
				}
			}
			if !learned {
				t.Fatalf("fluxvm_nh[1] per CPU %+v: no answer for backend 1 (id+1 = 2) from %d out of %d", per, l.in, l.out)
			}
			nbr(other)
			send("cached", ack, l.nbr)
			ctl(1)
			send("after invalidation", ack, other)

			// Off: every packet asks the FIB.
			ctl(0)
			nbr(l.nbr)
			send("cache off", ack, l.nbr)
			nbr(other)
			send("cache off, neighbour changed", ack, other)

			// A cached answer expires.
			ctl(1)
			send("learn", ack, other)
			nbr(l.nbr)
			send("cached", ack, other)
			time.Sleep(1100 * time.Millisecond)
			send("a second later", ack, l.nbr)

			// A lease that ended: the cache is off.
			ctl(1)
			send("learn", ack, l.nbr)
			nbr(other)
			gen++
			if err := xo.FluxvmNhCtl.Put(uint32(0), nhLease(t, gen-1, -time.Millisecond)); err != nil {
				t.Fatal(err)
			}
			send("lease ended", ack, other)
			nbr(l.nbr)

			// TTL/hop limit about to expire: the stack's, even cached.
			last := append([]byte(nil), ack...)
			if v.vip.Addr().Is4() {
				last[14+8] = 1
				pkt.FixIPv4Checksum(last)
			} else {
				last[14+7] = 1
			}
			before := h.counters()[CounterXDPPassNoRoute]
			send("ttl 1", last, nil)
			if got := h.counters()[CounterXDPPassNoRoute] - before; got != 1 {
				t.Errorf("ttl 1: xdp_pass_no_route +%d, want +1", got)
			}

			// Larger than the route's MTU: the stack's (it sends the
			// ICMP error), though the route is cached.
			mtu := func(n int) {
				t.Helper()
				var err error
				h.th.Do(func() {
					var ln netlink.Link
					if ln, err = netlink.LinkByIndex(l.out); err == nil {
						err = netlink.LinkSetMTU(ln, n)
					}
				})
				if err != nil {
					t.Fatal(err)
				}
			}
			mtu(1280)
			defer mtu(1500)
			ctl(1)
			send("small packet", ack, l.nbr)
			big := pkt.TCP(v.clientAt(40000), v.vip, pkt.ACK, make([]byte, 1300))
			send("packet over the route's MTU", big, nil)
			mtu(1500)
			ctl(1)
			send("packet within the MTU again", big, l.nbr)
		})
	}
}
