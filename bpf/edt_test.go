package bpf

import (
	"bytes"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// skbTstamp is struct __sk_buff: BPF_PROG_TEST_RUN takes it in and gives
// it back out (the whole of it), tstamp included.
type skbTstamp struct {
	Len, PktType, Mark, QueueMapping, Protocol, VlanPresent, VlanTCI, VlanProto, Priority, IngressIfindex, Ifindex uint32
	_                                                                                                              [27]uint32 // tc_index .. flow_keys
	Tstamp                                                                                                         uint64
	WireLen, GSOSegs                                                                                               uint32
	Sk                                                                                                             uint64
	GSOSize                                                                                                        uint32
	TstampType                                                                                                     uint8
	_                                                                                                              [3]uint8
	Hwtstamp                                                                                                       uint64
}

// runTstamp runs prog once on frame with skb->tstamp = in, and returns the
// verdict, the packet and skb->tstamp after the run.
func (h *harness) runTstamp(prog *ebpf.Program, frame []byte, in uint64) (uint32, []byte, uint64) {
	h.t.Helper()
	var out skbTstamp
	opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+256), Context: skbTstamp{Tstamp: in}, ContextOut: &out, Repeat: 1}
	var ret uint32
	var err error
	h.th.Do(func() { ret, err = prog.Run(&opts) })
	if err != nil {
		h.t.Fatalf("run: %v", err)
	}
	return ret, opts.DataOut, out.Tstamp
}

func (h *harness) edt(sid uint32, rate uint64, horizon time.Duration) EDTValue {
	h.t.Helper()
	v, err := NewEDTValue(rate, horizon)
	h.must(err)
	h.must(h.objs.FluxvmEdt.Put(sid, v))
	return v
}

