package bpf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"testing"
	"time"

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
// entry exactly as written. Conntrack hits queue nothing; with HA off
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
				h.run(prog, v.fwd(42001, pkt.ACK)) // a conntrack hit: nothing
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
// flows TC learned.
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
	ack := v.frame(v.clientAt(snatMin), v.vip, pkt.ACK)
	if ret, _ := h.runXDP(objs.FluxvmXdpNs, ack, l.in); ret != xdpRedirect {
		t.Errorf("an established flow under HA: verdict %d; want XDP_REDIRECT", ret)
	}
}

// BenchmarkHA: the new-flow cost of HA replication: the same east-west
// IPv4 new flow with the queue off and on (one record reserved, filled and
// submitted into fluxvm_haq), in alternate blocks (measureInterleaved),
// the ring drained before each block so that every record finds room
// (blocks are kept under the ring's capacity); ha-minus-none-ns is the
// net cost.
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
	cases := []*benchCase{
		{name: "ipv4 tcp new flow, HA off", metric: "v4-new-flow", prog: h.objs.FluxvmFromVm, frame: newFlow(0), want: tcOK, before: on(false)},
		{name: "ipv4 tcp new flow, HA on", metric: "v4-new-flow-ha", prog: h.objs.FluxvmFromVm, frame: newFlow(1 << 20), want: tcOK, before: on(true)},
	}
	d0 := h.haDrops()
	measureInterleaved(b, h.th, calls, cases, true)
	h.haOn(false)
	if d := h.haDrops() - d0; d != 0 {
		b.Fatalf("%d records found the ring full: the benchmark did not measure emitting alone", d)
	}
	off := float64(cases[0].sum) / float64(cases[0].n)
	onNs := float64(cases[1].sum) / float64(cases[1].n)
	b.ReportMetric(onNs-off, "ha-minus-none-ns")
}
