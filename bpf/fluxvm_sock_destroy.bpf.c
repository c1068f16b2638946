//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fluxvm_sock_destroy: a UDP socket iterator that terminates the connected
 * UDP sockets that socket load balancing (fluxvm_service_connect.bpf.c)
 * connected to a backend that may no longer serve them (Unhealthy,
 * removed, past its drain deadline). A connected socket's sends carry no
 * address, so no hook runs on them and nothing can re-pick its backend:
 * without this it would keep sending into the void. Destroyed, the socket
 * is disconnected with ECONNABORTED as its pending error (a send without
 * an address then fails with EDESTADDRREQ), and its application connects
 * again, to a fresh pick.
 *
 * Run by the control plane after backends change (bpf.Datapath
 * DestroyStaleUDPSockets), in the network namespace whose sockets it
 * walks. Its own object: bpf_sock_destroy needs Linux 6.5, and a kernel
 * without it must still load the socket hooks. One build serves every
 * tier: the loader gives it the datapath's maps, whatever their size.
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/svc.h"

/* The kernel's types, as far as this reads them (CO-RE: the names without
 * the ___fluxvm flavour are matched against the running kernel's BTF). */
struct in6_addr___fluxvm {
	union {
		__be32 u6_addr32[4];
	} in6_u;
} __attribute__((preserve_access_index));

struct sock_common___fluxvm {
	__be32 skc_daddr;
	__be16 skc_dport;
	unsigned short skc_family;
	volatile unsigned char skc_state;
	struct in6_addr___fluxvm skc_v6_daddr;
} __attribute__((preserve_access_index));

struct sock___fluxvm {
	struct sock_common___fluxvm __sk_common;
	__u16 sk_protocol;
} __attribute__((preserve_access_index));

struct udp_sock___fluxvm;
struct seq_file;

struct bpf_iter_meta___fluxvm {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

struct bpf_iter__udp___fluxvm {
	struct bpf_iter_meta___fluxvm *meta;
	struct udp_sock___fluxvm *udp_sk;
} __attribute__((preserve_access_index));

extern int bpf_sock_destroy(struct sock_common___fluxvm *sk) __ksym;

#define FLUXVM_TCP_ESTABLISHED 1 /* a connected UDP socket's state */
#define FLUXVM_AF_INET_SK 2
#define FLUXVM_AF_INET6_SK 10

SEC("iter/udp")
int fluxvm_sock_destroy_udp(struct bpf_iter__udp___fluxvm *ctx)
{
	struct sock___fluxvm *sk = (struct sock___fluxvm *)ctx->udp_sk;
	struct fluxvm_sock_rvalue *rv;
	struct fluxvm_sock_rkey rk = {};
	struct fluxvm_sock_key k = {};
	struct fluxvm_backend *be;
	unsigned short family;
	static const char one = 1;

	if (!sk || sk->__sk_common.skc_state != FLUXVM_TCP_ESTABLISHED)
		return 0;
	family = sk->__sk_common.skc_family;
	rk.cookie = bpf_get_socket_cookie(sk);
	rk.port = sk->__sk_common.skc_dport;
	rk.proto = IPPROTO_UDP;
	if (family == FLUXVM_AF_INET_SK) {
		rk.addr[0] = sk->__sk_common.skc_daddr;
		rk.family = FLUXVM_AF_INET;
	} else if (family == FLUXVM_AF_INET6_SK) {
		__be32 w0 = sk->__sk_common.skc_v6_daddr.in6_u.u6_addr32[0];
		__be32 w1 = sk->__sk_common.skc_v6_daddr.in6_u.u6_addr32[1];
		__be32 w2 = sk->__sk_common.skc_v6_daddr.in6_u.u6_addr32[2];
		__be32 w3 = sk->__sk_common.skc_v6_daddr.in6_u.u6_addr32[3];

		if (w0 == 0 && w1 == 0 && w2 == bpf_htonl(0xffff)) {
			/* IPv4-mapped: the socket hooks keyed it as IPv4. */
			rk.addr[0] = w3;
			rk.family = FLUXVM_AF_INET;
		} else {
			rk.addr[0] = w0;
			rk.addr[1] = w1;
			rk.addr[2] = w2;
			rk.addr[3] = w3;
			rk.family = FLUXVM_AF_INET6;
		}
	} else {
		return 0;
	}
	/* Connected by socket LB? Then its VIP, and the backend it has. */
	rv = bpf_map_lookup_elem(&fluxvm_sock_rev, &rk);
	if (!rv)
		return 0;
	k.cookie = rk.cookie;
	__builtin_memcpy(k.vip, rv->vip, 16);
	k.vport = rv->vport;
	k.proto = IPPROTO_UDP;
	k.family = rv->family;
	be = fluxvm_backend_get(rv->backend_id);
	/* The address must still be that backend's: an id given to another
	 * backend means this one was removed. (The fine clock: iterators may
	 * not read the coarse one, and the two differ by less than a tick.) */
	if (fluxvm_backend_keeps(be, rv->service_id, bpf_ktime_get_ns()) && be->port == rk.port &&
	    be->addr[0] == rk.addr[0] && be->addr[1] == rk.addr[1] && be->addr[2] == rk.addr[2] &&
	    be->addr[3] == rk.addr[3])
		return 0;
	if (bpf_sock_destroy((struct sock_common___fluxvm *)sk))
		return 0;
	/* Disconnected, its close will not find them (sock_release keys
	 * them by the peer it no longer has). */
	bpf_map_delete_elem(&fluxvm_sock_fwd, &k);
	bpf_map_delete_elem(&fluxvm_sock_rev, &rk);
	bpf_seq_write(ctx->meta->seq, &one, 1);
	return 0;
}

char _license[] SEC("license") = "Dual BSD/GPL";
