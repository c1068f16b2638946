/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Identity-aware service policy (maps: fluxvm_abi_policy.bpf.h).
 *
 * A service with FLUXVM_SVC_F_POLICY decides every new flow by the identity
 * of its source: the ipcache's longest prefix covering the source address
 * (fluxvm_sid4 / fluxvm_sid6), identity 0 when none does. The service's
 * header in fluxvm_spol names its rule set; a rule of that set for the
 * identity gives its action, else the header's default. A denied flow is
 * dropped (FLUXVM_DROP_POLICY_DENIED), or, under audit_only, forwarded and
 * counted (FLUXVM_CNT_POLICY_AUDITED) with its flow record's verdict
 * "audited".
 *
 * A flow's conntrack entry keeps the revision of the policy it was admitted
 * under. Each packet of an established flow of a service with a policy
 * compares it with the header's, one lookup; when they differ (the policy
 * or the ipcache changed, or the flow was admitted without a policy) the
 * flow is decided again, so revoking an identity stops its open
 * connections at their next packet.
 *
 * A service whose header is missing (its flag set, its policy maps not
 * restored yet after a program reload) drops: fail closed.
 *
 * XDP serves no service with a policy: it passes their packets to TC
 * (FLUXVM_CNT_XDP_PASS_POLICY), which applies it.
 */
#ifndef FLUXVM_LIB_POLICY_H
#define FLUXVM_LIB_POLICY_H

#include "maps.h"
#include "parse.h"
#include "counters.h"
#include "lb_types.h"

/* Whether a forward path with frontend flags @flags applies a policy. XDP
 * passes the packets of services with a policy on to TC (its call chain
 * has no stack to spare for it), so its paths carry no policy code. */
#ifdef FLUXVM_CTX_XDP
#define fluxvm_policy_on(flags) 0
#else
#define fluxvm_policy_on(flags) ((flags) & FLUXVM_SVC_F_POLICY)
#endif

/*
 * Decide a flow of client packet @pkt under the policy of the datapath
 * service of @info (the word of a union fluxvm_policy_arg: the service,
 * the family, the interface the packet came in on): the word of a union
 * fluxvm_policy_result, the verdict (enum fluxvm_policy_verdict) and the
 * policy's revision; a denied or audited flow is counted here (node-wide
 * and for the service). The header is read once:
 * its rule set and revision belong together (userspace replaces a header
 * in one update; fluxvm_spol is not preallocated, so a replaced header
 * stays readable until we are done). A global function, verified once for
 * every path that calls it; its keys live in per-CPU scratch, so its frame
 * is the smallest a call chain can have (the forward paths' chains are
 * near the 512-byte stack).
 */
__attribute__((noinline)) __u64 fluxvm_policy_decide(struct fluxvm_pkt *pkt, __u64 info)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	struct fluxvm_svc_stats_value *st;
	struct fluxvm_spol_value *v;
	struct fluxvm_sid_value *id;
	union fluxvm_policy_arg a = { .word = info };
	__u32 rev;
	__u8 action, flags;

	if (!s || !pkt)
		return FLUXVM_POLICY_RESULT(.verdict = FLUXVM_PV_MISSING);
	s->pk.id = a.info.sid;
	s->pk.identity = FLUXVM_SPOL_HEADER;
	v = bpf_map_lookup_elem(&fluxvm_spol, &s->pk);
	if (!v)
		return FLUXVM_POLICY_RESULT(.verdict = FLUXVM_PV_MISSING);
	rev = v->revision;
	action = v->action;
	flags = v->flags;
	/* L7 enforce's bypass (lib/l7.h): the proxy's own flows to the VIP
	 * carry requests whose clients were decided on their way in. */
	if ((flags & FLUXVM_POLICY_F_L7) && a.info.ifindex == v->proxy_ifindex)
		return FLUXVM_POLICY_RESULT(.verdict = FLUXVM_PV_ALLOW, .rev = rev);
	s->pk.id = v->rules;
	/* The source's identity: the ipcache's longest prefix covering it,
	 * or 0 (unknown). */
	if (a.info.v6) {
		s->sk6.prefixlen = 128;
		__builtin_memcpy(s->sk6.addr, pkt->saddr, 16);
		id = bpf_map_lookup_elem(&fluxvm_sid6, &s->sk6);
	} else {
		s->sk4.prefixlen = 32;
		s->sk4.addr = pkt->saddr[0];
		id = bpf_map_lookup_elem(&fluxvm_sid4, &s->sk4);
	}
	s->pk.identity = id ? id->identity : 0;
	v = bpf_map_lookup_elem(&fluxvm_spol, &s->pk);
	if (v)
		action = v->action;
	if (action == FLUXVM_POLICY_ALLOW)
		return FLUXVM_POLICY_RESULT(.verdict = FLUXVM_PV_ALLOW, .rev = rev);
	/* Denied (or audited): counted for the service too. */
	s->stats_key = a.info.sid;
	st = bpf_map_lookup_elem(&fluxvm_svc_stats, &s->stats_key);
	if (!(flags & FLUXVM_POLICY_F_AUDIT)) {
		if (st)
			st->policy_denied++;
		return FLUXVM_POLICY_RESULT(.verdict = FLUXVM_PV_DENY, .rev = rev);
	}
	if (st)
		st->policy_audited++;
	fluxvm_count(FLUXVM_CNT_POLICY_AUDITED);
	return FLUXVM_POLICY_RESULT(.verdict = FLUXVM_PV_AUDIT, .rev = rev);
}

