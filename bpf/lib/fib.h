/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Forwarding a packet ourselves: a FIB lookup in the node's routing table
 * and a redirect to the interface it names, with the L2 header and the
 * TTL/hop limit set as the kernel's forwarding path would set them.
 *
 * Used after NAT on services with host_routing (a miss leaves the packet to
 * the host stack) and for routed DSR (the lookup is on the backend's
 * address while the packet keeps the VIP; a miss drops). Both run on
 * ingress hooks, after conntrack and reverse NAT were learned, because a
 * redirect ends our say over the packet.
 *
 * The lookup and the L2 rewrite are shared by TC and XDP; the redirect is
 * each hook's own (fluxvm_fib_redirect here for TC, with the kernel's
 * neighbour resolution; XDP cannot resolve a neighbour and leaves such a
 * packet to the stack, untouched).
 */
#ifndef FLUXVM_LIB_FIB_H
#define FLUXVM_LIB_FIB_H

#include "maps.h"
#include "parse.h"
#include "csum.h"

#define FLUXVM_AF_INET_KERNEL 2   /* AF_INET, as bpf_fib_lookup wants it */
#define FLUXVM_AF_INET6_KERNEL 10 /* AF_INET6 */

/* fluxvm_fib_redirect found no way to forward the packet. */
#define FLUXVM_FIB_MISS -1


/* ip_decrease_ttl: one less TTL and the header checksum patched (RFC 1624).
 * skb->csum, which covers the header, does not move: the header sums to
 * the same value before and after. */
static __always_inline void fluxvm_ipv4_dec_ttl(struct iphdr *iph)
{
	__u32 check = (__u32)iph->check;

	check += (__u32)bpf_htons(0x0100);
	iph->check = (__sum16)(check + (check >= 0xFFFF));
	iph->ttl--;
}

/* One less hop limit. No header checksum covers it, but skb->csum does
 * under CHECKSUM_COMPLETE: returns what the word it shares with the next
 * header field moved by, for fluxvm_csum_complete_move. */
static __always_inline __u32 fluxvm_ipv6_dec_hoplimit(struct ipv6hdr *ip6)
{
	__u16 *w = (__u16 *)&ip6->nexthdr;
	__u16 old = *w;

	ip6->hop_limit--;
	return fluxvm_csum_diff2(old, *w);
}

/*
 * The FIB lookup for the packet as it will leave: from @src to @dst (NULL:
 * the packet's own addresses), from the interface it came in on. The
 * lookup and its answer are left in the per-CPU scratch (maps.h; a rare
 * path, and ~90 bytes every inlining frame would otherwise hold). Returns
 * BPF_FIB_LKUP_RET_SUCCESS (next hop and its link-layer address known),
 * BPF_FIB_LKUP_RET_NO_NEIGH (next hop known, its address not yet), or
 * FLUXVM_FIB_MISS: no forwarding answer (local destination, no route,
 * forwarding disabled, MTU exceeded) or a TTL about to expire, all of
 * which the host stack handles properly, with ICMP errors where due.
 * Nothing is written to the packet.
 */
