package bpf

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"golang.org/x/sys/unix"
)

// flowSampling sets the node's flow_sample_rate, keeping the rest of meta.
func (h *harness) flowSampling(n uint32) {
	h.t.Helper()
	var m Meta
	h.must(h.objs.FluxvmMeta.Lookup(uint32(0), &m))
	m.FlowSampleRate = n
	h.meta(m)
}

// flowRecord is the record of flow id, or false when the ring no longer
// holds it.
func (h *harness) flowRecord(id uint32) (FlowRecord, bool) {
	h.t.Helper()
	var f FlowRecord
	h.must(h.objs.FluxvmSflows.Lookup(id&uint32(h.objs.FluxvmSflows.MaxEntries()-1), &f))
	return f, id != 0 && uint32(f.Seq) == id
}

func (h *harness) flowSeq() uint64 {
	h.t.Helper()
	var n uint64
	h.must(h.objs.FluxvmFlowSeq.Lookup(uint32(0), &n))
	return n
}

// TestFlowRecords: with sampling on, a new flow gets a record that names it
// as the client sent it and as it was translated, its conntrack entry (and
// reverse-NAT half) keep the record's id, and its packets count into it
// each way; with sampling off nothing is written at all. Both families,
// east-west NAT and north-south SNAT.
func TestFlowRecords(t *testing.T) {
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v.setup(h)
			fam := family(v.client)

			// Off: no record, no id.
			if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(40000, pkt.SYN)); ret != tcOK {
				t.Fatalf("SYN: verdict %d", int32(ret))
			}
			if ct, _ := h.ct(v.flow(40000)); ct.Flow != 0 || h.flowSeq() != 0 {
				t.Fatalf("sampling off: conntrack flow id %d, records opened %d; want none", ct.Flow, h.flowSeq())
			}

			h.flowSampling(1)
			syn := v.fwd(40001, pkt.SYN)
			if ret, _ := h.run(h.objs.FluxvmFromVm, syn); ret != tcOK {
				t.Fatalf("SYN: verdict %d", int32(ret))
			}
			ct, ok := h.ct(v.flow(40001))
			if !ok || ct.Flow == 0 {
				t.Fatalf("conntrack %+v (present %v): no flow id", ct, ok)
			}
			b := v.backends[0]
			for _, be := range v.backends {
				if uint32(ct.BackendId) == 1+uint32(indexOf(v.backends, be)) {
					b = be
				}
			}
			f, ok := h.flowRecord(ct.Flow)
			if !ok {
				t.Fatalf("no record for id %d", ct.Flow)
			}
			if Addr(f.Client, fam) != v.client || Port(f.Cport) != 40001 || Addr(f.Vip, fam) != v.vip.Addr() ||
				Port(f.Vport) != v.vip.Port() || Addr(f.Backend, fam) != b.Addr() || Port(f.Bport) != b.Port() ||
				f.Proto != v.proto || f.Family != fam || FlowHook(f.Hook) != FlowHookFromVM ||
				FlowVerdict(f.Verdict) != FlowForwarded || f.ServiceId != sid || f.BackendId != ct.BackendId ||
				f.FwdPackets != 1 || f.FwdBytes != uint64(len(syn)) || f.FirstNs == 0 || f.Snat != [4]uint32{} {
				t.Errorf("record %+v; want the flow %s:40001 -> %s via %s, forwarded, one packet", f, v.client, v.vip, b)
			}
			ack := v.fwd(40001, pkt.ACK)
			for range 2 {
				h.run(h.objs.FluxvmFromVm, ack)
			}
			reply := v.reply(b, 40001, pkt.ACK)
			if ret, _ := h.run(h.objs.FluxvmToVm, reply); ret != tcOK {
				t.Fatalf("reply: verdict %d", int32(ret))
			}
			f, _ = h.flowRecord(ct.Flow)
			if f.FwdPackets != 3 || f.FwdBytes != uint64(len(syn)+2*len(ack)) || f.RevPackets != 1 || f.RevBytes != uint64(len(reply)) || f.LastNs < f.FirstNs {
				t.Errorf("counts %d/%d forward, %d/%d reply; want 3/%d, 1/%d", f.FwdPackets, f.FwdBytes, f.RevPackets, f.RevBytes,
					len(syn)+2*len(ack), len(reply))
			}
			if c := h.counters(); c[CounterFlowRecorded] != 1 {
				t.Errorf("flow_recorded %d; want 1", c[CounterFlowRecorded])
			}

			// A newer record in the slot: the flow stops counting into it.
			f.Seq += uint64(h.objs.FluxvmSflows.MaxEntries())
			h.must(h.objs.FluxvmSflows.Put(ct.Flow&uint32(h.objs.FluxvmSflows.MaxEntries()-1), f))
			h.run(h.objs.FluxvmFromVm, ack)
			h.run(h.objs.FluxvmToVm, reply)
			var again FlowRecord
			h.must(h.objs.FluxvmSflows.Lookup(ct.Flow&uint32(h.objs.FluxvmSflows.MaxEntries()-1), &again))
			if again.FwdPackets != f.FwdPackets || again.RevPackets != f.RevPackets {
				t.Errorf("a reused slot was counted into: %+v", again)
			}
			// The same id on a record of another service (an id carried
			// over a reload into a new ring): not counted into either.
			f.Seq -= uint64(h.objs.FluxvmSflows.MaxEntries())
			f.ServiceId = sid + 1
			h.must(h.objs.FluxvmSflows.Put(ct.Flow&uint32(h.objs.FluxvmSflows.MaxEntries()-1), f))
			h.run(h.objs.FluxvmFromVm, ack)
			h.run(h.objs.FluxvmToVm, reply)
			h.must(h.objs.FluxvmSflows.Lookup(ct.Flow&uint32(h.objs.FluxvmSflows.MaxEntries()-1), &again))
			if again.FwdPackets != f.FwdPackets || again.RevPackets != f.RevPackets {
				t.Errorf("another service's record with the flow's id was counted into: %+v", again)
			}
		})
	}
}

