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
 * Fragments addressed to a VIP are dropped (FLUXVM_DROP_FRAGMENT): later
 * fragments carry no ports, so translating only the first would send the
 * rest, untranslated, to the VIP. TCP avoids fragmentation with PMTU
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

static __always_inline struct fluxvm_backend *fluxvm_backend_get(__u32 id)
{
	return bpf_map_lookup_elem(&fluxvm_backends, &id);
}

/* May an established flow of service @sid stay on @be at time @now? */
static __always_inline int fluxvm_backend_keeps(const struct fluxvm_backend *be,
						__u32 sid, __u64 now)
{
	if (!be || be->service_id != sid)
		return 0;
	if (be->state == FLUXVM_BE_READY)
		return 1;
	return be->state == FLUXVM_BE_DRAINING && now < be->drain_until_ns;
}

/* The backend id in slot hash % M of the service's table, or 0. */
static __always_inline __u32 fluxvm_maglev_pick(__u32 sid, __u32 hash)
{
	__u32 slot = hash % FLUXVM_MAGLEV_SIZE;
	void *table = bpf_map_lookup_elem(&fluxvm_maglev, &sid);
	__u32 *id;

	if (!table)
		return 0;
	id = bpf_map_lookup_elem(table, &slot);
	return id ? *id : 0;
}

/* Client -> VIP: pick or keep a backend and DNAT to it. */
static __always_inline int fluxvm_lb_forward(struct __sk_buff *skb,
					     struct fluxvm_pkt *pkt, const int v6)
{
	struct fluxvm_tuple4 t4 = {};
	struct fluxvm_tuple6 t6 = {};
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *ct_key = v6 ? (void *)&t6 : (void *)&t4;
	struct fluxvm_ct_value *ct, nct = {};
	struct fluxvm_svc_value *svc;
	struct fluxvm_svc_stats_value *st, *es;
	struct fluxvm_guard *guard;
	struct fluxvm_backend *be;
	struct fluxvm_meta_value *meta;
	__u32 sid, bid, hash;
	int failover = 0;
	__u64 now;

	if (pkt->l4_proto != IPPROTO_TCP && pkt->l4_proto != IPPROTO_UDP)
		return FLUXVM_TC_NEXT;
	if (pkt->frag != FLUXVM_FRAG_NONE) {
		svc = fluxvm_frontend(pkt, v6, 0);
		if (!svc)
			return FLUXVM_TC_NEXT;
		return fluxvm_drop(FLUXVM_DROP_FRAGMENT, fluxvm_stats(svc->service_id), fluxvm_edge(skb));
	}
	svc = fluxvm_frontend(pkt, v6, pkt->dport);
	if (!svc || (svc->flags & FLUXVM_SVC_F_VIP_MARKER))
		return FLUXVM_TC_NEXT;

	sid = svc->service_id;
	st = fluxvm_stats(sid);
	es = fluxvm_edge(skb);
	guard = bpf_map_lookup_elem(&fluxvm_sguard, &sid);
	if (!guard || guard->state != FLUXVM_GUARD_OPEN)
		return fluxvm_drop(FLUXVM_DROP_GUARD_CLOSED, st, es);

	fluxvm_pkt_tuple(pkt, v6, &t4, &t6);

	now = bpf_ktime_get_coarse_ns();
	ct = bpf_map_lookup_elem(ct_map, ct_key);
	if (ct && ct->service_id == sid) {
		bid = ct->backend_id;
		be = fluxvm_backend_get(bid);
		if (fluxvm_backend_keeps(be, sid, now)) {
			/* A fresh SYN on a closed entry is a new connection
			 * reusing the tuple: it gets a fresh pick. */
			if (!(fluxvm_tcp_is_syn(pkt) && ct->state >= FLUXVM_CT_TCP_FIN)) {
				if (fluxvm_ct_touch(ct, fluxvm_ct_next(ct->state, pkt, 0), now) &&
				    fluxvm_nat_ensure(pkt, v6, be, sid, bid, now))
					return fluxvm_drop(FLUXVM_DROP_NAT_UPDATE, st, es);
				goto rewrite;
			}
		} else {
			failover = 1;
		}
	}

	meta = fluxvm_meta_get();
	hash = v6 ? fluxvm_hash6(&t6, meta ? meta->hash_seed : 0)
		  : fluxvm_hash4(&t4, meta ? meta->hash_seed : 0);
	bid = fluxvm_maglev_pick(sid, hash);
	if (!bid)
		return fluxvm_drop(FLUXVM_DROP_NO_BACKEND, st, es);
	be = fluxvm_backend_get(bid);
	if (!be || be->service_id != sid || be->state != FLUXVM_BE_READY)
		return fluxvm_drop(FLUXVM_DROP_BACKEND_INVALID, st, es);

	/* Learn both halves before the rewrite, whose helpers invalidate
	 * packet pointers. */
	nct.service_id = sid;
	nct.backend_id = bid;
	nct.created_ns = now;
	nct.last_seen_ns = now;
	nct.state = fluxvm_ct_next(FLUXVM_CT_NONE, pkt, 0);
	nct.deadline_ns = now + fluxvm_timeout_ns(meta, nct.state);
	if (bpf_map_update_elem(ct_map, ct_key, &nct, BPF_ANY))
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	if (fluxvm_nat_learn(pkt, v6, be, sid, bid, now))
		return fluxvm_drop(FLUXVM_DROP_NAT_UPDATE, st, es);
	if (st) {
		st->new_flows++;
		st->failovers += failover;
	}
	if (es) {
		es->new_flows++;
		es->failovers += failover;
	}

rewrite:
	if (fluxvm_rewrite(skb, pkt, v6, 1, be->addr, be->port))
		return fluxvm_drop(FLUXVM_DROP_REWRITE, st, es);
	fluxvm_count_translated(st, es, skb->len, 0);
	/* TC_ACT_OK ends the chain: the VM policy program behind us never
	 * sees the backend address and port. */
	return TC_ACT_OK;
}

