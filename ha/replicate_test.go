package ha

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
)

// fakeActive is an edge's flows (live) and the journal its datapath
// feeds; Export writes a real snapshot stream.
type fakeActive struct {
	exportErr error // Export fails with it after the header
	t         *testing.T
	j         *Journal
	live      map[conntrack.Key]Flow
	acked     uint64
}

func (a *fakeActive) learn(i, b int) {
	f := journalFlow(i, b)
	a.live[f.Key()] = f
	mustRecord(a.t, a.j, Op{Kind: OpUpsert, Flow: &f})
}

func (a *fakeActive) forget(i int) {
	delete(a.live, testKey(i))
	mustRecord(a.t, a.j, del(i))
}

func (a *fakeActive) Delta(_ context.Context, svc, journal string, seq uint64, maxOps int) (Delta, error) {
	return a.j.Since(seq, journal, maxOps)
}

func (a *fakeActive) Export(_ context.Context, svc string, w io.Writer) error {
	cp, err := a.j.Checkpoint()
	if err != nil {
		return err
	}
	sw, err := NewWriter(w, Header{Service: svc, Node: "a", Epoch: cp.Epoch, Journal: cp.Journal, Seq: cp.Seq, Seeds: &Seeds{}})
	if err != nil {
		return err
	}
	if a.exportErr != nil {
		return a.exportErr
	}
	for _, f := range a.live {
		if err := sw.Write(&f); err != nil {
			return err
		}
	}
	return sw.Close()
}

func (a *fakeActive) Ack(_ context.Context, svc string, seq uint64) error {
	a.acked = seq
	return a.j.Ack(seq)
}

// fakeStandby applies what it gets with the real Cursor rules.
type fakeStandby struct {
	cur       Cursor
	floor     Epoch // its own lease
	flows     map[conntrack.Key]Flow
	snapshots int
}

func (s *fakeStandby) Cursor(context.Context, string) (Cursor, error) { return s.cur, nil }

func (s *fakeStandby) Import(_ context.Context, svc string, r io.Reader, prune bool) (ImportResult, error) {
	sr, err := NewReader(r)
	if err != nil {
		return ImportResult{}, err
	}
	res := ImportResult{Header: sr.Header()}
	if res.Header.Epoch < max(s.floor, s.cur.Epoch) {
		return res, fmt.Errorf("snapshot of epoch %d: %w", res.Header.Epoch, ErrStaleEpoch)
	}
	got := map[conntrack.Key]Flow{}
	for {
		fs, err := sr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return res, err
		}
		for _, f := range fs {
			got[f.Key()] = f
			res.Flows++
			res.Written++
		}
	}
	if prune {
		for k := range s.flows {
			if _, ok := got[k]; !ok {
				delete(s.flows, k)
				res.Pruned++
			}
		}
	}
	maps.Copy(s.flows, got)
	if err := s.cur.Reset(res.Header.Journal, res.Header.Seq, res.Header.Epoch); err != nil {
		return res, err
	}
	s.snapshots++
	return res, nil
}

func (s *fakeStandby) ImportDelta(_ context.Context, svc string, d Delta) (Cursor, error) {
	check := s.cur
	check.Epoch = max(check.Epoch, s.floor)
	if err := check.Check(d); err != nil {
		return s.cur, err
	}
	for _, b := range d.Batches {
		apply(s.flows, b.Ops)
	}
	s.cur.Advance(d)
	return s.cur, nil
}

