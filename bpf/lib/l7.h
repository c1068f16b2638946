/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * L7 enforce: a service whose policy hands its HTTP or gRPC traffic to a
 * proxy (FLUXVM_SVC_F_L7, always with FLUXVM_SVC_F_POLICY).
 *
 * Its header in fluxvm_spol carries FLUXVM_POLICY_F_L7 and the node's
 * interface toward the proxy, a veth whose peer is in the proxy's
 * namespace. A new flow to the VIP is decided by the identity policy
 * first; admitted, it is not translated but handed whole to the proxy
 * with bpf_redirect_peer: it enters the proxy's namespace still addressed
 * to the VIP, where the proxy takes it (a local redirect rule or TPROXY).
 * The flow's conntrack entry (FLUXVM_CT_F_L7, backend 0) keeps its later
 * packets going the same way, and its identity decision is rechecked like
 * any flow's. The proxy's replies leave its namespace with the VIP as
 * their source and are routed to the client like any packet.
 *
 * What the proxy sends on to the VIP arrives on the proxy interface. That
 * interface is the bypass: its packets are load-balanced as usual, and
 * the identity decision admits them (fluxvm_policy_decide: the client's
 * flow was decided on its way in), so a proxied request is never handed
 * back to the proxy. A mark would not do: it does not survive the veth
 * crossing out of the proxy's namespace.
 *
 * A flow established before enforce was turned on keeps its backend; a
 * fresh SYN reusing its tuple is a new flow and goes to the proxy. A
 * header without FLUXVM_POLICY_F_L7 (enforce being turned off: userspace
 * rewrites the header, then clears the frontend's flag) leaves new flows
 * to the mode's path;
 * one without a proxy interface (it was missing when userspace wrote the
 * header) drops them, as a missing header does: fail closed.
 */
#ifndef FLUXVM_LIB_L7_H
#define FLUXVM_LIB_L7_H

#ifdef FLUXVM_CTX_SKB
#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "ct.h"
#include "svc.h"
#include "nat.h"
#include "flows.h"
#include "policy.h"
#include "lb_types.h"
#include "lb_ct.h"

/* What fluxvm_l7_stage returns besides a TC verdict: not for the proxy,
 * the mode's path takes the packet. */
#define FLUXVM_L7_LB 0x100

/* A packet of redirected flow @ct counted into the service's statistics and
 * the flow's record, then handed to the peer of its proxy interface. */
static __always_inline int fluxvm_l7_send(struct __ctx_buff *ctx, const struct fluxvm_ct_value *ct, __u32 sid,
					  __u64 now, struct fluxvm_svc_stats_value *st,
					  struct fluxvm_svc_stats_value *es)
{
	struct fluxvm_flow *f;
	__u32 len = ctx_full_len(ctx), flow = ct->flow, ifindex = ct->l7_ifindex;

	fluxvm_count_translated(st, es, len, 0);
	f = flow ? fluxvm_flow_get(flow) : NULL;
	if (f && f->service_id == sid) {
		/* Back from dropped (a recheck denied it, then allowed):
		 * audited wins, as in the record's first verdict. */
		if (!f->fwd_packets)
			f->verdict = (ct->flags & FLUXVM_CT_F_AUDITED) ? FLUXVM_FLOW_AUDITED : FLUXVM_FLOW_REDIRECTED;
		f->fwd_packets++;
		f->fwd_bytes += len;
		f->last_ns = now;
	}
	return bpf_redirect_peer(ifindex, 0);
}

/*
 * The L7 stage of a packet to a VIP of a service with FLUXVM_SVC_F_L7:
 * @info is the word of a union fluxvm_flow_arg: the family, the hook of
 * the edge and the service id. Returns a TC verdict (the packet handed to
 * the proxy, or dropped: the caller records the drop), or FLUXVM_L7_LB
 * (the proxy's own packets among them). A global function, its keys in per-CPU scratch: the
 * forward paths' call chains are near the 512-byte stack.
 */
__attribute__((noinline)) int fluxvm_l7_stage(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, __u64 info)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	union fluxvm_flow_arg a = { .word = info };
	__u32 sid = a.info.sid, ifindex;
	struct fluxvm_svc_stats_value *st = fluxvm_stats(sid), *es = fluxvm_edge(ctx);
	struct fluxvm_backend *old = NULL;
	struct fluxvm_spol_value *hdr;
	struct fluxvm_meta_value *meta;
	struct fluxvm_ct_value *ct;
	void *ct_map, *ct_key;
	int v6 = a.info.v6, reason;
	__u64 now;

	if (!s || !pkt)
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	s->pk.id = sid;
	s->pk.identity = FLUXVM_SPOL_HEADER;
	hdr = bpf_map_lookup_elem(&fluxvm_spol, &s->pk);
	if (!hdr)
		return fluxvm_drop(FLUXVM_DROP_POLICY_MISSING, st, es);
	if (!(hdr->flags & FLUXVM_POLICY_F_L7))
		return FLUXVM_L7_LB;
	ifindex = hdr->proxy_ifindex;
	if (ctx_ifindex(ctx) == ifindex) {
		fluxvm_count(FLUXVM_CNT_L7_BYPASS);
		return FLUXVM_L7_LB;
	}

	ct_map = fluxvm_ct_key_scratch(s, pkt, v6, 0, &ct_key);
	now = bpf_ktime_get_coarse_ns();
	ct = bpf_map_lookup_elem(ct_map, ct_key);
	/* A fresh SYN on an entry past its handshake is a new connection
	 * reusing the tuple (as fluxvm_ct_stage has it); anything else
	 * keeps its way: to the proxy, or to the backend it had before
	 * enforce was turned on. */
	if (ct && ct->service_id == sid && !(fluxvm_tcp_is_syn(pkt) && ct->state != FLUXVM_CT_TCP_SYN)) {
		if (!(ct->flags & FLUXVM_CT_F_L7))
			return FLUXVM_L7_LB;
		if (!fluxvm_guard_open(sid))
			return fluxvm_drop(FLUXVM_DROP_GUARD_CLOSED, st, es);
		if ((reason = fluxvm_policy_recheck(ctx, pkt, v6, sid, ct)))
			return fluxvm_drop(reason, st, es);
		fluxvm_ct_touch(ct, fluxvm_ct_next(ct->state, pkt, 0), now);
		return fluxvm_l7_send(ctx, ct, sid, now, st, es);
	}

	/* A new flow: decided, then learned whole before it is handed on.
	 * An entry it replaces (a direct flow's, whose tuple the client
	 * reused) must not leave a stored reverse half behind, which would
	 * translate its backend's late packets onto the proxied connection:
	 * forgotten once the new entry is written, as fluxvm_lb_nat does on a
	 * re-pick (a flow dropped before keeps its half). An SNAT mapping
	 * stays for the GC, as on an SNAT re-pick: its port may be another
	 * flow's by now. */
	if (!fluxvm_guard_open(sid))
		return fluxvm_drop(FLUXVM_DROP_GUARD_CLOSED, st, es);
	if (ct && ct->service_id == sid &&
	    !(ct->flags & (FLUXVM_CT_F_L7 | FLUXVM_CT_F_SNAT | FLUXVM_CT_F_DSR | FLUXVM_CT_F_REV_DERIVED))) {
		old = fluxvm_backend_get(ct->backend_id);
		if (old && old->service_id != sid)
			old = NULL;
	}
	/* The proxy interface missing (a restore before it came back): new
	 * flows must not reach the backends unproxied. */
	if (!ifindex)
		return fluxvm_drop(FLUXVM_DROP_POLICY_MISSING, st, es);
	meta = fluxvm_meta_get();
	ct = fluxvm_ct_build(pkt, meta, sid, 0, now, FLUXVM_CT_F_L7);
	if (!ct)
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	if ((reason = fluxvm_policy_admit(ctx, pkt, v6, sid, ct)))
		return fluxvm_drop(reason, st, es);
	ct->l7_ifindex = ifindex;
	ct->flow = fluxvm_flow_reserve(meta, now);
	if (bpf_map_update_elem(ct_map, ct_key, ct, BPF_ANY))
		return fluxvm_drop(FLUXVM_DROP_CT_UPDATE, st, es);
	if (old)
		fluxvm_nat_forget(pkt, v6, old); /* takes the scratch's keys: the last use of ct_key is above */
	if (ct->flow && fluxvm_flow_open(ctx, pkt,
					 FLUXVM_FLOW_ARG(.v6 = !!v6, .redirected = 1,
							 .audited = !!(ct->flags & FLUXVM_CT_F_AUDITED),
							 .hook = a.info.hook, .sid = sid),
					 ct->flow))
		fluxvm_count(FLUXVM_CNT_FLOW_RECORDED);
	fluxvm_count_new_flow(st, es, 0);
	fluxvm_count(FLUXVM_CNT_L7_REDIRECTED);
	if (st)
		st->l7_redirected++;
	return fluxvm_l7_send(ctx, ct, sid, now, st, es);
}
#endif /* FLUXVM_CTX_SKB */

#endif /* FLUXVM_LIB_L7_H */