func indexOf(s []netip.AddrPort, x netip.AddrPort) int {
	for i, y := range s {
		if y == x {
			return i
		}
	}
	return -1
}

// TestFlowRecordsSNAT: a north-south flow's record names the SNAT address
// and port its source became, and its replies (to the SNAT address,
// through the reverse-NAT mapping) count into it.
func TestFlowRecordsSNAT(t *testing.T) {
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v.nsSetup(h, 0)
			h.flowSampling(1)
			client := v.clientAt(40000)
			b := v.backends[0]
			port := nsForward(t, h, v, client, pkt.SYN, b)
			ct, _ := h.ct(v.flow(40000))
			f, ok := h.flowRecord(ct.Flow)
			fam := family(v.client)
			if !ok || Addr(f.Snat, fam) != v.snatAddr() || Port(f.SnatPort) != port || FlowHook(f.Hook) != FlowHookNSIn {
				t.Fatalf("record %+v (present %v); want SNAT to %s:%d, hook ns_in", f, ok, v.snatAddr(), port)
			}
			if nv, _ := h.nat(v.snatKey(b, port)); nv.Flow != ct.Flow {
				t.Errorf("reverse-NAT mapping flow id %d; want %d", nv.Flow, ct.Flow)
			}
			reply := v.frame(b, netip.AddrPortFrom(v.snatAddr(), port), pkt.SYNACK)
			if ret, _ := h.run(h.objs.FluxvmNsIn, reply); ret != tcOK {
				t.Fatalf("reply: verdict %d", int32(ret))
			}
			if f, _ = h.flowRecord(ct.Flow); f.RevPackets != 1 || f.RevBytes != uint64(len(reply)) {
				t.Errorf("reply counts %d/%d; want 1/%d", f.RevPackets, f.RevBytes, len(reply))
			}
		})
	}
}

// TestFlowRecordsDrops: a client packet dropped on a forward path records
// the drop with its reason, in a record of its own when its flow has none;
// new drop records take a budget (a flood of them cannot take the ring),
// and past it they are counted, not recorded.
func TestFlowRecordsDrops(t *testing.T) {
	v := variants()[0]
	h := newHarness(t)
	h.reset()
	v.setup(h)
	h.noTable(sid) // every new flow drops: no backend
	h.flowSampling(1)
	syn := v.fwd(40000, pkt.SYN)
	if ret, _ := h.run(h.objs.FluxvmFromVm, syn); ret != tcShot {
		t.Fatalf("SYN to a service without a table: verdict %d; want a drop", int32(ret))
	}
	f, ok := h.flowRecord(uint32(h.flowSeq()))
	if !ok || FlowVerdict(f.Verdict) != FlowDropped || DropReason(f.Reason) != DropNoBackend || f.Drops != 1 ||
		f.ServiceId != sid || f.Backend != [4]uint32{} || Port(f.Cport) != 40000 {
		t.Fatalf("drop record %+v (present %v); want dropped, no_backend, 1 drop, no backend", f, ok)
	}
	// A flood: the budget (64, refilled at 64 a second) holds; the rest
	// are counted as limited. On one CPU, so that the bound is exact
	// whatever the budget's scope (TestFlowRecordsDropBudget: the node's).
	h.onCPU(h.anyCPU(), func() {
		before, lim := h.flowSeq(), h.counters()[CounterFlowDropLimited]
		start := time.Now()
		for i := range 200 {
			h.run(h.objs.FluxvmFromVm, v.fwd(uint16(41000+i), pkt.SYN))
		}
		// The burst less the record above, plus what the refill added
		// while the loop ran (one record per 1/64 s, plus one for
		// rounding).
		refill := uint64(time.Since(start).Seconds()*64) + 1
		opened := h.flowSeq() - before
		limited := h.counters()[CounterFlowDropLimited] - lim
		if opened < 63 || opened > 63+refill || opened+limited != 200 {
			t.Errorf("200 drops: %d records opened, %d limited; want the rest of the burst, 63 (up to %d with the refill), opened and the rest limited",
				opened, limited, 63+refill)
		}
	})

	// An established flow's drop goes into its own record.
	h.table(sid, h.fill(1))
	if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(42000, pkt.SYN)); ret != tcOK {
		t.Fatalf("SYN: verdict %d", int32(ret))
	}
	ct, _ := h.ct(v.flow(42000))
	h.guard(sid, GuardClosed)
	if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(42000, pkt.ACK)); ret != tcShot {
		t.Fatalf("guard closed: verdict %d; want a drop", int32(ret))
	}
	if f, ok := h.flowRecord(ct.Flow); !ok || f.Drops != 1 || DropReason(f.Reason) != DropGuardClosed || FlowVerdict(f.Verdict) != FlowForwarded {
		t.Errorf("established flow's record %+v (present %v); want 1 drop, guard_closed, still forwarded", f, ok)
	}
}

