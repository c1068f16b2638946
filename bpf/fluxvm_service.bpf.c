//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fluxvm_service: the TC object of the FluxVM Service Fabric.
 *
 * Each program is one attach point and only composes the feature headers
 * in lib/, so a packet can be followed top to bottom in its entry function.
 * A packet that is not for a service continues to the next program
 * (TC_ACT_UNSPEC, which is also TCX_NEXT), so the VM policy program behind
 * us still filters it.
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/counters.h"
#include "lib/parse.h"
#include "lib/lb.h"
#include "lib/icmp.h"
#include "lib/l7.h"

/*
 * The feature paths, one global (non-inlined) function per path, address
 * family and hook kind. The verifier checks a global function once, on its
 * own, instead of once per way of reaching it: the programs below stay far
 * from the verifier's instruction limit and load in a fraction of the time,
 * for the cost of a BPF-to-BPF call. @pkt points at the caller's parse
 * result; the verifier cannot know it is never NULL.
 *
 * The parse result is on each program's stack, not in per-CPU scratch:
 * the inlined hot paths then address it from the frame pointer, while a
 * pointer into scratch took one of the four registers a call keeps
 * (3-9% on the IPv4 conntrack-hit and reply paths, docs/benchmarks.md).
 * The 448-byte stack limit is kept by the IPv6 reply's key in scratch
 * instead (fluxvm_scratch_tuple6); the IPv6 NAT forward's conntrack key
 * is on its frame, within 448 bytes since fluxvm_flow_open's frame is 32.
 *
 * The hot paths stay inline in their programs: the VM-edge reply path in
 * fluxvm_to_vm, its only user, and the IPv4 east-west NAT path in
 * fluxvm_from_vm, so that an IPv4 conntrack hit or pass-through packet pays
 * for no BPF-to-BPF call (which cost it 4-12 ns). That fits in the 512-byte
 * stack a program shares with the global functions it calls only because
 * the rare paths' state (new conntrack entries, reverse-NAT keys and
 * values, FIB lookups) lives in per-CPU scratch (lib/maps.h). IPv6 stays a
 * call: inlined as well, fluxvm_from_vm's frame plus fluxvm_icmp6_snat's
 * would reach the limit exactly. Every program calls the SNAT reply path
 * only for packets to the SNAT address, so that pass-through traffic pays
 * for no extra call. ICMP goes to the ICMP error path instead (the TCP/UDP
 * paths have nothing for it).
 *
 * The forward paths are one per mode (lib/lb.h), called from the program
 * once the frontend stage found the service and its mode: DSR, the rare
 * mode, costs the programs one verification per family instead of one per
 * edge, and no call chain holds two forward paths' frames.
 */
#define FLUXVM_PATH(name, call)                                                 \
	__attribute__((noinline)) int name(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt) \
	{                                                                       \
		if (!pkt)                                                       \
			return CTX_ACT_NEXT;                                    \
		return call;                                                    \
	}
/* A forward path takes the frontend's service id and flags (DSR's with
 * FLUXVM_LB_AT_NS at the north-south edge, for its flow records). */
#define FLUXVM_LB_PATH(name, call)                                              \
	__attribute__((noinline)) int name(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, \
					   __u32 sid, __u32 flags)              \
	{                                                                       \
		if (!pkt)                                                       \
			return CTX_ACT_NEXT;                                    \
		return call;                                                    \
	}

FLUXVM_LB_PATH(fluxvm_forward6_nat, fluxvm_lb_nat(ctx, pkt, 1, sid, flags))
FLUXVM_LB_PATH(fluxvm_forward4_snat, fluxvm_lb_snat(ctx, pkt, 0, sid, flags))
FLUXVM_LB_PATH(fluxvm_forward6_snat, fluxvm_lb_snat(ctx, pkt, 1, sid, flags))
FLUXVM_LB_PATH(fluxvm_forward4_dsr, fluxvm_lb_dsr(ctx, pkt, 0, sid, flags))
FLUXVM_LB_PATH(fluxvm_forward6_dsr, fluxvm_lb_dsr(ctx, pkt, 1, sid, flags))
/* East-west replies of flows that stored a reverse-NAT half (a backend
 * listed by more frontends than fluxvm_be2fe has slots). */
FLUXVM_PATH(fluxvm_reply4_stored, fluxvm_lb_reply(ctx, pkt, 0, FLUXVM_REPLY_EW, 0))
FLUXVM_PATH(fluxvm_reply6_stored, fluxvm_lb_reply(ctx, pkt, 1, FLUXVM_REPLY_EW, 0))
FLUXVM_PATH(fluxvm_reply4_snat_in, fluxvm_lb_reply(ctx, pkt, 0, FLUXVM_REPLY_SNAT, 1))
FLUXVM_PATH(fluxvm_reply6_snat_in, fluxvm_lb_reply(ctx, pkt, 1, FLUXVM_REPLY_SNAT, 1))
/* North-south replies leaving already translated, while a north-south
 * service is paced (lib/edt.h). */
