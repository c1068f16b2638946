/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Socket load balancing: the cgroup sock_addr hooks of processes on the
 * node itself. A connect or a send to a VIP is addressed to a backend
 * before the socket sends anything, so its packets carry the backend's
 * address from the start and no hook translates them; what the socket
 * receives from the backend, and getpeername, show the VIP.
 *
 * Selection follows the packet hooks (svc.h): a socket keeps the backend
 * it has for a VIP while that backend is Ready, or Draining with its
 * deadline ahead; otherwise (a new socket, or its backend Unhealthy,
 * removed or past its drain) it takes the Maglev pick, which holds Ready
 * backends only. The pick hashes the socket's cookie, so the sockets of a
 * service spread over its backends by their weights.
 *
 * Fail-open: whatever this cannot do leaves the address as the
 * application gave it, and the packet hooks serve the VIP as for any
 * client (TC and XDP stay canonical): no service here, the guard closed
 * (TC then drops, with the reason), no Ready backend of the socket's
 * family, a map that cannot be written. Each is counted.
 *
 * IPv4-mapped IPv6 addresses (::ffff:a.b.c.d, an IPv6 socket talking
 * IPv4) are served as IPv4, and written back mapped.
 */
#ifndef FLUXVM_LIB_SOCK_H
#define FLUXVM_LIB_SOCK_H

#include "maps.h"
#include "counters.h"
#include "hash.h"
#include "ct.h"
#include "svc.h"

/* An address as a sock_addr hook has it: family of the lookup (an
 * IPv4-mapped IPv6 address is IPv4), the address in fluxvm_backend's
 * layout, and whether it must be written back mapped. */
struct fluxvm_sock_addr {
	__be32 addr[4];
	__be16 port;
	__u8 v6;     /* an IPv6 address (not IPv4-mapped) */
	__u8 mapped; /* an IPv4-mapped IPv6 address */
};

static __always_inline void fluxvm_sock_read(const struct bpf_sock_addr *ctx, const int v6,
					     struct fluxvm_sock_addr *a)
{
	__builtin_memset(a, 0, sizeof(*a));
	/* The port is in network order in the low 16 bits. */
	a->port = (__be16)ctx->user_port;
	if (!v6) {
		a->addr[0] = ctx->user_ip4;
		return;
	}
	a->addr[0] = ctx->user_ip6[0];
	a->addr[1] = ctx->user_ip6[1];
	a->addr[2] = ctx->user_ip6[2];
	a->addr[3] = ctx->user_ip6[3];
	if (a->addr[0] == 0 && a->addr[1] == 0 && a->addr[2] == bpf_htonl(0xffff)) {
		a->addr[0] = a->addr[3];
		a->addr[2] = 0;
		a->addr[3] = 0;
		a->mapped = 1;
		return;
	}
	a->v6 = 1;
}

/* Write @addr (fluxvm_backend's layout, of the family @a was read as) and
 * @port into the hook's address. */
static __always_inline void fluxvm_sock_write(struct bpf_sock_addr *ctx, const int v6,
					      const struct fluxvm_sock_addr *a,
					      const __be32 *addr, __be16 port)
{
	ctx->user_port = (__u32)port;
	if (!v6) {
		ctx->user_ip4 = addr[0];
		return;
	}
	if (a->mapped) {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = bpf_htonl(0xffff);
		ctx->user_ip6[3] = addr[0];
		return;
	}
	ctx->user_ip6[0] = addr[0];
	ctx->user_ip6[1] = addr[1];
	ctx->user_ip6[2] = addr[2];
	ctx->user_ip6[3] = addr[3];
}

static __always_inline struct fluxvm_svc_value *fluxvm_sock_frontend(const struct fluxvm_sock_addr *a,
								      __u8 proto)
{
	if (a->v6) {
		struct fluxvm_svc6_key k = { .port = a->port, .proto = proto };

		__builtin_memcpy(k.vip, a->addr, 16);
		return bpf_map_lookup_elem(&fluxvm_svc6, &k);
	}
	struct fluxvm_svc4_key k = { .vip = a->addr[0], .port = a->port, .proto = proto };

	return bpf_map_lookup_elem(&fluxvm_svc4, &k);
}

/* The Maglev hash of a socket: its cookie, mixed with the node's seed. */
static __always_inline __u32 fluxvm_sock_hash(__u64 cookie, const struct fluxvm_meta_value *meta)
{
	__u32 h = fluxvm_seed32(meta ? meta->hash_seed : 0);

	h = fluxvm_hash_word(h, (__u32)cookie);
	h = fluxvm_hash_word(h, (__u32)(cookie >> 32));
	return fluxvm_hash_final(h, 8);
}

