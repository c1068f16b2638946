/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Sending in TC: how a forward path's packet leaves once translated (or,
 * for DSR, routed as it is): the deliver stage of the NAT modes
 * (fluxvm_nat_deliver), routed DSR (fluxvm_dsr_forward) and host routing
 * (fluxvm_host_route). lb_send_xdp.h has the same functions for XDP; each
 * header is empty in the other context.
 */
#ifndef FLUXVM_LIB_LB_SEND_TC_H
#define FLUXVM_LIB_LB_SEND_TC_H

#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "nat.h"
#include "fib.h"

#ifdef FLUXVM_CTX_SKB
/*
 * Routed DSR: the packet keeps the VIP as its destination and is forwarded
 * toward the backend's address, which holds the VIP locally and answers the
 * client directly. Without a route to the backend the packet is dropped:
 * the host stack would route it by the VIP instead.
 */
static __always_inline int fluxvm_dsr_forward(struct __ctx_buff *ctx,
					      const struct fluxvm_pkt *pkt, const int v6,
					      const struct fluxvm_backend *be, __u32 bid, __u64 now,
					      struct fluxvm_svc_stats_value *st,
					      struct fluxvm_svc_stats_value *es)
{
	__u32 len = ctx_full_len(ctx);
	int ret;

	(void)bid; /* XDP's next-hop cache only */
	(void)now;
	ret = fluxvm_fib_redirect(ctx, pkt, v6, be->addr);
	if (ret == FLUXVM_FIB_MISS || ret == TC_ACT_SHOT)
		return fluxvm_drop(FLUXVM_DROP_DSR_NO_ROUTE, st, es);
	fluxvm_count(FLUXVM_CNT_DSR_FORWARDED);
	fluxvm_count_translated(st, es, len, 0);
	return ret;
}

/* host_routing: forward a translated packet ourselves; a FIB miss leaves it
 * to the host stack (TC_ACT_OK), never a drop. A failure after the
 * lookup wrote to the packet (TTL, MACs) drops it: the host stack would
 * forward it a second time. */
static __always_inline int fluxvm_host_route(struct __ctx_buff *ctx,
					     const struct fluxvm_pkt *pkt, const int v6)
{
	int ret = fluxvm_fib_redirect(ctx, pkt, v6, NULL);

	if (ret == FLUXVM_FIB_MISS) {
		fluxvm_count(FLUXVM_CNT_HOST_ROUTE_FALLBACKS);
		return TC_ACT_OK;
	}
	if (ret == TC_ACT_SHOT)
		return fluxvm_drop(FLUXVM_DROP_REWRITE, NULL, NULL);
	fluxvm_count(FLUXVM_CNT_HOST_ROUTED_PACKETS);
	return ret;
}

/*
 * The deliver stage of the NAT modes: the destination becomes the backend
 * (DNAT) and, with @snat_addr, the source the SNAT address and port; then
 * with host routing the packet is forwarded by FIB lookup, a miss left to
 * the host stack. TC_ACT_OK otherwise ends the chain: the VM policy
 * program behind us never sees the backend address and port.
 */
static __always_inline int fluxvm_nat_deliver(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt,
					      const int v6, const struct fluxvm_backend *be,
					      __u32 bid, __u64 now, const __be32 *snat_addr, __be16 snat_port,
					      __u8 nat_flags, struct fluxvm_svc_stats_value *st,
					      struct fluxvm_svc_stats_value *es)
{
	(void)bid; /* XDP's next-hop cache only */
	(void)now;
	if (fluxvm_rewrite(ctx, pkt, v6, 1, be->addr, be->port) ||
	    (snat_addr && fluxvm_rewrite(ctx, pkt, v6, 0, snat_addr, snat_port)))
		return fluxvm_drop(FLUXVM_DROP_REWRITE, st, es);
	fluxvm_count_translated(st, es, ctx_full_len(ctx), 0);
	if (nat_flags & FLUXVM_NAT_F_HOST_ROUTING)
		return fluxvm_host_route(ctx, pkt, v6);
	return TC_ACT_OK;
}
#endif /* FLUXVM_CTX_SKB */

#endif /* FLUXVM_LIB_LB_SEND_TC_H */
