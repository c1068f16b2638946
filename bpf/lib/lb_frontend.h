/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The frontend stage: the service a client -> VIP packet's VIP and port
 * name, if it is served at this edge, and the mode of the path that takes
 * it on (enum fluxvm_lb_mode). Fragments addressed to a VIP are dropped
 * here (lb.h says why).
 */
#ifndef FLUXVM_LIB_LB_FRONTEND_H
#define FLUXVM_LIB_LB_FRONTEND_H

#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "svc.h"
#include "flows.h"
#include "lb_types.h"

static __always_inline struct fluxvm_svc_value *
fluxvm_frontend(const struct fluxvm_pkt *pkt, const int v6, __be16 port)
{
	if (v6) {
		struct fluxvm_svc6_key k = { .port = port, .proto = pkt->l4_proto };

		__builtin_memcpy(k.vip, pkt->daddr, 16);
		return bpf_map_lookup_elem(&fluxvm_svc6, &k);
	}
	struct fluxvm_svc4_key k = {
		.vip = pkt->daddr[0],
		.port = port,
		.proto = pkt->l4_proto,
	};

	return bpf_map_lookup_elem(&fluxvm_svc4, &k);
}

#ifdef FLUXVM_CTX_SKB
/*
 * The frontend stage of a fragment (rare: a global function, verified
 * once, off the programs' frames): one addressed to a VIP served here at
 * the edge @edge is dropped (lb.h says why), counted under its service,
 * whose flow record (fluxvm_flow_drop) records why. A first fragment carries its ports: the frontend of its
 * destination port names its service. A later one has none: the VIP's
 * marker entry names the VIP's first frontend, as it does for a first
 * fragment to a port not served here. (XDP passes fragments to TC before
 * its frontend stage.)
 */
__attribute__((noinline)) int fluxvm_lb_fragment(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, __u32 v6,
						 __u32 edge)
{
	struct fluxvm_svc_value *svc = NULL;
	int verdict;
	__u32 sid;

	if (!pkt)
		return CTX_ACT_NEXT;
	if (pkt->frag == FLUXVM_FRAG_FIRST) {
		svc = fluxvm_frontend(pkt, v6, pkt->dport);
		if (svc && ((svc->flags & FLUXVM_SVC_F_VIP_MARKER) || !fluxvm_svc_here(svc, edge)))
			svc = NULL;
	}
	if (!svc)
		svc = fluxvm_frontend(pkt, v6, 0);
	if (!svc || !fluxvm_svc_here(svc, edge))
		return CTX_ACT_NEXT;
	sid = svc->service_id;
	verdict = fluxvm_drop(FLUXVM_DROP_FRAGMENT, fluxvm_stats(sid), fluxvm_edge(ctx));
	fluxvm_flow_drop(ctx, pkt, FLUXVM_FLOW_ARG(.v6 = !!v6, .hook = FLUXVM_FWD_HOOK(edge == FLUXVM_EDGE_NS), .sid = sid));
	return verdict;
}
#endif

/*
 * The frontend stage of a client -> VIP packet at @edge: the service its
 * VIP and port name, if it is served here, with its id and flags copied out
 * (the frontend entry may be replaced while the packet is in flight), and
 * the mode whose path takes the packet on. FLUXVM_LB_NONE leaves the
 * verdict in *@verdict: the packet passes, or it is a fragment addressed
 * to a VIP served here and is dropped, its drop recorded
 * (fluxvm_lb_fragment).
 */
static __always_inline enum fluxvm_lb_mode fluxvm_lb_frontend(struct __ctx_buff *ctx,
							      struct fluxvm_pkt *pkt,
							      const int v6, const int edge,
							      __u32 *sid, __u32 *flags,
							      int *verdict)
{
	struct fluxvm_svc_value *svc;

	*verdict = CTX_ACT_NEXT;
	if (pkt->l4_proto != IPPROTO_TCP && pkt->l4_proto != IPPROTO_UDP)
		return FLUXVM_LB_NONE;
	if (pkt->frag != FLUXVM_FRAG_NONE) {
#ifdef FLUXVM_CTX_SKB
		*verdict = fluxvm_lb_fragment(ctx, pkt, v6, edge);
#endif
		return FLUXVM_LB_NONE;
	}
	svc = fluxvm_frontend(pkt, v6, pkt->dport);
	if (!svc || (svc->flags & FLUXVM_SVC_F_VIP_MARKER) || !fluxvm_svc_here(svc, edge))
		return FLUXVM_LB_NONE;
	*sid = svc->service_id;
	*flags = svc->flags;
	if (*flags & FLUXVM_SVC_F_DSR)
		return FLUXVM_LB_DSR;
	return edge == FLUXVM_EDGE_NS ? FLUXVM_LB_SNAT : FLUXVM_LB_NAT;
}

#endif /* FLUXVM_LIB_LB_FRONTEND_H */