FLUXVM_PATH(fluxvm_edt_out4, fluxvm_edt_ns_out(ctx, pkt, 0))
FLUXVM_PATH(fluxvm_edt_out6, fluxvm_edt_ns_out(ctx, pkt, 1))
FLUXVM_PATH(fluxvm_reply4_snat_out, fluxvm_lb_reply(ctx, pkt, 0, FLUXVM_REPLY_SNAT, 0))
FLUXVM_PATH(fluxvm_reply6_snat_out, fluxvm_lb_reply(ctx, pkt, 1, FLUXVM_REPLY_SNAT, 0))
/* ICMP errors about translated flows (lib/icmp.h), for the two reply
 * directions: to an east-west client, and to the SNAT address. */
FLUXVM_PATH(fluxvm_icmp4_ew, fluxvm_icmp_error(ctx, pkt, 0, FLUXVM_REPLY_EW))
FLUXVM_PATH(fluxvm_icmp6_ew, fluxvm_icmp_error(ctx, pkt, 1, FLUXVM_REPLY_EW))
FLUXVM_PATH(fluxvm_icmp4_snat, fluxvm_icmp_error(ctx, pkt, 0, FLUXVM_REPLY_SNAT))
FLUXVM_PATH(fluxvm_icmp6_snat, fluxvm_icmp_error(ctx, pkt, 1, FLUXVM_REPLY_SNAT))

/*
 * Client -> VIP at @edge: the frontend stage, then the path of the
 * service's mode. CTX_ACT_NEXT when the packet is not for a service
 * served here.
 */
static __always_inline int fluxvm_forward(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt,
					  const int v6, const int edge)
{
	__u32 sid = 0, flags = 0;
	enum fluxvm_lb_mode mode;
	int verdict;

	mode = fluxvm_lb_frontend(ctx, pkt, v6, edge, &sid, &flags, &verdict);
	/* L7 enforce (lib/l7.h): a flow for the proxy goes there; others,
	 * among them the proxy's own, take the mode's path. */
	if (mode != FLUXVM_LB_NONE && (flags & FLUXVM_SVC_F_L7)) {
		verdict = fluxvm_l7_stage(ctx, pkt,
					  FLUXVM_FLOW_ARG(.v6 = !!v6, .hook = FLUXVM_FWD_HOOK(edge == FLUXVM_EDGE_NS), .sid = sid));
		if (verdict != FLUXVM_L7_LB)
			mode = FLUXVM_LB_NONE;
	}
	switch (mode) {
	case FLUXVM_LB_NAT:
		/* Inline for IPv4: the conntrack-hit path (see above). */
		verdict = v6 ? fluxvm_forward6_nat(ctx, pkt, sid, flags) : fluxvm_lb_nat(ctx, pkt, 0, sid, flags);
		break;
	case FLUXVM_LB_SNAT:
		verdict = v6 ? fluxvm_forward6_snat(ctx, pkt, sid, flags) : fluxvm_forward4_snat(ctx, pkt, sid, flags);
		break;
	case FLUXVM_LB_DSR:
		if (edge == FLUXVM_EDGE_NS)
			flags |= FLUXVM_LB_AT_NS;
		verdict = v6 ? fluxvm_forward6_dsr(ctx, pkt, sid, flags) : fluxvm_forward4_dsr(ctx, pkt, sid, flags);
		break;
	default:
		/* Not for a service here; or a fragment to a VIP, dropped and
		 * recorded (fluxvm_lb_fragment); or the L7 stage's verdict. */
		if (verdict != CTX_ACT_DROP || !(flags & FLUXVM_SVC_F_L7))
			return verdict;
	}
	/* A client packet to a service dropped: FluxScope records why. */
	if (verdict == CTX_ACT_DROP)
		fluxvm_flow_drop(ctx, pkt,
				 FLUXVM_FLOW_ARG(.v6 = !!v6, .hook = FLUXVM_FWD_HOOK(edge == FLUXVM_EDGE_NS), .sid = sid));
	return verdict;
}

/* VM-edge ingress: packets a VM sends. East-west VIPs are DNATed (or
 * forwarded by DSR) here; a VM backend's replies to the SNAT address of a
 * north-south flow get the VIP and the client back. */
