package maglev

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/big"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"slices"
	"testing"
)

// testBackends returns n ready TCP backends 10.x.y.z:8080 with IDs 1..n.
func testBackends(n int, weight func(i int) uint32) []Backend {
	bs := make([]Backend, n)
	for i := range bs {
		bs[i] = Backend{
			ID:     uint32(i + 1),
			Addr:   netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}),
			Port:   8080,
			Proto:  6,
			Weight: weight(i),
			Ready:  true,
		}
	}
	return bs
}

func equalWeights(int) uint32 { return 1 }

// mixedWeights cycles through 1, 2, 3, 5, 8: a realistic spread that still
// lets every backend get slots.
func mixedWeights(i int) uint32 { return [...]uint32{1, 2, 3, 5, 8}[i%5] }

func mustNew(tb testing.TB, m uint32, seed uint64, bs []Backend) *Table {
	tb.Helper()
	t, err := New(Config{Size: m, Seed: seed}, bs)
	if err != nil {
		tb.Fatalf("New(M=%d): %v", m, err)
	}
	return t
}

// refApportion is an independent statement of the apportionment in exact
// rational arithmetic: floor(M·w/W) each, then the leftover slots to the
// largest remainders, ties to the earlier backend in identity order. It
// takes the eligible backends already in identity order.
func refApportion(m uint32, bs []Backend) []int {
	var total big.Int
	for _, b := range bs {
		total.Add(&total, big.NewInt(int64(b.Weight)))
	}
	counts := make([]int, len(bs))
	rems := make([]*big.Rat, len(bs))
	sum := 0
	for i, b := range bs {
		share := new(big.Rat).SetFrac(new(big.Int).Mul(big.NewInt(int64(m)), big.NewInt(int64(b.Weight))), &total)
		fl := new(big.Int).Quo(share.Num(), share.Denom())
		counts[i] = int(fl.Int64())
		sum += counts[i]
		rems[i] = new(big.Rat).Sub(share, new(big.Rat).SetInt(fl))
	}
	order := make([]int, len(bs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return rems[b].Cmp(rems[a]) })
	for _, i := range order[:int(m)-sum] {
		counts[i]++
	}
	return counts
}

// checkInvariants verifies what must hold for any table built from bs.
func checkInvariants(t *testing.T, tab *Table, bs []Backend) {
	t.Helper()
	var eligible []Backend
	for _, b := range bs {
		if b.Eligible() {
			eligible = append(eligible, b)
		}
	}
	slices.SortFunc(eligible, func(a, b Backend) int {
		return identityOf(a.Addr, a.Port, a.Proto).compare(identityOf(b.Addr, b.Port, b.Proto))
	})
	if len(eligible) == 0 {
		if !tab.Empty() || tab.Entries() != nil || len(tab.SlotCounts()) != 0 {
			t.Fatalf("no eligible backend but table not empty")
		}
		if _, ok := tab.Lookup(12345); ok {
			t.Fatalf("Lookup on empty table: ok")
		}
		return
	}
	if tab.Empty() {
		t.Fatalf("table empty with %d eligible backends", len(eligible))
	}
	entries := tab.Entries()
	if len(entries) != int(tab.Size()) {
		t.Fatalf("len(Entries) = %d, want %d", len(entries), tab.Size())
	}
	want := refApportion(tab.Size(), eligible)
	got := tab.SlotCounts()
	if len(got) != len(eligible) {
		t.Fatalf("SlotCounts has %d backends, want %d", len(got), len(eligible))
	}
	byID := map[uint32]int{}
	for i, sc := range got {
		if sc.Backend != eligible[i] {
			t.Fatalf("SlotCounts[%d] = %v, want %v", i, sc.Backend, eligible[i])
		}
		if sc.Slots != want[i] {
			t.Fatalf("SlotCounts[%d] (%v weight %d) = %d, want %d", i, sc.Backend, sc.Backend.Weight, sc.Slots, want[i])
		}
		byID[sc.Backend.ID] = i
	}
	seen := make([]int, len(eligible))
	for s, id := range entries {
		i, ok := byID[id]
		if !ok {
			t.Fatalf("entry %d = %d, not an eligible backend ID", s, id)
		}
		seen[i]++
		if b, ok := tab.Lookup(uint32(s)); !ok || b.ID != id {
			t.Fatalf("Lookup(%d) = %v, %v; entry is %d", s, b, ok, id)
		}
	}
	for i := range seen {
		if seen[i] != want[i] {
			t.Fatalf("backend %v holds %d entries, want %d", eligible[i], seen[i], want[i])
		}
	}
}