// TestEDTPacing: the replies of a paced service leave with departure times
// spaced by len/rate, the horizon drops (and counts) what would leave too
// far ahead, an unpaced service's packets keep their tstamp, and a new rate
// applies to the next packet. East-west replies at fluxvm_to_vm, north-south
// replies leaving through fluxvm_ns_out, both families.
func TestEDTPacing(t *testing.T) {
	const rate = MinEDTRate // 1 Mbit/s: 8 us a byte
	big := bytes.Repeat([]byte("p"), 1200)
	for _, fam := range []struct {
		name                 string
		vip, backend, client netip.AddrPort
	}{
		{"ipv4", netip.MustParseAddrPort("10.96.0.10:80"), netip.MustParseAddrPort("10.1.0.1:8080"), netip.MustParseAddrPort("10.0.0.1:40000")},
		{"ipv6", netip.MustParseAddrPort("[fd00:96::10]:80"), netip.MustParseAddrPort("[fd00:1::1]:8080"), netip.MustParseAddrPort("[fd00::1]:40000")},
	} {
		reply := pkt.TCP(fam.backend, fam.client, pkt.ACK, big)
		translated := pkt.TCP(fam.vip, fam.client, pkt.ACK, big)
		// What leaves fluxvm_ns_out after an ingress hook translated it.
		nsReply := translated

		t.Run(fam.name+"/east-west", func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			h.service(1, fam.vip, ipTCP)
			h.backend(1, 1, fam.backend, BackendReady, 0)
			h.table(1, h.fill(1))
			if ret, _ := h.run(h.objs.FluxvmFromVm, pkt.TCP(fam.client, fam.vip, pkt.SYN, nil)); ret != tcOK {
				t.Fatalf("SYN: verdict %d", int32(ret))
			}
			// Unpaced: tstamp untouched, whatever it was.
			for _, in := range []uint64{0, 12345} {
				ret, out, ts := h.runTstamp(h.objs.FluxvmToVm, reply, in)
				if ret != tcOK || !bytes.Equal(out, translated) || ts != in {
					t.Fatalf("unpaced (tstamp in %d): verdict %d, tstamp %d, translated %v", in, int32(ret), ts, bytes.Equal(out, translated))
				}
			}

			// At 1 Mbit/s, an idle service's packet leaves now plus
			// its own time.
			v := h.edt(1, rate, time.Second)
			delay := uint64(v.Delay(uint32(len(reply))))
			if want := uint64(len(reply)) * 1e9 / rate; delay < want || delay > want+1 {
				t.Fatalf("delay %d ns for %d bytes; want %d", delay, len(reply), want)
			}
			before := monoNow(t)
			ret, out, first := h.runTstamp(h.objs.FluxvmToVm, reply, 0)
			if after := monoNow(t); ret != tcOK || !bytes.Equal(out, translated) || first < before+delay || first > after+delay {
				t.Fatalf("idle service: verdict %d, departure %d; want the packet translated, leaving now (%d..%d) + %d", int32(ret), first, before, after, delay)
			}
			// A backlog: the service's clock set 2 s ahead (half the
			// 4 s horizon, far from what the coarse clock moves while
			// the test runs): each packet leaves len/rate after the
			// one before, from the clock on.
			backlog := func(ahead time.Duration, horizon time.Duration) uint64 {
				t.Helper()
				v := h.edt(1, rate, horizon)
				v.LastDeparture = monoNow(t) + uint64(ahead)
				h.must(h.objs.FluxvmEdt.Put(uint32(1), v))
				return v.LastDeparture
			}
			clock := backlog(2*time.Second, 4*time.Second)
			var stamps []uint64
			for i := range 3 {
				ret, out, ts := h.runTstamp(h.objs.FluxvmToVm, reply, 0)
				if ret != tcOK || !bytes.Equal(out, translated) {
					t.Fatalf("packet %d: verdict %d, translated %v", i, int32(ret), bytes.Equal(out, translated))
				}
				stamps = append(stamps, ts)
			}
			if stamps[0] != clock+delay || stamps[1] != stamps[0]+delay || stamps[2] != stamps[1]+delay {
				t.Errorf("departures %v; want %d + %d each", stamps, clock, delay)
			}
			var e EDTValue
			h.must(h.objs.FluxvmEdt.Lookup(uint32(1), &e))
			if e.LastDeparture != stamps[2] {
				t.Errorf("last_departure %d; want the last departure %d", e.LastDeparture, stamps[2])
			}
			// Beyond the horizon (the clock 5 s ahead of a 1 s
			// horizon): a data packet drops, counted; an RST (state
			// the flow has recorded) is scheduled and goes.
			clock = backlog(5*time.Second, time.Second)
			if ret, _, ts := h.runTstamp(h.objs.FluxvmToVm, reply, 0); ret != tcShot {
				t.Errorf("beyond the horizon: verdict %d, tstamp %d; want a drop", int32(ret), ts)
			}
			rst := pkt.TCP(fam.backend, fam.client, pkt.TCPFlags{RST: true, ACK: true}, nil)
			if ret, _, ts := h.runTstamp(h.objs.FluxvmToVm, rst, 0); ret != tcOK || ts != clock+uint64(v.Delay(uint32(len(rst)))) {
				t.Errorf("RST beyond the horizon: verdict %d, departure %d; want it scheduled (%d + its time) and sent", int32(ret), ts, clock)
			}
			if st, d := h.stats(1), h.drops(); st.EdtDrops != 1 || st.Drops != 1 || d[DropEDTHorizon] != 1 {
				t.Errorf("stats %+v, edt_horizon drops %d; want 1 horizon drop", st, d[DropEDTHorizon])
			}
			// What left toward the client: the reply counters (the
			// dropped packet not counted).
			if st, want := h.stats(1), uint64(6*len(reply)+len(rst)); st.ReplyPackets != 7 || st.ReplyBytes != want {
				t.Errorf("replies %d packets %d bytes; want 7, %d", st.ReplyPackets, st.ReplyBytes, want)
			}

			// A new rate: the next packet goes at once at the new rate
			// (the entry's clock starts empty).
			v2 := h.edt(1, 10*rate, time.Second)
			now := monoNow(t)
			ret, _, ts := h.runTstamp(h.objs.FluxvmToVm, reply, 0)
			if d2 := uint64(v2.Delay(uint32(len(reply)))); ret != tcOK || ts < now+d2 || ts > monoNow(t)+d2 {
				t.Errorf("after the rate change: verdict %d, departure %d; want now (%d) + %d", int32(ret), ts, now, d2)
			}
			// Unpaced again: tstamp untouched.
			h.must(h.objs.FluxvmEdt.Put(uint32(1), EDTValue{}))
			if ret, _, ts := h.runTstamp(h.objs.FluxvmToVm, reply, 0); ret != tcOK || ts != 0 {
				t.Errorf("cap removed: verdict %d, tstamp %d; want 0", int32(ret), ts)
			}
		})

		t.Run(fam.name+"/north-south", func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			h.svcFlags(1, fam.vip, ipTCP, SvcFlagNorthSouth|SvcFlagPaced)
			h.edt(1, rate, time.Second)
			// Without the node's count, ns_out does not look.
			if ret, out, ts := h.runTstamp(h.objs.FluxvmNsOut, nsReply, 0); ret != tcNext || !bytes.Equal(out, nsReply) || ts != 0 {
				t.Errorf("no paced north-south service on the node: verdict %d, tstamp %d", int32(ret), ts)
			}
			h.must(h.objs.FluxvmEdt.Put(EDTNodeKey, EDTValue{Rate: 1}))
			now := monoNow(t)
			ret, out, ts := h.runTstamp(h.objs.FluxvmNsOut, nsReply, 0)
			delay := uint64(len(nsReply)) * 1e9 / rate
			if ret != tcNext || !bytes.Equal(out, nsReply) || ts < now+delay || ts > monoNow(t)+delay+1 {
				t.Errorf("paced: verdict %d, tstamp %d; want the packet untouched, next program, departure now (%d) + %d", int32(ret), ts, now, delay)
			}
			// Beyond the horizon it drops, and the reply an ingress hook
			// counted is taken back (here none was: the sum goes to -1).
			v := h.edt(1, rate, time.Second)
			v.LastDeparture = monoNow(t) + uint64(5*time.Second)
			h.must(h.objs.FluxvmEdt.Put(uint32(1), v))
			if ret, _, _ := h.runTstamp(h.objs.FluxvmNsOut, nsReply, 0); ret != tcShot {
				t.Errorf("beyond the horizon: verdict %d; want a drop", int32(ret))
			}
			if st := h.stats(1); st.ReplyPackets != ^uint64(0) || st.ReplyBytes != -uint64(len(nsReply)) || st.EdtDrops != 1 {
				t.Errorf("stats after the drop %+v: want the reply taken back and one horizon drop", st)
			}
			// A DSR service's replies (no hook translated them) count
			// when they leave.
			h.svcFlags(1, fam.vip, ipTCP, SvcFlagNorthSouth|SvcFlagDSR|SvcFlagPaced)
			h.edt(1, rate, time.Second)
			before := h.stats(1)
			if ret, _, ts := h.runTstamp(h.objs.FluxvmNsOut, nsReply, 0); ret != tcNext || ts == 0 {
				t.Errorf("DSR reply: verdict %d, tstamp %d; want it paced", int32(ret), ts)
			}
			if st := h.stats(1); st.ReplyPackets-before.ReplyPackets != 1 || st.ReplyBytes-before.ReplyBytes != uint64(len(nsReply)) {
				t.Errorf("DSR reply counted %d packets, %d bytes; want 1, %d", st.ReplyPackets-before.ReplyPackets, st.ReplyBytes-before.ReplyBytes, len(nsReply))
			}
			// An unpaced service's replies, and a reply from another port,
			// pass untouched.
			h.svcFlags(1, fam.vip, ipTCP, SvcFlagNorthSouth)
			if ret, _, ts := h.runTstamp(h.objs.FluxvmNsOut, nsReply, 0); ret != tcNext || ts != 0 {
				t.Errorf("unpaced north-south service: verdict %d, tstamp %d", int32(ret), ts)
			}
			other := netip.AddrPortFrom(fam.vip.Addr(), 81)
			h.svcFlags(1, fam.vip, ipTCP, SvcFlagNorthSouth|SvcFlagPaced)
			if ret, _, ts := h.runTstamp(h.objs.FluxvmNsOut, pkt.TCP(other, fam.client, pkt.ACK, big), 0); ret != tcNext || ts != 0 {
				t.Errorf("not a frontend: verdict %d, tstamp %d", int32(ret), ts)
			}
		})
	}
}