// TestFlowSampling: 1 in N new flows gets a record.
func TestFlowSampling(t *testing.T) {
	v := variants()[0]
	h := newHarness(t)
	h.reset()
	v.setup(h)
	h.flowSampling(4)
	for i := range 800 {
		if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(uint16(20000+i), pkt.SYN)); ret != tcOK {
			t.Fatalf("SYN %d: verdict %d", i, int32(ret))
		}
	}
	// Binomial(800, 1/4): mean 200, sd 12; 140..260 fails once in ~10^6.
	if n := h.flowSeq(); n < 140 || n > 260 {
		t.Errorf("%d of 800 new flows recorded at flow_sample_rate 4; want about 200", n)
	}
}

// BenchmarkFlows measures what a flow record costs the conntrack-hit path,
// the way BenchmarkDatapath measures: the same packet of the same
// established IPv4 flow, its conntrack entry without a record id in one
// case's blocks and with one in the other's (written before each block),
// interleaved in both orders, net of the floor.
//
//	go test -run '^$' -bench BenchmarkFlows -benchtime 1x ./bpf/
func BenchmarkFlows(b *testing.B) {
	calls := benchCalls(b)
	h := newHarnessSized(b, 0)
	v := variants()[0]
	v.setup(h)
	h.edge()
	h.flowSampling(1)
	if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(40000, pkt.SYN)); ret != tcOK {
		b.Fatal("flow not set up")
	}
	ct, ok := h.ct(v.flow(40000))
	if !ok || ct.Flow == 0 {
		b.Fatal("no record")
	}
	id := ct.Flow
	ctMap := h.ctMap(v.flow(40000))
	key := v.flow(40000).key()
	set := func(flow uint32) func() {
		return func() {
			var c CTValue
			h.must(ctMap.Lookup(key, &c))
			c.Flow = flow
			h.must(ctMap.Put(key, c))
		}
	}
	ack := func(int) []byte { return v.fwd(40000, pkt.ACK) }
	cases := []*benchCase{
		{name: "ipv4 tcp conntrack hit, no record", metric: "v4-ct-hit-unrecorded", prog: h.objs.FluxvmFromVm, frame: ack, want: tcOK, before: set(0)},
		{name: "ipv4 tcp conntrack hit, recorded", metric: "v4-ct-hit-recorded", prog: h.objs.FluxvmFromVm, frame: ack, want: tcOK, before: set(id)},
	}
	measureInterleaved(b, h.th, calls, cases, true)
	u := float64(cases[0].sum) / float64(cases[0].n)
	r := float64(cases[1].sum) / float64(cases[1].n)
	b.ReportMetric(r-u, "recorded-minus-unrecorded-ns")
	if f, ok := h.flowRecord(id); !ok || f.FwdPackets < uint64(cases[1].n) {
		b.Fatalf("record %+v (present %v): fewer forward packets than the recorded case ran (%d)", f, ok, cases[1].n)
	}
}

