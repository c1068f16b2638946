package hasync

import (
	"context"
	"errors"
	"iter"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/intent"
)

// fakeView is the services: name -> live frontends' datapath ids.
type fakeView map[string][]uint32

// fakeDrainer runs until its context ends; it counts its closes.
type fakeDrainer struct {
	journal func(uint32) *ha.Journal
	closes  atomic.Int32
}

func (f *fakeDrainer) Run(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }
func (f *fakeDrainer) Stats() (read, skipped, dropped uint64, err error) {
	return 7, 2, 1, nil
}
func (f *fakeDrainer) Close() error { f.closes.Add(1); return nil }

// fixture is a component over a fake view, drainer and Settle.
type fixture struct {
	s       *Sync
	view    fakeView
	drainer *fakeDrainer
	settles atomic.Int32
}

func newFixture(t *testing.T, cfg Config, view fakeView) *fixture {
	t.Helper()
	f := &fixture{view: view, drainer: &fakeDrainer{}}
	if cfg.Interval == 0 {
		cfg.Interval = time.Hour
	}
	s, err := New(cfg, Deps{Services: &f.view, NewDrainer: func(j func(uint32) *ha.Journal) (Drainer, error) {
		f.drainer.journal = j
		return f.drainer, nil
	}, Settle: func() { f.settles.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	f.s = s
	s.Sync()
	t.Cleanup(func() { s.Close() })
	return f
}

// Services through a pointer, so that a test changes the view in place.
func (v *fakeView) Services() iter.Seq2[string, []uint32] { return maps.All(*v) }

func key(port uint16) conntrack.Key {
	return conntrack.Key{Client: netip.AddrPortFrom(netip.MustParseAddr("192.0.2.1"), port),
		VIP: netip.MustParseAddrPort("10.96.0.1:80"), Proto: conntrack.ProtoTCP}
}

func TestNewRejects(t *testing.T) {
	deps := Deps{Services: &fakeView{}, NewDrainer: func(func(uint32) *ha.Journal) (Drainer, error) { return &fakeDrainer{}, nil }}
	for _, c := range []struct {
		name string
		cfg  Config
		deps Deps
	}{
		{"no epoch", Config{Interval: time.Second}, deps},
		{"no interval", Config{Epoch: 1}, deps},
		{"no view", Config{Epoch: 1, Interval: time.Second}, Deps{NewDrainer: deps.NewDrainer}},
		{"no drainer", Config{Epoch: 1, Interval: time.Second}, Deps{Services: &fakeView{}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, err := New(c.cfg, c.deps); !errors.Is(err, intent.ErrInvalid) {
				t.Fatalf("New: %v, want ErrInvalid", err)
			}
		})
	}
}

// The journals follow the services: a datapath id resolves to its
// service's journal; a service gone drops its journal and cursor; an id
// no service has waits for the change in progress once per Sync.
func TestJournalsFollowServices(t *testing.T) {
	f := newFixture(t, Config{Epoch: 3}, fakeView{"web": {1, 2}, "db": {5}, "idle": nil})
	for _, c := range []struct {
		sid     uint32
		want    string // "": no journal
		settles int32  // Settle calls so far
	}{
		{1, "web", 0},
		{2, "web", 0},
		{5, "db", 0},
		{9, "", 1},
		{9, "", 1}, // the same miss within one Sync: no second wait
	} {
		j := f.s.journalOf(c.sid)
		got := ""
		if j != nil {
			got = j.Service()
		}
		if got != c.want || f.settles.Load() != c.settles {
			t.Fatalf("sid %d: journal of %q, %d settles; want %q, %d", c.sid, got, f.settles.Load(), c.want, c.settles)
		}
	}
	if st := f.s.Status(); st.Queue.Skipped != 2 || len(st.Journals) != 2 {
		t.Fatalf("status %+v: want 2 records of no service, journals of web and db", st)
	}
	// A cursor of db, then db goes: its journal and cursor with it.
	f.s.cursors[source{service: "db"}] = ha.Cursor{Journal: "j", Seq: 1, Epoch: 3}
	f.view = fakeView{"web": {1}, "idle": nil, "new": {9}}
	f.s.Sync()
	if j := f.s.journalOf(9); j == nil || j.Service() != "new" {
		t.Fatalf("sid 9 after the Sync that names it: %v", j)
	}
	if j := f.s.journalOf(5); j != nil || f.settles.Load() != 2 {
		t.Fatalf("sid 5 of a service gone: journal %v, %d settles; want none, 2", j, f.settles.Load())
	}
	st := f.s.Status()
	if got := slices.Sorted(maps.Keys(st.Journals)); !slices.Equal(got, []string{"new", "web"}) || len(st.Cursors) != 0 {
		t.Fatalf("journals %v, cursors %v: want new and web, no cursor", got, st.Cursors)
	}
	if _, err := f.s.SourceJournal(context.Background(), "db"); !errors.Is(err, errs.ErrNotFound) {
		t.Fatalf("SourceJournal of a service gone: %v, want ErrNotFound", err)
	}
	if j, err := f.s.SourceJournal(context.Background(), "idle"); err != nil || j.Service() != "idle" {
		t.Fatalf("SourceJournal of a service without a live frontend: %v, %v", j, err)
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	f.view["later"] = nil
	f.s.Sync()
	if _, err := f.s.SourceJournal(cancelled, "later"); !errors.Is(err, context.Canceled) || f.s.Status().Journals["later"] != (ha.JournalStats{}) {
		t.Fatalf("SourceJournal with a cancelled ctx: %v; want ctx's error and no journal made", err)
	}
}

// GC's removals go into the journals: the north-south kinds only.
func TestRemoved(t *testing.T) {
	f := newFixture(t, Config{Epoch: 1}, fakeView{"web": {1}})
	for _, c := range []struct {
		kind    conntrack.Kind
		sid     uint32
		journal bool // the removal is journaled
	}{
		{conntrack.SNAT, 1, true},
		{conntrack.DSR, 1, true},
		{conntrack.EastWest, 1, false},
		{conntrack.SNAT, 4, false},
	} {
		before := f.s.Status().GCDeletes
		f.s.Removed(key(1000), c.sid, c.kind, 90*time.Second)
		if got := f.s.Status().GCDeletes - before; got != map[bool]uint64{true: 1}[c.journal] {
			t.Fatalf("kind %v sid %d: %d deletes journaled, want journaled=%v", c.kind, c.sid, got, c.journal)
		}
	}
	j, _ := f.s.SourceJournal(context.Background(), "web")
	if st := j.Stats(); st.OpenOps != 2 {
		t.Fatalf("web's journal: %+v, want the 2 deletes open", st)
	}
	j.Seal()
	d, _ := j.Since(0, "", 0)
	if d, err := j.Since(0, d.Journal, 0); err != nil || len(d.Batches) != 1 || d.Batches[0].Ops[0].IdleMS != 90000 {
		t.Fatalf("the journaled delete: %+v, %v; want idle_ms 90000", d, err)
	}
}

// The lease: loaded from its file (newer wins), advanced, fenced,
// refused when stale, and written down.
func TestLease(t *testing.T) {
	type step struct {
		lease      Lease
		err        error
		epoch      ha.Epoch // after the step
		fenced     ha.Epoch
		serves     bool // web's journal serves (not fenced)
		newJournal bool // web's journal is another incarnation
		cursors    int
	}
	for _, c := range []struct {
		name   string
		cfg    ha.Epoch
		file   string // "": none
		epoch  ha.Epoch
		fenced ha.Epoch
		steps  []step
	}{
		{"renew and advance", 2, "", 2, 0, []step{
			{Lease{Epoch: 2}, nil, 2, 0, true, false, 1},
			{Lease{Epoch: 3}, nil, 3, 0, true, false, 0},
			{Lease{Epoch: 1}, ha.ErrStaleEpoch, 3, 0, true, false, 0},
			{Lease{}, intent.ErrInvalid, 3, 0, true, false, 0},
		}},
		{"fenced then taken back", 2, "", 2, 0, []step{
			{Lease{SupersededBy: 2}, nil, 2, 0, true, false, 1}, // not newer: no fence
			{Lease{SupersededBy: 5}, nil, 2, 5, false, false, 1},
			{Lease{Epoch: 4}, nil, 4, 5, false, false, 0},
			{Lease{Epoch: 6}, nil, 6, 0, true, true, 0},
		}},
		{"the file's newer lease wins", 2, `{"epoch":4,"superseded_by":7}`, 4, 7, []step{
			{Lease{Epoch: 3}, ha.ErrStaleEpoch, 4, 7, false, false, 1},
			{Lease{Epoch: 8}, nil, 8, 0, true, true, 0},
		}},
		{"an older file loses", 5, `{"epoch":4}`, 5, 0, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "lease")
			if c.file != "" {
				if err := os.WriteFile(path, []byte(c.file), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			f := newFixture(t, Config{Epoch: c.cfg, LeasePath: path}, fakeView{"web": {1}})
			if st := f.s.Status(); st.Epoch != c.epoch || st.SupersededBy != c.fenced {
				t.Fatalf("at New: %d/%d, want %d/%d", st.Epoch, st.SupersededBy, c.epoch, c.fenced)
			}
			j, err := f.s.SourceJournal(context.Background(), "web")
			if err != nil {
				t.Fatal(err)
			}
			id := j.ID()
			f.s.cursors[source{service: "web"}] = ha.Cursor{Journal: "peer", Seq: 1, Epoch: c.epoch}
			for i, s := range c.steps {
				changed, err := f.s.UpdateLease(context.Background(), s.lease)
				st := f.s.Status()
				_, serr := j.Since(0, "", 0)
				if !errors.Is(err, s.err) || (s.err == nil) != (err == nil) || st.Epoch != s.epoch || st.SupersededBy != s.fenced ||
					(serr == nil) != s.serves || (j.ID() != id) != s.newJournal || len(st.Cursors) != s.cursors {
					t.Fatalf("step %d %+v: err %v, lease %d/%d, since %v, journal renewed %v, %d cursors; want %+v",
						i, s.lease, err, st.Epoch, st.SupersededBy, serr, j.ID() != id, len(st.Cursors), s)
				}
				if changed {
					got, err := ReadLease(path)
					if err != nil || got != (Lease{Epoch: s.epoch, SupersededBy: s.fenced}) {
						t.Fatalf("step %d: the file holds %+v (%v), want %d/%d", i, got, err, s.epoch, s.fenced)
					}
				}
			}
		})
	}
}

// A lease file that is no lease fails New; one that cannot be written
// leaves the lease as it was.
func TestLeaseFileErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad")
	os.WriteFile(bad, []byte("{"), 0o600)
	deps := Deps{Services: &fakeView{}, NewDrainer: func(func(uint32) *ha.Journal) (Drainer, error) { return &fakeDrainer{}, nil }}
	if _, err := New(Config{Epoch: 1, Interval: time.Second, LeasePath: bad}, deps); err == nil {
		t.Fatal("New over a corrupt lease file: no error")
	}
	sub := filepath.Join(dir, "sub")
	if err := os.Mkdir(sub, 0o700); err != nil {
		t.Fatal(err)
	}
	f := newFixture(t, Config{Epoch: 2, LeasePath: filepath.Join(sub, "lease")}, fakeView{})
	// The lease's directory becomes a file: the lease cannot be written.
	if err := os.Remove(sub); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(sub, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := f.s.UpdateLease(context.Background(), Lease{Epoch: 3}); err == nil {
		t.Fatal("UpdateLease that cannot write its file: no error")
	}
	if st := f.s.Status(); st.Epoch != 2 || f.s.pending != 0 {
		t.Fatalf("after a failed update: epoch %d, pending %d; want 2, 0", st.Epoch, f.s.pending)
	}
}

// peerJournal is a peer's journal of web with n sealed batches.
func peerJournal(t *testing.T, epoch ha.Epoch, n int) *ha.Journal {
	t.Helper()
	j, err := ha.NewJournal("web", epoch, ha.JournalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if err := j.Record(ha.Op{Kind: ha.OpDelete, Key: key(uint16(2000 + i))}); err != nil {
			t.Fatal(err)
		}
		j.Seal()
	}
	return j
}

// The target side: a snapshot sets the cursor, deltas continue it, and
// what does not continue it (stale, gap, another journal) applies
// nothing.
func TestCursorRules(t *testing.T) {
	peer := peerJournal(t, 3, 4)
	cp, _ := peer.Checkpoint()
	snapshot := func(epoch ha.Epoch, journal string, seq uint64) func(context.Context, func(ha.Header) error) (ha.ImportResult, error) {
		return func(_ context.Context, accept func(ha.Header) error) (ha.ImportResult, error) {
			hd := ha.Header{Service: "web", Epoch: epoch, Journal: journal, Seq: seq}
			if err := accept(hd); err != nil {
				return ha.ImportResult{}, err
			}
			return ha.ImportResult{Header: hd}, nil
		}
	}
	since := func(seq uint64) ha.Delta { d, _ := peer.Since(seq, cp.Journal, 0); return d }
	for _, c := range []struct {
		name     string
		edge     ha.Epoch
		snap     func(context.Context, func(ha.Header) error) (ha.ImportResult, error) // nil: none first
		delta    ha.Delta
		err      error
		applied  bool
		wantSeq  uint64 // the cursor's seq after
		wantJrnl string
	}{
		{"delta without a snapshot", 3, nil, since(0), ha.ErrResetRequired, false, 0, ""},
		{"snapshot then delta", 3, snapshot(3, cp.Journal, 2), since(2), nil, true, 4, cp.Journal},
		{"delta with a gap", 3, snapshot(3, cp.Journal, 1), since(2), ha.ErrGap, false, 1, cp.Journal},
		{"snapshot older than the edge's lease", 4, snapshot(3, cp.Journal, 2), ha.Delta{}, ha.ErrStaleEpoch, false, 0, ""},
		{"snapshot of no lease", 3, snapshot(0, "", 0), ha.Delta{}, ha.ErrStaleEpoch, false, 0, ""},
		{"delta older than the edge's lease", 4, nil, since(0), ha.ErrStaleEpoch, false, 0, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, Config{Epoch: c.edge}, fakeView{"web": {1}})
			var err error
			if c.snap != nil {
				_, err = f.s.ImportSnapshot(context.Background(), "web", c.snap)
			}
			applied := false
			if err == nil {
				_, err = f.s.ImportDelta(context.Background(), "web", c.delta, func(context.Context, ha.Delta) (ha.ImportResult, error) {
					applied = true
					return ha.ImportResult{}, nil
				})
			}
			cur := f.s.Status().Cursors["web"]
			if !errors.Is(err, c.err) || (c.err == nil) != (err == nil) || applied != c.applied || cur.Seq != c.wantSeq || cur.Journal != c.wantJrnl {
				t.Fatalf("err %v, applied %v, cursor %+v; want %v, %v, %s/%d", err, applied, cur, c.err, c.applied, c.wantJrnl, c.wantSeq)
			}
		})
	}
}

// What happens meanwhile: an apply that fails, a service deleted, a
// lease that advances (it cancels the apply) keep the cursor where it
// was.
func TestCursorStaysWhenImportLosesItsRace(t *testing.T) {
	peer := peerJournal(t, 3, 2)
	cp, _ := peer.Checkpoint()
	delta, _ := peer.Since(0, cp.Journal, 0)
	for _, c := range []struct {
		name string
		// meanwhile runs inside the apply.
		meanwhile func(f *fixture, ctx context.Context) error
		err       error
	}{
		{"the apply fails", func(*fixture, context.Context) error { return os.ErrClosed }, os.ErrClosed},
		{"the service is deleted", func(f *fixture, _ context.Context) error {
			delete(f.view, "web")
			f.s.Sync()
			return nil
		}, errs.ErrNotFound},
		{"the lease advances", func(f *fixture, ctx context.Context) error {
			if _, err := f.s.UpdateLease(context.Background(), Lease{Epoch: 9}); err != nil {
				return err
			}
			return ctx.Err() // the apply sees its ctx cancelled
		}, context.Canceled},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, Config{Epoch: 3}, fakeView{"web": {1}})
			if _, err := f.s.ImportSnapshot(context.Background(), "web", func(_ context.Context, accept func(ha.Header) error) (ha.ImportResult, error) {
				hd := ha.Header{Epoch: 3, Journal: cp.Journal}
				return ha.ImportResult{Header: hd}, accept(hd)
			}); err != nil {
				t.Fatal(err)
			}
			before := f.s.Status().Cursors["web"]
			_, err := f.s.ImportDelta(context.Background(), "web", delta, func(ctx context.Context, _ ha.Delta) (ha.ImportResult, error) {
				return ha.ImportResult{}, c.meanwhile(f, ctx)
			})
			if got := f.s.Status().Cursors["web"]; !errors.Is(err, c.err) || (got != ha.Cursor{} && got != before) {
				t.Fatalf("err %v, cursor %+v; want %v and the cursor at %+v or gone", err, got, c.err, before)
			}
		})
	}
}

