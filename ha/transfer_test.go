package ha

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/testutils/bpftest"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
	"github.com/fluxvm/servicefabric/nat"
)

// node is one edge of an HA pair in a test: the real TC object with one
// service ("web") of four frontends, under ids of its own.
type node struct {
	t  *testing.T
	th *testenv.Thread
	o  *bpftest.Object
	ct *conntrack.Map
	// sids by frontend, backend ids by address, as this node numbered them.
	sids map[conntrack.Key]uint32 // Client unset: (VIP, proto)
	bids map[netip.AddrPort]uint32
}

// The service's frontends: east-west (derived replies), north-south SNAT,
// east-west with stored reverse halves, east-west IPv6; two backends each.
var frontends = []struct {
	vip      netip.AddrPort
	flags    uint32
	backends []netip.AddrPort
}{
	{netip.MustParseAddrPort("10.96.0.10:80"), 0, []netip.AddrPort{netip.MustParseAddrPort("10.1.0.1:8080"), netip.MustParseAddrPort("10.1.0.2:8080")}},
	{netip.MustParseAddrPort("10.96.0.20:80"), bpf.SvcFlagNorthSouth | bpf.SvcFlagNoEastWest, []netip.AddrPort{netip.MustParseAddrPort("10.2.0.1:8080"), netip.MustParseAddrPort("10.2.0.2:8080")}},
	{netip.MustParseAddrPort("10.96.0.30:80"), bpf.SvcFlagRevStored, []netip.AddrPort{netip.MustParseAddrPort("10.3.0.1:8080"), netip.MustParseAddrPort("10.3.0.2:8080")}},
	{netip.MustParseAddrPort("[fd00:96::10]:80"), 0, []netip.AddrPort{netip.MustParseAddrPort("[fd00:1::1]:8080"), netip.MustParseAddrPort("[fd00:1::2]:8080")}},
}

var (
	snat4 = netip.MustParseAddr("192.0.2.1")
	snat6 = netip.MustParseAddr("2001:db8::1")
)

// newNode loads a node whose datapath ids start at sidBase and bidBase.
func newNode(t *testing.T, sidBase, bidBase uint32) *node {
	t.Helper()
	testenv.RequirePrivileged(t)
	o, err := bpftest.Load(bpf.TierS, bpftest.Sizes{CT: 8192, NAT: 8192})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	nt, err := nat.New(o.Maps.FluxvmNat4, o.Maps.FluxvmNat6)
	if err != nil {
		t.Fatal(err)
	}
	ct, err := conntrack.New(conntrack.Config{CT4: o.Maps.FluxvmFct4, CT6: o.Maps.FluxvmFct6, Backends: o.Maps.FluxvmBackends, NAT: nt})
	if err != nil {
		t.Fatal(err)
	}
	n := &node{t: t, th: testenv.NewThread(t), o: o, ct: ct, sids: map[conntrack.Key]uint32{}, bids: map[netip.AddrPort]uint32{}}
	if err := o.SNAT(snat4, snat6, 20000, 29999); err != nil {
		t.Fatal(err)
	}
	bid := bidBase
	for i, fe := range frontends {
		sid := sidBase + uint32(i)
		var ids []uint32
		for _, b := range fe.backends {
			if err := o.Backend(bid, sid, b, bpf.BackendReady, 0); err != nil {
				t.Fatal(err)
			}
			n.bids[b] = bid
			ids = append(ids, bid)
			bid++
		}
		if err := o.Service(sid, fe.vip, conntrack.ProtoTCP, fe.flags, ids...); err != nil {
			t.Fatal(err)
		}
		n.sids[conntrack.Key{VIP: fe.vip, Proto: conntrack.ProtoTCP}] = sid
	}
	return n
}

func (n *node) source() Source {
	var ids []uint32
	for _, sid := range n.sids {
		ids = append(ids, sid)
	}
	return Source{CT: n.ct, ServiceIDs: ids, Backend: func(id uint32) (netip.AddrPort, bool) {
		for ap, b := range n.bids {
			if b == id {
				return ap, true
			}
		}
		return netip.AddrPort{}, false
	}}
}

