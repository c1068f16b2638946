// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fluxvm_test: the TC object of fluxvm_service.bpf.c, same source and same
 * maps and programs, with seams for datapath tests only (complete_test.go;
 * bpf2go writes it as *_test.go files, so nothing ships it).
 *
 * CHECKSUM_COMPLETE. BPF_PROG_TEST_RUN builds every skb with
 * CHECKSUM_NONE, no helper can change ip_summed, and no software device
 * hands a TC ingress hook a CHECKSUM_COMPLETE packet (veth, tun and GRO
 * give NONE, PARTIAL or UNNECESSARY; only NICs compute a full sum), so the
 * branches that move skb->csum never ran in the real object. Here:
 *   - the checksum state the datapath reads is fluxvm_test_summed: the
 *     CO-RE bitfield read of sk_buff->ip_summed is replaced (the
 *     bpf_cast_to_kern_ctx call stays, so the verifier sees the same
 *     calls as in the real object);
 *   - bpf_csum_update does what the kernel's does under
 *     CHECKSUM_COMPLETE, on fluxvm_test_csum instead of skb->csum:
 *     csum_add(csum, diff). The test seeds fluxvm_test_csum with the sum
 *     of the input from the IP header on and requires the sum of the
 *     output's bytes after the run.
 */
#include "../lib/common.h"

volatile __u32 fluxvm_test_summed;       /* ip_summed as the datapath sees it */
volatile __u32 fluxvm_test_csum;         /* skb->csum under CHECKSUM_COMPLETE */
volatile __u32 fluxvm_test_csum_updates; /* bpf_csum_update calls */

#undef BPF_CORE_READ_BITFIELD
#define BPF_CORE_READ_BITFIELD(s, field) ((void)(s), fluxvm_test_summed)

static __always_inline __s64 fluxvm_test_csum_update(struct __sk_buff *skb, __wsum diff)
{
	__u32 c = fluxvm_test_csum + diff;

	(void)skb;
	c += c < diff;
	fluxvm_test_csum = c;
	fluxvm_test_csum_updates++;
	return c;
}
#define bpf_csum_update(skb, diff) fluxvm_test_csum_update(skb, diff)

#include "../fluxvm_service.bpf.c"
