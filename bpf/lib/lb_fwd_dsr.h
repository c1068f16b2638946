/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The routed DSR forward path (FLUXVM_LB_DSR), at either edge, in the
 * stages lb.h describes.
 */
#ifndef FLUXVM_LIB_LB_FWD_DSR_H
#define FLUXVM_LIB_LB_FWD_DSR_H

#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "hash.h"
#include "ct.h"
#include "svc.h"
#include "flows.h"
#include "policy.h"
#include "ha.h"
#include "lb_types.h"
#include "lb_ct.h"
#include "lb_select.h"
#include "lb_send_tc.h"
#include "lb_send_xdp.h"

/*
 * Routed DSR, at either edge: the packet keeps the VIP as its destination
 * and is routed toward the backend, which holds the VIP and answers the
 * client directly. Conntrack alone keeps the flow on its backend; there is
 * no reply to translate. @flags are the frontend's, with FLUXVM_LB_AT_NS
 * when the packet came in on a north-south interface (its flow record's
 * hook).
 */
static __always_inline int fluxvm_lb_dsr(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt,
					 const int v6, __u32 sid, __u32 flags)
{
	struct fluxvm_tuple4 t4 = {};
	struct fluxvm_tuple6 t6 = {};
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *ct_key = v6 ? (void *)&t6 : (void *)&t4;
	struct fluxvm_svc_stats_value *st = fluxvm_stats(sid), *es = fluxvm_edge(ctx);
	struct fluxvm_backend *be;
	enum fluxvm_ct_verdict verdict;
	struct fluxvm_meta_value *meta;
	struct fluxvm_ct_value *ct;
	struct fluxvm_fwd o;
	__u32 bid;
	union fluxvm_flow_ref flow;
	__u64 now;
	int reason;

	if (fluxvm_fwd_open(ctx, pkt, v6, sid, flags, FLUXVM_CT_F_DSR, &t4, &t6, st, es, &o))
		return o.ret;
	ct = o.ct;
	be = o.be;
	bid = o.bid;
	now = o.now;
	verdict = o.verdict;
	if (verdict == FLUXVM_CT_KEEP)
		goto deliver;

	meta = fluxvm_meta_get();
	/* A new flow under HA: TC learns it and queues its record. */
	if (fluxvm_ha_xdp_pass(meta))
		return CTX_ACT_NEXT;
	be = fluxvm_select(sid, v6 ? fluxvm_hash6(&t6, meta ? meta->hash_seed : 0)
				   : fluxvm_hash4(&t4, meta ? meta->hash_seed : 0),
			   &bid, st, es);
	if (!be)
		return CTX_ACT_DROP;

	/* Learn: conntrack only. */
	ct = fluxvm_ct_build(pkt, meta, sid, bid, now, FLUXVM_CT_F_DSR);
	if (!ct)
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	if (fluxvm_policy_on(flags) && (reason = fluxvm_policy_admit(ctx, pkt, v6, sid, ct)))
		return fluxvm_drop(reason, st, es);
	ct->flow = fluxvm_flow_reserve(meta, now);
	if (bpf_map_update_elem(ct_map, ct_key, ct, BPF_ANY))
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	fluxvm_ha_learned(meta, ct, v6, &t4, &t6);
	fluxvm_flow_learn(ctx, pkt, v6, ct->flow, FLUXVM_FWD_HOOK(flags & FLUXVM_LB_AT_NS), sid, bid, be, ct->flags & FLUXVM_CT_F_AUDITED);
	fluxvm_count_new_flow(st, es, verdict == FLUXVM_CT_FAILOVER);

deliver:
	flow = fluxvm_flow_of(ct);
	return fluxvm_flow_sent(ctx, fluxvm_dsr_forward(ctx, pkt, v6, be, bid, now, st, es), flow, sid, now);
}

#endif /* FLUXVM_LIB_LB_FWD_DSR_H */
