/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * FluxScope: flow records in fluxvm_sflows (fluxvm_abi_node.bpf.h), a
 * ring every hook that learns or forwards flows writes.
 *
 * A new flow gets a record when sampled (meta flow_sample_rate N: 1 in N
 * new flows, by a random draw; 0: no record at all, no map write). Its
 * id (the low 32 bits of its seq) is reserved before the flow's learn
 * writes, which keep it (its conntrack entry, and its reverse-NAT half
 * where it has one), and the record is written only once every one of
 * them succeeded: a new flow whose learn fails (SNAT port exhaustion, a
 * full map) leaves no forwarded record, its seq unused, and its packet's
 * drop is recorded as any other. The packets of a flow count into its
 * record each way for the price of one array lookup, once the path sends
 * them (a forward path counts after its deliver stage: a packet it drops
 * counts as a drop, one XDP passes to TC is counted by TC; a reply counts
 * once its path will send it, after pacing, the rewrite and host routing,
 * and a north-south reply the uplink's pacing drops is taken back,
 * fluxvm_flow_uncount_reply); a flow whose slot a newer record took stops
 * counting (the ids differ).
 *
 * A drop of a client packet always records (while the sample rate is not
 * 0): into the flow's record when it has one (whose verdict reads dropped
 * while none of the flow's packets was sent: fluxvm_flow_sent sets it back
 * to forwarded, or audited, on the first one sent), else into a new record
 * with verdict dropped. New drop records take a budget that is the node's, one
 * token bucket shared by every CPU: at most FLUXVM_FLOW_DROP_BURST records
 * at once, refilled at FLUXVM_FLOW_DROP_RATE a second, so that over any
 * interval of t seconds the whole node opens at most
 * FLUXVM_FLOW_DROP_BURST + FLUXVM_FLOW_DROP_RATE * t drop records, however
 * many CPUs drop: a flood of drops (a SYN flood to a service without
 * backends) cannot evict every other record. The bucket is taken with a
 * compare-and-swap; two CPUs taking it at the same instant may lose a
 * token (one of them is refused), never gain one. Drops past the budget
 * are counted (flow_drop_limited).
 *
 * Counts are plain increments: a record is written by the CPUs of its
 * flow's packets, and two CPUs counting one direction of one flow at the
 * same instant may lose an increment (the datapath's per-CPU counters are
 * exact; records are telemetry).
 */
#ifndef FLUXVM_LIB_FLOWS_H
#define FLUXVM_LIB_FLOWS_H

#include "config.h"
#include "maps.h"
#include "counters.h"
#include "svc.h"
#include "ct.h"
#include "lb_types.h"

#define FLUXVM_FLOW_DROP_BURST 64
#define FLUXVM_FLOW_DROP_RATE 64 /* records a second, node-wide */
#define FLUXVM_FLOW_DROP_NS (1000000000ULL / FLUXVM_FLOW_DROP_RATE)

/* The record of flow @id while the ring holds it, or NULL; always NULL
 * while flow records are not loaded (FLUXVM_FEATURE_ON(flows)), so that
 * every path that counts into a record is dead code then. */
static __always_inline struct fluxvm_flow *fluxvm_flow_get(__u32 id)
{
	__u32 slot = id & (FLUXVM_FLOW_SLOTS - 1);
	struct fluxvm_flow *f;

	if (!FLUXVM_FEATURE_ON(flows) || !id)
		return NULL;
	f = bpf_map_lookup_elem(&fluxvm_sflows, &slot);
	if (!f || (__u32)f->seq != id)
		return NULL;
	return f;
}

/* Count a packet of @len bytes into flow @id's record: @reply is backend
 * -> client. The record must also name the flow's service @sid: an id is
 * 32 bits of a 64-bit sequence, and a conntrack entry carried over a
 * program reload names a slot of a new ring, so a matching id alone could
 * be another flow's record. */
