/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * EDT pacing: a service's egress toward its clients at no more than its
 * rate (fluxvm_edt, fluxvm_service_v6.bpf.h).
 *
 * Which packets count: those our TC egress hooks send toward the client of
 * a paced service, after translation, both families: east-west replies
 * (fluxvm_to_vm, found through conntrack or a reverse-NAT half), replies
 * to the SNAT address translated at fluxvm_ns_out, and north-south replies
 * an ingress hook translated (fluxvm_from_vm for a backend on the node,
 * fluxvm_ns_in for a remote one) as they leave through fluxvm_ns_out,
 * found there by their source (the VIP and port), as are the DSR replies
 * of a backend on the node. Never paced: client -> backend packets, DSR
 * replies of remote backends, and whatever XDP sends (it bypasses the
 * qdisc that would hold it).
 *
 * A service's frontends (each has a service id of its own) share one
 * departure clock, that of its first frontend (the entry's pacer), so
 * that its rate caps the service as a whole.
 *
 * A packet's departure is max(now, last_departure) + len / rate, len being the
 * skb's length (a GSO packet counts whole); it goes to skb->tstamp, where
 * an fq qdisc on the interface holds the packet until then. Without fq
 * nothing holds it, and the horizon polices instead: a packet whose
 * departure would lie more than horizon_ns ahead while an earlier one is
 * still scheduled is dropped, so a service sends at most its rate plus a
 * burst of horizon_ns worth of bytes. A packet of an idle service always
 * goes: a 64 KB GSO packet at 1 Mbit/s takes half a second, and no horizon
 * may starve it.
 *
 * The clock is the coarse one the reply paths read anyway (a tick is 4 ms
 * at HZ=250): while a service is backlogged its departures chain on
 * last_departure, so its rate holds exactly over time; the clock only decides
 * when a service has gone idle and where the horizon lies, each within a
 * tick. The fine clock would cost more than the rest of the pacing.
 */
#ifndef FLUXVM_LIB_EDT_H
#define FLUXVM_LIB_EDT_H

#include "config.h"
#include "maps.h"
#include "counters.h"
#include "flows.h"

#ifdef FLUXVM_CTX_SKB /* EDT is a TC egress feature */

/* Longer packets are paced as this long, so that len * ns_per_byte fits
 * in 64 bits at the lowest rate (1 Mbit/s: 8000 ns a byte, Q32). */
#define FLUXVM_EDT_MAX_LEN (1U << 19)
/* Compare-and-swap attempts on a service's clock before a packet queues
 * behind whatever is last (lib/edt.h, fluxvm_edt_pace). */
#define FLUXVM_EDT_TRIES 2

/*
 * Schedule a packet of service @sid (or let it go unpaced): 0 to send it,
 * or the drop verdict (counted) when it lies beyond the horizon. @now is
 * the coarse clock. @control: the packet changes the flow's state (a TCP
 * SYN, FIN or RST, which the reply paths have already recorded in
 * conntrack): it is scheduled but never dropped, so that the client never
 * misses what its flow's state says it saw (an RST is not retransmitted).
 */
static __always_inline int fluxvm_edt_pace(struct __ctx_buff *ctx, __u32 sid, __u64 now, int control,
					   struct fluxvm_svc_stats_value *st,
					   struct fluxvm_svc_stats_value *es)
{
	struct fluxvm_edt_value *e, *p;
	__u64 len, delay, horizon, t, next = 0, old;
	__u32 pacer;
	int i;

	/* Not loaded: no rate (the mask rather than a branch of its own,
	 * which cost fluxvm_to_vm's verification 467 insns more). */
	e = bpf_map_lookup_elem(&fluxvm_edt, &sid);
	if (!e || !(e->rate & FLUXVM_FEATURE_MASK(edt)))
		return 0;
	len = ctx->len;
	if (len > FLUXVM_EDT_MAX_LEN)
		len = FLUXVM_EDT_MAX_LEN;
	/* Rounded up: a packet never leaves earlier than the rate allows. */
	delay = (len * e->ns_per_byte + 0xffffffffULL) >> 32;
	horizon = e->horizon_ns;
	/* The service's clock, shared by its frontends. */
	pacer = e->pacer;
	if (pacer && pacer != sid && (p = bpf_map_lookup_elem(&fluxvm_edt, &pacer)))
		e = p;
	t = *(volatile __u64 *)&e->last_departure;
	/* Another CPU may schedule a packet of this service between the read
	 * and the write: then the departure is computed again from its. */
	for (i = 0; i < FLUXVM_EDT_TRIES; i++) {
		next = (t > now ? t : now) + delay;
		if (t > now && next - now > horizon && !control) {
			if (st)
				st->edt_drops++;
			return fluxvm_drop(FLUXVM_DROP_EDT_HORIZON, st, es);
		}
		old = __sync_val_compare_and_swap(&e->last_departure, t, next);
		if (old == t)
			goto admitted;
		t = old;
	}
	/* Lost every race (many CPUs on one service): behind whatever is last
	 * by now, past the horizon by at most a packet per CPU. A clock the
	 * control plane just reset reads ~0: the packet goes now. */
	next = __sync_fetch_and_add(&e->last_departure, delay) + delay;
	if (next < now)
		next = now + delay;
admitted:
	ctx->tstamp = next;
	return 0;
}

static __always_inline void fluxvm_count_reply(struct fluxvm_svc_stats_value *st, __u64 packets, __u64 bytes)
{
	st->reply_packets += packets;
	st->reply_bytes += bytes;
}

/* Whether any north-south service is paced (the node's entry, index 0):
 * only then does fluxvm_ns_out look packets' sources up. */
static __always_inline int fluxvm_edt_ns_active(void)
{
	__u32 zero = 0;
	struct fluxvm_edt_value *node;

	if (!FLUXVM_FEATURE_ON(edt))
		return 0;
	node = bpf_map_lookup_elem(&fluxvm_edt, &zero);
	return node && node->rate;
}

/*
 * fluxvm_ns_out, a packet not to the SNAT address while a north-south
 * service is paced: a north-south reply an ingress hook translated (or a
 * DSR reply of a backend on the node) leaves with its VIP and port as the
 * source, and is paced here if its service is.
 */
static __always_inline int fluxvm_edt_ns_out(struct __ctx_buff *ctx, const struct fluxvm_pkt *pkt,
					     const int v6)
{
	struct fluxvm_svc_stats_value *st;
	struct fluxvm_svc_value *svc;
	__u32 sid, dsr;
	int ret;

	if (!FLUXVM_FEATURE_ON(edt) || (pkt->l4_proto != IPPROTO_TCP && pkt->l4_proto != IPPROTO_UDP))
		return CTX_ACT_NEXT;
	if (v6) {
		struct fluxvm_svc6_key k = { .port = pkt->sport, .proto = pkt->l4_proto };

		__builtin_memcpy(k.vip, pkt->saddr, 16);
		svc = bpf_map_lookup_elem(&fluxvm_svc6, &k);
	} else {
		struct fluxvm_svc4_key k = { .vip = pkt->saddr[0], .port = pkt->sport, .proto = pkt->l4_proto };

		svc = bpf_map_lookup_elem(&fluxvm_svc4, &k);
	}
	if (!svc || (svc->flags & (FLUXVM_SVC_F_VIP_MARKER | FLUXVM_SVC_F_PACED)) != FLUXVM_SVC_F_PACED ||
	    !(svc->flags & FLUXVM_SVC_F_NORTH_SOUTH))
		return CTX_ACT_NEXT;
	/* Copied out: the entry may be replaced while the packet is paced. */
	sid = svc->service_id;
	dsr = svc->flags & FLUXVM_SVC_F_DSR;
	st = fluxvm_stats(sid);
	ret = fluxvm_edt_pace(ctx, sid, bpf_ktime_get_coarse_ns(), fluxvm_tcp_control(pkt), st, NULL);
	/* The service's reply counters hold what left toward its clients: a
	 * reply an ingress hook counted and the horizon dropped here is taken
	 * back (per-CPU slots are summed, so the CPU does not matter), from
	 * its flow's record too (a drop: the rare path), and a
	 * DSR reply, which no hook translated, counts here. */
	if (st && dsr) {
		if (!ret)
			fluxvm_count_reply(st, 1, ctx->len);
	} else if (ret) {
		if (st)
			fluxvm_count_reply(st, -1, -(__u64)ctx->len);
		/* And from its flow's record, which it counted into too. */
		fluxvm_flow_uncount_reply(pkt, v6, sid, ctx->len);
	}
	return ret ? ret : CTX_ACT_NEXT;
}

#endif /* FLUXVM_CTX_SKB */

#endif /* FLUXVM_LIB_EDT_H */
