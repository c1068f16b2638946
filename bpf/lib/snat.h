/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * North-south source NAT: a client outside the node reaches a backend as
 * the node's SNAT address and a port allocated here, so that the backend's
 * replies come back through us to be translated back.
 *
 * A mapping is the reverse-NAT entry keyed by the reply's view (backend
 * address and port -> SNAT address and port). Allocation inserts that
 * entry with BPF_NOEXIST: the kernel refuses a key that exists, so a port
 * that a live mapping to the same backend tuple holds is never handed out
 * again. A refused candidate counts FLUXVM_CNT_SNAT_RETRIES; after
 * FLUXVM_SNAT_TRIES refusals the flow drops with FLUXVM_DROP_SNAT_FAILED.
 *
 * The candidates: first the client's port folded into the range
 * ((cport - min) mod range: the client's own port when it lies in the
 * range), then a walk from it by a random odd stride. Folding is a
 * bijection on any run of consecutive client ports, so clients that open
 * connections from sequential ports (load generators, clients behind
 * another NAT) get distinct first candidates and fill a range without a
 * clash; a hashed start would clash by the birthday bound, and a linear
 * walk after a clash grows runs of taken ports (primary clustering) that
 * the bounded tries cannot cross. The stride is drawn at the first clash
 * only (a free first candidate costs no helper call), anew for every
 * attempt, so flows that clash on one port walk apart and a retransmitted
 * SYN tries other ports. When the walk comes back to where it started
 * (a stride sharing a factor with the range) it moves on by one, so the
 * candidates of one attempt never repeat; a range of up to
 * FLUXVM_SNAT_TRIES ports walks by one and is searched completely.
 *
 * The LRU may evict a mapping of a live flow under pressure, and another
 * flow may then take its port. Every packet of a flow with SNAT therefore
 * checks that its mapping is still its own: an evicted one is recreated;
 * when another flow holds the port, the flow is mapped afresh (counted as
 * FLUXVM_CNT_SNAT_CONFLICTS) instead of mixing two flows' replies.
 */
#ifndef FLUXVM_LIB_SNAT_H
#define FLUXVM_LIB_SNAT_H

#include "maps.h"
#include "counters.h"
#include "parse.h"

#ifndef EEXIST
#define EEXIST 17
#endif

/* Results of the SNAT helpers other than 0 (success). */
#define FLUXVM_SNAT_FAILED 1   /* no address, empty range, or no free port */
#define FLUXVM_SNAT_CONFLICT 2 /* the flow's port is held by another flow */
#define FLUXVM_SNAT_ERROR 3    /* the map refused for another reason */

static __always_inline struct fluxvm_snat_cfg *fluxvm_snat_cfg_get(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&fluxvm_snat, &zero);
}

/* An address as a global function's argument: the verifier lets the
 * callee read as many bytes as the pointed-to type has. */
struct fluxvm_addr16 {
	__be32 w[4];
};

/* Is @addr, of an edge of this node's group, in fluxvm_snat_peers? A
 * global function: the rare path (nodes in a group only) stays off the
 * callers' frames and is verified once. */
__attribute__((noinline)) int fluxvm_is_snat_peer(const struct fluxvm_addr16 *addr, __u32 v6)
{
	struct fluxvm_snat_peer_key k = {};

	if (!addr)
		return 0;
	if (v6) {
		__builtin_memcpy(k.addr, addr->w, 16);
		k.family = FLUXVM_AF_INET6;
	} else {
		k.addr[0] = addr->w[0];
		k.family = FLUXVM_AF_INET;
	}
	return bpf_map_lookup_elem(&fluxvm_snat_peers, &k) != NULL;
}

/* The bit of @addr in fluxvm_snat_cfg's peer_filter: its (folded) word
 * multiplied and its top 5 bits taken. The control plane sets the bit of
 * every fluxvm_snat_peers address (bpf.SNATPeerFilter computes the same),
 * so an address whose bit is clear is no peer's, and most packets of a
 * group node that are neither to a VIP nor to an SNAT address skip the
 * hash lookup (measured: BenchmarkSNATPeers, docs/benchmarks.md). */
