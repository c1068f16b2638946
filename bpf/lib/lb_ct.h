/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The conntrack stage of the forward paths: may a flow's entry keep its
 * backend (fluxvm_ct_stage), the opening every forward mode shares around
 * it (fluxvm_fwd_open), and the entry a new flow learns (fluxvm_ct_build),
 * with the statistics of a new flow.
 */
#ifndef FLUXVM_LIB_LB_CT_H
#define FLUXVM_LIB_LB_CT_H

#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "ct.h"
#include "svc.h"
#include "ha.h"
#include "policy.h"
#include "lb_types.h"

/*
 * The conntrack stage: may the flow's entry @ct (or NULL) keep its backend
 * *@be for service @sid in mode @kind (its FLUXVM_CT_F_SNAT/DSR bits)? An
 * entry of another service or mode (the service changed mode) is relearned
 * as a new flow.
 *
 * A fresh SYN on an entry past its handshake (closed, reset, or established
 * as far as we know: its end was not seen, or the entry was rebuilt from its
 * reply half) is a new connection reusing the tuple: it gets a fresh pick and
 * a fresh SYN state, whose SYN-ACK the reply path accepts. A retransmitted
 * SYN of a handshake in progress keeps its backend.
 */
static __always_inline enum fluxvm_ct_verdict
fluxvm_ct_stage(const struct fluxvm_ct_value *ct, const struct fluxvm_pkt *pkt, __u32 sid,
		__u8 kind, __u64 now, struct fluxvm_backend **be, __u32 *bid)
{
	if (!ct || ct->service_id != sid || (ct->flags & (FLUXVM_CT_F_SNAT | FLUXVM_CT_F_DSR)) != kind)
		return FLUXVM_CT_NEW;
	/* Read once: another CPU may re-pick the flow meanwhile, and the
	 * backend, its id and what is learned under it must agree. */
	*bid = *(volatile __u32 *)&ct->backend_id;
	*be = fluxvm_backend_get(*bid);
	if (!fluxvm_backend_keeps(*be, sid, now))
		return FLUXVM_CT_FAILOVER;
	if (fluxvm_tcp_is_syn(pkt) && ct->state != FLUXVM_CT_TCP_SYN)
		return FLUXVM_CT_REPICK;
	return FLUXVM_CT_KEEP;
}

/*
 * The opening every forward mode shares, for service @sid (@flags: the
 * frontend's) in mode @kind (FLUXVM_CT_F_SNAT/DSR bits, as
 * fluxvm_ct_stage): the service guard, the packet's tuple into *@t4 or
 * *@t6 (the conntrack key, which the mode keeps using), the clock, the
 * flow's entry and the conntrack stage. A flow that keeps its backend is
 * then handed to TC when XDP must not serve it under HA, rechecked
 * against its service's policy, and touched (a due refresh queued for
 * HA). Nonzero when the path ends here, its verdict in @o->ret; else
 * the mode goes on from @o->verdict. Inline: the conntrack-hit path pays
 * for no call.
 */
static __always_inline int fluxvm_fwd_open(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, const int v6,
					   __u32 sid, __u32 flags, __u8 kind, struct fluxvm_tuple4 *t4,
					   struct fluxvm_tuple6 *t6, struct fluxvm_svc_stats_value *st,
					   struct fluxvm_svc_stats_value *es, struct fluxvm_fwd *o)
{
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *ct_key = v6 ? (void *)t6 : (void *)t4;
	int reason;

	o->be = NULL;
	if (!fluxvm_guard_open(sid)) {
		o->ret = fluxvm_drop(FLUXVM_DROP_GUARD_CLOSED, st, es);
		return 1;
	}
	fluxvm_pkt_tuple(pkt, v6, t4, t6);
	o->now = bpf_ktime_get_coarse_ns();

	o->ct = bpf_map_lookup_elem(ct_map, ct_key);
	o->verdict = fluxvm_ct_stage(o->ct, pkt, sid, kind, o->now, &o->be, &o->bid);
	if (o->verdict != FLUXVM_CT_KEEP)
		return 0;
	/* Under HA, a hit that would queue a record is TC's. */
	if (fluxvm_ha_xdp_hit(o->ct, pkt, o->now)) {
		o->ret = CTX_ACT_NEXT;
		return 1;
	}
	if (fluxvm_policy_on(flags) && (reason = fluxvm_policy_recheck(ctx, pkt, v6, sid, o->ct))) {
		o->ret = fluxvm_drop(reason, st, es);
		return 1;
	}
	o->touched = fluxvm_ct_touch(o->ct, fluxvm_ct_next(o->ct->state, pkt, 0), o->now);
	fluxvm_ha_touched(o->ct, v6, t4, t6, o->touched);
	return 0;
}

/*
 * The conntrack entry of a new flow to backend @bid, built in per-CPU
 * scratch (maps.h), off the stack of the conntrack-hit path; NULL when the
 * scratch cannot be had.
 */
static __always_inline struct fluxvm_ct_value *
fluxvm_ct_build(const struct fluxvm_pkt *pkt, const struct fluxvm_meta_value *meta, __u32 sid,
		__u32 bid, __u64 now, __u8 flags)
{
	struct fluxvm_scratch *scr = fluxvm_scratch_get();
	struct fluxvm_ct_value *nct;

	if (!scr)
		return NULL;
	nct = &scr->nct;
	__builtin_memset(nct, 0, sizeof(*nct));
	nct->service_id = sid;
	nct->backend_id = bid;
	nct->created_ns = now;
	nct->last_seen_ns = now;
	nct->state = fluxvm_ct_next(FLUXVM_CT_NONE, pkt, 0);
	nct->deadline_ns = now + fluxvm_timeout_ns(meta, nct->state);
	nct->flags = flags;
#ifdef FLUXVM_CTX_SKB
	/* Its record (fluxvm_ha_learned) gives the standby this much: the
	 * first refresh is due only past it (lib/ha.h). Only the replicated
	 * kinds, SNAT and DSR: an east-west (or L7) entry is never queued and
	 * keeps 0. XDP learns no flow under HA. */
	if (fluxvm_ha_on(meta) && (flags & (FLUXVM_CT_F_SNAT | FLUXVM_CT_F_DSR)))
		FLUXVM_CT_HA_UNTIL(nct) = fluxvm_ha_until(nct, fluxvm_ha_hold_s(meta, nct->state));
#endif
	return nct;
}

static __always_inline void fluxvm_count_new_flow(struct fluxvm_svc_stats_value *st,
						  struct fluxvm_svc_stats_value *es, int failover)
{
	if (st) {
		st->new_flows++;
		st->failovers += failover;
	}
	if (es) {
		es->new_flows++;
		es->failovers += failover;
	}
}

#endif /* FLUXVM_LIB_LB_CT_H */