/*
 * Backend -> client: translate the source back to the VIP and port the
 * client used, and keep the conntrack half current (state changes, idle
 * deadline, and recreation if the LRU evicted it).
 */
static __always_inline int fluxvm_lb_reply(struct __sk_buff *skb,
					   struct fluxvm_pkt *pkt, const int v6)
{
	struct fluxvm_tuple4 t4 = {}, c4 = {};
	struct fluxvm_tuple6 t6 = {}, c6 = {};
	void *nat_map = v6 ? (void *)&fluxvm_nat6 : (void *)&fluxvm_nat4;
	void *ct_map = v6 ? (void *)&fluxvm_fct6 : (void *)&fluxvm_fct4;
	void *key = v6 ? (void *)&t6 : (void *)&t4;
	void *ct_key = v6 ? (void *)&c6 : (void *)&c4;
	struct fluxvm_svc_stats_value *st, *es;
	struct fluxvm_nat_value *nat;
	struct fluxvm_ct_value *ct;
	int synack;
	__u64 now;

	if (pkt->l4_proto != IPPROTO_TCP && pkt->l4_proto != IPPROTO_UDP)
		return FLUXVM_TC_NEXT;
	if (pkt->frag == FLUXVM_FRAG_LATER)
		return FLUXVM_TC_NEXT;

	fluxvm_pkt_tuple(pkt, v6, &t4, &t6);
	nat = bpf_map_lookup_elem(nat_map, key);
	if (!nat)
		return FLUXVM_TC_NEXT;
	st = fluxvm_stats(nat->service_id);
	es = fluxvm_edge(skb);
	if (pkt->frag != FLUXVM_FRAG_NONE)
		return fluxvm_drop(FLUXVM_DROP_FRAGMENT, st, es);

	now = bpf_ktime_get_coarse_ns();
	synack = pkt->l4_proto == IPPROTO_TCP &&
		 (pkt->tcp_flags & (FLUXVM_TCP_SYN | FLUXVM_TCP_ACK)) == (FLUXVM_TCP_SYN | FLUXVM_TCP_ACK);
	if (synack || now - nat->last_seen_ns >= FLUXVM_CT_REFRESH_NS ||
	    (pkt->l4_proto == IPPROTO_TCP && (pkt->tcp_flags & (FLUXVM_TCP_FIN | FLUXVM_TCP_RST)))) {
		/* The client's view of the flow. */
		if (v6) {
			__builtin_memcpy(c6.saddr, pkt->daddr, 16);
			__builtin_memcpy(c6.daddr, nat->vip, 16);
			c6.sport = pkt->dport;
			c6.dport = nat->vport;
			c6.proto = pkt->l4_proto;
		} else {
			c4.saddr = pkt->daddr[0];
			c4.daddr = nat->vip[0];
			c4.sport = pkt->dport;
			c4.dport = nat->vport;
			c4.proto = pkt->l4_proto;
		}
		ct = bpf_map_lookup_elem(ct_map, ct_key);
		/*
		 * A SYN-ACK answers a handshake. If our flow is not in one, the
		 * backend is answering a connection that did not come through
		 * the VIP (the client reused its port for a direct connection
		 * to the backend after our flow ended): this reverse-NAT entry
		 * is stale and would hijack that connection. Drop the entry and
		 * let the packet through untouched. (A handshake whose
		 * conntrack half was evicted recovers: the client's SYN
		 * retransmit learns both halves again.)
		 */
		if (synack && (!ct || ct->backend_id != nat->backend_id || ct->state != FLUXVM_CT_TCP_SYN)) {
			bpf_map_delete_elem(nat_map, key);
			fluxvm_count(FLUXVM_CNT_NAT_STALE);
			return FLUXVM_TC_NEXT;
		}
		nat->last_seen_ns = now;
		if (ct) {
			/* After a failover the flow's conntrack names another
			 * backend; this half is an orphan the GC removes. */
			if (ct->backend_id == nat->backend_id)
				fluxvm_ct_touch(ct, fluxvm_ct_next(ct->state, pkt, 1), now);
		} else {
			struct fluxvm_ct_value nct = {
				.service_id = nat->service_id,
				.backend_id = nat->backend_id,
				.created_ns = now,
				.last_seen_ns = now,
			};

			nct.state = fluxvm_ct_next(FLUXVM_CT_NONE, pkt, 1);
			nct.deadline_ns = now + fluxvm_timeout_ns(fluxvm_meta_get(), nct.state);
			bpf_map_update_elem(ct_map, ct_key, &nct, BPF_NOEXIST);
		}
	}

	if (fluxvm_rewrite(skb, pkt, v6, 0, nat->vip, nat->vport))
		return fluxvm_drop(FLUXVM_DROP_REWRITE, st, es);
	fluxvm_count_translated(st, es, skb->len, 1);
	return TC_ACT_OK;
}

#endif /* FLUXVM_LIB_LB_H */