static __always_inline __u32 fluxvm_snat_peer_bit(const __be32 *addr, const int v6)
{
	__u32 x = addr[0];

	if (v6)
		x ^= addr[1] ^ addr[2] ^ addr[3];
	return 1U << ((x * 0x9E3779B1U) >> 27);
}

/* Is @addr the SNAT address of its family, or one of the group's
 * (fluxvm_snat_peers)? Replies are looked up only for packets to them, so
 * other traffic pays one inlined array lookup, and on a node in a group a
 * filter check, and a hash lookup when its bit is set. */
static __always_inline int fluxvm_is_snat_addr(const __be32 *addr, const int v6)
{
	struct fluxvm_snat_cfg *cfg = fluxvm_snat_cfg_get();
	__u32 flags;

	if (!cfg)
		return 0;
	flags = cfg->flags;
	if (v6) {
		if ((flags & FLUXVM_SNAT_F_V6) && addr[0] == cfg->addr6[0] && addr[1] == cfg->addr6[1] &&
		    addr[2] == cfg->addr6[2] && addr[3] == cfg->addr6[3])
			return 1;
	} else if ((flags & FLUXVM_SNAT_F_V4) && addr[0] == cfg->addr4) {
		return 1;
	}
	/* Every caller passes a 16-byte address (struct fluxvm_pkt's). */
	return (flags & FLUXVM_SNAT_F_PEERS) && (cfg->peer_filter & fluxvm_snat_peer_bit(addr, v6)) &&
	       fluxvm_is_snat_peer((const struct fluxvm_addr16 *)addr, v6);
}

/* The mapping's key and value for the flow @pkt (client -> VIP) pinned to
 * backend @be, translated to @snat_addr. The key's port is left to the
 * caller. */
static __always_inline void fluxvm_snat_entry(const struct fluxvm_pkt *pkt, const int v6,
					      const struct fluxvm_backend *be,
					      const __be32 *snat_addr,
					      struct fluxvm_tuple4 *k4, struct fluxvm_tuple6 *k6,
					      struct fluxvm_nat_value *nv)
{
	if (v6) {
		__builtin_memcpy(k6->saddr, be->addr, 16);
		__builtin_memcpy(k6->daddr, snat_addr, 16);
		k6->sport = be->port;
		k6->proto = pkt->l4_proto;
		__builtin_memcpy(nv->vip, pkt->daddr, 16);
		__builtin_memcpy(nv->client, pkt->saddr, 16);
	} else {
		k4->saddr = be->addr[0];
		k4->daddr = snat_addr[0];
		k4->sport = be->port;
		k4->proto = pkt->l4_proto;
		nv->vip[0] = pkt->daddr[0];
		nv->client[0] = pkt->saddr[0];
	}
	nv->vport = pkt->dport;
	nv->cport = pkt->sport;
}

/*
 * State of one allocation, shared with the bpf_loop callback. It lives in a
 * per-CPU scratch map rather than on the stack: the north-south program
 * already uses most of its 512 bytes, and a program runs to completion on
 * its CPU, so one slot per CPU is enough.
 */
struct fluxvm_snat_try {
	struct fluxvm_tuple4 k4;
	struct fluxvm_tuple6 k6;
	struct fluxvm_nat_value nv;
	__u32 min;
	__u32 range;
	__u32 cand;   /* offset into the range of the port being tried */
	__u32 stride; /* of the walk after the first clash */
	__u32 first;  /* where the walk's current cycle started */
	__u32 v6;
	__s64 err;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct fluxvm_snat_try);
	__uint(max_entries, 1);
} fluxvm_snat_scratch SEC(".maps");

static __always_inline struct fluxvm_snat_try *fluxvm_snat_scratch_get(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&fluxvm_snat_scratch, &zero);
}

/*
 * One candidate port. Run through bpf_loop so that the verifier checks the
 * body once instead of once per try. Returns 1 (stop) on success or on an
 * error other than "taken".
 */
