package bpf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// haRecords drains the records queued in fluxvm_haq.
func (h *harness) haRecords() []HARecord {
	h.t.Helper()
	rd, err := ringbuf.NewReader(h.objs.FluxvmHaq)
	if err != nil {
		h.t.Fatal(err)
	}
	defer rd.Close()
	var out []HARecord
	for {
		rd.SetDeadline(time.Now().Add(10 * time.Millisecond))
		rec, err := rd.Read()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return out
		}
		if err != nil {
			h.t.Fatal(err)
		}
		var r HARecord
		if err := binary.Read(bytes.NewReader(rec.RawSample), binary.LittleEndian, &r); err != nil {
			h.t.Fatal(err)
		}
		out = append(out, r)
	}
}

func (h *harness) haDrops() uint64 {
	h.t.Helper()
	var per []uint64
	h.must(h.objs.FluxvmHadrop.Lookup(uint32(0), &per))
	var n uint64
	for _, v := range per {
		n += v
	}
	return n
}

func (h *harness) haOn(on bool) {
	h.t.Helper()
	var m Meta
	h.must(h.objs.FluxvmMeta.Lookup(uint32(0), &m))
	m.Flags &^= MetaFlagHA
	if on {
		m.Flags |= MetaFlagHA
	}
	h.meta(m)
}

// TestHAQueue: while HA replication is on, every conntrack entry a
// forward path writes (east-west NAT, north-south SNAT, DSR; both
// families) queues one record: the flow, its backend by address, the
// entry exactly as written. A hit that changes nothing queues nothing; with HA off
// nothing is queued; a full queue counts what it could not take.
func TestHAQueue(t *testing.T) {
	h := newHarness(t)
	for _, mode := range policyModes() {
		for _, v := range []variant{variants()[0], variants()[1], variants()[2], variants()[3]} {
			t.Run(mode.name+"/"+v.name, func(t *testing.T) {
				h.reset()
				mode.setup(h, v)
				prog := mode.prog(h)
				flags := mode.setupFlags(v)
				h.svcFlags(sid, v.vip, v.proto, flags)
				h.haRecords() // empty the ring of earlier subtests

				h.haOn(false)
				h.run(prog, v.fwd(42000, pkt.SYN))
				if r := h.haRecords(); len(r) != 0 {
					t.Fatalf("HA off: %d records", len(r))
				}
				h.haOn(true)
				c0 := h.counters()[CounterHAEmitted]
				h.run(prog, v.fwd(42001, pkt.SYN))
				ct, ok := h.ct(v.flow(42001)) // as written
				if !ok {
					t.Fatal("no conntrack entry")
				}
				// A conntrack hit that changes nothing (a retransmitted
				// SYN; a UDP datagram within the refresh throttle):
				// nothing. Transitions and refreshes: TestHAHits.
				h.run(prog, v.fwd(42001, pkt.SYN))
				recs := h.haRecords()
				if len(recs) != 1 {
					t.Fatalf("%d records for one new flow and a hit, want 1", len(recs))
				}
				r := recs[0]
				fam := uint8(FamilyIPv4)
				if v.client.Is6() {
					fam = FamilyIPv6
				}
				be := v.backends[ct.BackendId-1]
				if r.Op != HAUpsert || r.Family != fam || r.Proto != v.proto ||
					Addr(r.Client, fam) != v.client || Port(r.Cport) != 42001 ||
					Addr(r.Vip, fam) != v.vip.Addr() || Port(r.Vport) != v.vip.Port() ||
					Addr(r.Backend, fam) != be.Addr() || Port(r.Bport) != be.Port() {
					t.Errorf("record %+v: want flow %v -> %v on %v", r, v.clientAt(42001), v.vip, be)
				}
				if r.Ct != ct {
					t.Errorf("record's entry %+v\nthe map's %+v", r.Ct, ct)
				}
				if n := h.counters()[CounterHAEmitted] - c0; n != 1 {
					t.Errorf("ha_emitted +%d, want 1", n)
				}
				h.haOn(false)
			})
		}
	}
}

// setupFlags are the frontend flags of the mode's service (policyModes
// set them with the policy flag; the HA test wants none of it).
func (m policyMode) setupFlags(v variant) uint32 {
	switch m.name {
	case "north-south snat":
		return SvcFlagNorthSouth | SvcFlagNoEastWest
	case "dsr":
		return SvcFlagNorthSouth | SvcFlagNoEastWest | SvcFlagDSR
	}
	return 0
}

