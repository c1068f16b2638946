/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * East-west load balancing at the VM edge: frontend lookup, the service
 * guard, conntrack affinity, Maglev selection over Ready backends, DNAT on
 * the way to the backend and reverse NAT on the way back.
 *
 * Selection semantics (DESIGN.md §3):
 *   - a new flow takes the Maglev pick; the table holds Ready backends only;
 *   - an existing flow keeps its backend while it is Ready, or Draining with
 *     its drain deadline ahead; Unhealthy, removed or expired: fail over to
 *     a new Maglev pick, never a blackhole;
 *   - no eligible backend, or the service guard closed: drop with a reason.
 *
 * A packet to a VIP goes through the frontend stage (fluxvm_lb_frontend),
 * which finds its service and the mode of its path, one per mode:
 *   - fluxvm_lb_nat: the VM edge (east-west), DNAT;
 *   - fluxvm_lb_snat: the north-south edge, DNAT plus SNAT to the node's
 *     SNAT address (snat.h);
 *   - fluxvm_lb_dsr: either edge, routed DSR;
 * host routing is an option of the NAT modes. The entry object composes
 * the stage and the paths (which it inlines, which it calls). A service
 * says where it is served with FLUXVM_SVC_F_NORTH_SOUTH and
 * FLUXVM_SVC_F_NO_EAST_WEST; elsewhere its packets pass untouched.
 *
 * Fragments addressed to a VIP are dropped (FLUXVM_DROP_FRAGMENT): later
 * fragments carry no ports, so translating only the first would send the
 * rest, untranslated, to the VIP. The drop is the service's whose frontend
 * the first fragment's destination port names; a later fragment's, which
 * has no port, is that of the VIP's first frontend (its marker entry). TCP avoids fragmentation with PMTU
 * discovery; UDP services must keep datagrams under the path MTU.
 */
#ifndef FLUXVM_LIB_LB_H
#define FLUXVM_LIB_LB_H

#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "hash.h"
#include "ct.h"
#include "nat.h"
#include "snat.h"
#include "fib.h"
#include "rev.h"
#include "svc.h"

/* A forward path's flags (the frontend's, enum fluxvm_svc_flags) with
 * this bit: the packet came in on a north-south interface. */
#define FLUXVM_LB_AT_NS (1U << 31)

/* The hook a forward path runs in, for flow records: XDP, or the TC
 * program of the edge (@ns: north-south). */
#ifdef FLUXVM_CTX_XDP
#define FLUXVM_FWD_HOOK(ns) FLUXVM_HOOK_XDP
#else
#define FLUXVM_FWD_HOOK(ns) ((ns) ? FLUXVM_HOOK_NS_IN : FLUXVM_HOOK_FROM_VM)
#endif
#ifdef FLUXVM_CTX_XDP
#include "nh.h"
#endif

static __always_inline struct fluxvm_svc_value *
fluxvm_frontend(const struct fluxvm_pkt *pkt, const int v6, __be16 port)
{
	if (v6) {
		struct fluxvm_svc6_key k = { .port = port, .proto = pkt->l4_proto };

		__builtin_memcpy(k.vip, pkt->daddr, 16);
		return bpf_map_lookup_elem(&fluxvm_svc6, &k);
	}
	struct fluxvm_svc4_key k = {
		.vip = pkt->daddr[0],
		.port = port,
		.proto = pkt->l4_proto,
	};

	return bpf_map_lookup_elem(&fluxvm_svc4, &k);
}

/* The packet's own tuple, as conntrack (forward) and reverse NAT (reply)
 * key it. */
static __always_inline void fluxvm_pkt_tuple(const struct fluxvm_pkt *pkt, const int v6,
					     struct fluxvm_tuple4 *t4,
					     struct fluxvm_tuple6 *t6)
{
	if (v6) {
		__builtin_memcpy(t6->saddr, pkt->saddr, 16);
		__builtin_memcpy(t6->daddr, pkt->daddr, 16);
		t6->sport = pkt->sport;
		t6->dport = pkt->dport;
		t6->proto = pkt->l4_proto;
	} else {
		t4->saddr = pkt->saddr[0];
		t4->daddr = pkt->daddr[0];
		t4->sport = pkt->sport;
		t4->dport = pkt->dport;
		t4->proto = pkt->l4_proto;
	}
}