static __always_inline int fluxvm_fib_lookup(struct __ctx_buff *ctx, const struct fluxvm_pkt *pkt,
					     const int v6, const __be32 *src, const __be32 *dst)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	__u32 l3_off = pkt->l3_off;
	struct bpf_fib_lookup *fib;
	void *data, *end;
	int rc;

	if (!s || l3_off > FLUXVM_MAX_L4_OFF)
		return FLUXVM_FIB_MISS;
	fib = &s->fib;
	__builtin_memset(fib, 0, sizeof(*fib));
	data = ctx_data(ctx);
	end = ctx_data_end(ctx);

	/* On the ingress hooks that call this, the device is the one the
	 * packet arrived on. */
	fib->ifindex = ctx_ifindex(ctx);
	if (v6) {
		struct ipv6hdr *ip6 = data + l3_off;

		if ((void *)(ip6 + 1) > end || ip6->hop_limit <= 1)
			return FLUXVM_FIB_MISS;
		fib->family = FLUXVM_AF_INET6_KERNEL;
		fib->tot_len = bpf_ntohs(ip6->payload_len) + sizeof(*ip6);
		if (src)
			__builtin_memcpy(fib->ipv6_src, src, 16);
		else
			__builtin_memcpy(fib->ipv6_src, &ip6->saddr, 16);
		if (dst)
			__builtin_memcpy(fib->ipv6_dst, dst, 16);
		else
			__builtin_memcpy(fib->ipv6_dst, &ip6->daddr, 16);
	} else {
		struct iphdr *iph = data + l3_off;

		if ((void *)(iph + 1) > end || iph->ttl <= 1)
			return FLUXVM_FIB_MISS;
		fib->family = FLUXVM_AF_INET_KERNEL;
		fib->tos = iph->tos;
		fib->tot_len = bpf_ntohs(iph->tot_len);
		fib->ipv4_src = src ? src[0] : iph->saddr;
		fib->ipv4_dst = dst ? dst[0] : iph->daddr;
	}

	rc = bpf_fib_lookup(ctx, fib, sizeof(*fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return FLUXVM_FIB_MISS;
	return rc;
}

/*
 * After a FIB lookup: one less TTL/hop limit and, when the lookup knew the
 * next hop's link-layer address (@rc SUCCESS), the frame's MACs, as the
 * kernel's forwarding path would set them; skb->csum kept true. Returns 0,
 * or -1 before any write when the headers are not where the parser found
 * them (the verifier forgets packet ranges across the lookup).
 */
static __always_inline int fluxvm_fib_rewrite_l2(struct __ctx_buff *ctx,
						 const struct fluxvm_pkt *pkt, const int v6,
						 int rc, __u32 summed)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	__u32 l3_off = pkt->l3_off, moved = 0;
	struct ethhdr *eth;
	void *data, *end;

	if (!s || l3_off > FLUXVM_MAX_L4_OFF)
		return -1;
	data = ctx_data(ctx);
	end = ctx_data_end(ctx);
	eth = data;
	if (v6) {
		struct ipv6hdr *ip6 = data + l3_off;

		if ((void *)(ip6 + 1) > end || (void *)(eth + 1) > end)
			return -1;
		moved = fluxvm_ipv6_dec_hoplimit(ip6);
	} else {
		struct iphdr *iph = data + l3_off;

		if ((void *)(iph + 1) > end || (void *)(eth + 1) > end)
			return -1;
		fluxvm_ipv4_dec_ttl(iph);
	}
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		__builtin_memcpy(eth->h_dest, s->fib.dmac, ETH_ALEN);
		__builtin_memcpy(eth->h_source, s->fib.smac, ETH_ALEN);
	}
	/* Last: the helper call ends what the verifier knows of the packet. */
	if (summed == FLUXVM_CHECKSUM_COMPLETE)
		fluxvm_csum_complete_move(ctx, moved);
	return 0;
}

#ifdef FLUXVM_CTX_SKB
/*
 * TC: forward the packet to @dst (the packet's own destination when NULL)
 * as the host would: the FIB lookup, then a redirect with the neighbour's
 * address, or through the kernel's neighbour resolution when it is not
 * known yet. Returns the TC verdict of the redirect, or FLUXVM_FIB_MISS
 * when the FIB has no forwarding answer (fluxvm_fib_lookup); nothing is
 * written on a miss; once the packet is written, a failure is
 * TC_ACT_SHOT.
 */
static __always_inline int fluxvm_fib_redirect(struct __ctx_buff *ctx,
					       const struct fluxvm_pkt *pkt, const int v6,
					       const __be32 *dst)
{
	/* Read before the lookup: the verifier forgets packet ranges
	 * across calls. */
	__u32 summed = ctx_ip_summed(ctx);
	struct fluxvm_scratch *s;
	int rc = fluxvm_fib_lookup(ctx, pkt, v6, NULL, dst);

	if (rc == FLUXVM_FIB_MISS)
		return FLUXVM_FIB_MISS;
	s = fluxvm_scratch_get();
	if (!s || fluxvm_fib_rewrite_l2(ctx, pkt, v6, rc, summed))
		return FLUXVM_FIB_MISS;
	if (rc == BPF_FIB_LKUP_RET_SUCCESS)
		return bpf_redirect(s->fib.ifindex, 0);
	/* The next hop is known but its link-layer address is not (yet):
	 * let the kernel resolve it and queue the packet meanwhile. The
	 * lookup left the next hop (the gateway, or the destination itself
	 * on a link route) in fib's destination, and its family in
	 * fib->family: an IPv4 route may have an IPv6 gateway (RFC 5549). */
	__builtin_memset(&s->nh, 0, sizeof(s->nh));
	if (s->fib.family == FLUXVM_AF_INET6_KERNEL) {
		s->nh.nh_family = FLUXVM_AF_INET6_KERNEL;
		__builtin_memcpy(s->nh.ipv6_nh, s->fib.ipv6_dst, 16);
	} else {
		s->nh.nh_family = FLUXVM_AF_INET_KERNEL;
		s->nh.ipv4_nh = s->fib.ipv4_dst;
	}
	return bpf_redirect_neigh(s->fib.ifindex, &s->nh, sizeof(s->nh), 0);
}
#endif /* FLUXVM_CTX_SKB */

#endif /* FLUXVM_LIB_FIB_H */