func TestIsPrime(t *testing.T) {
	const limit = 1 << 18
	composite := make([]bool, limit)
	for i := 2; i < limit; i++ {
		if !composite[i] {
			for j := i * i; j < limit; j += i {
				composite[j] = true
			}
		}
		if got := IsPrime(uint32(i)); got == composite[i] {
			t.Fatalf("IsPrime(%d) = %v", i, got)
		}
	}
	for _, tc := range []struct {
		n     uint32
		prime bool
	}{
		{0, false}, {1, false}, {2, true}, {3, true}, {4, false},
		{SizeS, true}, {SizeM, true}, {SizeL, true}, {MaxSize, true},
		{561, false},        // Carmichael number
		{2047, false},       // strong pseudoprime to base 2
		{3215031751, false}, // strong pseudoprime to bases 2, 3, 5 and 7
		{4294967291, true},  // largest 32-bit prime
		{4294967295, false},
		{4294967279, true},
		{65521 * 65519, false},
	} {
		if got := IsPrime(tc.n); got != tc.prime {
			t.Errorf("IsPrime(%d) = %v, want %v", tc.n, got, tc.prime)
		}
	}
}

func TestNextPrime(t *testing.T) {
	for _, tc := range []struct{ n, want uint32 }{
		{0, 2}, {2, 2}, {3, 3}, {4, 5}, {16380, SizeS}, {SizeS, SizeS},
		{65536, SizeM}, {131070, SizeL}, {1 << 24, 16777259}, {4294967291, 4294967291}, {4294967292, 0},
	} {
		if got := NextPrime(tc.n); got != tc.want {
			t.Errorf("NextPrime(%d) = %d, want %d", tc.n, got, tc.want)
		}
	}
	// MaxSize is the largest prime below 2^24.
	if NextPrime(MaxSize+1) < 1<<24 {
		t.Errorf("MaxSize %d is not the largest prime below 2^24", MaxSize)
	}
}

func TestEvenness(t *testing.T) {
	tab := mustNew(t, SizeM, 0, testBackends(1000, equalWeights))
	lo, hi := int(SizeM), 0
	for _, sc := range tab.SlotCounts() {
		lo, hi = min(lo, sc.Slots), max(hi, sc.Slots)
	}
	t.Logf("N=1000 M=%d: slots per backend in [%d, %d]", SizeM, lo, hi)
	if hi-lo > 1 {
		t.Fatalf("slot counts span [%d, %d], want a spread of at most 1", lo, hi)
	}
	checkInvariants(t, tab, testBackends(1000, equalWeights))
}