// TestHAQueueFull: with no reader, the queue fills; the records it had no
// room for are counted in fluxvm_hadrop, and the flows are learned all
// the same.
func TestHAQueueFull(t *testing.T) {
	h := newHarness(t)
	v := variants()[0]
	v.setup(h)
	h.haRecords()
	h.haOn(true)
	defer h.haOn(false)
	room := int(h.objs.FluxvmHaq.MaxEntries()) / (128 + 8) // a record and its header
	n := room + 50
	d0 := h.haDrops()
	for i := 0; i < n; i++ {
		if ret, _ := h.run(h.objs.FluxvmFromVm, v.fwd(uint16(1024+i), pkt.SYN)); ret != tcOK {
			t.Fatalf("flow %d: verdict %d", i, int32(ret))
		}
	}
	drops := h.haDrops() - d0
	recs := h.haRecords()
	if uint64(len(recs))+drops != uint64(n) || drops < 50 {
		t.Errorf("%d flows: %d records queued, %d dropped; want every flow in one or the other, at least 50 dropped", n, len(recs), drops)
	}
	if _, ok := h.ct(v.flow(uint16(1024 + n - 1))); !ok {
		t.Error("the last flow was not learned")
	}
}

// TestHAXDPPassesNewFlows: while HA replication is on, XDP leaves a new
// flow to TC (which queues its record), counted, and still serves the
// established flows TC learned.
func TestHAXDPPassesNewFlows(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	objs := newXDPObjects(t, h, l.out)
	v := variants()[0]
	v.nsSetup(h, 0)
	h.haOn(true)
	defer h.haOn(false)
	in := v.frame(v.clientAt(snatMin), v.vip, pkt.SYN)
	c0 := h.counters()[CounterXDPPassHA]
	if ret, out := h.runXDP(objs.FluxvmXdpNs, in, l.in); ret != xdpPass || !bytes.Equal(out[:len(in)], in) {
		t.Fatalf("a new flow under HA: verdict %d; want XDP_PASS untouched", ret)
	}
	if n := h.counters()[CounterXDPPassHA] - c0; n != 1 {
		t.Errorf("xdp_pass_ha +%d, want 1", n)
	}
	// TC learns it (and queues it); XDP serves its next packets.
	h.haRecords()
	if ret, _ := h.runOn(h.objs.FluxvmNsIn, in, l.in); ret != tcOK {
		t.Fatalf("TC: verdict %d", int32(ret))
	}
	if r := h.haRecords(); len(r) != 1 {
		t.Errorf("TC queued %d records, want 1", len(r))
	}
	// The handshake's ACK is a transition: TC's too (TestHAXDPHits).
	ack := v.frame(v.clientAt(snatMin), v.vip, pkt.ACK)
	if ret, _ := h.runXDP(objs.FluxvmXdpNs, ack, l.in); ret != xdpPass {
		t.Fatalf("the handshake's ACK under HA: verdict %d; want XDP_PASS", ret)
	}
	if ret, _ := h.runOn(h.objs.FluxvmNsIn, ack, l.in); ret != tcOK {
		t.Fatalf("TC: verdict %d", int32(ret))
	}
	if ret, _ := h.runXDP(objs.FluxvmXdpNs, ack, l.in); ret != xdpRedirect {
		t.Errorf("an established flow under HA: verdict %d; want XDP_REDIRECT", ret)
	}
}

