package fluxvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

// groupSource and groupTarget are a Dataplane as ha.GroupReplicator sees
// it, in process: the source of its journals, and the target of one
// other edge's.
type groupSource struct{ d *Dataplane }

func (s groupSource) Delta(ctx context.Context, svc, journal string, seq uint64, maxOps int) (ha.Delta, error) {
	return s.d.HA().FlowDelta(ctx, svc, FlowDeltaRequest{Journal: journal, Seq: seq, MaxOps: maxOps})
}

func (s groupSource) Export(ctx context.Context, svc string, w io.Writer) error {
	_, err := s.d.ExportFlows(ctx, svc, w)
	return err
}

func (s groupSource) Ack(ctx context.Context, svc string, seq uint64) error {
	_, err := s.d.HA().AckFlowDelta(ctx, svc, seq)
	return err
}

type groupTarget struct {
	d      *Dataplane
	source string
}

func (g groupTarget) Cursor(context.Context, string) (ha.Cursor, error) {
	return g.d.HA().Status().Sources["web"][g.source], nil
}

func (g groupTarget) Import(ctx context.Context, svc string, r io.Reader, prune bool) (ha.ImportResult, error) {
	return g.d.ImportFlows(ctx, svc, r, prune)
}

func (g groupTarget) ImportDelta(ctx context.Context, svc string, d ha.Delta) (ha.Cursor, error) {
	res, err := g.d.HA().ImportFlowDelta(ctx, svc, d)
	return res.Cursor, err
}

// newGroup opens edges named names as a group (ha_group, leases 10, 9,
// ..., SNAT addresses 10.97.<net>.<i+1> and fd00:97:<net>::<i+1>), applies
// "web", gives each the others' SNAT addresses as peers, and returns them
// with a group replicator over them (in process, over the SDK calls the
// REST routes serve).
func newGroup(tb testing.TB, net int, names ...string) ([]*groupEdge, *ha.GroupReplicator) {
	tb.Helper()
	ctx := context.Background()
	snat4 := func(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 97, byte(net), byte(i + 1)}) }
	snat6 := func(i int) netip.Addr { return netip.MustParseAddr(fmt.Sprintf("fd00:97:%d::%d", net, i+1)) }
	var edges []*groupEdge
	for i, name := range names {
		e := newGroupEdgeWith(tb, name, seeds{hash: 0x6e0b, maglev: 7}, func(o *Options) {
			o.HA = HAOptions{Epoch: ha.Epoch(10 - i), Interval: MinHAInterval, Group: true}
			o.NorthSouth.SNATAddress, o.NorthSouth.SNATAddressV6 = snat4(i), snat6(i)
		})
		e.apply(tb, groupCatalog{func(bs []Backend) []Backend { return bs }}.web())
		edges = append(edges, e)
	}
	r := &ha.GroupReplicator{MaxOps: 4096}
	for i, e := range edges {
		var peers []netip.Addr
		for j := range edges {
			if j != i {
				peers = append(peers, snat4(j), snat6(j))
			}
		}
		if _, err := e.d.SetSNATPeers(ctx, SNATPeers{Addresses: peers}); err != nil {
			tb.Fatal(err)
		}
		r.Edges = append(r.Edges, ha.GroupEdge{Name: e.name, Source: groupSource{e.d},
			Target:   func(source string) ha.Standby { return groupTarget{d: e.d, source: source} },
			Services: func(context.Context) ([]string, error) { return []string{"web"}, nil },
			Join:     func(ctx context.Context) error { _, err := e.d.HA().Join(ctx); return err }})
	}
	return edges, r
}