func TestWeights(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	random := make([]uint32, 300)
	for i := range random {
		random[i] = uint32(rng.IntN(1000) + 1)
	}
	huge := []uint32{1, 1 << 31, 4294967295, 7, 4294967294}
	for _, tc := range []struct {
		name    string
		m       uint32
		weights []uint32
		want    []int // exact counts when known
	}{
		{"1-1-2/S", SizeS, []uint32{1, 1, 2}, []int{4095, 4095, 8191}},
		{"1-1-2/101", 101, []uint32{1, 1, 2}, []int{25, 25, 51}},
		{"1-1-2/7", 7, []uint32{1, 1, 2}, []int{2, 2, 3}},
		{"1-2-3/M", SizeM, []uint32{1, 2, 3}, nil},
		{"1..10/S", SizeS, []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, nil},
		{"1..10/L", SizeL, []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, nil},
		{"tiny-share/S", SizeS, []uint32{1, 100000, 100000}, []int{0, 8191, 8190}},
		{"huge/M", SizeM, huge, nil},
		{"random300/M", SizeM, random, nil},
		{"random300/L", SizeL, random, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := testBackends(len(tc.weights), func(i int) uint32 { return tc.weights[i] })
			tab := mustNew(t, tc.m, 7, bs)
			checkInvariants(t, tab, bs)
			var total float64
			for _, w := range tc.weights {
				total += float64(w)
			}
			got := tab.SlotCounts()
			for i, sc := range got {
				ideal := float64(tc.m) * float64(sc.Backend.Weight) / total
				if d := float64(sc.Slots) - ideal; d <= -1 || d >= 1 {
					t.Errorf("backend %d weight %d: %d slots, ideal %.3f", i, sc.Backend.Weight, sc.Slots, ideal)
				}
				if tc.want != nil && sc.Slots != tc.want[i] {
					t.Errorf("backend %d weight %d: %d slots, want %d", i, sc.Backend.Weight, sc.Slots, tc.want[i])
				}
			}
		})
	}
}

func TestIneligibleTakeNoSlots(t *testing.T) {
	bs := testBackends(20, mixedWeights)
	bs[3].Ready = false
	bs[7].Weight = 0
	bs[11].Ready, bs[11].Weight = false, 0
	tab := mustNew(t, 1009, 0, bs)
	checkInvariants(t, tab, bs)
	for _, id := range tab.Entries() {
		if id == bs[3].ID || id == bs[7].ID || id == bs[11].ID {
			t.Fatalf("ineligible backend %d holds a slot", id)
		}
	}
	if n := len(tab.SlotCounts()); n != 17 {
		t.Fatalf("SlotCounts lists %d backends, want the 17 eligible", n)
	}
}

func TestEmpty(t *testing.T) {
	notReady := testBackends(5, equalWeights)
	for i := range notReady {
		notReady[i].Ready = false
	}
	for _, tc := range []struct {
		name string
		bs   []Backend
	}{
		{"nil", nil},
		{"none-ready", notReady},
		{"all-weight-0", testBackends(5, func(int) uint32 { return 0 })},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tab := mustNew(t, SizeS, 0, tc.bs)
			if !tab.Empty() || tab.Size() != SizeS {
				t.Fatalf("Empty() = %v, Size() = %d", tab.Empty(), tab.Size())
			}
			if b, ok := tab.Lookup(1); ok {
				t.Fatalf("Lookup = %v, true on empty table", b)
			}
			if e := tab.Entries(); len(e) != 0 {
				t.Fatalf("Entries has %d entries on empty table", len(e))
			}
			checkInvariants(t, tab, tc.bs)

			// Filling and emptying again must round-trip.
			full := testBackends(10, equalWeights)
			if err := tab.Rebuild(full); err != nil {
				t.Fatal(err)
			}
			checkInvariants(t, tab, full)
			if err := tab.Rebuild(tc.bs); err != nil {
				t.Fatal(err)
			}
			checkInvariants(t, tab, tc.bs)
		})
	}
}

func TestDeterministicUnderShuffle(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, weights := range []func(int) uint32{equalWeights, mixedWeights} {
		bs := testBackends(200, weights)
		bs = append(bs, Backend{ID: 9000, Addr: netip.MustParseAddr("2001:db8::1"), Port: 443, Proto: 6, Weight: 4, Ready: true},
			Backend{ID: 9001, Addr: netip.MustParseAddr("2001:db8::1"), Port: 443, Proto: 17, Weight: 4, Ready: true},
			Backend{ID: 9002, Addr: netip.MustParseAddr("10.0.0.1"), Port: 443, Proto: 6, Weight: 4, Ready: false})
		want := slices.Clone(mustNew(t, SizeS, 99, bs).Entries())
		reused := mustNew(t, SizeS, 99, testBackends(500, mixedWeights))
		for range 5 {
			rng.Shuffle(len(bs), func(i, j int) { bs[i], bs[j] = bs[j], bs[i] })
			if got := mustNew(t, SizeS, 99, bs).Entries(); !slices.Equal(got, want) {
				t.Fatal("New gives a different table for a shuffled input")
			}
			// A table with another history must land on the same contents.
			if err := reused.Rebuild(bs); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(reused.Entries(), want) {
				t.Fatal("Rebuild gives a different table than New")
			}
		}
	}
}