// TestEDTSharedClock: the frontends of one service (two VIPs, each its own
// service id) pace on one clock, the pacer's: a reply through the second
// frontend leaves len/rate after one through the first, and the second's
// own clock stays untouched.
func TestEDTSharedClock(t *testing.T) {
	h := newHarness(t)
	h.reset()
	vips := []netip.AddrPort{netip.MustParseAddrPort("10.96.0.10:80"), netip.MustParseAddrPort("10.96.0.11:80")}
	backend := netip.MustParseAddrPort("10.1.0.1:8080")
	client := netip.MustParseAddrPort("10.0.0.1:40000")
	big := bytes.Repeat([]byte("p"), 1200)
	for i, vip := range vips {
		id := uint32(i + 1)
		h.service(id, vip, ipTCP)
		h.backend(id, id, backend, BackendReady, 0)
		h.table(id, h.fill(id))
		// One client port per frontend: the backend sees two flows.
		c := netip.AddrPortFrom(client.Addr(), client.Port()+uint16(i))
		if ret, _ := h.run(h.objs.FluxvmFromVm, pkt.TCP(c, vip, pkt.SYN, nil)); ret != tcOK {
			t.Fatalf("SYN to %v: verdict %d", vip, int32(ret))
		}
		v := h.edt(id, MinEDTRate, 4*time.Second)
		v.Pacer = 1
		h.must(h.objs.FluxvmEdt.Put(id, v))
	}
	// The pacer's clock 2 s ahead: both replies queue behind it.
	var pv EDTValue
	h.must(h.objs.FluxvmEdt.Lookup(uint32(1), &pv))
	pv.LastDeparture = monoNow(t) + uint64(2*time.Second)
	h.must(h.objs.FluxvmEdt.Put(uint32(1), pv))
	var stamps []uint64
	for i := range vips {
		c := netip.AddrPortFrom(client.Addr(), client.Port()+uint16(i))
		reply := pkt.TCP(backend, c, pkt.ACK, big)
		ret, out, ts := h.runTstamp(h.objs.FluxvmToVm, reply, 0)
		if want := pkt.TCP(vips[i], c, pkt.ACK, big); ret != tcOK || !bytes.Equal(out, want) {
			t.Fatalf("reply through frontend %d: verdict %d, translated %v", i+1, int32(ret), bytes.Equal(out, want))
		}
		stamps = append(stamps, ts)
	}
	var v EDTValue
	h.must(h.objs.FluxvmEdt.Lookup(uint32(1), &v))
	delay := uint64(v.Delay(uint32(len(pkt.TCP(backend, client, pkt.ACK, big)))))
	if stamps[0] != pv.LastDeparture+delay || stamps[1]-stamps[0] != delay || v.LastDeparture != stamps[1] {
		t.Errorf("departures %v, pacer's clock %d: want the second %d ns after the first, on the pacer's clock", stamps, v.LastDeparture, delay)
	}
	h.must(h.objs.FluxvmEdt.Lookup(uint32(2), &v))
	if v.LastDeparture != 0 {
		t.Errorf("the second frontend's own clock moved to %d; want it unused", v.LastDeparture)
	}
}

