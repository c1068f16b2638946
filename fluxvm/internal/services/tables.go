package services

import (
	"fmt"
	"runtime"
	"sync"

	"github.com/fluxvm/servicefabric/maglev"
)

// builtTable is a frontend's Maglev table, built and written into a new
// inner map that is not in place yet.
type builtTable struct {
	inner    Table  // nil: no eligible backend
	size     uint32 // its slots
	eligible int
}

// Tables are the Maglev tables of a plan's frontends, built by
// BuildTables and not in place yet. Close releases them (what is in
// place stays).
type Tables []builtTable

// Close releases the tables' inner maps.
func (ts Tables) Close() {
	for _, t := range ts {
		if t.inner != nil {
			t.inner.Close()
		}
	}
}

// BuildTables builds the table of every frontend of pl and writes each
// into a new inner map. It needs no lock: the inner maps are new, and the
// Maglev tables come from the Programmer's pool.
func (p *Programmer) BuildTables(pl *Plan) (Tables, error) {
	out := make(Tables, 0, len(pl.frontends))
	for _, f := range pl.frontends {
		t, err := p.buildTable(f.mb)
		if err != nil {
			out.Close()
			return nil, fmt.Errorf("frontend %s: %w", f.fe.key, err)
		}
		out = append(out, t)
	}
	return out, nil
}

// buildTable builds the Maglev table of backends mb and writes it into a
// new inner map with one batch update. The table has maglev.SizeFor(len(mb))
// slots, up to the tier's size: what the frontend needs for an even spread,
// not the tier's largest (a frontend of 3 backends takes 509 slots, 2 KiB,
// instead of 65,537 at tier M); the datapath reads each table's size from
// its inner map.
//
// At most GOMAXPROCS builds run at once, each with a table of the pool
// (kept per size): a table keeps its build scratch, about 10 bytes per
// slot, so the Programmer keeps a few rather than one per frontend.
func (p *Programmer) buildTable(mb []maglev.Backend) (builtTable, error) {
	size := maglev.SizeFor(len(mb), p.cfg.Capacities.MaglevSize)
	tp := &p.tables
	tp.sem <- struct{}{}
	defer func() { <-tp.sem }()
	t, err := tp.get(size, p.cfg.MaglevSeed, mb)
	if err != nil {
		return builtTable{}, err
	}
	defer tp.put(size, t)
	bt := builtTable{size: size}
	for _, c := range t.SlotCounts() {
		if c.Slots > 0 {
			bt.eligible++
		}
	}
	entries := t.Entries()
	if len(entries) == 0 {
		return bt, nil
	}
	inner, err := p.deps.Maps.NewTable(size, entries)
	if err != nil {
		return builtTable{}, fmt.Errorf("maglev table: %w", err)
	}
	bt.inner = inner
	return bt, nil
}

// tablePool holds the Maglev tables that buildTable builds in, by size.
type tablePool struct {
	sem  chan struct{} // one token per build under way
	mu   sync.Mutex
	free map[uint32][]*maglev.Table
}

func newTablePool() tablePool {
	return tablePool{sem: make(chan struct{}, runtime.GOMAXPROCS(0)), free: map[uint32][]*maglev.Table{}}
}

// get is a table of size slots of the pool rebuilt for mb, or a new one.
func (tp *tablePool) get(size uint32, seed uint64, mb []maglev.Backend) (*maglev.Table, error) {
	tp.mu.Lock()
	var t *maglev.Table
	if free := tp.free[size]; len(free) > 0 {
		t, tp.free[size] = free[len(free)-1], free[:len(free)-1]
	}
	tp.mu.Unlock()
	if t == nil {
		return maglev.New(maglev.Config{Size: size, Seed: seed}, mb)
	}
	if err := t.Rebuild(mb); err != nil {
		tp.put(size, t)
		return nil, err
	}
	return t, nil
}

func (tp *tablePool) put(size uint32, t *maglev.Table) {
	tp.mu.Lock()
	tp.free[size] = append(tp.free[size], t)
	tp.mu.Unlock()
}

// swapTables puts the tables of pl's frontends in place, each as a whole:
// the complete new inner map replaces the old one, or, with no eligible
// backend, the slot is emptied. It reads nothing the lock guards, so it
// may run without it.
func (p *Programmer) swapTables(pl *Plan, tables Tables) error {
	for i, f := range pl.frontends {
		if err := p.swapTable(f.fe.sid, tables[i].inner); err != nil {
			return fmt.Errorf("frontend %s: %w", f.fe.key, err)
		}
	}
	return nil
}

// swapTable is Maps.SwapTable with a nil Table for an empty slot (not an
// interface holding a nil pointer).
func (p *Programmer) swapTable(sid uint32, t Table) error {
	if err := p.deps.Maps.SwapTable(sid, t); err != nil {
		return fmt.Errorf("maglev table: %w", err)
	}
	return nil
}