/*
 * connect and sendmsg: a socket of protocol @proto addressing a VIP is
 * addressed to its backend instead (see the top of this file). @v6 is the
 * hook's family.
 */
static __always_inline void fluxvm_sock_forward(struct bpf_sock_addr *ctx, const int v6)
{
	struct fluxvm_sock_rvalue rv = {}, *old;
	struct fluxvm_sock_rkey rk = {};
	struct fluxvm_sock_key k = {};
	struct fluxvm_sock_value *sv, nv;
	struct fluxvm_sock_addr a;
	struct fluxvm_svc_value *svc;
	struct fluxvm_backend *be = NULL;
	__u8 proto = ctx->protocol, family;
	__u32 sid, bid = 0;
	__u64 cookie, now = 0;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return;
	fluxvm_sock_read(ctx, v6, &a);
	svc = fluxvm_sock_frontend(&a, proto);
	/* Served where VM-edge clients are: east-west. Not a DSR service:
	 * its backends serve the VIP itself, which the packet must keep. */
	if (!svc || (svc->flags & (FLUXVM_SVC_F_VIP_MARKER | FLUXVM_SVC_F_DSR)) ||
	    !fluxvm_svc_here(svc, FLUXVM_EDGE_VM))
		return;
	sid = svc->service_id;
	if (!fluxvm_guard_open(sid)) {
		fluxvm_count(FLUXVM_CNT_SOCK_FAIL_OPEN_GUARD);
		return;
	}
	family = a.v6 ? FLUXVM_AF_INET6 : FLUXVM_AF_INET;
	cookie = bpf_get_socket_cookie(ctx);

	k.cookie = cookie;
	__builtin_memcpy(k.vip, a.addr, 16);
	k.vport = a.port;
	k.proto = proto;
	k.family = family;
	/* A service with an identity policy (or L7 enforce) is left to TC,
	 * which decides every flow by its source's identity (lib/policy.h)
	 * and hands L7 flows to the proxy (lib/l7.h); a UDP socket's
	 * association from before the policy goes, so that its next send
	 * is decided there too. */
	if (svc->flags & (FLUXVM_SVC_F_POLICY | FLUXVM_SVC_F_L7)) {
		if (proto == IPPROTO_UDP)
			bpf_map_delete_elem(&fluxvm_sock_fwd, &k);
		fluxvm_count(FLUXVM_CNT_SOCK_FAIL_OPEN_POLICY);
		return;
	}
	/* Only a UDP socket has an association to keep (a TCP socket
	 * connects once): a TCP connect pays no lookup and no clock. */
	sv = NULL;
	if (proto == IPPROTO_UDP)
		sv = bpf_map_lookup_elem(&fluxvm_sock_fwd, &k);
	if (sv && sv->service_id == sid) {
		now = bpf_ktime_get_coarse_ns();
		bid = sv->backend_id;
		be = fluxvm_backend_get(bid);
		if (fluxvm_backend_keeps(be, sid, now) && be->family == family)
			goto write;
		fluxvm_count(FLUXVM_CNT_SOCK_REPICKED);
	}
	be = fluxvm_backend_ready(bid = fluxvm_maglev_pick(sid, fluxvm_sock_hash(cookie, fluxvm_meta_get())),
				  sid);
	if (!be || be->family != family) {
		/* The association that could no longer serve goes, or every
		 * later send would count it again. */
		if (sv)
			bpf_map_delete_elem(&fluxvm_sock_fwd, &k);
		fluxvm_count(FLUXVM_CNT_SOCK_FAIL_OPEN_NO_BACKEND);
		return;
	}
	/* A TCP socket connects once and sends no address after: nothing
	 * to keep for it but the way back. */
	if (proto == IPPROTO_UDP) {
		nv.backend_id = bid;
		nv.service_id = sid;
		if (bpf_map_update_elem(&fluxvm_sock_fwd, &k, &nv, BPF_ANY)) {
			fluxvm_count(FLUXVM_CNT_SOCK_FAIL_OPEN_MAP);
			return;
		}
	}

write:
	/* The way back, before the address changes: without it the socket
	 * would see the backend as its peer. Written only when missing
	 * (a send of a UDP socket comes here every datagram). */
	rk.cookie = cookie;
	__builtin_memcpy(rk.addr, be->addr, 16);
	rk.port = be->port;
	rk.proto = proto;
	rk.family = family;
	/* A new TCP socket has no way back yet: written without a look. */
	old = proto == IPPROTO_UDP ? bpf_map_lookup_elem(&fluxvm_sock_rev, &rk) : NULL;
	if (!old || old->service_id != sid || old->backend_id != bid || old->vport != a.port ||
	    old->vip[0] != a.addr[0] || old->vip[1] != a.addr[1] || old->vip[2] != a.addr[2] ||
	    old->vip[3] != a.addr[3]) {
		/* New, or the socket reached this backend through another VIP
		 * before: replies show the VIP it sent to last (one socket,
		 * one backend, two VIPs cannot be told apart on receive). */
		__builtin_memcpy(rv.vip, a.addr, 16);
		rv.vport = a.port;
		rv.family = family;
		rv.service_id = sid;
		rv.backend_id = bid;
		if (bpf_map_update_elem(&fluxvm_sock_rev, &rk, &rv, BPF_ANY)) {
			fluxvm_count(FLUXVM_CNT_SOCK_FAIL_OPEN_MAP);
			return;
		}
	}
	fluxvm_sock_write(ctx, v6, &a, be->addr, be->port);
	fluxvm_count(FLUXVM_CNT_SOCK_REWRITTEN);
}