static __always_inline void fluxvm_flow_count(__u32 id, __u32 sid, const int reply, __u32 len, __u64 now)
{
	struct fluxvm_flow *f = fluxvm_flow_get(id);

	if (!f || f->service_id != sid)
		return;
	if (reply) {
		f->rev_packets++;
		f->rev_bytes += len;
	} else {
		f->fwd_packets++;
		f->fwd_bytes += len;
	}
	f->last_ns = now;
}

/*
 * A reply of service @sid to @pkt's destination (the client) from its
 * source (the VIP), counted into its flow's record by the ingress hook
 * that translated it, then dropped as it left (the uplink's pacing,
 * fluxvm_edt_ns_out): taken back from the record. The flow's conntrack
 * entry (keyed by the client's view, here reversed, in scratch: the rare
 * path) names the record. Only after a drop.
 */
static __always_inline void fluxvm_flow_uncount_reply(const struct fluxvm_pkt *pkt, const int v6, __u32 sid,
						      __u32 len)
{
	struct fluxvm_scratch *scr = fluxvm_scratch_get();
	struct fluxvm_ct_value *ct;
	struct fluxvm_flow *f;
	void *map, *key;

	if (!FLUXVM_FEATURE_ON(flows) || !scr)
		return;
	map = fluxvm_ct_key_scratch(scr, pkt, v6, 1, &key);
	ct = bpf_map_lookup_elem(map, key);
	if (!ct || ct->service_id != sid || !(ct->flags & FLUXVM_CT_F_SNAT))
		return;
	f = fluxvm_flow_get(ct->flow);
	if (!f || f->service_id != sid || !f->rev_packets)
		return;
	f->rev_packets--;
	f->rev_bytes -= f->rev_bytes < len ? f->rev_bytes : len;
}

#ifdef FLUXVM_CTX_SKB
/* A reply of flow @id (service @sid) that its reply path sends: counted
 * into the record; @now 0: taken back (the path counted it, then could not
 * send it). A global function, called for recorded flows only: its
 * verifier cost is paid once, not in every state of the reply paths. */
__attribute__((noinline)) int fluxvm_flow_reply_count(struct __ctx_buff *ctx, __u32 id, __u32 sid, __u64 now)
{
	struct fluxvm_flow *f = fluxvm_flow_get(id);
	__u32 len = ctx_full_len(ctx);

	if (!f || f->service_id != sid)
		return 0;
	if (!now) {
		if (f->rev_packets) {
			f->rev_packets--;
			f->rev_bytes -= f->rev_bytes < len ? f->rev_bytes : len;
		}
		return 0;
	}
	f->rev_packets++;
	f->rev_bytes += len;
	f->last_ns = now;
	return 0;
}
/* The call, only while flow records are loaded. */
#define fluxvm_flow_reply(ctx, id, sid, now) \
	(FLUXVM_FEATURE_ON(flows) ? fluxvm_flow_reply_count((ctx), (id), (sid), (now)) : 0)
#endif

/* The flow of a forward path's conntrack entry @ct for fluxvm_flow_sent:
 * its record id, and whether the policy audited it. Never audited in XDP,
 * which passes every packet of a service with a policy to TC: its paths
 * do not read the entry's flags for it. */
static __always_inline union fluxvm_flow_ref fluxvm_flow_of(const struct fluxvm_ct_value *ct)
{
	union fluxvm_flow_ref r = { .info = { .id = ct->flow } };

#ifndef FLUXVM_CTX_XDP
	r.info.audited = !!(ct->flags & FLUXVM_CT_F_AUDITED);
#endif
	return r;
}

/*
 * A forward path's verdict @ret for a packet of flow @flow (fluxvm_flow_of)
 * of service @sid: counted into the flow's record when the packet is sent
 * (not dropped, nor passed on: XDP leaves it to TC, which counts it). The
 * first packet counted sets the record's verdict back to forwarded (or
 * audited) where drops after the learn stage (fluxvm_flow_drop) had set
 * it to dropped: the verdict is touched only while nothing was counted
 * forwarded, off the hot path.
 */
