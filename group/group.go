// Package group says whether the edges of a group agree on what decides a
// new flow's backend, and where they do not.
//
// Several edges that announce the same VIPs behind an ECMP router form a
// group: the router may move a flow from one edge to another at any
// time, and the flow keeps its backend only if both edges pick the same
// one. They do when they run the same catalog with the same seeds
// (hash_seed, maglev_seed): each Maglev table then names, slot by slot,
// the same backend address on every edge. Backend and service ids are
// node-local (an edge numbers them in the order it learns them), so edges
// are compared by the addresses their tables name, never by ids.
//
// The package is pure Go: it compares what callers read from each edge
// (the seeds from its status, the tables from its pinned maps through
// bpf.View.MaglevBackends) and reports the first differences in terms a
// person can act on. An edge of other seeds is no member of the group:
// CheckSeeds refuses it (ErrSeeds), and so do the HA snapshot import
// (ha.ErrSeeds) and cmd/fluxvm-replicator.
package group

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
)

// Errors of a comparison, checkable with errors.Is.
var (
	// ErrSeeds: an edge's hash_seed or maglev_seed differs from the
	// reference edge's.
	ErrSeeds = errors.New("group: edges with other seeds")
	// ErrTables: an edge's Maglev tables name other backends than the
	// reference edge's for some slots, or it has other frontends.
	ErrTables = errors.New("group: Maglev tables differ")
)

// MaxSlotDiffs is how many differing slots a TableDiff lists (it counts
// them all).
const MaxSlotDiffs = 8

// Seeds are the two seeds that decide a new flow's backend on an edge.
// The zero Seeds is a seed pair like any other (the default of both).
type Seeds struct {
	// FlowHash seeds the datapath's hash of a new flow's 5-tuple, which
	// picks its Maglev slot (hash_seed).
	FlowHash uint64 `json:"hash_seed"`
	// Maglev seeds the Maglev tables: which slots each backend holds
	// (maglev_seed).
	Maglev uint64 `json:"maglev_seed"`
}

// String is "hash_seed=0x.. maglev_seed=0x..".
func (s Seeds) String() string {
	return fmt.Sprintf("hash_seed=%#x maglev_seed=%#x", s.FlowHash, s.Maglev)
}

// Edge is what one edge holds that every other edge of its group must hold
// too.
type Edge struct {
	// Name names the edge in reports (a node name, a URL).
	Name  string
	Seeds Seeds
	// Tables are its Maglev tables by frontend ("10.96.0.1:80/tcp", as
	// bpf.Frontend prints it): the backend endpoint of each slot, in
	// slot order; empty for a frontend without an eligible backend. Nil
	// when only the seeds are compared.
	Tables map[string][]netip.AddrPort
}

// SeedDiff is an edge whose seeds differ from the reference's.
type SeedDiff struct {
	Edge       string
	Seeds, Ref Seeds
}

// SlotDiff is one slot whose backend differs: Ref on the reference edge,
// Got on the other (the zero AddrPort past the end of a shorter table).
type SlotDiff struct {
	Slot     int
	Ref, Got netip.AddrPort
}

// TableDiff is a frontend whose table differs between the reference edge
// and Edge.
type TableDiff struct {
	Frontend string
	Edge     string
	// Missing: the reference has the frontend, Edge does not; Extra: the
	// other way round. Neither: both have it, and the tables differ.
	Missing, Extra bool
	// Size and RefSize are the tables' slots on Edge and on the reference.
	Size, RefSize int
	// Differing counts the slots that differ (those past the shorter
	// table included); First lists the first MaxSlotDiffs of them.
	Differing int
	First     []SlotDiff
}

// Report is the result of Compare: the reference edge (the first), what
// was compared, and every difference. A report without differences is
// a group that agrees.
type Report struct {
	Reference string
	Edges     int
	// Frontends and Slots count what was compared (the reference's).
	Frontends, Slots int
	Seeds            []SeedDiff
	Tables           []TableDiff
}

// CheckSeeds reports, wrapping ErrSeeds, every edge whose seeds differ
// from the first edge's, naming both seeds of each; nil when all agree
// (or there are fewer than two edges).
func CheckSeeds(edges ...Edge) error {
	r := Report{}
	if len(edges) > 0 {
		r.Reference = edges[0].Name
		r.Seeds = seedDiffs(edges)
	}
	return r.Err()
}