#include "flows.h" /* after fluxvm_pkt_tuple, which its drop records use */
#include "policy.h"
#include "ha.h"
#ifdef FLUXVM_CTX_SKB
#include "edt.h" /* after flows.h: a paced reply dropped is taken back from its record */
#endif

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

#else /* XDP */
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
#endif /* FLUXVM_CTX_SKB */

/* What the conntrack stage decided for a flow's packet. */
enum fluxvm_ct_verdict {
	FLUXVM_CT_NEW,      /* no entry of this service and mode: a new flow */
	FLUXVM_CT_KEEP,     /* the entry's backend keeps the flow */
	FLUXVM_CT_REPICK,   /* a bare SYN reuses the tuple: a new connection */
	FLUXVM_CT_FAILOVER, /* the entry's backend may no longer serve it */
};

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
 * The select stage: the Maglev pick for a new flow of service @sid whose
 * tuple hashes to @hash, with its id in *@bid; or NULL, the drop counted
 * (no table or an empty slot; a slot naming a backend that is not Ready).
 */
static __always_inline struct fluxvm_backend *
fluxvm_select(__u32 sid, __u32 hash, __u32 *bid, struct fluxvm_svc_stats_value *st,
	      struct fluxvm_svc_stats_value *es)
{
	struct fluxvm_backend *be;

	*bid = fluxvm_maglev_pick(sid, hash);
	if (!*bid) {
		fluxvm_drop(FLUXVM_DROP_NO_BACKEND, st, es);
		return NULL;
	}
	be = fluxvm_backend_ready(*bid, sid);
	if (!be)
		fluxvm_drop(FLUXVM_DROP_BACKEND_INVALID, st, es);
	return be;
}

#ifdef FLUXVM_CTX_SKB
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

#else /* XDP */
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
#endif /* FLUXVM_CTX_SKB */

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

