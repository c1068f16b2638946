/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The maps of BPF schema 4. Layouts are in fluxvm_service_v6.bpf.h,
 * capacities in fluxvm_service_maps.bpf.h. Pinning is done by the Go loader,
 * which owns the pin root and decides which maps survive a reload.
 */
#ifndef FLUXVM_LIB_MAPS_H
#define FLUXVM_LIB_MAPS_H

#include "common.h"
#include "pkt_types.h"

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct fluxvm_svc4_key);
	__type(value, struct fluxvm_svc_value);
	__uint(max_entries, FLUXVM_MAX_FRONTENDS);
} fluxvm_svc4 SEC(".maps");

/* The IPv4 frontend index (fluxvm_abi_service.bpf.h, lib/lb_frontend.h). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_fe4_slot);
	__uint(max_entries, FLUXVM_FE4_SLOTS);
} fluxvm_fe4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct fluxvm_svc6_key);
	__type(value, struct fluxvm_svc_value);
	__uint(max_entries, FLUXVM_MAX_FRONTENDS);
} fluxvm_svc6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_backend);
	__uint(max_entries, FLUXVM_MAX_BACKENDS);
} fluxvm_backends SEC(".maps");

/*
 * One Maglev table per service frontend: an array of backend ids indexed by
 * the flow hash reduced to the table's size (fluxvm_maglev_pick).
 * Userspace builds a complete new inner table and swaps it into the outer
 * slot with one update, so a packet sees either the old table or the new
 * one, never a mix. An empty slot means the service has no eligible backend.
 *
 * Tables are sized by what they serve (a prime of at least 100 slots per
 * backend, up to the tier's FLUXVM_MAGLEV_SIZE; fluxvm_maglev_pick reads
 * each table's own size): BPF_F_INNER_MAP lets inner arrays of any size
 * stand in for this template. It costs the inlined array lookup (the
 * verifier cannot know the bound): one helper call, on the new-flow path
 * only.
 */
struct fluxvm_maglev_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_INNER_MAP);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, FLUXVM_MAGLEV_SIZE);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__type(key, __u32);
	__uint(max_entries, FLUXVM_MAX_SERVICES);
	__array(values, struct fluxvm_maglev_inner);
} fluxvm_maglev SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct fluxvm_tuple4);
	__type(value, struct fluxvm_ct_value);
	__uint(max_entries, FLUXVM_CT_ENTRIES);
} fluxvm_fct4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct fluxvm_tuple6);
	__type(value, struct fluxvm_ct_value);
	__uint(max_entries, FLUXVM_CT_ENTRIES);
} fluxvm_fct6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct fluxvm_tuple4);
	__type(value, struct fluxvm_nat_value);
	__uint(max_entries, FLUXVM_NAT_ENTRIES);
} fluxvm_nat4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct fluxvm_tuple6);
	__type(value, struct fluxvm_nat_value);
	__uint(max_entries, FLUXVM_NAT_ENTRIES);
} fluxvm_nat6 SEC(".maps");

/* Backend endpoint -> the frontends that list it (see the layout). One
 * entry per backend endpoint at most, and endpoints are at most backends.
 * Not preallocated: an update then replaces the element and frees the old
 * one only after every program reading it is done (RCU), where a
 * preallocated map hands it straight to the next update, under a reader
 * still walking its slots. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct fluxvm_be2fe_key);
	__type(value, struct fluxvm_be2fe_value);
	__uint(max_entries, FLUXVM_MAX_BACKENDS);
} fluxvm_be2fe SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_guard);
	__uint(max_entries, FLUXVM_MAX_SERVICES);
} fluxvm_sguard SEC(".maps");

/* FluxScope flow records: the ring, its sequence, the node's budget of
 * drop records (fluxvm_service_v6.bpf.h, lib/flows.h). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_flow);
	__uint(max_entries, FLUXVM_FLOW_SLOTS);
} fluxvm_sflows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} fluxvm_flow_seq SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_flow_budget);
	__uint(max_entries, 1);
} fluxvm_flow_budget SEC(".maps");

/* Identity policy: the ipcache's tries and the policies
 * (fluxvm_service_v6.bpf.h, lib/policy.h). */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct fluxvm_sid4_key);
	__type(value, struct fluxvm_sid_value);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, FLUXVM_IPCACHE_PREFIXES);
} fluxvm_sid4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct fluxvm_sid6_key);
	__type(value, struct fluxvm_sid_value);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, FLUXVM_IPCACHE_PREFIXES);
} fluxvm_sid6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct fluxvm_spol_key);
	__type(value, struct fluxvm_spol_value);
	/* Not preallocated: a replaced header is freed after an RCU grace
	 * period, so a reader never sees it reused (lib/policy.h). */
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, FLUXVM_SPOL_ENTRIES);
} fluxvm_spol SEC(".maps");

