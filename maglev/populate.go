package maglev

import (
	"encoding/binary"
	"math/bits"
	"slices"
	"unsafe"
)

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
	rem := withCap(t.remainders, len(t.backends))
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
//
// How a turn finds its slot changes as the table fills; which slot it
// finds never does (TestFillMatchesReference holds every path to the
// plain fill, entry for entry). While most slots are empty, probe tests
// one preference after the other. From windowsFrom on, if every backend
// claims at least fastMinClaims slots, playWindows reads the occupancy of
// a backend's next 64 preferences at once. For the last slots, with few
// backends, fillTail jumps straight to each backend's next empty slot.
func (t *Table) populate() {
	m := t.cfg.Size
	n := len(t.backends)
	t.reserve(n)
	occ := t.occ[:2*m]
	clear(occ[:m])
	for i, id := range t.ids {
		t.cursors[i].p, t.cursors[i].s = offsetSkip(t.cfg.Seed, id, m)
		t.cursors[i].id = t.backends[i].ID
	}
	turns := t.turnOrder()
	f := t.filler(turns)

	kA, kB := phases(m, n, turns != nil)
	j := f.probe(0, kA)
	if kA < int(m) {
		for i, c := range t.cursors {
			w := &t.windows[i]
			w.ks[0] = 0
			for j := 1; j < 64; j++ {
				w.ks[j] = wrapAdd(w.ks[j-1], c.s, m)
			}
			w.base, w.adv, w.id = c.p, wrapAdd(w.ks[63], c.s, m), c.id
		}
	}
	if kA < kB {
		copy(occ[m:], occ[:m]) // the mirror: see window
		for i := range t.windows {
			w := &t.windows[i]
			w.mask = gather(w.base, &w.ks, occ)
		}
		f.playWindows(j, kB-kA)
		// Back to cursors: every preference before the first one not
		// marked in the window is taken.
		for i := range t.cursors {
			w := &t.windows[i]
			if w.mask == ^uint64(0) {
				t.cursors[i].p = wrapAdd(w.base, w.adv, m)
			} else {
				t.cursors[i].p = wrapAdd(w.base, w.ks[bits.TrailingZeros64(^w.mask)&63], m)
			}
		}
	}
	if kB < int(m) {
		t.fillTail(turns, kB)
	}
}

// phases returns where the fill changes method for M slots and n
// backends: turns [0, kA) probe, turns [kA, kB) use windows, and the turns
// from kB on are the tail. stored says whether the turns are stored in
// t.work, which the tail borrows.
//
// The products are taken in 64 bits: M·300 and N·M/32 overflow a 32-bit
// int for the largest tables.
func phases(m uint32, n int, stored bool) (kA, kB int) {
	kA, kB = int(m), int(m)
	m64, n64 := uint64(m), uint64(n)
	if m < fastMinSize || m64 < fastMinClaims*n64 {
		return kA, kB
	}
	kA = int(m64 * windowsFrom / 1000)
	if e := m64 * tailEmpty / (1000 * n64); e >= tailMinEmpty {
		room := m64
		if stored {
			room = m64 - e
		}
		if n64*uint64(tailWords(m))+e <= room {
			kB = int(m64 - e)
		}
	}
	return kA, kB
}

// Where the fill changes method, measured on the benchmarks' tables with
// N = 2 to 1000 (docs/benchmarks.md): probing one preference at a time is
// cheaper until windowsFrom per mille of the slots are taken, and windows
// are cheaper than the tail until tailEmpty/N per mille are left. Windows
// pay off once every backend claims at least about a window's worth of
// slots.
const (
	windowsFrom   = 300
	tailEmpty     = 100
	tailMinEmpty  = 64
	fastMinSize   = 1024
	fastMinClaims = 64
)

