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
// north-south forward path writes (SNAT, DSR; both families) queues one
// record: the flow, its backend by address, the entry exactly as
// written. An east-west entry (NAT) queues nothing, takes no room in the
// ring and keeps ha_until 0: a standby edge cannot use the node's own
// VMs' flows. A hit that changes nothing queues nothing; with HA off
// nothing is queued; a full queue counts what it could not take
// (TestHAQueueFull).
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
				c0, d0 := h.counters()[CounterHAEmitted], h.haDrops()
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
				if ew := mode.name == "east-west nat"; ew == haNorthSouth(ct) {
					t.Fatalf("%s: entry of flags %#x", mode.name, ct.Flags)
				}
				if !haNorthSouth(ct) {
					// East-west: nothing queued, nothing dropped, no
					// bookkeeping.
					if len(recs) != 0 {
						t.Fatalf("east-west: %d records, want none: %+v", len(recs), recs)
					}
					if n := h.counters()[CounterHAEmitted] - c0; n != 0 {
						t.Errorf("east-west: ha_emitted +%d, want 0", n)
					}
					if d := h.haDrops() - d0; d != 0 {
						t.Errorf("east-west: fluxvm_hadrop +%d, want 0", d)
					}
					if ct.L7Ifindex != 0 {
						t.Errorf("east-west: ha_until %d, want 0", ct.L7Ifindex)
					}
					h.haOn(false)
					return
				}
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
				if want := uint32(ct.DeadlineNs/uint64(time.Second)) + h.haTimeout(CTState(ct.State))/2; ct.L7Ifindex != want {
					t.Errorf("ha_until %d, want %d", ct.L7Ifindex, want)
				}
				h.haOn(false)
			})
		}
	}
}

// haNorthSouth: is ct of a kind HA replicates (SNAT, DSR)?
func haNorthSouth(ct CTValue) bool { return ct.Flags&(CTFlagSNAT|CTFlagDSR) != 0 }

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

