/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Layouts of BPF schema 4 shared with Go, under the rules of
 * fluxvm_service_v6.bpf.h (fixed-width fields, explicit padding, a size
 * assert; enum members appended, never renumbered):
 * services, as the frontend and selection stages read them (frontends,
 * guards, backends), and what the datapath keeps per service and per
 * VM-edge interface (statistics, EDT pacing). Types only.
 */
#ifndef FLUXVM_ABI_SERVICE_BPF_H
#define FLUXVM_ABI_SERVICE_BPF_H

#include <linux/types.h>

/*
 * Frontends: fluxvm_svc4 / fluxvm_svc6, (VIP, port, protocol) -> service.
 * Port 0 is never a service port; the entry (VIP, 0, protocol) marks the
 * VIP itself so that fragments, which carry no ports, can be recognised.
 */
struct fluxvm_svc4_key {
	__be32 vip;
	__be16 port;
	__u8 proto;
	__u8 pad;
};
_Static_assert(sizeof(struct fluxvm_svc4_key) == 8, "fluxvm_svc4_key size");

struct fluxvm_svc6_key {
	__be32 vip[4];
	__be16 port;
	__u8 proto;
	__u8 pad;
};
_Static_assert(sizeof(struct fluxvm_svc6_key) == 20, "fluxvm_svc6_key size");

enum fluxvm_svc_flags {
	FLUXVM_SVC_F_VIP_MARKER = 1U << 0,   /* the (VIP, 0, proto) entry */
	FLUXVM_SVC_F_NORTH_SOUTH = 1U << 1,  /* served on north-south interfaces */
	FLUXVM_SVC_F_NO_EAST_WEST = 1U << 2, /* not served on VM edges */
	FLUXVM_SVC_F_DSR = 1U << 3,          /* routed DSR instead of NAT */
	FLUXVM_SVC_F_HOST_ROUTING = 1U << 4, /* FIB lookup and redirect after NAT */
	FLUXVM_SVC_F_REV_STORED = 1U << 5,   /* east-west: new flows store a reverse-NAT half too */
	FLUXVM_SVC_F_PACED = 1U << 6,        /* egress paced: fluxvm_edt holds its rate (lib/edt.h) */
	FLUXVM_SVC_F_POLICY = 1U << 7,       /* identity policy: fluxvm_spol holds its header (lib/policy.h) */
	FLUXVM_SVC_F_L7 = 1U << 8,           /* L7 enforce (lib/l7.h): always with FLUXVM_SVC_F_POLICY */
};

struct fluxvm_svc_value {
	__u32 service_id;  /* index into fluxvm_maglev, fluxvm_sguard, stats */
	__u32 flags;       /* enum fluxvm_svc_flags */
	__u32 revision;    /* bumped by userspace on every reprogramming */
	__u32 reserved0;
	__u64 reserved1;   /* kept for EDT rate without a layout change */
};
_Static_assert(sizeof(struct fluxvm_svc_value) == 24, "fluxvm_svc_value size");

/*
 * The IPv4 frontend index (fluxvm_fe4, an array of FLUXVM_FE4_SLOTS):
 * fluxvm_svc4 direct-mapped by a hash of its key, so that the frontend
 * stage of most IPv4 packets reads one array slot, which the verifier
 * inlines, instead of calling into the hash map (lib/lb_frontend.h says
 * what that saves). fluxvm_svc4 stays the truth: a slot either answers
 * for every key that hashes to it, or sends the lookup to fluxvm_svc4.
 * Written by the loader alone (bpf/feindex.go), after fluxvm_svc4 when a
 * frontend is added, before it when one is removed.
 *
 * A slot is read without a lock while the loader may be rewriting it, so
 * it carries a check over its first 16 bytes (fluxvm_fe4_check in
 * lib/lb_frontend.h, feCheck in Go): a slot read half old, half new fails
 * it and the lookup goes to fluxvm_svc4. A slot never written (all zero)
 * is FLUXVM_FE_UNKNOWN, so a new or unfilled index costs speed, never a
 * wrong answer.
 */
enum fluxvm_fe_state {
	FLUXVM_FE_UNKNOWN = 0, /* ask fluxvm_svc4 */
	FLUXVM_FE_EMPTY = 1,   /* no frontend hashes here: the key is no frontend */
	FLUXVM_FE_ONE = 2,     /* exactly one frontend hashes here: this key and value */
	FLUXVM_FE_SHARED = 3,  /* more than one frontend hashes here: ask fluxvm_svc4 */
};

