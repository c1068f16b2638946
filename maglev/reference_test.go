package maglev

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
)

// This file freezes the fill as it was before the small-N speed-ups: the
// apportionment and the weighted fill of commit 205787a, copied verbatim
// (renamed so as not to clash). TestFillMatchesReference holds the package
// to it byte for byte on many random inputs: the table is part of the HA
// contract, so no optimisation may change a single entry.

// refTable has the fields the frozen code used.
type refTable struct {
	cfg           Config
	backends      []Backend
	ids           []identity
	counts        []uint32
	slots         []uint32
	entries       []uint32
	remainders    []refRemainder
	pos, skip     []uint32
	used          []uint64
	quota, filled []uint32
	members       []refMember
	groups        []refGroup
	heap          []int32
}

// refBuild returns the reference table for the eligible backends, given in
// canonical identity order: the slot counts, each slot's backend index and
// the entries (backend IDs).
func refBuild(cfg Config, eligible []Backend) (counts, slots, entries []uint32) {
	t := &refTable{cfg: cfg, backends: eligible}
	for _, b := range eligible {
		t.ids = append(t.ids, identityOf(b.Addr, b.Port, b.Proto))
	}
	t.counts = make([]uint32, len(eligible))
	t.apportion()
	t.populate()
	return t.counts, t.slots, t.entries
}

type refRemainder struct {
	r uint64
	i int32
}

// apportion sets t.counts to the exact share of the Size slots for each
// eligible backend: the largest-remainder (Hamilton) apportionment of Size by
// weight. Every backend first gets floor(M·w/W); the slots left over, fewer
// than the number of backends, go one each to the largest remainders
// M·w mod W, ties going to the backend first in identity order. So each
// count differs from the ideal M·w/W by less than one slot.
//
// No product overflows: M < 2^24 and w < 2^32, so M·w < 2^56, and with at
// most M backends W < 2^56 as well.
func (t *refTable) apportion() {
	m := uint64(t.cfg.Size)
	var total uint64
	for i := range t.backends {
		total += uint64(t.backends[i].Weight)
	}
	rem := t.remainders[:0]
	var assigned uint64
	for i := range t.backends {
		p := m * uint64(t.backends[i].Weight)
		q := p / total
		t.counts[i] = uint32(q)
		assigned += q
		rem = append(rem, refRemainder{r: p % total, i: int32(i)})
	}
	t.remainders = rem
	if left := int(m - assigned); left > 0 {
		slices.SortFunc(rem, func(a, b refRemainder) int {
			switch {
			case a.r != b.r:
				return cmp3(a.r > b.r)
			case a.i != b.i:
				return cmp3(a.i < b.i)
			}
			return 0
		})
		for _, x := range rem[:left] {
			t.counts[x.i]++
		}
	}
}

// populate fills the slots, each eligible backend taking exactly its
// apportioned count.
//
// It is the fill of the Maglev paper: backend i prefers the slots
// (offset_i + j·skip_i) mod M for j = 0, 1, ..., and on its turn claims the
// first slot in that order that is still empty. The paper gives every
// backend one turn per round; here a backend's turns come at a pace set by
// its weight (the backend with the smallest filled/weight goes next, ties to
// identity order) and stop at its count. With equal weights this is exactly
// the paper's round robin.
//
// Only each backend's next position in its preference list is kept (O(N)),
// never the N×M permutation.
func (t *refTable) populate() {
	m := t.cfg.Size
	n := len(t.backends)
	t.slots = grow(t.slots, int(m))
	t.entries = grow(t.entries, int(m))
	t.used = grow(t.used, int(m+63)/64)
	clear(t.used)
	t.pos = grow(t.pos, n)
	t.skip = grow(t.skip, n)
	for i, id := range t.ids {
		t.pos[i], t.skip[i] = offsetSkip(t.cfg.Seed, id, m)
	}

	// Backend i's k-th turn comes at (k/w_i, i) in the order of turns.
	// Adding w_i to k adds exactly 1 to k/w_i for every backend, so the
	// order repeats with a period of W' = Σ w_i/g turns (g the gcd of the
	// weights): when W' < M, schedule one period and replay it, skipping
	// backends that hold their count (which leaves the others' order as it
	// was). Equal weights give the period 0, 1, ..., N−1: round robin.
	// Otherwise schedule every turn. The schedule borrows t.entries, which
	// is only written at the end.
	t.quota = grow(t.quota, n)
	g := uint32(0)
	for i := range t.backends {
		g = refGcd(g, t.backends[i].Weight)
	}
	var period uint64
	for i := range t.backends {
		period += uint64(t.backends[i].Weight / g)
	}
	if period < uint64(m) {
		for i := range t.backends {
			t.quota[i] = t.backends[i].Weight / g
		}
	} else {
		copy(t.quota, t.counts)
	}
	seq := t.schedule(t.quota, t.entries[:0])

	// Until the first backend reaches its count, whole periods need no
	// count checks. With a schedule of every turn that is all of it.
	full := ^uint32(0)
	for i, q := range t.quota {
		if q > 0 {
			full = min(full, t.counts[i]/q)
		}
	}
	for range full {
		for _, i := range seq {
			t.claim(int(i))
		}
	}
	left := m - full*uint32(len(seq))
	t.filled = grow(t.filled, n)
	for i, q := range t.quota {
		t.filled[i] = full * q
	}
	for left > 0 {
		for _, i := range seq {
			if t.filled[i] < t.counts[i] {
				t.claim(int(i))
				t.filled[i]++
				if left--; left == 0 {
					break
				}
			}
		}
	}

	for s, i := range t.slots {
		t.entries[s] = t.backends[i].ID
	}
}

