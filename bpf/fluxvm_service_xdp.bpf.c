//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fluxvm_service_xdp: the north-south XDP object of the FluxVM Service
 * Fabric, on the same maps as the TC object (fluxvm_service.bpf.c) and the
 * same feature headers, over the XDP context layer (lib/ctx/xdp.h).
 *
 * It takes the forward path of north-south VIPs off the stack: parse ->
 * frontend -> guard -> conntrack affinity or Maglev -> learn (conntrack
 * and the SNAT mapping, exactly as TC learns them) -> FIB lookup of the
 * translated packet -> DNAT and SNAT (or routed DSR), checksums, MACs and
 * TTL -> XDP_TX or a redirect. What it does not finish goes on to the
 * stack byte for byte untouched, and the TC programs serve it by the same
 * flow state:
 *   - no FIB answer or no neighbour yet (xdp_pass_no_route): XDP cannot
 *     resolve a neighbour; Cilium drops here, we pass;
 *   - fragments to a VIP (xdp_pass_fragment): TC drops them, with the
 *     reason counted;
 *   - a route out of an interface XDP may not send on (xdp_pass_egress):
 *     the loader lists in fluxvm_xdp_tx the devices that take XDP frames;
 *   - everything that is no TCP or UDP packet of a north-south VIP: ICMP
 *     errors (TC translates them), replies to the SNAT address (TC's
 *     reply path), packets of no service.
 * The parser's counters count a packet once: here if XDP finishes it,
 * else in TC; so do flow records (a packet counts into its flow's record
 * only when XDP sends it, else TC counts it).
 *
 * The route toward a flow's backend comes from the next-hop cache
 * (lib/nh.h) when the control plane keeps it on, else from the FIB.
 *
 * Known limits: an established flow costs 0.73-0.75 times Katran's
 * (docs/benchmarks.md, issue 34); XDP forwards by the FIB as TC's
 * host_routing does, so the stack's forwarding path (netfilter FORWARD,
 * egress qdiscs) is bypassed for what XDP sends; a frame whose VLAN tag
 * the driver moved to metadata, or a veth frame still CHECKSUM_PARTIAL,
 * is not told apart here (the loader must keep XDP off such interfaces).
 * A packet XDP translated leaves by XDP_TX or a redirect and never reaches
 * the TC hooks of this interface, so it is never translated twice; one it
 * passed is untouched, so TC translates it once. XDP never paces (EDT is a
 * TC egress feature).
 */
#define FLUXVM_CTX_XDP 1

#include "lib/common.h"
#include "lib/maps.h"
#include "lib/counters.h"
#include "lib/parse.h"
#include "lib/lb.h"

/* The IPv6 paths as global functions, as in the TC object: verified once
 * each; the IPv4 SNAT and DSR paths stay inline (the hot ones: a call
 * costs a conntrack hit a few ns, docs/benchmarks.md, issue 34). */
__attribute__((noinline)) int fluxvm_xdp_snat6(struct xdp_md *ctx, struct fluxvm_pkt *pkt,
					       __u32 sid, __u32 flags)
{
	if (!pkt)
		return XDP_PASS;
	return fluxvm_lb_snat(ctx, pkt, 1, sid, flags);
}

__attribute__((noinline)) int fluxvm_xdp_dsr6(struct xdp_md *ctx, struct fluxvm_pkt *pkt, __u32 sid,
					      __u32 flags)
{
	if (!pkt)
		return XDP_PASS;
	return fluxvm_lb_dsr(ctx, pkt, 1, sid, flags | FLUXVM_LB_AT_NS);
}

SEC("xdp")
int fluxvm_xdp_ns(struct xdp_md *ctx)
{
	/* On the frame, as in TC (maps.h says why). */
	struct fluxvm_pkt p = {};
	struct fluxvm_pkt *pkt = &p;
	struct fluxvm_svc_value *svc;
	enum fluxvm_lb_mode mode;
	__u32 sid = 0, flags = 0;
	int verdict, v6;

	/* Parsed without counting: a packet XDP passes is parsed and counted
	 * again by TC; the parser's counters count it once, where it is
	 * finished. */
	if (!pkt || fluxvm_parse(ctx, pkt) != FLUXVM_PARSE_OK)
		return XDP_PASS;
	if (pkt->l4_proto != IPPROTO_TCP && pkt->l4_proto != IPPROTO_UDP)
		return XDP_PASS;
	v6 = pkt->l3_proto != ETH_P_IP;
	if (pkt->frag != FLUXVM_FRAG_NONE) {
		svc = fluxvm_frontend(pkt, v6, 0);
		if (svc && fluxvm_svc_here(svc, FLUXVM_EDGE_NS))
			fluxvm_count(FLUXVM_CNT_XDP_PASS_FRAGMENT);
		return XDP_PASS;
	}
	mode = fluxvm_lb_frontend(ctx, pkt, v6, FLUXVM_EDGE_NS, &sid, &flags, &verdict);
	/* A service with an identity policy or L7 enforce: TC applies it
	 * (lib/policy.h, lib/l7.h). */
	if (mode != FLUXVM_LB_NONE && (flags & (FLUXVM_SVC_F_POLICY | FLUXVM_SVC_F_L7))) {
		fluxvm_count(FLUXVM_CNT_XDP_PASS_POLICY);
		return XDP_PASS;
	}
	switch (mode) {
	case FLUXVM_LB_SNAT:
		verdict = v6 ? fluxvm_xdp_snat6(ctx, pkt, sid, flags) : fluxvm_lb_snat(ctx, pkt, 0, sid, flags);
		break;
	case FLUXVM_LB_DSR:
		verdict = v6 ? fluxvm_xdp_dsr6(ctx, pkt, sid, flags)
			     : fluxvm_lb_dsr(ctx, pkt, 0, sid, flags | FLUXVM_LB_AT_NS);
		break;
	default:
		return XDP_PASS;
	}
	if (verdict != XDP_PASS)
		fluxvm_count_parse(FLUXVM_PARSE_OK, pkt);
	/* A client packet to a service dropped here: FluxScope records why. */
	if (verdict == XDP_DROP)
		fluxvm_flow_drop(ctx, pkt, FLUXVM_FLOW_ARG(.v6 = !!v6, .hook = FLUXVM_HOOK_XDP, .sid = sid));
	return verdict;
}

char _license[] SEC("license") = "Dual BSD/GPL";
