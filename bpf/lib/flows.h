/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * FluxScope: flow records in fluxvm_sflows (fluxvm_service_v6.bpf.h), a
 * ring every hook that learns or forwards flows writes.
 *
 * A new flow gets a record when sampled (meta flow_sample_rate N: 1 in N
 * new flows, by a random draw; 0: no record at all, no map write). Its
 * conntrack entry, and its reverse-NAT half where it has one, keep the
 * record's id (the low 32 bits of its seq), so the packets of the flow
 * count into it each way for the price of one array lookup; a flow whose
 * slot a newer record took stops counting (the ids differ).
 *
 * A drop of a client packet always records (while the sample rate is not
 * 0): into the flow's record when it has one, else into a new record with
 * verdict dropped; new drop records take a per-CPU budget of
 * FLUXVM_FLOW_DROP_BURST, refilled at FLUXVM_FLOW_DROP_RATE a second, so
 * that a flood of drops (a SYN flood to a service without backends) takes
 * at most that share of the ring and cannot evict every other record.
 * Drops past the budget are counted (flow_drop_limited).
 *
 * Counts are plain increments: a record is written by the CPUs of its
 * flow's packets, and two CPUs counting one direction of one flow at the
 * same instant may lose an increment (the datapath's per-CPU counters are
 * exact; records are telemetry).
 */
#ifndef FLUXVM_LIB_FLOWS_H
#define FLUXVM_LIB_FLOWS_H

#include "maps.h"
#include "counters.h"
#include "svc.h"

#define FLUXVM_FLOW_DROP_BURST 64
#define FLUXVM_FLOW_DROP_RATE 64 /* records a second, per CPU */

