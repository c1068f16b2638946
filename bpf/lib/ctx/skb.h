/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The packet context of TC programs (struct __sk_buff) behind the small API
 * the feature headers use: parser, conntrack, Maglev, NAT and checksum code
 * reach the packet only through __ctx_buff and the ctx_* functions below, so
 * an XDP object can serve the same headers with a ctx/xdp.h of its own.
 *
 * What only an skb has is said here: a length beyond the linear data
 * (ctx_pull_data makes it readable), a VLAN tag taken out of the frame, and
 * a checksum state (ip_summed, skb->csum) that rewrites must keep true.
 */
#ifndef FLUXVM_LIB_CTX_SKB_H
#define FLUXVM_LIB_CTX_SKB_H

#define __ctx_buff __sk_buff
#define FLUXVM_CTX_SKB 1

/*
 * Verdicts. TC_ACT_UNSPEC is also TCX_NEXT: with TCX links and with cls_bpf
 * chains alike it hands the packet to the next program, so traffic that is
 * not ours is still seen by the policy program behind us.
 */
#define CTX_ACT_NEXT TC_ACT_UNSPEC
#define CTX_ACT_DROP TC_ACT_SHOT

/*
 * ctx->data and ctx->data_end, loaded by an instruction clang cannot fold
 * into an earlier address computation. The verifier only accepts ctx loads
 * at a constant offset from the unmodified ctx pointer; left to itself,
 * clang may keep "ctx + 80" in a register across a helper call and load
 * through it, which the verifier refuses ("dereference of modified ctx
 * ptr"), or reuse a stale load after a helper that moved the packet.
 */
static __always_inline void *ctx_data(const struct __ctx_buff *ctx)
{
	void *p;

	asm volatile("%0 = *(u32 *)(%1 + %2)"
		     : "=r"(p)
		     : "r"(ctx), "i"(__builtin_offsetof(struct __sk_buff, data)));
	return p;
}

static __always_inline void *ctx_data_end(const struct __ctx_buff *ctx)
{
	void *p;

	asm volatile("%0 = *(u32 *)(%1 + %2)"
		     : "=r"(p)
		     : "r"(ctx), "i"(__builtin_offsetof(struct __sk_buff, data_end)));
	return p;
}

/* The whole packet's length, paged data included. */
static __always_inline __u32 ctx_full_len(const struct __ctx_buff *ctx)
{
	return ctx->len;
}

/* Make the first @len bytes direct-accessible; 0 on success. */
static __always_inline long ctx_pull_data(struct __ctx_buff *ctx, __u32 len)
{
	return bpf_skb_pull_data(ctx, len);
}

/* The interface the packet is on (for statistics, FIB lookups). */
static __always_inline __u32 ctx_ifindex(const struct __ctx_buff *ctx)
{
	return ctx->ifindex;
}

/* A VLAN tag the device took out of the frame: the frame itself then looks
 * untagged, so the parser must be told. */
static __always_inline int ctx_vlan_present(const struct __ctx_buff *ctx)
{
	return ctx->vlan_present;
}

/*
 * The checksum state. __sk_buff does not expose ip_summed, so it is read
 * from the kernel's sk_buff through bpf_cast_to_kern_ctx (a no-op cast the
 * verifier resolves, Linux 6.3+) with a CO-RE relocated bitfield read.
 */
extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

struct sk_buff___fluxvm {
	__u8 ip_summed : 2;
} __attribute__((preserve_access_index));

#define FLUXVM_CHECKSUM_COMPLETE 2
#define FLUXVM_CHECKSUM_PARTIAL 3

/*
 * A test object may stand in for the checksum state (bpf/testdata): it
 * defines ctx_ip_summed_read (the bitfield read alone, so that the kfunc
 * call stays and the verifier sees the same calls) and ctx_csum_update as
 * macros before including the headers, and these definitions step aside.
 */
#ifndef ctx_ip_summed_read
#define ctx_ip_summed_read(k) BPF_CORE_READ_BITFIELD(k, ip_summed)
#endif

static __always_inline __u32 ctx_ip_summed(struct __ctx_buff *ctx)
{
	struct sk_buff___fluxvm *k = bpf_cast_to_kern_ctx(ctx);

	return ctx_ip_summed_read(k);
}

#ifndef ctx_csum_update
/* Move skb->csum (CHECKSUM_COMPLETE) by the folded partial sum @diff. */
static __always_inline void ctx_csum_update(struct __ctx_buff *ctx, __u32 diff)
{
	bpf_csum_update(ctx, diff);
}
#endif

#endif /* FLUXVM_LIB_CTX_SKB_H */