func refGcd(a, b uint32) uint32 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// claim gives backend i the first empty slot in its preference list and
// advances the list past it. There always is one: claims stop when the
// table is full, and the list visits every slot.
//
// Occupancy is probed in a bitmap rather than in the slots themselves: at
// M/8 bytes (16 KiB for SizeL) it stays in the L1 cache, and the probes
// (about M·ln M in a whole fill) are where a build spends its time.
func (t *refTable) claim(i int) {
	m, used := t.cfg.Size, t.used
	p, s := t.pos[i], t.skip[i]
	for used[p>>6]&(1<<(p&63)) != 0 {
		p = refWrapAdd(p, s, m)
	}
	used[p>>6] |= 1 << (p & 63)
	t.slots[p] = uint32(i)
	t.pos[i] = refWrapAdd(p, s, m)
}

// refWrapAdd returns (p + s) mod m for p, s < m without a division: p+s < 2m,
// so at most one m comes off. Written as a min of unsigned values (p+s−m
// wraps around to a huge value when p+s < m) it compiles to a conditional
// move, free of the branch the CPU could not predict: whether a step wraps
// is as random as the skip.
func refWrapAdd(p, s, m uint32) uint32 {
	p += s
	return min(p, p-m)
}

// schedule appends to seq the order of turns when backend i takes quota[i]
// turns: the backend with the smallest turns/weight goes next, ties to
// identity order.
//
// Backends of equal weight advance in lockstep, so it schedules groups of
// equal weight rather than backends: a group's next turn belongs to its
// first member (in identity order) not yet served at the group's current
// level of turns taken. A min-heap of groups keyed by (level/weight, that
// member) yields exactly the per-backend order at O(log G) per turn for G
// distinct weights, usually a handful; and a group keeps the turn without
// any heap work for as long as it stays ahead of the runner-up.
//
// It relies on quotas never increasing along a group, so that the members
// still below their quota at any level are a prefix of it. They do not:
// within a group the quotas are either equal (one period of turns) or the
// apportioned counts, and all members of a group have the same remainder
// in apportion, so the extra slot goes to a prefix in identity order.
func (t *refTable) schedule(quota []uint32, seq []uint32) []uint32 {
	ms := t.members[:0]
	for i := range t.backends {
		ms = append(ms, refMember{w: t.backends[i].Weight, i: int32(i)})
	}
	t.members = ms
	slices.SortFunc(ms, func(a, b refMember) int {
		if a.w != b.w {
			return cmp3(a.w < b.w)
		}
		return cmp3(a.i < b.i)
	})
	gs := t.groups[:0]
	for start := 0; start < len(ms); {
		end := start + 1
		for end < len(ms) && ms[end].w == ms[start].w {
			end++
		}
		if quota[ms[start].i] > 0 {
			gs = append(gs, refGroup{w: ms[start].w, next: ms[start].i, start: int32(start), end: int32(end)})
		}
		start = end
	}
	t.groups = gs
	// The heap holds indices into gs, so that reordering it moves 4 bytes
	// per step. All levels are 0, so it is ordered by first member alone.
	h := t.heap[:0]
	for g := range gs {
		h = append(h, int32(g))
	}
	slices.SortFunc(h, func(a, b int32) int { return cmp3(gs[a].next < gs[b].next) })
	t.heap = h

	for len(h) > 0 {
		// The root group takes turns until the runner-up (the earlier of
		// its children) is due; only then is the heap reordered. With a
		// single group (equal weights) the heap is never touched.
		g := &gs[h[0]]
		var next *refGroup
		if len(h) > 1 {
			next = &gs[h[1]]
			if len(h) > 2 && gs[h[2]].before(next) {
				next = &gs[h[2]]
			}
		}
		for {
			seq = append(seq, uint32(g.next))
			if g.pos++; g.start+g.pos == g.end || quota[ms[g.start+g.pos].i] <= g.level {
				g.level++
				g.pos = 0
			}
			if i := ms[g.start+g.pos].i; quota[i] > g.level {
				g.next = i
			} else {
				last := len(h) - 1 // every member has had its turns
				h[0] = h[last]
				h = h[:last]
				break
			}
			if next != nil && !g.before(next) {
				break
			}
		}
		refSiftDown(h, gs)
	}
	return seq
}

