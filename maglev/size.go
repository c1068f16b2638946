package maglev

// SlotsPerBackend is the evenness rule's margin: a table of at least this
// many slots per backend keeps each equally weighted backend's share of new
// flows within about 1% of its due (see the package documentation).
const SlotsPerBackend = 100

// Ladder is the table sizes SizeFor chooses from, smallest first: primes
// about doubling from one to the next, ending with the largest tier's
// table (SizeL). The tiers' own sizes SizeS and SizeM are rungs, so a tier's
// largest table is always on the ladder.
var Ladder = []uint32{251, 509, 1021, 2039, 4093, 8191, SizeS, 32749, SizeM, SizeL}

// SizeFor is the table size for n backends, no larger than max: the
// smallest rung of Ladder with at least SlotsPerBackend slots per backend,
// or the largest rung not above max when none is small enough to obey the
// rule (and max itself when max is below the first rung).
//
// The size depends on n alone, so two nodes given the same backends build
// the same table. Count every backend a frontend lists, not only those
// eligible now: then draining a backend, or a health check marking it down,
// does not change the size, and with it the slot every new flow hashes to;
// only adding or removing backends can move a table to another rung (new
// flows are then spread afresh; established flows keep their backends by
// conntrack).
func SizeFor(n int, max uint32) uint32 {
	if max < Ladder[0] {
		return max
	}
	best := Ladder[0]
	for _, m := range Ladder {
		if m > max {
			break
		}
		best = m
		if uint64(m) >= uint64(n)*SlotsPerBackend {
			break
		}
	}
	return best
}