static long fluxvm_snat_try_one(__u32 i, void *arg)
{
	struct fluxvm_snat_try *t = fluxvm_snat_scratch_get();
	__be16 port;

	if (!t || !t->range)
		return 1;
	port = bpf_htons((__u16)(t->min + t->cand));
	t->k4.dport = port;
	t->k6.dport = port;
	t->err = t->v6 ? bpf_map_update_elem(&fluxvm_nat6, &t->k6, &t->nv, BPF_NOEXIST)
		       : bpf_map_update_elem(&fluxvm_nat4, &t->k4, &t->nv, BPF_NOEXIST);
	if (t->err != -EEXIST)
		return 1;
	fluxvm_count(FLUXVM_CNT_SNAT_RETRIES);
	if (i == 0) {
		/* An odd stride below the range: coprime with a range that is
		 * a power of two, and otherwise rarely sharing a factor with
		 * it (the cycle check below covers that case). */
		t->stride = t->range > FLUXVM_SNAT_TRIES ? (bpf_get_prandom_u32() % (t->range - 1)) | 1 : 1;
		t->first = t->cand;
	}
	/* Both terms are below the range (at most 65535): no wrap. */
	t->cand = (t->cand + t->stride) % t->range;
	if (t->cand == t->first) {
		t->cand = (t->cand + 1) % t->range;
		t->first = t->cand;
	}
	return 0;
}

/*
 * Allocate an SNAT port for a new flow and insert its mapping. On success
 * the flow's conntrack value @nct gets the address and port. @nat_flags
 * are extra FLUXVM_NAT_F_* for the mapping.
 */
static __always_inline int fluxvm_snat_learn(const struct fluxvm_pkt *pkt, const int v6,
					     const struct fluxvm_backend *be, __u32 sid, __u32 bid,
					     __u64 now, __u8 nat_flags,
					     struct fluxvm_ct_value *nct)
{
	struct fluxvm_snat_cfg *cfg = fluxvm_snat_cfg_get();
	struct fluxvm_snat_try *t = fluxvm_snat_scratch_get();
	__be32 addr[4] = {};
	__u32 sport, off;

	if (!t || !cfg || cfg->port_min == 0 || cfg->port_min > cfg->port_max)
		return FLUXVM_SNAT_FAILED;
	__builtin_memset(t, 0, sizeof(*t));
	t->nv.flags = FLUXVM_NAT_F_SNAT | nat_flags;
	t->nv.service_id = sid;
	t->nv.backend_id = bid;
	t->nv.flow = nct->flow;
	t->nv.last_seen_ns = now;
	t->v6 = v6;
	t->err = -EEXIST;
	if (v6) {
		if (!(cfg->flags & FLUXVM_SNAT_F_V6))
			return FLUXVM_SNAT_FAILED;
		__builtin_memcpy(addr, cfg->addr6, 16);
	} else {
		if (!(cfg->flags & FLUXVM_SNAT_F_V4))
			return FLUXVM_SNAT_FAILED;
		addr[0] = cfg->addr4;
	}
	t->min = cfg->port_min;
	t->range = (__u32)cfg->port_max - t->min + 1;
	fluxvm_snat_entry(pkt, v6, be, addr, &t->k4, &t->k6, &t->nv);

	/* The client's port folded into the range, (sport - min) mod range,
	 * with one division at most (none for a port in the range). */
	sport = bpf_ntohs(pkt->sport);
	if (sport >= t->min) {
		off = sport - t->min;
		if (off >= t->range)
			off %= t->range;
	} else {
		off = (t->min - sport) % t->range;
		if (off)
			off = t->range - off;
	}
	t->cand = off;
	bpf_loop(FLUXVM_SNAT_TRIES, fluxvm_snat_try_one, NULL, 0);
	if (t->err == -EEXIST)
		return FLUXVM_SNAT_FAILED;
	if (t->err)
		return FLUXVM_SNAT_ERROR;
	nct->flags |= FLUXVM_CT_F_SNAT;
	nct->nat_port = v6 ? t->k6.dport : t->k4.dport;
	__builtin_memcpy(nct->nat_addr, addr, 16);
	return 0;
}