/* EDT pacing per service (fluxvm_service_v6.bpf.h, lib/edt.h). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_edt_value);
	__uint(max_entries, FLUXVM_MAX_SERVICES);
} fluxvm_edt SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_svc_stats_value);
	__uint(max_entries, FLUXVM_MAX_SERVICES);
} fluxvm_svc_stats SEC(".maps");

/*
 * Per VM-edge interface statistics. Userspace gives each attached interface
 * a slot and records it at fluxvm_edge_slots[ifindex & 0xffff] together with
 * the full ifindex; the datapath finds its counters with two array lookups
 * (which the verifier inlines), where a hash lookup cost ~45 ns a packet. An
 * interface without a matching slot entry is not counted.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_edge_slot);
	__uint(max_entries, FLUXVM_EDGE_SLOT_MASK + 1);
} fluxvm_edge_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_svc_stats_value);
	__uint(max_entries, FLUXVM_MAX_EDGES);
} fluxvm_edge_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, enum fluxvm_drop_reason); /* puts the enum in BTF for Go */
	__type(value, __u64);
	__uint(max_entries, FLUXVM_DROP_MAX);
} fluxvm_drops SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, enum fluxvm_counter); /* puts the enum in BTF for Go */
	__type(value, __u64);
	__uint(max_entries, FLUXVM_CNT_MAX);
} fluxvm_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_meta_value);
	__uint(max_entries, 1);
} fluxvm_meta SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_snat_cfg);
	__uint(max_entries, 1);
} fluxvm_snat SEC(".maps");

/* The group's other SNAT addresses (fluxvm_abi_ct.bpf.h). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct fluxvm_snat_peer_key);
	__type(value, struct fluxvm_snat_peer_value);
	__uint(max_entries, FLUXVM_SNAT_PEERS_MAX);
} fluxvm_snat_peers SEC(".maps");

/* HA mutation queue (lib/ha.h) and the records it had no room for. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, FLUXVM_HAQ_BYTES);
} fluxvm_haq SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} fluxvm_hadrop SEC(".maps");

/*
 * Per-CPU scratch space of the rare paths: learning a new flow, recreating
 * an evicted half, routing (host_routing, DSR). Their keys, values and
 * helper arguments live here rather than on the stack because the stack
 * of a program and the global functions it calls is limited to 512 bytes
 * in all, and fluxvm_from_vm inlines its IPv4 forward path (so that a
 * conntrack hit pays no BPF-to-BPF call) while still calling the global
 * reply and ICMP paths. Each inlined copy of a rare path would otherwise
 * take its own stack slots in every frame that inlines it. A program runs
 * to completion on its CPU, so one slot per CPU is enough; the fields are
 * separate so that no two users in one packet's path overlap.
 *
 * The parse result (struct fluxvm_pkt) is not here: every program keeps
 * it on its own frame. Through a pointer into this map, the inlined IPv4
 * paths held it in one of the four registers a call keeps and measured
 * 3-9% slower in TC, ~3% in XDP (docs/benchmarks.md, issue 34). Memory
 * the verifier does not track also stops its walk from multiplying: the
 * IPv6 extension walk's offset passes through here (walk_off).
 */
