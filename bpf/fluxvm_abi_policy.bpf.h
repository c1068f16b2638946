/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Layouts of BPF schema 4 shared with Go, under the rules of
 * fluxvm_service_v6.bpf.h (fixed-width fields, explicit padding, a size
 * assert; enum members appended, never renumbered):
 * identity-aware service policy (the ipcache and the policy map). Types
 * only.
 */
#ifndef FLUXVM_ABI_POLICY_BPF_H
#define FLUXVM_ABI_POLICY_BPF_H

#include <linux/types.h>

/*
 * Identity-aware service policy (lib/policy.h). The ipcache maps source
 * prefixes to identities in two LPM tries, fluxvm_sid4 and fluxvm_sid6
 * (longest prefix wins; no match: identity 0, unknown). fluxvm_spol holds,
 * per datapath service with FLUXVM_SVC_F_POLICY, a header under (service
 * id, FLUXVM_SPOL_HEADER): the id of its current rule set, its revision,
 * default action and flags; and the rule sets' rules under (rule set id,
 * identity), one per identity whose action differs from the default. A
 * changed policy gets its rules written under a fresh rule set id and the
 * header switched to it in one update, so no packet meets half a policy.
 */
struct fluxvm_sid4_key {
	__u32 prefixlen;
	__be32 addr;
};
_Static_assert(sizeof(struct fluxvm_sid4_key) == 8, "fluxvm_sid4_key size");

struct fluxvm_sid6_key {
	__u32 prefixlen;
	__be32 addr[4];
};
_Static_assert(sizeof(struct fluxvm_sid6_key) == 20, "fluxvm_sid6_key size");

struct fluxvm_sid_value {
	__u32 identity; /* 1..2^24-1 */
	__u32 pad;
};
_Static_assert(sizeof(struct fluxvm_sid_value) == 8, "fluxvm_sid_value size");

enum fluxvm_spol_const {
	FLUXVM_SPOL_HEADER = 0xffffffffU, /* the identity of a header key: no identity is */
};

struct fluxvm_spol_key {
	__u32 id;       /* header: the datapath service id; rule: its rule set id */
	__u32 identity; /* FLUXVM_SPOL_HEADER for a header */
};
_Static_assert(sizeof(struct fluxvm_spol_key) == 8, "fluxvm_spol_key size");

enum fluxvm_policy_action {
	FLUXVM_POLICY_ALLOW = 1,
	FLUXVM_POLICY_DENY = 2,
};

enum fluxvm_policy_flags {
	FLUXVM_POLICY_F_AUDIT = 1U << 0, /* forward what it denies: counted and recorded audited */
	FLUXVM_POLICY_F_L7 = 1U << 1,    /* L7 enforce: new flows go to proxy_ifindex (lib/l7.h) */
};

struct fluxvm_spol_value {
	__u32 rules;    /* header: the id of the service's rule set; rule: 0 */
	__u32 revision; /* header: the policy's revision (never 0), kept in conntrack */
	__u8 action;    /* enum fluxvm_policy_action: header the default, rule the identity's */
	__u8 flags;     /* header: enum fluxvm_policy_flags */
	__u16 pad0;
	__u32 proxy_ifindex; /* header with FLUXVM_POLICY_F_L7: the proxy interface; else 0 */
};
_Static_assert(sizeof(struct fluxvm_spol_value) == 16, "fluxvm_spol_value size");

#endif /* FLUXVM_ABI_POLICY_BPF_H */