func seedDiffs(edges []Edge) []SeedDiff {
	var out []SeedDiff
	for _, e := range edges[1:] {
		if e.Seeds != edges[0].Seeds {
			out = append(out, SeedDiff{Edge: e.Name, Seeds: e.Seeds, Ref: edges[0].Seeds})
		}
	}
	return out
}

// Compare compares every edge with the first: their seeds, and the
// backend of every slot of every frontend's table. Frontends are visited
// in order of their names, so that a report lists the same differences in
// the same order every time.
func Compare(edges ...Edge) Report {
	r := Report{Edges: len(edges)}
	if len(edges) == 0 {
		return r
	}
	ref := edges[0]
	r.Reference, r.Seeds, r.Frontends = ref.Name, seedDiffs(edges), len(ref.Tables)
	for _, t := range ref.Tables {
		r.Slots += len(t)
	}
	for _, e := range edges[1:] {
		names := slices.Sorted(maps.Keys(ref.Tables))
		for name := range e.Tables {
			if _, ok := ref.Tables[name]; !ok {
				names = append(names, name)
			}
		}
		slices.Sort(names)
		for _, fe := range names {
			if d, ok := diffTable(fe, e.Name, ref.Tables, e.Tables); ok {
				r.Tables = append(r.Tables, d)
			}
		}
	}
	return r
}

// diffTable compares frontend fe's table on the reference and on edge.
func diffTable(fe, edge string, ref, got map[string][]netip.AddrPort) (TableDiff, bool) {
	rt, inRef := ref[fe]
	gt, inGot := got[fe]
	d := TableDiff{Frontend: fe, Edge: edge, Missing: !inGot, Extra: !inRef, Size: len(gt), RefSize: len(rt)}
	for i := range max(len(rt), len(gt)) {
		var a, b netip.AddrPort
		if i < len(rt) {
			a = rt[i]
		}
		if i < len(gt) {
			b = gt[i]
		}
		if a != b {
			if d.Differing++; len(d.First) < MaxSlotDiffs {
				d.First = append(d.First, SlotDiff{Slot: i, Ref: a, Got: b})
			}
		}
	}
	return d, d.Missing || d.Extra || d.Differing > 0
}

// Err is nil for a report without differences; else an error wrapping
// ErrSeeds (when seeds differ) and ErrTables (when tables differ) that
// names each difference: the edges and both seeds; the frontend, the
// first differing slots and the backend each edge has there.
func (r Report) Err() error {
	var lines []string
	for _, s := range r.Seeds {
		lines = append(lines, fmt.Sprintf("edge %s has %s, %s has %s", s.Edge, s.Seeds, r.Reference, s.Ref))
	}
	for _, t := range r.Tables {
		lines = append(lines, t.String(r.Reference))
	}
	detail := strings.Join(lines, "; ")
	switch {
	case len(r.Seeds) > 0 && len(r.Tables) > 0:
		return fmt.Errorf("%w, %w: %s", ErrSeeds, ErrTables, detail)
	case len(r.Seeds) > 0:
		return fmt.Errorf("%w: %s", ErrSeeds, detail)
	case len(r.Tables) > 0:
		return fmt.Errorf("%w: %s", ErrTables, detail)
	}
	return nil
}

// String describes the difference, ref naming the reference edge.
func (d TableDiff) String(ref string) string {
	switch {
	case d.Missing:
		return fmt.Sprintf("%s: on %s, not on %s", d.Frontend, ref, d.Edge)
	case d.Extra:
		return fmt.Sprintf("%s: on %s, not on %s", d.Frontend, d.Edge, ref)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %d of %d slots differ on %s", d.Frontend, d.Differing, max(d.Size, d.RefSize), d.Edge)
	if d.Size != d.RefSize {
		fmt.Fprintf(&b, " (%d slots there, %d on %s)", d.Size, d.RefSize, ref)
	}
	for i, s := range d.First {
		sep := ", first "
		if i > 0 {
			sep = ", "
		}
		fmt.Fprintf(&b, "%sslot %d %s on %s, %s on %s", sep, s.Slot, slotString(s.Ref), ref, slotString(s.Got), d.Edge)
	}
	return b.String()
}

func slotString(ap netip.AddrPort) string {
	if !ap.IsValid() {
		return "none"
	}
	return ap.String()
}
