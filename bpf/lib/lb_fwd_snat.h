/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The north-south SNAT forward path (FLUXVM_LB_SNAT), in the stages lb.h
 * describes.
 */
#ifndef FLUXVM_LIB_LB_FWD_SNAT_H
#define FLUXVM_LIB_LB_FWD_SNAT_H

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
#include "snat.h"

/*
 * North-south SNAT: the destination becomes the backend, and the source the
 * node's SNAT address and a port allocated for the flow (snat.h), so that
 * the replies come back through the node wherever the backend is; the
 * mapping keyed by that port translates them back.
 */
static __always_inline int fluxvm_lb_snat(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt,
					  const int v6, __u32 sid, __u32 flags)
{
	struct fluxvm_tuple4 t4 = {};
#ifdef FLUXVM_CTX_XDP
	/* In scratch (maps.h): this function's IPv6 copy is the deepest of
	 * the XDP program's chains. */
	struct fluxvm_tuple6 *t6 = v6 ? fluxvm_scratch_fwd6() : NULL;
#else
	struct fluxvm_tuple6 t6s = {}, *t6 = &t6s;
#endif
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *ct_key = v6 ? (void *)t6 : (void *)&t4;
	__u8 nat_flags = (flags & FLUXVM_SVC_F_HOST_ROUTING) ? FLUXVM_NAT_F_HOST_ROUTING : 0;
	struct fluxvm_svc_stats_value *st = fluxvm_stats(sid), *es = fluxvm_edge(ctx);
	struct fluxvm_backend *be;
	enum fluxvm_ct_verdict verdict;
	struct fluxvm_meta_value *meta;
	struct fluxvm_ct_value *ct;
	struct fluxvm_fwd o;
	__be32 nat_addr[4] = {};
	__be16 nat_port;
	__u32 bid, hash;
	union fluxvm_flow_ref flow;
	__u64 now;
	int ret;

#ifdef FLUXVM_CTX_XDP
	if (v6 && !t6)
		return CTX_ACT_NEXT;
#endif
	if (fluxvm_fwd_open(ctx, pkt, v6, sid, flags, FLUXVM_CT_F_SNAT, &t4, t6, st, es, &o))
		return o.ret;
	ct = o.ct;
	be = o.be;
	bid = o.bid;
	now = o.now;
	verdict = o.verdict;
	if (verdict == FLUXVM_CT_KEEP) {
		ret = fluxvm_snat_check(pkt, v6, be, ct, sid, bid, now, nat_flags);
		if (!ret) {
			__builtin_memcpy(nat_addr, ct->nat_addr, 16);
			nat_port = ct->nat_port;
			goto deliver;
		}
		if (ret != FLUXVM_SNAT_CONFLICT)
			return fluxvm_drop(FLUXVM_DROP_NAT_UPDATE, st, es);
		/* Our mapping was evicted and another flow took the port: map
		 * this flow afresh rather than mix two flows' replies (the
		 * backend sees a new source, as after a failover). */
		fluxvm_count(FLUXVM_CNT_SNAT_CONFLICTS);
	}

	meta = fluxvm_meta_get();
	/* A new flow under HA: TC learns it and queues its record. */
	if (fluxvm_ha_xdp_pass(meta))
		return CTX_ACT_NEXT;
	hash = v6 ? fluxvm_hash6(t6, meta ? meta->hash_seed : 0)
		  : fluxvm_hash4(&t4, meta ? meta->hash_seed : 0);
	be = fluxvm_select(sid, hash, &bid, st, es);
	if (!be)
		return CTX_ACT_DROP;

	/* Learn: the mapping (a port of its own), then conntrack. The entry
	 * is built SNAT (fluxvm_snat_learn would mark it so) for its
	 * ha_until; it is written only once the mapping is. */
	ct = fluxvm_ct_build(pkt, meta, sid, bid, now, FLUXVM_CT_F_SNAT);
	if (!ct)
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	/* Policy: before a port is taken. */
	if (fluxvm_policy_on(flags) && (ret = fluxvm_policy_admit(ctx, pkt, v6, sid, ct)))
		return fluxvm_drop(ret, st, es);
	ct->flow = fluxvm_flow_reserve(meta, now);
	ret = fluxvm_snat_learn(pkt, v6, be, sid, bid, now, nat_flags, ct);
	if (ret == FLUXVM_SNAT_FAILED)
		return fluxvm_drop(FLUXVM_DROP_SNAT_FAILED, st, es);
	if (ret)
		return fluxvm_drop(FLUXVM_DROP_NAT_UPDATE, st, es);
	__builtin_memcpy(nat_addr, ct->nat_addr, 16);
	nat_port = ct->nat_port;
	if (bpf_map_update_elem(ct_map, ct_key, ct, BPF_ANY)) {
		fluxvm_snat_forget(pkt, v6, be, ct);
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	}
	fluxvm_ha_learned(meta, ct, v6, &t4, t6);
	if (ct->flow) {
		fluxvm_flow_learn(ctx, pkt, v6, ct->flow, FLUXVM_FWD_HOOK(1), sid, bid, be, ct->flags & FLUXVM_CT_F_AUDITED);
		fluxvm_flow_snat(ct->flow, nat_addr, nat_port);
	}
	fluxvm_count_new_flow(st, es, verdict == FLUXVM_CT_FAILOVER);

deliver:
	flow = fluxvm_flow_of(ct);
	return fluxvm_flow_sent(ctx, fluxvm_nat_deliver(ctx, pkt, v6, be, bid, now, nat_addr, nat_port, nat_flags, st, es),
				flow, sid, now);
}

#endif /* FLUXVM_LIB_LB_FWD_SNAT_H */