func (n *node) target() Target {
	return Target{CT: n.ct, Service: "web",
		Frontend: func(vip netip.AddrPort, proto uint8) (uint32, bool) {
			sid, ok := n.sids[conntrack.Key{VIP: vip, Proto: proto}]
			return sid, ok
		},
		BackendID: func(sid uint32, addr netip.AddrPort) (uint32, bool) {
			id, ok := n.bids[addr]
			return id, ok
		}}
}

// send passes one client packet of flow k through the program of its
// edge and returns the verdict and the packet as it left.
func (n *node) send(k conntrack.Key, f pkt.TCPFlags, northSouth bool) (uint32, netip.AddrPort, netip.AddrPort) {
	n.t.Helper()
	prog := n.o.Programs.FluxvmFromVm
	if northSouth {
		prog = n.o.Programs.FluxvmNsIn
	}
	var ret uint32
	var out []byte
	var err error
	n.th.Do(func() { ret, out, err = bpftest.Run(prog, bpftest.Frame(k.Client, k.VIP, k.Proto, f)) })
	if err != nil {
		n.t.Fatal(err)
	}
	src, dst := bpftest.Endpoints(out)
	return ret, src, dst
}

// liveFlow is a flow node A's datapath learned, and how A sent its
// packets on.
type liveFlow struct {
	k          conntrack.Key
	northSouth bool
	src, dst   netip.AddrPort
}

// open makes n's datapath learn flow i of a mix over the service's
// frontends (a SYN, then an ACK whose translation it records).
func (n *node) open(i int, port uint16) liveFlow {
	n.t.Helper()
	fe := frontends[i%len(frontends)]
	ns := fe.flags&bpf.SvcFlagNorthSouth != 0
	client := netip.MustParseAddr(fmt.Sprintf("10.0.%d.%d", i/200, 1+i%200))
	switch {
	case fe.vip.Addr().Is6():
		client = netip.MustParseAddr(fmt.Sprintf("fd00::%x", 1+i))
	case ns:
		client = netip.MustParseAddr(fmt.Sprintf("198.51.100.%d", 1+i))
	}
	k := conntrack.Key{Client: netip.AddrPortFrom(client, port), VIP: fe.vip, Proto: conntrack.ProtoTCP}
	n.send(k, pkt.SYN, ns)
	ret, src, dst := n.send(k, pkt.ACK, ns)
	if ret != bpftest.TCOK {
		n.t.Fatalf("%s: verdict %d", k, int32(ret))
	}
	return liveFlow{k, ns, src, dst}
}

