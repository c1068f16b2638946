/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The packet parser every FluxVM datapath object uses.
 *
 * It reads Ethernet, IPv4 (with options) or IPv6 (with a bounded walk over
 * extension headers), then TCP or UDP, and fills struct fluxvm_pkt with
 * offsets and the 5-tuple. It never writes to the packet. Offsets rather
 * than pointers are kept, because helpers that resize or rewrite the skb
 * invalidate every packet pointer.
 *
 * An IPv6 routing header with segments left ends the walk: the packet is
 * only passing through on its way to another destination, so its upper
 * layer is not for us (l4_proto is the routing header's).
 *
 * Bounds, chosen so the verifier sees a finite walk and real traffic fits:
 *   - at most FLUXVM_IPV6_MAX_EXTHDRS IPv6 extension headers;
 *   - the L4 header must start within FLUXVM_MAX_L4_OFF bytes of the frame.
 * Packets beyond them parse as FLUXVM_PARSE_LIMIT and are left alone.
 *
 * VLAN-tagged frames are reported as non-IP and left alone, whether the tag
 * is still in the frame or the receive path already moved it into skb
 * metadata (it does on veth): a tagged frame at the VM edge belongs to a
 * VLAN device we do not own, so it must never match a service.
 */
#ifndef FLUXVM_LIB_PARSE_H
#define FLUXVM_LIB_PARSE_H

#include "counters.h"
#include "pkt_types.h"

#define FLUXVM_IPV6_MAX_EXTHDRS 8
#define FLUXVM_MAX_L4_OFF 512

/* IP protocol numbers of the IPv6 extension headers the walk understands. */
#define FLUXVM_NEXTHDR_HOP 0
#define FLUXVM_NEXTHDR_ROUTING 43
#define FLUXVM_NEXTHDR_FRAGMENT 44
#define FLUXVM_NEXTHDR_AUTH 51
#define FLUXVM_NEXTHDR_DEST 60
#define FLUXVM_NEXTHDR_MOBILITY 135

enum fluxvm_parse_result {
	FLUXVM_PARSE_OK = 0,
	FLUXVM_PARSE_NON_IP,
	FLUXVM_PARSE_TRUNCATED,
	FLUXVM_PARSE_MALFORMED,
	FLUXVM_PARSE_LIMIT,
};

/*
 * Pointer to @len readable bytes at @off from the start of the frame, or
 * NULL when the frame is shorter. Headers are nearly always in the linear
 * area already; the pull is only paid for when they are not, because it may
 * copy the skb.
 *
 * The compiler barrier and fluxvm_data() make clang load skb->data afresh:
 * reusing an older load can make it emit a 32-bit move on the pointer,
 * which the verifier turns into a scalar and then refuses to dereference.
 */
static __always_inline void *fluxvm_hdr(struct __ctx_buff *ctx, __u32 off,
					__u32 len)
{
	void *data, *end;

	asm volatile("" ::: "memory");
	data = ctx_data(ctx);
	end = ctx_data_end(ctx);
	if (data + off + len <= end)
		return data + off;
	if (off + len > ctx_full_len(ctx) || ctx_pull_data(ctx, off + len))
		return NULL;
	data = ctx_data(ctx);
	end = ctx_data_end(ctx);
	if (data + off + len > end)
		return NULL;
	return data + off;
}

static __always_inline int fluxvm_parse_ipv4(struct __ctx_buff *ctx,
					     struct fluxvm_pkt *pkt)
{
	__u32 off = pkt->l3_off;
	struct iphdr *iph = fluxvm_hdr(ctx, off, sizeof(*iph));
	__u32 hlen, tot;
	__u16 frag;

	if (!iph)
		return FLUXVM_PARSE_TRUNCATED;
	if (iph->version != 4 || iph->ihl < 5)
		return FLUXVM_PARSE_MALFORMED;
	hlen = iph->ihl * 4;
	tot = bpf_ntohs(iph->tot_len);
	frag = bpf_ntohs(iph->frag_off);
	if (tot < hlen)
		return FLUXVM_PARSE_MALFORMED;
	if (off + tot > ctx_full_len(ctx))
		return FLUXVM_PARSE_TRUNCATED;

	pkt->l4_proto = iph->protocol;
	pkt->saddr[0] = iph->saddr;
	pkt->daddr[0] = iph->daddr;
	if (frag & 0x1fff)
		pkt->frag = FLUXVM_FRAG_LATER;
	else if (frag & 0x2000)
		pkt->frag = FLUXVM_FRAG_FIRST;

	/* Options are skipped, not read: nothing here depends on them. */
	pkt->l4_off = off + hlen;
	pkt->l3_end = off + tot;
	return FLUXVM_PARSE_OK;
}

static __always_inline int fluxvm_parse_ipv6(struct __ctx_buff *ctx,
					     struct fluxvm_pkt *pkt)
{
	__u32 off = pkt->l3_off;
	struct ipv6hdr *ip6 = fluxvm_hdr(ctx, off, sizeof(*ip6));
#ifdef FLUXVM_CTX_SKB
	struct fluxvm_scratch *scr = NULL;
#endif
	__u32 end;
	__u8 nh;
	int i;

	if (!ip6)
		return FLUXVM_PARSE_TRUNCATED;
	if (ip6->version != 6)
		return FLUXVM_PARSE_MALFORMED;
	end = off + sizeof(*ip6) + bpf_ntohs(ip6->payload_len);
	if (end > ctx_full_len(ctx))
		return FLUXVM_PARSE_TRUNCATED;
	__builtin_memcpy(pkt->saddr, &ip6->saddr, 16);
	__builtin_memcpy(pkt->daddr, &ip6->daddr, 16);
	nh = ip6->nexthdr;
	off += sizeof(*ip6);
	pkt->l3_end = end;

	for (i = 0; i < FLUXVM_IPV6_MAX_EXTHDRS; i++) {
		__u8 *h;
		__u32 len;

		switch (nh) {
		case FLUXVM_NEXTHDR_HOP:
		case FLUXVM_NEXTHDR_ROUTING:
		case FLUXVM_NEXTHDR_DEST:
		case FLUXVM_NEXTHDR_MOBILITY:
		case FLUXVM_NEXTHDR_FRAGMENT:
		case FLUXVM_NEXTHDR_AUTH:
			break;
		default:
			goto upper;
		}
		if (off + 8 > end)
			return FLUXVM_PARSE_TRUNCATED;
		if (off > FLUXVM_MAX_L4_OFF)
			return FLUXVM_PARSE_LIMIT;
		h = fluxvm_hdr(ctx, off, 8);
		if (!h)
			return FLUXVM_PARSE_TRUNCATED;
		/* A routing header with segments left makes this node a
		 * waypoint: what follows belongs to the final destination,
		 * whose address (not ours) is in the L4 checksum's
		 * pseudo-header (RFC 8200 8.1). The routing header is then
		 * the upper layer as far as we are concerned, so the packet
		 * is never service traffic. */
		if (nh == FLUXVM_NEXTHDR_ROUTING && h[3]) {
			pkt->exthdrs++;
			goto upper;
		}
		if (nh == FLUXVM_NEXTHDR_FRAGMENT) {
			__u16 fo = ((__u16)h[2] << 8) | h[3];

			/* Offset 0 without M is an atomic fragment (RFC 6946):
			 * the whole datagram, so it is treated as unfragmented. */
			if (fo & 0xfff8)
				pkt->frag = FLUXVM_FRAG_LATER;
			else if (fo & 1)
				pkt->frag = FLUXVM_FRAG_FIRST;
			len = 8;
		} else if (nh == FLUXVM_NEXTHDR_AUTH) {
			len = ((__u32)h[1] + 2) * 4;
		} else {
			len = ((__u32)h[1] + 1) * 8;
		}
		nh = h[0];
		/* The offset goes through per-CPU scratch and is read back:
		 * the verifier, which does not track map memory, then knows
		 * only its bounds (not one range per way through the headers
		 * so far), and walks the next header once. In TC only a
		 * packet with extension headers pays for the lookup: the
		 * parse result stays on the caller's stack, where the hot
		 * paths read it without holding a pointer in a register.
		 * XDP, whose parse result is on its frame too, reads the
		 * offset back from it: its walk verifies within its budget
		 * so (the scratch way did not, in the XDP test object). */
#ifdef FLUXVM_CTX_SKB
		if (!scr && !(scr = fluxvm_scratch_get()))
			return FLUXVM_PARSE_LIMIT;
		scr->walk_off = off + len;
		off = *(volatile __u16 *)&scr->walk_off;
#else
		pkt->l4_off = off + len;
		off = *(volatile __u16 *)&pkt->l4_off;
#endif
		pkt->exthdrs++;
		if (off > end)
			return FLUXVM_PARSE_TRUNCATED;
		if (pkt->frag == FLUXVM_FRAG_LATER)
			goto upper;
	}
	switch (nh) {
	case FLUXVM_NEXTHDR_HOP:
	case FLUXVM_NEXTHDR_ROUTING:
	case FLUXVM_NEXTHDR_DEST:
	case FLUXVM_NEXTHDR_MOBILITY:
	case FLUXVM_NEXTHDR_FRAGMENT:
	case FLUXVM_NEXTHDR_AUTH:
		return FLUXVM_PARSE_LIMIT;
	}
upper:
	pkt->l4_proto = nh;
	pkt->l4_off = off;
	return FLUXVM_PARSE_OK;
}

static __always_inline int fluxvm_parse_l4(struct __ctx_buff *ctx,
					   struct fluxvm_pkt *pkt)
{
	__u32 off = pkt->l4_off;

	if (pkt->frag == FLUXVM_FRAG_LATER)
		return FLUXVM_PARSE_OK;
	if (off > FLUXVM_MAX_L4_OFF)
		return FLUXVM_PARSE_LIMIT;

	if (pkt->l4_proto == IPPROTO_TCP) {
		struct tcphdr *th;
		__u32 doff;

		if (off + sizeof(*th) > pkt->l3_end)
			return FLUXVM_PARSE_TRUNCATED;
		th = fluxvm_hdr(ctx, off, sizeof(*th));
		if (!th)
			return FLUXVM_PARSE_TRUNCATED;
		doff = th->doff * 4;
		if (doff < sizeof(*th))
			return FLUXVM_PARSE_MALFORMED;
		if (off + doff > pkt->l3_end)
			return FLUXVM_PARSE_TRUNCATED;
		pkt->sport = th->source;
		pkt->dport = th->dest;
		pkt->tcp_flags = ((__u8 *)th)[13];
	} else if (pkt->l4_proto == IPPROTO_UDP) {
		struct udphdr *uh;
		__u32 ulen;

		if (off + sizeof(*uh) > pkt->l3_end)
			return FLUXVM_PARSE_TRUNCATED;
		uh = fluxvm_hdr(ctx, off, sizeof(*uh));
		if (!uh)
			return FLUXVM_PARSE_TRUNCATED;
		ulen = bpf_ntohs(uh->len);
		if (ulen < sizeof(*uh))
			return FLUXVM_PARSE_MALFORMED;
		/* A first fragment carries only part of the datagram. */
		if (pkt->frag == FLUXVM_FRAG_NONE && off + ulen > pkt->l3_end)
			return FLUXVM_PARSE_TRUNCATED;
		pkt->sport = uh->source;
		pkt->dport = uh->dest;
	}
	return FLUXVM_PARSE_OK;
}

/* Parse the frame in @skb into @pkt; returns enum fluxvm_parse_result. */
static __always_inline int fluxvm_parse(struct __ctx_buff *ctx,
					struct fluxvm_pkt *pkt)
{
	struct ethhdr *eth = fluxvm_hdr(ctx, 0, sizeof(*eth));
	int ret;

	if (!eth)
		return FLUXVM_PARSE_TRUNCATED;
	if (ctx_vlan_present(ctx))
		return FLUXVM_PARSE_NON_IP;
	pkt->l3_proto = bpf_ntohs(eth->h_proto);
	pkt->l3_off = sizeof(*eth);

	if (pkt->l3_proto == ETH_P_IP)
		ret = fluxvm_parse_ipv4(ctx, pkt);
	else if (pkt->l3_proto == ETH_P_IPV6)
		ret = fluxvm_parse_ipv6(ctx, pkt);
	else
		return FLUXVM_PARSE_NON_IP;
	if (ret != FLUXVM_PARSE_OK)
		return ret;
	return fluxvm_parse_l4(ctx, pkt);
}

/*
 * Count one parse outcome. Failures bump exactly one counter; a parsed
 * packet bumps its family, its upper layer (when that header was read) and
 * the extension-header and fragment counters that apply.
 */
static __always_inline void fluxvm_count_parse(int ret, struct fluxvm_pkt *pkt)
{
	switch (ret) {
	case FLUXVM_PARSE_OK:
		break;
	case FLUXVM_PARSE_NON_IP:
		fluxvm_count(FLUXVM_CNT_NON_IP);
		return;
	case FLUXVM_PARSE_TRUNCATED:
		fluxvm_count(FLUXVM_CNT_TRUNCATED);
		return;
	case FLUXVM_PARSE_LIMIT:
		fluxvm_count(FLUXVM_CNT_PARSE_LIMIT);
		return;
	default:
		fluxvm_count(FLUXVM_CNT_MALFORMED);
		return;
	}
	fluxvm_count(pkt->l3_proto == ETH_P_IP ? FLUXVM_CNT_IPV4 : FLUXVM_CNT_IPV6);
	if (pkt->exthdrs)
		fluxvm_count(FLUXVM_CNT_IPV6_EXTHDR);
	if (pkt->frag != FLUXVM_FRAG_NONE)
		fluxvm_count(FLUXVM_CNT_FRAGMENT);
	if (pkt->frag == FLUXVM_FRAG_LATER)
		return;
	if (pkt->l4_proto == IPPROTO_TCP)
		fluxvm_count(FLUXVM_CNT_TCP);
	else if (pkt->l4_proto == IPPROTO_UDP)
		fluxvm_count(FLUXVM_CNT_UDP);
	else
		fluxvm_count(FLUXVM_CNT_L4_OTHER);
}

/* Parse and count: what every entry program does first. Returns 1 when
 * @pkt holds a parsed IP packet. */
static __always_inline int fluxvm_parse_counted(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt)
{
	int ret = fluxvm_parse(ctx, pkt);

	fluxvm_count_parse(ret, pkt);
	return ret == FLUXVM_PARSE_OK;
}

#endif /* FLUXVM_LIB_PARSE_H */
