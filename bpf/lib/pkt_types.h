/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The parse result of a packet (lib/parse.h fills it), as every stage
 * reads it. Types only: maps.h keeps the entry programs' copy in per-CPU
 * scratch.
 */
#ifndef FLUXVM_LIB_PKT_TYPES_H
#define FLUXVM_LIB_PKT_TYPES_H

#include "common.h"

enum fluxvm_frag {
	FLUXVM_FRAG_NONE = 0,
	FLUXVM_FRAG_FIRST = 1, /* offset 0, more follow: the L4 header is here */
	FLUXVM_FRAG_LATER = 2, /* offset > 0: no L4 header, ports unknown */
};

struct fluxvm_pkt {
	__u16 l3_off;     /* IP header, from the packet's start (ctx_data) */
	__u16 l4_off;     /* upper-layer header, from the packet's start */
	__u16 l3_end;     /* end of the IP payload (trailing L2 padding excluded) */
	__u16 l3_proto;   /* ETH_P_IP or ETH_P_IPV6, host order */
	__u8 l4_proto;    /* upper-layer protocol after all extension headers */
	__u8 frag;        /* enum fluxvm_frag */
	__u8 exthdrs;     /* IPv6 extension headers walked */
	__u8 tcp_flags;   /* byte 13 of the TCP header */
	__be16 sport;
	__be16 dport;
	__be32 saddr[4];  /* IPv4 uses saddr[0] */
	__be32 daddr[4];
};

#endif /* FLUXVM_LIB_PKT_TYPES_H */
