package revindex

import (
	"maps"
	"syscall"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
)

// TestSeedSettle: Open seeds the index from the pinned map, the restore
// confirms (Add) the slots of the catalog's frontends and appends new
// ones, and Settle drops what was not confirmed (with a catalog) and
// makes the map hold exactly the model.
func TestSeedSettle(t *testing.T) {
	clamped := value(1, 1, 2, 3, 4)
	clamped.Count = 9 // more than the slots: only Be2feSlots are read
	dup := value(2, 1, 1, 2)
	for _, tc := range []struct {
		name    string
		catalog bool
		pinned  map[bpf.Be2feKey]bpf.Be2feValue
		have    map[bpf.Be2feKey]bpf.Be2feValue // the map Settle finds; nil: pinned
		before  [][2]byte                       // Add(fe(f), ep(e)) before Seed
		restore [][2]byte                       // Add(fe(f), ep(e)) in catalog order
		want    listed
		seeded  []byte // frontends whose slots stay seeded
		writes  int
	}{
		{name: "a restart keeps the pinned order, not the catalog's, and writes nothing",
			catalog: true,
			pinned:  map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 3, 1, 2), key(2): value(2, 2)},
			restore: [][2]byte{{1, 1}, {2, 1}, {2, 2}, {3, 1}},
			want:    listed{1: {3, 1, 2}, 2: {2}}},
		{name: "a frontend the catalog lost: its slot goes, the later ones move down",
			catalog: true,
			pinned:  map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 3, 1, 2), key(2): value(2, 3)},
			restore: [][2]byte{{1, 1}, {2, 1}},
			want:    listed{1: {1, 2}}, writes: 2},
		{name: "a frontend new in the catalog is appended after the pinned ones",
			catalog: true,
			pinned:  map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 2)},
			restore: [][2]byte{{1, 1}, {2, 1}, {1, 2}},
			want:    listed{1: {2, 1}, 2: {1}}, writes: 2},
		{name: "without a catalog the pinned slots stay, seeded",
			pinned: map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 1, 2)},
			want:   listed{1: {1, 2}}, seeded: []byte{1, 2}},
		{name: "without a catalog an apply confirms its slot in place",
			pinned:  map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 1, 2)},
			restore: [][2]byte{{2, 1}},
			want:    listed{1: {1, 2}}, seeded: []byte{1}},
		{name: "seeding replaces the model; an unknown family is skipped, a frontend named twice listed once",
			pinned: map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 1), key(2): dup,
				{Family: 0, Port: bpf.Port(8080), Proto: 6}: value(1, 2)},
			have:   map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 1), key(2): dup},
			before: [][2]byte{{3, 3}},
			want:   listed{1: {1}, 2: {1, 2}}, seeded: []byte{1, 2}, writes: 1},
		{name: "after a reload the map is new: Settle writes the whole model",
			catalog: true,
			pinned:  map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 2, 1), key(2): value(2, 1)},
			have:    map[bpf.Be2feKey]bpf.Be2feValue{},
			restore: [][2]byte{{1, 1}, {1, 2}, {2, 1}},
			want:    listed{1: {2, 1}, 2: {1}}, writes: 2},
		{name: "an entry the model does not hold is deleted",
			catalog: true,
			pinned:  map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 1)},
			have:    map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 1), key(3): value(3, 4)},
			restore: [][2]byte{{1, 1}},
			want:    listed{1: {1}}, writes: 1},
		{name: "an unknown family is skipped, a frontend named twice listed once, the count read up to the slots",
			catalog: true,
			pinned: map[bpf.Be2feKey]bpf.Be2feValue{key(1): clamped, key(2): dup,
				{Family: 0, Port: bpf.Port(8080), Proto: 6}: value(1, 1)},
			have:    map[bpf.Be2feKey]bpf.Be2feValue{key(1): clamped, key(2): dup},
			restore: [][2]byte{{1, 1}, {2, 1}, {3, 1}, {4, 1}, {1, 2}, {2, 2}},
			want:    listed{1: {1, 2, 3, 4}, 2: {1, 2}}, writes: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x, m, _ := newTestIndex(t, tc.catalog)
			have := tc.have
			if have == nil {
				have = tc.pinned
			}
			for _, r := range tc.before {
				if err := x.Add(fe(r[0]), uint32(r[0]), ep(r[1]), bidOf(r[0], r[1]), true); err != nil {
					t.Fatal(err)
				}
			}
			m.entries, m.writes = maps.Clone(have), 0
			x.Seed(maps.All(tc.pinned))
			for _, r := range tc.restore {
				if err := x.Add(fe(r[0]), uint32(r[0]), ep(r[1]), bidOf(r[0], r[1]), true); err != nil {
					t.Fatal(err)
				}
			}
			if err := x.Settle(maps.Clone(m.entries)); err != nil {
				t.Fatal(err)
			}
			checkListed(t, x, m, tc.want, tc.seeded...)
			if m.writes != tc.writes {
				t.Errorf("%d map writes, want %d", m.writes, tc.writes)
			}
		})
	}
}

// TestSettleFails: a write Settle cannot make is its error.
func TestSettleFails(t *testing.T) {
	x, m, _ := newTestIndex(t, true)
	x.Seed(maps.All(map[bpf.Be2feKey]bpf.Be2feValue{key(1): value(1, 1)}))
	if err := x.Add(fe(1), 1, ep(1), bidOf(1, 1), true); err != nil {
		t.Fatal(err)
	}
	m.fail = syscall.EIO
	if err := x.Settle(nil); err == nil {
		t.Fatal("Settle hid a failed write")
	}
}