/* Remove the mapping @nct names (both halves go together when the
 * conntrack half could not be written). The key is built in per-CPU
 * scratch (maps.h). */
static __always_inline void fluxvm_snat_forget(const struct fluxvm_pkt *pkt, const int v6,
					       const struct fluxvm_backend *be,
					       const struct fluxvm_ct_value *nct)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();

	if (!s)
		return;
	__builtin_memset(&s->k4, 0, sizeof(s->k4));
	__builtin_memset(&s->k6, 0, sizeof(s->k6));
	fluxvm_snat_entry(pkt, v6, be, nct->nat_addr, &s->k4, &s->k6, &s->nv);
	s->k4.dport = nct->nat_port;
	s->k6.dport = nct->nat_port;
	if (v6)
		bpf_map_delete_elem(&fluxvm_nat6, &s->k6);
	else
		bpf_map_delete_elem(&fluxvm_nat4, &s->k4);
}

/*
 * An established flow with SNAT: is its mapping (@ct's address and port,
 * backend @be) still its own? An evicted mapping is recreated. The key and
 * value are built in per-CPU scratch (maps.h): ~120 bytes the SNAT forward
 * path's frame would otherwise hold, in a call chain that shares 512.
 */
static __always_inline int fluxvm_snat_check(const struct fluxvm_pkt *pkt, const int v6,
					     const struct fluxvm_backend *be,
					     const struct fluxvm_ct_value *ct, __u32 sid, __u32 bid,
					     __u64 now, __u8 nat_flags)
{
	struct fluxvm_scratch *s = fluxvm_scratch_get();
	struct fluxvm_nat_value *cur, *nv;
	long err;

	if (!s)
		return FLUXVM_SNAT_ERROR;
	nv = &s->nv;
	/* Keys are hashed with their padding: zero it. */
	__builtin_memset(&s->k4, 0, sizeof(s->k4));
	__builtin_memset(&s->k6, 0, sizeof(s->k6));
	__builtin_memset(nv, 0, sizeof(*nv));
	nv->flags = FLUXVM_NAT_F_SNAT | nat_flags;
	nv->service_id = sid;
	nv->backend_id = bid;
	nv->flow = ct->flow;
	nv->last_seen_ns = now;
	fluxvm_snat_entry(pkt, v6, be, ct->nat_addr, &s->k4, &s->k6, nv);
	s->k4.dport = ct->nat_port;
	s->k6.dport = ct->nat_port;
	cur = v6 ? bpf_map_lookup_elem(&fluxvm_nat6, &s->k6) : bpf_map_lookup_elem(&fluxvm_nat4, &s->k4);
	if (cur) {
		if (!(cur->flags & FLUXVM_NAT_F_SNAT) || cur->backend_id != bid ||
		    cur->cport != pkt->sport || cur->vport != pkt->dport ||
		    cur->client[0] != pkt->saddr[0] || cur->vip[0] != pkt->daddr[0])
			return FLUXVM_SNAT_CONFLICT;
		if (v6 && (cur->client[1] != pkt->saddr[1] || cur->client[2] != pkt->saddr[2] ||
			   cur->client[3] != pkt->saddr[3] || cur->vip[1] != pkt->daddr[1] ||
			   cur->vip[2] != pkt->daddr[2] || cur->vip[3] != pkt->daddr[3]))
			return FLUXVM_SNAT_CONFLICT;
		return 0;
	}
	err = v6 ? bpf_map_update_elem(&fluxvm_nat6, &s->k6, nv, BPF_NOEXIST)
		 : bpf_map_update_elem(&fluxvm_nat4, &s->k4, nv, BPF_NOEXIST);
	if (!err)
		return 0;
	return err == -EEXIST ? FLUXVM_SNAT_CONFLICT : FLUXVM_SNAT_ERROR;
}

#endif /* FLUXVM_LIB_SNAT_H */
