/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * A service's frontend as every hook sees it, whatever its context: the
 * guard, where the service is served, its backends and their states, and
 * the Maglev pick. Packet hooks (lb.h) and socket hooks (sock.h) select by
 * these, so that a flow is kept and picked by the same rules at every
 * hook (DESIGN.md §3).
 */
#ifndef FLUXVM_LIB_SVC_H
#define FLUXVM_LIB_SVC_H

#include "maps.h"

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

/* The kernel's struct bpf_map, for the size of an inner table (CO-RE). */
struct bpf_map___fluxvm {
	__u32 max_entries;
} __attribute__((preserve_access_index));

/*
 * The backend id in the slot of @hash in the service's table, or 0.
 *
 * Tables are sized by what they serve (maps.h), and the size is read from
 * the inner map itself: it is swapped in with its table in one update, so
 * a packet never pairs one table with another's size. The hash is reduced
 * to the table by multiply and shift (hash * size / 2^32), which needs no
 * division by a size known only at run time; the hash is well mixed, so
 * every slot gets an equal share of hashes (within one).
 */
static __always_inline __u32 fluxvm_maglev_pick(__u32 sid, __u32 hash)
{
	struct bpf_map___fluxvm *table = bpf_map_lookup_elem(&fluxvm_maglev, &sid);
	__u32 slot, *id;

	if (!table)
		return 0;
	slot = (__u32)(((__u64)hash * table->max_entries) >> 32);
	id = bpf_map_lookup_elem(table, &slot);
	return id ? *id : 0;
}

/* Where a forward path runs. */
#define FLUXVM_EDGE_VM 0 /* VM-edge ingress: east-west clients */
#define FLUXVM_EDGE_NS 1 /* north-south ingress: clients outside the node */

static __always_inline int fluxvm_svc_flags_here(__u32 flags, const int edge)
{
	if (edge == FLUXVM_EDGE_NS)
		return flags & FLUXVM_SVC_F_NORTH_SOUTH;
	return !(flags & FLUXVM_SVC_F_NO_EAST_WEST);
}

static __always_inline int fluxvm_svc_here(const struct fluxvm_svc_value *svc, const int edge)
{
	return fluxvm_svc_flags_here(svc->flags, edge);
}

static __always_inline int fluxvm_guard_open(__u32 sid)
{
	struct fluxvm_guard *guard = bpf_map_lookup_elem(&fluxvm_sguard, &sid);

	return guard && guard->state == FLUXVM_GUARD_OPEN;
}

/* The selection stage's check of a Maglev pick: the table holds Ready
 * backends of its service only; anything else is a table being replaced
 * under us. */
static __always_inline struct fluxvm_backend *fluxvm_backend_ready(__u32 bid, __u32 sid)
{
	struct fluxvm_backend *be = fluxvm_backend_get(bid);

	if (!be || be->service_id != sid || be->state != FLUXVM_BE_READY)
		return NULL;
	return be;
}

#endif /* FLUXVM_LIB_SVC_H */