// reserve sizes the fill's scratch for n backends. All of it is sized by M
// and N alone, whatever path the fill takes, so that a table that has held
// a backend set at least as large never allocates again.
func (t *Table) reserve(n int) {
	m := int(t.cfg.Size)
	t.entries = grow(t.entries, m)
	t.work = grow(t.work, m)
	t.occ = grow(t.occ, 2*m) // two copies for the windows
	t.cursors = grow(t.cursors, n)
	t.windows = grow(t.windows, n)
	t.tails = grow(t.tails, n)
	t.quota = grow(t.quota, n)
	t.filled = grow(t.filled, n)
	t.members = withCap(t.members, n)
	t.groups = withCap(t.groups, n)
	t.heap = withCap(t.heap, n)
}

// withCap returns s emptied, with room for n elements.
func withCap[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, 0, n)
	}
	return s[:0]
}

// cursor is a backend's place in its preference list: the next slot to
// look at, p, and the step to the one after it, s (the skip).
type cursor struct{ p, s, id uint32 }

// turnOrder returns the backend of each of the M turns, or nil for round
// robin: turn k is backend k mod N.
//
// Backend i's k-th turn comes at (k/w_i, i) in the order of turns. Adding
// w_i to k adds exactly 1 to k/w_i for every backend, so the order repeats
// with a period of W' = Σ w_i/g turns (g the gcd of the weights). Equal
// weights give the period 0, 1, ..., N−1: round robin, and the counts are
// ⌈M/N⌉ for the first M mod N backends and ⌊M/N⌋ for the others, so no
// turn is ever skipped. Otherwise the turns are written to t.work (of M
// words, shared with the tail's bitmaps): when W' < M one period is
// scheduled and replayed, skipping backends that hold their count (which
// leaves the others' order as it was), else every turn is scheduled.
func (t *Table) turnOrder() []uint32 {
	m := t.cfg.Size
	g := uint32(0)
	for i := range t.backends {
		g = gcd(g, t.backends[i].Weight)
	}
	var period uint64
	for i := range t.backends {
		period += uint64(t.backends[i].Weight / g)
	}
	if period == uint64(len(t.backends)) {
		return nil
	}
	turns := t.work[:m]
	if period >= uint64(m) {
		copy(t.quota, t.counts)
		return t.schedule(t.quota, turns[:0])
	}
	for i := range t.backends {
		t.quota[i] = t.backends[i].Weight / g
	}
	seq := t.schedule(t.quota, turns[:0])

	// Until the first backend reaches its count, whole periods need no
	// count checks. There is at least one: counts[i] ≥ ⌊M·q_i/W'⌋ ≥ q_i as
	// M > W'. So the replays below write from turns[len(seq)] on and never
	// overwrite the period they read in turns[:len(seq)].
	full := ^uint32(0)
	for i, q := range t.quota {
		if q > 0 {
			full = min(full, t.counts[i]/q)
		}
	}
	k := len(seq)
	for range full - 1 {
		k += copy(turns[k:], seq)
	}
	for i, q := range t.quota {
		t.filled[i] = full * q
	}
	for k < int(m) {
		for _, i := range seq {
			if t.filled[i] < t.counts[i] {
				turns[k] = i
				t.filled[i]++
				if k++; k == int(m) {
					break
				}
			}
		}
	}
	return turns
}

func gcd(a, b uint32) uint32 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// filler is the state of a fill that its hot loops, probe and claim,
// work on. They are the whole cost of a build, and with the table's
// slices they would need more registers than there are: the compiler
// would keep half their state on the stack. So they see the arrays
// through bare pointers, each index bounded by construction:
//
//   - seq is the order of turns, nseq long: turn k is backend seq[j] with
//     j = k mod nseq (weighted: the M turns of turnOrder, j = k). Every
//     entry is below N. For round robin seq is nil, nseq = N and turn k is
//     backend j = k mod N.
//   - cursors and windows hold N elements, indexed by a backend.
//   - occ holds 2M bytes: slot s and its mirror s+M (see window).
//   - entries holds M IDs, indexed by a slot below M.
//
// A cursor's slot is kept below M by wrapAdd; a window's candidate is
// base+ks[b] < 2M with base, ks[b] < M, and a claim reduces it to its
// slot s < M and writes occ[s], occ[s+M] and entries[s]; the loops index
// nothing else.
type filler struct {
	seq, cursors, windows, occ, entries unsafe.Pointer
	nseq                                int
	m                                   uint32
}

