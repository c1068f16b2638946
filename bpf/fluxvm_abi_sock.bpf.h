/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Layouts of BPF schema 4 shared with Go, under the rules of
 * fluxvm_service_v6.bpf.h (fixed-width fields, explicit padding, a size
 * assert; enum members appended, never renumbered):
 * socket load balancing. Types only.
 */
#ifndef FLUXVM_ABI_SOCK_BPF_H
#define FLUXVM_ABI_SOCK_BPF_H

#include <linux/types.h>

/*
 * Socket load balancing (fluxvm_service_connect.bpf.c, lib/sock.h). A
 * socket that connects or sends to a VIP is addressed to a backend
 * instead; fluxvm_sock_fwd remembers which, per UDP socket and VIP, so
 * that its later sends keep the backend by the rules of a conntrack entry
 * (a TCP socket connects once), and
 * fluxvm_sock_rev maps the backend back to the VIP for what the socket
 * receives and for getpeername. Addresses as in fluxvm_backend: IPv4 in
 * addr[0], the rest zero. Both keyed by the socket's cookie (unique while
 * the kernel runs).
 */
struct fluxvm_sock_key {
	__u64 cookie;
	__be32 vip[4];
	__be16 vport;
	__u8 proto;
	__u8 family;  /* enum fluxvm_family of the VIP */
	__u32 pad;
};
_Static_assert(sizeof(struct fluxvm_sock_key) == 32, "fluxvm_sock_key size");

struct fluxvm_sock_value {
	__u32 backend_id;
	__u32 service_id;
};
_Static_assert(sizeof(struct fluxvm_sock_value) == 8, "fluxvm_sock_value size");

struct fluxvm_sock_rkey {
	__u64 cookie;
	__be32 addr[4];    /* the backend's */
	__be16 port;
	__u8 proto;
	__u8 family;
	__u32 pad;
};
_Static_assert(sizeof(struct fluxvm_sock_rkey) == 32, "fluxvm_sock_rkey size");

struct fluxvm_sock_rvalue {
	__be32 vip[4];
	__be16 vport;
	__u8 family;
	__u8 pad;
	__u32 service_id;
	__u32 backend_id;  /* the backend the socket was addressed to */
	__u32 pad2;
};
_Static_assert(sizeof(struct fluxvm_sock_rvalue) == 32, "fluxvm_sock_rvalue size");

#endif /* FLUXVM_ABI_SOCK_BPF_H */
