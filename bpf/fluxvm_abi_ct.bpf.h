/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Layouts of BPF schema 4 shared with Go, under the rules of
 * fluxvm_service_v6.bpf.h (fixed-width fields, explicit padding, a size
 * assert; enum members appended, never renumbered):
 * the state of a flow: tuples, conntrack, reverse NAT, the east-west
 * reverse index (fluxvm_be2fe), the north-south SNAT configuration, and
 * the conntrack timeouts. Types only.
 */
#ifndef FLUXVM_ABI_CT_BPF_H
#define FLUXVM_ABI_CT_BPF_H

#include <linux/types.h>

#include "fluxvm_abi_const.bpf.h" /* FLUXVM_BE2FE_SLOTS */

/*
 * Flow tuples, as the packet carries them. Conntrack (fluxvm_fct4/6) keys
 * the client's view: client -> VIP. Reverse NAT (fluxvm_nat4/6) keys the
 * reply's view: backend -> client, where for a north-south flow with SNAT
 * the "client" is the SNAT address and port the backend sees.
 */
struct fluxvm_tuple4 {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3];
};
_Static_assert(sizeof(struct fluxvm_tuple4) == 16, "fluxvm_tuple4 size");

struct fluxvm_tuple6 {
	__be32 saddr[4];
	__be32 daddr[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3];
};
_Static_assert(sizeof(struct fluxvm_tuple6) == 40, "fluxvm_tuple6 size");

enum fluxvm_ct_state {
	FLUXVM_CT_NONE = 0,
	FLUXVM_CT_TCP_SYN = 1,         /* client SYN seen, handshake not complete */
	FLUXVM_CT_TCP_ESTABLISHED = 2,
	FLUXVM_CT_TCP_FIN = 3,         /* a FIN was seen in either direction */
	FLUXVM_CT_TCP_RST = 4,         /* a RST was seen in either direction */
	FLUXVM_CT_UDP = 5,
};

struct fluxvm_ct_value {
	__u32 service_id;
	__u32 backend_id;
	__u64 created_ns;    /* CLOCK_MONOTONIC (coarse) */
	__u64 last_seen_ns;  /* refreshed at most once per FLUXVM_CT_REFRESH_NS */
	__u64 deadline_ns;   /* expiry for userspace GC, from the state's timeout */
	__u8 state;          /* enum fluxvm_ct_state */
	__u8 flags;          /* enum fluxvm_ct_flags */
	__be16 nat_port;     /* SNAT: the source port the backend sees */
	__u32 flow;          /* FluxScope: low 32 bits of its record's seq (lib/flows.h); 0: none */
	__be32 nat_addr[4];  /* SNAT: the source address the backend sees */
	/* Identity policy: the revision of its service's policy the flow was
	 * admitted under (lib/policy.h); 0: none (admitted without one, or
	 * learned before generation 5: decided at its next packet). */
	__u32 policy_rev;
	/*
	 * Two uses by kind, never both: L7 entries are never replicated, so
	 * the two never meet. The generated Go type names the union by its
	 * first member (L7Ifindex), the same four bytes.
	 */
	union {
		/* FLUXVM_CT_F_L7: the proxy interface the flow goes to
		 * (lib/l7.h). */
		__u32 l7_ifindex;
		/* Any other kind: the second (CLOCK_MONOTONIC, coarse) until
		 * which the HA standby holds the flow as last queued
		 * (lib/ha.h); 0: never queued, and always 0 in an east-west
		 * entry (HA replicates SNAT and DSR flows only). Datapath-only:
		 * userspace reads the field of L7 entries alone. */
		__u32 ha_until;
	};
};
_Static_assert(sizeof(struct fluxvm_ct_value) == 64, "fluxvm_ct_value size");

enum fluxvm_ct_flags {
	FLUXVM_CT_F_SNAT = 1U << 0, /* north-south NAT: source translated too */
	FLUXVM_CT_F_DSR = 1U << 1,  /* routed DSR: nothing translated */
	/* East-west: replies are translated from this entry, found through
	 * fluxvm_be2fe; the flow has no reverse-NAT half. Not a kind: an
	 * east-west entry with or without it is the same flow. */
	FLUXVM_CT_F_REV_DERIVED = 1U << 2,
	/* Identity policy: admitted by audit_only, the policy denying it
	 * (lib/policy.h). Not a kind. */
	FLUXVM_CT_F_AUDITED = 1U << 3,
	/* L7 enforce: the flow is handed to the proxy interface in
	 * l7_ifindex, untranslated (lib/l7.h); backend_id is 0. A kind. */
	FLUXVM_CT_F_L7 = 1U << 4,
};

struct fluxvm_nat_value {
	__be32 vip[4];       /* IPv4 uses vip[0] */
	__be16 vport;
	__u8 flags;          /* enum fluxvm_nat_flags */
	__u8 pad0;
	__u32 service_id;
	__u32 backend_id;
	__u32 flow;          /* FluxScope: as fluxvm_ct_value.flow */
	__u64 last_seen_ns;  /* refresh throttle for the reply direction */
	__be32 client[4];    /* SNAT: the client's own address, restored on replies */
	__be16 cport;        /* SNAT: the client's own port */
	__u16 pad2;
	__u32 pad3;
};
_Static_assert(sizeof(struct fluxvm_nat_value) == 64, "fluxvm_nat_value size");

enum fluxvm_nat_flags {
	FLUXVM_NAT_F_SNAT = 1U << 0,         /* the key's destination is the SNAT address */
	FLUXVM_NAT_F_HOST_ROUTING = 1U << 1, /* replies take the FIB fast path */
};