func (t *Table) filler(turns []uint32) filler {
	n := len(t.backends)
	m := t.cfg.Size
	// The lengths the loops rely on, checked once.
	_, _, _, _ = t.cursors[n-1], t.windows[n-1], t.occ[2*m-1], t.entries[m-1]
	var seq unsafe.Pointer
	nseq := n
	if turns != nil {
		seq, nseq = unsafe.Pointer(&turns[0]), len(turns)
	}
	return filler{
		seq: seq, nseq: nseq,
		cursors: unsafe.Pointer(&t.cursors[0]), windows: unsafe.Pointer(&t.windows[0]),
		occ: unsafe.Pointer(&t.occ[0]), entries: unsafe.Pointer(&t.entries[0]),
		m: m,
	}
}

// turn returns the backend of turn index j in the order of turns seq
// (nil for round robin) of nseq turns, and the index of the next turn.
func turn(seq unsafe.Pointer, nseq, j int) (uint32, int) {
	i := uint32(j)
	if seq != nil {
		i = *(*uint32)(unsafe.Add(seq, 4*j))
	}
	if j++; j == nseq {
		j = 0
	}
	return i, j
}

// probe plays count turns from turn index j and returns the index of the
// next turn. It plays them the classic way: backend i claims the first
// empty slot of its preference list, probing the slots one by one, and
// its cursor moves past the slot. A claimed slot's entry is set to the
// backend's ID.
//
// Occupancy is probed in occ, a byte per slot (1 if taken), rather than in
// the entries themselves: a byte is tested and set with one load or store,
// and occ is a quarter of the size of the entries.
func (f *filler) probe(j, count int) int {
	occ, entries, cursors, m := f.occ, f.entries, f.cursors, f.m
	for range count {
		var i uint32
		i, j = turn(f.seq, f.nseq, j)
		cu := (*cursor)(unsafe.Add(cursors, uintptr(i)*unsafe.Sizeof(cursor{})))
		p, s := cu.p, cu.s
		for *(*byte)(unsafe.Add(occ, p)) != 0 {
			p = wrapAdd(p, s, m)
		}
		*(*byte)(unsafe.Add(occ, p)) = 1
		*(*uint32)(unsafe.Add(entries, 4*uintptr(p))) = cu.id
		cu.p = wrapAdd(p, s, m)
	}
	return j
}

// wrapAdd returns (p + s) mod m for p, s < m < 2^31 without a division or
// a branch: p+s−m is negative, as an int32, exactly when p+s < m, and then
// the sign mask adds m back. (Whether a step wraps is as random as the
// skip, so a branch would be mispredicted half the time.)
func wrapAdd(p, s, m uint32) uint32 {
	q := p + s - m
	return q + m&uint32(int32(q)>>31)
}

// window is what a backend knows of its next 64 preferences: base is the
// slot of the first, and bit j of mask is set if preference j was taken
// when the window was read, or has been passed since. Preference j is
// base + ks[j] (mod M), ks[j] = j·skip mod M; adv = 64·skip mod M moves
// the window on.
//
// Probing mispredicts about once a turn, since whether the next preference
// is free is a coin toss once a good part of the slots are taken. Reading
// a window tests its 64 preferences without a branch, and then each turn
// takes the first preference not marked. It checks that the slot is still
// empty, in case another backend took it after the window was read; that
// is rare, as other backends take only a few slots between two turns of
// the same backend, and then the turn marks it and tries the next.
//
// Preference j is read from occ[base + ks[j]] without reducing the index
// mod M: occ holds two copies of the occupancy, occ[M+s] = occ[s], made
// when the windows start and both kept up to date, so any index below 2M
// is good. Reading a byte costs a load, a shift and an or per preference,
// where a bitmap also costs the shifts that find the bit.
type window struct {
	mask uint64
	base uint32
	adv  uint32
	id   uint32 // the backend's ID
	_    uint32
	ks   [64]uint32
}