/* The drop reason of a decision @pv, or 0 when the flow may go on. */
static __always_inline int fluxvm_policy_reason(union fluxvm_policy_result pv)
{
	if (pv.d.verdict == FLUXVM_PV_ALLOW || pv.d.verdict == FLUXVM_PV_AUDIT)
		return 0;
	return pv.d.verdict == FLUXVM_PV_DENY ? FLUXVM_DROP_POLICY_DENIED : FLUXVM_DROP_POLICY_MISSING;
}

/*
 * The policy stage of a new flow of service @sid, whose conntrack entry
 * @ct is built but not written: 0 when the flow may go on, its entry then
 * holding the revision it is admitted under (and FLUXVM_CT_F_AUDITED when
 * audit_only let it through); else the reason to drop it. After the pick
 * (which takes nothing) and before every write, so a denied flow leaves
 * no state and takes no SNAT port.
 */
static __always_inline int fluxvm_policy_admit(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, const int v6,
					       __u32 sid, struct fluxvm_ct_value *ct)
{
	union fluxvm_policy_result pv = {
		.word = fluxvm_policy_decide(pkt, FLUXVM_POLICY_ARG(.v6 = !!v6, .ifindex = ctx_ifindex(ctx), .sid = sid)),
	};
	int reason = fluxvm_policy_reason(pv);

	if (reason)
		return reason;
	ct->policy_rev = pv.d.rev;
	if (pv.d.verdict == FLUXVM_PV_AUDIT)
		ct->flags |= FLUXVM_CT_F_AUDITED;
	return 0;
}

/*
 * A packet of established flow @ct of service @sid, which has a policy: 0
 * when it may go on, else the reason to drop it. A flow admitted under
 * the policy's current revision costs one lookup; any other is decided
 * again and, when it still may go on, takes the current revision. A
 * denied flow's entry keeps its old revision: each of its packets is
 * decided again (and counted revoked), so a policy that allows it again
 * lets it go on.
 */
static __always_inline int fluxvm_policy_recheck(struct __ctx_buff *ctx, struct fluxvm_pkt *pkt, const int v6,
						 __u32 sid, struct fluxvm_ct_value *ct)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	struct fluxvm_spol_value *hdr;
	union fluxvm_policy_result pv;
	int reason;

	if (!s)
		return FLUXVM_DROP_POLICY_MISSING;
	s->pk.id = sid;
	s->pk.identity = FLUXVM_SPOL_HEADER;
	hdr = bpf_map_lookup_elem(&fluxvm_spol, &s->pk);
	if (hdr && hdr->revision == ct->policy_rev)
		return 0;
	fluxvm_count(FLUXVM_CNT_POLICY_RECHECKED);
	pv.word = fluxvm_policy_decide(pkt, FLUXVM_POLICY_ARG(.v6 = !!v6, .ifindex = ctx_ifindex(ctx), .sid = sid));
	reason = fluxvm_policy_reason(pv);
	if (reason == FLUXVM_DROP_POLICY_DENIED)
		fluxvm_count(FLUXVM_CNT_POLICY_REVOKED);
	if (reason)
		return reason;
	ct->policy_rev = pv.d.rev;
	if (pv.d.verdict == FLUXVM_PV_AUDIT)
		ct->flags |= FLUXVM_CT_F_AUDITED;
	else
		ct->flags &= ~FLUXVM_CT_F_AUDITED;
	return 0;
}

#endif /* FLUXVM_LIB_POLICY_H */