// BenchmarkHA: the cost of HA replication: the same east-west IPv4 new
// flow with the queue off and on (one record reserved, filled and
// submitted into fluxvm_haq), in alternate blocks (measureInterleaved),
// the ring drained before each block so that every record finds room
// (blocks are kept under the ring's capacity); ha-minus-none-ns is the
// net cost. Then the established conntrack hit and its reply with HA off
// and on (ct-hit-ha-minus-none-ns, reply-ha-minus-none-ns): between
// refreshes a hit queues nothing, and it pays at most one call a second
// to learn that a refresh is not due.
func BenchmarkHA(b *testing.B) {
	h := newHarnessSized(b, 0)
	v := variants()[0]
	v.setup(h)
	h.edge()
	room := int(h.objs.FluxvmHaq.MaxEntries()) / (128 + 8)
	calls := min(benchCalls(b), 20*room*9/10)
	newFlow := func(off int) func(i int) []byte {
		return func(i int) []byte {
			i += off
			f := v.fwd(uint16(1024+i%60000), pkt.SYN)
			binary.BigEndian.PutUint16(f[14+12+2:], uint16(i/60000+2))
			return f
		}
	}
	on := func(ha bool) func() {
		return func() {
			h.haOn(ha)
			h.haRecords()
		}
	}
	// An established flow for the hits (HA off: no record).
	for _, f := range [][]byte{v.fwd(40000, pkt.SYN), v.fwd(40000, pkt.ACK)} {
		if ret, _ := h.run(h.objs.FluxvmFromVm, f); ret != tcOK {
			b.Fatal("flow not set up")
		}
	}
	hit := func(int) []byte { return v.fwd(40000, pkt.ACK) }
	reply := func(int) []byte { return v.reply(v.backends[0], 40000, pkt.ACK) }
	cases := []*benchCase{
		{name: "ipv4 tcp new flow, HA off", metric: "v4-new-flow", prog: h.objs.FluxvmFromVm, frame: newFlow(0), want: tcOK, before: on(false)},
		{name: "ipv4 tcp new flow, HA on", metric: "v4-new-flow-ha", prog: h.objs.FluxvmFromVm, frame: newFlow(1 << 20), want: tcOK, before: on(true)},
		{name: "ipv4 tcp conntrack hit, HA off", metric: "v4-ct-hit", prog: h.objs.FluxvmFromVm, frame: hit, want: tcOK, before: on(false)},
		{name: "ipv4 tcp conntrack hit, HA on", metric: "v4-ct-hit-ha", prog: h.objs.FluxvmFromVm, frame: hit, want: tcOK, before: on(true)},
		{name: "ipv4 tcp reply, HA off", metric: "v4-reply", prog: h.objs.FluxvmToVm, frame: reply, want: tcOK, before: on(false)},
		{name: "ipv4 tcp reply, HA on", metric: "v4-reply-ha", prog: h.objs.FluxvmToVm, frame: reply, want: tcOK, before: on(true)},
	}
	d0 := h.haDrops()
	measureInterleaved(b, h.th, calls, cases, true)
	h.haOn(false)
	if d := h.haDrops() - d0; d != 0 {
		b.Fatalf("%d records found the ring full: the benchmark did not measure emitting alone", d)
	}
	net := func(i int) float64 {
		return float64(cases[i+1].sum)/float64(cases[i+1].n) - float64(cases[i].sum)/float64(cases[i].n)
	}
	b.ReportMetric(net(0), "ha-minus-none-ns")
	b.ReportMetric(net(2), "ct-hit-ha-minus-none-ns")
	b.ReportMetric(net(4), "reply-ha-minus-none-ns")
}

// BenchmarkHAXDP: XDP's established conntrack hits (SNAT and DSR, IPv4)
// with HA off and on, in alternate blocks: under HA a hit between
// refreshes stays in XDP, at the cost of the check that it may
// (fluxvm_ha_xdp_hit); *-ha-minus-none-ns are the net costs.
func BenchmarkHAXDP(b *testing.B) {
	calls := benchCalls(b)
	h, all := xdpBenchCases(b, calls)
	byMetric := map[string]*benchCase{}
	for _, c := range all {
		byMetric[c.metric] = c
	}
	// The flows of the hits (xdpBenchCases). XDP learned them with HA
	// off: their standby holds nothing yet, and the first hit under HA
	// would be TC's (a refresh due). TC's record is emulated: each HA-on
	// block starts with the flows' ha_until as TC's refresh leaves it.
	v4 := variants()[0]
	flows := []tuple{v4.flow(40000), {v4.clientAt(40000), netip.MustParseAddrPort("10.96.0.11:80"), v4.proto}}
	on := func(ha bool) func() {
		return func() {
			h.haOn(ha)
			if !ha {
				return
			}
			for _, tp := range flows {
				ct, ok := h.ct(tp)
				if !ok {
					b.Fatalf("%v: no entry", tp)
				}
				ct.L7Ifindex = uint32(ct.DeadlineNs/uint64(time.Second)) + h.haTimeout(CTState(ct.State))/2
				h.must(h.ctMap(tp).Put(tp.key(), ct))
			}
		}
	}
	var cases []*benchCase
	for _, m := range []string{"xdp-v4-ct-hit", "xdp-v4-dsr-hit"} {
		c, ok := byMetric[m]
		if !ok {
			b.Fatalf("no XDP case %s", m)
		}
		// Established first (the set-up SYN left the entries in their
		// handshake, which XDP leaves to TC under HA).
		f := c.frame(0)
		var ret uint32
		var err error
		h.th.Do(func() { ret, _, err = progTestRun(c.prog, f, c.ctx) })
		if err != nil || ret != xdpRedirect {
			b.Fatalf("%s: not established: verdict %d, %v", m, ret, err)
		}
		offC, onC := *c, *c
		offC.name, offC.before = c.name+", HA off", on(false)
		onC.name, onC.metric, onC.before = c.name+", HA on", c.metric+"-ha", on(true)
		cases = append(cases, &offC, &onC)
	}
	c0 := h.counters()[CounterXDPPassHA]
	measureInterleavedOn(b, h.th, calls, cases, true, ebpf.XDP)
	h.haOn(false)
	if n := h.counters()[CounterXDPPassHA] - c0; n > 4 {
		b.Logf("xdp_pass_ha +%d during the run", n)
	}
	for i := 0; i < len(cases); i += 2 {
		d := float64(cases[i+1].sum)/float64(cases[i+1].n) - float64(cases[i].sum)/float64(cases[i].n)
		b.ReportMetric(d, cases[i].metric+"-ha-minus-none-ns")
	}
}