// TestFlowRecordsXDP: the north-south XDP program opens and counts records
// as TC does, marked as XDP's.
func TestFlowRecordsXDP(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	objs := newXDPObjects(t, h, l.out)
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h.reset()
			v.nsSetup(h, 0)
			h.flowSampling(1)
			client := v.clientAt(snatMin)
			var frames int
			for _, f := range []pkt.TCPFlags{pkt.SYN, pkt.ACK} {
				in := v.frame(client, v.vip, f)
				if ret, _ := h.runXDP(objs.FluxvmXdpNs, in, l.in); ret != xdpRedirect {
					t.Fatalf("verdict %d; want XDP_REDIRECT", ret)
				}
				frames += len(in)
			}
			ct, _ := h.ct(tuple{client, v.vip, v.proto})
			f, ok := h.flowRecord(ct.Flow)
			fam := family(v.client)
			if !ok || FlowHook(f.Hook) != FlowHookXDP || Addr(f.Snat, fam) != v.snatAddr() || Port(f.SnatPort) != snatMin ||
				Addr(f.Backend, fam) != v.backends[0].Addr() || f.FwdPackets != 2 || f.FwdBytes != uint64(frames) ||
				uint32(f.Ifindex) != uint32(l.in) {
				t.Errorf("record %+v (present %v); want XDP's, SNAT to %s:%d, 2 packets, %d bytes, ifindex %d", f, ok, v.snatAddr(), snatMin, frames, l.in)
			}
			// A drop in XDP (no backend) is recorded, as XDP's.
			h.noTable(sid)
			before := h.flowSeq()
			if ret, _ := h.runXDP(objs.FluxvmXdpNs, v.frame(v.clientAt(snatMin+1), v.vip, pkt.SYN), l.in); ret != xdpDrop {
				t.Fatalf("no backend: verdict %d; want XDP_DROP", ret)
			}
			d, ok := h.flowRecord(uint32(h.flowSeq()))
			if h.flowSeq() != before+1 || !ok || FlowHook(d.Hook) != FlowHookXDP || FlowVerdict(d.Verdict) != FlowDropped ||
				DropReason(d.Reason) != DropNoBackend {
				t.Errorf("drop record %+v (present %v); want XDP's, dropped, no_backend", d, ok)
			}
		})
	}
}

// flowRecords are the records the ring holds, oldest first.
func (h *harness) flowRecords() []FlowRecord {
	h.t.Helper()
	var out []FlowRecord
	seq := h.flowSeq()
	n := uint64(h.objs.FluxvmSflows.MaxEntries())
	for s := seq; s > 0 && seq-s < n; s-- {
		if f, ok := h.flowRecord(uint32(s)); ok && f.Seq == s {
			out = append(out, f)
		}
	}
	slices.Reverse(out)
	return out
}

// recordsOf are the records of client.
func recordsOf(recs []FlowRecord, client netip.AddrPort) []FlowRecord {
	var out []FlowRecord
	fam := family(client.Addr())
	for _, f := range recs {
		if f.Family == fam && Addr(f.Client, fam) == client.Addr() && Port(f.Cport) == client.Port() {
			out = append(out, f)
		}
	}
	return out
}

// allowedCPUs are the CPUs the test may run on.
func (h *harness) allowedCPUs() []int {
	h.t.Helper()
	var set unix.CPUSet
	h.must(unix.SchedGetaffinity(0, &set))
	var cpus []int
	for c := range 1024 {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus
}

func (h *harness) anyCPU() int { return h.allowedCPUs()[0] }

// onCPU runs fn with the harness's thread (where the programs run: an OS
// thread nsutil.Thread keeps locked with runtime.LockOSThread for its
// life) pinned to cpu by sched_setaffinity, its affinity restored
// afterwards.
func (h *harness) onCPU(cpu int, fn func()) {
	h.t.Helper()
	var old unix.CPUSet
	var err error
	h.th.Do(func() {
		if err = unix.SchedGetaffinity(0, &old); err != nil {
			return
		}
		var one unix.CPUSet
		one.Set(cpu)
		err = unix.SchedSetaffinity(0, &one)
	})
	h.must(err)
	defer h.th.Do(func() { h.must(unix.SchedSetaffinity(0, &old)) })
	fn()
}

// TestFlowRecordsDropBudget: the budget of new drop records is the node's,
// not each CPU's: a flood of drops on one CPU opens exactly the burst
// (plus what the refill added while it ran), and the same flood then on
// another CPU opens no more than the refill: both together no more than
// the burst plus the refill over the time of both.
func TestFlowRecordsDropBudget(t *testing.T) {
	v := variants()[0]
	h := newHarness(t)
	h.reset()
	v.setup(h)
	h.noTable(sid)
	h.flowSampling(1)
	allowed := h.allowedCPUs()
	flood := func(port uint16) (opened, limited uint64, refill uint64) {
		before, lim := h.flowSeq(), h.counters()[CounterFlowDropLimited]
		start := time.Now()
		for i := range 200 {
			if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(port+uint16(i), pkt.SYN)); ret != tcShot {
				t.Fatalf("verdict %d; want a drop", int32(ret))
			}
		}
		// One record per 1/64 s of the flood, plus one for rounding.
		return h.flowSeq() - before, h.counters()[CounterFlowDropLimited] - lim, uint64(time.Since(start).Seconds()*64) + 1
	}
	var first, refill uint64
	start := time.Now()
	h.onCPU(allowed[0], func() {
		var limited uint64
		first, limited, refill = flood(41000)
		if first < 64 || first > 64+refill || first+limited != 200 {
			t.Errorf("200 drops on one CPU: %d records opened, %d limited; want the burst of 64 (up to %d with the refill) and the rest limited",
				first, limited, 64+refill)
		}
	})
	if len(allowed) < 2 {
		t.Skip("one CPU: the node-wide bound needs two")
	}
	h.onCPU(allowed[1], func() {
		opened, limited, _ := flood(42000)
		// The bucket the first flood emptied is the node's: both floods
		// together open at most the burst plus what it refilled from
		// the first flood's start to the second's end (the time
		// between them included: a loaded machine may take long to
		// move the thread), plus two for rounding.
		bound := 64 + uint64(time.Since(start).Seconds()*64) + 2
		if first+opened > bound || opened+limited != 200 {
			t.Errorf("200 more drops on another CPU: %d records opened (%d before), %d limited; want at most %d in all: the budget is node-wide",
				opened, first, limited, bound)
		}
	})
}