static __always_inline int fluxvm_flow_sent(struct __ctx_buff *ctx, int ret, union fluxvm_flow_ref flow, __u32 sid,
					    __u64 now)
{
	struct fluxvm_flow *f;

	if (!flow.info.id || ret == CTX_ACT_DROP || ret == CTX_ACT_NEXT)
		return ret;
	f = fluxvm_flow_get(flow.info.id);
	if (!f || f->service_id != sid)
		return ret;
	if (!f->fwd_packets)
		f->verdict = flow.info.audited ? FLUXVM_FLOW_AUDITED : FLUXVM_FLOW_FORWARDED;
	f->fwd_packets++;
	f->fwd_bytes += ctx_full_len(ctx);
	f->last_ns = now;
	return ret;
}

/* Whether a new flow gets a record, by the node's sample rate; never
 * while flow records are not loaded. */
static __always_inline int fluxvm_flow_sampled(const struct fluxvm_meta_value *meta)
{
	__u32 n;

	if (!FLUXVM_FEATURE_ON(flows))
		return 0;
	n = meta ? meta->flow_sample_rate : 0;

	return n == 1 || (n > 1 && bpf_get_prandom_u32() % n == 0);
}

/* The next record's seq (its low 32 bits never 0: id 0 means none), or 0
 * when the sequence cannot be had. */
static __always_inline __u64 fluxvm_flow_next_seq(void)
{
	__u32 zero = 0;
	__u64 *seqp = bpf_map_lookup_elem(&fluxvm_flow_seq, &zero), seq;

	if (!seqp)
		return 0;
	seq = __sync_fetch_and_add(seqp, 1) + 1;
	if (!(__u32)seq)
		seq = __sync_fetch_and_add(seqp, 1) + 1;
	return seq;
}

/*
 * Record @seq (fluxvm_flow_next_seq) for the flow of client packet @pkt
 * (its addresses and ports as the client sent them), cleared, with its
 * tuple, hook, interface, times, service, backend id and verdict, no
 * packet counted yet: its id (fluxvm_flow_get finds it), or 0 when the
 * ring cannot be had. No pointer to the caller's stack: a global
 * function's frame stays small (the XDP program's call chain is near the
 * 512-byte stack).
 */
static __always_inline __u32 fluxvm_flow_fill(struct fluxvm_flow *f, struct __ctx_buff *ctx,
					      const struct fluxvm_pkt *pkt, const int v6, __u8 hook, __u64 now,
					      __u32 sid, __u32 bid, __u8 verdict, __u64 seq)
{
	__builtin_memset(f, 0, sizeof(*f));
	f->seq = seq;
	if (v6) {
		__builtin_memcpy(f->client, pkt->saddr, 16);
		__builtin_memcpy(f->vip, pkt->daddr, 16);
	} else {
		f->client[0] = pkt->saddr[0];
		f->vip[0] = pkt->daddr[0];
	}
	f->cport = pkt->sport;
	f->vport = pkt->dport;
	f->proto = pkt->l4_proto;
	f->family = v6 ? FLUXVM_AF_INET6 : FLUXVM_AF_INET;
	f->hook = hook;
	f->ifindex = ctx_ifindex(ctx);
	f->first_ns = now;
	f->last_ns = now;
	f->service_id = sid;
	f->backend_id = bid;
	f->verdict = verdict;
	return (__u32)seq;
}

static __always_inline __u32 fluxvm_flow_new(struct __ctx_buff *ctx, const struct fluxvm_pkt *pkt,
					     const int v6, __u8 hook, __u64 now, __u32 sid, __u32 bid,
					     __u8 verdict, __u64 seq)
{
	__u32 slot = (__u32)seq & (FLUXVM_FLOW_SLOTS - 1);
	struct fluxvm_flow *f;

	if (!(__u32)seq)
		return 0;
	f = bpf_map_lookup_elem(&fluxvm_sflows, &slot);
	if (!f)
		return 0;
	return fluxvm_flow_fill(f, ctx, pkt, v6, hook, now, sid, bid, verdict, seq);
}

/*
 * A new flow's record id, reserved before its learn writes, or 0 when the
 * flow is not sampled: the learn stage stores it with the flow's state and
 * writes the record (fluxvm_flow_learn) once all of it is written. The
 * full seq waits in this CPU's scratch, with the path's clock @now: the
 * record's first_ns, so that the packet's count (fluxvm_flow_sent, at the
 * same @now) never leaves last_ns before first_ns.
 */
