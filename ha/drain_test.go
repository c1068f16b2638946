package ha

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/testutils/bpftest"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

func (n *node) haOn() {
	n.t.Helper()
	var m bpf.Meta
	if err := n.o.Maps.FluxvmMeta.Lookup(uint32(0), &m); err != nil {
		n.t.Fatal(err)
	}
	m.Flags |= bpf.MetaFlagHA
	if err := n.o.Maps.FluxvmMeta.Put(uint32(0), m); err != nil {
		n.t.Fatal(err)
	}
}

// openNorthSouth makes n's datapath learn north-south (SNAT) flow i: flow
// i*len(frontends)+1 of open's mix, on frontends[1].
func (n *node) openNorthSouth(i int, port uint16) liveFlow {
	n.t.Helper()
	if frontends[1].flags&bpf.SvcFlagNorthSouth == 0 {
		n.t.Fatal("frontends[1] is not north-south")
	}
	return n.open(i*len(frontends)+1, port)
}

// openEastWest makes n's datapath learn east-west flow i: one of open's
// mix on the other frontends (derived replies, stored reverse halves,
// IPv6), in turn.
func (n *node) openEastWest(i int, port uint16) liveFlow {
	n.t.Helper()
	f := n.open(i*len(frontends)+[]int{0, 2, 3}[i%3], port)
	if f.northSouth {
		n.t.Fatalf("%s: not east-west", f.k)
	}
	return f
}

