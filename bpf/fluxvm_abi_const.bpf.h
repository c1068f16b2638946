/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Layouts of BPF schema 4 shared with Go, under the rules of
 * fluxvm_service_v6.bpf.h (fixed-width fields, explicit padding, a size
 * assert; enum members appended, never renumbered):
 * the schema's constants, the packet counters, the drop reasons and the
 * address families. Types only.
 */
#ifndef FLUXVM_ABI_CONST_BPF_H
#define FLUXVM_ABI_CONST_BPF_H

#include <linux/types.h>

/* Constants of the schema that are neither flags nor states. */
enum fluxvm_abi_const {
	FLUXVM_SCHEMA_VERSION = 4,  /* of the pinned maps (fluxvm_meta_value) */
	FLUXVM_SNAT_TRIES = 32,     /* candidate ports for one new SNAT mapping */
	FLUXVM_EDGE_SLOT_MASK = 0xffff, /* ifindex -> fluxvm_edge_slots key */
	FLUXVM_BE2FE_SLOTS = 4,     /* frontends per fluxvm_be2fe entry */
	FLUXVM_SNAT_PEERS_MAX = 64, /* entries of fluxvm_snat_peers */
};

/*
 * Global packet counters (per-CPU array fluxvm_counters, one __u64 packet
 * count per index). They describe what the parser saw; a packet may bump
 * several (e.g. IPV6 + IPV6_EXTHDR + UDP).
 */
enum fluxvm_counter {
	FLUXVM_CNT_IPV4 = 0,        /* well-formed IPv4 header */
	FLUXVM_CNT_IPV6 = 1,        /* well-formed IPv6 header chain */
	FLUXVM_CNT_TCP = 2,         /* TCP header parsed */
	FLUXVM_CNT_UDP = 3,         /* UDP header parsed */
	FLUXVM_CNT_L4_OTHER = 4,    /* IP, but neither TCP nor UDP (ICMP, ESP, ...) */
	FLUXVM_CNT_IPV6_EXTHDR = 5, /* IPv6 packet that carried extension headers */
	FLUXVM_CNT_FRAGMENT = 6,    /* IPv4 or IPv6 fragment (first or later) */
	FLUXVM_CNT_NON_IP = 7,      /* not IPv4/IPv6 (ARP, LLDP, VLAN-tagged, ...) */
	FLUXVM_CNT_TRUNCATED = 8,   /* a header or the IP payload is cut short */
	FLUXVM_CNT_MALFORMED = 9,   /* a header field is invalid */
	FLUXVM_CNT_PARSE_LIMIT = 10, /* beyond the parser's bounds (see lib/parse.h) */
	FLUXVM_CNT_NAT_STALE = 11,  /* a foreign SYN-ACK removed a stale reverse-NAT half or derived conntrack entry */
	FLUXVM_CNT_HOST_ROUTED_PACKETS = 12,/* host_routing: redirected after a FIB hit */
	FLUXVM_CNT_HOST_ROUTE_FALLBACKS = 13, /* host_routing: FIB miss, left to the host stack */
	FLUXVM_CNT_SNAT_RETRIES = 14, /* an SNAT port candidate was taken; another was tried */
	FLUXVM_CNT_DSR_FORWARDED = 15, /* DSR packet redirected toward its backend */
	FLUXVM_CNT_SNAT_CONFLICTS = 16, /* an SNAT flow's port was held by another flow: remapped */
	FLUXVM_CNT_ICMP_ERRORS_TRANSLATED = 17, /* ICMP error about a translated flow, translated (lib/icmp.h) */
	FLUXVM_CNT_XDP_TRANSLATED = 18, /* XDP: a VIP packet translated (or DSR-routed) and sent */
	FLUXVM_CNT_XDP_PASS_NO_ROUTE = 19, /* XDP: a VIP packet left to the stack: no FIB answer or neighbour */
	FLUXVM_CNT_XDP_PASS_FRAGMENT = 20, /* XDP: a fragment to a VIP left to the stack */
	FLUXVM_CNT_XDP_PASS_EGRESS = 21, /* XDP: a VIP packet left to the stack: its route leaves by an interface XDP may not send on */
	FLUXVM_CNT_SOCK_REWRITTEN = 22, /* socket LB: a connect or send to a VIP addressed to its backend instead */
	FLUXVM_CNT_SOCK_REVERSED = 23,  /* socket LB: a receive or getpeername shown the VIP instead of the backend */
	FLUXVM_CNT_SOCK_REPICKED = 24,  /* socket LB: a socket's backend may no longer serve it: picked afresh */
	FLUXVM_CNT_SOCK_FAIL_OPEN_GUARD = 25, /* socket LB fail-open: the service's guard is closed (TC drops) */
	FLUXVM_CNT_SOCK_FAIL_OPEN_NO_BACKEND = 26, /* socket LB fail-open: no Ready backend of the socket's family */
	FLUXVM_CNT_SOCK_FAIL_OPEN_MAP = 27,  /* socket LB fail-open: the socket maps could not be written */
	FLUXVM_CNT_FLOW_RECORDED = 28,  /* FluxScope: a flow got a record (sampled, or a drop) */
	FLUXVM_CNT_FLOW_DROP_LIMITED = 29, /* FluxScope: a drop found the node's budget empty: not recorded */
	FLUXVM_CNT_POLICY_AUDITED = 30,  /* identity policy: a flow it denies forwarded (audit_only) */
	FLUXVM_CNT_POLICY_RECHECKED = 31, /* identity policy: an established flow decided again (new revision) */
	FLUXVM_CNT_POLICY_REVOKED = 32,  /* identity policy: an established flow denied at its recheck */
	FLUXVM_CNT_XDP_PASS_POLICY = 33, /* XDP: a service with an identity policy, left to TC */
	FLUXVM_CNT_SOCK_FAIL_OPEN_POLICY = 34, /* socket LB: a service with an identity policy, left to TC */
	FLUXVM_CNT_L7_REDIRECTED = 35, /* L7 enforce: a new flow handed to the proxy interface (lib/l7.h) */
	FLUXVM_CNT_L7_BYPASS = 36,     /* L7 enforce: a packet from the proxy interface, load-balanced as usual */
	FLUXVM_CNT_HA_EMITTED = 37,    /* HA: a record queued in fluxvm_haq (lib/ha.h) */
	FLUXVM_CNT_XDP_PASS_HA = 38,   /* XDP: a new flow left to TC while HA replication is on */
	FLUXVM_CNT_MAX = 39,
};