// goldenBackends mixes IPv4, IPv6, TCP and UDP, equal and unequal weights,
// and an ineligible backend, in no particular order.
func goldenBackends() []Backend {
	p := netip.MustParseAddr
	return []Backend{
		{ID: 7, Addr: p("192.0.2.10"), Port: 80, Proto: 6, Weight: 1, Ready: true},
		{ID: 3, Addr: p("2001:db8::20"), Port: 80, Proto: 6, Weight: 2, Ready: true},
		{ID: 5, Addr: p("192.0.2.11"), Port: 8080, Proto: 17, Weight: 1, Ready: true},
		{ID: 11, Addr: p("198.51.100.7"), Port: 443, Proto: 6, Weight: 3, Ready: true},
		{ID: 2, Addr: p("192.0.2.12"), Port: 80, Proto: 6, Weight: 1, Ready: false},
		{ID: 13, Addr: p("2001:db8::21"), Port: 53, Proto: 17, Weight: 1, Ready: true},
	}
}

func entriesDigest(entries []uint32) string {
	buf := make([]byte, 4*len(entries))
	for i, e := range entries {
		binary.LittleEndian.PutUint32(buf[4*i:], e)
	}
	sum := sha256.Sum256(buf)
	return hex.EncodeToString(sum[:])
}

// TestGolden pins the exact bytes of a few tables. The values were
// cross-checked against an independent re-implementation of the algorithm
// as the package documentation states it. A failure means tables
// differ from those of earlier releases, so an upgraded node and a
// not-yet-upgraded standby would disagree: that must be a deliberate,
// announced change, never a side effect.
func TestGolden(t *testing.T) {
	equal := goldenBackends()
	for i := range equal {
		equal[i].Weight = 1
	}
	for _, tc := range []struct {
		name string
		m    uint32
		seed uint64
		bs   []Backend
		want string
	}{
		{"weighted/seed0/S", SizeS, 0, goldenBackends(), "ddc869ae413d6c3b1c405a3ec2f9f2c4076446b43850cb78f2cd2a35b3fcb1eb"},
		{"weighted/seed/S", SizeS, 0x5eed_c0ffee, goldenBackends(), "3305491f733a11be0f730dab9dfde4d7c88f2a00fc6438cbdae75c52f38fe773"},
		{"equal/seed0/M", SizeM, 0, equal, "3cc0fa68530879484ff1ac0484e61efc8bd76d1fb4ee6f4e95b0cbfa1917d441"},
		{"equal/seed/L", SizeL, 0x5eed_c0ffee, equal, "2b42dab04a5e3bb6409256307ff6d9156a26f45e1e5dab44e79e21f47c6db1f3"},
		{"1000-mixed/seed/M", SizeM, 42, testBackends(1000, mixedWeights), "6daca9f34b6540d54c9b9f2c4d2e41fe1fc47d6f86673dae936912df110471c6"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tab := mustNew(t, tc.m, tc.seed, tc.bs)
			if got := entriesDigest(tab.Entries()); got != tc.want {
				t.Errorf("sha256(entries) = %s, want %s", got, tc.want)
			}
		})
	}
	// A table small enough to check by hand: weights 1, 2, 1, 3, 1 (one
	// backend not ready) apportion 13 slots as 2, 3, 2, 5, 1.
	small := mustNew(t, 13, 0, goldenBackends()).Entries()
	if want := []uint32{3, 13, 7, 11, 11, 5, 11, 11, 5, 3, 11, 7, 3}; !slices.Equal(small, want) {
		t.Errorf("M=13 entries = %v, want %v", small, want)
	}
	// The hash itself, so that a change is caught even before it reaches a
	// table.
	id := identityOf(netip.MustParseAddr("192.0.2.10"), 80, 6)
	if got, want := fmt.Sprintf("%016x %016x", hashIdentity(0, domainOffset, id), hashIdentity(1, domainSkip, id)), "ae853c50662e21be f3ac58e7781d5613"; got != want {
		t.Errorf("hashes = %s, want %s", got, want)
	}
}

