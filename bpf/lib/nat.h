/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Packet rewriting (DNAT toward a backend, the reverse toward the client)
 * and the reverse-NAT entries that remember how to undo it.
 *
 * Addresses and ports are written directly and checksums are patched
 * incrementally (RFC 1624), honouring the skb's checksum offload state the
 * same way the kernel's csum helpers do.
 */
#ifndef FLUXVM_LIB_NAT_H
#define FLUXVM_LIB_NAT_H

#include "maps.h"
#include "parse.h"
#include "csum.h"

/*
 * Patch the L4 checksum at @csum in place for an address change of @adiff
 * (pseudo-header) and a port change @old_port -> @port, exactly as
 * bpf_l4_csum_replace would for CHECKSUM_NONE/UNNECESSARY/COMPLETE (a full
 * sum is stored) and CHECKSUM_PARTIAL (the field holds only the
 * pseudo-header sum that the device completes, so ports do not enter it).
 */
static __always_inline void fluxvm_l4_csum_patch(__sum16 *csum, __u32 summed, int udp,
						 const int v6, __u32 adiff, __be16 old_port,
						 __be16 port)
{
	__u16 old = *csum, new;

	/* An IPv4 UDP checksum of zero means "none" and stays so. IPv6 has
	 * no such value (RFC 8200 8.1, the checksum is mandatory): a zero
	 * there is wrong like any other wrong value and is patched as one,
	 * so the receiver sees the same error it would have seen. */
	if (udp && !v6 && old == 0)
		return;
	if (summed == FLUXVM_CHECKSUM_PARTIAL) {
		new = (__u16)~fluxvm_csum_fold(fluxvm_csum_add(adiff, old));
	} else {
		__u32 d = fluxvm_csum_add(adiff, ~(__u32)old_port);

		d = fluxvm_csum_add(d, port);
		new = fluxvm_csum_fold(fluxvm_csum_add(d, ~(__u32)old));
	}
	/* A computed zero is sent as 0xffff so it is not read as "none". */
	if (udp && new == 0)
		new = 0xffff;
	*csum = new;
}

/*
 * Replace the destination (@dst != 0) or source address and port of the
 * parsed packet with @addr/@port. Returns 0, or -1 when the packet could
 * not be rewritten.
 *
 * Everything is written through direct packet access and patched by hand;
 * only CHECKSUM_COMPLETE packets whose skb->csum must move (IPv4) pay for a
 * helper, bpf_csum_update. A helper call costs tens of nanoseconds, a large
 * share of a conntrack-hit packet.
 */
static __always_inline int fluxvm_rewrite(struct __ctx_buff *ctx,
					  const struct fluxvm_pkt *pkt, const int v6,
					  const int dst, const __be32 *addr, __be16 port)
{
	const __be32 *old = dst ? pkt->daddr : pkt->saddr;
	__be16 old_port = dst ? pkt->dport : pkt->sport;
	int udp = pkt->l4_proto == IPPROTO_UDP;
	__u32 summed = ctx_ip_summed(ctx);
	__u32 l3_off = pkt->l3_off, l4_off = pkt->l4_off;
	__u32 csum_off, diff, moved;
	void *data, *end;
	__sum16 *c;
	__u16 before;
	__be16 *p;

	/* The IP header precedes the L4 header, within the parser's bound;
	 * the bound also tells the verifier the offsets are small. */
	if (l3_off > FLUXVM_MAX_L4_OFF || l4_off > FLUXVM_MAX_L4_OFF)
		return -1;
	csum_off = l4_off + (udp ? 6 : 16);
	data = ctx_data(ctx);
	end = ctx_data_end(ctx);
	/* Every bound is checked before the first write: a packet is never
	 * left half rewritten. */
	p = data + l4_off + (dst ? 2 : 0);
	c = data + csum_off;
	if ((void *)(p + 1) > end || (void *)(c + 1) > end)
		return -1;

	if (v6) {
		struct ipv6hdr *ip6 = data + l3_off;

		if ((void *)(ip6 + 1) > end)
			return -1;
		diff = fluxvm_csum_diff16(old, addr);
		if (dst)
			__builtin_memcpy(&ip6->daddr, addr, 16);
		else
			__builtin_memcpy(&ip6->saddr, addr, 16);
	} else {
		struct iphdr *iph = data + l3_off;

		if ((void *)(iph + 1) > end)
			return -1;
		diff = fluxvm_csum_add(~old[0], addr[0]);
		iph->check = fluxvm_csum_fold(fluxvm_csum_add(diff, (__u16)~iph->check));
		if (dst)
			iph->daddr = addr[0];
		else
			iph->saddr = addr[0];
	}
	*p = port;
	before = *c;
	fluxvm_l4_csum_patch(c, summed, udp, v6, diff, old_port, port);
	if (summed != FLUXVM_CHECKSUM_COMPLETE)
		return 0;

	/*
	 * CHECKSUM_COMPLETE: skb->csum sums the bytes from the IP header on,
	 * so it moves by what those bytes moved by: the port, the L4
	 * checksum field and, for IPv6, the address (an IPv4 address change
	 * is absorbed by the header checksum). That is minus the address
	 * change for IPv4 (what bpf_l4_csum_replace with BPF_F_PSEUDO_HDR
	 * applies) and nothing for IPv6, where that helper is wrong without
	 * BPF_F_IPV6 (Linux 6.16+) -- and the port alone for an IPv4 UDP
	 * checksum of zero, which the helper leaves out.
	 */
	moved = fluxvm_csum_add(~(__u32)old_port, port);
	moved = fluxvm_csum_add(moved, ~(__u32)before);
	moved = fluxvm_csum_add(moved, *c);
	if (v6)
		moved = fluxvm_csum_add(moved, diff);
	fluxvm_csum_complete_move(ctx, moved);
	return 0;
}