// TestTransfer: flows learned by the real datapath on one node, exported
// and imported into a node that numbers services and backends otherwise,
// continue there on the same backend with the same translated source, and
// their replies are translated back; a second import changes nothing; a
// flow the target saw more recently is kept; a snapshot of another
// service, or one the target's Accept refuses, applies nothing.
func TestTransfer(t *testing.T) {
	a, b := newNode(t, 1, 1), newNode(t, 40, 100)
	var flows []liveFlow
	for i := 0; i < 40; i++ {
		flows = append(flows, a.open(i, uint16(40000+i)))
	}

	var snap bytes.Buffer
	seeds := Seeds{FlowHash: 0x5eed, Maglev: 7}
	h := Header{Node: "a", Service: "web", Epoch: 3, Journal: "j", Seq: 9, Seeds: &seeds}
	exp, err := Export(context.Background(), &snap, h, a.source())
	if err != nil || exp.Flows != uint64(len(flows)) {
		t.Fatalf("export: %+v, %v; want %d flows", exp, err, len(flows))
	}
	data := snap.Bytes()

	// Refused before any flow: another service; the target's judgement.
	other := b.target()
	other.Service = "api"
	if _, err := Import(context.Background(), bytes.NewReader(data), other); !errors.Is(err, ErrService) {
		t.Errorf("import of web's snapshot into api: %v, want ErrService", err)
	}
	stale := errors.New("stale epoch")
	refusing := b.target()
	refusing.Accept = func(h Header) error {
		if h.Epoch < 5 {
			return stale
		}
		return nil
	}
	if _, err := Import(context.Background(), bytes.NewReader(data), refusing); !errors.Is(err, stale) {
		t.Errorf("import the target refuses: %v", err)
	}
	// An edge of other seeds: refused before its Accept is asked.
	for _, other := range []Seeds{{FlowHash: seeds.FlowHash, Maglev: 8}, {FlowHash: 1, Maglev: seeds.Maglev}} {
		judged := false
		tg := b.target()
		tg.Seeds, tg.Accept = &other, func(Header) error { judged = true; return nil }
		if _, err := Import(context.Background(), bytes.NewReader(data), tg); !errors.Is(err, ErrSeeds) || judged {
			t.Errorf("import into an edge of %s: %v (accept asked: %v), want ErrSeeds before the accept", other, err, judged)
		}
	}
	if es, _ := b.ct.List(conntrack.Filter{}); len(es) != 0 {
		t.Fatalf("refused imports wrote %d flows", len(es))
	}

	same := b.target()
	same.Seeds = &Seeds{FlowHash: seeds.FlowHash, Maglev: seeds.Maglev}
	res, err := Import(context.Background(), bytes.NewReader(data), same)
	if err != nil || res.Written != uint64(len(flows)) || res.Header.Epoch != 3 || res.Header.Seq != 9 {
		t.Fatalf("import: %+v, %v", res, err)
	}
	for _, f := range flows {
		ea, _ := a.ct.Lookup(f.k)
		eb, err := b.ct.Lookup(f.k)
		if err != nil {
			t.Fatalf("%s: not on node B: %v", f.k, err)
		}
		if eb.Kind != ea.Kind || eb.State != ea.State || eb.SNAT != ea.SNAT || eb.ReverseDerived != ea.ReverseDerived ||
			eb.ServiceID != b.sids[conntrack.Key{VIP: f.k.VIP, Proto: f.k.Proto}] {
			t.Errorf("%s: on B %+v\n on A %+v", f.k, eb, ea)
		}
		// The flow goes on on B exactly as on A.
		ret, src, dst := b.send(f.k, pkt.ACK, f.northSouth)
		if ret != bpftest.TCOK || src != f.src || dst != f.dst {
			t.Errorf("%s: on B %d %s -> %s, on A %s -> %s", f.k, int32(ret), src, dst, f.src, f.dst)
		}
		// And its replies are translated back on B.
		if f.northSouth {
			var out []byte
			b.th.Do(func() {
				_, out, err = bpftest.Run(b.o.Programs.FluxvmNsIn, bpftest.Frame(f.dst, f.src, f.k.Proto, pkt.ACK))
			})
			if s, d := bpftest.Endpoints(out); s != f.k.VIP || d != f.k.Client {
				t.Errorf("%s: reply on B left as %s -> %s", f.k, s, d)
			}
		}
	}
	if _, broken := pairs(t, b); broken != 0 {
		t.Errorf("%d flows on B without their reverse half", broken)
	}

	// A target whose SNAT address is another skips the SNAT flows.
	c := newNode(t, 60, 200)
	elsewhere := c.target()
	elsewhere.SNATAddrs = []netip.Addr{netip.MustParseAddr("192.0.2.99"), snat6}
	r2, err := Import(context.Background(), bytes.NewReader(data), elsewhere)
	if err != nil || r2.ForeignSNAT == 0 || r2.Written+r2.ForeignSNAT != uint64(len(flows)) {
		t.Errorf("import with another SNAT address: %+v, %v; want the SNAT flows skipped", r2, err)
	}

	// Again: nothing written (every flow is as fresh on B).
	if res, err := Import(context.Background(), bytes.NewReader(data), b.target()); err != nil || res.Written != 0 || res.Fresher != uint64(len(flows)) {
		t.Errorf("second import: %+v, %v; want all %d kept", res, err, len(flows))
	}
}