// deltaRound runs one round of r and returns the ops it applied; a round
// that had to load a snapshot fails tb (deltas were to continue).
func deltaRound(tb testing.TB, r *ha.GroupReplicator) int {
	tb.Helper()
	res, err := r.Round(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	ops := 0
	for _, x := range res {
		if x.Snapshot != nil {
			tb.Fatalf("%s -> %s loaded a snapshot (%s) where deltas continue", x.Source, x.Target, x.Reason)
		}
		ops += x.Ops
	}
	return ops
}

// TestGroupReplication: three edges of a group (ha_group, a lease and an
// SNAT address each, the others' addresses as SNAT peers) each learn
// flows of their own through their real north-south program; the group
// replicator (in process, over the SDK calls the REST routes serve)
// brings every edge's flows to every other, first by snapshot and then by
// delta, pruning none across edges; then any edge continues any edge's
// flow with its original translation: a reply to the first edge's SNAT
// address and port, run through the second edge's program, goes back to
// the client from the VIP, and the client's next packet through the
// second edge leaves from the first edge's SNAT address and port to the
// same backend.
func TestGroupReplication(t *testing.T) {
	ctx := context.Background()
	names := []string{"e1", "e2", "e3"}
	snat := func(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 97, 0, byte(i + 1)}) }
	edges, r := newGroup(t, 0, names...)
	r.MaxOps = 64
	cat := groupCatalog{func(bs []Backend) []Backend { return bs }}
	var fes []groupFrontend
	for _, fe := range cat.frontends() {
		if fe.vip.Addr() == cat.web().VIPs[0] {
			fes = append(fes, fe)
		}
	}
	ts := groupTuples(240, fes)
	learn := func(i int, part []groupTuple) {
		t.Helper()
		edges[i].picks(t, part, false)
	}
	// Each edge learns flows of its own; a round brings them everywhere.
	for i := range edges {
		learn(i, ts[i*40:(i+1)*40])
	}
	entries := func(e *groupEdge) map[conntrack.Key]conntrack.Entry {
		t.Helper()
		ct, err := e.d.Conntrack()
		if err != nil {
			t.Fatal(err)
		}
		es, err := ct.List(conntrack.Filter{})
		if err != nil {
			t.Fatal(err)
		}
		out := map[conntrack.Key]conntrack.Entry{}
		for _, en := range es {
			out[en.Key] = en
		}
		return out
	}
	converge := func(what string, n int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			res, err := r.Round(ctx)
			if err != nil {
				t.Fatalf("%s: round: %v", what, err)
			}
			for _, x := range res {
				if x.Snapshot != nil && x.Snapshot.Pruned != 0 {
					t.Fatalf("%s: %s's snapshot pruned %d flows on %s", what, x.Source, x.Snapshot.Pruned, x.Target)
				}
			}
			ok := true
			var got []int
			for _, e := range edges {
				es := entries(e)
				got = append(got, len(es))
				for _, tu := range ts[:n] {
					if _, has := es[tu.key]; !has {
						ok = false
					}
				}
			}
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the edges hold %v flows; every one should hold the %d learned", what, got, n)
			}
			time.Sleep(MinHAInterval)
		}
	}
	converge("first round", 120)
	for _, e := range edges {
		if st := e.d.HA().Status(); !st.Joined {
			t.Errorf("%s has not joined after the rounds that brought it every edge's flows: %+v", e.name, st)
		}
	}
	// Every copy is the learning edge's translation.
	owner := func(k conntrack.Key) int {
		for i := range edges {
			for _, tu := range ts[i*40 : (i+1)*40] {
				if tu.key == k {
					return i
				}
			}
			for _, tu := range ts[120+i*40 : 120+(i+1)*40] {
				if tu.key == k {
					return i
				}
			}
		}
		return -1
	}
	check := func(what string, n int) {
		t.Helper()
		ref := make([]map[conntrack.Key]conntrack.Entry, len(edges))
		for i, e := range edges {
			ref[i] = entries(e)
		}
		for _, tu := range ts[:n] {
			o := owner(tu.key)
			want := ref[o][tu.key]
			if want.SNAT.Addr() != snat(o) {
				t.Fatalf("%s: %s learned on %s with SNAT %s, want its own %s", what, tu.key, names[o], want.SNAT, snat(o))
			}
			for i := range edges {
				got := ref[i][tu.key]
				if got.SNAT != want.SNAT || got.Kind != conntrack.SNAT {
					t.Fatalf("%s: %s on %s: %+v; on %s (which learned it): %+v", what, tu.key, names[i], got, names[o], want)
				}
			}
		}
	}
	check("after the snapshots", 120)

	// Deltas: more flows on every edge, carried without a snapshot.
	for i := range edges {
		learn(i, ts[120+i*40:120+(i+1)*40])
	}
	time.Sleep(2 * MinHAInterval) // sealed
	if ops := deltaRound(t, r); ops == 0 {
		t.Fatal("the second round carried no op")
	}
	converge("deltas", 240)
	check("after the deltas", 240)
	if st := edges[1].d.HA().Status(); !st.Group || len(st.Sources["web"]) != 2 {
		t.Errorf("e2's status: group %v, sources %v; want two sources of web", st.Group, st.Sources)
	}

	// e2 continues a TCP flow e1 learned: the reply to e1's SNAT address
	// and port goes back to the client from the VIP, and the client's
	// next packet leaves from e1's address and port to the same backend.
	var flow conntrack.Entry
	for k, en := range entries(edges[0]) {
		if owner(k) == 0 && k.Proto == conntrack.ProtoTCP {
			flow = en
			break
		}
	}
	if !flow.SNAT.IsValid() {
		t.Fatal("no TCP flow of e1's")
	}
	run := func(e *groupEdge, frame []byte) (uint32, []byte) {
		t.Helper()
		out := make([]byte, len(frame)+64)
		var ret uint32
		err := e.lab.Node.Do(func() error {
			opts := ebpf.RunOptions{Data: frame, DataOut: out, Repeat: 1}
			var err error
			ret, err = e.d.dp.Programs().FluxvmNsIn.Run(&opts)
			out = opts.DataOut
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return ret, out
	}
	// The backend, as e1 itself translates the flow's next packet.
	_, out := run(edges[0], pkt.TCP(flow.Key.Client, flow.Key.VIP, pkt.ACK, nil))
	p := pkt.Decode(out)
	if p.NetworkLayer() == nil || p.TransportLayer() == nil {
		t.Fatalf("e1's own translation: undecodable %x", out)
	}
	a, _ := netip.AddrFromSlice(p.NetworkLayer().NetworkFlow().Dst().Raw())
	dp := p.TransportLayer().TransportFlow().Dst().Raw()
	be := netip.AddrPortFrom(a.Unmap(), uint16(dp[0])<<8|uint16(dp[1]))
	e2 := edges[1]
	ret, out := run(e2, pkt.TCP(be, flow.SNAT, pkt.SYNACK, nil))
	if want := pkt.TCP(flow.Key.VIP, flow.Key.Client, pkt.SYNACK, nil); (ret != 0 && ret != 7) || !bytes.Equal(out[:len(want)], want) {
		t.Fatalf("e1's flow's reply through e2: verdict %d\n got %x\nwant %x", ret, out, want)
	}
	ret, out = run(e2, pkt.TCP(flow.Key.Client, flow.Key.VIP, pkt.ACK, nil))
	if want := pkt.TCP(flow.SNAT, be, pkt.ACK, nil); (ret != 0 && ret != 7) || !bytes.Equal(out[:len(want)], want) {
		t.Fatalf("e1's flow's next packet through e2: verdict %d\n got %x\nwant %x (e1's translation)", ret, out, want)
	}
}

// TestGroupJoinHoldsAdvertisements: a group edge withdraws its VIPs
// ("joining the group") from its start until HA.Join, then advertises
// them; a restart holds them again; an edge outside a group refuses Join.
func TestGroupJoinHoldsAdvertisements(t *testing.T) {
	ctx := context.Background()
	same := seeds{hash: 1, maglev: 2}
	e := newGroupEdgeWith(t, "e1", same, func(o *Options) {
		o.HA = HAOptions{Epoch: 3, Interval: MinHAInterval, Group: true}
	})
	svc := groupCatalog{func(bs []Backend) []Backend { return bs }}.web()
	svc.Advertise = true
	e.apply(t, svc)
	reason := func() advert.Reason {
		t.Helper()
		for _, en := range e.d.Advertisements().Entries {
			if en.VIP == svc.VIPs[0] {
				return en.Reason
			}
		}
		t.Fatal("the VIP is not in the advertisement snapshot")
		return ""
	}
	if r := reason(); r != advert.ReasonGroupJoining {
		t.Fatalf("before Join: reason %q, want %q", r, advert.ReasonGroupJoining)
	}
	st, err := e.d.HA().Join(ctx)
	if err != nil || !st.Joined {
		t.Fatalf("Join: %+v, %v", st, err)
	}
	if r := reason(); r != "" {
		t.Fatalf("after Join: withdrawn (%q)", r)
	}
	if err := e.d.Close(); err != nil {
		t.Fatal(err)
	}
	e.open(t, same)
	if r := reason(); r != advert.ReasonGroupJoining {
		t.Fatalf("after a restart: reason %q, want %q", r, advert.ReasonGroupJoining)
	}
	pair := newGroupEdgeWith(t, "p1", same, func(o *Options) { o.HA = HAOptions{Epoch: 3, Interval: MinHAInterval} })
	var ve *ValidationError
	if _, err := pair.d.HA().Join(ctx); !errors.Is(err, ErrPrerequisite) || !errors.As(err, &ve) || ve.Field != "ha_group" {
		t.Errorf("Join outside a group: %v, want ErrPrerequisite naming ha_group", err)
	}
}

// BenchmarkGroupReplication: what a group's replication costs, against a
// pair's, in one run: edges of a group of three (and, as the baseline, a
// pair) each learn flows through their real north-south program, and the
// group replicator (in process, over the SDK calls the REST routes serve)
// carries them to the other edges by delta; the time of the rounds that
// carry them, per flow and per target edge (µs-per-flow-target), is what
// every edge of a group pays for each flow of every other edge. Blocks of
// the group and of the pair alternate.
func BenchmarkGroupReplication(b *testing.B) {
	ctx := context.Background()
	cat := groupCatalog{func(bs []Backend) []Backend { return bs }}
	var fes []groupFrontend
	for _, fe := range cat.frontends() {
		if fe.vip.Addr() == cat.web().VIPs[0] && fe.proto == conntrack.ProtoTCP {
			fes = append(fes, fe)
		}
	}
	build := func(net int, names ...string) ([]*groupEdge, *ha.GroupReplicator) {
		edges, r := newGroup(b, net, names...)
		// The first round loads the (empty) snapshots: cursors exist.
		if _, err := r.Round(ctx); err != nil {
			b.Fatal(err)
		}
		return edges, r
	}
	group, gr := build(3, "g1", "g2", "g3")
	pair, pr := build(2, "p1", "p2")
	const perEdge = 400 // flows each edge learns a block
	ts := groupTuples(perEdge*3*b.N*4+perEdge*3, fes)
	next := 0
	block := func(edges []*groupEdge, r *ha.GroupReplicator) (time.Duration, int) {
		b.Helper()
		for _, e := range edges {
			e.picks(b, ts[next:next+perEdge], false)
			next += perEdge
		}
		time.Sleep(3 * MinHAInterval) // the journals sealed
		start := time.Now()
		ops := 0
		for range 10 {
			n := deltaRound(b, r)
			if n == 0 {
				break
			}
			ops += n
		}
		return time.Since(start), ops
	}
	var gt, pt time.Duration
	var gops, pops int
	for range b.N * 2 {
		d, n := block(group, gr)
		gt, gops = gt+d, gops+n
		d, n = block(pair, pr)
		pt, pops = pt+d, pops+n
	}
	// Each op is one flow applied on one target edge.
	if gops == 0 || pops == 0 {
		b.Fatal("no op carried")
	}
	b.ReportMetric(float64(gt.Microseconds())/float64(gops), "group-µs-per-flow-target")
	b.ReportMetric(float64(pt.Microseconds())/float64(pops), "pair-µs-per-flow-target")
	b.ReportMetric(float64(gops)/float64(b.N*2), "group-ops-per-block")
	b.ReportMetric(float64(pops)/float64(b.N*2), "pair-ops-per-block")
}