SEC("tc")
int fluxvm_from_vm(struct __ctx_buff *ctx)
{
	struct fluxvm_pkt pkt = {};
	int ret;

	if (!fluxvm_parse_counted(ctx, &pkt))
		return CTX_ACT_NEXT;
	/* ICMP is never service traffic; errors to the SNAT address are
	 * translated back (fluxvm_icmp*_snat check the address). */
	if (pkt.l3_proto == ETH_P_IP) {
		if (pkt.l4_proto == IPPROTO_ICMP)
			return fluxvm_icmp4_snat(ctx, &pkt);
		ret = fluxvm_forward(ctx, &pkt, 0, FLUXVM_EDGE_VM);
		if (ret == CTX_ACT_NEXT && fluxvm_is_snat_addr(pkt.daddr, 0))
			ret = fluxvm_reply4_snat_in(ctx, &pkt);
		return ret;
	}
	if (pkt.l4_proto == IPPROTO_ICMPV6)
		return fluxvm_icmp6_snat(ctx, &pkt);
	ret = fluxvm_forward(ctx, &pkt, 1, FLUXVM_EDGE_VM);
	if (ret == CTX_ACT_NEXT && fluxvm_is_snat_addr(pkt.daddr, 1))
		ret = fluxvm_reply6_snat_in(ctx, &pkt);
	return ret;
}

/* VM-edge egress: packets delivered to a VM. Replies from a backend get the
 * VIP back as their source. */
SEC("tc")
int fluxvm_to_vm(struct __ctx_buff *ctx)
{
	struct fluxvm_pkt pkt = {};
	int ret;

	if (!fluxvm_parse_counted(ctx, &pkt))
		return CTX_ACT_NEXT;
	if (pkt.l3_proto == ETH_P_IP) {
		if (pkt.l4_proto == IPPROTO_ICMP)
			return fluxvm_icmp4_ew(ctx, &pkt);
		ret = fluxvm_lb_reply_ew(ctx, &pkt, 0);
		return ret == FLUXVM_REPLY_STORED ? fluxvm_reply4_stored(ctx, &pkt) : ret;
	}
	if (pkt.l4_proto == IPPROTO_ICMPV6)
		return fluxvm_icmp6_ew(ctx, &pkt);
	ret = fluxvm_lb_reply_ew(ctx, &pkt, 1);
	return ret == FLUXVM_REPLY_STORED ? fluxvm_reply6_stored(ctx, &pkt) : ret;
}

/* North-south ingress: clients outside the node reach north-south VIPs
 * (DNAT + SNAT, or routed DSR); remote backends' replies to the SNAT
 * address are translated back. */
SEC("tc")
int fluxvm_ns_in(struct __ctx_buff *ctx)
{
	struct fluxvm_pkt pkt = {};
	int ret;

	if (!fluxvm_parse_counted(ctx, &pkt))
		return CTX_ACT_NEXT;
	if (pkt.l3_proto == ETH_P_IP) {
		if (pkt.l4_proto == IPPROTO_ICMP)
			return fluxvm_icmp4_snat(ctx, &pkt);
		ret = fluxvm_forward(ctx, &pkt, 0, FLUXVM_EDGE_NS);
		if (ret == CTX_ACT_NEXT && fluxvm_is_snat_addr(pkt.daddr, 0))
			ret = fluxvm_reply4_snat_in(ctx, &pkt);
		return ret;
	}
	if (pkt.l4_proto == IPPROTO_ICMPV6)
		return fluxvm_icmp6_snat(ctx, &pkt);
	ret = fluxvm_forward(ctx, &pkt, 1, FLUXVM_EDGE_NS);
	if (ret == CTX_ACT_NEXT && fluxvm_is_snat_addr(pkt.daddr, 1))
		ret = fluxvm_reply6_snat_in(ctx, &pkt);
	return ret;
}

/* North-south egress: the reverse path for replies that meet none of our
 * ingress hooks first, such as those of a backend on the node itself when
 * the SNAT address is routed to the node rather than assigned to it; and
 * the pacing of north-south replies already translated (lib/edt.h). */
SEC("tc")
int fluxvm_ns_out(struct __ctx_buff *ctx)
{
	struct fluxvm_pkt pkt = {};

	if (!fluxvm_parse_counted(ctx, &pkt))
		return CTX_ACT_NEXT;
	if (pkt.l3_proto == ETH_P_IP) {
		if (pkt.l4_proto == IPPROTO_ICMP)
			return fluxvm_icmp4_snat(ctx, &pkt);
		if (!fluxvm_is_snat_addr(pkt.daddr, 0))
			return fluxvm_edt_ns_active() ? fluxvm_edt_out4(ctx, &pkt) : CTX_ACT_NEXT;
		return fluxvm_reply4_snat_out(ctx, &pkt);
	}
	if (pkt.l4_proto == IPPROTO_ICMPV6)
		return fluxvm_icmp6_snat(ctx, &pkt);
	if (!fluxvm_is_snat_addr(pkt.daddr, 1))
		return fluxvm_edt_ns_active() ? fluxvm_edt_out6(ctx, &pkt) : CTX_ACT_NEXT;
	return fluxvm_reply6_snat_out(ctx, &pkt);
}

char _license[] SEC("license") = "Dual BSD/GPL";
