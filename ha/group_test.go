package ha

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/fluxvm/servicefabric/conntrack"
)

// groupFake is an edge of a group: its own flows and journal (a
// fakeActive), and what it holds of the others' (one map, with a cursor
// per source).
type groupFake struct {
	name    string
	a       *fakeActive
	held    map[conntrack.Key]Flow
	targets map[string]*fakeStandby
	down    bool
	joins   int // Join calls
}

var errDown = errors.New("edge down")

// groupTarget is g as the target of source's journals; it fails while g
// is down.
type groupTarget struct {
	g      *groupFake
	source string
}

func (t groupTarget) s() (*fakeStandby, error) {
	if t.g.down {
		return nil, errDown
	}
	if t.g.targets[t.source] == nil {
		t.g.targets[t.source] = &fakeStandby{flows: t.g.held}
	}
	return t.g.targets[t.source], nil
}

func (t groupTarget) Cursor(ctx context.Context, svc string) (Cursor, error) {
	s, err := t.s()
	if err != nil {
		return Cursor{}, err
	}
	return s.Cursor(ctx, svc)
}

func (t groupTarget) Import(ctx context.Context, svc string, r io.Reader, prune bool) (ImportResult, error) {
	s, err := t.s()
	if err != nil {
		return ImportResult{}, err
	}
	return s.Import(ctx, svc, r, prune)
}

func (t groupTarget) ImportDelta(ctx context.Context, svc string, d Delta) (Cursor, error) {
	s, err := t.s()
	if err != nil {
		return Cursor{}, err
	}
	return s.ImportDelta(ctx, svc, d)
}

func (g *groupFake) edge() GroupEdge {
	return GroupEdge{Name: g.name, Source: g.a,
		Target:   func(source string) Standby { return groupTarget{g: g, source: source} },
		Services: func(context.Context) ([]string, error) { return []string{"web"}, nil },
		Join: func(context.Context) error {
			if g.down {
				return errDown
			}
			g.joins++
			return nil
		}}
}

// TestGroupReplicator: every edge's flows reach every other edge, without
// a snapshot of one edge pruning the flows another edge's brought; each
// journal is acked up to the least cursor of the edges that follow it,
// and not past an edge that is down.
func TestGroupReplicator(t *testing.T) {
	ctx := context.Background()
	var edges []*groupFake
	for i, name := range []string{"e1", "e2", "e3"} {
		g := &groupFake{name: name, held: map[conntrack.Key]Flow{}, targets: map[string]*fakeStandby{},
			a: &fakeActive{t: t, j: newTestJournal(t, Epoch(i+2), JournalOptions{MaxOps: 256, MaxBatchOps: 8}), live: map[conntrack.Key]Flow{}}}
		edges = append(edges, g)
	}
	e1, e2, e3 := edges[0], edges[1], edges[2]
	for i := range 10 {
		e1.a.learn(i, 1)
	}
	for i := 100; i < 105; i++ {
		e2.a.learn(i, 2)
	}
	r := &GroupReplicator{MaxOps: 16}
	if _, err := r.Round(ctx); err == nil {
		t.Fatal("a group of no edge: no error")
	}
	for _, g := range edges {
		r.Edges = append(r.Edges, g.edge())
	}
	holdsAll := func(what string) {
		t.Helper()
		for _, dst := range edges {
			want := 0
			for _, src := range edges {
				if src == dst {
					continue
				}
				want += len(src.a.live)
				for k, f := range src.a.live {
					if g, ok := dst.held[k]; !ok || g.Backend != f.Backend {
						t.Fatalf("%s: %s lacks %s's flow %s (has %+v, %v)", what, dst.name, src.name, k, g, ok)
					}
				}
			}
			if len(dst.held) != want {
				t.Fatalf("%s: %s holds %d flows of the others, want %d", what, dst.name, len(dst.held), want)
			}
		}
	}
	res, err := r.Round(ctx)
	if err != nil || len(res) != 6 {
		t.Fatalf("first round: %d results, %v", len(res), err)
	}
	for _, x := range res {
		if x.Snapshot == nil || x.Snapshot.Pruned != 0 {
			t.Fatalf("first round %s->%s: %+v; want a snapshot, nothing pruned", x.Source, x.Target, x.RoundResult)
		}
	}
	holdsAll("after the snapshots")
	for _, g := range edges {
		if g.joins != 1 {
			t.Fatalf("%s joined %d times after the first round, want once", g.name, g.joins)
		}
	}

	// Deltas from two edges at once; e1's journal acked to the least of
	// e2's and e3's cursors, which both follow it to its end.
	for i := 10; i < 30; i++ {
		e1.a.learn(i, 3)
	}
	e1.a.forget(0)
	e1.a.j.Seal()
	e3.a.learn(300, 1)
	e3.a.j.Seal()
	if _, err := r.Round(ctx); err != nil {
		t.Fatal(err)
	}
	holdsAll("after the deltas")
	c2, c3 := e2.targets["e1"].cur, e3.targets["e1"].cur
	if least := min(c2.Seq, c3.Seq); least == 0 || e1.a.acked != least {
		t.Fatalf("e1 acked %d; e2 follows it to %d, e3 to %d", e1.a.acked, c2.Seq, c3.Seq)
	}

	// e3 is down: e1's and e2's journals reach e2 and e1, and are acked
	// no further than e3 holds.
	acked := e1.a.acked
	e3.down = true
	for i := 30; i < 40; i++ {
		e1.a.learn(i, 4)
	}
	e1.a.j.Seal()
	_, err = r.Round(ctx)
	if !errors.Is(err, errDown) {
		t.Fatalf("round with e3 down: %v, want its error", err)
	}
	if e1.a.acked != acked {
		t.Fatalf("e1 acked %d past e3's cursor (%d) while e3 was down", e1.a.acked, acked)
	}
	if _, ok := e2.held[testKey(35)]; !ok {
		t.Fatal("e2 lacks e1's new flow while e3 is down")
	}
	// e1 and e2 hold what every edge that is up has: they join; e3, down,
	// is not asked.
	if e1.joins != 3 || e2.joins != 3 || e3.joins != 2 {
		t.Fatalf("joins with e3 down: e1 %d, e2 %d, e3 %d; want 3, 3, 2", e1.joins, e2.joins, e3.joins)
	}
	e3.down = false
	if _, err := r.Round(ctx); err != nil {
		t.Fatal(err)
	}
	holdsAll("after e3 is back")
	if e1.a.acked <= acked {
		t.Fatalf("e1 acked %d once e3 caught up, no further than %d", e1.a.acked, acked)
	}
	// Two edges of one name are refused.
	r2 := &GroupReplicator{Edges: []GroupEdge{e1.edge(), e1.edge()}}
	if _, err := r2.Round(ctx); err == nil {
		t.Error(fmt.Sprint("two edges named e1: no error"))
	}
}
