package fluxvm

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/group"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// groupEdge is one edge of a group behind ECMP: a dataplane in a lab node
// namespace of its own, with its own pin root, serving north-south on the
// node's uplink.
type groupEdge struct {
	name string
	lab  *lab.Lab
	root string
	opts Options
	d    *Dataplane
}

func newGroupEdge(t *testing.T, name string, s seeds) *groupEdge {
	t.Helper()
	return newGroupEdgeHA(t, name, s, HAOptions{})
}

// newGroupEdgeHA is newGroupEdge with replication options (the zero
// HAOptions: none).
func newGroupEdgeHA(t *testing.T, name string, s seeds, h HAOptions) *groupEdge {
	t.Helper()
	return newGroupEdgeWith(t, name, s, func(o *Options) { o.HA = h })
}

// newGroupEdgeWith is newGroupEdge with options changed by set before the
// dataplane opens.
func newGroupEdgeWith(t testing.TB, name string, s seeds, set func(*Options)) *groupEdge {
	t.Helper()
	l := lab.NewForTest(t)
	if _, err := l.AddExternal(); err != nil {
		t.Fatal(err)
	}
	e := &groupEdge{name: name, lab: l, root: filepath.Join(testenv.PinRoot(t), "service")}
	e.opts = Options{
		Loader:              bpf.Options{PinRoot: e.root, Tier: bpf.TierS},
		NodeName:            name,
		CatalogPath:         filepath.Join(t.TempDir(), "catalog.json"),
		ConntrackGCInterval: -1,
		InNamespace:         l.Node.Do,
		NorthSouth: NorthSouth{Interfaces: []string{nsUplink}, SNATAddress: nsSNAT4, SNATAddressV6: nsSNAT6,
			SNATPortMin: 1024, SNATPortMax: 65535},
		Logger: slog.New(slog.DiscardHandler),
	}
	set(&e.opts)
	e.open(t, s)
	return e
}

// open (re)opens the edge's dataplane with seeds s, on its pins and
// catalog.
func (e *groupEdge) open(t testing.TB, s seeds) {
	t.Helper()
	e.opts.Loader.HashSeed, e.opts.MaglevSeed = s.hash, s.maglev
	d, err := Open(context.Background(), e.opts)
	if err != nil {
		t.Fatalf("open edge %s: %v", e.name, err)
	}
	t.Cleanup(func() { d.Close() })
	e.d = d
}

// apply applies each service in turn, as Fabric would, one call each.
func (e *groupEdge) apply(t testing.TB, svcs ...Service) {
	t.Helper()
	for _, s := range svcs {
		if _, err := e.d.ApplyService(context.Background(), s); err != nil {
			t.Fatalf("edge %s: apply %s: %v", e.name, s.Name, err)
		}
	}
}

// edge reads the edge as a member of its group: its seeds from its
// status, its Maglev tables as backend addresses from its pinned maps
// (a read-only view, as a second process would).
func (e *groupEdge) edge(t *testing.T) group.Edge {
	t.Helper()
	v, err := bpf.OpenView(e.root)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	tabs, err := v.MaglevBackends()
	if err != nil {
		t.Fatalf("edge %s: %v", e.name, err)
	}
	st := e.d.Status().Seeds
	out := group.Edge{Name: e.name, Seeds: group.Seeds{FlowHash: st.FlowHash, Maglev: st.Maglev}, Tables: map[string][]netip.AddrPort{}}
	for fe, slots := range tabs {
		out.Tables[fe.String()] = slots
	}
	return out
}

// rawTables reads the edge's Maglev tables as the datapath holds them:
// backend ids, which are the edge's own.
func (e *groupEdge) rawTables(t *testing.T, fes []groupFrontend) map[groupFrontend][]uint32 {
	t.Helper()
	v, err := bpf.OpenView(e.root)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	out := map[groupFrontend][]uint32{}
	for _, fe := range fes {
		var sv bpf.SvcValue
		if fe.vip.Addr().Is4() {
			err = v.Maps().FluxvmSvc4.Lookup(bpf.SvcKey4{Vip: bpf.AddrWords(fe.vip.Addr())[0], Port: bpf.Port(fe.vip.Port()), Proto: fe.proto}, &sv)
		} else {
			err = v.Maps().FluxvmSvc6.Lookup(bpf.SvcKey6{Vip: bpf.AddrWords(fe.vip.Addr()), Port: bpf.Port(fe.vip.Port()), Proto: fe.proto}, &sv)
		}
		if err != nil {
			t.Fatalf("edge %s: frontend %v: %v", e.name, fe, err)
		}
		ids, err := v.MaglevTable(sv.ServiceId)
		if err != nil {
			t.Fatal(err)
		}
		out[fe] = append([]uint32{sv.ServiceId}, ids...)
	}
	return out
}