type refMember struct {
	w uint32
	i int32
}

// refGroup is what fillWeighted schedules: the backends ms[start:end], all of
// weight w. Those before pos have level+1 slots, the others level; next is
// the backend index at pos.
type refGroup struct {
	level, w        uint32
	next            int32
	start, end, pos int32
}

// before orders groups by level/weight, then by the backend whose turn it
// is. The cross products are exact: level < 2^24 and w < 2^32.
func (a *refGroup) before(b *refGroup) bool {
	x := uint64(a.level) * uint64(b.w)
	y := uint64(b.level) * uint64(a.w)
	if x != y {
		return x < y
	}
	return a.next < b.next
}

// refSiftDown restores the heap after the root's key grew. It stops as soon
// as the root is no later than its children.
func refSiftDown(h []int32, gs []refGroup) {
	n := len(h)
	k := 0
	for {
		c := 2*k + 1
		if c >= n {
			return
		}
		if r := c + 1; r < n && gs[h[r]].before(&gs[h[c]]) {
			c = r
		}
		if !gs[h[c]].before(&gs[h[k]]) {
			return
		}
		h[k], h[c] = h[c], h[k]
		k = c
	}
}

// randomBackends returns n backends with random identities (IPv4 and IPv6,
// TCP and UDP) and IDs, and weights drawn by the named distribution; some
// are not ready, and some have weight 0 unless the distribution is "equal".
func randomBackends(rng *rand.Rand, n int, dist string) []Backend {
	bs := make([]Backend, 0, n)
	seen := map[identity]bool{}
	for len(bs) < n {
		var addr netip.Addr
		if rng.IntN(3) == 0 {
			var a [16]byte
			a[0], a[1], a[2], a[3] = 0x20, 0x01, 0x0d, 0xb8
			a[14], a[15] = byte(rng.IntN(256)), byte(rng.IntN(256))
			addr = netip.AddrFrom16(a)
		} else {
			addr = netip.AddrFrom4([4]byte{10, byte(rng.IntN(4)), byte(rng.IntN(256)), byte(rng.IntN(255) + 1)})
		}
		b := Backend{
			ID:    uint32(len(bs) + 1),
			Addr:  addr,
			Port:  uint16(80 + rng.IntN(3)),
			Proto: [...]uint8{6, 17}[rng.IntN(2)],
			Ready: true,
		}
		if id := identityOf(b.Addr, b.Port, b.Proto); seen[id] {
			continue
		} else {
			seen[id] = true
		}
		switch dist {
		case "equal":
			b.Weight = 1
		case "equal-k":
			b.Weight = 7
		case "small":
			b.Weight = uint32(rng.IntN(4)) // 0..3
		case "wide":
			b.Weight = uint32(rng.IntN(1001)) // 0..1000
		case "huge":
			b.Weight = rng.Uint32()
		case "one-heavy":
			b.Weight = 1
			if len(bs) == 0 {
				b.Weight = 100000
			}
		}
		if dist != "equal" && rng.IntN(10) == 0 {
			b.Weight = 0
		}
		if rng.IntN(10) == 0 {
			b.Ready = false
		}
		bs = append(bs, b)
	}
	rng.Shuffle(len(bs), func(i, j int) { bs[i], bs[j] = bs[j], bs[i] })
	for i := range bs {
		bs[i].ID = uint32(rng.IntN(1<<20)<<10 | i + 1) // unique, unordered
	}
	return bs
}