/*
 * recvmsg and getpeername: an address that is a backend this socket was
 * addressed to instead of a VIP is shown as that VIP.
 */
static __always_inline void fluxvm_sock_reverse(struct bpf_sock_addr *ctx, const int v6)
{
	struct fluxvm_sock_rvalue *rv;
	struct fluxvm_sock_rkey rk = {};
	struct fluxvm_sock_addr a, vip = {};
	struct fluxvm_svc_value *svc;
	__u8 proto = ctx->protocol;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return;
	fluxvm_sock_read(ctx, v6, &a);
	rk.cookie = bpf_get_socket_cookie(ctx);
	__builtin_memcpy(rk.addr, a.addr, 16);
	rk.port = a.port;
	rk.proto = proto;
	rk.family = a.v6 ? FLUXVM_AF_INET6 : FLUXVM_AF_INET;
	rv = bpf_map_lookup_elem(&fluxvm_sock_rev, &rk);
	if (!rv)
		return;
	/* Only while the VIP is still that service's: a service deleted (or
	 * its VIP given to another) leaves the socket talking to a backend
	 * address, which is what it then sees. */
	vip.port = rv->vport;
	__builtin_memcpy(vip.addr, rv->vip, 16);
	vip.v6 = rv->family == FLUXVM_AF_INET6;
	svc = fluxvm_sock_frontend(&vip, proto);
	if (!svc || svc->service_id != rv->service_id) {
		bpf_map_delete_elem(&fluxvm_sock_rev, &rk);
		return;
	}
	fluxvm_sock_write(ctx, v6, &a, rv->vip, rv->vport);
	fluxvm_count(FLUXVM_CNT_SOCK_REVERSED);
}

/*
 * sock_release: a connected socket (TCP, or connected UDP) that closes
 * takes its association with it, so that the LRU maps hold live sockets:
 * short connections would otherwise evict the entries of long-lived ones.
 * (An unconnected UDP socket's entries, one per VIP it sent to, age out of
 * the LRU.)
 */
static __always_inline void fluxvm_sock_forget(struct bpf_sock *ctx)
{
	struct fluxvm_sock_rvalue *rv;
	struct fluxvm_sock_rkey rk = {};
	struct fluxvm_sock_key k = {};
	__u32 proto = ctx->protocol;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return;
	rk.port = ctx->dst_port;
	if (!rk.port)
		return; /* never connected */
	if (ctx->family == 2 /* AF_INET */) {
		rk.addr[0] = ctx->dst_ip4;
		rk.family = FLUXVM_AF_INET;
	} else if (ctx->family == 10 /* AF_INET6 */) {
		rk.addr[0] = ctx->dst_ip6[0];
		rk.addr[1] = ctx->dst_ip6[1];
		rk.addr[2] = ctx->dst_ip6[2];
		rk.addr[3] = ctx->dst_ip6[3];
		rk.family = FLUXVM_AF_INET6;
		if (rk.addr[0] == 0 && rk.addr[1] == 0 && rk.addr[2] == bpf_htonl(0xffff)) {
			rk.addr[0] = rk.addr[3];
			rk.addr[2] = 0;
			rk.addr[3] = 0;
			rk.family = FLUXVM_AF_INET;
		}
	} else {
		return;
	}
	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.proto = proto;
	if (proto == IPPROTO_TCP) {
		/* A TCP socket has nothing but its way back. */
		bpf_map_delete_elem(&fluxvm_sock_rev, &rk);
		return;
	}
	rv = bpf_map_lookup_elem(&fluxvm_sock_rev, &rk);
	if (!rv)
		return;
	k.cookie = rk.cookie;
	__builtin_memcpy(k.vip, rv->vip, 16);
	k.vport = rv->vport;
	k.proto = IPPROTO_UDP;
	k.family = rv->family;
	bpf_map_delete_elem(&fluxvm_sock_fwd, &k);
	bpf_map_delete_elem(&fluxvm_sock_rev, &rk);
}

#endif /* FLUXVM_LIB_SOCK_H */