// haTimeout is the timeout of conntrack state s in seconds, as the
// datapath takes it (fluxvm_timeout_s): the meta's, or the default.
func (h *harness) haTimeout(s CTState) uint32 {
	h.t.Helper()
	var m Meta
	h.must(h.objs.FluxvmMeta.Lookup(uint32(0), &m))
	pick := func(v, def uint32) uint32 {
		if v != 0 {
			return v
		}
		return def
	}
	switch s {
	case CTTCPSyn:
		return pick(m.TimeoutTcpSynS, DefaultTimeoutTCPSyn)
	case CTTCPEstablished:
		return pick(m.TimeoutTcpEstablishedS, DefaultTimeoutTCPEstablished)
	case CTTCPFin:
		return pick(m.TimeoutTcpFinS, DefaultTimeoutTCPFin)
	case CTTCPRst:
		return pick(m.TimeoutTcpRstS, DefaultTimeoutTCPRst)
	}
	return pick(m.TimeoutUdpS, DefaultTimeoutUDP)
}

// haAge moves flow tp's conntrack entry d into the past, as if its last
// write (and the record that set its ha_until) were d ago: created,
// last-seen and deadline back by d, ha_until (L7Ifindex of a non-L7
// entry) back by d in seconds.
func (h *harness) haAge(tp tuple, d time.Duration) {
	h.t.Helper()
	ct, ok := h.ct(tp)
	if !ok {
		h.t.Fatalf("%v: no conntrack entry to age", tp)
	}
	ns := uint64(d)
	ct.CreatedNs -= ns
	ct.LastSeenNs -= ns
	ct.DeadlineNs -= ns
	if ct.L7Ifindex != 0 {
		ct.L7Ifindex -= uint32(d / time.Second)
	}
	h.must(h.ctMap(tp).Put(tp.key(), ct))
}

// haCheck requires records to be exactly one record of cause and state
// for flow tp, carrying the map's entry as it is now and the hold of its
// state, and the entry's ha_until to be what the record gives the standby.
func (h *harness) haCheck(t *testing.T, recs []HARecord, tp tuple, cause uint8, state CTState) {
	t.Helper()
	if len(recs) != 1 {
		t.Fatalf("%d records, want 1 (cause %d, state %d): %+v", len(recs), cause, state, recs)
	}
	r := recs[0]
	ct, ok := h.ct(tp)
	if !ok {
		t.Fatal("no conntrack entry")
	}
	hold := h.haTimeout(state) / 2
	if r.Op != HAUpsert || r.Cause != cause || CTState(r.Ct.State) != state || r.HoldS != hold {
		t.Errorf("record op %d cause %d state %d hold %d s; want op %d cause %d state %d hold %d s",
			r.Op, r.Cause, r.Ct.State, r.HoldS, HAUpsert, cause, state, hold)
	}
	if r.Ct != ct {
		t.Errorf("record's entry %+v\nthe map's %+v", r.Ct, ct)
	}
	if want := uint32(ct.DeadlineNs/uint64(time.Second)) + hold; ct.L7Ifindex != want {
		t.Errorf("ha_until %d, want deadline %d s + hold %d s = %d", ct.L7Ifindex, ct.DeadlineNs/uint64(time.Second), hold, want)
	}
	if now := monoNow(t); r.Ct.DeadlineNs < now+uint64(h.haTimeout(state)-2)*uint64(time.Second) {
		t.Errorf("record's deadline %d is not the state's timeout (%d s) from now %d", r.Ct.DeadlineNs, h.haTimeout(state), now)
	}
}

