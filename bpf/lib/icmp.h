/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * ICMP errors about translated flows.
 *
 * A router on the path of a translated flow answers with an ICMP error
 * (destination unreachable, fragmentation needed / packet too big, time
 * exceeded) that quotes the packet as it left us: client -> backend
 * (east-west) or SNAT address -> backend (north-south). The client's stack
 * matches the error to its socket by the quoted packet, so the quote must
 * show the flow as the client sent it (client -> VIP), or path MTU
 * discovery through a VIP never learns the path MTU.
 *
 * Translated, for the reply directions that translate the flow's replies:
 *   - FLUXVM_REPLY_EW (VM-edge egress): the quote's destination
 *     backend:port becomes VIP:vport; the outer header is unchanged;
 *   - FLUXVM_REPLY_SNAT (to the SNAT address): the outer destination
 *     becomes the client, the quote becomes client:cport -> VIP:vport.
 * The quoted flow decides, and must be of the hook's kind: an east-west
 * flow found as its replies find it (rev.h) or by a stored reverse-NAT half,
 * an SNAT flow by its mapping (both in the reply view: backend:port ->
 * quoted source:port). Nothing is learned or refreshed from an ICMP error.
 *
 * Everything else passes untouched: other ICMP types, an outer fragment,
 * a quote that is no IPv4/IPv6 TCP or UDP packet of a tracked flow, a
 * quote that is a fragment, carries IPv6 extension headers or holds fewer
 * than 8 bytes of its L4 header, and a quote whose source is not the
 * error's destination.
 *
 * Checksums are patched by hand as in nat.h: the quote's IPv4 header
 * checksum, its L4 checksum when the quote holds it (the quoted TCP/UDP
 * checksum always is a full one), the ICMP checksum (ICMPv6: with its
 * pseudo-header), the outer IPv4 header checksum, and skb->csum under
 * CHECKSUM_COMPLETE by exactly what the covered bytes moved.
 */
#ifndef FLUXVM_LIB_ICMP_H
#define FLUXVM_LIB_ICMP_H

#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "csum.h"
#include "nat.h"
#include "snat.h"
#include "rev.h"
#include "lb_types.h"

#ifndef IPPROTO_ICMPV6
#define IPPROTO_ICMPV6 58
#endif

#define FLUXVM_ICMP_DEST_UNREACH 3 /* ICMPv4 */
#define FLUXVM_ICMP_TIME_EXCEEDED 11
#define FLUXVM_ICMP6_DEST_UNREACH 1
#define FLUXVM_ICMP6_PKT_TOOBIG 2
#define FLUXVM_ICMP6_TIME_EXCEED 3

/* The ICMP header is at most FLUXVM_MAX_L4_OFF into the frame (the parser's
 * bound), the quoted IP header 8 bytes later, its L4 header at most 60
 * (IPv4 options) or 40 (IPv6) bytes after that. */
#define FLUXVM_ICMP_MAX_INNER_L4 (FLUXVM_MAX_L4_OFF + 8 + 60)

/* The quoted packet of an ICMP error, as the quote stage found it. */
struct fluxvm_icmp_quote {
	__be32 src[4];  /* the quote's source: our side of the flow */
	__be32 dst[4];  /* the quote's destination: the backend */
	__u32 ip_off;   /* the quoted IP header */
	__u32 l4_off;   /* the quoted L4 header */
	__be16 sport;
	__be16 dport;
	__u8 proto;     /* IPPROTO_TCP or IPPROTO_UDP */
};

/* What the flow stage says the quote becomes: client:cport -> VIP:vport
 * (east-west: the client is the quote's own source and stays). */
struct fluxvm_icmp_xlate {
	__be32 client[4];
	__be32 vip[4];
	__be16 cport;
	__be16 vport;
};

/* The stages' state, in a per-CPU scratch slot rather than on the stack:
 * the ICMP paths are global functions called from every program, and
 * their frames count toward each program's 512 bytes. A program runs to
 * completion on its CPU, so one slot per CPU is enough. */
struct fluxvm_icmp_state {
	struct fluxvm_icmp_quote q;
	struct fluxvm_icmp_xlate x;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_icmp_state);
	__uint(max_entries, 1);
} fluxvm_icmp_scratch SEC(".maps");

/*
 * The quote stage: is @pkt an ICMP error (of a type we translate) quoting a
 * whole TCP or UDP packet, no fragment, sent by the error's destination?
 * Fills @q; returns 0, or -1 to leave the packet untouched.
 */