// TestFlowRecordsLearnFails: a new flow whose learn fails (SNAT port
// exhaustion) leaves no forwarded record: its packet's drop is recorded
// once, as a dropped record with the reason (from the drop budget).
func TestFlowRecordsLearnFails(t *testing.T) {
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v.nsSetup(h, 0)
			h.flowSampling(1)
			client := func(i int) netip.AddrPort {
				a := v.client.As16()
				a[15] += byte(i)
				return netip.AddrPortFrom(netip.AddrFrom16(a).Unmap(), snatMin)
			}
			for i := range snatMax - snatMin + 1 {
				nsForward(t, h, v, client(int(i)), pkt.SYN, v.backends[0])
			}
			full := client(100)
			full = netip.AddrPortFrom(full.Addr(), 45000)
			rec := h.counters()[CounterFlowRecorded]
			expectDropOn(t, h, h.objs.FluxvmNsIn, v.frame(full, v.vip, pkt.SYN), DropSNATFailed)
			recs := recordsOf(h.flowRecords(), full)
			if len(recs) != 1 || FlowVerdict(recs[0].Verdict) != FlowDropped || DropReason(recs[0].Reason) != DropSNATFailed ||
				recs[0].Drops != 1 || recs[0].FwdPackets != 0 || recs[0].BackendId != 0 {
				t.Errorf("records of the flow whose SNAT failed: %+v; want one, dropped, snat_failed, 1 drop, nothing forwarded", recs)
			}
			if got := h.counters()[CounterFlowRecorded] - rec; got != 1 {
				t.Errorf("flow_recorded +%d; want +1", got)
			}
		})
	}
}

// TestFlowRecordsDropAfterHit: a packet of a recorded flow that the
// forward path drops after its conntrack hit (DSR toward a backend
// without a route) counts as a drop, not as forwarded; and the flow's
// first packet, dropped the same way after its learn, is not counted
// forwarded either. While nothing of the flow was sent its record says
// dropped; the first packet sent sets it back to forwarded (audited, for
// a flow its identity policy audited).
func TestFlowRecordsDropAfterHit(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	for _, v := range []variant{variants()[0], variants()[2]} {
		for _, audited := range []bool{false, true} {
			name := v.name
			if audited {
				name += "/audited"
			}
			t.Run(name, func(t *testing.T) {
				h.reset()
				for _, m := range []*ebpf.Map{h.objs.FluxvmSpol, h.objs.FluxvmSid4, h.objs.FluxvmSid6} {
					clearMap(t, m)
				}
				// A client port of its own: the ring is the harness's.
				cport := uint16(40000)
				if audited {
					cport = 40100
				}
				flags, want := SvcFlagDSR, FlowForwarded
				if audited {
					// audit_only over a default deny: forwarded,
					// recorded audited.
					flags |= SvcFlagPolicy
					want = FlowAudited
					bits := 32
					if v.client.Is6() {
						bits = 128
					}
					h.ipcache(netip.PrefixFrom(v.client, bits).String(), 2001)
					h.policy(sid, 10, 1, PolicyDeny, PolicyFlagAudit, nil)
				}
				v.nsSetup(h, flags)
				h.table(sid, h.fill(3)) // backend 3: no route
				h.flowSampling(1)
				for _, f := range []pkt.TCPFlags{pkt.SYN, pkt.ACK} {
					if ret, _ := h.runOn(h.objs.FluxvmNsIn, v.fwd(cport, f), l.in); ret != tcShot {
						t.Fatalf("DSR without a route: verdict %d; want a drop", int32(ret))
					}
				}
				ct, ok := h.ct(v.flow(cport))
				f, present := h.flowRecord(ct.Flow)
				if !ok || !present || f.FwdPackets != 0 || f.FwdBytes != 0 || f.Drops != 2 || DropReason(f.Reason) != DropDSRNoRoute ||
					FlowVerdict(f.Verdict) != FlowDropped {
					t.Errorf("record %+v (present %v, conntrack %v); want nothing forwarded, 2 drops, dsr_no_route, verdict dropped", f, present, ok)
				}
				if n := len(recordsOf(h.flowRecords(), v.clientAt(cport))); n != 1 {
					t.Errorf("%d records of the flow; want 1", n)
				}
				// The flow's backend gets a route (the entry moved to
				// backend 1, which has one): its next packet is sent,
				// and the record says so.
				ct.BackendId = 1
				h.must(h.ctMap(v.flow(cport)).Put(v.flow(cport).key(), ct))
				ack := v.fwd(cport, pkt.ACK)
				if ret, _ := h.runOn(h.objs.FluxvmNsIn, ack, l.in); ret != tcRedirect {
					t.Fatalf("DSR with a route: verdict %d; want a redirect", int32(ret))
				}
				if f, _ = h.flowRecord(ct.Flow); f.FwdPackets != 1 || f.FwdBytes != uint64(len(ack)) || f.Drops != 2 || FlowVerdict(f.Verdict) != want {
					t.Errorf("record after a packet sent %+v; want 1 packet forwarded, 2 drops, verdict %v", f, want)
				}
				// Once a packet was sent, a drop leaves the verdict.
				h.guard(sid, GuardClosed)
				if ret, _ := h.runOn(h.objs.FluxvmNsIn, ack, l.in); ret != tcShot {
					t.Fatalf("guard closed: verdict %d; want a drop", int32(ret))
				}
				if f, _ = h.flowRecord(ct.Flow); f.Drops != 3 || FlowVerdict(f.Verdict) != want {
					t.Errorf("record after a later drop %+v; want 3 drops, verdict still %v", f, want)
				}
			})
		}
	}
}