static __always_inline __u32 fluxvm_flow_reserve(const struct fluxvm_meta_value *meta, __u64 now)
{
	struct fluxvm_scratch *scr;
	__u64 seq;

	if (!fluxvm_flow_sampled(meta))
		return 0;
	scr = fluxvm_scratch_get();
	if (!scr)
		return 0;
	seq = fluxvm_flow_next_seq();
	scr->flow_seq = seq;
	scr->flow_now = now;
	return (__u32)seq;
}

/*
 * Write the record of a new flow forwarded to a backend, its id @id
 * reserved by fluxvm_flow_reserve on this CPU: its id, or 0. @info is the
 * word of a union fluxvm_flow_arg: the family, the verdict (audited,
 * redirected to the L7 proxy, else forwarded), the hook, the backend id
 * (ids are below the tier's 65,536) and the service id. A global function: the verifier checks it once, not once per
 * forward path. Its four arguments fit the four registers a call keeps,
 * so its frame stays within the 32 bytes the XDP program's deepest call
 * chain has left of the 512-byte stack.
 */
#ifdef FLUXVM_CTX_XDP
/* In XDP, inline: the call chain through the IPv6 SNAT path has no frame
 * to spare, while the frames it inlines into have room within their
 * rounding to 32 bytes. */
static __always_inline
#else
__attribute__((noinline))
#endif
int fluxvm_flow_open(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, __u64 info, __u32 id)
{
	struct fluxvm_scratch *scr = fluxvm_scratch_get();
	union fluxvm_flow_arg a = { .word = info };
	struct fluxvm_flow *f;
	__u32 slot;

	if (!pkt || !scr || !id || (__u32)scr->flow_seq != id)
		return 0;
	slot = id & (FLUXVM_FLOW_SLOTS - 1);
	f = bpf_map_lookup_elem(&fluxvm_sflows, &slot);
	if (!f)
		return 0;
	/* The seq and clock read back from scratch after the lookup, not
	 * kept across it: nothing spills, and the frame stays within 32
	 * bytes (the IPv6 NAT forward's chain, fluxvm_forward6_nat, needs
	 * the rest of the 448). */
	return (int)fluxvm_flow_fill(f, ctx, pkt, a.info.v6, a.info.hook, scr->flow_now, a.info.sid, a.info.bid,
				     a.info.audited ? FLUXVM_FLOW_AUDITED :
				     a.info.redirected ? FLUXVM_FLOW_REDIRECTED : FLUXVM_FLOW_FORWARDED,
				     scr->flow_seq);
}

/* The record of new flow @id (fluxvm_flow_reserve; 0: not sampled), once
 * its learn writes succeeded; @audited: the policy forwarded it under
 * audit_only. */
static __always_inline void fluxvm_flow_learn(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, const int v6,
					      __u32 id, __u8 hook, __u32 sid, __u32 bid,
					      const struct fluxvm_backend *be, int audited)
{
	struct fluxvm_flow *f;

	if (!id)
		return;
	id = (__u32)fluxvm_flow_open(ctx, pkt,
				     FLUXVM_FLOW_ARG(.v6 = !!v6, .audited = !!audited, .hook = hook,
						     .bid = (__u16)bid, .sid = sid),
				     id);
	/* The backend, here: a BPF call takes five arguments at most. */
	f = fluxvm_flow_get(id);
	if (f) {
		__builtin_memcpy(f->backend, be->addr, 16);
		f->bport = be->port;
		fluxvm_count(FLUXVM_CNT_FLOW_RECORDED);
	}
}

/* The SNAT address and port a recorded flow's source became. */
static __always_inline void fluxvm_flow_snat(__u32 id, const __be32 *addr, __be16 port)
{
	struct fluxvm_flow *f = fluxvm_flow_get(id);

	if (!f)
		return;
	__builtin_memcpy(f->snat, addr, 16);
	f->snat_port = port;
}