static __always_inline int fluxvm_icmp_quote(struct __ctx_buff *ctx, const struct fluxvm_pkt *pkt,
					     const int v6, struct fluxvm_icmp_quote *q)
{
	__u32 off = pkt->l4_off, l3_end = pkt->l3_end;
	__u8 *h;

	if (pkt->frag != FLUXVM_FRAG_NONE)
		return -1;
	if (pkt->l4_proto != (v6 ? IPPROTO_ICMPV6 : IPPROTO_ICMP))
		return -1;
	if (off > FLUXVM_MAX_L4_OFF || pkt->l3_off > FLUXVM_MAX_L4_OFF)
		return -1;

	/* The ICMP header: an error type. */
	if (off + 8 > l3_end)
		return -1;
	h = fluxvm_hdr(ctx, off, 8);
	if (!h)
		return -1;
	if (v6) {
		if (h[0] != FLUXVM_ICMP6_DEST_UNREACH && h[0] != FLUXVM_ICMP6_PKT_TOOBIG &&
		    h[0] != FLUXVM_ICMP6_TIME_EXCEED)
			return -1;
	} else if (h[0] != FLUXVM_ICMP_DEST_UNREACH && h[0] != FLUXVM_ICMP_TIME_EXCEEDED) {
		return -1;
	}

	/* The quoted IP header: a whole TCP or UDP packet, no fragment. */
	q->ip_off = off + 8;
	if (v6) {
		struct ipv6hdr *ip6;

		if (q->ip_off + sizeof(*ip6) > l3_end)
			return -1;
		ip6 = fluxvm_hdr(ctx, q->ip_off, sizeof(*ip6));
		if (!ip6 || ip6->version != 6)
			return -1;
		q->proto = ip6->nexthdr;
		__builtin_memcpy(q->src, &ip6->saddr, 16);
		__builtin_memcpy(q->dst, &ip6->daddr, 16);
		q->l4_off = q->ip_off + sizeof(*ip6);
	} else {
		struct iphdr *iph;

		if (q->ip_off + sizeof(*iph) > l3_end)
			return -1;
		iph = fluxvm_hdr(ctx, q->ip_off, sizeof(*iph));
		if (!iph || iph->version != 4 || iph->ihl < 5)
			return -1;
		if (iph->frag_off & bpf_htons(0x3fff))
			return -1;
		q->proto = iph->protocol;
		q->src[0] = iph->saddr;
		q->dst[0] = iph->daddr;
		q->l4_off = q->ip_off + iph->ihl * 4;
	}
	if (q->proto != IPPROTO_TCP && q->proto != IPPROTO_UDP)
		return -1;
	/* The quote's source sent the packet; the error is addressed to it. */
	if (v6 ? (q->src[0] != pkt->daddr[0] || q->src[1] != pkt->daddr[1] ||
		  q->src[2] != pkt->daddr[2] || q->src[3] != pkt->daddr[3])
	       : q->src[0] != pkt->daddr[0])
		return -1;
	if (q->l4_off > FLUXVM_ICMP_MAX_INNER_L4 || q->l4_off + 8 > l3_end)
		return -1;
	h = fluxvm_hdr(ctx, q->l4_off, 8);
	if (!h)
		return -1;
	q->sport = *(__be16 *)h;
	q->dport = *(__be16 *)(h + 2);
	return 0;
}

/*
 * The flow stage: the quoted flow, of the hook's kind. An east-west flow is
 * found as its replies find it (rev.h: the quote's destination is the
 * backend, its source the client), or by its stored reverse-NAT half; an
 * SNAT flow by its mapping, in the reply view (backend:port -> SNAT
 * address:port). Fills @x; returns 0, or -1 when the quote is of no flow
 * we translate.
 */
static __always_inline int fluxvm_icmp_flow(const struct fluxvm_icmp_quote *q, const int v6,
					    const int snat, struct fluxvm_icmp_xlate *x)
{
	struct fluxvm_tuple4 k4 = {};
	struct fluxvm_tuple6 k6 = {};
	struct fluxvm_nat_value *nat;

	if (!snat) {
		struct fluxvm_rev r = {};
		__u64 now = 0;

		if (fluxvm_rev_find(q->dst, q->dport, q->src, q->sport, q->proto, v6, 0,
				    &now, &k4, &k6, &r)) {
			__builtin_memcpy(x->vip, r.vip, 16);
			x->vport = r.vport;
			x->cport = q->sport;
			return 0;
		}
		__builtin_memset(&k4, 0, sizeof(k4));
		__builtin_memset(&k6, 0, sizeof(k6));
	}
	if (v6) {
		__builtin_memcpy(k6.saddr, q->dst, 16);
		__builtin_memcpy(k6.daddr, q->src, 16);
		k6.sport = q->dport;
		k6.dport = q->sport;
		k6.proto = q->proto;
		nat = bpf_map_lookup_elem(&fluxvm_nat6, &k6);
	} else {
		k4.saddr = q->dst[0];
		k4.daddr = q->src[0];
		k4.sport = q->dport;
		k4.dport = q->sport;
		k4.proto = q->proto;
		nat = bpf_map_lookup_elem(&fluxvm_nat4, &k4);
	}
	if (!nat || !(nat->flags & FLUXVM_NAT_F_SNAT) != !snat)
		return -1;
	__builtin_memcpy(x->vip, nat->vip, 16);
	x->vport = nat->vport;
	if (snat) {
		__builtin_memcpy(x->client, nat->client, 16);
		x->cport = nat->cport;
	} else {
		x->cport = q->sport;
	}
	return 0;
}

