package maglev

import (
	"math/rand/v2"
	"slices"
	"testing"
)

func TestMeasureEdgeCases(t *testing.T) {
	bs := testBackends(10, equalWeights)
	full := mustNew(t, 101, 0, bs)
	empty := mustNew(t, 101, 0, nil)
	other := mustNew(t, 103, 0, bs)
	for _, tc := range []struct {
		name       string
		old, new   *Table
		want       Disruption
		checkFracs bool
	}{
		{"same", full, full, Disruption{Slots: 101, StayedSlots: 101}, true},
		{"both-empty", empty, empty, Disruption{Slots: 101}, true},
		{"nil-to-empty", nil, empty, Disruption{Slots: 101}, true},
		{"empty-to-full", empty, full, Disruption{Slots: 101, MovedSlots: 101, MinMovedSlots: 101, Moved: 1}, true},
		{"nil-to-full", nil, full, Disruption{Slots: 101, MovedSlots: 101, MinMovedSlots: 101, Moved: 1}, true},
		{"full-to-empty", full, empty, Disruption{Slots: 101, MovedSlots: 101, MinMovedSlots: 101, Moved: 1}, true},
		{"resize", full, other, Disruption{Slots: 103, MovedSlots: 103, MinMovedSlots: 103, StayedSlots: 101,
			MovedWhileStayedSlots: 101, Moved: 1, MovedWhileStayed: 1}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Measure(tc.old, tc.new); got != tc.want {
				t.Errorf("Measure = %+v, want %+v", got, tc.want)
			}
		})
	}

	// IDs do not matter, identities do.
	renumbered := slices.Clone(bs)
	for i := range renumbered {
		renumbered[i].ID += 100
	}
	if d := Measure(full, mustNew(t, 101, 0, renumbered)); d.MovedSlots != 0 {
		t.Errorf("renumbering IDs moved %d slots", d.MovedSlots)
	}
}

// maglevCollateral is the collateral churn known for classic Maglev when 1
// of 1000 backends leaves a table of 65537 slots: about 0.7% of the slots
// whose backend stayed move anyway.
const maglevCollateral = 0.007

// textbookDisruption measures the change between two textbook tables by
// backend ID, which the test data keeps tied to the identity.
func textbookDisruption(old, new []uint32) (moved, collateral float64) {
	present := map[uint32]bool{}
	for _, id := range new {
		present[id] = true
	}
	var nMoved, nStayed, nCollateral int
	for s := range old {
		if old[s] != new[s] {
			nMoved++
		}
		if present[old[s]] {
			nStayed++
			if old[s] != new[s] {
				nCollateral++
			}
		}
	}
	return float64(nMoved) / float64(len(old)), float64(nCollateral) / float64(nStayed)
}

// TestDisruption measures what removing and adding backends moves, at the
// size and backend count the datapath's middle tier is designed for, and
// holds it to classic Maglev: equal to the textbook algorithm run on the
// same change for equal weights, and within the known collateral churn.
func TestDisruption(t *testing.T) {
	const n = 1000
	m := SizeM
	rng := rand.New(rand.NewPCG(5, 6))
	for _, w := range []struct {
		name string
		f    func(int) uint32
	}{{"equal", equalWeights}, {"mixed", mixedWeights}} {
		all := testBackends(n+10, w.f)
		base := all[:n]
		// Victims sit at random positions in identity order, so that the
		// result does not hinge on the first or last backend.
		victims := rng.Perm(n)[:10]
		without := func(k int) []Backend {
			out := slices.Clone(base)
			for _, v := range victims[:k] {
				out[v].Ready = false
			}
			return out
		}
		baseTab := mustNew(t, m, 0, base)
		var baseTextbook []uint32
		if w.name == "equal" {
			baseTextbook = textbook(m, 0, base)
		}
		for _, tc := range []struct {
			name string
			to   []Backend
			// Limits on the fraction of all slots moved and on the
			// fraction of stayed slots moved.
			maxMoved, maxCollateral float64
		}{
			{"remove-1", without(1), 0.009, maglevCollateral},
			{"add-1", all[:n+1], 0.009, maglevCollateral},
			{"remove-10", without(10), 0.045, 0.04},
			{"add-10", all[:n+10], 0.045, 0.04},
		} {
			t.Run(w.name+"/"+tc.name, func(t *testing.T) {
				to := mustNew(t, m, 0, tc.to)
				d := Measure(baseTab, to)
				t.Logf("N=%d M=%d %s weights, %s: moved %d slots = %.3f%% (minimum %d = %.3f%%); moved while stayed %d of %d = %.3f%%",
					n, m, w.name, tc.name, d.MovedSlots, 100*d.Moved, d.MinMovedSlots, 100*float64(d.MinMovedSlots)/float64(d.Slots),
					d.MovedWhileStayedSlots, d.StayedSlots, 100*d.MovedWhileStayed)
				if d.MovedSlots < d.MinMovedSlots {
					t.Fatalf("moved %d slots, below the minimum %d: Measure is wrong", d.MovedSlots, d.MinMovedSlots)
				}
				if d.Moved > tc.maxMoved || d.MovedWhileStayed > tc.maxCollateral {
					t.Errorf("moved %.3f%% (limit %.3f%%), moved while stayed %.3f%% (limit %.3f%%)",
						100*d.Moved, 100*tc.maxMoved, 100*d.MovedWhileStayed, 100*tc.maxCollateral)
				}
				if baseTextbook != nil {
					moved, collateral := textbookDisruption(baseTextbook, textbook(m, 0, tc.to))
					t.Logf("textbook: moved %.3f%%, moved while stayed %.3f%%", 100*moved, 100*collateral)
					if d.Moved > moved || d.MovedWhileStayed > collateral {
						t.Errorf("worse than the textbook algorithm")
					}
				}
				// Undoing the change restores the original table.
				if back := Measure(to, baseTab); back.MovedSlots != d.MovedSlots {
					t.Errorf("undoing moved %d slots, doing %d", back.MovedSlots, d.MovedSlots)
				}
			})
		}
	}
}

// TestDisruptionWeightChange measures a weight change of one backend among
// 1000: only slots needed to adjust its share should move, plus collateral.
func TestDisruptionWeightChange(t *testing.T) {
	base := testBackends(1000, mixedWeights)
	baseTab := mustNew(t, SizeM, 0, base)
	for _, tc := range []struct {
		name   string
		weight uint32
	}{{"double", 6}, {"halve", 1}, {"drain-to-0", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			changed := slices.Clone(base)
			changed[502].Weight = tc.weight // weight 3 in mixedWeights
			d := Measure(baseTab, mustNew(t, SizeM, 0, changed))
			t.Logf("weight 3 -> %d of 1 in 1000 mixed: moved %.3f%% (minimum %.3f%%), moved while stayed %.3f%%",
				tc.weight, 100*d.Moved, 100*float64(d.MinMovedSlots)/float64(d.Slots), 100*d.MovedWhileStayed)
			if d.MovedWhileStayed > maglevCollateral {
				t.Errorf("moved while stayed %.3f%%, limit %.3f%%", 100*d.MovedWhileStayed, 100*maglevCollateral)
			}
		})
	}
}
