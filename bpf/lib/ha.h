/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * HA mutation queue (maps: fluxvm_haq, fluxvm_hadrop; layout:
 * fluxvm_ha_record in fluxvm_service_v6.bpf.h).
 *
 * While HA replication is on (FLUXVM_META_F_HA), every conntrack entry a
 * forward path writes emits one record: the flow as the client sent it,
 * its backend by address (ids are this node's and may be reused before
 * userspace reads the record) and the entry as written. Userspace drains
 * the ring into the journal the standby pulls (package ha). A record the
 * ring has no room for is counted in fluxvm_hadrop; the periodic
 * snapshot-diff in userspace restores what it would have carried, so a
 * full ring costs replication lag, never state.
 *
 * Only TC emits: XDP leaves new flows to TC while HA is on
 * (fluxvm_ha_xdp_pass), so that one path, verified once, owns the queue.
 * Entries the datapath rebuilds from a flow's other half are the same
 * flow and emit nothing; deletes are userspace's (GC), which journals them
 * itself.
 */
#ifndef FLUXVM_LIB_HA_H
#define FLUXVM_LIB_HA_H

#include "maps.h"
#include "counters.h"

/* Whether HA replication is on. */
static __always_inline int fluxvm_ha_on(const struct fluxvm_meta_value *meta)
{
	return meta && (meta->flags & FLUXVM_META_F_HA);
}

#ifdef FLUXVM_CTX_SKB
/*
 * Emit the entry a forward path just wrote for the flow of client packet
 * @pkt: the entry is the CPU's scratch one (fluxvm_ct_build), its backend
 * @bid (bits 32-63 of @info; bit 0: IPv6). A global function: verified
 * once, its record built in the ring's memory, not on the stack.
 */
__attribute__((noinline)) int fluxvm_ha_emit(struct fluxvm_pkt *pkt, __u64 info)
{
	struct fluxvm_scratch *scr = fluxvm_scratch_get();
	struct fluxvm_backend *be = fluxvm_backend_get((__u32)(info >> 32));
	struct fluxvm_ha_record *r;
	__u32 zero = 0;
	__u64 *drops;

	if (!pkt || !scr || !be)
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
	r->proto = pkt->l4_proto;
	r->cport = pkt->sport;
	r->vport = pkt->dport;
	r->bport = be->port;
	if (info & 1) {
		r->family = FLUXVM_AF_INET6;
		__builtin_memcpy(r->client, pkt->saddr, 16);
		__builtin_memcpy(r->vip, pkt->daddr, 16);
	} else {
		r->family = FLUXVM_AF_INET;
		r->client[0] = pkt->saddr[0];
		r->vip[0] = pkt->daddr[0];
	}
	__builtin_memcpy(r->backend, be->addr, 16);
	__builtin_memcpy(&r->ct, &scr->nct, sizeof(r->ct));
	bpf_ringbuf_submit(r, 0);
	fluxvm_count(FLUXVM_CNT_HA_EMITTED);
	return 0;
}

/* After a forward path wrote the entry of a new flow (or a re-pick) to
 * backend @bid: its record, while HA is on. */
#define fluxvm_ha_learned(meta, pkt, v6, bid)                                    \
	do {                                                                     \
		if (fluxvm_ha_on(meta))                                          \
			fluxvm_ha_emit((pkt), ((v6) ? 1 : 0) | ((__u64)(bid) << 32)); \
	} while (0)

/* TC learns every flow itself. */
#define fluxvm_ha_xdp_pass(meta) 0
#else
#define fluxvm_ha_learned(meta, pkt, v6, bid) do { } while (0)
/* XDP leaves a new flow to TC while HA is on, counted. */
static __always_inline int fluxvm_ha_xdp_pass(const struct fluxvm_meta_value *meta)
{
	if (!fluxvm_ha_on(meta))
		return 0;
	fluxvm_count(FLUXVM_CNT_XDP_PASS_HA);
	return 1;
}
#endif /* FLUXVM_CTX_SKB */

#endif /* FLUXVM_LIB_HA_H */