// haModes are the forward paths of the HA tests: their service setup and
// the TC program that takes the client's packets.
func haModes() []struct {
	name  string
	setup func(h *harness, v variant)
	prog  func(h *harness) *ebpf.Program
} {
	return []struct {
		name  string
		setup func(h *harness, v variant)
		prog  func(h *harness) *ebpf.Program
	}{
		{"east-west nat", func(h *harness, v variant) { v.setup(h) }, func(h *harness) *ebpf.Program { return h.objs.FluxvmFromVm }},
		{"east-west nat stored", func(h *harness, v variant) { v.setup(h); h.revStored(sid) }, func(h *harness) *ebpf.Program { return h.objs.FluxvmFromVm }},
		{"north-south snat", func(h *harness, v variant) { v.nsSetup(h, 0) }, func(h *harness) *ebpf.Program { return h.objs.FluxvmNsIn }},
		{"dsr", func(h *harness, v variant) { v.nsSetup(h, SvcFlagDSR) }, func(h *harness) *ebpf.Program { return h.objs.FluxvmNsIn }},
	}
}

// TestHAHits: under HA, conntrack hits of TC's forward paths (east-west
// NAT with derived and stored replies, north-south SNAT, DSR; both
// families) queue a TCP flow's state transitions, SYN -> ESTABLISHED ->
// FIN, each with its new state and deadline; established hits queue
// nothing until a refresh is due (the entry's deadline would pass the one
// the standby holds: deadline + half the state's timeout at the last
// record), and then exactly one; the same for UDP, which has no
// transitions. With HA off, no hit queues anything.
func TestHAHits(t *testing.T) {
	h := newHarness(t)
	type step struct {
		what  string
		flags pkt.TCPFlags
		age   time.Duration // the entry is moved this far into the past first
		cause uint8         // 0: no record
		state CTState       // the entry's state after the packet
	}
	// A refresh is due half the state's timeout after the last record, and
	// the datapath refreshes an entry at most once a second.
	due := func(s CTState) time.Duration { return time.Duration(h.haTimeout(s)/2+2) * time.Second }
	// After a refresh 2 s ago: 2 s short of due.
	notYet := func(s CTState) time.Duration { return time.Duration(h.haTimeout(s)/2-4) * time.Second }
	tcp := []step{
		{"syn", pkt.SYN, 0, HANew, CTTCPSyn},
		{"syn retransmitted", pkt.SYN, 0, 0, CTTCPSyn},
		{"ack: established", pkt.ACK, 0, HATransition, CTTCPEstablished},
		{"ack within the refresh throttle", pkt.ACK, 0, 0, CTTCPEstablished},
		{"ack refreshing, not due", pkt.ACK, 2 * time.Second, 0, CTTCPEstablished},
		// Ages add up: the last record was half the timeout less 2 s ago,
		// then half the timeout plus 2 s ago.
		{"ack refreshing, not due, later", pkt.ACK, notYet(CTTCPEstablished), 0, CTTCPEstablished},
		{"ack, refresh due", pkt.ACK, 4 * time.Second, HARefresh, CTTCPEstablished},
		{"ack after the refresh", pkt.ACK, 2 * time.Second, 0, CTTCPEstablished},
		{"fin", pkt.FIN, 0, HATransition, CTTCPFin},
		{"ack after fin", pkt.ACK, 0, 0, CTTCPFin},
		{"rst", pkt.RST, 0, HATransition, CTTCPRst},
	}
	udp := []step{
		{"first datagram", pkt.ACK, 0, HANew, CTUDP},
		{"within the throttle", pkt.ACK, 0, 0, CTUDP},
		{"refreshing, not due", pkt.ACK, 2 * time.Second, 0, CTUDP},
		{"refreshing, not due, later", pkt.ACK, notYet(CTUDP), 0, CTUDP},
		{"refresh due", pkt.ACK, 4 * time.Second, HARefresh, CTUDP},
		{"after the refresh", pkt.ACK, 2 * time.Second, 0, CTUDP},
		{"due again", pkt.ACK, due(CTUDP), HARefresh, CTUDP},
	}
	for _, mode := range haModes() {
		for _, v := range variants() {
			t.Run(mode.name+"/"+v.name, func(t *testing.T) {
				h.reset()
				mode.setup(h, v)
				prog := mode.prog(h)
				steps := tcp
				if v.proto == ipUDP {
					steps = udp
				}
				for _, ha := range []bool{true, false} {
					port := uint16(42100)
					if !ha {
						port++
					}
					h.haOn(ha)
					h.haRecords()
					c0 := h.counters()[CounterHAEmitted]
					want := 0
					for _, s := range steps {
						if s.age != 0 {
							h.haAge(v.flow(port), s.age)
						}
						lastSeen := uint64(0)
						if ct, ok := h.ct(v.flow(port)); ok {
							lastSeen = ct.LastSeenNs
						}
						h.run(prog, v.fwd(port, s.flags))
						ct, ok := h.ct(v.flow(port))
						if !ok || CTState(ct.State) != s.state {
							t.Fatalf("HA %v, %s: entry %+v (present %v), want state %d", ha, s.what, ct, ok, s.state)
						}
						if s.age != 0 && ct.LastSeenNs == lastSeen {
							t.Fatalf("HA %v, %s: the hit did not refresh the entry", ha, s.what)
						}
						recs := h.haRecords()
						if !ha || s.cause == 0 {
							if len(recs) != 0 {
								t.Fatalf("HA %v, %s: %d records, want none: %+v", ha, s.what, len(recs), recs)
							}
							continue
						}
						want++
						h.haCheck(t, recs, v.flow(port), s.cause, s.state)
						if t.Failed() {
							t.Fatalf("HA %v, %s", ha, s.what)
						}
					}
					if n := h.counters()[CounterHAEmitted] - c0; n != uint64(want) {
						t.Errorf("HA %v: ha_emitted +%d, want %d", ha, n, want)
					}
				}
				h.haOn(false)
			})
		}
	}
}

