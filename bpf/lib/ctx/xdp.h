/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The packet context of XDP programs (struct xdp_md) behind the same small
 * API as lib/ctx/skb.h, so that the parser, conntrack, Maglev, NAT and
 * checksum headers serve an XDP object unchanged. An entry file selects it
 * by defining FLUXVM_CTX_XDP before lib/common.h.
 *
 * What XDP differs in, said once here:
 *   - the frame is linear: our XDP programs are loaded without
 *     BPF_F_XDP_HAS_FRAGS, so the driver hands them only single-buffer
 *     frames, the whole packet lies between data and data_end, and there
 *     is nothing to pull;
 *   - a VLAN tag stays in the frame (no offload took it out): the parser
 *     sees 802.1Q as a non-IP frame and the packet passes;
 *   - there is no checksum state: every checksum in the frame is a full
 *     one, which the rewrites patch incrementally, exactly as under
 *     CHECKSUM_NONE, and no skb->csum exists to move.
 */
#ifndef FLUXVM_LIB_CTX_XDP_H
#define FLUXVM_LIB_CTX_XDP_H

#define __ctx_buff xdp_md
#ifndef FLUXVM_CTX_XDP
#define FLUXVM_CTX_XDP 1
#endif

/* Verdicts: what XDP does not finish goes on to the stack, where the TC
 * programs see it as if XDP were not there. */
#define CTX_ACT_NEXT XDP_PASS
#define CTX_ACT_DROP XDP_DROP

/* ctx->data and ctx->data_end, loaded as lib/ctx/skb.h explains. */
static __always_inline void *ctx_data(const struct __ctx_buff *ctx)
{
	void *p;

	asm volatile("%0 = *(u32 *)(%1 + %2)"
		     : "=r"(p)
		     : "r"(ctx), "i"(__builtin_offsetof(struct xdp_md, data)));
	return p;
}

static __always_inline void *ctx_data_end(const struct __ctx_buff *ctx)
{
	void *p;

	asm volatile("%0 = *(u32 *)(%1 + %2)"
		     : "=r"(p)
		     : "r"(ctx), "i"(__builtin_offsetof(struct xdp_md, data_end)));
	return p;
}

/* The whole packet's length: a single-buffer frame's. */
static __always_inline __u32 ctx_full_len(const struct __ctx_buff *ctx)
{
	return (__u32)((long)ctx_data_end(ctx) - (long)ctx_data(ctx));
}

/* Nothing lies beyond the linear frame: a read past it fails. */
static __always_inline long ctx_pull_data(struct __ctx_buff *ctx, __u32 len)
{
	(void)ctx;
	(void)len;
	return -1;
}

static __always_inline __u32 ctx_ifindex(const struct __ctx_buff *ctx)
{
	return ctx->ingress_ifindex;
}

static __always_inline int ctx_vlan_present(const struct __ctx_buff *ctx)
{
	(void)ctx;
	return 0;
}

/* The checksum state: none, as CHECKSUM_NONE (0). */
#define FLUXVM_CHECKSUM_COMPLETE 2
#define FLUXVM_CHECKSUM_PARTIAL 3

static __always_inline __u32 ctx_ip_summed(struct __ctx_buff *ctx)
{
	(void)ctx;
	return 0;
}

/* Never called: only CHECKSUM_COMPLETE moves skb->csum. */
static __always_inline void ctx_csum_update(struct __ctx_buff *ctx, __u32 diff)
{
	(void)ctx;
	(void)diff;
}

#endif /* FLUXVM_LIB_CTX_XDP_H */
