package fluxvm

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestExportImportFlows: a node's flows exported, its conntrack then lost
// and the backends reweighted so that Maglev sends new flows to one VM
// only: importing the snapshot puts every open connection back on the
// backend it had, and each goes on (a connection re-picked to another VM
// would be reset there). Then the journal: flows learned after the
// snapshot's checkpoint come as a delta that continues the cursor the
// import set, once; leases fence what is stale, and survive a restart.
func TestExportImportFlows(t *testing.T) {
	e := newNSEnv(t)
	e.opts.HA = HAOptions{Epoch: 3, Interval: MinHAInterval}
	d := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 1, 1)
	svc.Ports = []ServicePort{{Port: 80, Protocol: TCP}}
	svc.Exposure = ExposureBoth
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if delta, err := d.HA().FlowDelta(context.Background(), "web", FlowDeltaRequest{}); err != nil || !delta.ResetRequired {
		t.Fatalf("delta for a standby with no state: %+v, %v; want reset_required", delta, err)
	}
	var conns []*lab.Conn
	elsewhere := 0
	for i := 0; i < 24; i++ {
		c := e.dial(t, []netip.Addr{vip4, vip6}[i%2])
		echo(t, c, "before")
		if c.Backend != e.backends[0].Name {
			elsewhere++
		}
		conns = append(conns, c)
	}
	if elsewhere == 0 {
		t.Fatal("every connection is on the first VM: the test proves nothing")
	}
	// The last ACKs settle, so that no packet re-creates a flow the test
	// deletes below.
	time.Sleep(300 * time.Millisecond)
	var snap bytes.Buffer
	exp, err := d.ExportFlows(ctx, "web", &snap)
	if err != nil || exp.Flows < uint64(len(conns)) {
		t.Fatalf("export: %+v, %v; want at least %d flows", exp, err, len(conns))
	}
	st := d.HA().Status()
	// East-west flows queue nothing: the journal is there, empty.
	if !st.Enabled || st.Epoch != 3 || st.Journals["web"].Journal == "" || st.Queue.Read != 0 {
		t.Fatalf("status after the export: %+v; want epoch 3, a journal, nothing queued", st)
	}

	// The flows are lost, and new flows would all go to the first VM.
	ct, err := d.Conntrack()
	if err != nil {
		t.Fatal(err)
	}
	es, err := ct.List(conntrack.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, en := range es {
		if err := ct.Delete(en.Key); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.ApplyService(ctx, func() Service { s := e.service(1, 0, 0); s.Ports, s.Exposure = svc.Ports, svc.Exposure; return s }()); err != nil {
		t.Fatal(err)
	}

	// Refused before anything is applied: a service this node lacks; a
	// lease older than the edge's.
	if _, err := d.ImportFlows(ctx, "nosuch", bytes.NewReader(snap.Bytes()), false); !errors.Is(err, ErrNotFound) {
		t.Errorf("import into a service that does not exist: %v", err)
	}
	if _, err := d.HA().UpdateLease(context.Background(), HALease{Epoch: 2}); !errors.Is(err, ha.ErrStaleEpoch) {
		t.Errorf("lease older than the edge's: %v, want ErrStaleEpoch", err)
	}
	// The same flows from a source without a lease (epoch 0, no
	// journal): an edge holding a lease refuses them before any flow.
	var unleased bytes.Buffer
	uw, err := ha.NewWriter(&unleased, ha.Header{Service: "web", Seeds: &ha.Seeds{}})
	if err != nil {
		t.Fatal(err)
	}
	sr, err := ha.NewReader(bytes.NewReader(snap.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	for fs, err := sr.Next(); err != io.EOF; fs, err = sr.Next() {
		if err != nil {
			t.Fatal(err)
		}
		for i := range fs {
			if err := uw.Write(&fs[i]); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := uw.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ImportFlows(ctx, "web", &unleased, false); !errors.Is(err, ha.ErrStaleEpoch) {
		t.Errorf("snapshot of no lease into an edge with lease 3: %v, want ErrStaleEpoch", err)
	}
	if es, _ := ct.List(conntrack.Filter{}); len(es) != 0 {
		t.Fatalf("refused imports wrote %d flows", len(es))
	}

	res, err := d.ImportFlows(ctx, "web", bytes.NewReader(snap.Bytes()), false)
	if err != nil || res.Written != exp.Flows || res.Header.Epoch != 3 {
		t.Fatalf("import: %+v, %v; want %d flows written", res, err, exp.Flows)
	}
	cur := d.HA().Status().Cursors["web"]
	if cur.Journal != res.Header.Journal || cur.Seq != res.Header.Seq || cur.Epoch != 3 || cur.Journal == "" {
		t.Fatalf("cursor after the import %+v, want the snapshot's checkpoint %s/%d", cur, res.Header.Journal, res.Header.Seq)
	}
	for i, c := range conns {
		if err := c.Echo([]byte("after"), 3*time.Second); err != nil {
			t.Errorf("connection %d (on %s) broke after the import: %v", i, c.Backend, err)
		}
	}

	// North-south flows learned after the checkpoint are the next delta
	// (the queue carries the kinds a standby edge holds).
	var late []*lab.Conn
	for range 3 {
		c, err := e.lab.External.DialTCP(netip.AddrPortFrom(vip4, 80), 3*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		echo(t, c, "late")
		late = append(late, c)
	}
	var delta ha.Delta
	deadline := time.Now().Add(5 * time.Second)
	for {
		delta, err = d.HA().FlowDelta(context.Background(), "web", FlowDeltaRequest{Journal: cur.Journal, Seq: cur.Seq})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, b := range delta.Batches {
			n += len(b.Ops)
		}
		if n >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("delta after %d: %+v; want the 3 late flows", cur.Seq, delta)
		}
		time.Sleep(20 * time.Millisecond)
	}
	dr, err := d.HA().ImportFlowDelta(ctx, "web", delta)
	if err != nil || dr.Cursor.Seq != delta.To || dr.Applied.Written < 3 {
		t.Fatalf("delta import: %+v, %v; want the cursor at %d and the late flows written", dr, err, delta.To)
	}
	if _, err := d.HA().ImportFlowDelta(ctx, "web", delta); !errors.Is(err, ha.ErrGap) {
		t.Errorf("the same delta again: %v, want ErrGap", err)
	}
	if js, err := d.HA().AckFlowDelta(context.Background(), "web", delta.To); err != nil || js.Acked != delta.To || js.Batches != 0 {
		t.Errorf("ack %d: %+v, %v; want the history trimmed", delta.To, js, err)
	}
	if _, err := d.HA().AckFlowDelta(context.Background(), "web", delta.To+100); !errors.Is(err, ha.ErrCursorAhead) {
		t.Errorf("ack past the journal: %v, want ErrCursorAhead", err)
	}

	// GC's removals are journaled: the late flows' backend goes away.
	s1 := e.service(0, 1, 1)
	s1.Ports, s1.Exposure, s1.Backends = svc.Ports, svc.Exposure, nil
	for _, b := range e.service(0, 1, 1).Backends {
		if b.Address != e.backends[0].Addr4 && b.Address != e.backends[0].Addr6 {
			s1.Backends = append(s1.Backends, b)
		}
	}
	if _, err := d.ApplyService(ctx, s1); err != nil {
		t.Fatal(err)
	}
	gcDeletes := d.HA().Status().GCDeletes
	if r, err := d.GC(ctx); err != nil || r.BackendGone < len(late) {
		t.Fatalf("GC after the backend went: %+v, %v", r, err)
	}
	if n := d.HA().Status().GCDeletes - gcDeletes; n != uint64(len(late)) {
		t.Errorf("GC journaled %d deletes, want the %d north-south flows of the backend gone", n, len(late))
	}
	deleted := 0
	for deadline := time.Now().Add(5 * time.Second); deleted < len(late) && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		dd, err := d.HA().FlowDelta(context.Background(), "web", FlowDeltaRequest{Journal: delta.Journal, Seq: delta.To})
		if err != nil {
			t.Fatal(err)
		}
		deleted = 0
		for _, b := range dd.Batches {
			for _, op := range b.Ops {
				if op.Kind == ha.OpDelete {
					deleted++
				}
			}
		}
	}
	if deleted != len(late) {
		t.Errorf("the journal carries %d deletes after the GC, want %d", deleted, len(late))
	}

	// A lease that advances under an import of the old active's snapshot
	// cancels it: no snapshot-diff, no cursor.
	pr, pw := io.Pipe()
	cut := snap.Len() - 40 // the end record waits
	leased := make(chan struct{})
	go func() {
		defer close(leased)
		pw.Write(snap.Bytes()[:cut])
		if _, err := d.HA().UpdateLease(context.Background(), HALease{Epoch: 4}); err != nil {
			t.Errorf("lease 4 under an import: %v", err)
		}
		pw.Write(snap.Bytes()[cut:])
		pw.Close()
	}()
	// Cancelled, or refused at its header when the lease came first.
	if _, err := d.ImportFlows(ctx, "web", pr, true); !errors.Is(err, context.Canceled) && !errors.Is(err, ha.ErrStaleEpoch) {
		t.Errorf("import under a lease that advanced: %v, want it cancelled", err)
	}
	pr.Close()
	<-leased
	if st := d.HA().Status(); st.Epoch != 4 || len(st.Cursors) != 0 {
		t.Errorf("after the cancelled import: epoch %d, cursors %+v", st.Epoch, st.Cursors)
	}

	// A newer lease: the edge's own epoch is the floor of what it takes.
	if st, err := d.HA().UpdateLease(context.Background(), HALease{Epoch: 5}); err != nil || st.Epoch != 5 {
		t.Fatalf("lease 5: %+v, %v", st, err)
	}
	if _, err := d.ImportFlows(ctx, "web", bytes.NewReader(snap.Bytes()), false); !errors.Is(err, ha.ErrStaleEpoch) {
		t.Errorf("snapshot of epoch 3 at lease 5: %v, want ErrStaleEpoch", err)
	}
	// A delta of the old active (epoch 3), still up and partitioned, is
	// refused as well; the takeover forgot the edge's cursors.
	if st := d.HA().Status(); len(st.Cursors) != 0 {
		t.Errorf("cursors after the lease advanced: %+v", st.Cursors)
	}
	old := ha.Delta{Service: "web", Journal: delta.Journal, Epoch: 3, From: delta.To, To: delta.To + 1,
		Batches: []ha.Batch{{Seq: delta.To + 1, Epoch: 3, Ops: []ha.Op{{Kind: ha.OpDelete, Key: conntrack.Key{Client: netip.MustParseAddrPort("10.250.0.2:1000"), VIP: netip.AddrPortFrom(vip4, 80), Proto: 6}}}}}}
	if _, err := d.HA().ImportFlowDelta(ctx, "web", old); !errors.Is(err, ha.ErrStaleEpoch) {
		t.Errorf("delta of epoch 3 at lease 5: %v, want ErrStaleEpoch", err)
	}
	// Superseded: nothing is served.
	if st, err := d.HA().UpdateLease(context.Background(), HALease{SupersededBy: 7}); err != nil || st.SupersededBy != 7 {
		t.Fatalf("superseded by 7: %+v, %v", st, err)
	}
	if _, err := d.HA().FlowDelta(context.Background(), "web", FlowDeltaRequest{Journal: cur.Journal, Seq: cur.Seq}); !errors.Is(err, ha.ErrFenced) {
		t.Errorf("delta of a superseded edge: %v, want ErrFenced", err)
	}
	if _, err := d.ExportFlows(ctx, "web", io.Discard); !errors.Is(err, ha.ErrFenced) {
		t.Errorf("export of a superseded edge: %v, want ErrFenced", err)
	}
	// The lease survives a restart, over the older ha_epoch.
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d = e.open(t)
	if st := d.HA().Status(); st.Epoch != 5 || st.SupersededBy != 7 || len(st.Cursors) != 0 {
		t.Errorf("after a restart: %+v; want lease 5 superseded by 7, no cursor", st)
	}
	if _, err := d.ExportFlows(ctx, "web", io.Discard); !errors.Is(err, ha.ErrFenced) {
		t.Errorf("export after a restart, still superseded: %v, want ErrFenced", err)
	}
	// Taking over: a lease past the one that fenced the edge serves again,
	// a new journal incarnation.
	if _, err := d.HA().UpdateLease(context.Background(), HALease{Epoch: 8}); err != nil {
		t.Fatal(err)
	}
	if delta, err := d.HA().FlowDelta(context.Background(), "web", FlowDeltaRequest{Journal: cur.Journal, Seq: cur.Seq}); err != nil || !delta.ResetRequired || delta.Epoch != 8 {
		t.Errorf("delta after the takeover: %+v, %v; want reset_required at epoch 8", delta, err)
	}
}

// TestHAOptions: replication needs the north-south edge; without ha_epoch
// its methods say it is off.
func TestHAOptions(t *testing.T) {
	for _, tc := range []struct {
		ha   HAOptions
		ns   []string
		want error
	}{
		{HAOptions{Epoch: 1}, nil, ErrPrerequisite},
		{HAOptions{Epoch: 1, Interval: time.Millisecond}, []string{"uplink"}, ErrInvalid},
		{HAOptions{Epoch: 1, Interval: time.Hour}, []string{"uplink"}, ErrInvalid},
		{HAOptions{Epoch: 1, JournalMaxOps: -1}, []string{"uplink"}, ErrInvalid},
		{HAOptions{Epoch: 1, JournalMaxOps: MaxHAJournalOps + 1}, []string{"uplink"}, ErrInvalid},
	} {
		if _, err := Open(context.Background(), Options{HA: tc.ha, NorthSouth: NorthSouth{Interfaces: tc.ns}}); !errors.Is(err, tc.want) {
			t.Errorf("Open with %+v: %v, want %v", tc.ha, err, tc.want)
		}
	}
	e := newEnv(t)
	d := e.open(t)
	if _, err := d.ApplyService(context.Background(), e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	var ve *ValidationError
	if _, err := d.HA().FlowDelta(context.Background(), "web", FlowDeltaRequest{}); !errors.Is(err, ErrPrerequisite) || !errors.As(err, &ve) || ve.Field != "ha_epoch" {
		t.Errorf("delta with HA off: %v, want ErrPrerequisite naming ha_epoch", err)
	}
	if st := d.HA().Status(); st.Enabled {
		t.Errorf("status with HA off: %+v", st)
	}
	// Snapshots need the north-south edge, which this node lacks: refused
	// before any byte is written or read.
	var out bytes.Buffer
	if _, err := d.ExportFlows(context.Background(), "web", &out); !errors.Is(err, ErrPrerequisite) || !errors.As(err, &ve) || ve.Field != "north_south_interfaces" || out.Len() != 0 {
		t.Errorf("export without the north-south edge: %v, %d bytes; want ErrPrerequisite naming north_south_interfaces, nothing written", err, out.Len())
	}
	in := strings.NewReader("not read")
	if _, err := d.ImportFlows(context.Background(), "web", in, true); !errors.Is(err, ErrPrerequisite) || !errors.As(err, &ve) || ve.Field != "north_south_interfaces" || in.Len() != len("not read") {
		t.Errorf("import without the north-south edge: %v; want ErrPrerequisite naming north_south_interfaces, nothing read", err)
	}
}

// TestExportImportFlowsWithoutHA: a planned move of a service's flows
// between two dataplanes that run without replication (no ha_epoch, a
// north-south edge): the first exports its flows, north-south (SNAT
// through the uplink) and east-west, under no lease (epoch 0, no journal
// cursor), and goes away; the second, on another pin root, with Maglev
// sending every new flow to one VM, imports the snapshot with prune, and
// every open connection goes on with the backend it had (one re-picked to
// another VM, or given another SNAT port, would be reset). Deltas, acks
// and leases still need the journal and say so.
func TestExportImportFlowsWithoutHA(t *testing.T) {
	e := newNSEnv(t)
	a := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 1, 1)
	svc.Ports, svc.Exposure = []ServicePort{{Port: 80, Protocol: TCP}}, ExposureBoth
	if _, err := a.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	var conns []*lab.Conn
	moved := 0 // connections a new pick on the second node would move
	for i := range 24 {
		var c *lab.Conn
		if i%2 == 0 {
			var err error
			if c, err = e.lab.External.DialTCP(netip.AddrPortFrom(vip4, 80), 3*time.Second); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
		} else {
			c = e.dial(t, []netip.Addr{vip4, vip6}[i/2%2])
		}
		echo(t, c, "before")
		if c.Backend != e.backends[0].Name {
			moved++
		}
		conns = append(conns, c)
	}
	if moved == 0 {
		t.Fatal("every connection is on the first VM: the test proves nothing")
	}
	time.Sleep(300 * time.Millisecond) // the last ACKs settle
	var snap bytes.Buffer
	exp, err := a.ExportFlows(ctx, "web", &snap)
	if err != nil || exp.Flows < uint64(len(conns)) {
		t.Fatalf("export without HA: %+v, %v; want at least %d flows", exp, err, len(conns))
	}
	sr, err := ha.NewReader(bytes.NewReader(snap.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	if h := sr.Header(); h.Epoch != 0 || h.Journal != "" || h.Seq != 0 || h.Service != "web" {
		t.Fatalf("header of an export without a lease: %+v; want epoch 0, no journal, seq 0", h)
	}
	// What needs the journal says so, naming ha_epoch.
	for name, call := range map[string]func() error{
		"delta":        func() error { _, err := a.HA().FlowDelta(context.Background(), "web", FlowDeltaRequest{}); return err },
		"ack":          func() error { _, err := a.HA().AckFlowDelta(context.Background(), "web", 1); return err },
		"delta import": func() error { _, err := a.HA().ImportFlowDelta(ctx, "web", ha.Delta{Service: "web"}); return err },
		"lease":        func() error { _, err := a.HA().UpdateLease(context.Background(), HALease{Epoch: 1}); return err },
	} {
		var ve *ValidationError
		if err := call(); !errors.Is(err, ErrPrerequisite) || !errors.As(err, &ve) || ve.Field != "ha_epoch" {
			t.Errorf("%s without HA: %v; want ErrPrerequisite naming ha_epoch", name, err)
		}
	}
	if err := a.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}

	// The second dataplane: its own pin root and catalog, the same
	// interfaces; Maglev now sends new flows to the first VM only.
	e.opts.Loader.PinRoot = filepath.Join(testenv.PinRoot(t), "service")
	e.opts.CatalogPath = filepath.Join(t.TempDir(), "catalog.json")
	b := e.open(t)
	one := e.service(1, 0, 0)
	one.Ports, one.Exposure = svc.Ports, svc.Exposure
	if _, err := b.ApplyService(ctx, one); err != nil {
		t.Fatal(err)
	}
	ct, err := b.Conntrack()
	if err != nil {
		t.Fatal(err)
	}
	if es, err := ct.List(conntrack.Filter{}); err != nil || len(es) != 0 {
		t.Fatalf("the second dataplane starts with %d flows (%v)", len(es), err)
	}
	res, err := b.ImportFlows(ctx, "web", bytes.NewReader(snap.Bytes()), true)
	if err != nil || res.Written != exp.Flows || res.Header.Epoch != 0 || res.NoBackend != 0 || res.ForeignSNAT != 0 {
		t.Fatalf("import without HA: %+v, %v; want the %d flows written", res, err, exp.Flows)
	}
	if st := b.HA().Status(); st.Enabled || len(st.Cursors) != 0 {
		t.Errorf("status after an import without HA: %+v; want off, no cursor", st)
	}
	snat := 0
	es, err := ct.List(conntrack.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	for _, en := range es {
		if en.Kind == conntrack.SNAT {
			snat++
		}
	}
	if snat < len(conns)/2 {
		t.Errorf("%d SNAT flows after the import, want the %d external connections'", snat, len(conns)/2)
	}
	for i, c := range conns {
		if err := c.Echo([]byte("after"), 3*time.Second); err != nil {
			t.Errorf("connection %d (on %s) broke after the move: %v", i, c.Backend, err)
		}
	}
	// The same snapshot again changes nothing; a snapshot of an edge with
	// a lease is taken too (this edge holds none), and moves no cursor.
	if again, err := b.ImportFlows(ctx, "web", bytes.NewReader(snap.Bytes()), true); err != nil || again.Written != 0 || again.Pruned != 0 {
		t.Errorf("the snapshot again: %+v, %v; want nothing written or pruned", again, err)
	}
	var leased bytes.Buffer
	w, err := ha.NewWriter(&leased, ha.Header{Service: "web", Epoch: 9, Journal: "j9", Seq: 4, Seeds: &ha.Seeds{}})
	if err != nil || w.Close() != nil {
		t.Fatal(err)
	}
	if r, err := b.ImportFlows(ctx, "web", &leased, false); err != nil || r.Header.Epoch != 9 {
		t.Errorf("a leased edge's snapshot into an edge without a lease: %+v, %v", r, err)
	}
	if st := b.HA().Status(); len(st.Cursors) != 0 {
		t.Errorf("cursors after it: %+v", st.Cursors)
	}
}