// pairs counts B's flows that should have a reverse half and those whose
// half is missing.
func pairs(t *testing.T, n *node) (flows, broken int) {
	es, err := n.ct.List(conntrack.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		if !e.HasNATHalf() {
			continue
		}
		flows++
		var be netip.AddrPort
		for ap, id := range n.bids {
			if id == e.BackendID {
				be = ap
			}
		}
		k := nat.Key{Backend: be, Client: e.Client, Proto: e.Proto}
		if e.Kind == conntrack.SNAT {
			k.Client = e.SNAT
		}
		if _, err := n.ct.NAT().Lookup(k); err != nil {
			broken++
		}
	}
	return flows, broken
}

// TestTransferKeepsFresher: a flow the target has seen after the export
// keeps the target's state; a snapshot's expired flows are not carried.
func TestTransferKeepsFresher(t *testing.T) {
	a, b := newNode(t, 1, 1), newNode(t, 40, 100)
	k := conntrack.Key{Client: netip.MustParseAddrPort("10.0.0.9:41000"), VIP: frontends[0].vip, Proto: conntrack.ProtoTCP}
	a.send(k, pkt.SYN, false)
	var snap bytes.Buffer
	if _, err := Export(context.Background(), &snap, Header{Node: "a", Service: "web", Epoch: 1, Seeds: &Seeds{}}, a.source()); err != nil {
		t.Fatal(err)
	}
	// B learned the flow itself since (a SYN-ACK's later ACK): its entry
	// is last seen after A's, and stays as it is.
	time.Sleep(20 * time.Millisecond)
	b.send(k, pkt.SYN, false)
	b.send(k, pkt.ACK, false)
	before, _ := b.ct.Lookup(k)
	res, err := Import(context.Background(), &snap, b.target())
	if err != nil || res.Written != 0 || res.Fresher != 1 {
		t.Fatalf("import: %+v, %v; want the flow kept", res, err)
	}
	if after, _ := b.ct.Lookup(k); after != before {
		t.Errorf("B's fresher flow changed: %+v\nwas %+v", after, before)
	}
	// Expired on A: not exported.
	exp, err := Export(context.Background(), &bytes.Buffer{}, Header{Node: "a", Service: "web", Epoch: 1, Seeds: &Seeds{}},
		Source{CT: a.ct, ServiceIDs: a.source().ServiceIDs, Backend: a.source().Backend,
			Now: func() (time.Duration, error) { return 100 * time.Hour * 24, nil }})
	if err != nil || exp.Flows != 0 || exp.Expired != 1 {
		t.Errorf("export in the far future: %+v, %v; want the flow expired", exp, err)
	}
}

// TestExportCarriesHold: while HA is on the datapath queues a flow's next
// refresh only when its deadline passes the hold its last record gave
// the standby (HAUntil), so a snapshot must give the standby as much: an
// imported copy never expires before the active's entry could, short of
// another record.
func TestExportCarriesHold(t *testing.T) {
	a, b := newNode(t, 1, 1), newNode(t, 40, 100)
	a.haOn()
	f := a.open(1, 40001) // north-south: SYN, then the ACK's transition
	e, err := a.ct.Lookup(f.k)
	if err != nil {
		t.Fatal(err)
	}
	if e.HAUntil <= e.Deadline {
		t.Fatalf("entry %+v: HAUntil %v not past the deadline %v after a transition's record", e.Key, e.HAUntil, e.Deadline)
	}
	var snap bytes.Buffer
	if _, err := Export(context.Background(), &snap, Header{Service: "web", Epoch: 1, Seeds: &Seeds{}}, a.source()); err != nil {
		t.Fatal(err)
	}
	if _, err := Import(context.Background(), &snap, b.target()); err != nil {
		t.Fatal(err)
	}
	g, err := b.ct.Lookup(f.k)
	if err != nil {
		t.Fatal(err)
	}
	// The clocks are the same machine's; a second of slack for the
	// import's anchoring and HAUntil's rounding down.
	if g.Deadline < e.HAUntil-time.Second {
		t.Errorf("imported deadline %v, before the hold %v the active's last record gave", g.Deadline, e.HAUntil)
	}
}
