/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Types the load balancer's stages share (lb.h lists the stages): the
 * flags and hooks a forward path takes, the verdicts one stage hands the
 * next. Types only: no maps, no code.
 */
#ifndef FLUXVM_LIB_LB_TYPES_H
#define FLUXVM_LIB_LB_TYPES_H

#include "common.h"

/* A forward path's flags (the frontend's, enum fluxvm_svc_flags) with
 * this bit: the packet came in on a north-south interface. */
#define FLUXVM_LB_AT_NS (1U << 31)

/* The hook a forward path runs in, for flow records: XDP, or the TC
 * program of the edge (@ns: north-south). */
#ifdef FLUXVM_CTX_XDP
#define FLUXVM_FWD_HOOK(ns) FLUXVM_HOOK_XDP
#else
#define FLUXVM_FWD_HOOK(ns) ((ns) ? FLUXVM_HOOK_NS_IN : FLUXVM_HOOK_FROM_VM)
#endif

/* What the conntrack stage decided for a flow's packet. */
enum fluxvm_ct_verdict {
	FLUXVM_CT_NEW,      /* no entry of this service and mode: a new flow */
	FLUXVM_CT_KEEP,     /* the entry's backend keeps the flow */
	FLUXVM_CT_REPICK,   /* a bare SYN reuses the tuple: a new connection */
	FLUXVM_CT_FAILOVER, /* the entry's backend may no longer serve it */
};

/* What the opening of a forward path (fluxvm_fwd_open) leaves the mode. */
struct fluxvm_fwd {
	struct fluxvm_ct_value *ct;    /* the flow's entry, or NULL */
	struct fluxvm_backend *be;     /* the entry's backend (FLUXVM_CT_KEEP, FAILOVER, REPICK) */
	__u64 now;                     /* the path's clock */
	__u32 bid;                     /* the entry's backend id, read once with be */
	enum fluxvm_ct_verdict verdict;
	int touched;                   /* FLUXVM_CT_KEEP: fluxvm_ct_touch's result */
	int ret;                       /* the path's verdict when the opening ends it */
};

/* The mode of a frontend's path, as the frontend stage finds it. */
enum fluxvm_lb_mode {
	FLUXVM_LB_NONE, /* not a service served here, or dropped: see the verdict */
	FLUXVM_LB_NAT,  /* east-west NAT: fluxvm_lb_nat */
	FLUXVM_LB_SNAT, /* north-south NAT with SNAT: fluxvm_lb_snat */
	FLUXVM_LB_DSR,  /* routed DSR, either edge: fluxvm_lb_dsr */
};

/*
 * Named layouts of values packed into one register: the arguments and
 * results of global functions, and what a forward path keeps across its
 * send stage. A global function takes at most five arguments, each a
 * scalar or a pointer (no struct by value), and returns a scalar, and a
 * pointer to the caller's stack would cost bytes the deepest call chains
 * have not got: each layout travels in one register as the word of its
 * union, built with its FLUXVM_* macro (or accessor) and read back by name
 * through the union on the other side.
 */

/* What a flow record's functions (fluxvm_flow_open, fluxvm_flow_drop)
 * and the L7 stage (fluxvm_l7_stage) know of a client packet's path
 * besides the packet itself. */
struct fluxvm_flow_info {
	__u8 v6 : 1;         /* the packet is IPv6 */
	__u8 audited : 1;    /* fluxvm_flow_open: forwarded under audit_only */
	__u8 redirected : 1; /* fluxvm_flow_open: handed to the L7 proxy */
	__u8 hook;           /* enum fluxvm_flow_hook: where it was seen */
	__u16 bid;           /* fluxvm_flow_open: the backend's id (below the tier's 65,536) */
	__u32 sid;           /* the datapath service id */
};

union fluxvm_flow_arg {
	struct fluxvm_flow_info info;
	__u64 word;
};

/* FLUXVM_FLOW_ARG(.v6 = v6, .sid = sid, ...): the word of the fields named. */
#define FLUXVM_FLOW_ARG(...) (((union fluxvm_flow_arg){ .info = { __VA_ARGS__ } }).word)

/* What the policy decision (fluxvm_policy_decide) knows of a client
 * packet besides the packet itself. */
struct fluxvm_policy_info {
	__u32 v6 : 1;       /* the packet is IPv6 */
	__u32 ifindex : 31; /* the interface it came in on (L7 enforce's bypass) */
	__u32 sid;          /* the datapath service whose policy decides */
};

union fluxvm_policy_arg {
	struct fluxvm_policy_info info;
	__u64 word;
};

/* FLUXVM_POLICY_ARG(.v6 = v6, .sid = sid, ...): the word of the fields named. */
#define FLUXVM_POLICY_ARG(...) (((union fluxvm_policy_arg){ .info = { __VA_ARGS__ } }).word)

/* What a policy does with a flow. */
enum fluxvm_policy_verdict {
	FLUXVM_PV_MISSING = 0, /* no header: fail closed */
	FLUXVM_PV_ALLOW = 1,
	FLUXVM_PV_DENY = 2,
	FLUXVM_PV_AUDIT = 3, /* denied, forwarded under audit_only */
};

/* What the policy decision (fluxvm_policy_decide) returns. Fields of one
 * 64-bit unit: the caller reads each as a mask or a shift of the
 * register (byte and word fields would split it, and cost instructions). */
struct fluxvm_policy_decision {
	__u64 verdict : 8; /* enum fluxvm_policy_verdict */
	__u64 pad : 24;
	__u64 rev : 32;    /* the revision of the policy that decided; 0: FLUXVM_PV_MISSING */
};

union fluxvm_policy_result {
	struct fluxvm_policy_decision d;
	__u64 word;
};

/* FLUXVM_POLICY_RESULT(.verdict = v, .rev = rev): the word of the fields
 * named, the rest zero. */
#define FLUXVM_POLICY_RESULT(...) (((union fluxvm_policy_result){ .d = { __VA_ARGS__ } }).word)

/* The flow of a forward path's packet, as the path's send stage counts it
 * (fluxvm_flow_sent): read from the flow's conntrack entry before the send
 * stage (fluxvm_flow_of) and kept in one register across it. */
struct fluxvm_flow_ref_info {
	__u32 id;      /* its record's id (fluxvm_ct_value.flow); 0: none */
	__u32 audited; /* the policy forwarded the flow under audit_only; always 0 in XDP */
};

union fluxvm_flow_ref {
	struct fluxvm_flow_ref_info info;
	__u64 word;
};

/* Which replies a reply path translates. */
#define FLUXVM_REPLY_EW 0   /* VM-edge egress: replies to east-west clients */
#define FLUXVM_REPLY_SNAT 1 /* ingress hooks, north-south egress: replies to the SNAT address */
/* fluxvm_lb_reply_ew found no flow through the slots of the backend's
 * fluxvm_be2fe entry: the flow may have a stored reverse-NAT half (a
 * frontend past the slots, a flow of generation 3, or one whose conntrack
 * entry the LRU evicted and the half rebuilds): the stored path,
 * fluxvm_lb_reply with FLUXVM_REPLY_EW. Never a TC verdict. */
#define FLUXVM_REPLY_STORED 0x100

#endif /* FLUXVM_LIB_LB_TYPES_H */