// gather reads the occupancy of the 64 preferences base + ks[j]: bit j of
// the result is occ[base + ks[j]]. base + ks[j] < 2M indexes the two
// copies of occ (see window).
func gather(base uint32, ks *[64]uint32, occ []byte) uint64 {
	// base + ks[j] < 2M = len(occ), so the loads need no bounds checks.
	p := unsafe.Pointer(unsafe.SliceData(occ[base:]))
	at := func(k uint32) uint64 { return uint64(*(*byte)(unsafe.Add(p, k))) }
	var lo, hi uint64
	for j := 28; j >= 0; j -= 4 {
		lo = lo<<4 | at(ks[j+3])<<3 | at(ks[j+2])<<2 | at(ks[j+1])<<1 | at(ks[j])
		hi = hi<<4 | at(ks[j+35])<<3 | at(ks[j+34])<<2 | at(ks[j+33])<<1 | at(ks[j+32])
	}
	return hi<<32 | lo
}

// playWindows plays count turns from turn index j with windows, as probe
// does. Its loop, claim, leaves the turns to it whose window runs out.
func (f *filler) playWindows(j, count int) {
	for count > 0 {
		var played int
		j, played = f.claim(j, count)
		if count -= played; count == 0 {
			return
		}
		i, _ := turn(f.seq, f.nseq, j)
		w := (*window)(unsafe.Add(f.windows, uintptr(i)*unsafe.Sizeof(window{})))
		w.base = wrapAdd(w.base, w.adv, f.m)
		w.mask = gather(w.base, &w.ks, unsafe.Slice((*byte)(f.occ), 2*f.m))
	}
}

// claim plays turns from turn index j on, at most count, until one finds
// its window used up. It returns the index of that turn (or of the turn
// after the last) and the number of turns played.
func (f *filler) claim(j, count int) (int, int) {
	occ, entries, windows, seq, nseq, m := f.occ, f.entries, f.windows, f.seq, f.nseq, f.m
	for left := count; left > 0; left-- {
		// turn, written out: its second result would cost this loop a
		// register it does not have (5-10% slower, measured).
		i := uint32(j)
		if seq != nil {
			i = *(*uint32)(unsafe.Add(seq, 4*j))
		}
		w := (*window)(unsafe.Add(windows, uintptr(i)*unsafe.Sizeof(window{})))
		mask := w.mask
		var x uint32
		for {
			if mask == ^uint64(0) {
				return j, count - left
			}
			b := bits.TrailingZeros64(^mask)
			mask |= mask + 1 // the lowest clear bit, b
			x = w.base + w.ks[b&63]
			if *(*byte)(unsafe.Add(occ, x)) == 0 {
				break
			}
		}
		w.mask = mask
		// The slot is x mod M; mark both its copies.
		x -= m
		x += m & uint32(int32(x)>>31)
		*(*byte)(unsafe.Add(occ, x)) = 1
		*(*byte)(unsafe.Add(occ, x+m)) = 1
		*(*uint32)(unsafe.Add(entries, 4*uintptr(x))) = w.id
		if j++; j == nseq {
			j = 0
		}
	}
	return j, count
}

// tailCursor is a backend's place in its rank bitmap during the tail: the
// word q, the slot sb of the first rank the word stands for, and
// adv = 32·skip mod M, which moves sb to the next word.
type tailCursor struct {
	q, sb, adv uint32
}

// tailWords is the length of a backend's rank bitmap in 32-bit words.
func tailWords(m uint32) int { return (int(m) + 31) / 32 }

