/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Layouts of BPF schema 4 shared with Go, under the rules of
 * fluxvm_service_v6.bpf.h (fixed-width fields, explicit padding, a size
 * assert; enum members appended, never renumbered):
 * the node's settings (fluxvm_meta), and what the datapath hands
 * userspace about flows: the HA mutation queue and the FluxScope flow
 * records. Types only.
 */
#ifndef FLUXVM_ABI_NODE_BPF_H
#define FLUXVM_ABI_NODE_BPF_H

#include <linux/types.h>

#include "fluxvm_abi_ct.bpf.h" /* struct fluxvm_ct_value */

/* Node-wide settings and identity (fluxvm_meta, one entry at key 0). */
struct fluxvm_meta_value {
	__u32 schema_version;      /* FLUXVM_SCHEMA_VERSION of the pinned maps */
	__u32 program_generation;
	__u32 tier;                /* FLUXVM_TIER_* */
	__u32 flags;
	__u64 hash_seed;           /* per-node seed of the flow hash */
	__u32 timeout_tcp_syn_s;   /* 0 = built-in default, for every timeout */
	__u32 timeout_tcp_established_s;
	__u32 timeout_tcp_fin_s;
	__u32 timeout_tcp_rst_s;
	__u32 timeout_udp_s;
	__u32 flow_sample_rate;    /* FluxScope: record 1 in N new flows; 0: no records at all */
};
_Static_assert(sizeof(struct fluxvm_meta_value) == 48, "fluxvm_meta size");

enum fluxvm_meta_flags {
	/* HA replication is on: the new flows, state transitions and due
	 * refreshes of north-south (SNAT, DSR) entries emit fluxvm_haq
	 * records (lib/ha.h), and XDP leaves the packets that would emit to
	 * TC, which emits them. East-west flows emit nothing. */
	FLUXVM_META_F_HA = 1U << 0,
};

/*
 * HA mutation queue (fluxvm_haq, a ring buffer; lib/ha.h): one record per
 * write of a north-south (SNAT or DSR) conntrack entry the standby must
 * learn (a new flow, a re-pick, a failover; a state transition; a due
 * refresh of the deadline; east-west entries are not queued), the flow
 * as the client sent it, its backend by address and the entry as
 * written. Userspace (package ha) drains it into the journal; a record
 * the ring had no room for is counted in fluxvm_hadrop and left to the
 * periodic snapshot-diff.
 */
enum fluxvm_ha_op {
	FLUXVM_HA_UPSERT = 1,
};

/* Why a record was queued (informational: every record is an upsert of
 * the whole flow). */
enum fluxvm_ha_cause {
	FLUXVM_HA_NEW = 1,        /* a forward path wrote a new entry (new flow, re-pick, failover) */
	FLUXVM_HA_TRANSITION = 2, /* a hit changed the entry's state */
	FLUXVM_HA_REFRESH = 3,    /* a hit pushed the deadline past the one the standby holds */
};

struct fluxvm_ha_record {
	__u8 op;             /* enum fluxvm_ha_op */
	__u8 family;         /* enum fluxvm_family */
	__u8 proto;
	__u8 cause;          /* enum fluxvm_ha_cause */
	__be16 cport;        /* the client's port */
	__be16 vport;        /* the VIP's port */
	__be16 bport;        /* the backend's port */
	__u16 pad1;
	__be32 client[4];    /* IPv4 in [0] */
	__be32 vip[4];
	__be32 backend[4];
	/* Seconds the standby keeps the flow past ct.deadline_ns: half the
	 * timeout of its state, the lead that lets the active refresh the
	 * standby's copy only once per that much time and still never have
	 * it expire first (lib/ha.h). */
	__u32 hold_s;
	struct fluxvm_ct_value ct; /* the entry as written */
};
_Static_assert(sizeof(struct fluxvm_ha_record) == 128, "fluxvm_ha_record size");

/*
 * FluxScope flow records (fluxvm_sflows, lib/flows.h): a ring of the
 * tier's FLUXVM_FLOW_SLOTS records, array by slot = seq % slots, where seq
 * counts the records ever opened (fluxvm_flow_seq). A record names the
 * flow as the client sent it and as it was translated, its verdict, and
 * its packets and bytes each way. A flow's conntrack entry (and its
 * reverse-NAT half, where it has one) holds the low 32 bits of the seq of
 * its record: a record whose seq no longer matches was reused by a newer
 * flow, and the older one stops counting.
 */
enum fluxvm_flow_verdict {
	FLUXVM_FLOW_FORWARDED = 1,
	FLUXVM_FLOW_DROPPED = 2,
	FLUXVM_FLOW_AUDITED = 3,    /* policy (issue 21): forwarded, would have been denied */
	FLUXVM_FLOW_REDIRECTED = 4, /* L7 (issue 21): sent to the proxy */
};

enum fluxvm_flow_hook {
	FLUXVM_HOOK_FROM_VM = 1,
	FLUXVM_HOOK_TO_VM = 2,
	FLUXVM_HOOK_NS_IN = 3,
	FLUXVM_HOOK_NS_OUT = 4,
	FLUXVM_HOOK_XDP = 5,
};

struct fluxvm_flow {
	__u64 seq;           /* 1, 2, ...: which record of the ring's history this is; 0: never written */
	__be32 client[4];    /* the packet's source as the client sent it */
	__be32 vip[4];       /* its destination: the VIP */
	__be32 backend[4];   /* the translated destination; zero when dropped before a pick */
	__be32 snat[4];      /* the translated source (north-south SNAT); zero: none */
	__be16 cport;
	__be16 vport;
	__be16 bport;
	__be16 snat_port;
	__u8 proto;
	__u8 family;         /* enum fluxvm_family */
	__u8 hook;           /* enum fluxvm_flow_hook that opened the record */
	__u8 verdict;        /* enum fluxvm_flow_verdict */
	__u8 reason;         /* enum fluxvm_drop_reason of the last drop; 0: none */
	__u8 pad0[3];
	__u32 service_id;
	__u32 backend_id;
	__u32 ifindex;       /* where the record was opened */
	__u32 drops;         /* packets of the flow dropped */
	__u64 first_ns;      /* coarse monotonic, as conntrack */
	__u64 last_ns;
	__u64 fwd_packets;   /* client -> backend */
	__u64 fwd_bytes;
	__u64 rev_packets;   /* backend -> client */
	__u64 rev_bytes;
};
_Static_assert(sizeof(struct fluxvm_flow) == 152, "fluxvm_flow size");

/* The node's budget of records for drops, one token bucket for every CPU
 * (lib/flows.h): the time it was (or would have been) empty. */
struct fluxvm_flow_budget {
	__u64 empty_ns;
	__u64 pad;
};
_Static_assert(sizeof(struct fluxvm_flow_budget) == 16, "fluxvm_flow_budget size");

#endif /* FLUXVM_ABI_NODE_BPF_H */
