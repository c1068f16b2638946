package group

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/maglev"
)

// table builds a real Maglev table (package maglev) of the backends with
// seed and returns it as addresses: ids are assigned in the order given,
// as an edge assigns them in the order it learns backends.
func table(t *testing.T, seed uint64, size uint32, eps ...string) []netip.AddrPort {
	t.Helper()
	var bs []maglev.Backend
	byID := map[uint32]netip.AddrPort{}
	for i, s := range eps {
		ap := netip.MustParseAddrPort(s)
		id := uint32(100 + i)
		bs = append(bs, maglev.Backend{ID: id, Addr: ap.Addr(), Port: ap.Port(), Proto: 6, Weight: 1, Ready: true})
		byID[id] = ap
	}
	tb, err := maglev.New(maglev.Config{Size: size, Seed: seed}, bs)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]netip.AddrPort, 0, size)
	for _, id := range tb.Entries() {
		out = append(out, byID[id])
	}
	return out
}

// TestCompare: edges whose tables were built from the same backends in
// another order (so with other ids) agree; another Maglev seed, a backend
// missing, a frontend missing or extra, and other seeds are each reported
// with the frontend, the edge and the first differing slots.
func TestCompare(t *testing.T) {
	const fe, fe2 = "10.96.0.1:80/tcp", "[fd00::1]:80/tcp"
	eps := []string{"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:8080"}
	rev := []string{eps[3], eps[2], eps[1], eps[0]}
	ref := Edge{Name: "a", Tables: map[string][]netip.AddrPort{fe: table(t, 0, 251, eps...), fe2: table(t, 0, 251, eps[:2]...)}}
	with := func(name string, s Seeds, tables map[string][]netip.AddrPort) Edge {
		return Edge{Name: name, Seeds: s, Tables: tables}
	}
	otherSeed := table(t, 7, 251, rev...)
	tests := []struct {
		name      string
		edge      Edge
		seeds     bool
		diffs     []TableDiff // Frontend, Edge, Missing, Extra, Size, RefSize, Differing (First checked apart)
		wantInErr []string
	}{
		{name: "same backends, other order", edge: with("b", Seeds{}, map[string][]netip.AddrPort{fe: table(t, 0, 251, rev...), fe2: table(t, 0, 251, eps[1], eps[0])})},
		{name: "other maglev seed", edge: with("b", Seeds{}, map[string][]netip.AddrPort{fe: otherSeed, fe2: ref.Tables[fe2]}),
			diffs:     []TableDiff{{Frontend: fe, Edge: "b", Size: 251, RefSize: 251}},
			wantInErr: []string{"10.96.0.1:80/tcp", "slots differ on b", "first slot"}},
		{name: "a backend missing", edge: with("b", Seeds{}, map[string][]netip.AddrPort{fe: table(t, 0, 251, eps[:3]...), fe2: ref.Tables[fe2]}),
			diffs: []TableDiff{{Frontend: fe, Edge: "b", Size: 251, RefSize: 251}}},
		{name: "a shorter table", edge: with("b", Seeds{}, map[string][]netip.AddrPort{fe: ref.Tables[fe][:250], fe2: ref.Tables[fe2]}),
			diffs:     []TableDiff{{Frontend: fe, Edge: "b", Size: 250, RefSize: 251, Differing: 1}},
			wantInErr: []string{"1 of 251 slots differ on b (250 slots there, 251 on a), first slot 250 " + ref.Tables[fe][250].String() + " on a, none on b"}},
		{name: "a frontend missing", edge: with("b", Seeds{}, map[string][]netip.AddrPort{fe: ref.Tables[fe]}),
			diffs:     []TableDiff{{Frontend: fe2, Edge: "b", Missing: true, RefSize: 251, Differing: 251}},
			wantInErr: []string{"[fd00::1]:80/tcp: on a, not on b"}},
		{name: "a frontend extra", edge: with("b", Seeds{}, map[string][]netip.AddrPort{fe: ref.Tables[fe], fe2: ref.Tables[fe2], "10.96.0.9:53/udp": nil}),
			diffs:     []TableDiff{{Frontend: "10.96.0.9:53/udp", Edge: "b", Extra: true}},
			wantInErr: []string{"10.96.0.9:53/udp: on b, not on a"}},
		{name: "other hash seed, same tables", edge: with("b", Seeds{FlowHash: 5}, ref.Tables), seeds: true,
			wantInErr: []string{"edge b has hash_seed=0x5 maglev_seed=0x0, a has hash_seed=0x0 maglev_seed=0x0"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := Compare(ref, tc.edge)
			if r.Reference != "a" || r.Edges != 2 || r.Frontends != 2 || r.Slots != 502 {
				t.Errorf("report %+v: want reference a, 2 edges, 2 frontends, 502 slots", r)
			}
			if got := len(r.Seeds) > 0; got != tc.seeds {
				t.Errorf("seed diffs %+v, want some: %v", r.Seeds, tc.seeds)
			}
			if len(r.Tables) != len(tc.diffs) {
				t.Fatalf("table diffs %+v, want %d", r.Tables, len(tc.diffs))
			}
			for i, d := range r.Tables {
				w := tc.diffs[i]
				if w.Differing == 0 {
					w.Differing = d.Differing // counted below
				}
				if d.Frontend != w.Frontend || d.Edge != w.Edge || d.Missing != w.Missing || d.Extra != w.Extra ||
					d.Size != w.Size || d.RefSize != w.RefSize || d.Differing != w.Differing {
					t.Errorf("diff %+v, want %+v", d, w)
				}
				// Differing and First are the slots that differ, counted
				// and listed independently here.
				rt, gt := padded(ref.Tables[d.Frontend], tc.edge.Tables[d.Frontend])
				var all []SlotDiff
				for s := range rt {
					if rt[s] != gt[s] {
						all = append(all, SlotDiff{s, rt[s], gt[s]})
					}
				}
				n, first := len(all), all[:min(len(all), MaxSlotDiffs)]
				if n == 0 {
					first = nil
				}
				if n == 0 && !d.Extra || d.Differing != n || !reflect.DeepEqual(d.First, first) {
					t.Errorf("%s: %d differing, first %v; want %d, %v", d.Frontend, d.Differing, d.First, n, first)
				}
			}
			err := r.Err()
			if wantErr := tc.seeds || len(tc.diffs) > 0; (err != nil) != wantErr {
				t.Fatalf("err %v, want an error: %v", err, wantErr)
			}
			if err == nil {
				return
			}
			if errors.Is(err, ErrSeeds) != tc.seeds || errors.Is(err, ErrTables) != (len(tc.diffs) > 0) {
				t.Errorf("err %v: ErrSeeds %v, ErrTables %v", err, errors.Is(err, ErrSeeds), errors.Is(err, ErrTables))
			}
			for _, s := range tc.wantInErr {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("err %q lacks %q", err, s)
				}
			}
		})
	}
}