func TestSeedChangesTable(t *testing.T) {
	bs := testBackends(100, equalWeights)
	a := mustNew(t, SizeS, 1, bs)
	b := mustNew(t, SizeS, 2, bs)
	d := Measure(a, b)
	t.Logf("seed 1 -> 2 moves %.1f%% of slots", 100*d.Moved)
	if d.Moved < 0.9 {
		t.Fatalf("another seed moved only %.1f%% of slots; want an unrelated table", 100*d.Moved)
	}
	// The counts do not depend on the seed, only the placement.
	for i, sc := range a.SlotCounts() {
		if b.SlotCounts()[i].Slots != sc.Slots {
			t.Fatal("seed changed the slot counts")
		}
	}
}

func TestErrors(t *testing.T) {
	ok := testBackends(3, equalWeights)
	with := func(f func(bs []Backend) []Backend) []Backend { return f(slices.Clone(ok)) }
	p := netip.MustParseAddr
	for _, tc := range []struct {
		name string
		m    uint32
		bs   []Backend
		want error
	}{
		{"size-0", 0, ok, ErrSizeOutOfRange},
		{"size-2", 2, ok, ErrSizeOutOfRange},
		{"size-too-large", 16777259, ok, ErrSizeOutOfRange},
		{"size-not-prime", 65536, ok, ErrSizeNotPrime},
		{"size-not-prime-small", 9, ok, ErrSizeNotPrime},
		{"size-not-prime-carmichael", 561, ok, ErrSizeNotPrime},
		{"too-many-backends", 3, testBackends(4, equalWeights), ErrTooManyBackends},
		{"zero-addr", 101, with(func(bs []Backend) []Backend { bs[1].Addr = netip.Addr{}; return bs }), ErrInvalidBackend},
		{"zoned-addr", 101, with(func(bs []Backend) []Backend { bs[1].Addr = p("fe80::1%eth0"); return bs }), ErrInvalidBackend},
		{"unspecified-v4", 101, with(func(bs []Backend) []Backend { bs[1].Addr = p("0.0.0.0"); return bs }), ErrInvalidBackend},
		{"unspecified-v6", 101, with(func(bs []Backend) []Backend { bs[1].Addr = p("::"); return bs }), ErrInvalidBackend},
		{"proto-0", 101, with(func(bs []Backend) []Backend { bs[2].Proto = 0; return bs }), ErrInvalidBackend},
		{"id-0", 101, with(func(bs []Backend) []Backend { bs[0].ID = 0; return bs }), ErrInvalidBackend},
		{"invalid-even-if-not-ready", 101, with(func(bs []Backend) []Backend { bs[0].Ready = false; bs[0].ID = 0; return bs }), ErrInvalidBackend},
		{"duplicate-identity", 101, with(func(bs []Backend) []Backend { bs[2].Addr = bs[0].Addr; return bs }), ErrDuplicateBackend},
		{"duplicate-identity-4in6", 101, with(func(bs []Backend) []Backend {
			bs[2].Addr = netip.AddrFrom16(bs[0].Addr.As16())
			return bs
		}), ErrDuplicateBackend},
		{"duplicate-identity-not-ready", 101, with(func(bs []Backend) []Backend {
			bs[2].Addr, bs[2].Ready = bs[0].Addr, false
			return bs
		}), ErrDuplicateBackend},
		{"duplicate-id", 101, with(func(bs []Backend) []Backend { bs[2].ID = bs[1].ID; return bs }), ErrDuplicateBackend},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(Config{Size: tc.m}, tc.bs)
			if !errors.Is(err, tc.want) {
				t.Fatalf("New: error %v, want %v", err, tc.want)
			}
			t.Logf("%v", err)
			if tc.m != 101 {
				return
			}
			// A failed Rebuild must leave the table as it was.
			tab := mustNew(t, 101, 0, testBackends(10, mixedWeights))
			before, counts := slices.Clone(tab.Entries()), tab.SlotCounts()
			if err := tab.Rebuild(tc.bs); !errors.Is(err, tc.want) {
				t.Fatalf("Rebuild: error %v, want %v", err, tc.want)
			}
			if !slices.Equal(tab.Entries(), before) || !slices.Equal(tab.SlotCounts(), counts) {
				t.Fatal("failed Rebuild changed the table")
			}
			checkInvariants(t, tab, testBackends(10, mixedWeights))
		})
	}
	var zero Table
	if err := zero.Rebuild(ok); !errors.Is(err, ErrSizeOutOfRange) {
		t.Errorf("Rebuild of zero Table: %v, want ErrSizeOutOfRange", err)
	}
	if !zero.Empty() || zero.Entries() != nil {
		t.Error("zero Table is not empty")
	}
}