// TestHAReplyHits: replies touch their flow's one conntrack entry: the
// backend's FIN is a transition, and a server-push stream whose client is
// silent keeps its standby copy alive by the replies' due refreshes
// (east-west, derived and stored reverse halves; TCP and UDP).
func TestHAReplyHits(t *testing.T) {
	h := newHarness(t)
	for _, mode := range haModes()[:2] {
		for _, v := range variants() {
			t.Run(mode.name+"/"+v.name, func(t *testing.T) {
				h.reset()
				mode.setup(h, v)
				const port = 42200
				h.haOn(true)
				defer h.haOn(false)
				first := pkt.SYN
				if v.proto == ipUDP {
					first = pkt.ACK
				}
				h.run(h.objs.FluxvmFromVm, v.fwd(port, first))
				h.run(h.objs.FluxvmFromVm, v.fwd(port, pkt.ACK))
				h.haRecords()
				state := CTUDP
				if v.proto == ipTCP {
					state = CTTCPEstablished
				}
				be := v.backends[0]
				reply := func(f pkt.TCPFlags) {
					t.Helper()
					if ret, _ := h.run(h.objs.FluxvmToVm, v.reply(be, port, f)); ret != tcOK {
						t.Fatalf("reply: verdict %d", int32(ret))
					}
				}
				// The stored reverse half has its own refresh throttle:
				// aged with the entry.
				age := func(d time.Duration) {
					t.Helper()
					h.haAge(v.flow(port), d)
					if n, ok := h.nat(v.natKey(be, port)); ok {
						n.LastSeenNs -= uint64(d)
						h.must(h.natMap(v.natKey(be, port)).Put(v.natKey(be, port).key(), n))
					}
				}
				reply(pkt.ACK)
				if r := h.haRecords(); len(r) != 0 {
					t.Fatalf("a fresh reply: %d records, want none", len(r))
				}
				age(2 * time.Second)
				reply(pkt.ACK)
				if r := h.haRecords(); len(r) != 0 {
					t.Fatalf("a reply refreshing, not due: %d records, want none", len(r))
				}
				age(time.Duration(h.haTimeout(state)/2+2) * time.Second)
				reply(pkt.ACK)
				h.haCheck(t, h.haRecords(), v.flow(port), HARefresh, state)
				if v.proto == ipTCP {
					reply(pkt.FIN)
					h.haCheck(t, h.haRecords(), v.flow(port), HATransition, CTTCPFin)
				}
			})
		}
	}
}