// TestReplicator: a standby with no cursor loads a snapshot; then deltas
// carry creates and deletes and are acked; a standby that lost its cursor
// (restart) and a standby behind history the active dropped both resync
// exactly; the periodic diff repairs what the journal never carried; data
// of a superseded active is refused.
func TestReplicator(t *testing.T) {
	ctx := context.Background()
	a := &fakeActive{t: t, j: newTestJournal(t, 2, JournalOptions{MaxOps: 64, MaxBatchOps: 8}), live: map[conntrack.Key]Flow{}}
	s := &fakeStandby{flows: map[conntrack.Key]Flow{}}
	r := &Replicator{Active: a, Standby: s, Services: []string{"web"}, MaxOps: 16}
	same := func(what string) {
		t.Helper()
		if len(s.flows) != len(a.live) {
			t.Fatalf("%s: standby holds %d flows, active %d", what, len(s.flows), len(a.live))
		}
		for k, f := range a.live {
			if g, ok := s.flows[k]; !ok || g.Backend != f.Backend || g.SNAT != f.SNAT {
				t.Fatalf("%s: flow %s on the standby %+v (present %v), active %+v", what, k, g, ok, f)
			}
		}
	}
	round := func(what string) RoundResult {
		t.Helper()
		res, err := r.Round(ctx)
		if err != nil || len(res) != 1 {
			t.Fatalf("%s: round %+v, %v", what, res, err)
		}
		return res[0]
	}
	for i := range 10 {
		a.learn(i, 1)
	}
	if res := round("first"); res.Snapshot == nil || res.Reason != "no cursor" || res.Cursor.Journal != a.j.ID() {
		t.Fatalf("first round %+v: want a snapshot for a standby with no cursor", res)
	}
	same("after the first snapshot")

	// Deltas: creates, moves, deletes; acked on the active.
	for i := 5; i < 20; i++ {
		a.learn(i, 2)
	}
	a.forget(0)
	a.j.Seal()
	res := round("deltas")
	if res.Snapshot != nil || res.Ops != 16 || res.Deltas == 0 || a.acked != res.Cursor.Seq {
		t.Fatalf("delta round %+v (active acked %d): want 16 ops by delta, acked", res, a.acked)
	}
	same("after the deltas")
	if st := a.j.Stats(); st.Batches != 0 {
		t.Fatalf("the active kept %d batches after the ack", st.Batches)
	}

	// The standby restarts: its cursor is gone, it resyncs.
	s.cur = Cursor{Epoch: s.cur.Epoch}
	a.learn(30, 3)
	a.j.Seal()
	if res := round("restart"); res.Snapshot == nil || res.Reason != "no cursor" {
		t.Fatalf("after a standby restart %+v: want a snapshot", res)
	}
	same("after the standby's restart")

	// A history gap: more than MaxOps before the standby pulls again.
	for i := range 100 {
		a.learn(100+i, 4)
	}
	a.j.Seal()
	if st := a.j.Stats(); st.DroppedOps == 0 {
		t.Fatal("the journal dropped nothing: no gap to test")
	}
	if res := round("gap"); res.Snapshot == nil || res.Reason != "reset_required" {
		t.Fatalf("after a history gap %+v: want reset_required -> snapshot", res)
	}
	same("after the gap")

	// A change the journal never carried (a dropped queue record): only the
	// periodic diff repairs it, also pruning a flow gone without a delete.
	f := journalFlow(500, 5)
	a.live[f.Key()] = f
	delete(a.live, testKey(101))
	if res := round("quiet"); res.Snapshot != nil || res.Ops != 0 {
		t.Fatalf("quiet round %+v", res)
	}
	r.DiffEvery = time.Nanosecond
	if res := round("diff"); !res.Diff || res.Snapshot == nil || res.Snapshot.Pruned != 1 {
		t.Fatalf("diff round %+v: want a snapshot-diff pruning 1 flow", res)
	}
	same("after the diff")

	// A diff that fails does not stop the deltas; the active's own error
	// (fenced) is what the round reports, not the cut stream's.
	a.exportErr = ErrFenced
	a.learn(501, 5)
	a.j.Seal()
	rs, err := r.Round(ctx)
	if !errors.Is(err, ErrFenced) || len(rs) != 1 || rs[0].Ops != 0 {
		t.Fatalf("round with a fenced export: %+v, %v", rs, err)
	}
	a.exportErr = errors.New("snapshot too big for the standby")
	r.DiffEvery = time.Nanosecond
	rs, err = r.Round(ctx)
	if err == nil || len(rs) != 1 || rs[0].Ops != 1 {
		t.Fatalf("round with a failing diff: %+v, %v; want the delta applied and the diff's error", rs, err)
	}
	same("after a failed diff")
	a.exportErr = nil
	r.DiffEvery = 0

	// Superseded: the standby took over under epoch 3; the old active's
	// deltas and snapshots are refused, and nothing of them is applied.
	s.floor = 3
	a.learn(600, 6)
	a.j.Seal()
	before := maps.Clone(s.flows)
	if _, err := r.Round(ctx); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("round with a superseded active: %v, want ErrStaleEpoch", err)
	}
	s.cur = Cursor{Epoch: 3}
	if _, err := r.Round(ctx); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("snapshot of a superseded active: %v, want ErrStaleEpoch", err)
	}
	if !maps.EqualFunc(before, s.flows, func(x, y Flow) bool { return x.Backend == y.Backend }) || len(before) != len(s.flows) {
		t.Fatal("a stale active's data reached the standby")
	}
}
