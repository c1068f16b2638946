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
 * Forward the packet to @dst (the packet's own destination when NULL) as
 * the host would: FIB lookup from the interface the packet came in on, then
 * a redirect with the neighbour's address, or through the kernel's
 * neighbour resolution when it is not known yet. Returns the TC verdict of
 * the redirect, or FLUXVM_FIB_MISS when the FIB has no forwarding answer
 * (local destination, no route, forwarding disabled, MTU exceeded, or TTL
 * about to expire: the host stack handles all of these properly, with
 * ICMP errors where due). Nothing is written on a miss; once the packet is
 * written, a failure is TC_ACT_SHOT.
 */
static __always_inline int fluxvm_fib_redirect(struct __ctx_buff *ctx,
					       const struct fluxvm_pkt *pkt, const int v6,
					       const __be32 *dst)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	__u32 l3_off = pkt->l3_off, moved = 0;
	/* Read before the lookup: the verifier forgets packet ranges
	 * across calls. */
	__u32 summed = ctx_ip_summed(ctx);
	struct bpf_fib_lookup *fib;
	struct ethhdr *eth;
	void *data, *end;
	int rc;

	/* The lookup and the neighbour live in per-CPU scratch (maps.h):
	 * routing is a rare path and they would take ~90 bytes of every
	 * frame that inlines it. */
	if (!s || l3_off > FLUXVM_MAX_L4_OFF)
		return FLUXVM_FIB_MISS;
	fib = &s->fib;
	__builtin_memset(fib, 0, sizeof(*fib));
	__builtin_memset(&s->nh, 0, sizeof(s->nh));
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
		fib->ipv4_src = iph->saddr;
		fib->ipv4_dst = dst ? dst[0] : iph->daddr;
	}

	rc = bpf_fib_lookup(ctx, fib, sizeof(*fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return FLUXVM_FIB_MISS;

	/* The helper does not move the packet, but re-derive the pointers
	 * the verifier wants checked again after a call. */
	data = ctx_data(ctx);
	end = ctx_data_end(ctx);
	eth = data;
	if (v6) {
		struct ipv6hdr *ip6 = data + l3_off;

		if ((void *)(ip6 + 1) > end || (void *)(eth + 1) > end)
			return FLUXVM_FIB_MISS;
		moved = fluxvm_ipv6_dec_hoplimit(ip6);
	} else {
		struct iphdr *iph = data + l3_off;

		if ((void *)(iph + 1) > end || (void *)(eth + 1) > end)
			return FLUXVM_FIB_MISS;
		fluxvm_ipv4_dec_ttl(iph);
	}

	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		__builtin_memcpy(eth->h_dest, fib->dmac, ETH_ALEN);
		__builtin_memcpy(eth->h_source, fib->smac, ETH_ALEN);
	}
	/* Last: the helper call ends what the verifier knows of the packet. */
	if (summed == FLUXVM_CHECKSUM_COMPLETE)
		fluxvm_csum_complete_move(ctx, moved);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS)
		return bpf_redirect(fib->ifindex, 0);
	/* The next hop is known but its link-layer address is not (yet):
	 * let the kernel resolve it and queue the packet meanwhile. The
	 * lookup left the next hop (the gateway, or the destination itself
	 * on a link route) in fib's destination, and its family in
	 * fib->family: an IPv4 route may have an IPv6 gateway (RFC 5549). */
	if (fib->family == FLUXVM_AF_INET6_KERNEL) {
		s->nh.nh_family = FLUXVM_AF_INET6_KERNEL;
		__builtin_memcpy(s->nh.ipv6_nh, fib->ipv6_dst, 16);
	} else {
		s->nh.nh_family = FLUXVM_AF_INET_KERNEL;
		s->nh.ipv4_nh = fib->ipv4_dst;
	}
	return bpf_redirect_neigh(fib->ifindex, &s->nh, sizeof(s->nh), 0);
}

#endif /* FLUXVM_LIB_FIB_H */
