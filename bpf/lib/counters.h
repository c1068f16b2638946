/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Counters: global per-CPU packet counters, drops by reason, and per-service
 * statistics. Per-CPU slots need no atomics: a program runs to completion
 * on one CPU.
 */
#ifndef FLUXVM_LIB_COUNTERS_H
#define FLUXVM_LIB_COUNTERS_H

#include "maps.h"

static __always_inline void fluxvm_count(enum fluxvm_counter c)
{
	enum fluxvm_counter key = c;
	__u64 *v = bpf_map_lookup_elem(&fluxvm_counters, &key);

	if (v)
		*v += 1;
}

static __always_inline struct fluxvm_svc_stats_value *fluxvm_stats(__u32 service_id)
{
	return bpf_map_lookup_elem(&fluxvm_svc_stats, &service_id);
}

/* The per-interface statistics of the VM edge @ctx arrived on, or NULL.
 * XDP runs on north-south interfaces only, which never have a VM-edge
 * slot (fluxvm: an interface is one kind or the other), so it skips the
 * lookup. */
static __always_inline struct fluxvm_svc_stats_value *
fluxvm_edge(struct __ctx_buff *ctx)
{
#ifdef FLUXVM_CTX_XDP
	(void)ctx;
	return NULL;
#endif
	__u32 ifindex = ctx_ifindex(ctx);
	__u32 key = ifindex & FLUXVM_EDGE_SLOT_MASK;
	struct fluxvm_edge_slot *s = bpf_map_lookup_elem(&fluxvm_edge_slots, &key);

	if (!s || s->ifindex != ifindex || !s->slot)
		return NULL;
	key = s->slot;
	return bpf_map_lookup_elem(&fluxvm_edge_stats, &key);
}

/* Count a drop by reason and, when known, against the service and the
 * VM-edge interface. */
static __always_inline int fluxvm_drop(enum fluxvm_drop_reason reason,
				       struct fluxvm_svc_stats_value *st,
				       struct fluxvm_svc_stats_value *es)
{
	enum fluxvm_drop_reason key = reason;
	__u64 *v = bpf_map_lookup_elem(&fluxvm_drops, &key);
	struct fluxvm_scratch *scr = fluxvm_scratch_get();

	if (v)
		*v += 1;
	if (scr)
		scr->drop_reason = reason;
	if (st)
		st->drops++;
	if (es)
		es->drops++;
	return CTX_ACT_DROP;
}

/* Count a translated packet of @len bytes against the service and the VM
 * edge; @reply selects the backend -> client counters. */
static __always_inline void fluxvm_count_translated(struct fluxvm_svc_stats_value *st,
						    struct fluxvm_svc_stats_value *es,
						    __u32 len, const int reply)
{
	if (st) {
		if (reply) {
			st->reply_packets++;
			st->reply_bytes += len;
		} else {
			st->packets++;
			st->bytes += len;
		}
	}
	if (es) {
		if (reply) {
			es->reply_packets++;
			es->reply_bytes += len;
		} else {
			es->packets++;
			es->bytes += len;
		}
	}
}

#endif /* FLUXVM_LIB_COUNTERS_H */
