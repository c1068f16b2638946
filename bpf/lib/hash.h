/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The flow hash that indexes Maglev tables: MurmurHash3's 32-bit mixing
 * over the tuple words, keyed with the per-node seed from fluxvm_meta, so
 * that flows spread evenly and a node's mapping is not guessable from
 * outside. It only needs to be stable for the life of the seed.
 */
#ifndef FLUXVM_LIB_HASH_H
#define FLUXVM_LIB_HASH_H

#include "common.h"

static __always_inline __u32 fluxvm_rol32(__u32 x, int r)
{
	return (x << r) | (x >> (32 - r));
}

static __always_inline __u32 fluxvm_hash_word(__u32 h, __u32 k)
{
	k *= 0xcc9e2d51;
	k = fluxvm_rol32(k, 15);
	k *= 0x1b873593;
	h ^= k;
	h = fluxvm_rol32(h, 13);
	return h * 5 + 0xe6546b64;
}

static __always_inline __u32 fluxvm_hash_final(__u32 h, __u32 len)
{
	h ^= len;
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

static __always_inline __u32 fluxvm_seed32(__u64 seed)
{
	return (__u32)seed ^ (__u32)(seed >> 32);
}

static __always_inline __u32 fluxvm_hash4(const struct fluxvm_tuple4 *t, __u64 seed)
{
	__u32 h = fluxvm_seed32(seed);

	h = fluxvm_hash_word(h, t->saddr);
	h = fluxvm_hash_word(h, t->daddr);
	h = fluxvm_hash_word(h, ((__u32)t->sport << 16) | t->dport);
	h = fluxvm_hash_word(h, t->proto);
	return fluxvm_hash_final(h, 16);
}

static __always_inline __u32 fluxvm_hash6(const struct fluxvm_tuple6 *t, __u64 seed)
{
	__u32 h = fluxvm_seed32(seed);
	int i;

#pragma unroll
	for (i = 0; i < 4; i++)
		h = fluxvm_hash_word(h, t->saddr[i]);
#pragma unroll
	for (i = 0; i < 4; i++)
		h = fluxvm_hash_word(h, t->daddr[i]);
	h = fluxvm_hash_word(h, ((__u32)t->sport << 16) | t->dport);
	h = fluxvm_hash_word(h, t->proto);
	return fluxvm_hash_final(h, 40);
}

#endif /* FLUXVM_LIB_HASH_H */
