/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Sending in XDP: the devices XDP may send on (fluxvm_xdp_tx), the route
 * toward a backend (the next-hop cache, else the FIB), the frame's L2
 * rewrite and its way out (XDP_TX or a redirect); the deliver stage of the
 * NAT modes and routed DSR on top of them. lb_send_tc.h has the same
 * functions for TC; each header is empty in the other context.
 */
#ifndef FLUXVM_LIB_LB_SEND_XDP_H
#define FLUXVM_LIB_LB_SEND_XDP_H

#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "nat.h"
#include "fib.h"

#ifdef FLUXVM_CTX_XDP
#include "nh.h" /* XDP only: its maps stay out of the TC object */

/*
 * The interfaces XDP may send on (by ifindex), written by the loader: only
 * devices that take XDP frames (a redirect goes through the target's
 * ndo_xdp_xmit, and a device that refuses, such as a veth whose peer runs
 * no XDP program, drops the frame silently after we learned and counted
 * it). A route out of any other interface, or back out of an uplink that
 * is not listed, leaves the packet to the stack. Empty: XDP sends nothing
 * and passes every packet to TC.
 */
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, FLUXVM_MAX_EDGES);
} fluxvm_xdp_tx SEC(".maps");

/* The L3 length of the packet to forward, or 0 when it may not be
 * forwarded from here (its TTL/hop limit would expire, or the header is
 * not where the parser found it). */
static __always_inline __u32 fluxvm_xdp_fwd_len(struct __ctx_buff *ctx, const struct fluxvm_pkt *pkt,
						const int v6)
{
	void *data = ctx_data(ctx), *end = ctx_data_end(ctx);
	__u32 l3_off = pkt->l3_off;

	if (l3_off > FLUXVM_MAX_L4_OFF)
		return 0;
	if (v6) {
		struct ipv6hdr *ip6 = data + l3_off;

		if ((void *)(ip6 + 1) > end || ip6->hop_limit <= 1)
			return 0;
		return bpf_ntohs(ip6->payload_len) + sizeof(*ip6);
	} else {
		struct iphdr *iph = data + l3_off;

		if ((void *)(iph + 1) > end || iph->ttl <= 1)
			return 0;
		return bpf_ntohs(iph->tot_len);
	}
}

/*
 * The route toward backend @bid (at @dst, the packet to leave from @src),
 * left in the per-CPU scratch's fib (egress ifindex and MACs): from the
 * next-hop cache (lib/nh.h) when it holds a fresh answer, else from the
 * FIB, whose full answers it then keeps. Looked up before the first
 * write: without a full answer (a miss, or a next hop whose link-layer
 * address is not known yet, which XDP cannot resolve) or toward a device
 * XDP may not send on, this returns -1 with the reason counted, and the
 * caller passes the packet on to the stack untouched, where TC serves it
 * by the same flow state. Returns 0 otherwise.
 */
static __always_inline int fluxvm_xdp_route(struct __ctx_buff *ctx, const struct fluxvm_pkt *pkt,
					    const int v6, const __be32 *src, const __be32 *dst,
					    __u32 bid, __u64 now)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	__u32 gen = 0, iif = ctx_ifindex(ctx);
	struct fluxvm_nh_entry *e;

	if (!s)
		return -1;
	e = fluxvm_nh_slot(bid, now, &gen);
	if (e && fluxvm_nh_fresh(e, bid, gen, iif, fluxvm_xdp_fwd_len(ctx, pkt, v6), now)) {
		s->fib.ifindex = e->oif;
		__builtin_memcpy(s->fib.dmac, e->dmac, ETH_ALEN);
		__builtin_memcpy(s->fib.smac, e->smac, ETH_ALEN);
		return 0;
	}
	if (fluxvm_fib_lookup(ctx, pkt, v6, src, dst) != BPF_FIB_LKUP_RET_SUCCESS) {
		fluxvm_count(FLUXVM_CNT_XDP_PASS_NO_ROUTE);
		return -1;
	}
	if (!bpf_map_lookup_elem(&fluxvm_xdp_tx, &s->fib.ifindex)) {
		fluxvm_count(FLUXVM_CNT_XDP_PASS_EGRESS);
		return -1;
	}
	if (e)
		fluxvm_nh_learn(e, bid, gen, iif, now, &s->fib);
	return 0;
}

