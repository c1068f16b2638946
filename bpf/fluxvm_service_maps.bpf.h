/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Map capacities for the three map tiers.
 *
 * One C source is compiled once per tier with -DFLUXVM_MAP_TIER=<n>; the
 * loader picks the object whose capacities match the configured tier, so a
 * tier change is a reload with new maps rather than a resize in place (BPF
 * maps cannot grow). Without the define the default tier M is built.
 *
 * The Go side reads the capacities back from every object (bpf.CapacitiesOf),
 * and checks bpf.Tier against FLUXVM_BUILT_TIER in each object's BTF.
 */
#ifndef FLUXVM_SERVICE_MAPS_BPF_H
#define FLUXVM_SERVICE_MAPS_BPF_H

#define FLUXVM_TIER_S 1
#define FLUXVM_TIER_M 2
#define FLUXVM_TIER_L 3

#ifndef FLUXVM_MAP_TIER
#define FLUXVM_MAP_TIER FLUXVM_TIER_M
#endif

#if FLUXVM_MAP_TIER == FLUXVM_TIER_S
#define FLUXVM_MAX_SERVICES     256
#define FLUXVM_MAX_BACKENDS     4096
#define FLUXVM_MAGLEV_SIZE      16381
#define FLUXVM_CT_ENTRIES       65536
#define FLUXVM_NAT_ENTRIES      65536
#define FLUXVM_SOCK_ENTRIES     16384
#define FLUXVM_FLOW_SLOTS       4096 /* a power of two: slot = seq & (slots - 1) */
#define FLUXVM_POLICY_RULES     16384 /* identity rules over all policies */
#define FLUXVM_HAQ_BYTES        (256 << 10) /* HA queue: ~1,900 records (128 + an 8-byte header) */
#elif FLUXVM_MAP_TIER == FLUXVM_TIER_M
#define FLUXVM_MAX_SERVICES     1024
#define FLUXVM_MAX_BACKENDS     16384
#define FLUXVM_MAGLEV_SIZE      65537
#define FLUXVM_CT_ENTRIES       262144
#define FLUXVM_NAT_ENTRIES      262144
#define FLUXVM_SOCK_ENTRIES     65536
#define FLUXVM_FLOW_SLOTS       16384 /* a power of two: slot = seq & (slots - 1) */
#define FLUXVM_POLICY_RULES     65536 /* identity rules over all policies */
#define FLUXVM_HAQ_BYTES        (1 << 20) /* HA queue: ~7,700 records */
#elif FLUXVM_MAP_TIER == FLUXVM_TIER_L
#define FLUXVM_MAX_SERVICES     4096
#define FLUXVM_MAX_BACKENDS     65536
#define FLUXVM_MAGLEV_SIZE      131071
#define FLUXVM_CT_ENTRIES       1048576
#define FLUXVM_NAT_ENTRIES      1048576
#define FLUXVM_SOCK_ENTRIES     262144
#define FLUXVM_FLOW_SLOTS       65536 /* a power of two: slot = seq & (slots - 1) */
#define FLUXVM_POLICY_RULES     262144 /* identity rules over all policies */
#define FLUXVM_HAQ_BYTES        (4 << 20) /* HA queue: ~30,800 records */
#else
#error "FLUXVM_MAP_TIER must be FLUXVM_TIER_S, FLUXVM_TIER_M or FLUXVM_TIER_L"
#endif

/* The tier this object was built for, as an enum so that it reaches the
 * object's BTF (the #defines above serve #if, which cannot read an enum). */
enum fluxvm_built_tier {
	FLUXVM_BUILT_TIER = FLUXVM_MAP_TIER,
};

/*
 * A service has one frontend per (VIP, port, protocol) plus one VIP marker
 * per (VIP, protocol); four per service on average is generous.
 */
#define FLUXVM_MAX_FRONTENDS (4 * FLUXVM_MAX_SERVICES)

/* The IPv4 frontend index (fluxvm_fe4): four slots per frontend, a power
 * of two (FLUXVM_MAX_SERVICES is one), so that at most about a fifth of a
 * full table's frontends share a slot with another. */
#define FLUXVM_FE4_SLOTS (4 * FLUXVM_MAX_FRONTENDS)
#if FLUXVM_MAP_TIER == FLUXVM_TIER_S
#define FLUXVM_FE4_BITS 12
#elif FLUXVM_MAP_TIER == FLUXVM_TIER_M
#define FLUXVM_FE4_BITS 14
#else
#define FLUXVM_FE4_BITS 16
#endif
_Static_assert(FLUXVM_FE4_SLOTS == 1 << FLUXVM_FE4_BITS, "FLUXVM_FE4_BITS");

/* Identity policy (lib/policy.h): prefixes a family in the ipcache's
 * tries; the policy map holds the rules, a header per datapath service,
 * and room for one policy's new rule set (two lists of 1,024 identities)
 * next to its old one while a change switches between them. */
#define FLUXVM_IPCACHE_PREFIXES 65536
#define FLUXVM_SPOL_ENTRIES (FLUXVM_POLICY_RULES + FLUXVM_MAX_SERVICES + 2048)

/* VM-edge interfaces with their own statistics. */
#define FLUXVM_MAX_EDGES FLUXVM_MAX_SERVICES

#endif /* FLUXVM_SERVICE_MAPS_BPF_H */