func TestRebuildAllocatesNothing(t *testing.T) {
	for _, weights := range []struct {
		name string
		f    func(int) uint32
	}{{"equal", equalWeights}, {"mixed", mixedWeights}} {
		t.Run(weights.name, func(t *testing.T) {
			a := testBackends(1000, weights.f)
			b := slices.Clone(a) // same size, different set and order
			b[10].Addr = netip.MustParseAddr("10.200.0.1")
			b[20].Ready = false
			slices.Reverse(b)
			tab := mustNew(t, SizeS, 1, a)
			if err := tab.Rebuild(b); err != nil {
				t.Fatal(err)
			}
			flip := false
			allocs := testing.AllocsPerRun(20, func() {
				flip = !flip
				src := a
				if flip {
					src = b
				}
				if err := tab.Rebuild(src); err != nil {
					t.Fatal(err)
				}
			})
			if allocs != 0 {
				t.Fatalf("Rebuild allocates %v times per run, want 0", allocs)
			}
			if err := tab.Rebuild(a); err != nil {
				t.Fatal(err)
			}
			checkInvariants(t, tab, a)
		})
	}
}

// TestRebuildAllocatesNothingAcrossPaths: the fill takes different paths
// for equal and unequal weights and for few or many backends; a table that
// has held a set at least as large must not allocate on any of them, not
// even the first time it takes one.
func TestRebuildAllocatesNothingAcrossPaths(t *testing.T) {
	mallocs := func(f func()) uint64 {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		f()
		runtime.ReadMemStats(&after)
		return after.Mallocs - before.Mallocs
	}
	for _, m := range []uint32{SizeS, SizeM} {
		sets := [][]Backend{
			testBackends(10, equalWeights),                                           // probe, windows, tail; round robin
			testBackends(10, mixedWeights),                                           // the same with the turns stored
			testBackends(3, func(i int) uint32 { return []uint32{1, 100000, 7}[i] }), // a schedule of every turn
			testBackends(1000, mixedWeights),                                         // probe only at SizeS
			testBackends(2, equalWeights),
		}
		// A table that has held 1000 backends (twice: Rebuild alternates
		// between two backend lists), on each path for the first time.
		// MemStats counts every goroutine's allocations, and the runtime
		// and test framework allocate now and then in the background, so
		// the scenario runs three times on fresh tables and the least
		// count is what the fill itself allocates.
		least := make([]uint64, len(sets))
		for trial := range 3 {
			big := mustNew(t, m, 3, sets[3])
			if err := big.Rebuild(sets[3]); err != nil {
				t.Fatal(err)
			}
			for i, bs := range sets {
				n := mallocs(func() {
					if err := big.Rebuild(bs); err != nil {
						t.Fatal(err)
					}
				})
				if trial == 0 || n < least[i] {
					least[i] = n
				}
			}
		}
		for i, n := range least {
			if n != 0 {
				t.Errorf("M=%d: first Rebuild with set %d after 1000 backends allocates %d times", m, i, n)
			}
		}
		for _, first := range [][]Backend{sets[0], sets[3]} {
			tab := mustNew(t, m, 3, first)
			// Twice each: Rebuild alternates between two backend lists.
			for _, bs := range sets {
				for range 2 {
					if err := tab.Rebuild(bs); err != nil {
						t.Fatal(err)
					}
				}
			}
			for i, bs := range sets {
				if allocs := testing.AllocsPerRun(5, func() {
					if err := tab.Rebuild(bs); err != nil {
						t.Fatal(err)
					}
				}); allocs != 0 {
					t.Errorf("M=%d, after %d backends: Rebuild with set %d allocates %v times", m, len(first), i, allocs)
				}
				checkInvariants(t, tab, bs)
			}
		}
	}
}