struct fluxvm_scratch {
	struct fluxvm_ct_value nct;      /* a conntrack entry being created */
	struct fluxvm_tuple4 k4;         /* a reverse-NAT entry being learned (nat.h) */
	struct fluxvm_tuple6 k6;
	struct fluxvm_nat_value nv;
	/* An IPv6 reply's reverse-NAT key (lb_reply.h), off the frames of
	 * its global paths (fluxvm_to_vm's call chain through
	 * fluxvm_reply6_stored would reach 480 bytes with it). */
	struct fluxvm_tuple6 rk6;
	/* XDP's IPv6 SNAT forward key (lb_fwd_snat.h), off the frame of
	 * fluxvm_xdp_snat6, the deepest of the XDP program's call chains
	 * once its parse result is on its own frame. TC keeps this key on
	 * its frame. */
	struct fluxvm_tuple6 xfwd6;
	struct bpf_fib_lookup fib;       /* fib.h */
	struct bpf_redir_neigh nh;
	__u32 drop_reason;               /* the last drop this CPU counted (counters.h), for flows.h */
	__u16 walk_off;                  /* the IPv6 extension walk's offset in TC (parse.h) */
	__u16 pad;
	__u64 flow_seq;                  /* the seq a new flow's record reserved (flows.h) */
	__u64 flow_now;                  /* and the clock of the path that reserved it */
	/* Identity policy's lookup keys (policy.h), off the forward paths'
	 * stack: their call chains are at the 512-byte limit. */
	struct fluxvm_spol_key pk;
	struct fluxvm_sid4_key sk4;
	struct fluxvm_sid6_key sk6;
	__u32 stats_key; /* a service id, to count into fluxvm_svc_stats (policy.h) */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	/* By size: BTF would give bpf2go the kernel's bpf_fib_lookup, with
	 * anonymous unions it cannot mirror in Go. */
	__uint(value_size, sizeof(struct fluxvm_scratch));
	__uint(max_entries, 1);
} fluxvm_scratch SEC(".maps");

/* Socket load balancing: per socket and VIP, its backend; per socket and
 * backend, the VIP (fluxvm_service_v6.bpf.h). LRU: a closed socket's
 * entries age out. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct fluxvm_sock_key);
	__type(value, struct fluxvm_sock_value);
	__uint(max_entries, FLUXVM_SOCK_ENTRIES);
} fluxvm_sock_fwd SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct fluxvm_sock_rkey);
	__type(value, struct fluxvm_sock_rvalue);
	__uint(max_entries, FLUXVM_SOCK_ENTRIES);
} fluxvm_sock_rev SEC(".maps");

/* Nothing clears the slot between packets: each user zeroes or sets the
 * fields it reads before reading them. */
static __always_inline struct fluxvm_scratch *fluxvm_scratch_get(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&fluxvm_scratch, &zero);
}

/* XDP's IPv6 SNAT forward key (xfwd6) in this CPU's scratch, zeroed;
 * NULL when the scratch cannot be had. */
static __always_inline struct fluxvm_tuple6 *fluxvm_scratch_fwd6(void)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();

	if (!s)
		return NULL;
	__builtin_memset(&s->xfwd6, 0, sizeof(s->xfwd6));
	return &s->xfwd6;
}

/* The IPv6 reply key (rk6) in this CPU's scratch. Only its padding is
 * zeroed: the caller fills every other field (fluxvm_pkt_tuple) before
 * using it as a key. NULL when the scratch cannot be had. */
static __always_inline struct fluxvm_tuple6 *fluxvm_scratch_tuple6(void)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	struct fluxvm_tuple6 *t;

	if (!s)
		return NULL;
	t = &s->rk6;
	__builtin_memset(t->pad, 0, sizeof(t->pad));
	return t;
}

#endif /* FLUXVM_LIB_MAPS_H */