struct fluxvm_fe4_slot {
	__be32 vip;        /* FLUXVM_FE_ONE: the key, as in fluxvm_svc4_key */
	__be16 port;
	__u8 proto;
	__u8 state;        /* enum fluxvm_fe_state */
	__u32 service_id;  /* FLUXVM_FE_ONE: the fluxvm_svc_value's */
	__u32 flags;
	__u32 check;       /* of the 16 bytes above */
	__u32 pad;
};
_Static_assert(sizeof(struct fluxvm_fe4_slot) == 24, "fluxvm_fe4_slot size");

/* Service guard (fluxvm_sguard, array by service id). Zero is closed, so a
 * service whose guard was never written fails closed. */
enum fluxvm_guard_state {
	FLUXVM_GUARD_CLOSED = 0, /* and every value but OPEN */
	FLUXVM_GUARD_OPEN = 1,
};

struct fluxvm_guard {
	__u32 state;      /* enum fluxvm_guard_state: OPEN, anything else drops */
	__u32 revision;   /* the svc revision the guard was opened for */
};
_Static_assert(sizeof(struct fluxvm_guard) == 8, "fluxvm_guard size");

/* Backends (fluxvm_backends, array by backend id; id 0 is never used). */
enum fluxvm_backend_state {
	FLUXVM_BE_UNUSED = 0,
	FLUXVM_BE_READY = 1,     /* takes new flows and keeps its flows */
	FLUXVM_BE_DRAINING = 2,  /* keeps its flows until drain_until_ns */
	FLUXVM_BE_UNHEALTHY = 3, /* its flows fail over */
};

struct fluxvm_backend {
	__be32 addr[4];          /* IPv4 uses addr[0] */
	__be16 port;
	__u8 family;             /* enum fluxvm_family */
	__u8 state;              /* enum fluxvm_backend_state */
	__u32 service_id;        /* owner; a flow never follows an id to another service */
	__u64 drain_until_ns;    /* CLOCK_MONOTONIC (coarse) deadline while Draining */
};
_Static_assert(sizeof(struct fluxvm_backend) == 32, "fluxvm_backend size");

/* Per-service counters (per-CPU array fluxvm_svc_stats by service id). */
struct fluxvm_svc_stats_value {
	__u64 packets;        /* client -> VIP packets translated */
	__u64 bytes;
	__u64 reply_packets;  /* backend -> client packets translated back */
	__u64 reply_bytes;
	__u64 new_flows;      /* conntrack entries created */
	__u64 failovers;      /* flows moved off an Unhealthy/removed backend */
	__u64 drops;
	__u64 edt_drops;      /* of drops: beyond the EDT horizon (lib/edt.h) */
	/* Identity policy and L7 enforce, per frontend (lib/policy.h, l7.h);
	 * zero in the per-interface statistics. */
	__u64 policy_denied;  /* flows denied: new, or established at a recheck */
	__u64 policy_audited; /* flows audit_only forwarded */
	__u64 l7_redirected;  /* new flows handed to the proxy */
	__u64 pad0;
};
_Static_assert(sizeof(struct fluxvm_svc_stats_value) == 96, "fluxvm_svc_stats size");

/*
 * EDT pacing (fluxvm_edt, array by service id, that is by frontend; lib/
 * edt.h). Written by the control plane (rate, ns_per_byte, horizon_ns,
 * pacer) and by the datapath (last_departure, with compare-and-swap:
 * several CPUs pace one service). A rate of 0 is an unpaced frontend. The
 * frontends of one service share one departure clock, that of the entry
 * named by pacer (the service's first frontend), so that the cap holds for
 * the service as a whole. Index 0, never a service id, is the node's: its
 * rate counts the paced services that are north-south, so that
 * fluxvm_ns_out looks for them only while there are any.
 */
struct fluxvm_edt_value {
	__u64 rate;           /* bytes per second; 0: not paced */
	__u64 ns_per_byte;    /* 1e9 / rate in Q32 fixed point: delay = len * ns_per_byte >> 32 */
	__u64 horizon_ns;     /* the furthest a departure may lie ahead (drop beyond) */
	__u64 last_departure; /* of the last packet admitted, coarse monotonic ns (the pacer's is used) */
	__u32 pacer;          /* the entry whose clock this frontend uses; 0: its own */
	__u32 pad;
};
_Static_assert(sizeof(struct fluxvm_edt_value) == 40, "fluxvm_edt_value size");

/* Where a VM-edge interface's counters live (fluxvm_edge_slots, keyed by
 * ifindex & FLUXVM_EDGE_SLOT_MASK). */
struct fluxvm_edge_slot {
	__u32 ifindex;  /* the full ifindex, to tell apart those sharing a key */
	__u32 slot;     /* index into fluxvm_edge_stats; 0 = not counted */
};
_Static_assert(sizeof(struct fluxvm_edge_slot) == 8, "fluxvm_edge_slot size");

#endif /* FLUXVM_ABI_SERVICE_BPF_H */