/*
 * Reverse translation of east-west flows (fluxvm_be2fe, hash, written by
 * the control plane only): a backend endpoint -> the east-west NAT
 * frontends whose tables may name it. A reply backend:port -> client:cport
 * carries no VIP; its flow is the conntrack entry client:cport -> VIP:vport
 * of one of these frontends that names this backend. So a new east-west
 * flow learns one entry, not two, and a reply half can never be orphaned:
 * there is none.
 *
 * An entry lists a frontend before any table of it can name the backend,
 * and keeps the slots of the frontends it lists in place (a flow is found
 * only through its frontend's slot). A backend listed by more frontends
 * than there are slots is marked OVERFLOW: the frontends past the slots
 * have FLUXVM_SVC_F_REV_STORED and learn reverse-NAT halves, which the
 * reply path looks up when no slot finds the flow.
 */
struct fluxvm_be2fe_key {
	__be32 addr[4];  /* the backend's; IPv4 uses addr[0] */
	__be16 port;
	__u8 proto;
	__u8 family;     /* enum fluxvm_family */
};
_Static_assert(sizeof(struct fluxvm_be2fe_key) == 20, "fluxvm_be2fe_key size");

struct fluxvm_be2fe_slot {
	__be32 vip[4];      /* IPv4 uses vip[0] */
	__be16 vport;
	__u16 pad;
	__u32 service_id;   /* the frontend's */
	__u32 backend_id;   /* the backend's id in that frontend */
};
_Static_assert(sizeof(struct fluxvm_be2fe_slot) == 28, "fluxvm_be2fe_slot size");

enum fluxvm_be2fe_flags {
	FLUXVM_BE2FE_F_OVERFLOW = 1U << 0, /* more frontends than slots list the backend */
};

struct fluxvm_be2fe_value {
	__u8 count;      /* slots in use, at most FLUXVM_BE2FE_SLOTS */
	__u8 flags;      /* enum fluxvm_be2fe_flags */
	__u16 pad;
	struct fluxvm_be2fe_slot slots[FLUXVM_BE2FE_SLOTS];
};
_Static_assert(sizeof(struct fluxvm_be2fe_value) == 116, "fluxvm_be2fe_value size");

/*
 * North-south source NAT (fluxvm_snat, one entry at key 0): the addresses
 * the backend sees as the client, and the port range to allocate from.
 * Ports are host order; a range with port_min > port_max or no address for
 * the family makes every new north-south NAT flow drop (SNAT_FAILED).
 */
enum fluxvm_snat_flags {
	FLUXVM_SNAT_F_V4 = 1U << 0, /* addr4 is set */
	FLUXVM_SNAT_F_V6 = 1U << 1, /* addr6 is set */
	FLUXVM_SNAT_F_PEERS = 1U << 2, /* fluxvm_snat_peers may list addresses */
};

struct fluxvm_snat_cfg {
	__be32 addr4;
	__be32 addr6[4];
	__u16 port_min;
	__u16 port_max;
	__u32 flags;         /* enum fluxvm_snat_flags */
	__u32 peer_filter;   /* a bit per fluxvm_snat_peers address (lib/snat.h) */
};
_Static_assert(sizeof(struct fluxvm_snat_cfg) == 32, "fluxvm_snat_cfg size");

/*
 * The SNAT addresses of the other edges of this node's group
 * (fluxvm_snat_peers, at most FLUXVM_SNAT_PEERS_MAX): the flows
 * translated to them that replication brought here keep their
 * translation (the conntrack entry holds its SNAT address and port), and
 * replies to them are translated back here as replies to the node's own
 * address are, so that any edge continues any edge's flow. New flows take
 * the node's own address only. Looked up only while fluxvm_snat_cfg has
 * FLUXVM_SNAT_F_PEERS, so a node outside a group pays nothing for it.
 * The value's flags are the control plane's (the datapath reads only the
 * key): FLUXVM_SNAT_PEER_F_ANNOUNCE marks an address this node took over
 * from an edge that is gone, which it asks the routing to send here.
 */
struct fluxvm_snat_peer_key {
	__be32 addr[4]; /* IPv4 uses addr[0], the rest zero */
	__u8 family;    /* enum fluxvm_family */
	__u8 pad[3];
};
_Static_assert(sizeof(struct fluxvm_snat_peer_key) == 20, "fluxvm_snat_peer_key size");

enum fluxvm_snat_peer_flags {
	FLUXVM_SNAT_PEER_F_ANNOUNCE = 1U << 0, /* announced by this node (taken over) */
};

struct fluxvm_snat_peer_value {
	enum fluxvm_snat_peer_flags flags; /* 4 bytes; the enum named for BTF and Go */
	__u32 pad;
};
_Static_assert(sizeof(struct fluxvm_snat_peer_value) == 8, "fluxvm_snat_peer_value size");

/* Conntrack timeouts in seconds where fluxvm_meta_value holds 0. */
enum fluxvm_timeout_default {
	FLUXVM_TIMEOUT_TCP_SYN_S = 60,
	FLUXVM_TIMEOUT_TCP_ESTABLISHED_S = 21600,
	FLUXVM_TIMEOUT_TCP_FIN_S = 30,
	FLUXVM_TIMEOUT_TCP_RST_S = 10,
	FLUXVM_TIMEOUT_UDP_S = 60,
};

/* Conntrack deadlines are refreshed at most this often per flow, so that a
 * busy flow does not write its entry on every packet. */
#define FLUXVM_CT_REFRESH_NS 1000000000ULL

#endif /* FLUXVM_ABI_CT_BPF_H */
