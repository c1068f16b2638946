/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Includes and small helpers every FluxVM BPF object uses. */
#ifndef FLUXVM_LIB_COMMON_H
#define FLUXVM_LIB_COMMON_H

#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>

#include "../fluxvm_service_maps.bpf.h"
#include "../fluxvm_service_v6.bpf.h"

#ifndef likely
#define likely(x) __builtin_expect(!!(x), 1)
#endif
#ifndef unlikely
#define unlikely(x) __builtin_expect(!!(x), 0)
#endif


/* The packet context: TC (skb), or XDP for an entry file that defines
 * FLUXVM_CTX_XDP first. Each also names the verdicts the shared paths
 * return: CTX_ACT_NEXT (not ours, or not ours to finish: the packet goes
 * on untouched) and CTX_ACT_DROP. */
#ifdef FLUXVM_CTX_XDP
#include "ctx/xdp.h"
#else
#include "ctx/skb.h"
#endif

#endif /* FLUXVM_LIB_COMMON_H */
