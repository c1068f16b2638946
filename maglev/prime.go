package maglev

// IsPrime reports whether n is prime.
//
// It is exact for every uint32: it runs the Miller–Rabin test with the bases
// 2, 7 and 61, which has no false positive below 4,759,123,141.
func IsPrime(n uint32) bool {
	if n < 2 {
		return false
	}
	for _, p := range [...]uint32{2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61} {
		if n%p == 0 {
			return n == p
		}
	}
	// n is odd and > 61 here, so n-1 = d·2^r with r ≥ 1.
	d, r := n-1, 0
	for d&1 == 0 {
		d >>= 1
		r++
	}
	m := uint64(n)
witness:
	for _, a := range [...]uint64{2, 7, 61} {
		x := powMod(a, uint64(d), m)
		if x == 1 || x == m-1 {
			continue
		}
		for i := 1; i < r; i++ {
			x = x * x % m // operands < 2^32, so the product fits in 64 bits
			if x == m-1 {
				continue witness
			}
		}
		return false
	}
	return true
}

func powMod(a, e, m uint64) uint64 {
	r := uint64(1)
	a %= m
	for e > 0 {
		if e&1 == 1 {
			r = r * a % m
		}
		a = a * a % m
		e >>= 1
	}
	return r
}

// NextPrime returns the smallest prime ≥ n, or 0 if there is none that fits
// in a uint32. Use it to pick a table size for a backend count that the
// offered sizes do not fit, e.g. NextPrime(100*n+1) for the evenness rule.
func NextPrime(n uint32) uint32 {
	const largest = 4294967291 // the largest prime below 2^32
	if n > largest {
		return 0
	}
	if n <= 2 {
		return 2
	}
	if n&1 == 0 {
		n++
	}
	for !IsPrime(n) {
		n += 2
	}
	return n
}