// TestFlowRecordsXDPPass: a packet XDP learns or counts and then leaves
// to TC (no neighbour toward the backend, or a route out of an interface
// XDP may not send on) is counted once, by TC; packets XDP sends are
// counted by XDP.
func TestFlowRecordsXDPPass(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	objs := newXDPObjects(t, h, l.out)
	for _, v := range []variant{variants()[0], variants()[2]} {
		for _, tc := range []struct {
			name string
			set  func()
			undo func()
		}{
			{"no neighbour", func() { h.table(sid, h.fill(2)) }, func() {}},
			{"egress not allowed", func() { h.th.Do(func() { h.must(objs.FluxvmXdpTx.Delete(uint32(l.out))) }) },
				func() { h.th.Do(func() { h.must(objs.FluxvmXdpTx.Put(uint32(l.out), uint32(l.out))) }) }},
		} {
			t.Run(v.name+"/"+tc.name, func(t *testing.T) {
				h.reset()
				v.nsSetup(h, 0)
				h.flowSampling(1)
				tc.set()
				defer tc.undo()
				client := v.clientAt(snatMin + 1)
				var bytes uint64
				for _, f := range []pkt.TCPFlags{pkt.SYN, pkt.ACK} {
					in := v.frame(client, v.vip, f)
					if ret, _ := h.runXDP(objs.FluxvmXdpNs, in, l.in); ret != xdpPass {
						t.Fatalf("verdict %d; want XDP_PASS", ret)
					}
					if ret, _ := h.run(h.objs.FluxvmNsIn, in); ret != tcOK {
						t.Fatalf("TC after XDP: verdict %d", int32(ret))
					}
					bytes += uint64(len(in))
				}
				ct, _ := h.ct(tuple{client, v.vip, v.proto})
				f, ok := h.flowRecord(ct.Flow)
				if !ok || f.FwdPackets != 2 || f.FwdBytes != bytes {
					t.Errorf("record %+v (present %v); want 2 packets, %d bytes: each passed packet counted once", f, ok, bytes)
				}
			})
		}
	}
}

