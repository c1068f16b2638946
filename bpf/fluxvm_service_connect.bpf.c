//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fluxvm_service_connect: socket load balancing for processes on the node
 * itself, on the same maps as the TC object (lib/sock.h says how). One
 * program per cgroup sock_addr hook, attached to one cgroup v2 (and so to
 * every process below it):
 *   - connect4/6: TCP, and UDP sockets that connect;
 *   - sendmsg4/6: UDP datagrams sent with an address;
 *   - recvmsg4/6: UDP datagrams received, shown from the VIP;
 *   - getpeername4/6: the peer shown as the VIP;
 *   - sock_release: a connected socket's association forgotten.
 * Every hook lets the call go on (returns 1): a socket hook that fails
 * leaves the address as it was (fail-open) and the packet hooks serve it.
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/sock.h"

SEC("cgroup/connect4")
int fluxvm_sock_connect4(struct bpf_sock_addr *ctx)
{
	fluxvm_sock_forward(ctx, 0);
	return 1;
}

SEC("cgroup/connect6")
int fluxvm_sock_connect6(struct bpf_sock_addr *ctx)
{
	fluxvm_sock_forward(ctx, 1);
	return 1;
}

SEC("cgroup/sendmsg4")
int fluxvm_sock_sendmsg4(struct bpf_sock_addr *ctx)
{
	fluxvm_sock_forward(ctx, 0);
	return 1;
}

SEC("cgroup/sendmsg6")
int fluxvm_sock_sendmsg6(struct bpf_sock_addr *ctx)
{
	fluxvm_sock_forward(ctx, 1);
	return 1;
}

SEC("cgroup/recvmsg4")
int fluxvm_sock_recvmsg4(struct bpf_sock_addr *ctx)
{
	fluxvm_sock_reverse(ctx, 0);
	return 1;
}

SEC("cgroup/recvmsg6")
int fluxvm_sock_recvmsg6(struct bpf_sock_addr *ctx)
{
	fluxvm_sock_reverse(ctx, 1);
	return 1;
}

SEC("cgroup/getpeername4")
int fluxvm_sock_getpeername4(struct bpf_sock_addr *ctx)
{
	fluxvm_sock_reverse(ctx, 0);
	return 1;
}

SEC("cgroup/getpeername6")
int fluxvm_sock_getpeername6(struct bpf_sock_addr *ctx)
{
	fluxvm_sock_reverse(ctx, 1);
	return 1;
}

SEC("cgroup/sock_release")
int fluxvm_sock_release(struct bpf_sock *ctx)
{
	fluxvm_sock_forget(ctx);
	return 1;
}

char _license[] SEC("license") = "Dual BSD/GPL";