// TestTextbookEquivalence holds the equal-weight fill to the paper's
// algorithm, entry for entry.
func TestTextbookEquivalence(t *testing.T) {
	for _, tc := range []struct {
		m    uint32
		n    int
		seed uint64
	}{
		{3, 1, 0}, {3, 3, 1}, {7, 5, 2}, {101, 10, 3}, {1009, 100, 4}, {SizeS, 1, 5}, {SizeS, 100, 6}, {SizeS, 1000, 7},
	} {
		bs := testBackends(tc.n, equalWeights)
		got := mustNew(t, tc.m, tc.seed, bs).Entries()
		if want := textbook(tc.m, tc.seed, bs); !slices.Equal(got, want) {
			t.Errorf("M=%d N=%d seed=%d: table differs from the textbook algorithm", tc.m, tc.n, tc.seed)
		}
	}
}

// specFill is the fill rule as the documentation states it, written for
// clarity: each turn goes to the backend with the smallest filled/weight
// among those below their count (ties to identity order), which claims the
// first empty slot of its preference list (offset + j·skip) mod M.
func specFill(tab *Table) []uint32 {
	m := tab.Size()
	sc := tab.SlotCounts()
	filled := make([]uint64, len(sc))
	next := make([]uint64, len(sc))
	owner := make([]int, m)
	for s := range owner {
		owner[s] = -1
	}
	for range m {
		best := -1
		for i := range sc {
			if filled[i] == uint64(sc[i].Slots) {
				continue
			}
			if best < 0 || filled[i]*uint64(sc[best].Backend.Weight) < filled[best]*uint64(sc[i].Backend.Weight) {
				best = i
			}
		}
		b := sc[best].Backend
		offset, skip := offsetSkip(tab.cfg.Seed, identityOf(b.Addr, b.Port, b.Proto), m)
		for {
			s := (uint64(offset) + next[best]*uint64(skip)) % uint64(m)
			next[best]++
			if owner[s] < 0 {
				owner[s] = best
				break
			}
		}
		filled[best]++
	}
	out := make([]uint32, m)
	for s, i := range owner {
		out[s] = sc[i].Backend.ID
	}
	return out
}

// TestFillMatchesSpec holds both fill paths (a replayed period of turns,
// or a schedule of every turn) to the rule as documented.
func TestFillMatchesSpec(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 9))
	for _, tc := range []struct {
		name string
		m    uint32
		n    int
		w    func(int) uint32
	}{
		// Weights whose W' = Σ w/gcd is below M replay one period of
		// turns; the others schedule every turn.
		{"equal", 1009, 37, equalWeights},
		{"gcd", 1009, 30, func(i int) uint32 { return uint32(2 * (1 + i%3)) }},
		{"period=M-1", 101, 10, func(i int) uint32 { return []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 55}[i] }},
		{"period=M", 101, 10, func(i int) uint32 { return []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 56}[i] }},
		{"equal-5", SizeS, 1000, func(int) uint32 { return 5 }},
		{"mixed", SizeS, 1000, mixedWeights},
		{"1-1-2", 7, 3, func(i int) uint32 { return []uint32{1, 1, 2}[i] }},
		{"few-distinct", 4099, 200, func(int) uint32 { return uint32(rng.IntN(3) + 1) }},
		{"random", 4099, 200, func(int) uint32 { return uint32(rng.IntN(1000) + 1) }},
		{"zero-quotas", 101, 60, func(i int) uint32 { return []uint32{1, 1000}[i%2] }},
		{"huge", 1009, 20, func(int) uint32 { return uint32(rng.Uint32()) | 1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tab := mustNew(t, tc.m, 11, testBackends(tc.n, tc.w))
			want := specFill(tab)
			if !slices.Equal(tab.Entries(), want) {
				t.Fatal("table differs from the documented fill rule")
			}
		})
	}
}