// TestReplication: north-south flows the real datapath learns on node A
// queue records (fluxvm_haq) that the drainer turns into journal
// batches; a target cursor pulls them in small deltas, applies them to
// node B (which numbers services and backends otherwise) and acks; every
// flow then goes on on B exactly as on A. Each flow's handshake queues
// two records (its SYN's new entry and its ACK's transition to
// ESTABLISHED): B's copy has the ESTABLISHED state and A's deadline plus
// the record's hold (half the state's timeout), and so after a FIN. The
// queue is the only channel: no snapshot. East-west flows A learns
// meanwhile (its own VMs') queue nothing and never reach B.
func TestReplication(t *testing.T) {
	a, b := newNode(t, 1, 1), newNode(t, 40, 100)
	a.haOn()
	j, err := NewJournal("web", 5, JournalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	d, err := NewDrainer(DrainerConfig{Queue: a.o.Maps.FluxvmHaq, Drops: a.o.Maps.FluxvmHadrop,
		Journal: func(sid uint32) *Journal {
			for _, s := range a.sids {
				if s == sid {
					return j
				}
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	var flows, eastWest []liveFlow
	// B starts from a snapshot of A taken after the checkpoint: A has no
	// flow yet, so the snapshot is empty and the cursor is the start.
	cp, err := j.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	var cur Cursor
	if err := cur.Reset(cp.Journal, cp.Seq, cp.Epoch); err != nil {
		t.Fatal(err)
	}
	pull := func() {
		t.Helper()
		if _, err := d.Drain(20 * time.Millisecond); err != nil {
			t.Fatal(err)
		}
		j.Seal()
		for {
			delta, err := j.Since(cur.Seq, cur.Journal, 7)
			if err != nil {
				t.Fatal(err)
			}
			if err := cur.Check(delta); err != nil {
				t.Fatalf("delta %d..%d: %v", delta.From, delta.To, err)
			}
			if _, err := Apply(context.Background(), delta, b.target()); err != nil {
				t.Fatal(err)
			}
			cur.Advance(delta)
			if err := j.Ack(cur.Seq); err != nil {
				t.Fatal(err)
			}
			if delta.To == delta.From {
				return
			}
		}
	}
	for round := 0; round < 3; round++ {
		for i := 0; i < 20; i++ {
			flows = append(flows, a.openNorthSouth(round*20+i, uint16(43000+round*20+i)))
			eastWest = append(eastWest, a.openEastWest(round*20+i, uint16(44000+round*20+i)))
		}
		pull()
	}
	read, skipped, dropped, err := d.Stats()
	if err != nil || read != 2*uint64(len(flows)) || skipped != 0 || dropped != 0 {
		t.Errorf("drainer: read %d, skipped %d, dropped %d (%v); want %d records (two a flow), none skipped or dropped",
			read, skipped, dropped, err, 2*len(flows))
	}
	// Both nodes run on this host's monotonic clock: their deadlines
	// compare. B's is A's plus the hold, and the drain-to-apply time.
	sameFlow := func(f liveFlow, state bpf.CTState, timeout time.Duration) {
		t.Helper()
		ea, err := a.ct.Lookup(f.k)
		if err != nil {
			t.Fatalf("%s on A: %v", f.k, err)
		}
		eb, err := b.ct.Lookup(f.k)
		if err != nil {
			t.Fatalf("%s on B: %v", f.k, err)
		}
		want := ea.Deadline + timeout/2
		if ea.State != state || eb.State != state || eb.Deadline < want || eb.Deadline > want+time.Second {
			t.Errorf("%s: A %s deadline %v, B %s deadline %v; want %s on both, B's deadline A's + %v",
				f.k, ea.State, ea.Deadline, eb.State, eb.Deadline, state, timeout/2)
		}
	}
	var meta bpf.Meta
	if err := a.o.Maps.FluxvmMeta.Lookup(uint32(0), &meta); err != nil {
		t.Fatal(err)
	}
	timeout := func(v, def uint32) time.Duration {
		if v == 0 {
			v = def
		}
		return time.Duration(v) * time.Second
	}
	for _, f := range flows {
		sameFlow(f, bpf.CTTCPEstablished, timeout(meta.TimeoutTcpEstablishedS, bpf.DefaultTimeoutTCPEstablished))
	}
	for _, f := range flows[:8] {
		if ret, _, _ := a.send(f.k, pkt.FIN, f.northSouth); ret != bpftest.TCOK {
			t.Fatalf("%s: FIN on A: verdict %d", f.k, int32(ret))
		}
	}
	pull()
	for _, f := range flows[:8] {
		sameFlow(f, bpf.CTTCPFin, timeout(meta.TimeoutTcpFinS, bpf.DefaultTimeoutTCPFin))
	}
	for _, f := range flows {
		ret, src, dst := b.send(f.k, pkt.ACK, f.northSouth)
		if ret != bpftest.TCOK || src != f.src || dst != f.dst {
			t.Errorf("%s: on B %d %s -> %s, on A %s -> %s", f.k, int32(ret), src, dst, f.src, f.dst)
		}
	}
	if _, broken := pairs(t, b); broken != 0 {
		t.Errorf("%d flows on B without their reverse half", broken)
	}
	for _, f := range eastWest {
		if _, err := a.ct.Lookup(f.k); err != nil {
			t.Errorf("east-west %s on A: %v", f.k, err)
		}
		if e, err := b.ct.Lookup(f.k); err == nil {
			t.Errorf("east-west %s replicated to B: %+v", f.k, e)
		}
	}
	if got := len(b.keys(t)); got != len(flows) {
		t.Errorf("B has %d flows, want the %d north-south ones", got, len(flows))
	}
	if st := j.Stats(); st.Batches != 0 || cur.Seq != st.LastSeq {
		t.Errorf("journal %+v, cursor %+v: want everything acked", st, cur)
	}
}

// keys returns node n's flows: key -> backend address.
func (n *node) keys(t *testing.T) map[conntrack.Key]netip.AddrPort {
	t.Helper()
	es, err := n.ct.List(conntrack.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[conntrack.Key]netip.AddrPort{}
	for _, e := range es {
		for ap, id := range n.bids {
			if id == e.BackendID {
				out[e.Key] = ap
			}
		}
	}
	return out
}

// TestReplicationOverflow: more new flows than the queue holds, with no
// reader: the records it had no room for are counted, the target misses
// those flows after the deltas, and the snapshot-diff (an import with
// Prune) restores the target exactly — also deleting the flows the source
// no longer has.
func TestReplicationOverflow(t *testing.T) {
	a, b := newNode(t, 1, 1), newNode(t, 40, 100)
	a.haOn()
	j, err := NewJournal("web", 1, JournalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	d, err := NewDrainer(DrainerConfig{Queue: a.o.Maps.FluxvmHaq, Drops: a.o.Maps.FluxvmHadrop,
		Journal: func(uint32) *Journal { return j }})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	room := int(a.o.Maps.FluxvmHaq.MaxEntries()) / (128 + 8)
	n := room + 300
	// North-south flows (SNAT): the ones a snapshot-diff prunes.
	ns := frontends[1].vip
	for i := 0; i < n; i++ {
		k := conntrack.Key{Client: netip.AddrPortFrom(netip.MustParseAddr(fmt.Sprintf("198.18.%d.%d", i/250, 1+i%250)), 44000),
			VIP: ns, Proto: conntrack.ProtoTCP}
		if ret, _, _ := a.send(k, pkt.SYN, true); ret != bpftest.TCOK {
			t.Fatalf("%s: verdict %d", k, int32(ret))
		}
	}
	if _, err := d.Drain(20 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	_, _, dropped, err := d.Stats()
	if err != nil || dropped < 300 {
		t.Fatalf("dropped %d (%v), want at least 300 of %d flows over a queue of %d", dropped, err, n, room)
	}
	j.Seal()
	delta, err := j.Since(0, j.ID(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Apply(context.Background(), delta, b.target()); err != nil {
		t.Fatal(err)
	}
	if got := len(b.keys(t)); got != n-int(dropped) {
		t.Fatalf("B has %d flows after the deltas, want %d (the queued ones)", got, n-int(dropped))
	}
	// A forgets some flows (its GC would); B still has them.
	for i := 0; i < 10; i++ {
		k := conntrack.Key{Client: netip.AddrPortFrom(netip.MustParseAddr(fmt.Sprintf("198.18.0.%d", 1+i)), 44000), VIP: ns, Proto: conntrack.ProtoTCP}
		if err := a.ct.Delete(k); err != nil {
			t.Fatal(err)
		}
	}
	// B's own VM opens an east-west flow: the diff must leave it.
	own := conntrack.Key{Client: netip.MustParseAddrPort("10.0.9.9:45000"), VIP: frontends[0].vip, Proto: conntrack.ProtoTCP}
	if ret, _, _ := b.send(own, pkt.SYN, false); ret != bpftest.TCOK {
		t.Fatalf("B's own flow: verdict %d", int32(ret))
	}
	time.Sleep(60 * time.Millisecond) // B's flows were last seen before the export (past the slack)
	var snap bytes.Buffer
	if _, err := Export(context.Background(), &snap, Header{Node: "a", Service: "web", Epoch: 1, Seeds: &Seeds{}}, a.source()); err != nil {
		t.Fatal(err)
	}
	tgt := b.target()
	tgt.Prune = true
	for _, sid := range b.sids {
		tgt.ServiceIDs = append(tgt.ServiceIDs, sid)
	}
	res, err := Import(context.Background(), &snap, tgt)
	if err != nil {
		t.Fatal(err)
	}
	want, got := a.keys(t), b.keys(t)
	if _, ok := got[own]; !ok {
		t.Error("the snapshot-diff deleted B's own east-west flow")
	}
	delete(got, own)
	if !maps.Equal(want, got) {
		t.Errorf("after the snapshot-diff B has %d flows, A %d (import %+v)", len(got), len(want), res)
	}
	if res.Pruned != 10 || res.Written != dropped {
		t.Errorf("snapshot-diff %+v: want the %d dropped written and 10 pruned", res, dropped)
	}
}

// TestApplyLaterWins: two upserts of one flow in a delta (a re-pick after
// the first record was drained): the later one wins, though its ages,
// counted from its own draining, make it look older.
func TestApplyLaterWins(t *testing.T) {
	b := newNode(t, 40, 100)
	k := conntrack.Key{Client: netip.MustParseAddrPort("198.51.100.7:46000"), VIP: frontends[1].vip, Proto: conntrack.ProtoTCP}
	f := func(be netip.AddrPort, port uint16, idle time.Duration) *Flow {
		return &Flow{Client: k.Client, VIP: k.VIP, Proto: k.Proto, Backend: be, Kind: conntrack.SNAT,
			SNAT: netip.AddrPortFrom(snat4, port), State: bpf.CTTCPEstablished, Idle: idle, TTL: time.Hour,
			NAT: &NATHalf{Idle: idle}}
	}
	first, second := frontends[1].backends[0], frontends[1].backends[1]
	d := Delta{Service: "web", Journal: "j", Epoch: 1, From: 0, To: 1, Batches: []Batch{{Seq: 1, Epoch: 1, Ops: []Op{
		{Kind: OpUpsert, Flow: f(first, 21000, 100*time.Millisecond)},
		{Kind: OpUpsert, Flow: f(second, 21001, 900*time.Millisecond)},
	}}}}
	if _, err := Apply(context.Background(), d, b.target()); err != nil {
		t.Fatal(err)
	}
	e, err := b.ct.Lookup(k)
	if err != nil || e.BackendID != b.bids[second] || e.SNAT.Port() != 21001 {
		t.Errorf("after the delta %+v (%v): want the later upsert, backend %s", e, err, second)
	}
}

// TestApplyDeleteKeepsFresher: a source's GC delete names how long the
// source had not seen the flow; a target that saw it more recently than
// that (by more than the refresh granularity) keeps it, counted fresher,
// while a delete of a flow the target saw no later, or one that names no
// idle time, applies.
func TestApplyDeleteKeepsFresher(t *testing.T) {
	b := newNode(t, 40, 100)
	flow := func(port uint16, idle time.Duration) (conntrack.Key, *Flow) {
		k := conntrack.Key{Client: netip.AddrPortFrom(netip.MustParseAddr("198.51.100.8"), port), VIP: frontends[1].vip, Proto: conntrack.ProtoTCP}
		return k, &Flow{Client: k.Client, VIP: k.VIP, Proto: k.Proto, Backend: frontends[1].backends[0], Kind: conntrack.SNAT,
			SNAT: netip.AddrPortFrom(snat4, port), State: bpf.CTTCPEstablished, Idle: idle, TTL: time.Hour, NAT: &NATHalf{Idle: idle}}
	}
	for _, tc := range []struct {
		name      string
		localIdle time.Duration // how long ago the target saw the flow
		opIdle    time.Duration // the source's idle time at its delete (0: none said)
		kept      bool
	}{
		{"the target carries it now", 0, 90 * time.Second, true},
		{"seen here a minute ago, idle there 90s", time.Minute, 90 * time.Second, true},
		{"seen here no later than there", 90 * time.Second, 90 * time.Second, false},
		{"within the refresh granularity", 89 * time.Second, 90 * time.Second, false},
		{"a delete naming no idle time", 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k, f := flow(uint16(22000+len(tc.name)), tc.localIdle)
			up := Delta{Service: "web", Journal: "j", Epoch: 1, To: 1, Batches: []Batch{{Seq: 1, Epoch: 1, Ops: []Op{{Kind: OpUpsert, Flow: f}}}}}
			if _, err := Apply(context.Background(), up, b.target()); err != nil {
				t.Fatal(err)
			}
			del := Op{Kind: OpDelete, Key: k, IdleMS: uint64(tc.opIdle / time.Millisecond)}
			d := Delta{Service: "web", Journal: "j", Epoch: 1, From: 1, To: 2, Batches: []Batch{{Seq: 2, Epoch: 1, Ops: []Op{del}}}}
			res, err := Apply(context.Background(), d, b.target())
			if err != nil {
				t.Fatal(err)
			}
			_, lerr := b.ct.Lookup(k)
			if kept := lerr == nil; kept != tc.kept || (res.Fresher == 1) != tc.kept {
				t.Errorf("after the delete: kept %v (fresher %d); want kept %v", kept, res.Fresher, tc.kept)
			}
		})
	}
}
