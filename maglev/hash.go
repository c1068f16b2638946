package maglev

import (
	"encoding/binary"
	"net/netip"
)

// identity is the canonical identity of a backend: the 19 bytes
//
//	address (16 bytes, IPv4 as ::ffff:a.b.c.d) | port (2 bytes, big-endian) | protocol (1 byte)
//
// held as three big-endian words, so that comparing the words in order
// compares the bytes lexicographically.
type identity struct {
	hi uint64 // address bytes 0..7
	lo uint64 // address bytes 8..15
	pp uint32 // port << 8 | protocol: bytes 16..18
}

func identityOf(addr netip.Addr, port uint16, proto uint8) identity {
	a := addr.As16()
	return identity{
		hi: binary.BigEndian.Uint64(a[0:8]),
		lo: binary.BigEndian.Uint64(a[8:16]),
		pp: uint32(port)<<8 | uint32(proto),
	}
}

func (x identity) compare(y identity) int {
	switch {
	case x.hi != y.hi:
		return cmp3(x.hi < y.hi)
	case x.lo != y.lo:
		return cmp3(x.lo < y.lo)
	case x.pp != y.pp:
		return cmp3(x.pp < y.pp)
	}
	return 0
}

func cmp3(less bool) int {
	if less {
		return -1
	}
	return 1
}

// The hash below is part of the package's compatibility contract: every
// constant is fixed, so that two processes (an active node and its HA standby,
// or two releases) given the same backends and seed compute the same table.
// Changing anything here changes every table; TestGolden guards it.
const (
	// Domain separators make the offset hash and the skip hash two unrelated
	// functions of the same identity.
	domainOffset uint64 = 0x6d61676c65762d6f // "maglev-o"
	domainSkip   uint64 = 0x6d61676c65762d73 // "maglev-s"

	// identityLen is folded into the last word so that the encoding stays
	// unambiguous should the identity ever grow.
	identityLen uint64 = 19
)

// mix64 is the SplitMix64 finalizer (Stafford's "Mix13" constants): a
// bijection on 64-bit words with full avalanche.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// hashIdentity is a seeded 64-bit hash of the canonical identity bytes.
// Each word is absorbed by XOR into a state that then goes through mix64;
// since mix64 is a bijection, identities that differ in a single word never
// collide, and all other collisions are as rare as for a random function.
func hashIdentity(seed, domain uint64, id identity) uint64 {
	h := mix64(seed ^ domain)
	h = mix64(h ^ id.hi)
	h = mix64(h ^ id.lo)
	return mix64(h ^ uint64(id.pp) ^ identityLen<<56)
}

// offsetSkip returns where the backend's preference list starts and by how
// much it advances: the preference list (offset + j·skip) mod m visits every
// slot exactly once because m is prime and 1 ≤ skip < m.
func offsetSkip(seed uint64, id identity, m uint32) (offset, skip uint32) {
	offset = uint32(hashIdentity(seed, domainOffset, id) % uint64(m))
	skip = uint32(hashIdentity(seed, domainSkip, id)%uint64(m-1)) + 1
	return offset, skip
}
