/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * HA mutation queue (maps: fluxvm_haq, fluxvm_hadrop; layout:
 * fluxvm_ha_record in fluxvm_service_v6.bpf.h).
 *
 * HA replicates a north-south edge's flows to a standby edge (another
 * node): the flows of the north-south kinds, SNAT and DSR
 * (FLUXVM_CT_F_SNAT, FLUXVM_CT_F_DSR). East-west flows belong to this
 * node's own VMs, and a standby can never use them; L7 entries are not
 * replicated either. While HA replication is on (FLUXVM_META_F_HA), the
 * datapath queues one record per write of a north-south entry the standby
 * must learn: the flow as the client sent it, its backend by address (ids
 * are this node's and may be reused before userspace reads the record)
 * and the entry as written. Userspace drains the ring into the journal
 * the standby pulls (package ha), which upserts the whole flow. A record
 * is queued when
 *   - a north-south forward path (SNAT, DSR) writes a new entry (new
 *     flow, re-pick, failover): FLUXVM_HA_NEW;
 *   - a conntrack hit (forward or reply: both touch the flow's one entry)
 *     changes the entry's state, SYN -> ESTABLISHED, -> FIN, -> RST:
 *     FLUXVM_HA_TRANSITION, so the standby's copy has the state's
 *     timeout, not the handshake's;
 *   - a hit's refresh pushes the deadline past the one the standby holds:
 *     FLUXVM_HA_REFRESH (the rule below).
 * The east-west path (fluxvm_lb_nat) and its replies queue nothing, so
 * the ring's room (tier S: some 1,900 records) is the north-south
 * flows' alone; their entries keep ha_until 0, which nothing reads.
 *
 * The refresh rule. Every record carries hold_s, half the timeout T of
 * the entry's state, and the standby keeps the flow until the entry's
 * deadline D plus hold_s (ha.Drainer adds it to the TTL). The entry keeps
 * that second in ha_until (FLUXVM_CT_HA_UNTIL; in a union with the
 * l7_ifindex of L7 entries, which are never replicated). A refresh is due when the entry's deadline, pushed by a
 * hit (now + T), passes ha_until. So, with a record lost to nothing:
 *   - the standby's copy never expires before the active's entry: after
 *     every write D <= ha_until <= the standby's deadline (ha_until is
 *     rounded down to a second), whatever the gaps between packets;
 *   - a busy flow queues one refresh per T/2 (30 s for UDP at the default
 *     60 s, 3 h for an established TCP flow), an idle one none; the
 *     standby's copy outlives the active's by at most T/2, which its GC
 *     then removes.
 * Replies refresh the forward entry (a server-push stream whose client
 * is silent) and emit by the same rule; reverse-NAT halves are not
 * replicated on their own (the standby derives them from the flow).
 *
 * A record the ring has no room for is counted in fluxvm_hadrop; ha_until
 * moves on regardless (one retry a second per flow would only keep the
 * ring full), and the periodic snapshot-diff in userspace restores what
 * it would have carried, so a full ring costs replication lag, never
 * state.
 *
 * Only TC emits: under HA, XDP leaves to TC every packet that would emit,
 * counted in xdp_pass_ha: new flows (fluxvm_ha_xdp_pass) and the hits of
 * fluxvm_ha_xdp_hit (TCP control packets, TCP entries not ESTABLISHED, a
 * refresh due); so one path, verified once, owns the queue, and XDP's
 * stack (at the kernel's limit) takes nothing. Entries the datapath
 * rebuilds from a flow's other half are the same flow and emit nothing
 * (their ha_until is 0: their next forward refresh re-sends them);
 * deletes are userspace's (GC), which journals them itself.
 */
#ifndef FLUXVM_LIB_HA_H
#define FLUXVM_LIB_HA_H

#include "config.h"
#include "maps.h"
#include "counters.h"
#include "ct.h"
#include "svc.h"

/* A north-south (SNAT or DSR) entry's ha_until (see the top of this file
 * and struct fluxvm_ct_value, whose union it shares with the L7 proxy's
 * ifindex). */
#define FLUXVM_CT_HA_UNTIL(ct) ((ct)->ha_until)

/* Whether HA replication is on: loaded (FLUXVM_FEATURE_ON(ha), a
 * constant: with it off, no HA code is verified) and switched on in the
 * meta map. */
static __always_inline int fluxvm_ha_on(const struct fluxvm_meta_value *meta)
{
	if (!FLUXVM_FEATURE_ON(ha))
		return 0;
	return meta && (meta->flags & FLUXVM_META_F_HA);
}

/* The standby's lead on an entry in @state: half the state's timeout. */
static __always_inline __u32 fluxvm_ha_hold_s(const struct fluxvm_meta_value *meta, __u8 state)
{
	return fluxvm_timeout_s(meta, state) / 2;
}

/* The second until which the standby holds entry @ct once the record of
 * it as it is now is applied (rounded down: the rule errs early). */
static __always_inline __u32 fluxvm_ha_until(const struct fluxvm_ct_value *ct, __u32 hold_s)
{
	return (__u32)(ct->deadline_ns / 1000000000ULL) + hold_s;
}

/* Would deadline @deadline of entry @ct pass the one the standby holds? */
static __always_inline int fluxvm_ha_due(const struct fluxvm_ct_value *ct, __u64 deadline)
{
	return deadline > (__u64)FLUXVM_CT_HA_UNTIL(ct) * 1000000000ULL;
}

#ifdef FLUXVM_CTX_SKB
/*
 * Queue entry @ct of the flow keyed @k4 (IPv4) or @k6 (IPv6: @k4 NULL)
 * for @cause (enum fluxvm_ha_cause), while HA is on and the entry is of
 * a north-south kind (SNAT or DSR); any other entry (east-west, L7)
 * returns at once, its ha_until untouched. FLUXVM_HA_NEW: @ct
 * is the entry just written (the scratch copy; fluxvm_ct_build set its
 * ha_until). Otherwise @ct is the map's entry a hit just touched: a
 * FLUXVM_HA_REFRESH is queued only when due, and either moves ha_until
 * on. A global function: verified once, its record built in the ring's
 * memory, not on the stack, and the hit paths pay a call only when they
 * wrote their entry (at most once a second per flow, or a new state).
 */
__attribute__((noinline)) int fluxvm_ha_emit(struct fluxvm_ct_value *ct, struct fluxvm_tuple4 *k4,
					     struct fluxvm_tuple6 *k6, __u32 cause)
{
	struct fluxvm_meta_value *meta = fluxvm_meta_get();
	struct fluxvm_ha_record *r;
	struct fluxvm_backend *be;
	__u32 zero = 0, hold;
	__u64 *drops;

	/* (No test of @k4 and @k6 together here: clang ORs the pointers,
	 * which the verifier refuses. Neither: the record is discarded.) */
	if (!ct || !fluxvm_ha_on(meta) || !(ct->flags & (FLUXVM_CT_F_SNAT | FLUXVM_CT_F_DSR)))
		return 0;
	hold = fluxvm_ha_hold_s(meta, ct->state);
	if (cause != FLUXVM_HA_NEW) {
		if (cause == FLUXVM_HA_REFRESH && !fluxvm_ha_due(ct, ct->deadline_ns))
			return 0;
		/* Before the copy: the record carries the entry as it now is. */
		FLUXVM_CT_HA_UNTIL(ct) = fluxvm_ha_until(ct, hold);
	}
	be = fluxvm_backend_get(ct->backend_id);
	if (!be)
		return 0;
	r = bpf_ringbuf_reserve(&fluxvm_haq, sizeof(*r), 0);
	if (!r) {
		drops = bpf_map_lookup_elem(&fluxvm_hadrop, &zero);
		if (drops)
			*drops += 1;
		return 0;
	}
	__builtin_memset(r, 0, sizeof(*r));
	r->op = FLUXVM_HA_UPSERT;
	r->cause = cause;
	r->bport = be->port;
	r->hold_s = hold;
	if (k6) {
		r->family = FLUXVM_AF_INET6;
		r->proto = k6->proto;
		r->cport = k6->sport;
		r->vport = k6->dport;
		__builtin_memcpy(r->client, k6->saddr, 16);
		__builtin_memcpy(r->vip, k6->daddr, 16);
	} else if (k4) {
		r->family = FLUXVM_AF_INET;
		r->proto = k4->proto;
		r->cport = k4->sport;
		r->vport = k4->dport;
		r->client[0] = k4->saddr;
		r->vip[0] = k4->daddr;
	} else {
		bpf_ringbuf_discard(r, 0);
		return 0;
	}
	__builtin_memcpy(r->backend, be->addr, 16);
	__builtin_memcpy(&r->ct, ct, sizeof(r->ct));
	bpf_ringbuf_submit(r, 0);
	fluxvm_count(FLUXVM_CNT_HA_EMITTED);
	return 0;
}

/* The conntrack key of a forward path's flow, for the queue: its IPv4 or
 * IPv6 tuple (fluxvm_pkt_tuple). */
#define FLUXVM_HA_K4(v6, t4) ((v6) ? NULL : (t4))
#define FLUXVM_HA_K6(v6, t6) ((v6) ? (t6) : NULL)

/* After a forward path wrote @ct, the entry of a new flow (or a re-pick)
 * keyed @t4/@t6: its record, while HA is on, if the entry is north-south
 * (fluxvm_ha_emit). */
#define fluxvm_ha_learned(meta, ct, v6, t4, t6)                                          \
	do {                                                                             \
		if (fluxvm_ha_on(meta))                                                  \
			fluxvm_ha_emit((ct), FLUXVM_HA_K4(v6, t4), FLUXVM_HA_K6(v6, t6), \
				       FLUXVM_HA_NEW);                                   \
	} while (0)

/* After fluxvm_ct_touch of a hit on entry @ct keyed @t4/@t6 returned
 * @touched: a transition's record, or a refresh's when due. A call only
 * when the touch wrote; HA on and the entry's kind are checked there (an
 * east-west hit pays the call, at most once a second per flow, and
 * returns). */
#define fluxvm_ha_touched(ct, v6, t4, t6, touched)                                           \
	do {                                                                                 \
		int __t = (touched);                                                         \
		if (__t && FLUXVM_FEATURE_ON(ha))                                            \
			fluxvm_ha_emit((ct), FLUXVM_HA_K4(v6, t4), FLUXVM_HA_K6(v6, t6),     \
				       __t == FLUXVM_CT_TOUCH_STATE ? FLUXVM_HA_TRANSITION   \
								    : FLUXVM_HA_REFRESH);    \
	} while (0)

/* TC learns every flow and touches every entry itself. */
#define fluxvm_ha_xdp_pass(meta) 0
#define fluxvm_ha_xdp_hit(ct, pkt, now) 0
#else
#define fluxvm_ha_learned(meta, ct, v6, t4, t6) do { } while (0)
#define fluxvm_ha_touched(ct, v6, t4, t6, touched) ((void)(touched))

/* XDP leaves a new flow to TC while HA is on, counted. */
static __always_inline int fluxvm_ha_xdp_pass(const struct fluxvm_meta_value *meta)
{
	if (!fluxvm_ha_on(meta))
		return 0;
	fluxvm_count(FLUXVM_CNT_XDP_PASS_HA);
	return 1;
}

/*
 * A conntrack hit on entry @ct XDP must leave to TC while HA is on,
 * counted: one whose touch could change the entry's state (a TCP SYN,
 * FIN or RST; a TCP entry not ESTABLISHED) or whose refresh is due
 * (fluxvm_ct_touch would write, and its deadline, now + T, which is the
 * current deadline plus the time since the last write, would pass
 * ha_until). The established hits between refreshes, nearly all of them,
 * stay here. Inline and on registers: XDP's stack is at the kernel's
 * limit.
 */
static __always_inline int fluxvm_ha_xdp_hit(const struct fluxvm_ct_value *ct,
					     const struct fluxvm_pkt *pkt, __u64 now)
{
	__u64 idle;

	if (!fluxvm_ha_on(fluxvm_meta_get()))
		return 0;
	if (pkt->l4_proto == IPPROTO_TCP &&
	    (fluxvm_tcp_control(pkt) || ct->state != FLUXVM_CT_TCP_ESTABLISHED))
		goto pass;
	idle = now - ct->last_seen_ns;
	if (idle < FLUXVM_CT_REFRESH_NS || !fluxvm_ha_due(ct, ct->deadline_ns + idle))
		return 0;
pass:
	fluxvm_count(FLUXVM_CNT_XDP_PASS_HA);
	return 1;
}
#endif /* FLUXVM_CTX_SKB */

#endif /* FLUXVM_LIB_HA_H */
