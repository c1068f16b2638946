/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The reply path (TC only): backend -> client packets translated back to
 * the VIP the client used, the flow's conntrack entry kept current. Two
 * ways to the flow: the conntrack entry itself, found through
 * fluxvm_be2fe (fluxvm_lb_reply_ew, east-west), or a stored reverse-NAT
 * half keyed by the reply (fluxvm_lb_reply: SNAT, and east-west frontends
 * the index cannot list).
 */
#ifndef FLUXVM_LIB_LB_REPLY_H
#define FLUXVM_LIB_LB_REPLY_H

#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "ct.h"
#include "nat.h"
#include "snat.h"
#include "rev.h"
#include "flows.h"
#include "ha.h"
#include "edt.h"
#include "lb_types.h"
#include "lb_send_tc.h"

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
	struct fluxvm_tuple6 c6 = {};
	void *nat_map = v6 ? (void *)&fluxvm_nat6 : (void *)&fluxvm_nat4;
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	struct fluxvm_tuple6 *t6 = NULL;
	void *key = &t4;
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
	/* FLUXVM_REPLY_SNAT: every caller sent only packets to an SNAT
	 * address of the node or its group (fluxvm_is_snat_addr), and the
	 * mapping found must be an SNAT one (below), so the address is not
	 * looked up again: a second fluxvm_snat_peers lookup would be the
	 * whole cost of a reply to a peer's address twice. */

	/* IPv6: the reverse-NAT key in per-CPU scratch, off the frame of
	 * the global paths this runs in (the deepest call chains). */
	if (v6) {
		t6 = fluxvm_scratch_tuple6();
		if (!t6)
			return CTX_ACT_NEXT;
		key = t6;
	}
	fluxvm_pkt_tuple(pkt, v6, &t4, t6);
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
	synack = pkt->l4_proto == IPPROTO_TCP &&
		 (pkt->tcp_flags & (FLUXVM_TCP_SYN | FLUXVM_TCP_ACK)) == (FLUXVM_TCP_SYN | FLUXVM_TCP_ACK);
	r.indexed = 0;
	now = 0; /* read by fluxvm_rev_find once the index lists the source */
	ct = fluxvm_rev_find(pkt->saddr, pkt->sport, pkt->daddr, pkt->dport, pkt->l4_proto, v6,
			     synack, &now, &c4, &c6, &r);
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

#endif /* FLUXVM_LIB_LB_REPLY_H */
