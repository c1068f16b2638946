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

/* The mode of a frontend's path, as the frontend stage finds it. */
enum fluxvm_lb_mode {
	FLUXVM_LB_NONE, /* not a service served here, or dropped: see the verdict */
	FLUXVM_LB_NAT,  /* east-west NAT: fluxvm_lb_nat */
	FLUXVM_LB_SNAT, /* north-south NAT with SNAT: fluxvm_lb_snat */
	FLUXVM_LB_DSR,  /* routed DSR, either edge: fluxvm_lb_dsr */
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