/*
 * The rewrite stage: the quote becomes @x's view of the flow (and, for
 * SNAT, the outer destination its client), every checksum patched. It
 * fails (-1, nothing written) only before its first write.
 */
static __always_inline int fluxvm_icmp_rewrite(struct __ctx_buff *ctx,
					       const struct fluxvm_pkt *pkt, const int v6,
					       const int snat, const struct fluxvm_icmp_quote *q,
					       const struct fluxvm_icmp_xlate *x)
{
	__u32 l3_off = pkt->l3_off, off = pkt->l4_off, l3_end = pkt->l3_end;
	__u32 il4 = q->l4_off, csum_off, need, summed;
	__u32 sdiff = 0, ddiff, odiff = 0, d, moved;
	__u16 old_icsum = 0, new_icsum = 0, old_l4 = 0, new_l4 = 0, old_ic, new_ic;
	__u16 old_oc = 0, new_oc = 0;
	int udp = q->proto == IPPROTO_UDP, has_l4csum;
	const __u32 iph_len = v6 ? sizeof(struct ipv6hdr) : sizeof(struct iphdr);
	__sum16 *qcsum, *icsum;
	__be16 *qports;
	void *data, *end, *oip, *qip;

	/* Offsets bounded again for the verifier, which needs a packet
	 * pointer's offset well below 64 KiB to accept a range check on it:
	 * the earlier stages' checks were made on copies it no longer links
	 * to these. */
	if (l3_off > FLUXVM_MAX_L4_OFF || off > FLUXVM_MAX_L4_OFF ||
	    il4 > FLUXVM_ICMP_MAX_INNER_L4)
		return -1;
	/* Everything written below lies in the linear area. */
	csum_off = il4 + (udp ? 6 : 16);
	has_l4csum = csum_off + 2 <= l3_end;
	need = has_l4csum ? csum_off + 2 : il4 + 8;
	if (!fluxvm_hdr(ctx, 0, need))
		return -1;
	summed = ctx_ip_summed(ctx);
	/*
	 * The point of no return. Every pointer written through is derived
	 * and checked here, after the last call (the verifier forgets packet
	 * ranges across calls): from the first write on nothing can fail,
	 * so a packet is never passed on half translated.
	 */
	data = ctx_data(ctx);
	end = ctx_data_end(ctx);
	oip = data + l3_off;
	qip = data + off + 8; /* q->ip_off: after the 8-byte ICMP header */
	qports = data + il4;
	icsum = data + off + 2;
	/* Without a quoted L4 checksum, a pointer never written through but
	 * checked like the others: the verifier does not connect a later
	 * test of has_l4csum with one made here. */
	qcsum = data + (has_l4csum ? csum_off : off + 2);
	if (oip + iph_len > end || qip + iph_len > end || (void *)(qports + 2) > end ||
	    (void *)(icsum + 1) > end || (void *)(qcsum + 1) > end)
		return -1;

	/* The quote: addresses (and the IPv4 header checksum), ports. d sums
	 * every change of a 16-bit word the ICMP checksum covers. */
	if (v6) {
		struct ipv6hdr *ip6 = qip;

		ddiff = fluxvm_csum_diff16(q->dst, x->vip);
		if (snat)
			sdiff = fluxvm_csum_diff16(q->src, x->client);
		__builtin_memcpy(&ip6->daddr, x->vip, 16);
		if (snat)
			__builtin_memcpy(&ip6->saddr, x->client, 16);
		d = fluxvm_csum_add(ddiff, sdiff);
	} else {
		struct iphdr *iph = qip;

		ddiff = fluxvm_csum_diff4(q->dst[0], x->vip[0]);
		if (snat)
			sdiff = fluxvm_csum_diff4(q->src[0], x->client[0]);
		d = fluxvm_csum_add(ddiff, sdiff);
		old_icsum = iph->check;
		new_icsum = fluxvm_csum_fold(fluxvm_csum_add(d, (__u16)~old_icsum));
		iph->check = new_icsum;
		iph->daddr = x->vip[0];
		if (snat)
			iph->saddr = x->client[0];
		d = fluxvm_csum_add(d, fluxvm_csum_diff2(old_icsum, new_icsum));
	}
	qports[1] = x->vport;
	if (snat)
		qports[0] = x->cport;
	d = fluxvm_csum_add(d, fluxvm_csum_diff2(q->dport, x->vport));
	if (snat)
		d = fluxvm_csum_add(d, fluxvm_csum_diff2(q->sport, x->cport));

	/* The quoted L4 checksum, when the quote holds it: pseudo-header
	 * addresses and ports. An IPv4 UDP checksum of zero stays so. */
	if (has_l4csum) {
		old_l4 = *qcsum;
		if (!(udp && !v6 && old_l4 == 0)) {
			__u32 l = fluxvm_csum_add(fluxvm_csum_add(ddiff, sdiff),
						  fluxvm_csum_diff2(q->dport, x->vport));

			if (snat)
				l = fluxvm_csum_add(l, fluxvm_csum_diff2(q->sport, x->cport));
			new_l4 = fluxvm_csum_fold(fluxvm_csum_add(l, (__u16)~old_l4));
			if (udp && new_l4 == 0)
				new_l4 = 0xffff;
			*qcsum = new_l4;
			d = fluxvm_csum_add(d, fluxvm_csum_diff2(old_l4, new_l4));
		}
	}

	/* The outer destination (SNAT only): IPv4 header checksum; for
	 * ICMPv6 the pseudo-header enters the ICMP checksum. */
	if (snat) {
		if (v6) {
			struct ipv6hdr *ip6 = oip;

			odiff = fluxvm_csum_diff16(pkt->daddr, x->client);
			__builtin_memcpy(&ip6->daddr, x->client, 16);
		} else {
			struct iphdr *iph = oip;

			odiff = fluxvm_csum_diff4(pkt->daddr[0], x->client[0]);
			old_oc = iph->check;
			new_oc = fluxvm_csum_fold(fluxvm_csum_add(odiff, (__u16)~old_oc));
			iph->check = new_oc;
			iph->daddr = x->client[0];
		}
	}

	/* The ICMP checksum. */
	old_ic = *icsum;
	new_ic = fluxvm_csum_fold(fluxvm_csum_add(v6 ? fluxvm_csum_add(d, odiff) : d,
						  (__u16)~old_ic));
	*icsum = new_ic;

	if (summed == FLUXVM_CHECKSUM_COMPLETE) {
		/* skb->csum covers everything from the IP header on. */
		moved = fluxvm_csum_add(d, fluxvm_csum_diff2(old_ic, new_ic));
		moved = fluxvm_csum_add(moved, odiff);
		if (snat && !v6)
			moved = fluxvm_csum_add(moved, fluxvm_csum_diff2(old_oc, new_oc));
		fluxvm_csum_complete_move(ctx, moved);
	}
	return 0;
}

