// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fluxvm_xdp_test: the shared feature headers over the XDP context layer
 * (lib/ctx/xdp.h), for tests only (xdp_ctx_test.go; bpf2go writes it as
 * *_test.go files, so nothing ships it). The north-south XDP object (issue
 * 17) composes the same headers; this one proves on real frames, with
 * BPF_PROG_TEST_RUN, that the parser, its counters and the NAT rewrite
 * with its checksum patches behave in XDP as they do in TC.
 *
 * fluxvm_xdp_dnat: a parsed TCP or UDP packet that is no fragment gets the
 * destination fluxvm_xdp_test_addr:fluxvm_xdp_test_port (network order,
 * IPv4 in word 0) and leaves XDP_TX; everything else passes.
 */
#define FLUXVM_CTX_XDP 1

#include "../lib/common.h"
#include "../lib/maps.h"
#include "../lib/counters.h"
#include "../lib/parse.h"
#include "../lib/nat.h"

volatile __be32 fluxvm_xdp_test_addr[4];
volatile __be16 fluxvm_xdp_test_port;

SEC("xdp")
int fluxvm_xdp_dnat(struct xdp_md *ctx)
{
	struct fluxvm_pkt pkt = {};
	__be32 addr[4];
	int v6;

	if (!fluxvm_parse_counted(ctx, &pkt))
		return XDP_PASS;
	if (pkt.l4_proto != IPPROTO_TCP && pkt.l4_proto != IPPROTO_UDP)
		return XDP_PASS;
	if (pkt.frag != FLUXVM_FRAG_NONE)
		return XDP_PASS;
	v6 = pkt.l3_proto != ETH_P_IP;
	addr[0] = fluxvm_xdp_test_addr[0];
	addr[1] = fluxvm_xdp_test_addr[1];
	addr[2] = fluxvm_xdp_test_addr[2];
	addr[3] = fluxvm_xdp_test_addr[3];
	if (fluxvm_rewrite(ctx, &pkt, v6, 1, addr, fluxvm_xdp_test_port))
		return XDP_ABORTED;
	return XDP_TX;
}

char _license[] SEC("license") = "Dual BSD/GPL";