// fillTail plays the turns from k0 on, when few slots are left empty,
// without probing one slot at a time; the slots claimed are exactly those
// probe would claim.
//
// Backend i's next claim is the empty slot that comes first in its
// preference list from its cursor c_i on: the empty slot e with the
// smallest rank r = (e − c_i)·s_i⁻¹ mod M, s_i⁻¹ being the inverse of the
// skip mod M (M is prime), since every slot before the cursor is taken.
// So each backend gets a bitmap over ranks, with a bit set for every slot
// still empty at k0. On its turn it takes the next set bit, maps the rank
// back to its slot c_i + r·s_i mod M and claims it, unless another backend
// has taken it since. Setting the bits costs O(N·E) for E empty slots
// (listed once), and each backend reads each bit at most once, where
// probing would cost about M/E per claim near the end.
//
// The bitmaps, N·tailWords(M) words, and the list of empty slots borrow
// t.work: its turns before k0 are played, if the turns are there at all.
func (t *Table) fillTail(turns []uint32, k0 int) {
	m := t.cfg.Size
	n := len(t.backends)
	words := tailWords(m)
	ranks := t.work[:n*words]
	clear(ranks)
	occ := t.occ[:m]
	empty := emptySlots(occ, t.work[n*words:n*words])
	for i, c := range t.cursors {
		setRanks(ranks[i*words:i*words+words], empty, c, m)
		t.tails[i] = tailCursor{q: uint32(i * words), sb: c.p, adv: t.windows[i].ks[32]}
	}
	playTail(turns, k0, int(m)-k0, t.tails, ranks, t.windows, occ, t.cursors, t.entries, m)
}

// setRanks sets bit rank(e) of r for every slot e in empty, for the
// backend at cursor c: rank(e) = (e − c.p)·inv mod M, inv the inverse of
// c.s. It multiplies by Shoup's method: with invq = ⌊inv·2³²/M⌋ and
// a < M, a·inv − ⌊a·invq/2³²⌋·M is in [0, 2M).
func setRanks(r, empty []uint32, c cursor, m uint32) {
	inv := uint64(invMod(c.s, m))
	invq := inv << 32 / uint64(m)
	for _, e := range empty {
		a := uint64(wrapAdd(e, m-c.p, m))
		x := wrapAdd(uint32(a*inv-(a*invq>>32)*uint64(m)), 0, m)
		r[x>>5] |= 1 << (x & 31)
	}
}

// emptySlots appends to list the slots s with occ[s] = 0, in order. It
// reads occ eight bytes at a time: as every byte is 0 or 1, the empty
// slots of a word are the bytes whose low bit is clear.
func emptySlots(occ []byte, list []uint32) []uint32 {
	const lows = 0x0101010101010101
	full := len(occ) &^ 7
	for s := 0; s < full; s += 8 {
		free := ^binary.LittleEndian.Uint64(occ[s:]) & lows
		for ; free != 0; free &= free - 1 {
			list = append(list, uint32(s+bits.TrailingZeros64(free)>>3))
		}
	}
	for s := full; s < len(occ); s++ {
		if occ[s] == 0 {
			list = append(list, uint32(s))
		}
	}
	return list
}

// playTail plays count turns from turn k, as probe does, with the rank
// bitmaps of fillTail. It uses ws[i].ks[b] = b·skip mod M for b < 32.
func playTail(turns []uint32, k, count int, tc []tailCursor, ranks []uint32, ws []window, occ []byte, cs []cursor, entries []uint32, m uint32) {
	n := uint32(len(tc))
	i := uint32(k % len(tc))
	for c := range count {
		if turns != nil {
			i = turns[k+c]
		}
		tci := &tc[i]
		q, sb := tci.q, tci.sb
		ks := &ws[i].ks
		for {
			w := ranks[q]
			for w == 0 {
				q++
				sb = wrapAdd(sb, tci.adv, m)
				w = ranks[q]
			}
			ranks[q] = w & (w - 1)
			e := wrapAdd(sb, ks[bits.TrailingZeros32(w)&31], m)
			if occ[e] == 0 {
				occ[e] = 1
				entries[e] = cs[i].id
				break
			}
		}
		tci.q, tci.sb = q, sb
		if i++; i == n {
			i = 0
		}
	}
}

// invMod returns the inverse of a mod the prime m, 0 < a < m, by the
// extended Euclidean algorithm.
func invMod(a, m uint32) uint32 {
	r0, r1 := int64(m), int64(a)
	t0, t1 := int64(0), int64(1)
	for r1 != 0 {
		q := r0 / r1
		r0, r1 = r1, r0-q*r1
		t0, t1 = t1, t0-q*t1
	}
	if t0 < 0 {
		t0 += int64(m)
	}
	return uint32(t0)
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
