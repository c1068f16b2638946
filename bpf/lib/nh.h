/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * XDP's next-hop cache: the FIB's answer toward a backend, kept per CPU.
 *
 * Why: bpf_fib_lookup costs ~230 ns a call on the machines we measure
 * (docs/benchmarks.md, "Issue 17"), more than the rest of an established
 * flow's XDP path, and every packet of a flow asks the same question: the
 * route from the ingress interface to the flow's backend. The answer
 * (egress interface, MACs, MTU) is kept per backend and ingress interface.
 * Written by fluxvm_xdp_route (lib/lb.h).
 *
 * When an answer may be used, which is where a cache of routes goes wrong:
 *   - only while the control plane holds a lease on the cache
 *     (fluxvm_nh_ctl.until, renewed every second or so): it holds one only
 *     where the answer depends on the destination and the ingress
 *     interface alone (no policy rules or routes that select by source
 *     or TOS, no multipath routes; fluxvm/xdproutes*.go), so every flow
 *     to a backend gets the answer the FIB would give it. A control plane
 *     that stops (closed, killed) stops renewing, and the cache turns
 *     itself off within seconds;
 *   - only in the FIB generation it was learned in: the control plane
 *     moves fluxvm_nh_ctl.gen on at every route, rule, neighbour, link,
 *     address, nexthop or netconf change it hears of, at a lost
 *     notification, when it edits the interfaces XDP may send on, and
 *     when it gives a backend id to another backend;
 *   - for at most FLUXVM_NH_TTL, for what no notification announces (a
 *     path MTU learned from ICMP);
 *   - for packets that fit the route's MTU, and with a TTL left to
 *     forward: everything else asks the FIB, which answers as it would
 *     without the cache (a miss passes the packet to the stack).
 * Only full answers (next hop's link-layer address known, an interface
 * XDP may send on) are kept. Per CPU, so no entry is ever read while
 * another CPU writes it; direct-mapped by backend id, so a backend that
 * shares a slot with another just asks the FIB more often.
 */
#ifndef FLUXVM_LIB_NH_H
#define FLUXVM_LIB_NH_H

#include "common.h"

#define FLUXVM_NH_SLOTS 4096 /* a power of two */
/* In units of the coarse clock >> 20 (1.05 ms): about one second. */
#define FLUXVM_NH_TTL 1000

struct fluxvm_nh_entry {
	__u32 backend_id_1; /* the owner's backend id + 1; 0: empty */
	__u32 iif;          /* the ingress interface the answer is for */
	__u32 oif;          /* the egress interface */
	__u32 gen;          /* fluxvm_nh_ctl.gen when learned */
	__u32 born;         /* coarse clock >> 20 when learned */
	__u16 mtu;          /* the route's MTU (bpf_fib_lookup's mtu_result) */
	__u8 dmac[6];
	__u8 smac[6];
	__u8 pad[6];
};
_Static_assert(sizeof(struct fluxvm_nh_entry) == 40, "fluxvm_nh_entry size");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_nh_entry);
	__uint(max_entries, FLUXVM_NH_SLOTS);
} fluxvm_nh SEC(".maps");

/* Written by the control plane only (bpf.Datapath), as one 64-bit word
 * at key 0: the generation (low half) and the lease (high half: the
 * cache may be used while the coarse clock >> 20 is before it; 0: off). A
 * new program starts with the cache off. */
struct fluxvm_nh_ctl {
	__u32 gen;
	__u32 until;
};
_Static_assert(sizeof(struct fluxvm_nh_ctl) == 8, "fluxvm_nh_ctl size");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_nh_ctl);
	__uint(max_entries, 1);
} fluxvm_nh_ctl SEC(".maps");

/* The slot of backend @bid, and the generation its answer must be of in
 * *@gen; NULL while the control plane holds no lease at @now. */
static __always_inline struct fluxvm_nh_entry *fluxvm_nh_slot(__u32 bid, __u64 now, __u32 *gen)
{
	__u32 zero = 0, slot = bid & (FLUXVM_NH_SLOTS - 1);
	struct fluxvm_nh_ctl *ctl = bpf_map_lookup_elem(&fluxvm_nh_ctl, &zero);
	__u64 w;

	if (!ctl)
		return NULL;
	/* One load: the generation and the lease as written together. */
	w = *(volatile __u64 *)ctl;
	if ((__s32)((__u32)(w >> 32) - (__u32)(now >> 20)) <= 0)
		return NULL;
	*gen = (__u32)w;
	return bpf_map_lookup_elem(&fluxvm_nh, &slot);
}

/* Learn @e for backend @bid: the owner field cleared first and set last,
 * so that a program preempted on this CPU (PREEMPT_RT) never meets an
 * entry half of one answer and half of another. */
static __always_inline void fluxvm_nh_learn(struct fluxvm_nh_entry *e, __u32 bid, __u32 gen,
					    __u32 iif, __u64 now, const struct bpf_fib_lookup *fib)
{
	e->backend_id_1 = 0;
	asm volatile("" ::: "memory");
	e->iif = iif;
	e->oif = fib->ifindex;
	e->gen = gen;
	e->born = (__u32)(now >> 20);
	e->mtu = fib->mtu_result;
	__builtin_memcpy(e->dmac, fib->dmac, ETH_ALEN);
	__builtin_memcpy(e->smac, fib->smac, ETH_ALEN);
	asm volatile("" ::: "memory");
	e->backend_id_1 = bid + 1;
}

/* Is @e a usable answer toward backend @bid from interface @iif for an L3
 * packet of @len bytes at @now? @len 0: a packet that may not be forwarded
 * from here, which only the FIB lookup's checks may pass on. */
static __always_inline int fluxvm_nh_fresh(const struct fluxvm_nh_entry *e, __u32 bid, __u32 gen,
					   __u32 iif, __u32 len, __u64 now)
{
	return len && e->backend_id_1 == bid + 1 && e->iif == iif && e->gen == gen &&
	       (__u32)(now >> 20) - e->born < FLUXVM_NH_TTL && len <= e->mtu;
}

#endif /* FLUXVM_LIB_NH_H */
