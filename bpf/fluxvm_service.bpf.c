//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fluxvm_service: the TC object of the FluxVM Service Fabric.
 *
 * Each program is one attach point and only composes the feature headers
 * in lib/, so a packet can be followed top to bottom in its entry function.
 */
#include "lib/common.h"
#include "lib/counters.h"
#include "lib/parse.h"

/*
 * VM-edge ingress: packets sent by a VM. For now every packet is parsed and
 * counted, then handed on unchanged to the next program in the chain.
 */
SEC("tc")
int fluxvm_from_vm(struct __sk_buff *skb)
{
	struct fluxvm_pkt pkt = {};

	fluxvm_count_parse(fluxvm_parse(skb, &pkt), &pkt);
	return FLUXVM_TC_NEXT;
}

char _license[] SEC("license") = "Dual BSD/GPL";