/*
 * The forward paths, one per mode, each in the same stages:
 *
 *   conntrack (fluxvm_ct_stage) -> select (fluxvm_select) -> learn
 *   -> deliver (fluxvm_nat_deliver for the NAT modes)
 *
 * A packet whose flow keeps its backend skips selection and learning. The
 * learn stage writes every piece of state the flow's replies need before
 * the deliver stage, whose helpers invalidate packet pointers; a piece
 * that cannot be written takes the others with it. From the first write
 * to the packet on, a failure drops: nothing half-translated leaves.
 * A sampled flow's record (lib/flows.h) has its id reserved before the
 * learn writes, which keep it, and is written only after all of them
 * succeeded; a packet counts into it after the deliver stage, only when
 * the path sends it (fluxvm_flow_sent): one dropped, or one XDP leaves to
 * TC, is not counted forwarded here.
 *
 * They take the frontend's service id and flags as scalars: the frontend
 * entry may be replaced while the packet is in flight.
 */

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
	struct fluxvm_tuple6 t6 = {};
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *ct_key = v6 ? (void *)&t6 : (void *)&t4;
	__u8 nat_flags = (flags & FLUXVM_SVC_F_HOST_ROUTING) ? FLUXVM_NAT_F_HOST_ROUTING : 0;
	struct fluxvm_svc_stats_value *st = fluxvm_stats(sid), *es = fluxvm_edge(ctx);
	struct fluxvm_backend *be = NULL, *old_be = NULL;
	enum fluxvm_ct_verdict verdict;
	struct fluxvm_meta_value *meta;
	struct fluxvm_ct_value *ct;
	__u32 bid;
	__u64 now, flow;
	int reason;

	if (!fluxvm_guard_open(sid))
		return fluxvm_drop(FLUXVM_DROP_GUARD_CLOSED, st, es);
	fluxvm_pkt_tuple(pkt, v6, &t4, &t6);
	now = bpf_ktime_get_coarse_ns();

	ct = bpf_map_lookup_elem(ct_map, ct_key);
	verdict = fluxvm_ct_stage(ct, pkt, sid, 0, now, &be, &bid);
	if (verdict == FLUXVM_CT_KEEP) {
		/* Under HA, a hit that would queue a record is TC's. */
		if (fluxvm_ha_xdp_hit(ct, pkt, now))
			return CTX_ACT_NEXT;
		if (fluxvm_policy_on(flags) && (reason = fluxvm_policy_recheck(ctx, pkt, v6, sid, ct)))
			return fluxvm_drop(reason, st, es);
		/* A refresh also recreates a stored reverse half the LRU
		 * evicted. */
		reason = fluxvm_ct_touch(ct, fluxvm_ct_next(ct->state, pkt, 0), now);
		fluxvm_ha_touched(ct, v6, &t4, &t6, reason);
		if (reason && !(ct->flags & FLUXVM_CT_F_REV_DERIVED) &&
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
	be = fluxvm_select(sid, v6 ? fluxvm_hash6(&t6, meta ? meta->hash_seed : 0)
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
	fluxvm_ha_learned(meta, ct, v6, &t4, &t6);
	fluxvm_flow_learn(ctx, pkt, v6, ct->flow, FLUXVM_FWD_HOOK(0), sid, bid, be, ct->flags & FLUXVM_CT_F_AUDITED);
	fluxvm_count_new_flow(st, es, verdict == FLUXVM_CT_FAILOVER);

deliver:
	flow = FLUXVM_FLOW_OF(ct);
	return fluxvm_flow_sent(ctx, fluxvm_nat_deliver(ctx, pkt, v6, be, bid, now, NULL, 0, nat_flags, st, es),
				flow, sid, now);
}

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
	struct fluxvm_tuple6 t6 = {};
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *ct_key = v6 ? (void *)&t6 : (void *)&t4;
	__u8 nat_flags = (flags & FLUXVM_SVC_F_HOST_ROUTING) ? FLUXVM_NAT_F_HOST_ROUTING : 0;
	struct fluxvm_svc_stats_value *st = fluxvm_stats(sid), *es = fluxvm_edge(ctx);
	struct fluxvm_backend *be = NULL;
	enum fluxvm_ct_verdict verdict;
	struct fluxvm_meta_value *meta;
	struct fluxvm_ct_value *ct;
	__be32 nat_addr[4] = {};
	__be16 nat_port;
	__u32 bid, hash;
	__u64 now, flow;
	int ret;

	if (!fluxvm_guard_open(sid))
		return fluxvm_drop(FLUXVM_DROP_GUARD_CLOSED, st, es);
	fluxvm_pkt_tuple(pkt, v6, &t4, &t6);
	now = bpf_ktime_get_coarse_ns();

	ct = bpf_map_lookup_elem(ct_map, ct_key);
	verdict = fluxvm_ct_stage(ct, pkt, sid, FLUXVM_CT_F_SNAT, now, &be, &bid);
	if (verdict == FLUXVM_CT_KEEP) {
		/* Under HA, a hit that would queue a record is TC's. */
		if (fluxvm_ha_xdp_hit(ct, pkt, now))
			return CTX_ACT_NEXT;
		if (fluxvm_policy_on(flags) && (ret = fluxvm_policy_recheck(ctx, pkt, v6, sid, ct)))
			return fluxvm_drop(ret, st, es);
		fluxvm_ha_touched(ct, v6, &t4, &t6, fluxvm_ct_touch(ct, fluxvm_ct_next(ct->state, pkt, 0), now));
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
	hash = v6 ? fluxvm_hash6(&t6, meta ? meta->hash_seed : 0)
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
	fluxvm_ha_learned(meta, ct, v6, &t4, &t6);
	if (ct->flow) {
		fluxvm_flow_learn(ctx, pkt, v6, ct->flow, FLUXVM_FWD_HOOK(1), sid, bid, be, ct->flags & FLUXVM_CT_F_AUDITED);
		fluxvm_flow_snat(ct->flow, nat_addr, nat_port);
	}
	fluxvm_count_new_flow(st, es, verdict == FLUXVM_CT_FAILOVER);

deliver:
	flow = FLUXVM_FLOW_OF(ct);
	return fluxvm_flow_sent(ctx, fluxvm_nat_deliver(ctx, pkt, v6, be, bid, now, nat_addr, nat_port, nat_flags, st, es),
				flow, sid, now);
}

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
	struct fluxvm_backend *be = NULL;
	enum fluxvm_ct_verdict verdict;
	struct fluxvm_meta_value *meta;
	struct fluxvm_ct_value *ct;
	__u32 bid;
	__u64 now, flow;
	int reason;

	if (!fluxvm_guard_open(sid))
		return fluxvm_drop(FLUXVM_DROP_GUARD_CLOSED, st, es);
	fluxvm_pkt_tuple(pkt, v6, &t4, &t6);
	now = bpf_ktime_get_coarse_ns();

	ct = bpf_map_lookup_elem(ct_map, ct_key);
	verdict = fluxvm_ct_stage(ct, pkt, sid, FLUXVM_CT_F_DSR, now, &be, &bid);
	if (verdict == FLUXVM_CT_KEEP) {
		/* Under HA, a hit that would queue a record is TC's. */
		if (fluxvm_ha_xdp_hit(ct, pkt, now))
			return CTX_ACT_NEXT;
		if (fluxvm_policy_on(flags) && (reason = fluxvm_policy_recheck(ctx, pkt, v6, sid, ct)))
			return fluxvm_drop(reason, st, es);
		fluxvm_ha_touched(ct, v6, &t4, &t6, fluxvm_ct_touch(ct, fluxvm_ct_next(ct->state, pkt, 0), now));
		goto deliver;
	}

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
	flow = FLUXVM_FLOW_OF(ct);
	return fluxvm_flow_sent(ctx, fluxvm_dsr_forward(ctx, pkt, v6, be, bid, now, st, es), flow, sid, now);
}

#ifdef FLUXVM_CTX_SKB
/*
 * The frontend stage of a fragment (rare: a global function, verified
 * once, off the programs' frames): one addressed to a VIP served here at
 * the edge @how >> 8 is dropped (see the top of this file), counted under
 * its service, whose flow record (fluxvm_flow_drop) records why; @how bit
 * 0: IPv6. A first fragment carries its ports: the frontend of its
 * destination port names its service. A later one has none: the VIP's
 * marker entry names the VIP's first frontend, as it does for a first
 * fragment to a port not served here. (XDP passes fragments to TC before
 * its frontend stage.)
 */
__attribute__((noinline)) int fluxvm_lb_fragment(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, __u32 how)
{
	struct fluxvm_svc_value *svc = NULL;
	int v6 = how & 1, edge = how >> 8, verdict;
	__u32 sid;

	if (!pkt)
		return CTX_ACT_NEXT;
	if (pkt->frag == FLUXVM_FRAG_FIRST) {
		svc = fluxvm_frontend(pkt, v6, pkt->dport);
		if (svc && ((svc->flags & FLUXVM_SVC_F_VIP_MARKER) || !fluxvm_svc_here(svc, edge)))
			svc = NULL;
	}
	if (!svc)
		svc = fluxvm_frontend(pkt, v6, 0);
	if (!svc || !fluxvm_svc_here(svc, edge))
		return CTX_ACT_NEXT;
	sid = svc->service_id;
	verdict = fluxvm_drop(FLUXVM_DROP_FRAGMENT, fluxvm_stats(sid), fluxvm_edge(ctx));
	fluxvm_flow_drop(ctx, pkt, (v6 ? 1 : 0) | ((__u64)FLUXVM_FWD_HOOK(edge == FLUXVM_EDGE_NS) << 8) |
				   ((__u64)sid << 32));
	return verdict;
}
#endif

/* The mode of a frontend's path, as the frontend stage finds it. */
enum fluxvm_lb_mode {
	FLUXVM_LB_NONE, /* not a service served here, or dropped: see the verdict */
	FLUXVM_LB_NAT,  /* east-west NAT: fluxvm_lb_nat */
	FLUXVM_LB_SNAT, /* north-south NAT with SNAT: fluxvm_lb_snat */
	FLUXVM_LB_DSR,  /* routed DSR, either edge: fluxvm_lb_dsr */
};

/*
 * The frontend stage of a client -> VIP packet at @edge: the service its
 * VIP and port name, if it is served here, with its id and flags copied out
 * (the frontend entry may be replaced while the packet is in flight), and
 * the mode whose path takes the packet on. FLUXVM_LB_NONE leaves the
 * verdict in *@verdict: the packet passes, or it is a fragment addressed
 * to a VIP served here and is dropped, its drop recorded
 * (fluxvm_lb_fragment).
 */
static __always_inline enum fluxvm_lb_mode fluxvm_lb_frontend(struct __ctx_buff *ctx,
							      struct fluxvm_pkt *pkt,
							      const int v6, const int edge,
							      __u32 *sid, __u32 *flags,
							      int *verdict)
{
	struct fluxvm_svc_value *svc;

	*verdict = CTX_ACT_NEXT;
	if (pkt->l4_proto != IPPROTO_TCP && pkt->l4_proto != IPPROTO_UDP)
		return FLUXVM_LB_NONE;
	if (pkt->frag != FLUXVM_FRAG_NONE) {
#ifdef FLUXVM_CTX_SKB
		*verdict = fluxvm_lb_fragment(ctx, pkt, (v6 ? 1 : 0) | (edge << 8));
#endif
		return FLUXVM_LB_NONE;
	}
	svc = fluxvm_frontend(pkt, v6, pkt->dport);
	if (!svc || (svc->flags & FLUXVM_SVC_F_VIP_MARKER) || !fluxvm_svc_here(svc, edge))
		return FLUXVM_LB_NONE;
	*sid = svc->service_id;
	*flags = svc->flags;
	if (*flags & FLUXVM_SVC_F_DSR)
		return FLUXVM_LB_DSR;
	return edge == FLUXVM_EDGE_NS ? FLUXVM_LB_SNAT : FLUXVM_LB_NAT;
}

/* Is a SYN-ACK on conntrack entry @ct stale, i.e. does it answer a
 * connection that did not come through the VIP? Not while the flow is in
 * its handshake, nor on an established, unexpired flow (a retransmission:
 * the client's ACK was lost on its way to the backend, and the client's
 * stack must see the SYN-ACK to answer it). After the flow's FIN or RST,
 * or past its deadline, the client may have reused its port for a direct
 * connection to the backend. */
static __always_inline int fluxvm_synack_stale(const struct fluxvm_ct_value *ct, __u64 now)
{
	if (ct->state == FLUXVM_CT_TCP_SYN)
		return 0;
	return ct->state != FLUXVM_CT_TCP_ESTABLISHED || ct->deadline_ns < now;
}

/* Which replies a reply path translates. */
#define FLUXVM_REPLY_EW 0   /* VM-edge egress: replies to east-west clients */
#define FLUXVM_REPLY_SNAT 1 /* ingress hooks, north-south egress: replies to the SNAT address */

/* Is the reverse-NAT entry of backend @bid (the reply @pkt matched) the
 * other half of conntrack entry @ct? */
static __always_inline int fluxvm_ct_owns_nat(const struct fluxvm_ct_value *ct, __u32 bid,
					      const struct fluxvm_pkt *pkt, int snat)
{
	if (ct->backend_id != bid)
		return 0;
	if (!snat)
		return !(ct->flags & (FLUXVM_CT_F_SNAT | FLUXVM_CT_F_DSR));
	return (ct->flags & FLUXVM_CT_F_SNAT) && ct->nat_port == pkt->dport;
}

#ifdef FLUXVM_CTX_SKB
/*
 * Backend -> client: translate the source back to the VIP and port the
 * client used (and, for SNAT, the destination back to the client), and
 * keep the conntrack half current (state changes, idle deadline, and
 * recreation if the LRU evicted it). @ingress allows host routing.
 */
static __always_inline int fluxvm_lb_reply(struct __ctx_buff *ctx,
					   struct fluxvm_pkt *pkt, const int v6,
					   const int kind, const int ingress)
{
	struct fluxvm_tuple4 t4 = {}, c4 = {};
	struct fluxvm_tuple6 t6 = {}, c6 = {};
	void *nat_map = v6 ? (void *)&fluxvm_nat6 : (void *)&fluxvm_nat4;
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *key = v6 ? (void *)&t6 : (void *)&t4;
	void *ct_key = v6 ? (void *)&c6 : (void *)&c4;
	struct fluxvm_svc_stats_value *st, *es;
	struct fluxvm_nat_value *nat;
	struct fluxvm_scratch *scr;
	struct fluxvm_ct_value *ct;
	const __be32 *client, *vip;
	__be16 cport, vport;
	__u32 nat_sid, nat_bid, nat_flow;
	int synack, snat, refresh, ret;
	__u8 nat_flags;
	__u64 now;

	if (pkt->l4_proto != IPPROTO_TCP && pkt->l4_proto != IPPROTO_UDP)
		return CTX_ACT_NEXT;
	if (pkt->frag == FLUXVM_FRAG_LATER)
		return CTX_ACT_NEXT;
	if (kind == FLUXVM_REPLY_SNAT && !fluxvm_is_snat_addr(pkt->daddr, v6))
		return CTX_ACT_NEXT;

	fluxvm_pkt_tuple(pkt, v6, &t4, &t6);
	nat = bpf_map_lookup_elem(nat_map, key);
	if (!nat)
		return CTX_ACT_NEXT;
	/*
	 * Copy what is needed before any other map operation: an LRU entry
	 * may be recycled for another flow by an update on another CPU, so
	 * @nat is only read here, and its refresh stamp written right after.
	 * The client's view of the flow (the conntrack key) holds the copies
	 * of the addresses and ports, so they take no more stack.
	 */
	nat_flags = nat->flags;
	snat = !!(nat_flags & FLUXVM_NAT_F_SNAT);
	if (snat != (kind == FLUXVM_REPLY_SNAT))
		return CTX_ACT_NEXT;
	if (v6) {
		__builtin_memcpy(c6.saddr, snat ? nat->client : pkt->daddr, 16);
		__builtin_memcpy(c6.daddr, nat->vip, 16);
		c6.sport = snat ? nat->cport : pkt->dport;
		c6.dport = nat->vport;
		c6.proto = pkt->l4_proto;
		client = c6.saddr;
		vip = c6.daddr;
		cport = c6.sport;
		vport = c6.dport;
	} else {
		c4.saddr = snat ? nat->client[0] : pkt->daddr[0];
		c4.daddr = nat->vip[0];
		c4.sport = snat ? nat->cport : pkt->dport;
		c4.dport = nat->vport;
		c4.proto = pkt->l4_proto;
		client = &c4.saddr;
		vip = &c4.daddr;
		cport = c4.sport;
		vport = c4.dport;
	}
	nat_sid = nat->service_id;
	nat_bid = nat->backend_id;
	nat_flow = nat->flow;
	now = bpf_ktime_get_coarse_ns();
	synack = pkt->l4_proto == IPPROTO_TCP &&
		 (pkt->tcp_flags & (FLUXVM_TCP_SYN | FLUXVM_TCP_ACK)) == (FLUXVM_TCP_SYN | FLUXVM_TCP_ACK);
	refresh = synack || now - nat->last_seen_ns >= FLUXVM_CT_REFRESH_NS ||
		  (pkt->l4_proto == IPPROTO_TCP && (pkt->tcp_flags & (FLUXVM_TCP_FIN | FLUXVM_TCP_RST)));
	if (refresh && pkt->frag == FLUXVM_FRAG_NONE)
		nat->last_seen_ns = now;
	st = fluxvm_stats(nat_sid);
	es = fluxvm_edge(ctx);
	if (pkt->frag != FLUXVM_FRAG_NONE)
		return fluxvm_drop(FLUXVM_DROP_FRAGMENT, st, es);

	if (refresh) {
		ct = bpf_map_lookup_elem(ct_map, ct_key);
		/*
		 * A SYN-ACK answers a handshake. If our flow is not in one (for
		 * an east-west flow: nor established and unexpired, where it is
		 * a retransmission, fluxvm_synack_stale), the backend is
		 * answering a connection that did not come through the VIP
		 * (the client reused its port for a direct connection to the
		 * backend after our flow ended): this reverse-NAT entry is
		 * stale and would hijack that connection. Drop the entry and
		 * let the packet through untouched. (A handshake whose
		 * conntrack half was evicted recovers: the client's SYN
		 * retransmit learns both halves again.)
		 */
		if (synack && (!ct || !fluxvm_ct_owns_nat(ct, nat_bid, pkt, snat) ||
			       (snat ? ct->state != FLUXVM_CT_TCP_SYN
				     : fluxvm_synack_stale(ct, now)))) {
			bpf_map_delete_elem(nat_map, key);
			fluxvm_count(FLUXVM_CNT_NAT_STALE);
			return CTX_ACT_NEXT;
		}
		if (ct) {
			/* After a failover the flow's conntrack names another
			 * backend; this half is an orphan the GC removes. */
			if (fluxvm_ct_owns_nat(ct, nat_bid, pkt, snat))
				fluxvm_ha_touched(ct, v6, &c4, &c6,
						  fluxvm_ct_touch(ct, fluxvm_ct_next(ct->state, pkt, 1), now));
		} else if ((scr = fluxvm_scratch_get())) {
			/* Built in per-CPU scratch (maps.h), off the stack. */
			struct fluxvm_ct_value *nct = &scr->nct;

			__builtin_memset(nct, 0, sizeof(*nct));
			nct->service_id = nat_sid;
			nct->backend_id = nat_bid;
			/* The flow keeps its record: its next packets count
			 * into it. */
			nct->flow = nat_flow;
			nct->created_ns = now;
			nct->last_seen_ns = now;
			nct->state = fluxvm_ct_next(FLUXVM_CT_NONE, pkt, 1);
			nct->deadline_ns = now + fluxvm_timeout_ns(fluxvm_meta_get(), nct->state);
			if (snat) {
				nct->flags = FLUXVM_CT_F_SNAT;
				nct->nat_port = pkt->dport;
				__builtin_memcpy(nct->nat_addr, pkt->daddr, 16);
			}
			bpf_map_update_elem(ct_map, ct_key, nct, BPF_NOEXIST);
		}
	}

	/* Leaving toward the client here (an egress hook): paced. */
	if (!ingress && (ret = fluxvm_edt_pace(ctx, nat_sid, now, fluxvm_tcp_control(pkt), st, es)))
		return ret;
	if (fluxvm_rewrite(ctx, pkt, v6, 0, vip, vport))
		return fluxvm_drop(FLUXVM_DROP_REWRITE, st, es);
	if (snat && fluxvm_rewrite(ctx, pkt, v6, 1, client, cport))
		return fluxvm_drop(FLUXVM_DROP_REWRITE, st, es);
	fluxvm_count_translated(st, es, ctx_full_len(ctx), 1);
	ret = TC_ACT_OK;
	if (ingress && (nat_flags & FLUXVM_NAT_F_HOST_ROUTING))
		ret = fluxvm_host_route(ctx, pkt, v6);
	/* Counted into the record once it will be sent, as the forward
	 * direction (a north-south reply the uplink's pacing drops is
	 * taken back there, fluxvm_edt_ns_out). */
	if (nat_flow && ret != CTX_ACT_DROP)
		fluxvm_flow_reply(ctx, nat_flow, nat_sid, now);
	return ret;
}

#endif /* FLUXVM_CTX_SKB */

#ifdef FLUXVM_CTX_SKB
/* fluxvm_lb_reply_ew found no flow through the slots of the backend's
 * fluxvm_be2fe entry: the flow may have a stored reverse-NAT half (a
 * frontend past the slots, a flow of generation 3, or one whose conntrack
 * entry the LRU evicted and the half rebuilds): the stored path,
 * fluxvm_lb_reply with FLUXVM_REPLY_EW. Never a TC verdict. */
#define FLUXVM_REPLY_STORED 0x100

/*
 * Backend -> east-west client (VM-edge egress): translate the source back
 * to the VIP and port the client used, found from the flow's conntrack
 * entry (rev.h), and keep that entry current.
 *
 * A stale SYN-ACK (fluxvm_synack_stale) removes the entry; the packet then
 * goes to the stored path, which removes a reverse-NAT half left without
 * its flow and passes the packet untouched (or translates it for the
 * tuple's flow of a frontend past the slots, if there is one).
 */
static __always_inline int fluxvm_lb_reply_ew(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt,
					      const int v6)
{
	struct fluxvm_tuple4 c4 = {};
	struct fluxvm_tuple6 c6 = {};
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *ct_key = v6 ? (void *)&c6 : (void *)&c4;
	struct fluxvm_svc_stats_value *st, *es;
	struct fluxvm_ct_value *ct;
	struct fluxvm_rev r;
	__u64 now;
	__u32 flow;
	int synack, ret;

	if (pkt->l4_proto != IPPROTO_TCP && pkt->l4_proto != IPPROTO_UDP)
		return CTX_ACT_NEXT;
	if (pkt->frag == FLUXVM_FRAG_LATER)
		return CTX_ACT_NEXT;
	now = bpf_ktime_get_coarse_ns();
	synack = pkt->l4_proto == IPPROTO_TCP &&
		 (pkt->tcp_flags & (FLUXVM_TCP_SYN | FLUXVM_TCP_ACK)) == (FLUXVM_TCP_SYN | FLUXVM_TCP_ACK);
	r.indexed = 0;
	ct = fluxvm_rev_find(pkt->saddr, pkt->sport, pkt->daddr, pkt->dport, pkt->l4_proto, v6,
			     synack, now, &c4, &c6, &r);
	if (!ct)
		return r.indexed ? FLUXVM_REPLY_STORED : CTX_ACT_NEXT;
	st = fluxvm_stats(r.service_id);
	es = fluxvm_edge(ctx);
	if (pkt->frag != FLUXVM_FRAG_NONE)
		return fluxvm_drop(FLUXVM_DROP_FRAGMENT, st, es);

	if (synack && fluxvm_synack_stale(ct, now)) {
		bpf_map_delete_elem(ct_map, ct_key);
		fluxvm_count(FLUXVM_CNT_NAT_STALE);
		return FLUXVM_REPLY_STORED;
	}
	/* The flow's one entry: a reply's transition or due refresh queues
	 * it as a forward packet's would (lib/ha.h). */
	fluxvm_ha_touched(ct, v6, &c4, &c6, fluxvm_ct_touch(ct, fluxvm_ct_next(ct->state, pkt, 1), now));

	if ((ret = fluxvm_edt_pace(ctx, r.service_id, now, fluxvm_tcp_control(pkt), st, es)))
		return ret;
	/* Counted into the record before the rewrite: after it, the count
	 * costs the verifier 11,000 instructions this program has not got.
	 * The rewrite of a packet the parser checked cannot fail short of
	 * bpf_skb_store_bytes failing; if it does, the count is taken back. */
	flow = ct->flow;
	if (flow)
		fluxvm_flow_reply(ctx, flow, r.service_id, now);
	if (fluxvm_rewrite(ctx, pkt, v6, 0, r.vip, r.vport)) {
		if (flow)
			fluxvm_flow_reply(ctx, flow, r.service_id, 0);
		return fluxvm_drop(FLUXVM_DROP_REWRITE, st, es);
	}
	fluxvm_count_translated(st, es, ctx_full_len(ctx), 1);
	return TC_ACT_OK;
}
#endif /* FLUXVM_CTX_SKB */

#endif /* FLUXVM_LIB_LB_H */