/*
 * Take a drop record from the node's budget (see the top of this file).
 * The bucket is kept as one time, *@empty_ns: the bucket holds
 * (now - empty_ns) / FLUXVM_FLOW_DROP_NS tokens, at most the burst; a
 * token taken moves it on by FLUXVM_FLOW_DROP_NS. One compare-and-swap:
 * a CPU that loses the race to another is refused (a token lost, never
 * one gained).
 */
static __always_inline int fluxvm_flow_budget_take(__u64 now)
{
	__u32 zero = 0;
	struct fluxvm_flow_budget *b = bpf_map_lookup_elem(&fluxvm_flow_budget, &zero);
	__u64 old, t;

	if (!b)
		return 0;
	old = *(volatile __u64 *)&b->empty_ns;
	t = old;
	if (now > FLUXVM_FLOW_DROP_BURST * FLUXVM_FLOW_DROP_NS && t < now - FLUXVM_FLOW_DROP_BURST * FLUXVM_FLOW_DROP_NS)
		t = now - FLUXVM_FLOW_DROP_BURST * FLUXVM_FLOW_DROP_NS; /* full */
	t += FLUXVM_FLOW_DROP_NS;
	if (t > now)
		return 0; /* empty */
	return __sync_val_compare_and_swap(&b->empty_ns, old, t) == old;
}

/*
 * A client packet to a service was dropped on a forward path (the reason
 * is the last one this CPU counted, lib/counters.h): into its flow's
 * record when its conntrack entry has one, else into a new record with
 * verdict dropped, within the node's budget. @info is the word of a
 * union fluxvm_flow_arg: the family, the hook and the service id.
 * Drops are the rare path: a global function, and a conntrack lookup of
 * its own.
 */
__attribute__((noinline)) int fluxvm_flow_drop(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, __u64 info)
{
	const struct fluxvm_meta_value *meta = fluxvm_meta_get();
	struct fluxvm_scratch *scr = fluxvm_scratch_get();
	struct fluxvm_tuple4 t4 = {};
	struct fluxvm_tuple6 t6 = {};
	struct fluxvm_ct_value *ct;
	struct fluxvm_flow *f = NULL;
	union fluxvm_flow_arg a = { .word = info };
	__u32 sid = a.info.sid;
	__u64 now;
	int v6 = a.info.v6;

	if (!FLUXVM_FEATURE_ON(flows) || !pkt || !meta || !meta->flow_sample_rate)
		return 0;
	now = bpf_ktime_get_coarse_ns();
	fluxvm_pkt_tuple(pkt, v6, &t4, &t6);
	ct = v6 ? bpf_map_lookup_elem(&fluxvm_fct6, &t6) : bpf_map_lookup_elem(&fluxvm_fct4, &t4);
	/* The tuple's conntrack entry is this flow's only if it is of this
	 * service (a VIP and port given to another service, a tuple reused). */
	if (ct && ct->service_id == sid)
		f = fluxvm_flow_get(ct->flow);
	if (f && f->service_id != sid)
		f = NULL;
	if (!f) {
		if (!fluxvm_flow_budget_take(now)) {
			fluxvm_count(FLUXVM_CNT_FLOW_DROP_LIMITED);
			return 0;
		}
		f = fluxvm_flow_get(fluxvm_flow_new(ctx, pkt, v6, a.info.hook, now, sid, 0,
						    FLUXVM_FLOW_DROPPED, fluxvm_flow_next_seq()));
		if (!f)
			return 0;
		fluxvm_count(FLUXVM_CNT_FLOW_RECORDED);
	} else if (!f->fwd_packets) {
		/* Every packet of the flow so far was dropped after its learn
		 * (its deliver stage): the record must not say forwarded
		 * (fluxvm_flow_sent sets it back on the first one sent). */
		f->verdict = FLUXVM_FLOW_DROPPED;
	}
	f->drops++;
	f->reason = scr ? scr->drop_reason : 0;
	f->last_ns = now;
	return 0;
}

#endif /* FLUXVM_LIB_FLOWS_H */