/* XDP: after fluxvm_xdp_route and the L3/L4 rewrite, the frame's MACs and
 * TTL, then out: back through the interface it came in on (XDP_TX) or to
 * another one, both listed in fluxvm_xdp_tx. Negative when the frame could
 * not be written. */
static __always_inline int fluxvm_xdp_send(struct __ctx_buff *ctx, const struct fluxvm_pkt *pkt,
					   const int v6)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();

	if (!s || fluxvm_fib_rewrite_l2(ctx, pkt, v6, BPF_FIB_LKUP_RET_SUCCESS, 0))
		return -1;
	fluxvm_count(FLUXVM_CNT_XDP_TRANSLATED);
	if (s->fib.ifindex == ctx_ifindex(ctx))
		return XDP_TX;
	/* fluxvm_xdp_route checked the device against fluxvm_xdp_tx (or the
	 * cache holds an answer that was checked, and the loader moves the
	 * cache's generation on when it removes a device). A redirect by
	 * ifindex costs ~55 ns less here than bpf_redirect_map, whose own
	 * lookup would repeat that check, and is queued and flushed the same
	 * way (dev_xdp_enqueue). */
	return bpf_redirect(s->fib.ifindex, 0);
}

/* Routed DSR in XDP: routed toward the backend as it is (it keeps the
 * VIP). */
static __always_inline int fluxvm_dsr_forward(struct __ctx_buff *ctx,
					      const struct fluxvm_pkt *pkt, const int v6,
					      const struct fluxvm_backend *be, __u32 bid, __u64 now,
					      struct fluxvm_svc_stats_value *st,
					      struct fluxvm_svc_stats_value *es)
{
	__u32 len = ctx_full_len(ctx);
	int ret;

	if (fluxvm_xdp_route(ctx, pkt, v6, NULL, be->addr, bid, now))
		return CTX_ACT_NEXT;
	ret = fluxvm_xdp_send(ctx, pkt, v6);
	if (ret < 0)
		return fluxvm_drop(FLUXVM_DROP_REWRITE, st, es);
	fluxvm_count(FLUXVM_CNT_DSR_FORWARDED);
	fluxvm_count_translated(st, es, len, 0);
	return ret;
}

/*
 * The deliver stage of the NAT modes in XDP: the route of the translated
 * packet (to the backend, from the SNAT address) is looked up first; then
 * DNAT and SNAT, the frame's MACs and TTL, and out (fluxvm_xdp_send). A
 * packet without a route goes on to the stack untouched. Host routing is
 * what XDP always does.
 */
static __always_inline int fluxvm_nat_deliver(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt,
					      const int v6, const struct fluxvm_backend *be,
					      __u32 bid, __u64 now, const __be32 *snat_addr, __be16 snat_port,
					      __u8 nat_flags, struct fluxvm_svc_stats_value *st,
					      struct fluxvm_svc_stats_value *es)
{
	int ret;

	(void)nat_flags;
	if (fluxvm_xdp_route(ctx, pkt, v6, snat_addr, be->addr, bid, now))
		return CTX_ACT_NEXT;
	if (fluxvm_rewrite(ctx, pkt, v6, 1, be->addr, be->port) ||
	    (snat_addr && fluxvm_rewrite(ctx, pkt, v6, 0, snat_addr, snat_port)))
		return fluxvm_drop(FLUXVM_DROP_REWRITE, st, es);
	fluxvm_count_translated(st, es, ctx_full_len(ctx), 0);
	ret = fluxvm_xdp_send(ctx, pkt, v6);
	if (ret < 0)
		return fluxvm_drop(FLUXVM_DROP_REWRITE, st, es);
	return ret;
}
#endif /* FLUXVM_CTX_XDP */

#endif /* FLUXVM_LIB_LB_SEND_XDP_H */