// TestFillMatchesReference holds New and Rebuild to the frozen fill, entry
// for entry, on random inputs: N from 1 to 200 (and a few sets of up to
// 1000), weights of every kind including 0, backends not ready, the three
// offered sizes and a few small primes, random seeds. Each table is built
// twice, by New and by Rebuild of a table with another history.
func TestFillMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(20261129, 5))
	sizes := []uint32{3, 7, 13, 101, 211, 1009, 4099, SizeS, SizeM, SizeL}
	dists := []string{"equal", "equal-k", "small", "wide", "huge", "one-heavy"}
	reused := map[uint32]*Table{}
	compared := 0
	paths := map[string]int{}
	cases := 400
	if testing.Short() {
		cases = 100
	}
	// A few large sets too, where windows serve up to 1000 backends.
	big := []struct {
		m uint32
		n int
	}{{SizeM, 300}, {SizeM, 1000}, {SizeL, 700}, {SizeL, 1000}}
	for c := range cases + len(big) {
		m := sizes[c%len(sizes)]
		n := 1 + rng.IntN(min(200, int(m)+2)) // a few more than M fail
		switch c % 4 {
		case 0:
			n = 1 + rng.IntN(12) // few backends: every method of the fill
		case 1:
			n = 1 + rng.IntN(40)
		}
		if c >= cases {
			m, n = big[c-cases].m, big[c-cases].n
		}
		dist := dists[rng.IntN(len(dists))]
		seed := rng.Uint64()
		bs := randomBackends(rng, n, dist)
		var eligible []Backend
		for _, b := range bs {
			if b.Eligible() {
				eligible = append(eligible, b)
			}
		}
		if len(eligible) > int(m) {
			if _, err := New(Config{Size: m}, bs); !errors.Is(err, ErrTooManyBackends) {
				t.Fatalf("M=%d, %d eligible: error %v, want ErrTooManyBackends", m, len(eligible), err)
			}
			continue
		}
		compared++
		slices.SortFunc(eligible, func(a, b Backend) int {
			return identityOf(a.Addr, a.Port, a.Proto).compare(identityOf(b.Addr, b.Port, b.Proto))
		})
		name := fmt.Sprintf("case %d: M=%d N=%d (%d eligible) %s seed=%#x", c, m, n, len(eligible), dist, seed)
		if len(eligible) > 0 {
			equal := true
			for _, b := range eligible {
				equal = equal && b.Weight == eligible[0].Weight
			}
			switch kA, kB := phases(m, len(eligible), !equal); {
			case kA < kB && kB < int(m):
				paths["probe, windows, tail"]++
			case kA < kB:
				paths["probe, windows"]++
			default:
				paths["probe"]++
			}
		}
		cfg := Config{Size: m, Seed: seed}
		tab, err := New(cfg, bs)
		if err != nil {
			t.Fatalf("%s: New: %v", name, err)
		}
		if reused[m] == nil {
			reused[m] = mustNew(t, m, seed, testBackends(int(min(m, 50)), mixedWeights))
		}
		other := reused[m]
		other.cfg.Seed = seed
		if err := other.Rebuild(bs); err != nil {
			t.Fatalf("%s: Rebuild: %v", name, err)
		}
		if len(eligible) == 0 {
			if !tab.Empty() || !other.Empty() {
				t.Fatalf("%s: table not empty", name)
			}
			continue
		}
		counts, slots, entries := refBuild(cfg, eligible)
		for _, got := range []*Table{tab, other} {
			if !slices.Equal(got.counts, counts) {
				t.Fatalf("%s: slot counts differ from the reference", name)
			}
			if e := got.Entries(); !slices.Equal(e, entries) {
				for s := range entries {
					if e[s] != entries[s] {
						t.Fatalf("%s: slot %d holds backend %d (ID %d), reference %d (ID %d)",
							name, s, got.indexOf(e[s]), e[s], slots[s], entries[s])
					}
				}
			}
		}
	}
	t.Logf("%d tables compared; methods of the fill: %v", compared, paths)
	for _, p := range []string{"probe", "probe, windows", "probe, windows, tail"} {
		if paths[p] < cases/20 {
			t.Errorf("only %d tables filled by %s", paths[p], p)
		}
	}
}