/*
 * Translate the ICMP error @pkt (parsed, its l4_proto ICMP/ICMPv6) for
 * reply direction @kind, in three stages: the quote, its flow, the rewrite.
 * Returns TC_ACT_OK when translated, else CTX_ACT_NEXT with the packet
 * untouched.
 */
static __always_inline int fluxvm_icmp_error(struct __ctx_buff *ctx,
					     const struct fluxvm_pkt *pkt, const int v6,
					     const int kind)
{
	const int snat = kind == FLUXVM_REPLY_SNAT;
	struct fluxvm_icmp_state *s;
	__u32 zero = 0;

	if (snat && !fluxvm_is_snat_addr(pkt->daddr, v6))
		return CTX_ACT_NEXT;
	s = bpf_map_lookup_elem(&fluxvm_icmp_scratch, &zero);
	if (!s)
		return CTX_ACT_NEXT;
	__builtin_memset(s, 0, sizeof(*s));
	if (fluxvm_icmp_quote(ctx, pkt, v6, &s->q) || fluxvm_icmp_flow(&s->q, v6, snat, &s->x) ||
	    fluxvm_icmp_rewrite(ctx, pkt, v6, snat, &s->q, &s->x))
		return CTX_ACT_NEXT;
	fluxvm_count(FLUXVM_CNT_ICMP_ERRORS_TRANSLATED);
	return TC_ACT_OK;
}

#endif /* FLUXVM_LIB_ICMP_H */
