package maglev

import "testing"

func TestLadderIsPrimeAndGrowing(t *testing.T) {
	for i, m := range Ladder {
		if !IsPrime(m) {
			t.Errorf("rung %d: %d is not prime", i, m)
		}
		if i > 0 && m <= Ladder[i-1] {
			t.Errorf("rung %d: %d after %d", i, m, Ladder[i-1])
		}
	}
	if Ladder[len(Ladder)-1] != SizeL {
		t.Errorf("the ladder ends at %d, want SizeL", Ladder[len(Ladder)-1])
	}
}

func TestSizeFor(t *testing.T) {
	for _, tc := range []struct {
		n    int
		max  uint32
		want uint32
	}{
		{0, SizeM, 251},
		{1, SizeM, 251},
		{2, SizeM, 251},
		{3, SizeM, 509},
		{10, SizeM, 1021},
		{11, SizeM, 2039},
		{100, SizeM, 16381},
		{163, SizeM, 16381},
		{164, SizeM, 32749},
		{655, SizeM, 65537},
		{656, SizeM, 65537}, // capped at the tier: the rule gives way
		{1000, SizeS, SizeS},
		{1000, SizeL, SizeL},
		{5000, SizeL, SizeL},
		{3, 101, 101}, // a custom maximum below the first rung
	} {
		if got := SizeFor(tc.n, tc.max); got != tc.want {
			t.Errorf("SizeFor(%d, %d) = %d, want %d", tc.n, tc.max, got, tc.want)
		}
	}
	for n := range 2000 {
		for _, max := range []uint32{SizeS, SizeM, SizeL} {
			m := SizeFor(n, max)
			if m > max || (uint64(m) < uint64(n)*SlotsPerBackend && m != largestRung(max)) {
				t.Fatalf("SizeFor(%d, %d) = %d breaks the rule", n, max, m)
			}
		}
	}
}

func largestRung(max uint32) uint32 {
	var best uint32
	for _, m := range Ladder {
		if m <= max {
			best = m
		}
	}
	return best
}