// TestEDTSNATReplies: a north-south reply to the SNAT address that meets
// no ingress hook first is translated at fluxvm_ns_out, and paced there,
// on egress; translated at an ingress hook (ns_in, from_vm), it is paced
// later, as it leaves through ns_out by its source, not there.
func TestEDTSNATReplies(t *testing.T) {
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v.nsSetup(h, 0)
			client := v.clientAt(40000)
			b := v.backends[0]
			port := nsForward(t, h, v, client, pkt.SYN, b)
			ev := h.edt(sid, MinEDTRate, 4*time.Second)
			ev.LastDeparture = monoNow(t) + uint64(2*time.Second)
			h.must(h.objs.FluxvmEdt.Put(uint32(sid), ev))
			reply := v.frame(b, netip.AddrPortFrom(v.snatAddr(), port), pkt.ACK)
			want := v.frame(v.vip, client, pkt.ACK)
			for _, hook := range []struct {
				name  string
				prog  *ebpf.Program
				paced bool
			}{{"ns_in", h.objs.FluxvmNsIn, false}, {"from_vm", h.objs.FluxvmFromVm, false}, {"ns_out", h.objs.FluxvmNsOut, true}} {
				ret, got, ts := h.runTstamp(hook.prog, reply, 0)
				if ret != tcOK || !bytes.Equal(got, want) {
					t.Fatalf("reply on %s: verdict %d, translated %v", hook.name, int32(ret), bytes.Equal(got, want))
				}
				if wantTS := ev.LastDeparture + uint64(ev.Delay(uint32(len(reply)))); hook.paced != (ts == wantTS) || !hook.paced && ts != 0 {
					t.Errorf("reply on %s: tstamp %d; paced %v (departure %d)", hook.name, ts, hook.paced, wantTS)
				}
			}
		})
	}
}