// padded returns copies of a and b of the same length, the shorter one
// filled with zero AddrPorts (what a slot past a table's end compares as).
func padded(a, b []netip.AddrPort) ([]netip.AddrPort, []netip.AddrPort) {
	n := max(len(a), len(b))
	return append(slices.Clone(a), make([]netip.AddrPort, n-len(a))...), append(slices.Clone(b), make([]netip.AddrPort, n-len(b))...)
}

// TestCheckSeeds: every edge with other seeds than the first is named
// with both seeds; agreeing edges, one edge and none pass.
func TestCheckSeeds(t *testing.T) {
	a := Edge{Name: "a", Seeds: Seeds{FlowHash: 1, Maglev: 2}}
	tests := []struct {
		edges []Edge
		want  []string // in the error; nil: no error
	}{
		{nil, nil},
		{[]Edge{a}, nil},
		{[]Edge{a, {Name: "b", Seeds: a.Seeds}, {Name: "c", Seeds: a.Seeds}}, nil},
		{[]Edge{a, {Name: "b", Seeds: Seeds{FlowHash: 1, Maglev: 3}}}, []string{"edge b has hash_seed=0x1 maglev_seed=0x3, a has hash_seed=0x1 maglev_seed=0x2"}},
		{[]Edge{a, {Name: "b", Seeds: a.Seeds}, {Name: "c", Seeds: Seeds{}}, {Name: "d", Seeds: Seeds{FlowHash: 9, Maglev: 2}}},
			[]string{"edge c has hash_seed=0x0 maglev_seed=0x0", "edge d has hash_seed=0x9 maglev_seed=0x2"}},
	}
	for i, tc := range tests {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			err := CheckSeeds(tc.edges...)
			if (err != nil) != (tc.want != nil) || err != nil && (!errors.Is(err, ErrSeeds) || errors.Is(err, ErrTables)) {
				t.Fatalf("err %v, want one: %v (ErrSeeds only)", err, tc.want != nil)
			}
			for _, s := range tc.want {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("err %q lacks %q", err, s)
				}
			}
			if err != nil && strings.Contains(err.Error(), "edge b") && tc.edges[1].Seeds == a.Seeds {
				t.Errorf("err %q names b, whose seeds agree", err)
			}
		})
	}
}