func TestLookup(t *testing.T) {
	tab := mustNew(t, 101, 0, testBackends(10, mixedWeights))
	e := tab.Entries()
	for _, h := range []uint32{0, 1, 100, 101, 102, 1 << 31, ^uint32(0)} {
		b, ok := tab.Lookup(h)
		if !ok || b.ID != e[h%101] {
			t.Errorf("Lookup(%d) = %v, %v; want ID %d", h, b, ok, e[h%101])
		}
		if !b.Ready || b.Weight == 0 {
			t.Errorf("Lookup(%d) returned ineligible %v", h, b)
		}
	}
}

// TestMemoryLinear guards the O(M + N) memory bound: materialising the N×M
// permutation would take over 100× more.
func TestMemoryLinear(t *testing.T) {
	bs := testBackends(1000, mixedWeights)
	res := testing.Benchmark(func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := New(Config{Size: SizeL}, bs); err != nil {
				b.Fatal(err)
			}
		}
	})
	// 4 bytes per slot (entries), scratch per backend and, should the pool
	// be empty, the fill's 6 bytes per slot, with room for append's growth.
	limit := int64(9*SizeL + 1000*1024)
	t.Logf("New(N=1000, M=%d) allocates %d B in %d allocs", SizeL, res.AllocedBytesPerOp(), res.AllocsPerOp())
	if res.AllocedBytesPerOp() > limit {
		t.Fatalf("New allocates %d B, want at most %d (O(M+N))", res.AllocedBytesPerOp(), limit)
	}
}

func TestBackendString(t *testing.T) {
	b := Backend{ID: 4, Addr: netip.MustParseAddr("2001:db8::1"), Port: 443, Proto: 6}
	if got, want := b.String(), "[2001:db8::1]:443/6#4"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

// TestPhasesLargeTables guards the fill's phase boundaries at the largest
// sizes, where M·300 and N·M/32 overflow a 32-bit int: the boundaries stay
// ordered within [0, M], and the tail's scratch (rank bitmaps and the list
// of empty slots) fits before the turns it must not overwrite.
func TestPhasesLargeTables(t *testing.T) {
	for _, m := range []uint32{MaxSize, 10000019, SizeL, SizeS} {
		for _, n := range []int{1, 10, 31, 1000, 8192} {
			for _, stored := range []bool{false, true} {
				kA, kB := phases(m, n, stored)
				if kA < 0 || kA > kB || kB > int(m) {
					t.Fatalf("M=%d N=%d stored=%v: phases %d, %d out of order", m, n, stored, kA, kB)
				}
				if e := int64(m) - int64(kB); e > 0 {
					room := int64(m)
					if stored {
						room -= e
					}
					if need := int64(n)*int64(tailWords(m)) + e; need > room {
						t.Fatalf("M=%d N=%d stored=%v: tail needs %d words, has %d", m, n, stored, need, room)
					}
				}
			}
		}
	}
}

// TestLookupUnknownIDPanics: an entry that is no backend's ID (Entries
// modified by a caller) is a broken invariant that panics, not a search
// that never ends.
func TestLookupUnknownIDPanics(t *testing.T) {
	tab := mustNew(t, SizeS, 0, testBackends(10, equalWeights))
	defer func() {
		if recover() == nil {
			t.Fatal("Lookup of a modified entry did not panic")
		}
	}()
	tab.Entries()[7] = 12345
	tab.Lookup(7)
}
