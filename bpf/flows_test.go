package bpf

import (
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
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
// new drop records take a per-CPU budget (a flood of them cannot take the
// ring), and past it they are counted, not recorded.
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
	// are counted as limited.
	before := h.flowSeq()
	start := time.Now()
	for i := range 200 {
		h.run(h.objs.FluxvmFromVm, v.fwd(uint16(41000+i), pkt.SYN))
	}
	// Per CPU the loop ran on: the burst, plus what the refill added
	// while it ran (one record per 1/64 s), plus one for rounding.
	allowed := uint64(64+time.Since(start).Seconds()*64+1) * uint64(runtime.NumCPU())
	opened := h.flowSeq() - before
	limited := h.counters()[CounterFlowDropLimited]
	if opened > allowed || opened < 32 || limited == 0 || opened+limited != 200 {
		t.Errorf("200 drops: %d records opened, %d limited; want at most the budget (%d with the refill) opened and the rest limited", opened, limited, allowed)
	}

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