/* Why a packet was dropped (per-CPU array fluxvm_drops, one __u64 each). */
enum fluxvm_drop_reason {
	FLUXVM_DROP_NONE = 0,            /* unused: index 0 is never counted */
	FLUXVM_DROP_NO_BACKEND = 1,      /* the service has no eligible backend */
	FLUXVM_DROP_BACKEND_INVALID = 2, /* the table names a backend that is not Ready */
	FLUXVM_DROP_GUARD_CLOSED = 3,    /* the service is being reprogrammed */
	FLUXVM_DROP_FRAGMENT = 4,        /* an IP fragment addressed to a VIP */
	FLUXVM_DROP_CT_UPDATE = 5,       /* the conntrack entry could not be written */
	FLUXVM_DROP_NAT_UPDATE = 6,      /* the reverse-NAT entry could not be written */
	FLUXVM_DROP_REWRITE = 7,         /* a packet rewrite helper failed */
	FLUXVM_DROP_SNAT_FAILED = 8,     /* no free SNAT port after the bounded retries, or no SNAT address */
	FLUXVM_DROP_DSR_NO_ROUTE = 9,    /* DSR: no route, neighbour or TTL toward the backend */
	FLUXVM_DROP_EDT_HORIZON = 10,    /* EDT: departure beyond the service's horizon (lib/edt.h) */
	FLUXVM_DROP_POLICY_DENIED = 11,  /* identity policy: the source's identity is denied (lib/policy.h) */
	FLUXVM_DROP_POLICY_MISSING = 12, /* identity policy: the service has one but its maps lack it: fail closed */
	FLUXVM_DROP_MAX = 13,
};

/* Address family tags used in map values. */
enum fluxvm_family {
	FLUXVM_AF_INET = 4,
	FLUXVM_AF_INET6 = 6,
};

#endif /* FLUXVM_ABI_CONST_BPF_H */
