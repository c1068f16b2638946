/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Packet rewriting (DNAT toward a backend, the reverse toward the client)
 * and the reverse-NAT entries that remember how to undo it.
 *
 * Addresses and ports are written directly; checksums are patched
 * incrementally. The IPv4 header checksum is patched by hand (it has no
 * offload state), while the L4 checksum goes through bpf_l4_csum_replace,
 * which knows about CHECKSUM_PARTIAL and CHECKSUM_COMPLETE skbs: with
 * BPF_F_PSEUDO_HDR it patches only what the pseudo-header contributes, and
 * with BPF_F_MARK_MANGLED_0 an IPv4 UDP checksum of zero ("none") stays zero
 * while a computed zero becomes 0xffff.
 */
#ifndef FLUXVM_LIB_NAT_H
#define FLUXVM_LIB_NAT_H

#include "maps.h"
#include "parse.h"

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

static __always_inline __u16 fluxvm_csum_fold(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)~s;
}

/*
 * Replace the destination (@dst != 0) or source address and port of the
 * parsed packet with @addr/@port. Returns 0, or -1 when the packet could
 * not be rewritten. Invalidates packet pointers.
 */
static __always_inline int fluxvm_rewrite(struct __sk_buff *skb,
					  const struct fluxvm_pkt *pkt, const int v6,
					  const int dst, const __be32 *addr, __be16 port)
{
	const __be32 *old = dst ? pkt->daddr : pkt->saddr;
	__be16 old_port = dst ? pkt->dport : pkt->sport;
	__u64 mangled0 = pkt->l4_proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
	__u32 l4_off = pkt->l4_off;
	__u32 csum_off, diff;
	void *data, *end;
	__be16 *p;

	if (l4_off > FLUXVM_MAX_L4_OFF)
		return -1;
	csum_off = l4_off + (pkt->l4_proto == IPPROTO_TCP ? 16 : 6);
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;

	if (v6) {
		struct ipv6hdr *ip6 = data + ETH_HLEN;

		if ((void *)(ip6 + 1) > end)
			return -1;
		diff = fluxvm_csum_diff16(old, addr);
		if (dst)
			__builtin_memcpy(&ip6->daddr, addr, 16);
		else
			__builtin_memcpy(&ip6->saddr, addr, 16);
	} else {
		struct iphdr *iph = data + ETH_HLEN;

		if ((void *)(iph + 1) > end)
			return -1;
		diff = fluxvm_csum_add(~old[0], addr[0]);
		iph->check = fluxvm_csum_fold(fluxvm_csum_add(diff, (__u16)~iph->check));
		if (dst)
			iph->daddr = addr[0];
		else
			iph->saddr = addr[0];
	}

	p = data + l4_off + (dst ? 2 : 0);
	if ((void *)(p + 1) > end)
		return -1;
	*p = port;

	if (bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR | mangled0))
		return -1;
	if (old_port != port &&
	    bpf_l4_csum_replace(skb, csum_off, old_port, port, mangled0 | sizeof(port)))
		return -1;
	return 0;
}

/*
 * Remember how to translate replies of a flow from backend @be back to the
 * VIP the client used. The key is the reply as it leaves the backend.
 */
static __always_inline int fluxvm_nat_learn(const struct fluxvm_pkt *pkt, const int v6,
					    const struct fluxvm_backend *be,
					    __u32 sid, __u32 bid, __u64 now)
{
	struct fluxvm_nat_value nv = {
		.vport = pkt->dport,
		.service_id = sid,
		.backend_id = bid,
		.last_seen_ns = now,
	};

	if (v6) {
		struct fluxvm_tuple6 k = {
			.sport = be->port,
			.dport = pkt->sport,
			.proto = pkt->l4_proto,
		};

		__builtin_memcpy(k.saddr, be->addr, 16);
		__builtin_memcpy(k.daddr, pkt->saddr, 16);
		__builtin_memcpy(nv.vip, pkt->daddr, 16);
		return bpf_map_update_elem(&fluxvm_nat6, &k, &nv, BPF_ANY);
	}
	struct fluxvm_tuple4 k = {
		.saddr = be->addr[0],
		.daddr = pkt->saddr[0],
		.sport = be->port,
		.dport = pkt->sport,
		.proto = pkt->l4_proto,
	};

	nv.vip[0] = pkt->daddr[0];
	return bpf_map_update_elem(&fluxvm_nat4, &k, &nv, BPF_ANY);
}

/*
 * Recreate the reverse-NAT half of a flow if the LRU evicted it, so that a
 * conntrack entry never lives without it. Called on conntrack refresh only,
 * which bounds the cost to one lookup per flow per refresh interval.
 */
static __always_inline int fluxvm_nat_ensure(const struct fluxvm_pkt *pkt, const int v6,
					     const struct fluxvm_backend *be,
					     __u32 sid, __u32 bid, __u64 now)
{
	void *nv;

	if (v6) {
		struct fluxvm_tuple6 k = {
			.sport = be->port,
			.dport = pkt->sport,
			.proto = pkt->l4_proto,
		};

		__builtin_memcpy(k.saddr, be->addr, 16);
		__builtin_memcpy(k.daddr, pkt->saddr, 16);
		nv = bpf_map_lookup_elem(&fluxvm_nat6, &k);
	} else {
		struct fluxvm_tuple4 k = {
			.saddr = be->addr[0],
			.daddr = pkt->saddr[0],
			.sport = be->port,
			.dport = pkt->sport,
			.proto = pkt->l4_proto,
		};

		nv = bpf_map_lookup_elem(&fluxvm_nat4, &k);
	}
	if (nv)
		return 0;
	return fluxvm_nat_learn(pkt, v6, be, sid, bid, now);
}

#endif /* FLUXVM_LIB_NAT_H */
