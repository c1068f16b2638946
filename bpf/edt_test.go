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

			// A burst at 1 Mbit/s with a horizon of 2.5 packets: the
			// first leaves at once plus its own time, each next one
			// len/rate later, and the third would lie beyond the horizon.
			v := h.edt(1, rate, 25*time.Millisecond)
			delay := uint64(v.Delay(uint32(len(reply))))
			if want := uint64(len(reply)) * 1e9 / rate; delay < want || delay > want+1 {
				t.Fatalf("delay %d ns for %d bytes; want %d", delay, len(reply), want)
			}
			before := monoNow(t)
			var stamps []uint64
			for i := range 5 {
				ret, out, ts := h.runTstamp(h.objs.FluxvmToVm, reply, 0)
				if i < 2 {
					if ret != tcOK || !bytes.Equal(out, translated) {
						t.Fatalf("packet %d: verdict %d, translated %v", i, int32(ret), bytes.Equal(out, translated))
					}
					stamps = append(stamps, ts)
					continue
				}
				if ret != tcShot {
					t.Fatalf("packet %d: verdict %d, tstamp %d; want a drop beyond the horizon (stamps so far %v)", i, int32(ret), ts, stamps)
				}
			}
			after := monoNow(t)
			if stamps[0] < before+delay || stamps[0] > after+delay {
				t.Errorf("first departure %d; want now (%d..%d) + %d", stamps[0], before, after, delay)
			}
			if stamps[1]-stamps[0] != delay {
				t.Errorf("departures %v: spaced %d ns; want len/rate = %d", stamps, stamps[1]-stamps[0], delay)
			}
			var e EDTValue
			h.must(h.objs.FluxvmEdt.Lookup(uint32(1), &e))
			if e.LastDeparture != stamps[1] {
				t.Errorf("last_departure %d; want the last departure %d", e.LastDeparture, stamps[1])
			}
			if st, d := h.stats(1), h.drops(); st.EdtDrops != 3 || st.Drops != 3 || d[DropEDTHorizon] != 3 || st.ReplyPackets != 4 {
				t.Errorf("stats %+v, edt_horizon drops %d; want 3 horizon drops and 4 replies translated", st, d[DropEDTHorizon])
			}

			// A new rate: the next packet goes at once at the new rate
			// (the entry's clock starts empty).
			v2 := h.edt(1, 10*rate, 25*time.Millisecond)
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
		v := h.edt(id, MinEDTRate, time.Second)
		v.Pacer = 1
		h.must(h.objs.FluxvmEdt.Put(id, v))
	}
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
	if stamps[1]-stamps[0] != delay || v.LastDeparture != stamps[1] {
		t.Errorf("departures %v, pacer's clock %d: want the second %d ns after the first, on the pacer's clock", stamps, v.LastDeparture, delay)
	}
	h.must(h.objs.FluxvmEdt.Lookup(uint32(2), &v))
	if v.LastDeparture != 0 {
		t.Errorf("the second frontend's own clock moved to %d; want it unused", v.LastDeparture)
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
			if d := float64(v.Delay(n)); d < exact-1 || d > exact+1 {
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
// empty program's floor, interleaved blocks): a reply of an established
// flow of an unpaced service against one of a paced service (100 Gbit/s
// and a 10 s horizon, so that no packet of the run is dropped), in the
// same run, each pair in both orders.
//
//	go test -run '^$' -bench BenchmarkEDT -benchtime 1x ./bpf/
func BenchmarkEDT(b *testing.B) {
	calls := benchCalls(b)
	h := newHarnessSized(b, 0)
	unpaced := variants()[0] // ipv4 tcp
	paced := unpaced
	paced.vip = netip.MustParseAddrPort("10.96.0.11:80")
	paced.backends = []netip.AddrPort{netip.MustParseAddrPort("10.1.1.1:8080")}
	unpaced.setup(h)
	paced.setupAt(h, sid+1, 31)
	h.edge()
	for _, v := range []variant{unpaced, paced} {
		if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(40000, pkt.SYN)); ret != tcOK {
			b.Fatalf("%v flow not set up", v.vip)
		}
	}
	h.edt(sid+1, MaxEDTRate, MaxEDTHorizon)
	cases := []*benchCase{
		{name: "ipv4 tcp reply, unpaced", metric: "v4-reply-unpaced", prog: h.objs.FluxvmToVm,
			frame: func(int) []byte { return unpaced.reply(unpaced.backends[0], 40000, pkt.ACK) }, want: tcOK},
		{name: "ipv4 tcp reply, paced", metric: "v4-reply-paced", prog: h.objs.FluxvmToVm,
			frame: func(int) []byte { return paced.reply(paced.backends[0], 40000, pkt.ACK) }, want: tcOK},
	}
	measureInterleaved(b, h.th, calls, cases, true)
	u := float64(cases[0].sum) / float64(cases[0].n)
	p := float64(cases[1].sum) / float64(cases[1].n)
	b.ReportMetric(p-u, "paced-minus-unpaced-ns")
	var e EDTValue
	h.must(h.objs.FluxvmEdt.Lookup(uint32(sid+1), &e))
	if st := h.stats(sid + 1); st.EdtDrops != 0 || e.LastDeparture == 0 {
		b.Fatalf("%d paced packets dropped, last departure %d: the measurement is not of paced packets", st.EdtDrops, e.LastDeparture)
	}
}
