package maglev

import "slices"

// textbook is the reference the benchmarks compare against: the algorithm
// as the Maglev paper (Eisenbud et al., NSDI 2016, §3.4, Pseudocode 1)
// states it, unweighted. It materialises the N×M permutation table and
// computes every entry with %, as a straightforward implementation does.
//
// It orders backends canonically and takes offset and skip from the same
// hash as the package, so for equal weights it must produce exactly the
// package's table; TestTextbookEquivalence holds the package to that.
func textbook(m uint32, seed uint64, backends []Backend) []uint32 {
	type be struct {
		id  identity
		bid uint32
	}
	var bs []be
	for _, b := range backends {
		if b.Eligible() {
			bs = append(bs, be{identityOf(b.Addr, b.Port, b.Proto), b.ID})
		}
	}
	if len(bs) == 0 {
		return nil
	}
	slices.SortFunc(bs, func(a, b be) int { return a.id.compare(b.id) })
	n := len(bs)

	permutation := make([][]uint32, n)
	for i, b := range bs {
		offset, skip := offsetSkip(seed, b.id, m)
		permutation[i] = make([]uint32, m)
		for j := uint32(0); j < m; j++ {
			permutation[i][j] = uint32((uint64(offset) + uint64(j)*uint64(skip)) % uint64(m))
		}
	}

	next := make([]uint32, n)
	entry := make([]int, m)
	for j := range entry {
		entry[j] = -1
	}
	filled := uint32(0)
	for {
		for i := 0; i < n; i++ {
			c := permutation[i][next[i]]
			for entry[c] >= 0 {
				next[i]++
				c = permutation[i][next[i]]
			}
			entry[c] = i
			next[i]++
			filled++
			if filled == m {
				out := make([]uint32, m)
				for s, i := range entry {
					out[s] = bs[i].bid
				}
				return out
			}
		}
	}
}