// Start runs the drainer on the journals, Close stops it once; the
// status counts the queue.
func TestStartClose(t *testing.T) {
	f := newFixture(t, Config{Epoch: 1, Interval: time.Millisecond}, fakeView{"web": {1}})
	if err := f.s.Start(); err != nil {
		t.Fatal(err)
	}
	j := f.drainer.journal(1)
	if j == nil || j.Service() != "web" {
		t.Fatalf("the drainer's journal of sid 1: %v", j)
	}
	if err := j.Record(ha.Op{Kind: ha.OpDelete, Key: key(1)}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for j.Stats().LastSeq == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if st := j.Stats(); st.LastSeq != 1 || st.OpenOps != 0 {
		t.Fatalf("the sealer did not seal the open batch: %+v", st)
	}
	if st := f.s.Status(); st.Queue != (QueueStatus{Read: 7, Skipped: 2, Dropped: 1}) || st.Interval != time.Millisecond {
		t.Fatalf("status %+v", st)
	}
	for range 2 {
		if err := f.s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if n := f.drainer.closes.Load(); n != 1 {
		t.Fatalf("the drainer closed %d times, want 1", n)
	}
}

// TestGroupCursors: a group edge follows every other edge's journal of a
// service with a cursor of its own, takes each source's data against the
// newest epoch of that source alone (not its own lease: every edge holds
// one), refuses data naming no edge or itself, and keeps its cursors when
// its own lease advances.
func TestGroupCursors(t *testing.T) {
	if _, err := New(Config{Epoch: 1, Interval: time.Second, Group: true}, Deps{Services: &fakeView{}, NewDrainer: func(func(uint32) *ha.Journal) (Drainer, error) { return nil, nil }}); !errors.Is(err, intent.ErrInvalid) {
		t.Fatalf("a group edge without a node name: %v", err)
	}
	f := newFixture(t, Config{Epoch: 9, Group: true, Node: "e1"}, fakeView{"web": {1}})
	ctx := context.Background()
	b, c := peerJournal(t, 3, 3), peerJournal(t, 5, 2)
	snapshot := func(node string, j *ha.Journal, seq uint64) func(context.Context, func(ha.Header) error) (ha.ImportResult, error) {
		return func(_ context.Context, accept func(ha.Header) error) (ha.ImportResult, error) {
			cp, _ := j.Checkpoint()
			hd := ha.Header{Service: "web", Node: node, Epoch: cp.Epoch, Journal: cp.Journal, Seq: seq}
			if err := accept(hd); err != nil {
				return ha.ImportResult{}, err
			}
			return ha.ImportResult{Header: hd}, nil
		}
	}
	applied := 0
	apply := func(context.Context, ha.Delta) (ha.ImportResult, error) { applied++; return ha.ImportResult{}, nil }
	since := func(node string, j *ha.Journal, seq uint64) ha.Delta {
		cp, _ := j.Checkpoint()
		d, err := j.Since(seq, cp.Journal, 0)
		if err != nil {
			t.Fatal(err)
		}
		d.Node = node
		return d
	}
	// e2's data, of an epoch below this edge's own lease: taken.
	if _, err := f.s.ImportSnapshot(ctx, "web", snapshot("e2", b, 1)); err != nil {
		t.Fatalf("e2's snapshot: %v", err)
	}
	if _, err := f.s.ImportDelta(ctx, "web", since("e2", b, 1), apply); err != nil || applied != 1 {
		t.Fatalf("e2's delta: %v (applied %d)", err, applied)
	}
	// e3 has a cursor of its own: none yet.
	if _, err := f.s.ImportDelta(ctx, "web", since("e3", c, 0), apply); !errors.Is(err, ha.ErrResetRequired) {
		t.Fatalf("e3's delta before its snapshot: %v, want reset required", err)
	}
	if _, err := f.s.ImportSnapshot(ctx, "web", snapshot("e3", c, 2)); err != nil {
		t.Fatalf("e3's snapshot: %v", err)
	}
	for _, bad := range []struct {
		node string
		want error
	}{{"", ErrSource}, {"e1", ErrSource}} {
		if _, err := f.s.ImportDelta(ctx, "web", since(bad.node, b, 3), apply); !errors.Is(err, bad.want) {
			t.Errorf("a delta naming %q: %v, want %v", bad.node, err, bad.want)
		}
		if _, err := f.s.ImportSnapshot(ctx, "web", snapshot(bad.node, b, 3)); !errors.Is(err, bad.want) {
			t.Errorf("a snapshot naming %q: %v, want %v", bad.node, err, bad.want)
		}
	}
	// e2's older incarnation (epoch 2) is stale for e2, whatever e3's is.
	old := peerJournal(t, 2, 1)
	if _, err := f.s.ImportSnapshot(ctx, "web", snapshot("e2", old, 1)); !errors.Is(err, ha.ErrStaleEpoch) {
		t.Errorf("e2's snapshot of epoch 2 after epoch 3: %v, want stale", err)
	}
	if _, err := f.s.UpdateLease(ctx, Lease{Epoch: 12}); err != nil {
		t.Fatal(err)
	}
	st := f.s.Status()
	want := map[string]ha.Cursor{"e2": {Journal: since("e2", b, 0).Journal, Seq: 3, Epoch: 3}, "e3": {Journal: since("e3", c, 0).Journal, Seq: 2, Epoch: 5}}
	if !st.Group || st.Node != "e1" || len(st.Cursors) != 0 || !maps.Equal(st.Sources["web"], want) {
		t.Fatalf("status after the edge's lease advanced: group %v node %q cursors %v sources %v; want %v", st.Group, st.Node, st.Cursors, st.Sources, want)
	}
}
