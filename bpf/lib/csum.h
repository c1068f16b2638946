/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Checksum arithmetic (RFC 1071 one's complement sums, RFC 1624
 * incremental updates) and the skb's checksum offload state, shared by
 * every header that writes to a packet (nat.h, icmp.h, fib.h).
 *
 * Sums are kept as 32-bit partial sums over 16-bit words loaded in host
 * order, like the kernel's __wsum: a one's complement sum is the same in
 * either byte order, so the words are never swapped.
 */
#ifndef FLUXVM_LIB_CSUM_H
#define FLUXVM_LIB_CSUM_H

#include "common.h"

static __always_inline __u32 fluxvm_csum_add(__u32 a, __u32 b)
{
	a += b;
	return a + (a < b);
}

/* The partial sum that turns 16 bytes @from into @to, like bpf_csum_diff. */
static __always_inline __u32 fluxvm_csum_diff16(const __be32 *from, const __be32 *to)
{
	__u32 s = 0;
	int i;

#pragma unroll
	for (i = 0; i < 4; i++) {
		s = fluxvm_csum_add(s, ~from[i]);
		s = fluxvm_csum_add(s, to[i]);
	}
	return s;
}

/* The one's complement change of a 16-bit field from @o to @n. */
static __always_inline __u32 fluxvm_csum_diff2(__u16 o, __u16 n)
{
	return fluxvm_csum_add(~(__u32)o, n);
}

static __always_inline __u32 fluxvm_csum_diff4(__be32 o, __be32 n)
{
	return fluxvm_csum_add(~o, n);
}

static __always_inline __u16 fluxvm_csum_fold(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)~s;
}

/*
 * CHECKSUM_COMPLETE: skb->csum sums the packet from the IP header on, so
 * every write there moves it by what the written words moved by (@moved,
 * a partial sum of the changes). Callers call this only under
 * CHECKSUM_COMPLETE, after the packet is written: bpf_csum_update costs a
 * helper call, and a change that folds to zero needs none.
 */
static __always_inline void fluxvm_csum_complete_move(struct __ctx_buff *ctx, __u32 moved)
{
	moved = (moved & 0xffff) + (moved >> 16);
	moved = (moved & 0xffff) + (moved >> 16);
	if (moved != 0 && moved != 0xffff)
		ctx_csum_update(ctx, moved);
}

#endif /* FLUXVM_LIB_CSUM_H */