/* The record of flow @id while the ring holds it, or NULL. */
static __always_inline struct fluxvm_flow *fluxvm_flow_get(__u32 id)
{
	__u32 slot = id & (FLUXVM_FLOW_SLOTS - 1);
	struct fluxvm_flow *f;

	if (!id)
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

/* Whether a new flow gets a record, by the node's sample rate. */
static __always_inline int fluxvm_flow_sampled(const struct fluxvm_meta_value *meta)
{
	__u32 n = meta ? meta->flow_sample_rate : 0;

	return n == 1 || (n > 1 && bpf_get_prandom_u32() % n == 0);
}

/*
 * A new record for the flow of client packet @pkt (its addresses and ports
 * as the client sent them), cleared, with its seq, tuple, hook, interface
 * times, service, backend id and verdict (a forwarded flow counts its
 * first packet): its id (fluxvm_flow_get finds it), or 0 when the ring
 * cannot be had. No pointer to the caller's stack: a global function's frame
 * stays small (the XDP program's call chain is near the 512-byte stack).
 */
static __always_inline __u32 fluxvm_flow_new(struct __ctx_buff *ctx, const struct fluxvm_pkt *pkt,
					     const int v6, __u8 hook, __u64 now, __u32 sid, __u32 bid,
					     __u8 verdict)
{
	__u32 zero = 0, slot;
	struct fluxvm_flow *f;
	__u64 *seqp, seq;

	seqp = bpf_map_lookup_elem(&fluxvm_flow_seq, &zero);
	if (!seqp)
		return 0;
	seq = __sync_fetch_and_add(seqp, 1) + 1;
	if (!(__u32)seq) /* id 0 means none: skip it */
		seq = __sync_fetch_and_add(seqp, 1) + 1;
	slot = (__u32)seq & (FLUXVM_FLOW_SLOTS - 1);
	f = bpf_map_lookup_elem(&fluxvm_sflows, &slot);
	if (!f)
		return 0;
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
	if (verdict == FLUXVM_FLOW_FORWARDED) {
		f->fwd_packets = 1;
		f->fwd_bytes = ctx_full_len(ctx);
	}
	return (__u32)seq;
}

/*
 * The record of a new flow forwarded to a backend, written before the
 * packet is rewritten (its forward counters count it): its id, or 0 when
 * none could be had. @info packs the family (bit 0: IPv6), the hook (bits
 * 8-15), the backend id (bits 16-31; ids are below the tier's 65,536) and
 * the service id (bits 32-63); @now is the coarse clock. A global
 * function: the verifier checks it once, not once per forward path. Its
 * four arguments fit the four registers a call keeps, so its frame stays
 * within the 32 bytes the XDP program's deepest call chain has left of the
 * 512-byte stack. Only sampled flows call it (fluxvm_flow_learn).
 */
#ifdef FLUXVM_CTX_XDP
/* In XDP, inline: the call chain through the IPv6 SNAT path has no frame
 * to spare, while the frames it inlines into have room within their
 * rounding to 32 bytes. */
static __always_inline
#else
__attribute__((noinline))
#endif
int fluxvm_flow_open(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, __u64 info, __u64 now)
{
	if (!pkt)
		return 0;
	return (int)fluxvm_flow_new(ctx, pkt, info & 1, (info >> 8) & 0xff, now, (__u32)(info >> 32),
				    (__u32)(info >> 16) & 0xffff, FLUXVM_FLOW_FORWARDED);
}

/* A new flow's record id, or 0 when it is not sampled (lib/flows.h). */
static __always_inline __u32 fluxvm_flow_learn(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, const int v6,
					       const struct fluxvm_meta_value *meta, __u8 hook, __u32 sid,
					       __u32 bid, const struct fluxvm_backend *be)
{
	struct fluxvm_flow *f;
	__u32 id;

	if (!fluxvm_flow_sampled(meta))
		return 0;
	id = (__u32)fluxvm_flow_open(ctx, pkt,
				     (v6 ? 1 : 0) | ((__u64)hook << 8) | ((__u64)(bid & 0xffff) << 16) | ((__u64)sid << 32),
				     bpf_ktime_get_coarse_ns());
	/* The backend, here: a BPF call takes five arguments at most. */
	f = fluxvm_flow_get(id);
	if (f) {
		__builtin_memcpy(f->backend, be->addr, 16);
		f->bport = be->port;
		fluxvm_count(FLUXVM_CNT_FLOW_RECORDED);
	}
	return id;
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

/* Take a drop record from this CPU's budget. */
static __always_inline int fluxvm_flow_budget_take(__u64 now)
{
	__u32 zero = 0;
	struct fluxvm_flow_budget *b = bpf_map_lookup_elem(&fluxvm_flow_budget, &zero);
	__u64 refill;

	if (!b)
		return 0;
	refill = (now - b->last_ns) / (1000000000ULL / FLUXVM_FLOW_DROP_RATE);
	if (refill) {
		b->tokens = b->tokens + refill > FLUXVM_FLOW_DROP_BURST ? FLUXVM_FLOW_DROP_BURST
									: b->tokens + refill;
		b->last_ns = now;
	}
	if (!b->tokens)
		return 0;
	b->tokens--;
	return 1;
}

/*
 * A client packet to a service was dropped on a forward path (the reason
 * is the last one this CPU counted, lib/counters.h): into its flow's
 * record when its conntrack entry has one, else into a new record with
 * verdict dropped, within this CPU's budget. @info packs the family
 * (bit 0: IPv6), the hook (bits 8-15) and the service id (bits 32-63).
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
	__u64 now;
	int v6 = info & 1;

	if (!pkt || !meta || !meta->flow_sample_rate)
		return 0;
	now = bpf_ktime_get_coarse_ns();
	fluxvm_pkt_tuple(pkt, v6, &t4, &t6);
	ct = v6 ? bpf_map_lookup_elem(&fluxvm_fct6, &t6) : bpf_map_lookup_elem(&fluxvm_fct4, &t4);
	/* The tuple's conntrack entry is this flow's only if it is of this
	 * service (a VIP and port given to another service, a tuple reused). */
	if (ct && ct->service_id == (__u32)(info >> 32))
		f = fluxvm_flow_get(ct->flow);
	if (f && f->service_id != (__u32)(info >> 32))
		f = NULL;
	if (!f) {
		if (!fluxvm_flow_budget_take(now)) {
			fluxvm_count(FLUXVM_CNT_FLOW_DROP_LIMITED);
			return 0;
		}
		f = fluxvm_flow_get(fluxvm_flow_new(ctx, pkt, v6, (info >> 8) & 0xff, now, (__u32)(info >> 32), 0,
						    FLUXVM_FLOW_DROPPED));
		if (!f)
			return 0;
		fluxvm_count(FLUXVM_CNT_FLOW_RECORDED);
	}
	f->drops++;
	f->reason = scr ? scr->drop_reason : 0;
	f->last_ns = now;
	return 0;
}

#endif /* FLUXVM_LIB_FLOWS_H */