func TestNewEDTValue(t *testing.T) {
	for _, tc := range []struct {
		rate    uint64
		horizon time.Duration
		ok      bool
	}{
		{MinEDTRate, time.Millisecond, true},
		{MaxEDTRate, MaxEDTHorizon, true},
		{MinEDTRate - 1, time.Second, false},
		{MaxEDTRate + 1, time.Second, false},
		{MinEDTRate, MinEDTHorizon - 1, false},
		{MinEDTRate, MaxEDTHorizon + 1, false},
	} {
		v, err := NewEDTValue(tc.rate, tc.horizon)
		if (err == nil) != tc.ok {
			t.Errorf("NewEDTValue(%d, %v) = %v; ok=%v", tc.rate, tc.horizon, err, tc.ok)
			continue
		}
		if !tc.ok {
			continue
		}
		// The Q32 delay never undershoots the exact one (the rate is a
		// ceiling) and is off by less than a nanosecond.
		for _, n := range []uint32{1, 64, 1500, 65535, 1 << 19} {
			exact := float64(n) * 1e9 / float64(tc.rate)
			if d := float64(v.Delay(n)); d < exact || d > exact+1 {
				t.Errorf("rate %d: delay of %d bytes %v; want %.1f ns", tc.rate, n, v.Delay(n), exact)
			}
		}
	}
	if got := MbpsToEDTRate(50); got != 6_250_000 {
		t.Errorf("50 Mbit/s = %d bytes/s; want 6250000", got)
	}
}

// BenchmarkEDT measures what pacing costs the reply path, the way
// BenchmarkDatapath measures (one run per call, kernel-reported, net of an
// empty program's floor, interleaved blocks in both orders): the same reply
// of the same established flow, its service unpaced in one case's blocks
// and paced in the other's (100 Gbit/s and a 10 s horizon, so that no
// packet of the run is dropped, checked), the entry written before each
// block.
//
//	go test -run '^$' -bench BenchmarkEDT -benchtime 1x ./bpf/
func BenchmarkEDT(b *testing.B) {
	calls := benchCalls(b)
	h := newHarnessSized(b, 0)
	v := variants()[0] // ipv4 tcp
	v.setup(h)
	h.edge()
	if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(40000, pkt.SYN)); ret != tcOK {
		b.Fatal("flow not set up")
	}
	paced, err := NewEDTValue(MaxEDTRate, MaxEDTHorizon)
	if err != nil {
		b.Fatal(err)
	}
	// Before each block the entry is written; before an unpaced block it
	// is read first: a paced block must have moved its clock.
	var pacedBlocks, unmoved int
	set := func(e EDTValue) func() {
		return func() {
			var was EDTValue
			h.must(h.objs.FluxvmEdt.Lookup(uint32(sid), &was))
			if was.Rate != 0 {
				pacedBlocks++
				if was.LastDeparture == 0 {
					unmoved++
				}
			}
			h.must(h.objs.FluxvmEdt.Put(uint32(sid), e))
		}
	}
	reply := func(int) []byte { return v.reply(v.backends[0], 40000, pkt.ACK) }
	cases := []*benchCase{
		{name: "ipv4 tcp reply, unpaced", metric: "v4-reply-unpaced", prog: h.objs.FluxvmToVm, frame: reply, want: tcOK, before: set(EDTValue{})},
		{name: "ipv4 tcp reply, paced", metric: "v4-reply-paced", prog: h.objs.FluxvmToVm, frame: reply, want: tcOK, before: set(paced)},
	}
	measureInterleaved(b, h.th, calls, cases, true)
	u := float64(cases[0].sum) / float64(cases[0].n)
	p := float64(cases[1].sum) / float64(cases[1].n)
	b.ReportMetric(p-u, "paced-minus-unpaced-ns")
	set(EDTValue{})() // counts the last block, if it was paced
	if st := h.stats(sid); st.EdtDrops != 0 || pacedBlocks == 0 || unmoved != 0 {
		b.Fatalf("%d paced packets dropped, %d of %d paced blocks left the clock unmoved: the measurement is not of paced packets", st.EdtDrops, unmoved, pacedBlocks)
	}
}
