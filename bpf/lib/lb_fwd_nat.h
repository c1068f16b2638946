/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The east-west NAT forward path (FLUXVM_LB_NAT), in the stages lb.h
 * describes.
 */
#ifndef FLUXVM_LIB_LB_FWD_NAT_H
#define FLUXVM_LIB_LB_FWD_NAT_H

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
#include "nat.h"

/*
 * East-west NAT: the destination becomes the backend (DNAT). The replies
 * are translated back from the conntrack entry itself, which they find
 * through fluxvm_be2fe (rev.h): the entry is all a new flow learns. A
 * frontend the index cannot list (FLUXVM_SVC_F_REV_STORED) stores a
 * reverse-NAT half as well, keyed by the reply. With host routing the
 * translated packet is forwarded by FIB lookup, a miss left to the host
 * stack.
 */
static __always_inline int fluxvm_lb_nat(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt,
					 const int v6, __u32 sid, __u32 flags)
{
	struct fluxvm_tuple4 t4 = {};
	struct fluxvm_tuple6 k6 = {};
	struct fluxvm_tuple6 *t6 = v6 ? &k6 : NULL;
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *ct_key = v6 ? (void *)t6 : (void *)&t4;
	__u8 nat_flags = (flags & FLUXVM_SVC_F_HOST_ROUTING) ? FLUXVM_NAT_F_HOST_ROUTING : 0;
	struct fluxvm_svc_stats_value *st = fluxvm_stats(sid), *es = fluxvm_edge(ctx);
	struct fluxvm_backend *be, *old_be = NULL;
	enum fluxvm_ct_verdict verdict;
	struct fluxvm_meta_value *meta;
	struct fluxvm_ct_value *ct;
	struct fluxvm_fwd o;
	__u32 bid;
	union fluxvm_flow_ref flow;
	__u64 now;
	int reason;

	if (fluxvm_fwd_open(ctx, pkt, v6, sid, flags, 0, &t4, t6, st, es, &o))
		return o.ret;
	ct = o.ct;
	be = o.be;
	bid = o.bid;
	now = o.now;
	verdict = o.verdict;
	if (verdict == FLUXVM_CT_KEEP) {
		/* A refresh also recreates a stored reverse half the LRU
		 * evicted. */
		if (o.touched && !(ct->flags & FLUXVM_CT_F_REV_DERIVED) &&
		    fluxvm_nat_ensure(pkt, v6, be, sid, ct->backend_id, now, nat_flags, ct->flow))
			return fluxvm_drop(FLUXVM_DROP_NAT_UPDATE, st, es);
		goto deliver;
	}
	/* The stored reply half of the tuple's earlier flow (re-picked or
	 * failed over), which the new pick supersedes. A derived flow has
	 * none: overwriting its conntrack entry is all it takes. */
	if (ct && be && be->service_id == sid && !(ct->flags & FLUXVM_CT_F_REV_DERIVED))
		old_be = be;

	meta = fluxvm_meta_get();
	be = fluxvm_select(sid, v6 ? fluxvm_hash6(t6, meta ? meta->hash_seed : 0)
				   : fluxvm_hash4(&t4, meta ? meta->hash_seed : 0),
			   &bid, st, es);
	if (!be)
		return CTX_ACT_DROP;

	/* Learn: the conntrack entry; the reverse half only where the index
	 * cannot find the flow. */
	ct = fluxvm_ct_build(pkt, meta, sid, bid, now,
			     (flags & FLUXVM_SVC_F_REV_STORED) ? 0 : FLUXVM_CT_F_REV_DERIVED);
	if (!ct)
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	/* Policy: before anything is written. */
	if (fluxvm_policy_on(flags) && (reason = fluxvm_policy_admit(ctx, pkt, v6, sid, ct)))
		return fluxvm_drop(reason, st, es);
	ct->flow = fluxvm_flow_reserve(meta, now);
	if (bpf_map_update_elem(ct_map, ct_key, ct, BPF_ANY))
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	if ((flags & FLUXVM_SVC_F_REV_STORED) &&
	    fluxvm_nat_learn(pkt, v6, be, sid, bid, now, nat_flags, ct->flow)) {
		bpf_map_delete_elem(ct_map, ct_key);
		return fluxvm_drop(FLUXVM_DROP_NAT_UPDATE, st, es);
	}
	/* Left behind, the earlier flow's reply half would outlive its
	 * conntrack half and could be taken for a live flow. */
	if (old_be && (old_be != be || !(flags & FLUXVM_SVC_F_REV_STORED)))
		fluxvm_nat_forget(pkt, v6, old_be);
	fluxvm_ha_learned(meta, ct, v6, &t4, t6);
	fluxvm_flow_learn(ctx, pkt, v6, ct->flow, FLUXVM_FWD_HOOK(0), sid, bid, be, ct->flags & FLUXVM_CT_F_AUDITED);
	fluxvm_count_new_flow(st, es, verdict == FLUXVM_CT_FAILOVER);

deliver:
	flow = fluxvm_flow_of(ct);
	return fluxvm_flow_sent(ctx, fluxvm_nat_deliver(ctx, pkt, v6, be, bid, now, NULL, 0, nat_flags, st, es),
				flow, sid, now);
}

#endif /* FLUXVM_LIB_LB_FWD_NAT_H */
