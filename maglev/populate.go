package maglev

import "slices"

type remainder struct {
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
func (t *Table) apportion() {
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
		rem = append(rem, remainder{r: p % total, i: int32(i)})
	}
	t.remainders = rem
	if left := int(m - assigned); left > 0 {
		slices.SortFunc(rem, func(a, b remainder) int {
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
func (t *Table) populate() {
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
		g = gcd(g, t.backends[i].Weight)
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

func gcd(a, b uint32) uint32 {
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
func (t *Table) claim(i int) {
	m, used := t.cfg.Size, t.used
	p, s := t.pos[i], t.skip[i]
	for used[p>>6]&(1<<(p&63)) != 0 {
		p = wrapAdd(p, s, m)
	}
	used[p>>6] |= 1 << (p & 63)
	t.slots[p] = uint32(i)
	t.pos[i] = wrapAdd(p, s, m)
}

// wrapAdd returns (p + s) mod m for p, s < m without a division: p+s < 2m,
// so at most one m comes off. Written as a min of unsigned values (p+s−m
// wraps around to a huge value when p+s < m) it compiles to a conditional
// move, free of the branch the CPU could not predict: whether a step wraps
// is as random as the skip.
func wrapAdd(p, s, m uint32) uint32 {
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
func (t *Table) schedule(quota []uint32, seq []uint32) []uint32 {
	ms := t.members[:0]
	for i := range t.backends {
		ms = append(ms, member{w: t.backends[i].Weight, i: int32(i)})
	}
	t.members = ms
	slices.SortFunc(ms, func(a, b member) int {
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
			gs = append(gs, group{w: ms[start].w, next: ms[start].i, start: int32(start), end: int32(end)})
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
		var next *group
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
		siftDown(h, gs)
	}
	return seq
}

type member struct {
	w uint32
	i int32
}

// group is what fillWeighted schedules: the backends ms[start:end], all of
// weight w. Those before pos have level+1 slots, the others level; next is
// the backend index at pos.
type group struct {
	level, w        uint32
	next            int32
	start, end, pos int32
}

// before orders groups by level/weight, then by the backend whose turn it
// is. The cross products are exact: level < 2^24 and w < 2^32.
func (a *group) before(b *group) bool {
	x := uint64(a.level) * uint64(b.w)
	y := uint64(b.level) * uint64(a.w)
	if x != y {
		return x < y
	}
	return a.next < b.next
}

// siftDown restores the heap after the root's key grew. It stops as soon
// as the root is no later than its children.
func siftDown(h []int32, gs []group) {
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
