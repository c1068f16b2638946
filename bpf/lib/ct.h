/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Conntrack: protocol state and deadlines of forward-affinity entries.
 *
 * The datapath only writes deadlines; expired entries are removed by the
 * userspace GC (conntrack.Map.GC), which also removes entries whose
 * backend's drain deadline passed. Times are CLOCK_MONOTONIC in coarse
 * resolution (bpf_ktime_get_coarse_ns), which is plenty for timeouts of
 * seconds and much cheaper per packet.
 */
#ifndef FLUXVM_LIB_CT_H
#define FLUXVM_LIB_CT_H

#include "maps.h"
#include "parse.h"

#define FLUXVM_TCP_FIN 0x01
#define FLUXVM_TCP_SYN 0x02
#define FLUXVM_TCP_RST 0x04
#define FLUXVM_TCP_ACK 0x10

static __always_inline struct fluxvm_meta_value *fluxvm_meta_get(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&fluxvm_meta, &zero);
}

/* The timeout of @state in seconds: the meta's, or the default. */
static __always_inline __u32 fluxvm_timeout_s(const struct fluxvm_meta_value *m, __u8 state)
{
	__u32 s = 0;

	switch (state) {
	case FLUXVM_CT_TCP_SYN:
		s = m ? m->timeout_tcp_syn_s : 0;
		s = s ?: FLUXVM_TIMEOUT_TCP_SYN_S;
		break;
	case FLUXVM_CT_TCP_ESTABLISHED:
		s = m ? m->timeout_tcp_established_s : 0;
		s = s ?: FLUXVM_TIMEOUT_TCP_ESTABLISHED_S;
		break;
	case FLUXVM_CT_TCP_FIN:
		s = m ? m->timeout_tcp_fin_s : 0;
		s = s ?: FLUXVM_TIMEOUT_TCP_FIN_S;
		break;
	case FLUXVM_CT_TCP_RST:
		s = m ? m->timeout_tcp_rst_s : 0;
		s = s ?: FLUXVM_TIMEOUT_TCP_RST_S;
		break;
	default:
		s = m ? m->timeout_udp_s : 0;
		s = s ?: FLUXVM_TIMEOUT_UDP_S;
		break;
	}
	return s;
}

static __always_inline __u64 fluxvm_timeout_ns(const struct fluxvm_meta_value *m,
					       __u8 state)
{
	return (__u64)fluxvm_timeout_s(m, state) * 1000000000ULL;
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

static __always_inline int fluxvm_tcp_is_syn(const struct fluxvm_pkt *pkt)
{
	return pkt->l4_proto == IPPROTO_TCP &&
	       (pkt->tcp_flags & (FLUXVM_TCP_SYN | FLUXVM_TCP_ACK | FLUXVM_TCP_RST)) == FLUXVM_TCP_SYN;
}

/* A TCP packet that changes its flow's state: SYN, FIN or RST. */
static __always_inline int fluxvm_tcp_control(const struct fluxvm_pkt *pkt)
{
	return pkt->l4_proto == IPPROTO_TCP &&
	       (pkt->tcp_flags & (FLUXVM_TCP_SYN | FLUXVM_TCP_FIN | FLUXVM_TCP_RST));
}

/*
 * The state after @pkt. @reply is set for backend -> client packets. RST
 * wins over FIN, which wins over the handshake; a flow first seen mid-stream
 * (for example after its entry was lost) is taken as established.
 */
static __always_inline __u8 fluxvm_ct_next(__u8 cur, const struct fluxvm_pkt *pkt,
					   int reply)
{
	__u8 f = pkt->tcp_flags;

	if (pkt->l4_proto != IPPROTO_TCP)
		return FLUXVM_CT_UDP;
	if (f & FLUXVM_TCP_RST)
		return FLUXVM_CT_TCP_RST;
	if (cur == FLUXVM_CT_TCP_RST)
		return cur;
	if (f & FLUXVM_TCP_FIN)
		return FLUXVM_CT_TCP_FIN;
	if (cur == FLUXVM_CT_NONE)
		return fluxvm_tcp_is_syn(pkt) ? FLUXVM_CT_TCP_SYN : FLUXVM_CT_TCP_ESTABLISHED;
	if (cur == FLUXVM_CT_TCP_SYN && !reply && (f & FLUXVM_TCP_ACK) && !(f & FLUXVM_TCP_SYN))
		return FLUXVM_CT_TCP_ESTABLISHED;
	return cur;
}

/* What fluxvm_ct_touch wrote: nothing (0), a refresh, or a new state
 * (which the HA queue carries at once, lib/ha.h). */
#define FLUXVM_CT_TOUCH_REFRESH 1
#define FLUXVM_CT_TOUCH_STATE 2

/*
 * Move @ct to @state and push its deadline when the state changed or the
 * last refresh is older than FLUXVM_CT_REFRESH_NS. Returns what it wrote
 * (FLUXVM_CT_TOUCH_*), 0 when nothing.
 */
static __always_inline int fluxvm_ct_touch(struct fluxvm_ct_value *ct, __u8 state,
					   __u64 now)
{
	int ret = FLUXVM_CT_TOUCH_REFRESH;

	if (state == ct->state && now - ct->last_seen_ns < FLUXVM_CT_REFRESH_NS)
		return 0;
	if (state != ct->state)
		ret = FLUXVM_CT_TOUCH_STATE;
	ct->state = state;
	ct->last_seen_ns = now;
	ct->deadline_ns = now + fluxvm_timeout_ns(fluxvm_meta_get(), state);
	return ret;
}

/*
 * The conntrack key of the flow of @pkt, built in per-CPU scratch @s (off
 * the caller's stack): the client's view (client -> VIP), or with @reply
 * the view of a reply @pkt (its addresses and ports swapped). Returns the
 * family's conntrack map, the key in *@key.
 */
static __always_inline void *fluxvm_ct_key_scratch(struct fluxvm_scratch *s, const struct fluxvm_pkt *pkt,
						   const int v6, const int reply, void **key)
{
	const __be32 *src = reply ? pkt->daddr : pkt->saddr, *dst = reply ? pkt->saddr : pkt->daddr;

	if (v6) {
		__builtin_memcpy(s->k6.saddr, src, 16);
		__builtin_memcpy(s->k6.daddr, dst, 16);
		s->k6.sport = reply ? pkt->dport : pkt->sport;
		s->k6.dport = reply ? pkt->sport : pkt->dport;
		s->k6.proto = pkt->l4_proto;
		__builtin_memset(s->k6.pad, 0, sizeof(s->k6.pad));
		*key = &s->k6;
		return &fluxvm_fct6;
	}
	__builtin_memset(&s->k4, 0, sizeof(s->k4));
	s->k4.saddr = src[0];
	s->k4.daddr = dst[0];
	s->k4.sport = reply ? pkt->dport : pkt->sport;
	s->k4.dport = reply ? pkt->sport : pkt->dport;
	s->k4.proto = pkt->l4_proto;
	*key = &s->k4;
	return &fluxvm_fct4;
}

#endif /* FLUXVM_LIB_CT_H */