// TestHAXDPHits: under HA, XDP leaves to TC exactly the conntrack hits
// that would queue a record (a TCP SYN, FIN or RST; a TCP entry not
// ESTABLISHED; a refresh due), counted in xdp_pass_ha and untouched, and
// TC queues them; established hits between refreshes stay in XDP. With
// HA off, XDP serves every hit and nothing is queued or counted.
func TestHAXDPHits(t *testing.T) {
	h := newHarness(t)
	l := newFIBLab(t, h)
	objs := newXDPObjects(t, h, l.out)
	type step struct {
		what  string
		flags pkt.TCPFlags
		age   time.Duration
		pass  bool // under HA: passed to TC (which then runs it)
		cause uint8
	}
	due := func(s CTState) time.Duration { return time.Duration(h.haTimeout(s)/2+2) * time.Second }
	tcp := []step{
		{"syn: new", pkt.SYN, 0, true, HANew},
		{"ack on a syn entry", pkt.ACK, 0, true, HATransition},
		{"established", pkt.ACK, 0, false, 0},
		{"established, refreshing, not due", pkt.ACK, 2 * time.Second, false, 0},
		{"established, refresh due", pkt.ACK, due(CTTCPEstablished), true, HARefresh},
		{"established after the refresh", pkt.ACK, 2 * time.Second, false, 0},
		{"fin", pkt.FIN, 0, true, HATransition},
		{"ack on a fin entry", pkt.ACK, 0, true, 0},
	}
	udp := []step{
		{"new", pkt.ACK, 0, true, HANew},
		{"hit", pkt.ACK, 0, false, 0},
		{"refreshing, not due", pkt.ACK, 2 * time.Second, false, 0},
		{"refresh due", pkt.ACK, due(CTUDP), true, HARefresh},
		{"after the refresh", pkt.ACK, 2 * time.Second, false, 0},
	}
	for _, v := range variants() {
		for _, dsr := range []bool{false, true} {
			name := v.name + "/snat"
			if dsr {
				name = v.name + "/dsr"
			}
			t.Run(name, func(t *testing.T) {
				h.reset()
				if dsr {
					v.nsSetup(h, SvcFlagDSR)
				} else {
					v.nsSetup(h, 0)
				}
				steps := tcp
				if v.proto == ipUDP {
					steps = udp
				}
				for _, ha := range []bool{true, false} {
					client := v.clientAt(snatMin)
					if !ha {
						client = v.clientAt(snatMin + 1)
					}
					flow := tuple{client, v.vip, v.proto}
					h.haOn(ha)
					h.haRecords()
					for _, s := range steps {
						if s.age != 0 {
							h.haAge(flow, s.age)
						}
						in := v.frame(client, v.vip, s.flags)
						c0 := h.counters()[CounterXDPPassHA]
						ret, out := h.runXDP(objs.FluxvmXdpNs, in, l.in)
						passed := ret == xdpPass && bytes.Equal(out[:len(in)], in)
						if n := h.counters()[CounterXDPPassHA] - c0; n != map[bool]uint64{true: 1}[ha && s.pass] {
							t.Errorf("HA %v, %s: xdp_pass_ha +%d", ha, s.what, n)
						}
						if ha && s.pass {
							if !passed {
								t.Fatalf("HA on, %s: verdict %d, want XDP_PASS untouched", s.what, ret)
							}
							h.runOn(h.objs.FluxvmNsIn, in, l.in)
						} else if ret != xdpRedirect {
							t.Fatalf("HA %v, %s: verdict %d, want XDP_REDIRECT", ha, s.what, ret)
						}
						recs := h.haRecords()
						if !ha || s.cause == 0 {
							if len(recs) != 0 {
								t.Fatalf("HA %v, %s: %d records, want none", ha, s.what, len(recs))
							}
							continue
						}
						if len(recs) != 1 || recs[0].Cause != s.cause {
							t.Fatalf("HA on, %s: records %+v, want one of cause %d", s.what, recs, s.cause)
						}
					}
				}
				h.haOn(false)
			})
		}
	}
}
