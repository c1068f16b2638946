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

/* VM-edge ingress: packets a VM sends. East-west VIPs are DNATed here. */
SEC("tc")
int fluxvm_from_vm(struct __sk_buff *skb)
{
	struct fluxvm_pkt pkt = {};
	int ret = fluxvm_parse(skb, &pkt);

	fluxvm_count_parse(ret, &pkt);
	if (ret != FLUXVM_PARSE_OK)
		return FLUXVM_TC_NEXT;
	if (pkt.l3_proto == ETH_P_IP)
		return fluxvm_lb_forward(skb, &pkt, 0);
	return fluxvm_lb_forward(skb, &pkt, 1);
}

/* VM-edge egress: packets delivered to a VM. Replies from a backend get the
 * VIP back as their source. */
SEC("tc")
int fluxvm_to_vm(struct __sk_buff *skb)
{
	struct fluxvm_pkt pkt = {};
	int ret = fluxvm_parse(skb, &pkt);

	fluxvm_count_parse(ret, &pkt);
	if (ret != FLUXVM_PARSE_OK)
		return FLUXVM_TC_NEXT;
	if (pkt.l3_proto == ETH_P_IP)
		return fluxvm_lb_reply(skb, &pkt, 0);
	return fluxvm_lb_reply(skb, &pkt, 1);
}

char _license[] SEC("license") = "Dual BSD/GPL";
