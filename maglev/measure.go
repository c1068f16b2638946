package maglev

// Disruption says how much of the datapath's traffic a change of table
// moves. Flows hash uniformly onto slots, so a fraction of slots is the
// fraction of flows (or new connections) sent to a different place.
type Disruption struct {
	// Slots is the number of slots compared: the new table's size.
	Slots int
	// MovedSlots counts slots whose backend identity changed, including
	// slots that went from no backend (empty table) to one or back.
	MovedSlots int
	// StayedSlots counts slots whose old backend still holds slots in the
	// new table: the slots a perfect algorithm could have left alone.
	StayedSlots int
	// MovedWhileStayedSlots counts the StayedSlots that moved anyway: the
	// churn that breaks connections to healthy backends. Most of it is
	// collateral, but it includes the slots a staying backend had to give
	// up because its count shrank (when backends are added or weights
	// change); MovedSlots − MinMovedSlots is the pure excess.
	MovedWhileStayedSlots int
	// MinMovedSlots is the least any table with the new slot counts must
	// move: for each backend (and for "no backend"), the slots it gained.
	MinMovedSlots int

	// Moved is MovedSlots / Slots.
	Moved float64
	// MovedWhileStayed is MovedWhileStayedSlots / StayedSlots (0 when no
	// slot stayed).
	MovedWhileStayed float64
}

// Measure compares the table before a change with the table after it, slot
// by slot, matching backends by identity (address, port, protocol), not by
// ID. A nil table counts as empty.
//
// Tables of different sizes cannot be compared slot by slot: changing M
// changes hash % M for nearly every flow, so Measure then reports every slot
// as moved, with MinMovedSlots = Slots.
func Measure(before, after *Table) Disruption {
	var d Disruption
	switch {
	case after != nil:
		d.Slots = int(after.cfg.Size)
	case before != nil:
		d.Slots = int(before.cfg.Size)
	}
	oldEmpty := before == nil || before.Empty()
	newEmpty := after == nil || after.Empty()
	switch {
	case before != nil && after != nil && before.cfg.Size != after.cfg.Size:
		d.MovedSlots, d.MinMovedSlots = d.Slots, d.Slots
		for i, c := range before.counts {
			if after.find(before.ids[i]) >= 0 {
				d.StayedSlots += int(c)
			}
		}
		d.MovedWhileStayedSlots = d.StayedSlots
	case oldEmpty && newEmpty:
	case oldEmpty || newEmpty:
		d.MovedSlots, d.MinMovedSlots = d.Slots, d.Slots
	default:
		// Map each before backend to its index in after, by merging the two
		// identity-ordered lists.
		to := make([]int32, len(before.ids))
		j := 0
		for i, id := range before.ids {
			for j < len(after.ids) && after.ids[j].compare(id) < 0 {
				d.MinMovedSlots += int(after.counts[j])
				j++
			}
			to[i] = -1
			if j < len(after.ids) && after.ids[j] == id {
				if after.counts[j] > 0 {
					to[i] = int32(j)
				}
				d.MinMovedSlots += int(max(after.counts[j], before.counts[i]) - before.counts[i])
				j++
			}
		}
		for ; j < len(after.ids); j++ {
			d.MinMovedSlots += int(after.counts[j])
		}
		for s, id := range before.entries {
			ni := to[before.indexOf(id)]
			moved := ni != int32(after.indexOf(after.entries[s]))
			if moved {
				d.MovedSlots++
			}
			if ni >= 0 {
				d.StayedSlots++
				if moved {
					d.MovedWhileStayedSlots++
				}
			}
		}
	}
	if d.Slots > 0 {
		d.Moved = float64(d.MovedSlots) / float64(d.Slots)
	}
	if d.StayedSlots > 0 {
		d.MovedWhileStayed = float64(d.MovedWhileStayedSlots) / float64(d.StayedSlots)
	}
	return d
}

// find returns the index of the eligible backend with identity id holding at
// least one slot, or -1.
func (t *Table) find(id identity) int {
	lo, hi := 0, len(t.ids)
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if t.ids[mid].compare(id) < 0 {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	if lo < len(t.ids) && t.ids[lo] == id && t.counts[lo] > 0 {
		return lo
	}
	return -1
}