// TestFlowRecordsFragments: a fragment to a VIP, dropped by the frontend
// stage, records the drop with its reason: a first fragment with its
// ports, a later one with ports 0.
func TestFlowRecordsFragments(t *testing.T) {
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v.setup(h)
			h.flowSampling(1)
			f := v.fwd(40000, pkt.SYN)
			var first, later []byte
			if v.vip.Addr().Is4() {
				first, later = pkt.SetIPv4Frag(f, 0, true), pkt.SetIPv4Frag(f, 1480, false)
			} else {
				first, later = pkt.IPv6Ext(f, pkt.Fragment(0, true)), pkt.IPv6Ext(f, pkt.Fragment(1448, false))
			}
			expectDrop(t, h, first, DropFragment)
			expectDrop(t, h, later, DropFragment)
			recs := h.flowRecords()
			fam := family(v.client)
			if len(recs) != 2 {
				t.Fatalf("%d records; want 2: %+v", len(recs), recs)
			}
			for i, want := range []struct{ cport, vport uint16 }{{40000, v.vip.Port()}, {0, 0}} {
				r := recs[i]
				if FlowVerdict(r.Verdict) != FlowDropped || DropReason(r.Reason) != DropFragment || r.Drops != 1 ||
					r.ServiceId != sid || Addr(r.Client, fam) != v.client || Addr(r.Vip, fam) != v.vip.Addr() ||
					Port(r.Cport) != want.cport || Port(r.Vport) != want.vport || FlowHook(r.Hook) != FlowHookFromVM {
					t.Errorf("fragment %d: record %+v; want dropped, fragment, ports %d -> %d", i, r, want.cport, want.vport)
				}
			}
		})
	}
}

// TestFlowRecordsFragmentService: on a VIP serving several ports, a first
// fragment (it carries its ports) is dropped under the service of its
// destination port, recorded and counted there; a later one (no ports)
// under the VIP's first frontend, the one its marker names.
func TestFlowRecordsFragmentService(t *testing.T) {
	const sid2 = sid + 1
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v.setup(h)
			// A second service on the VIP's next port; the marker
			// stays the first's.
			vip2 := netip.AddrPortFrom(v.vip.Addr(), v.vip.Port()+1)
			w := AddrWords(vip2.Addr())
			val := SvcValue{ServiceId: sid2, Revision: 1}
			if vip2.Addr().Is4() {
				h.must(h.fe.Put(SvcKey4{Vip: w[0], Port: Port(vip2.Port()), Proto: v.proto}, val))
			} else {
				h.must(h.objs.FluxvmSvc6.Put(SvcKey6{Vip: w, Port: Port(vip2.Port()), Proto: v.proto}, val))
			}
			h.guard(sid2, GuardOpen)
			h.flowSampling(1)
			f := v.frame(v.clientAt(40000), vip2, pkt.SYN)
			var first, later []byte
			if v.vip.Addr().Is4() {
				first, later = pkt.SetIPv4Frag(f, 0, true), pkt.SetIPv4Frag(f, 1480, false)
			} else {
				first, later = pkt.IPv6Ext(f, pkt.Fragment(0, true)), pkt.IPv6Ext(f, pkt.Fragment(1448, false))
			}
			d1, d2 := h.stats(sid).Drops, h.stats(sid2).Drops
			expectDropOn(t, h, h.objs.FluxvmFromVm, first, DropFragment)
			if got1, got2 := h.stats(sid).Drops-d1, h.stats(sid2).Drops-d2; got1 != 0 || got2 != 1 {
				t.Errorf("first fragment to the second port: drops +%d under the first service, +%d under the second; want 0 and 1", got1, got2)
			}
			expectDropOn(t, h, h.objs.FluxvmFromVm, later, DropFragment)
			if got1, got2 := h.stats(sid).Drops-d1, h.stats(sid2).Drops-d2; got1 != 1 || got2 != 1 {
				t.Errorf("later fragment: drops +%d under the first service, +%d under the second; want 1 and 0 more", got1, got2-1)
			}
			recs := h.flowRecords()
			if len(recs) != 2 {
				t.Fatalf("%d records; want 2: %+v", len(recs), recs)
			}
			for i, want := range []struct {
				sid   uint32
				vport uint16
			}{{sid2, vip2.Port()}, {sid, 0}} {
				if r := recs[i]; r.ServiceId != want.sid || Port(r.Vport) != want.vport || DropReason(r.Reason) != DropFragment ||
					FlowVerdict(r.Verdict) != FlowDropped {
					t.Errorf("fragment %d: record %+v; want service %d, port %d, dropped, fragment", i, r, want.sid, want.vport)
				}
			}
		})
	}
}