// TestHAQueueFull: with no reader, the queue fills with north-south
// (SNAT) flows; the records it had no room for are counted in
// fluxvm_hadrop, and the flows are learned all the same. East-west flows
// opened meanwhile take none of its room.
func TestHAQueueFull(t *testing.T) {
	h := newHarness(t)
	v := variants()[0]
	v.nsSetup(h, 0)
	// A port for every client, its own (in the range: kept).
	h.snat(1024, 65535)
	// An east-west frontend beside it, the same backends.
	ew := v
	ew.vip = netip.MustParseAddrPort("10.96.0.11:80")
	ew.setupAt(h, sid+1, 10)
	h.haRecords()
	h.haOn(true)
	defer h.haOn(false)
	room := int(h.objs.FluxvmHaq.MaxEntries()) / (128 + 8) // a record and its header
	n := room + 50
	d0, e0 := h.haDrops(), h.counters()[CounterHAEmitted]
	for i := 0; i < n; i++ {
		if ret, _ := h.run(h.objs.FluxvmNsIn, v.fwd(uint16(1024+i), pkt.SYN)); ret != tcOK {
			t.Fatalf("flow %d: verdict %d", i, int32(ret))
		}
		// Half as many east-west flows: if they were queued, they would
		// fill the ring and take the north-south flows' room.
		if i%2 == 0 {
			if ret, _ := h.run(h.objs.FluxvmFromVm, ew.fwd(uint16(1024+i), pkt.SYN)); ret != tcOK {
				t.Fatalf("east-west flow %d: verdict %d", i, int32(ret))
			}
		}
	}
	drops := h.haDrops() - d0
	recs := h.haRecords()
	if uint64(len(recs))+drops != uint64(n) || drops < 50 || drops > 60 {
		t.Errorf("%d flows: %d records queued, %d dropped; want every flow in one or the other, 50 to 60 dropped", n, len(recs), drops)
	}
	if e := h.counters()[CounterHAEmitted] - e0; e != uint64(len(recs)) {
		t.Errorf("ha_emitted +%d, want %d (the records queued)", e, len(recs))
	}
	for _, r := range recs {
		if r.Ct.Flags&CTFlagSNAT == 0 || Addr(r.Vip, FamilyIPv4) != v.vip.Addr() {
			t.Fatalf("record %+v: want the north-south flows' alone", r)
		}
	}
	if _, ok := h.ct(v.flow(uint16(1024 + n - 1))); !ok {
		t.Error("the last flow was not learned")
	}
	if ct, ok := h.ct(ew.flow(uint16(1024 + (n-1)/2*2))); !ok || ct.L7Ifindex != 0 {
		t.Errorf("the last east-west flow: %+v (present %v), want learned with ha_until 0", ct, ok)
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

// BenchmarkHA: the cost of HA replication: the same north-south (SNAT)
// IPv4 new flow on the north-south ingress with the queue off and on (one
// record reserved, filled and submitted into fluxvm_haq), in alternate
// blocks (measureInterleaved), the ring drained before each block so that
// every record finds room (blocks are kept under the ring's capacity);
// ha-minus-none-ns is the net cost. Then the established conntrack hit
// and its reply with HA off and on (ct-hit-ha-minus-none-ns,
// reply-ha-minus-none-ns): between refreshes a hit queues nothing, and it
// pays at most one call a second to learn that a refresh is not due.
// (East-west flows are not replicated: their paths queue nothing.) Every
// new flow keeps its client's port as its SNAT port, each a port of its
// own: the flows of both blocks fit in the port range, so that no port
// search is measured.
func BenchmarkHA(b *testing.B) {
	h := newHarnessSized(b, 0)
	v := variants()[0]
	v.nsSetup(h, 0)
	const portMin, hitPort = 1024, 65000
	h.snat(portMin, 65535)
	h.edge()
	room := int(h.objs.FluxvmHaq.MaxEntries()) / (128 + 8)
	calls := min(benchCalls(b), 20*room*9/10, (hitPort-portMin)/2)
	newFlow := func(off int) func(i int) []byte {
		return func(i int) []byte {
			f := v.fwd(uint16(portMin+off+i), pkt.SYN)
			// Another client than the hit's (10.0.0.2).
			binary.BigEndian.PutUint16(f[14+12+2:], 2)
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
	for _, f := range [][]byte{v.fwd(hitPort, pkt.SYN), v.fwd(hitPort, pkt.ACK)} {
		if ret, _ := h.run(h.objs.FluxvmNsIn, f); ret != tcOK {
			b.Fatal("flow not set up")
		}
	}
	if ct, ok := h.ct(v.flow(hitPort)); !ok || ct.Flags&CTFlagSNAT == 0 || Port(ct.NatPort) != hitPort {
		b.Fatalf("the hits' flow: %+v (present %v), want SNAT to port %d", ct, ok, hitPort)
	}
	hit := func(int) []byte { return v.fwd(hitPort, pkt.ACK) }
	reply := func(int) []byte {
		return v.frame(v.backends[0], netip.AddrPortFrom(v.snatAddr(), hitPort), pkt.ACK)
	}
	cases := []*benchCase{
		{name: "ipv4 tcp snat new flow, HA off", metric: "v4-new-flow", prog: h.objs.FluxvmNsIn, frame: newFlow(0), want: tcOK, before: on(false)},
		{name: "ipv4 tcp snat new flow, HA on", metric: "v4-new-flow-ha", prog: h.objs.FluxvmNsIn, frame: newFlow(calls), want: tcOK, before: on(true)},
		{name: "ipv4 tcp snat conntrack hit, HA off", metric: "v4-ct-hit", prog: h.objs.FluxvmNsIn, frame: hit, want: tcOK, before: on(false)},
		{name: "ipv4 tcp snat conntrack hit, HA on", metric: "v4-ct-hit-ha", prog: h.objs.FluxvmNsIn, frame: hit, want: tcOK, before: on(true)},
		{name: "ipv4 tcp snat reply, HA off", metric: "v4-reply", prog: h.objs.FluxvmNsIn, frame: reply, want: tcOK, before: on(false)},
		{name: "ipv4 tcp snat reply, HA on", metric: "v4-reply-ha", prog: h.objs.FluxvmNsIn, frame: reply, want: tcOK, before: on(true)},
	}
	d0, e0, r0 := h.haDrops(), h.counters()[CounterHAEmitted], h.counters()[CounterSNATRetry]
	measureInterleaved(b, h.th, calls, cases, true)
	h.haOn(false)
	if d := h.haDrops() - d0; d != 0 {
		b.Fatalf("%d records found the ring full: the benchmark did not measure emitting alone", d)
	}
	// Every HA-on new flow queued its record (the hits and replies: at
	// most a few refreshes).
	if e := h.counters()[CounterHAEmitted] - e0; e < uint64(calls/20*20) {
		b.Fatalf("ha_emitted +%d, want at least the %d new flows under HA", e, calls/20*20)
	}
	if r := h.counters()[CounterSNATRetry] - r0; r != 0 {
		b.Logf("snat_retries +%d: some new flows searched for a port", r)
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

// haMode is a forward path of the HA tests: its service setup, the TC
// program that takes the client's packets, and whether HA replicates its
// flows (north-south: SNAT, DSR).
type haMode struct {
	name       string
	setup      func(h *harness, v variant)
	prog       func(h *harness) *ebpf.Program
	northSouth bool
}

func haModes() []haMode {
	fromVM := func(h *harness) *ebpf.Program { return h.objs.FluxvmFromVm }
	nsIn := func(h *harness) *ebpf.Program { return h.objs.FluxvmNsIn }
	return []haMode{
		{"east-west nat", func(h *harness, v variant) { v.setup(h) }, fromVM, false},
		{"east-west nat stored", func(h *harness, v variant) { v.setup(h); h.revStored(sid) }, fromVM, false},
		{"north-south snat", func(h *harness, v variant) { v.nsSetup(h, 0) }, nsIn, true},
		{"dsr", func(h *harness, v variant) { v.nsSetup(h, SvcFlagDSR) }, nsIn, true},
	}
}

// TestHAHits: under HA, conntrack hits of TC's north-south forward paths
// (SNAT, DSR; both families) queue a TCP flow's state transitions, SYN ->
// ESTABLISHED -> FIN, each with its new state and deadline; established
// hits queue nothing until a refresh is due (the entry's deadline would
// pass the one the standby holds: deadline + half the state's timeout at
// the last record), and then exactly one; the same for UDP, which has no
// transitions. East-west flows (NAT with derived and stored replies) go
// through the same steps and queue nothing at any of them, their entries
// keeping ha_until 0. With HA off, no hit queues anything.
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
					c0, d0 := h.counters()[CounterHAEmitted], h.haDrops()
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
						if !mode.northSouth && ct.L7Ifindex != 0 {
							t.Fatalf("HA %v, %s: east-west entry with ha_until %d, want 0", ha, s.what, ct.L7Ifindex)
						}
						if !ha || s.cause == 0 || !mode.northSouth {
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
					if d := h.haDrops() - d0; d != 0 {
						t.Errorf("HA %v: fluxvm_hadrop +%d, want 0", ha, d)
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
// (north-south SNAT, its replies on the north-south ingress; TCP and
// UDP). East-west replies (derived and stored reverse halves) take the
// same steps and queue nothing: no record, no drop, ha_until 0. (DSR
// replies bypass the node.)
func TestHAReplyHits(t *testing.T) {
	h := newHarness(t)
	for _, mode := range haModes()[:3] {
		for _, v := range variants() {
			t.Run(mode.name+"/"+v.name, func(t *testing.T) {
				h.reset()
				mode.setup(h, v)
				prog := mode.prog(h)
				const port = 42200
				h.haOn(true)
				defer h.haOn(false)
				first := pkt.SYN
				if v.proto == ipUDP {
					first = pkt.ACK
				}
				h.run(prog, v.fwd(port, first))
				h.run(prog, v.fwd(port, pkt.ACK))
				h.haRecords()
				c0, d0 := h.counters()[CounterHAEmitted], h.haDrops()
				state := CTUDP
				if v.proto == ipTCP {
					state = CTTCPEstablished
				}
				be := v.backends[0]
				ct, ok := h.ct(v.flow(port))
				if !ok || haNorthSouth(ct) != mode.northSouth {
					t.Fatalf("entry %+v (present %v)", ct, ok)
				}
				// The reply and its reverse half: the backend answers
				// the client (east-west) or the SNAT address and port
				// (north-south), which the north-south ingress takes.
				replyProg, natKey := h.objs.FluxvmToVm, v.natKey(be, port)
				replyTo := v.clientAt(port)
				if mode.northSouth {
					replyProg = h.objs.FluxvmNsIn
					replyTo = netip.AddrPortFrom(v.snatAddr(), Port(ct.NatPort))
					natKey = v.snatKey(be, replyTo.Port())
				}
				reply := func(f pkt.TCPFlags) {
					t.Helper()
					if ret, _ := h.run(replyProg, v.frame(be, replyTo, f)); ret != tcOK {
						t.Fatalf("reply: verdict %d", int32(ret))
					}
				}
				// The stored reverse half (the SNAT mapping) has its own
				// refresh throttle: aged with the entry.
				age := func(d time.Duration) {
					t.Helper()
					h.haAge(v.flow(port), d)
					if n, ok := h.nat(natKey); ok {
						n.LastSeenNs -= uint64(d)
						h.must(h.natMap(natKey).Put(natKey.key(), n))
					} else if mode.northSouth {
						t.Fatal("no SNAT mapping")
					}
				}
				// check: the reply queued the record of cause and state
				// (north-south), or nothing (east-west).
				check := func(what string, cause uint8, state CTState) {
					t.Helper()
					recs := h.haRecords()
					ct, ok := h.ct(v.flow(port))
					if !ok || CTState(ct.State) != state {
						t.Fatalf("%s: entry %+v (present %v), want state %d", what, ct, ok, state)
					}
					if !mode.northSouth || cause == 0 {
						if len(recs) != 0 {
							t.Fatalf("%s: %d records, want none: %+v", what, len(recs), recs)
						}
						if !mode.northSouth && ct.L7Ifindex != 0 {
							t.Fatalf("%s: east-west entry with ha_until %d, want 0", what, ct.L7Ifindex)
						}
						return
					}
					h.haCheck(t, recs, v.flow(port), cause, state)
				}
				reply(pkt.ACK)
				check("a fresh reply", 0, state)
				age(2 * time.Second)
				lastSeen := uint64(0)
				if ct, ok := h.ct(v.flow(port)); ok {
					lastSeen = ct.LastSeenNs
				}
				reply(pkt.ACK)
				if ct, _ := h.ct(v.flow(port)); ct.LastSeenNs == lastSeen {
					t.Fatal("a reply refreshing: the entry was not refreshed")
				}
				check("a reply refreshing, not due", 0, state)
				age(time.Duration(h.haTimeout(state)/2+2) * time.Second)
				reply(pkt.ACK)
				check("a reply, refresh due", HARefresh, state)
				want := uint64(1)
				if v.proto == ipTCP {
					reply(pkt.FIN)
					check("the backend's FIN", HATransition, CTTCPFin)
					want++
				}
				if !mode.northSouth {
					want = 0
				}
				if n := h.counters()[CounterHAEmitted] - c0; n != want {
					t.Errorf("ha_emitted +%d, want %d", n, want)
				}
				if d := h.haDrops() - d0; d != 0 {
					t.Errorf("fluxvm_hadrop +%d, want 0", d)
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
