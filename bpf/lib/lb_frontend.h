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

/*
 * The IPv4 frontend index (fluxvm_fe4; layout and states in
 * fluxvm_abi_service.bpf.h). Why: a hash-map lookup is a call into the
 * kernel (hashing, a bucket walk, a key compare), and the frontend stage
 * is the one every packet pays, to a VIP or not. Read through the index,
 * the stage is an array read the verifier inlines, a multiply and a few
 * compares: on this machine it took an established XDP flow from about
 * 128 to about 85 ns and a packet to no VIP from about 50 to about 15
 * (docs/benchmarks.md, issue 34 point 5).
 *
 * The key's 8 bytes as one word (vip, port, protocol; the state byte
 * zero), as fluxvm_svc4_key lays them out, and its slot
 * (fluxvm_fe4_slot_of). The loader computes both the same way
 * (bpf/feindex.go).
 */
#define FLUXVM_FE_HASH_MUL 0x9E3779B97F4A7C15ULL
#define FLUXVM_FE_CHECK_MUL0 0xC2B2AE3D27D4EB4FULL
#define FLUXVM_FE_CHECK_MUL1 0x165667B19E3779F9ULL

static __always_inline __u64 fluxvm_fe4_word(__be32 vip, __be16 port, __u8 proto)
{
	return (__u64)vip | (__u64)port << 32 | (__u64)proto << 48;
}

/* The slot of key word @key: multiply, fold the high bits down, multiply
 * again, and take the top FLUXVM_FE4_BITS bits. One multiply alone would
 * make keys that differ in the VIP only collide at every port together. */
static __always_inline __u32 fluxvm_fe4_slot_of(__u64 key)
{
	__u64 x = key * FLUXVM_FE_HASH_MUL;

	x ^= x >> 29;
	x *= FLUXVM_FE_CHECK_MUL0;
	return (__u32)(x >> (64 - FLUXVM_FE4_BITS));
}

/* The check of a slot's first 16 bytes, @w0 and @w1 as loaded. */
static __always_inline __u32 fluxvm_fe4_check(__u64 w0, __u64 w1)
{
	return (__u32)((w0 * FLUXVM_FE_CHECK_MUL0 ^ w1 * FLUXVM_FE_CHECK_MUL1) >> 32);
}

/*
 * The index's answer for IPv4 key @key (fluxvm_fe4_word): 1 when the
 * slot answers, with *@found set (and *@sid, *@flags when found); 0 when
 * it cannot (never written, shared, or read while being rewritten) and
 * fluxvm_svc4 must be asked.
 */
static __always_inline int fluxvm_fe4_lookup(__u64 key, __u32 *sid, __u32 *flags, int *found)
{
	__u32 idx = fluxvm_fe4_slot_of(key);
	struct fluxvm_fe4_slot *slot = bpf_map_lookup_elem(&fluxvm_fe4, &idx);
	__u64 w0, w1;
	__u32 check;

	if (!slot)
		return 0;
	/* Each word read once: the check and the answer come from the same
	 * bytes. */
	w0 = *(volatile __u64 *)slot;
	w1 = *((volatile __u64 *)slot + 1);
	check = *(volatile __u32 *)&slot->check;
	if (check != fluxvm_fe4_check(w0, w1))
		return 0;
	switch (w0 >> 56) {
	case FLUXVM_FE_EMPTY:
		*found = 0;
		return 1;
	case FLUXVM_FE_ONE:
		/* The one frontend of this slot is this key, or the key is
		 * none. */
		*found = (w0 & 0x00ffffffffffffffULL) == key;
		if (*found) {
			*sid = (__u32)w1;
			*flags = (__u32)(w1 >> 32);
		}
		return 1;
	}
	return 0;
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
	int found;

	*verdict = CTX_ACT_NEXT;
	if (pkt->l4_proto != IPPROTO_TCP && pkt->l4_proto != IPPROTO_UDP)
		return FLUXVM_LB_NONE;
	if (pkt->frag != FLUXVM_FRAG_NONE) {
#ifdef FLUXVM_CTX_SKB
		*verdict = fluxvm_lb_fragment(ctx, pkt, v6, edge);
#endif
		return FLUXVM_LB_NONE;
	}
	if (v6 || !fluxvm_fe4_lookup(fluxvm_fe4_word(pkt->daddr[0], pkt->dport, pkt->l4_proto), sid, flags,
				     &found)) {
		svc = fluxvm_frontend(pkt, v6, pkt->dport);
		found = svc != NULL;
		if (svc) {
			*sid = svc->service_id;
			*flags = svc->flags;
		}
	}
	if (!found || (*flags & FLUXVM_SVC_F_VIP_MARKER) || !fluxvm_svc_flags_here(*flags, edge))
		return FLUXVM_LB_NONE;
	if (*flags & FLUXVM_SVC_F_DSR)
		return FLUXVM_LB_DSR;
	return edge == FLUXVM_EDGE_NS ? FLUXVM_LB_SNAT : FLUXVM_LB_NAT;
}

#endif /* FLUXVM_LIB_LB_FRONTEND_H */
