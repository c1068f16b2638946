/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Derived reverse translation of east-west flows.
 *
 * A reply backend:port -> client:cport carries no VIP. Its flow is the
 * conntrack entry client:cport -> VIP:vport of one of the frontends that
 * list the backend in fluxvm_be2fe (written by the control plane before any
 * table can pick the backend), and that entry must name this backend of
 * that frontend. So a new east-west flow learns one entry, and each reply
 * pays one lookup in a small, hot index plus one conntrack lookup (almost
 * always: a backend is listed by one frontend), instead of one in a
 * reverse-NAT map as large as conntrack.
 *
 * The conntrack entry proves the flow: a packet from the backend to a
 * client that never went through the VIP finds no entry (or one that
 * names another backend) and passes untouched.
 */
#ifndef FLUXVM_LIB_REV_H
#define FLUXVM_LIB_REV_H

#include "maps.h"
#include "parse.h"

/* The flow a reply belongs to, as fluxvm_rev_find found it. */
struct fluxvm_rev {
	__be32 vip[4];  /* IPv4 uses vip[0] */
	__be16 vport;
	__u8 indexed;   /* the backend endpoint has a fluxvm_be2fe entry */
	__u8 pad;
	__u32 service_id;
	__u32 backend_id;
};

/* How well a conntrack entry fits a reply: a flow in its handshake for a
 * SYN-ACK, then a live flow, then one that ended (FIN, RST) or expired. */
static __always_inline int fluxvm_rev_rank(const struct fluxvm_ct_value *ct, int synack, __u64 now)
{
	if (synack && ct->state == FLUXVM_CT_TCP_SYN)
		return 3;
	if (ct->state != FLUXVM_CT_TCP_FIN && ct->state != FLUXVM_CT_TCP_RST && ct->deadline_ns >= now)
		return 2;
	return 1;
}

/*
 * Find the east-west flow of a reply from @backend:@bport to
 * @client:@cport (@proto; both addresses of family @v6; @synack for a TCP
 * SYN-ACK): its conntrack entry (client -> VIP), with the frontend in @r,
 * or NULL. @t4/@t6 are left holding the found entry's key. Entries of
 * SNAT or DSR flows are never a match: those flows' replies are not
 * east-west replies. *@now is the clock the flows' deadlines are judged
 * by; when 0, it is read here once the index lists @backend, so that a
 * packet from any other source (most packets to a VM) pays one index miss
 * and no helper call.
 *
 * When the client used one port toward two VIPs that share the backend,
 * two slots find an entry (the backend cannot tell the two apart: it sees
 * one tuple). The better fit wins (fluxvm_rev_rank), then the newer flow,
 * as the newer reverse-NAT half did when halves were stored; only the
 * chosen entry is refreshed, so an older flow on the tuple still expires.
 */
static __always_inline struct fluxvm_ct_value *
fluxvm_rev_find(const __be32 *backend, __be16 bport, const __be32 *client, __be16 cport,
		__u8 proto, const int v6, int synack, __u64 *now, struct fluxvm_tuple4 *t4,
		struct fluxvm_tuple6 *t6, struct fluxvm_rev *r)
{
	struct fluxvm_be2fe_key k = { .port = bport, .proto = proto };
	struct fluxvm_ct_value *ct, *best = NULL;
	struct fluxvm_be2fe_value *idx;
	__u64 best_created = 0;
	int i, rank, best_rank = 0;
	__u32 n;

	if (v6) {
		__builtin_memcpy(k.addr, backend, 16);
		k.family = FLUXVM_AF_INET6;
	} else {
		k.addr[0] = backend[0];
		k.family = FLUXVM_AF_INET;
	}
	idx = bpf_map_lookup_elem(&fluxvm_be2fe, &k);
	if (!idx)
		return NULL;
	r->indexed = 1;
	n = idx->count;
	if (!*now)
		*now = bpf_ktime_get_coarse_ns();

	if (v6) {
		__builtin_memcpy(t6->saddr, client, 16);
		t6->sport = cport;
		t6->proto = proto;
	} else {
		t4->saddr = client[0];
		t4->sport = cport;
		t4->proto = proto;
	}
#pragma unroll
	for (i = 0; i < FLUXVM_BE2FE_SLOTS; i++) {
		const struct fluxvm_be2fe_slot *s = &idx->slots[i];

		if (i >= n)
			break;
		if (v6) {
			__builtin_memcpy(t6->daddr, s->vip, 16);
			t6->dport = s->vport;
			ct = bpf_map_lookup_elem(&fluxvm_fct6, t6);
		} else {
			t4->daddr = s->vip[0];
			t4->dport = s->vport;
			ct = bpf_map_lookup_elem(&fluxvm_fct4, t4);
		}
		if (!ct || ct->service_id != s->service_id || ct->backend_id != s->backend_id ||
		    (ct->flags & (FLUXVM_CT_F_SNAT | FLUXVM_CT_F_DSR)))
			continue;
		rank = fluxvm_rev_rank(ct, synack, *now);
		if (rank < best_rank || (rank == best_rank && ct->created_ns <= best_created))
			continue;
		best = ct;
		best_rank = rank;
		best_created = ct->created_ns;
		__builtin_memcpy(r->vip, s->vip, 16);
		r->vport = s->vport;
		r->service_id = s->service_id;
		r->backend_id = s->backend_id;
	}
	if (!best)
		return NULL;
	/* The key of the entry chosen, for the caller's delete. */
	if (v6) {
		__builtin_memcpy(t6->daddr, r->vip, 16);
		t6->dport = r->vport;
	} else {
		t4->daddr = r->vip[0];
		t4->dport = r->vport;
	}
	return best;
}

#endif /* FLUXVM_LIB_REV_H */