// flowMaps dumps the edge's conntrack and NAT maps byte for byte.
func (e *groupEdge) flowMaps(t *testing.T) map[string]string {
	t.Helper()
	v, err := bpf.OpenView(e.root)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	out := map[string]string{}
	m := v.Maps()
	for name, mp := range map[string]*ebpf.Map{"fct4": m.FluxvmFct4, "fct6": m.FluxvmFct6, "nat4": m.FluxvmNat4, "nat6": m.FluxvmNat6} {
		var k, val []byte
		it := mp.Iterate()
		for it.Next(&k, &val) {
			out[name+" "+hex.EncodeToString(k)] = hex.EncodeToString(val)
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// groupFrontend is a frontend the tuples address.
type groupFrontend struct {
	vip   netip.AddrPort
	proto uint8
}

// groupTuple is one client flow and the frame of its first packet.
type groupTuple struct {
	key   conntrack.Key
	frame []byte
}

// groupTuples crafts n first packets (TCP SYNs, UDP datagrams) from
// distinct external clients, spread over the frontends.
func groupTuples(n int, fes []groupFrontend) []groupTuple {
	out := make([]groupTuple, n)
	for i := range out {
		fe := fes[i%len(fes)]
		c := i / len(fes)
		port := uint16(1024 + (c*7919)%64000)
		client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{100, 64 + byte(c>>16), byte(c >> 8), byte(c)}), port)
		if fe.vip.Addr().Is6() {
			client = netip.AddrPortFrom(netip.MustParseAddr(fmt.Sprintf("2001:db8:64::%x:%x", c>>16, c&0xffff)), port)
		}
		out[i].key = conntrack.Key{Client: client, VIP: fe.vip, Proto: fe.proto}
		if fe.proto == conntrack.ProtoTCP {
			out[i].frame = pkt.TCP(client, fe.vip, pkt.SYN, nil)
		} else {
			out[i].frame = pkt.UDP(client, fe.vip, []byte("q"))
		}
	}
	return out
}

// picks runs the edge's north-south entry program (fluxvm_ns_in) on each
// tuple's first packet with BPF_PROG_TEST_RUN, in the edge's node
// namespace, and returns the destination of the rewritten packet: the
// backend the datapath picked. With forget, each flow is deleted again
// (conntrack and NAT halves), so that a hundred thousand tuples neither
// fill the maps nor exhaust SNAT ports.
func (e *groupEdge) picks(t testing.TB, tuples []groupTuple, forget bool) []netip.AddrPort {
	t.Helper()
	prog := e.d.dp.Programs().FluxvmNsIn
	ct, err := e.d.Conntrack()
	if err != nil {
		t.Fatal(err)
	}
	out := make([]netip.AddrPort, len(tuples))
	buf := make([]byte, 512)
	err = e.lab.Node.Do(func() error {
		for i, tu := range tuples {
			opts := ebpf.RunOptions{Data: tu.frame, DataOut: buf, Repeat: 1}
			ret, err := prog.Run(&opts)
			if err != nil {
				return err
			}
			if ret != 0 && ret != 7 { // TC_ACT_OK, TC_ACT_REDIRECT: translated and sent on
				return fmt.Errorf("%s: verdict %d", tu.key, int32(ret))
			}
			p := pkt.Decode(opts.DataOut)
			nl, tl := p.NetworkLayer(), p.TransportLayer()
			if nl == nil || tl == nil {
				return fmt.Errorf("%s: undecodable output", tu.key)
			}
			a, _ := netip.AddrFromSlice(nl.NetworkFlow().Dst().Raw())
			dp := tl.TransportFlow().Dst().Raw()
			out[i] = netip.AddrPortFrom(a.Unmap(), uint16(dp[0])<<8|uint16(dp[1]))
			if forget {
				if err := ct.Delete(tu.key); err != nil {
					return fmt.Errorf("%s: forget: %w", tu.key, err)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("edge %s: %v", e.name, err)
	}
	return out
}

// groupCatalog is the catalog of the group: a plain service on two
// protocols, a weighted one, and one whose backend set changes after it
// is created (changedSteps, then its final form). order permutes every
// backend list, so that an edge learns the backends in another order.
type groupCatalog struct {
	order func(bs []Backend) []Backend
}

func groupBackends(from, to int, weights ...uint32) []Backend {
	var out []Backend
	for i := from; i <= to; i++ {
		var w *uint32
		if len(weights) > 0 {
			w = u32(weights[(i-from)%len(weights)])
		}
		out = append(out,
			Backend{Address: netip.AddrFrom4([4]byte{10, 201, byte(i), 2}), Port: 8080, Weight: w},
			Backend{Address: netip.MustParseAddr(fmt.Sprintf("fd00:201:%x::2", i)), Port: 8080, Weight: w})
	}
	return out
}

func (c groupCatalog) svc(name string, n byte, ports []ServicePort, bs []Backend) Service {
	return Service{Name: name, Exposure: ExposureNorthSouth,
		VIPs:  []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 7, n}), netip.MustParseAddr(fmt.Sprintf("fd00:96:7::%d", n))},
		Ports: ports, Backends: c.order(slices.Clone(bs))}
}

func (c groupCatalog) web() Service {
	return c.svc("web", 1, []ServicePort{{Port: 80, Protocol: TCP}, {Port: 53, Protocol: UDP}}, groupBackends(1, 8))
}

func (c groupCatalog) weighted() Service {
	return c.svc("weighted", 2, []ServicePort{{Port: 443, Protocol: TCP}}, groupBackends(9, 14, 1, 2, 3, 5, 8, 13))
}

// changedSteps are the forms of "changed" before its final one: created
// with equal weights, a backend's weight raised, a backend removed; the
// final form has the backend back.
func (c groupCatalog) changedSteps() []Service {
	all := groupBackends(15, 22)
	raised := slices.Clone(all)
	raised[2].Weight, raised[3].Weight = u32(4), u32(4)  // backend 16, both families
	removed := slices.Delete(slices.Clone(raised), 6, 8) // backend 18
	return []Service{c.changedOf(all), c.changedOf(raised), c.changedOf(removed)}
}

func (c groupCatalog) changed() Service {
	all := groupBackends(15, 22)
	all[2].Weight, all[3].Weight = u32(4), u32(4)
	return c.changedOf(all)
}

func (c groupCatalog) changedOf(bs []Backend) Service {
	return c.svc("changed", 3, []ServicePort{{Port: 8443, Protocol: TCP}}, bs)
}

func (c groupCatalog) frontends() []groupFrontend {
	var out []groupFrontend
	for _, s := range []Service{c.web(), c.weighted(), c.changed()} {
		for _, vip := range s.VIPs {
			for _, p := range s.Ports {
				out = append(out, groupFrontend{netip.AddrPortFrom(vip, p.Port), p.Protocol.Number()})
			}
		}
	}
	return out
}

// TestGroupConsistency: three edges (lab node namespaces of their own,
// pin roots of their own, the same seeds) given the same catalog in
// another order each (so that their service and backend ids differ) hold
// the same backend address in every slot of every Maglev table, read from
// their pinned maps, and their north-south programs send each of 100,000
// tuples to the same backend. An edge with another maglev_seed is
// reported by the comparison (its seeds and the slots that differ), sends
// tuples elsewhere, and refuses a snapshot of the group's flows without
// changing a byte of its flow maps.
func TestGroupConsistency(t *testing.T) {
	const tuples = 100_000
	same := seeds{hash: 0x5eed_0f_9e0e, maglev: 42}
	ident := func(bs []Backend) []Backend { return bs }
	reverse := func(bs []Backend) []Backend { slices.Reverse(bs); return bs }
	rotate := func(bs []Backend) []Backend { return append(bs[3:], bs[:3]...) }

	a, b, c := newGroupEdge(t, "edge-a", same), newGroupEdge(t, "edge-b", same), newGroupEdge(t, "edge-c", same)
	// Edge a: in catalog order, "changed" through its history.
	ca := groupCatalog{ident}
	a.apply(t, ca.web(), ca.weighted())
	a.apply(t, ca.changedSteps()...)
	a.apply(t, ca.changed())
	// Edge b: the other way round, every backend list reversed.
	cb := groupCatalog{reverse}
	b.apply(t, cb.changedSteps()...)
	b.apply(t, cb.changed(), cb.weighted(), cb.web())
	// Edge c: ids taken by a service that is gone again, lists rotated,
	// "changed" in its final form at once.
	cc := groupCatalog{rotate}
	decoy := cc.svc("decoy", 9, []ServicePort{{Port: 80, Protocol: TCP}}, groupBackends(40, 49))
	c.apply(t, decoy, cc.weighted())
	if err := c.d.DeleteService(context.Background(), "decoy"); err != nil {
		t.Fatal(err)
	}
	c.apply(t, cc.changed(), cc.web())

	// The ids differ between the edges, or comparing addresses would
	// prove nothing more than comparing ids.
	fes := ca.frontends()
	ra, rb, rc := a.rawTables(t, fes), b.rawTables(t, fes), c.rawTables(t, fes)
	for _, other := range []map[groupFrontend][]uint32{rb, rc} {
		differ := 0
		for _, fe := range fes {
			if !slices.Equal(ra[fe], other[fe]) {
				differ++
			}
		}
		if differ < len(fes)/2 {
			t.Fatalf("only %d of %d frontends have other service or backend ids on another edge: the test proves nothing", differ, len(fes))
		}
	}

	// Every slot names the same backend address on every edge.
	ea, eb, ec := a.edge(t), b.edge(t), c.edge(t)
	r := group.Compare(ea, eb, ec)
	if err := r.Err(); err != nil {
		t.Fatalf("edges with the same catalog and seeds: %v", err)
	}
	if r.Frontends != len(fes) || r.Slots < len(fes)*251 {
		t.Fatalf("compared %d frontends, %d slots; want the %d frontends of the catalog, tables of 251 slots or more", r.Frontends, r.Slots, len(fes))
	}
	// The tables are the catalog's: the weighted service's backends hold
	// slots in the order of their weights, and "changed" uses backend 18
	// again.
	checkWeights(t, ea.Tables["10.96.7.2:443/tcp"], groupBackends(9, 14, 1, 2, 3, 5, 8, 13))
	if !slices.Contains(ea.Tables["10.96.7.3:8443/tcp"], netip.MustParseAddrPort("10.201.18.2:8080")) {
		t.Error("the re-added backend holds no slot of changed")
	}

	// Every tuple goes to the same backend on every edge.
	ts := groupTuples(tuples, fes)
	start := time.Now()
	pa := a.picks(t, ts, true)
	t.Logf("%d tuples through edge a's fluxvm_ns_in in %v (each run, decoded and forgotten)", tuples, time.Since(start).Round(time.Millisecond))
	used := map[netip.AddrPort]bool{}
	for i, p := range pa {
		used[p] = true
		if !slices.Contains(ea.Tables[bpf.Frontend{VIP: ts[i].key.VIP.Addr(), Port: ts[i].key.VIP.Port(), Proto: ts[i].key.Proto}.String()], p) {
			t.Fatalf("%s went to %s, not a backend of its frontend's table", ts[i].key, p)
		}
	}
	if len(used) < 40 {
		t.Fatalf("%d tuples went to only %d backends, want every backend of the catalog (44)", tuples, len(used))
	}
	for _, e := range []*groupEdge{b, c} {
		start := time.Now()
		pe := e.picks(t, ts, true)
		t.Logf("edge %s: %v", e.name, time.Since(start).Round(time.Millisecond))
		if n, first := differingPicks(ts, pa, pe); n != 0 {
			t.Errorf("edge %s sends %d of %d tuples elsewhere than edge a, first %s", e.name, n, tuples, first)
		}
	}

	// An edge of another Maglev seed, same catalog: the comparison names
	// it, its seeds and its slots; it sends tuples elsewhere.
	other := seeds{hash: same.hash, maglev: same.maglev + 1}
	d := newGroupEdge(t, "edge-d", other)
	cd := groupCatalog{ident}
	d.apply(t, cd.web(), cd.weighted(), cd.changed())
	ed := d.edge(t)
	r = group.Compare(ea, eb, ed, ec)
	err := r.Err()
	if !errors.Is(err, group.ErrSeeds) || !errors.Is(err, group.ErrTables) {
		t.Fatalf("an edge of another maglev_seed: %v, want ErrSeeds and ErrTables", err)
	}
	if len(r.Seeds) != 1 || r.Seeds[0].Edge != "edge-d" || r.Seeds[0].Seeds != ed.Seeds || r.Seeds[0].Ref != ea.Seeds {
		t.Errorf("seed differences %+v, want edge-d's alone", r.Seeds)
	}
	if !strings.Contains(err.Error(), "edge edge-d has hash_seed=0x5eed0f9e0e maglev_seed=0x2b, edge-a has hash_seed=0x5eed0f9e0e maglev_seed=0x2a") {
		t.Errorf("the report does not name both seeds: %v", err)
	}
	for _, td := range r.Tables {
		if td.Edge != "edge-d" || td.Missing || td.Extra || td.Differing < td.RefSize/4 || len(td.First) == 0 {
			t.Errorf("table difference %+v: want edge-d's, a quarter of the slots or more", td)
		}
	}
	if len(r.Tables) != len(fes) {
		t.Errorf("%d frontends reported, want all %d of edge-d's", len(r.Tables), len(fes))
	}
	t.Logf("the report: %.300s...", err)
	sample := ts[:10_000]
	if n, _ := differingPicks(sample, pa, d.picks(t, sample, true)); n < len(sample)/4 {
		t.Errorf("edge d sends only %d of %d tuples elsewhere", n, len(sample))
	}

	// A snapshot of edge a's flows: refused by edge d, whose flow maps
	// stay byte for byte; taken by edge b (the same seeds).
	mine, theirs := groupTuples(600, fes), groupTuples(1200, fes)[600:]
	a.picks(t, mine, false)
	d.picks(t, theirs, false)
	var snap bytes.Buffer
	exp, err := a.d.ExportFlows(context.Background(), "web", &snap)
	if err != nil || exp.Flows == 0 {
		t.Fatalf("export: %+v, %v", exp, err)
	}
	before := d.flowMaps(t)
	if len(before) == 0 {
		t.Fatal("edge d holds no flows: the refusal would prove nothing")
	}
	_, err = d.d.ImportFlows(context.Background(), "web", bytes.NewReader(snap.Bytes()), true)
	if !errors.Is(err, ha.ErrSeeds) || !strings.Contains(err.Error(), "maglev_seed=0x2a") || !strings.Contains(err.Error(), "maglev_seed=0x2b") {
		t.Fatalf("import into an edge of another maglev_seed: %v, want ha.ErrSeeds naming both seeds", err)
	}
	if after := d.flowMaps(t); !maps.Equal(before, after) {
		t.Errorf("a refused import changed edge d's flow maps: %d entries before, %d after", len(before), len(after))
	}
	res, err := b.d.ImportFlows(context.Background(), "web", bytes.NewReader(snap.Bytes()), false)
	if err != nil || res.Written != exp.Flows || res.Header.Seeds == nil || *res.Header.Seeds != ea.Seeds {
		t.Fatalf("import into an edge of the same seeds: %+v, %v; want %d flows written, seeds %s", res, err, exp.Flows, ea.Seeds)
	}
}

// differingPicks counts the tuples two edges sent to different backends.
func differingPicks(ts []groupTuple, a, b []netip.AddrPort) (int, string) {
	n, first := 0, ""
	for i := range ts {
		if a[i] != b[i] {
			if n++; n == 1 {
				first = fmt.Sprintf("%s: %s and %s", ts[i].key, a[i], b[i])
			}
		}
	}
	return n, first
}

// checkWeights checks that each backend holds a share of the table's
// slots within a fifth of its weight's share.
func checkWeights(t *testing.T, slots []netip.AddrPort, bs []Backend) {
	t.Helper()
	count := map[netip.AddrPort]int{}
	for _, s := range slots {
		count[s]++
	}
	var total uint32
	for _, b := range bs {
		if b.Address.Is4() {
			total += *b.Weight
		}
	}
	for _, b := range bs {
		if !b.Address.Is4() {
			continue
		}
		want := float64(len(slots)) * float64(*b.Weight) / float64(total)
		if got := float64(count[netip.AddrPortFrom(b.Address, b.Port)]); got < want*0.8 || got > want*1.2 {
			t.Errorf("backend %s of weight %d holds %v slots, want about %.0f", b.Address, *b.Weight, got, want)
		}
	}
}

// TestGroupDeltasFollowACheckedSnapshot: deltas carry no seeds and need
// none. An edge applies a delta only to continue the cursor a snapshot
// set, and seeds change only when a dataplane is opened again, which
// forgets the cursors: the standby reopened with another maglev_seed
// refuses the active's next delta (ha.ErrResetRequired) and the snapshot
// that would reset it (ha.ErrSeeds), its flow maps unchanged by both.
// Before the reopen, with the same seeds, the snapshot and a delta both
// apply (the control).
func TestGroupDeltasFollowACheckedSnapshot(t *testing.T) {
	ctx := context.Background()
	same := seeds{hash: 0x5eed, maglev: 42}
	a := newGroupEdgeHA(t, "edge-a", same, HAOptions{Epoch: 2, Interval: MinHAInterval})
	b := newGroupEdgeHA(t, "edge-b", same, HAOptions{Epoch: 1, Interval: MinHAInterval})
	cat := groupCatalog{func(bs []Backend) []Backend { return bs }}
	a.apply(t, cat.web())
	b.apply(t, cat.web())
	var fes []groupFrontend
	for _, fe := range cat.frontends() {
		if fe.vip.Addr() == cat.web().VIPs[0] || fe.vip.Addr() == cat.web().VIPs[1] {
			fes = append(fes, fe)
		}
	}
	ts := groupTuples(600, fes)

	a.picks(t, ts[:200], false)
	export := func() []byte {
		t.Helper()
		var snap bytes.Buffer
		if exp, err := a.d.ExportFlows(ctx, "web", &snap); err != nil || exp.Flows < 200 {
			t.Fatalf("export: %+v, %v; want 200 flows or more", exp, err)
		}
		return snap.Bytes()
	}
	if res, err := b.d.ImportFlows(ctx, "web", bytes.NewReader(export()), false); err != nil || res.Written < 200 {
		t.Fatalf("snapshot into the standby of the same seeds: %+v, %v", res, err)
	}
	cur := b.d.HA().Status().Cursors["web"]
	a.picks(t, ts[200:400], false)
	delta := groupDelta(t, a, cur, 200)
	if dr, err := b.d.HA().ImportFlowDelta(ctx, "web", delta); err != nil || dr.Applied.Written < 200 {
		t.Fatalf("delta into the standby of the same seeds: %+v, %v", dr, err)
	}

	// The standby comes back with another maglev_seed.
	if err := b.d.Close(); err != nil {
		t.Fatal(err)
	}
	b.open(t, seeds{hash: same.hash, maglev: same.maglev + 1})
	a.picks(t, ts[400:], false)
	next := groupDelta(t, a, ha.Cursor{Journal: delta.Journal, Seq: delta.To}, 200)
	before := b.flowMaps(t)
	if len(before) == 0 {
		t.Fatal("the standby holds no flows: refusals would prove nothing")
	}
	if _, err := b.d.HA().ImportFlowDelta(ctx, "web", next); !errors.Is(err, ha.ErrResetRequired) {
		t.Errorf("the active's next delta into the reopened standby: %v, want ErrResetRequired", err)
	}
	if _, err := b.d.ImportFlows(ctx, "web", bytes.NewReader(export()), false); !errors.Is(err, ha.ErrSeeds) {
		t.Errorf("the resync snapshot into the standby of another maglev_seed: %v, want ErrSeeds", err)
	}
	if after := b.flowMaps(t); !maps.Equal(before, after) {
		t.Errorf("refused imports changed the standby's flow maps: %d entries before, %d after", len(before), len(after))
	}
	if c, ok := b.d.HA().Status().Cursors["web"]; ok {
		t.Errorf("the reopened standby holds cursor %+v after the refusals", c)
	}
}

// groupDelta waits for the edge's journal of "web" to hold at least ops
// ops after cursor c and returns them.
func groupDelta(t *testing.T, e *groupEdge, c ha.Cursor, ops int) ha.Delta {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		delta, err := e.d.HA().FlowDelta(context.Background(), "web", FlowDeltaRequest{Journal: c.Journal, Seq: c.Seq})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, b := range delta.Batches {
			n += len(b.Ops)
		}
		if n >= ops && !delta.ResetRequired {
			return delta
		}
		if time.Now().After(deadline) {
			t.Fatalf("edge %s: delta after %s/%d: %d ops (reset %v), want %d", e.name, c.Journal, c.Seq, n, delta.ResetRequired, ops)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