/*
 * The reverse-NAT key of a flow: the reply as it leaves backend @be for the
 * client that sent @pkt.
 */
static __always_inline void fluxvm_nat_key(const struct fluxvm_pkt *pkt, const int v6,
					   const struct fluxvm_backend *be,
					   struct fluxvm_tuple4 *k4,
					   struct fluxvm_tuple6 *k6)
{
	if (v6) {
		__builtin_memcpy(k6->saddr, be->addr, 16);
		__builtin_memcpy(k6->daddr, pkt->saddr, 16);
		k6->sport = be->port;
		k6->dport = pkt->sport;
		k6->proto = pkt->l4_proto;
	} else {
		k4->saddr = be->addr[0];
		k4->daddr = pkt->saddr[0];
		k4->sport = be->port;
		k4->dport = pkt->sport;
		k4->proto = pkt->l4_proto;
	}
}

/* Remember how to translate replies of a flow from backend @be back to the
 * VIP the client used. The key and value are built in per-CPU scratch
 * (maps.h): this runs for new flows and refreshes only, and its ~100 bytes
 * would otherwise sit in the frame of the conntrack-hit path that inlines
 * it, twice (here and in fluxvm_nat_ensure). */
static __always_inline int fluxvm_nat_learn(const struct fluxvm_pkt *pkt, const int v6,
					    const struct fluxvm_backend *be,
					    __u32 sid, __u32 bid, __u64 now, __u8 flags, __u32 flow)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	struct fluxvm_nat_value *nv;

	if (!s)
		return -1;
	nv = &s->nv;
	/* Keys are hashed with their padding: zero it. */
	__builtin_memset(&s->k4, 0, sizeof(s->k4));
	__builtin_memset(&s->k6, 0, sizeof(s->k6));
	__builtin_memset(nv, 0, sizeof(*nv));
	nv->vport = pkt->dport;
	nv->flags = flags;
	nv->service_id = sid;
	nv->backend_id = bid;
	nv->flow = flow;
	nv->last_seen_ns = now;
	fluxvm_nat_key(pkt, v6, be, &s->k4, &s->k6);
	if (v6) {
		__builtin_memcpy(nv->vip, pkt->daddr, 16);
		return bpf_map_update_elem(&fluxvm_nat6, &s->k6, nv, BPF_ANY);
	}
	nv->vip[0] = pkt->daddr[0];
	return bpf_map_update_elem(&fluxvm_nat4, &s->k4, nv, BPF_ANY);
}

/* Remove the reverse-NAT half of the flow of @pkt on backend @be. The key
 * is built in per-CPU scratch, as in fluxvm_nat_learn. */
static __always_inline void fluxvm_nat_forget(const struct fluxvm_pkt *pkt, const int v6,
					      const struct fluxvm_backend *be)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();

	if (!s)
		return;
	__builtin_memset(&s->k4, 0, sizeof(s->k4));
	__builtin_memset(&s->k6, 0, sizeof(s->k6));
	fluxvm_nat_key(pkt, v6, be, &s->k4, &s->k6);
	if (v6)
		bpf_map_delete_elem(&fluxvm_nat6, &s->k6);
	else
		bpf_map_delete_elem(&fluxvm_nat4, &s->k4);
}

/*
 * Recreate the reverse-NAT half of a flow if the LRU evicted it, so that a
 * conntrack entry never lives without it. Called on conntrack refresh only,
 * which bounds the cost to one lookup per flow per refresh interval. The
 * key is built in per-CPU scratch, as in fluxvm_nat_learn.
 */
static __always_inline int fluxvm_nat_ensure(const struct fluxvm_pkt *pkt, const int v6,
					     const struct fluxvm_backend *be,
					     __u32 sid, __u32 bid, __u64 now, __u8 flags, __u32 flow)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	void *nv;

	if (!s)
		return -1;
	__builtin_memset(&s->k4, 0, sizeof(s->k4));
	__builtin_memset(&s->k6, 0, sizeof(s->k6));
	fluxvm_nat_key(pkt, v6, be, &s->k4, &s->k6);
	nv = v6 ? bpf_map_lookup_elem(&fluxvm_nat6, &s->k6)
		: bpf_map_lookup_elem(&fluxvm_nat4, &s->k4);
	if (nv)
		return 0;
	return fluxvm_nat_learn(pkt, v6, be, sid, bid, now, flags, flow);
}

#endif /* FLUXVM_LIB_NAT_H */
