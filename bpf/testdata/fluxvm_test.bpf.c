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
 *
 * Flags the datapath writes and reads back itself (FLUXVM_NAT_F_SNAT,
 * FLUXVM_CT_F_SNAT) are moved off bit 0, so a test of a flag that holds
 * only because the flag is bit 0 (snat = flags & F; snat != bool) fails.
 *
 * LRU recycling. Another CPU's update may recycle a reverse-NAT entry for
 * another flow while a program still holds a pointer to it. With
 * fluxvm_test_recycle set (4 or 6), the first per-service statistics
 * lookup (the reply path's first map operation after its reverse-NAT
 * lookup) overwrites the entry fluxvm_test_recycle_key4/6 names with
 * fluxvm_test_recycle_val first, once: what the program reads from its
 * pointer after that is another flow's.
 */
/* The checksum-state seams of the context layer (lib/ctx/skb.h): defined
 * before the headers, so that theirs step aside. */
volatile unsigned int fluxvm_test_summed; /* ip_summed as the datapath sees it */
#define ctx_ip_summed_read(k) ((void)(k), fluxvm_test_summed)
#define ctx_csum_update(ctx, diff) fluxvm_test_csum_update(ctx, diff)

#include "../lib/common.h"
#include "../lib/maps.h"
#include "../lib/counters.h"

/* Both are enum members (fluxvm_service_v6.bpf.h, already included): these
 * macros shadow them in all the code below, and the #undefs are no-ops. */
#undef FLUXVM_NAT_F_SNAT
#define FLUXVM_NAT_F_SNAT (1U << 5)
#undef FLUXVM_CT_F_SNAT
#define FLUXVM_CT_F_SNAT (1U << 5)

volatile __u32 fluxvm_test_csum;         /* skb->csum under CHECKSUM_COMPLETE */
volatile __u32 fluxvm_test_csum_updates; /* bpf_csum_update calls */

static __always_inline __s64 fluxvm_test_csum_update(struct __sk_buff *skb, __wsum diff)
{
	__u32 c = fluxvm_test_csum + diff;

	(void)skb;
	c += c < diff;
	fluxvm_test_csum = c;
	fluxvm_test_csum_updates++;
	return c;
}

volatile __u32 fluxvm_test_recycle;
struct fluxvm_tuple4 fluxvm_test_recycle_key4;
struct fluxvm_tuple6 fluxvm_test_recycle_key6;
struct fluxvm_nat_value fluxvm_test_recycle_val;

static __always_inline struct fluxvm_svc_stats_value *fluxvm_test_stats(__u32 service_id)
{
	__u32 family = fluxvm_test_recycle;
	struct fluxvm_nat_value *v = NULL;

	if (family) {
		fluxvm_test_recycle = 0;
		if (family == 6)
			v = bpf_map_lookup_elem(&fluxvm_nat6, &fluxvm_test_recycle_key6);
		else
			v = bpf_map_lookup_elem(&fluxvm_nat4, &fluxvm_test_recycle_key4);
		if (v)
			__builtin_memcpy(v, &fluxvm_test_recycle_val, sizeof(*v));
	}
	return fluxvm_stats(service_id);
}
#define fluxvm_stats(service_id) fluxvm_test_stats(service_id)

#include "../fluxvm_service.bpf.c"
