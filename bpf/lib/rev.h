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
	__u8 overflow;  /* the backend has frontends past the slots */
	__u8 pad;
	__u32 service_id;
	__u32 backend_id;
};

/*
 * Find the east-west flow of a reply from @backend:@bport to
 * @client:@cport (@proto; both addresses of family @v6): its conntrack
 * entry (client -> VIP), with the frontend in @r, or NULL. @t4/@t6 are
 * left holding the entry's key. Entries of SNAT or DSR flows are never a
 * match: those flows' replies are not east-west replies.
 *
 * @r->overflow is set whenever the backend's index entry says frontends
 * past its slots store reverse-NAT halves: the caller looks those up when
 * no slot found the flow.
 */
static __always_inline struct fluxvm_ct_value *
fluxvm_rev_find(const __be32 *backend, __be16 bport, const __be32 *client, __be16 cport,
		__u8 proto, const int v6, struct fluxvm_tuple4 *t4, struct fluxvm_tuple6 *t6,
		struct fluxvm_rev *r)
{
	struct fluxvm_be2fe_key k = { .port = bport, .proto = proto };
	struct fluxvm_be2fe_value *idx;
	struct fluxvm_ct_value *ct;
	__u32 n;
	int i;

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
	r->overflow = !!(idx->flags & FLUXVM_BE2FE_F_OVERFLOW);
	n = idx->count;

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
		__builtin_memcpy(r->vip, s->vip, 16);
		r->vport = s->vport;
		r->service_id = s->service_id;
		r->backend_id = s->backend_id;
		return ct;
	}
	return NULL;
}

#endif /* FLUXVM_LIB_REV_H */
