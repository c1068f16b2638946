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
 * The quoted packet's reverse-NAT entry (the reply view: backend:port ->
 * quoted source:port) decides, and must be of the hook's kind. Nothing is
 * learned or refreshed from an ICMP error.
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

/*
 * Translate the ICMP error @pkt (parsed, its l4_proto ICMP/ICMPv6) for
 * reply direction @kind. Returns TC_ACT_OK when translated, else
 * FLUXVM_TC_NEXT with the packet untouched.
 */
static __always_inline int fluxvm_icmp_error(struct __ctx_buff *ctx,
					     const struct fluxvm_pkt *pkt, const int v6,
					     const int kind)
{
	struct fluxvm_tuple4 k4 = {};
	struct fluxvm_tuple6 k6 = {};
	struct fluxvm_nat_value *nat;
	__be32 isrc[4] = {}, idst[4] = {}, client[4] = {}, vip[4] = {};
	__be16 isport, idport, cport, vport;
	__u32 l3_off = pkt->l3_off, off = pkt->l4_off, l3_end = pkt->l3_end;
	__u32 in_off, il4, csum_off, need, summed;
	__u32 sdiff = 0, ddiff, odiff = 0, d, moved;
	__u16 old_icsum = 0, new_icsum = 0, old_l4 = 0, new_l4 = 0, old_ic, new_ic;
	__u16 old_oc = 0, new_oc = 0;
	int snat = kind == FLUXVM_REPLY_SNAT, has_l4csum, udp;
	const __u32 iph_len = v6 ? sizeof(struct ipv6hdr) : sizeof(struct iphdr);
	__sum16 *qcsum, *icsum;
	__be16 *qports;
	__u8 iproto, *h;
	void *data, *end, *oip, *qip;

	if (pkt->frag != FLUXVM_FRAG_NONE)
		return FLUXVM_TC_NEXT;
	if (pkt->l4_proto != (v6 ? IPPROTO_ICMPV6 : IPPROTO_ICMP))
		return FLUXVM_TC_NEXT;
	if (off > FLUXVM_MAX_L4_OFF || l3_off > FLUXVM_MAX_L4_OFF)
		return FLUXVM_TC_NEXT;
	if (snat && !fluxvm_is_snat_addr(pkt->daddr, v6))
		return FLUXVM_TC_NEXT;

	/* The ICMP header: an error type. */
	if (off + 8 > l3_end)
		return FLUXVM_TC_NEXT;
	h = fluxvm_hdr(ctx, off, 8);
	if (!h)
		return FLUXVM_TC_NEXT;
	if (v6) {
		if (h[0] != FLUXVM_ICMP6_DEST_UNREACH && h[0] != FLUXVM_ICMP6_PKT_TOOBIG &&
		    h[0] != FLUXVM_ICMP6_TIME_EXCEED)
			return FLUXVM_TC_NEXT;
	} else if (h[0] != FLUXVM_ICMP_DEST_UNREACH && h[0] != FLUXVM_ICMP_TIME_EXCEEDED) {
		return FLUXVM_TC_NEXT;
	}

	/* The quoted IP header: a whole TCP or UDP packet, no fragment. */
	in_off = off + 8;
	if (v6) {
		struct ipv6hdr *ip6;

		if (in_off + sizeof(*ip6) > l3_end)
			return FLUXVM_TC_NEXT;
		ip6 = fluxvm_hdr(ctx, in_off, sizeof(*ip6));
		if (!ip6 || ip6->version != 6)
			return FLUXVM_TC_NEXT;
		iproto = ip6->nexthdr;
		__builtin_memcpy(isrc, &ip6->saddr, 16);
		__builtin_memcpy(idst, &ip6->daddr, 16);
		il4 = in_off + sizeof(*ip6);
	} else {
		struct iphdr *iph;

		if (in_off + sizeof(*iph) > l3_end)
			return FLUXVM_TC_NEXT;
		iph = fluxvm_hdr(ctx, in_off, sizeof(*iph));
		if (!iph || iph->version != 4 || iph->ihl < 5)
			return FLUXVM_TC_NEXT;
		if (iph->frag_off & bpf_htons(0x3fff))
			return FLUXVM_TC_NEXT;
		iproto = iph->protocol;
		isrc[0] = iph->saddr;
		idst[0] = iph->daddr;
		il4 = in_off + iph->ihl * 4;
	}
	if (iproto != IPPROTO_TCP && iproto != IPPROTO_UDP)
		return FLUXVM_TC_NEXT;
	udp = iproto == IPPROTO_UDP;
	/* The quote's source sent the packet; the error is addressed to it. */
	if (v6 ? (isrc[0] != pkt->daddr[0] || isrc[1] != pkt->daddr[1] ||
		  isrc[2] != pkt->daddr[2] || isrc[3] != pkt->daddr[3])
	       : isrc[0] != pkt->daddr[0])
		return FLUXVM_TC_NEXT;
	if (il4 > FLUXVM_ICMP_MAX_INNER_L4 || il4 + 8 > l3_end)
		return FLUXVM_TC_NEXT;
	h = fluxvm_hdr(ctx, il4, 8);
	if (!h)
		return FLUXVM_TC_NEXT;
	isport = *(__be16 *)h;
	idport = *(__be16 *)(h + 2);

	/* The flow's reverse-NAT entry, in the reply view. */
	if (v6) {
		__builtin_memcpy(k6.saddr, idst, 16);
		__builtin_memcpy(k6.daddr, isrc, 16);
		k6.sport = idport;
		k6.dport = isport;
		k6.proto = iproto;
		nat = bpf_map_lookup_elem(&fluxvm_nat6, &k6);
	} else {
		k4.saddr = idst[0];
		k4.daddr = isrc[0];
		k4.sport = idport;
		k4.dport = isport;
		k4.proto = iproto;
		nat = bpf_map_lookup_elem(&fluxvm_nat4, &k4);
	}
	if (!nat || !(nat->flags & FLUXVM_NAT_F_SNAT) != !snat)
		return FLUXVM_TC_NEXT;
	__builtin_memcpy(vip, nat->vip, 16);
	vport = nat->vport;
	if (snat) {
		__builtin_memcpy(client, nat->client, 16);
		cport = nat->cport;
	} else {
		cport = isport;
	}

	/* Everything written below lies in the linear area. */
	csum_off = il4 + (udp ? 6 : 16);
	has_l4csum = csum_off + 2 <= l3_end;
	need = has_l4csum ? csum_off + 2 : il4 + 8;
	if (!fluxvm_hdr(ctx, 0, need))
		return FLUXVM_TC_NEXT;
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
	qip = data + in_off;
	qports = data + il4;
	icsum = data + off + 2;
	/* Without a quoted L4 checksum, a pointer never written through but
	 * checked like the others: the verifier does not connect a later
	 * test of has_l4csum with one made here. */
	qcsum = data + (has_l4csum ? csum_off : off + 2);
	if (oip + iph_len > end || qip + iph_len > end || (void *)(qports + 2) > end ||
	    (void *)(icsum + 1) > end || (void *)(qcsum + 1) > end)
		return FLUXVM_TC_NEXT;

	/* The quote: addresses (and the IPv4 header checksum), ports. d sums
	 * every change of a 16-bit word the ICMP checksum covers. */
	if (v6) {
		struct ipv6hdr *ip6 = qip;

		ddiff = fluxvm_csum_diff16(idst, vip);
		if (snat)
			sdiff = fluxvm_csum_diff16(isrc, client);
		__builtin_memcpy(&ip6->daddr, vip, 16);
		if (snat)
			__builtin_memcpy(&ip6->saddr, client, 16);
		d = fluxvm_csum_add(ddiff, sdiff);
	} else {
		struct iphdr *iph = qip;

		ddiff = fluxvm_csum_diff4(idst[0], vip[0]);
		if (snat)
			sdiff = fluxvm_csum_diff4(isrc[0], client[0]);
		d = fluxvm_csum_add(ddiff, sdiff);
		old_icsum = iph->check;
		new_icsum = fluxvm_csum_fold(fluxvm_csum_add(d, (__u16)~old_icsum));
		iph->check = new_icsum;
		iph->daddr = vip[0];
		if (snat)
			iph->saddr = client[0];
		d = fluxvm_csum_add(d, fluxvm_csum_diff2(old_icsum, new_icsum));
	}
	qports[1] = vport;
	if (snat)
		qports[0] = cport;
	d = fluxvm_csum_add(d, fluxvm_csum_diff2(idport, vport));
	if (snat)
		d = fluxvm_csum_add(d, fluxvm_csum_diff2(isport, cport));

	/* The quoted L4 checksum, when the quote holds it: pseudo-header
	 * addresses and ports. An IPv4 UDP checksum of zero stays so. */
	if (has_l4csum) {
		old_l4 = *qcsum;
		if (!(udp && !v6 && old_l4 == 0)) {
			__u32 l = fluxvm_csum_add(fluxvm_csum_add(ddiff, sdiff),
						  fluxvm_csum_diff2(idport, vport));

			if (snat)
				l = fluxvm_csum_add(l, fluxvm_csum_diff2(isport, cport));
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

			odiff = fluxvm_csum_diff16(pkt->daddr, client);
			__builtin_memcpy(&ip6->daddr, client, 16);
		} else {
			struct iphdr *iph = oip;

			odiff = fluxvm_csum_diff4(pkt->daddr[0], client[0]);
			old_oc = iph->check;
			new_oc = fluxvm_csum_fold(fluxvm_csum_add(odiff, (__u16)~old_oc));
			iph->check = new_oc;
			iph->daddr = client[0];
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
	fluxvm_count(FLUXVM_CNT_ICMP_ERRORS_TRANSLATED);
	return TC_ACT_OK;
}

#endif /* FLUXVM_LIB_ICMP_H */
