package edt

import (
	"fmt"

	"github.com/fluxvm/servicefabric/bpf"
)

// A paced service's frontends share one pacer, the service's frontend
// with the lowest id, whose departure clock they all advance. A change
// that removes the pacer frontend repoints the others first. The clocks
// survive every change but one of rate or horizon: a new pacer starts
// from the old one's (ClockFrom), and a restart onto kept maps rewrites
// nothing (Entry.Put).

// EntryMap is fluxvm_edt as frontend entries are read and written.
type EntryMap interface {
	LookupEDT(sid uint32) (bpf.EDTValue, error)
	PutEDT(sid uint32, v bpf.EDTValue) error
}

// Entry is a frontend's fluxvm_edt entry as last written, the departure
// clock aside. The zero value knows nothing yet: Put reads the map first.
// Its owner (the services component) guards it.
type Entry struct {
	v     bpf.EDTValue
	known bool
}

// Zeroed records that the entry was written zero (a new id's slot reset).
func (e *Entry) Zeroed() { e.v, e.known = bpf.EDTValue{}, true }

// paced is the entry of a paced frontend, if known.
func (e *Entry) paced() (bpf.EDTValue, bool) { return e.v, e.known && e.v.Rate != 0 }

// Paced reports whether the entry is known and paces.
func (e *Entry) Paced() bool { _, ok := e.paced(); return ok }

// Put writes frontend sid's entry through m, unless it holds v already (a
// rewrite would reset the departure clock). v.LastDeparture is the clock
// the entry is written with (a new pacer gets the old pacer's:
// ClockFrom); the other fields are compared and remembered without it.
//
// The departure clock, as written:
//   - a rate or horizon change (or pacing turned on or off) starts it
//     empty: the next packet goes at once, then the new rate holds;
//   - a change of the pacer alone keeps it: the entry's own clock, or
//     the one passed in (the old pacer's), whichever is later;
//   - at Open (the entry not known yet: the maps may be an earlier
//     start's, kept) the entry is read first, and one that holds v
//     already is not rewritten, so a restart keeps every clock.
func (e *Entry) Put(m EntryMap, sid uint32, v bpf.EDTValue) error {
	clock := v.LastDeparture
	v.LastDeparture = 0
	if !e.known {
		if cur, err := m.LookupEDT(sid); err == nil {
			cur.LastDeparture = 0
			e.v, e.known = cur, true
		}
	}
	if e.known && e.v == v {
		return nil
	}
	if e.known && v.Rate != 0 && SameRate(e.v, v) {
		if cur, err := m.LookupEDT(sid); err == nil {
			clock = max(clock, cur.LastDeparture)
		}
	}
	w := v
	w.LastDeparture = clock
	if err := m.PutEDT(sid, w); err != nil {
		return fmt.Errorf("edt entry: %w", err)
	}
	e.v, e.known = v, true
	return nil
}

// ClockFrom is the departure clock a change hands on to a service's new
// pacer: when the pacer changes (its frontend removed, or a frontend with
// a lower id added) and the rate and horizon stay (want), the new pacer's
// entry starts from the old pacer's clock, read now from m (what the
// datapath adds to it between this read and the write is lost: at most
// the packets of that moment go early). old is the entry of a frontend
// of the service paced before the change (nil: none). Otherwise 0: no
// clock to hand on.
func ClockFrom(m EntryMap, want bpf.EDTValue, old *Entry, pacer uint32) uint64 {
	if want.Rate == 0 || old == nil {
		return 0
	}
	v, ok := old.paced()
	if !ok || v.Pacer == 0 || v.Pacer == pacer || !SameRate(v, want) {
		return 0
	}
	cur, err := m.LookupEDT(v.Pacer)
	if err != nil {
		return 0
	}
	return cur.LastDeparture
}
