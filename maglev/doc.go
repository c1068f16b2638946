// Package maglev builds Maglev lookup tables: the consistent-hashing tables
// that the eBPF datapath indexes with hash % M to pick a service backend.
//
// The package is pure Go, has no dependency beyond the standard library and
// can be imported on its own.
//
// # What Maglev is
//
// Maglev is the consistent hashing of Google's software load balancer
// (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
// Balancer", NSDI 2016, section 3.4). A table has M slots, M prime. Every
// backend has its own preference order over the slots, a permutation
// derived from two hashes of the backend's identity:
//
//	offset = h1 mod M
//	skip   = h2 mod (M−1) + 1
//	preference[j] = (offset + j·skip) mod M,   j = 0 … M−1
//
// Because M is prime and 1 ≤ skip < M, the preference list visits every
// slot exactly once. The table is filled by letting the backends take turns:
// on its turn a backend claims the first slot in its preference list that
// is still empty. The result spreads the slots almost perfectly evenly and,
// because each backend's preferences do not depend on the others, changes
// little when a backend comes or goes.
//
// # How the datapath uses a table
//
// The control plane builds a Table with New (or Rebuild) and writes
// Table.Entries, M backend IDs, into the service's BPF array map. For each
// new flow the datapath hashes the flow's addresses and ports to a 32-bit
// value and reads entry hash % M: the ID of the backend to use. Lookup does
// the same in Go, for tests and for the control plane's own use.
//
// A table with no eligible backend is explicitly empty (Empty reports true,
// Entries is empty, Lookup reports ok == false). The datapath must then drop
// the packet and count the drop; it must never read a slot, which would hold
// stale or zero data. Backend ID 0 is rejected so that a zeroed map entry can
// never be mistaken for a backend.
//
// # Table size and the evenness rule
//
// The size must be prime (IsPrime, NextPrime); New rejects any other with
// ErrSizeNotPrime. The datapath's map tiers use SizeS (16381), SizeM (65537)
// and SizeL (131071); sizes from MinSize to MaxSize are accepted.
//
// Every backend gets its exact share of the M slots rounded to a whole slot
// (see Weights), so a backend's share of traffic is off by less than one
// slot. That is at most 1% of its share when the share is at least 100
// slots. For N equally weighted backends this is the paper's rule:
//
//	M > 100·N keeps the imbalance within about 1%
//
// which lets SizeS serve up to 163 backends, SizeM 655 and SizeL 1310. With
// weights, the backend with the smallest weight w_min needs
// M·w_min/W ≥ 100, W being the sum of the weights. A larger table costs
// memory linearly, 4 bytes per slot here (10 for a table that is
// rebuilt, see Cost) and 4 per slot in the BPF map, and build time a
// little more than linearly (see Cost).
//
// # Weights
//
// Each Backend has a Weight. Only backends that are Ready with a Weight
// above 0 take slots ("eligible" backends). Shares are exactly proportional
// to the weights, for any integer weights including small ones: {1, 1, 2}
// gives 1:1:2. The slot counts are the largest-remainder apportionment of M:
// each backend first gets ⌊M·w/W⌋ slots, and the few slots left over go one
// each to the backends with the largest remainders M·w mod W, ties going to
// the backend first in identity order (see Determinism). So a backend's count
// differs from M·w/W by less than one slot, and a backend whose share is
// below one slot may get none. SlotCounts reports the counts.
//
// The turns are interleaved in proportion to the weights: the next turn goes
// to the eligible backend with the smallest filled/weight (slots claimed so
// far over its weight), ties to identity order, and a backend stops taking
// turns once it holds its count. With equal weights this is exactly the
// paper's round robin, so equally weighted tables are the paper's tables.
// Pacing turns by weight, rather than giving heavy backends all their turns
// first, keeps every backend's claims spread through the fill, which is what
// keeps changes local.
//
// The total weight cannot overflow: weights are uint32 and at most MaxSize
// backends are eligible, so the total stays below 2^56 and every product the
// apportionment forms fits in 64 bits.
//
// # Determinism and the seed
//
// The same backend set, Config.Size and Config.Seed give the same table,
// whatever order the backends come in, in any process, on any machine and
// in any release: an HA standby must compute the table of the active node.
// To that end:
//
//   - A backend's identity is its canonical identity bytes, 19 of them: the
//     16-byte address (an IPv4 address as the IPv4-mapped ::ffff:a.b.c.d),
//     the port big-endian, and the protocol number. The backend's ID, its
//     position in the input and anything else play no part.
//   - Backends are put in identity order (bytewise) before anything else.
//   - h1 and h2 are a 64-bit hash implemented in this package with fixed
//     constants: the identity bytes read as three big-endian words (bytes
//     0–7, 8–15, 16–18) are absorbed one by one into a state seeded from
//     Config.Seed, each step a SplitMix64 finalizer. Go's map order,
//     hash/maphash and other per-process randomness are never used.
//
// Config.Seed is a per-cluster seed, not a secret: all nodes of a cluster
// must use the same one; different clusters may use different seeds so that one
// backend failing does not shift the same flows everywhere. Changing the seed
// reshuffles the whole table (the counts stay the same).
//
// Any change to the identity bytes, the hash or the fill changes tables for
// the same input and so breaks a mixed-version HA pair; the package's golden
// test pins the exact bytes of several tables to catch such a change.
//
// # Disruption
//
// When backends come or go, the slots of a removed backend must move, and so
// must the slots a new backend takes: that is the minimum. Maglev moves
// somewhat more, because a change in who takes which turn lets a few
// backends claim different slots: its collateral churn. Measured with
// Measure at M = 65537 with 1000 equally weighted backends, removing one
// backend moves 0.72% of all slots where 0.10% is the minimum, and 0.62% of
// the slots whose backend stayed; removing ten moves 3.4% (minimum 1.0%).
// This package's weighted fill is no worse than the paper's algorithm: it is
// identical for equal weights. Measure reports both fractions, with the raw
// counts and the minimum, for any two tables.
//
// Collateral moves break established connections unless the datapath keeps
// per-flow state: pair the table with connection tracking so that only new
// flows use the table.
//
// # Cost
//
// A build keeps each backend's offset and skip, its position in its
// preference list and a window of its next 64 preferences, never the N×M
// permutation: memory is O(M + N). A table keeps 4 bytes per slot, the
// entries, and finds a slot's backend by its ID in a small hash index. The
// fill's scratch is 6 bytes per slot (two copies of a byte of occupancy
// per slot; a word per slot for the order of turns of a weighted fill and
// for the last slots' bitmaps) plus about 300 bytes per backend. New borrows
// that scratch from a pool and returns it; a table that is rebuilt keeps
// its own, so that Rebuild allocates nothing.
//
// Searching preference by preference, a fill examines about M·ln M slots
// in all, the last slots being the hardest to find. How the search is done
// changes as the table fills, never which slot a turn takes (the package's
// tests hold every path to the plain search, entry for entry). While most
// slots are empty a turn tests its backend's preferences one by one. From
// 30% full, if every backend takes at least 64 slots, a backend reads the
// occupancy of its next 64 preferences at once, without a branch, and its
// turns take the free ones in order: this spares the CPU the branch
// misprediction that the one-by-one search costs almost every turn once
// many slots are taken. For the last 10%/N of the slots, with up to about
// 30 backends, the empty slots are listed once and each backend gets a
// bitmap of them in the order of its preferences, built with a few
// multiplications (no division) per backend and empty slot, and a turn
// jumps straight to its next empty slot. The loops that play the turns
// index the fill's arrays through bare pointers, each index bounded by
// construction (see filler): with bounds-checked slices the compiler kept
// half their state on the stack.
//
// The order of turns repeats every W' = Σ w/gcd(w) turns: with equal
// weights it is round robin, otherwise one period (or all M turns if that
// is shorter) is scheduled at O(log G) per turn, G being the number of
// distinct weights, and replayed.
//
// Rebuild reuses the table's storage and allocates nothing in steady state.
// See docs/benchmarks.md for measured figures.
package maglev