// TestFlowRecordsReplyRecreatesCT: a reply whose flow's conntrack entry
// was evicted recreates it from the reverse-NAT half, with the flow's
// record: the flow's next packets still count into it.
func TestFlowRecordsReplyRecreatesCT(t *testing.T) {
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v.nsSetup(h, 0)
			h.flowSampling(1)
			client := v.clientAt(40000)
			b := v.backends[0]
			syn := v.frame(client, v.vip, pkt.SYN)
			port := nsForward(t, h, v, client, pkt.SYN, b)
			ct, _ := h.ct(v.flow(40000))
			if ct.Flow == 0 {
				t.Fatal("no record")
			}
			// Evicted; the reply half due for its refresh.
			h.must(h.ctMap(v.flow(40000)).Delete(v.flow(40000).key()))
			nk := v.snatKey(b, port)
			nv, _ := h.nat(nk)
			nv.LastSeenNs = 0
			h.must(h.natMap(nk).Put(nk.key(), nv))
			reply := v.frame(b, netip.AddrPortFrom(v.snatAddr(), port), pkt.ACK)
			if ret, _ := h.run(h.objs.FluxvmNsIn, reply); ret != tcOK {
				t.Fatalf("reply: verdict %d", int32(ret))
			}
			nct, ok := h.ct(v.flow(40000))
			if !ok || nct.Flow != ct.Flow {
				t.Fatalf("recreated conntrack %+v (present %v); want the flow's record id %d", nct, ok, ct.Flow)
			}
			ack := v.frame(client, v.vip, pkt.ACK)
			if ret, _ := h.run(h.objs.FluxvmNsIn, ack); ret != tcOK {
				t.Fatalf("forward after the recreation: verdict %d", int32(ret))
			}
			f, present := h.flowRecord(ct.Flow)
			if !present || f.FwdPackets != 2 || f.FwdBytes != uint64(len(syn)+len(ack)) || f.RevPackets != 1 || f.RevBytes != uint64(len(reply)) {
				t.Errorf("record %+v (present %v); want 2 packets forwarded, 1 reply", f, present)
			}
			if n := len(recordsOf(h.flowRecords(), client)); n != 1 {
				t.Errorf("%d records of the flow; want 1", n)
			}
		})
	}
}

// TestFlowRecordsEDTTakeBack: a north-south reply an ingress hook
// translated (and counted into its flow's record) and the uplink's pacing
// then dropped at its horizon is taken back from the record, as from the
// service's reply counters.
func TestFlowRecordsEDTTakeBack(t *testing.T) {
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v.nsSetup(h, 0)
			h.svcFlags(sid, v.vip, v.proto, SvcFlagNorthSouth|SvcFlagNoEastWest|SvcFlagPaced)
			h.flowSampling(1)
			client := v.clientAt(40000)
			b := v.backends[0]
			port := nsForward(t, h, v, client, pkt.SYN, b)
			ct, _ := h.ct(v.flow(40000))
			reply := v.frame(b, netip.AddrPortFrom(v.snatAddr(), port), pkt.ACK)
			ret, out := h.run(h.objs.FluxvmNsIn, reply)
			if ret != tcOK {
				t.Fatalf("reply at ns_in: verdict %d", int32(ret))
			}
			if f, _ := h.flowRecord(ct.Flow); f.RevPackets != 1 || f.RevBytes != uint64(len(reply)) {
				t.Fatalf("record after ns_in %+v; want 1 reply counted", f)
			}
			// Backlogged past the horizon (5 s ahead of 1 s): the
			// reply leaving through ns_out is dropped.
			ev := h.edt(sid, MinEDTRate, time.Second)
			ev.LastDeparture = monoNow(t) + uint64(5*time.Second)
			h.must(h.objs.FluxvmEdt.Put(uint32(sid), ev))
			h.edt(0, MinEDTRate, time.Second) // the node's entry: pacing on
			st := h.stats(sid)
			if ret, _ := h.run(h.objs.FluxvmNsOut, out[:len(reply)]); ret != tcShot {
				t.Fatalf("reply at ns_out past the horizon: verdict %d; want a drop", int32(ret))
			}
			if got := h.stats(sid); got.ReplyPackets != st.ReplyPackets-1 {
				t.Errorf("service reply packets %d; want %d (taken back)", got.ReplyPackets, st.ReplyPackets-1)
			}
			if f, _ := h.flowRecord(ct.Flow); f.RevPackets != 0 || f.RevBytes != 0 {
				t.Errorf("record after the drop %+v; want the reply taken back (0 replies)", f)
			}
		})
	}
}

// TestFlowRecordsTimes: a record's times are the path's clock: first_ns is
// that of the packet that opened it (its conntrack entry's created_ns),
// and last_ns is never before it, also when the coarse clock ticks between
// the path's read and the record's write (which a run cannot force: many
// flows make it likely to be seen if it happens).
func TestFlowRecordsTimes(t *testing.T) {
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(v.name, func(t *testing.T) {
			h := newHarness(t)
			h.reset()
			v.setup(h)
			h.flowSampling(1)
			for i := range 300 {
				port := uint16(41000 + i)
				if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(port, pkt.SYN)); ret != tcOK {
					t.Fatalf("SYN: verdict %d", int32(ret))
				}
				ct, _ := h.ct(v.flow(port))
				f, ok := h.flowRecord(ct.Flow)
				if !ok || f.FirstNs != ct.CreatedNs || f.LastNs < f.FirstNs || f.FwdPackets != 1 {
					t.Fatalf("flow %d: record %+v (present %v), conntrack created %d; want first_ns the path's clock, last_ns not before it",
						i, f, ok, ct.CreatedNs)
				}
			}
		})
	}
}
