/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * East-west load balancing at the VM edge: frontend lookup, the service
 * guard, conntrack affinity, Maglev selection over Ready backends, DNAT on
 * the way to the backend and reverse NAT on the way back.
 *
 * Selection semantics (DESIGN.md §3):
 *   - a new flow takes the Maglev pick; the table holds Ready backends only;
 *   - an existing flow keeps its backend while it is Ready, or Draining with
 *     its drain deadline ahead; Unhealthy, removed or expired: fail over to
 *     a new Maglev pick, never a blackhole;
 *   - no eligible backend, or the service guard closed: drop with a reason.
 *
 * A packet to a VIP goes through the frontend stage (fluxvm_lb_frontend),
 * which finds its service and the mode of its path, one per mode:
 *   - fluxvm_lb_nat: the VM edge (east-west), DNAT;
 *   - fluxvm_lb_snat: the north-south edge, DNAT plus SNAT to the node's
 *     SNAT address (snat.h);
 *   - fluxvm_lb_dsr: either edge, routed DSR;
 * host routing is an option of the NAT modes. The entry object composes
 * the stage and the paths (which it inlines, which it calls). A service
 * says where it is served with FLUXVM_SVC_F_NORTH_SOUTH and
 * FLUXVM_SVC_F_NO_EAST_WEST; elsewhere its packets pass untouched.
 *
 * Fragments addressed to a VIP are dropped (FLUXVM_DROP_FRAGMENT): later
 * fragments carry no ports, so translating only the first would send the
 * rest, untranslated, to the VIP. The drop is the service's whose frontend
 * the first fragment's destination port names; a later fragment's, which
 * has no port, is that of the VIP's first frontend (its marker entry). TCP avoids fragmentation with PMTU
 * discovery; UDP services must keep datagrams under the path MTU.
 *
 * One header per stage, in the order a packet meets them; each includes
 * what it uses and compiles on its own after the context layer (common.h;
 * bpf/headers_test.go checks it):
 *
 *   lb_types.h     types the stages share (modes, verdicts, flags)
 *   lb_frontend.h  frontend lookup, fragments (fluxvm_lb_frontend)
 *   lb_ct.h        the conntrack stage and its shared opening
 *   lb_select.h    backend selection (Maglev)
 *   lb_fwd_nat.h   forward mode: east-west NAT (fluxvm_lb_nat)
 *   lb_fwd_snat.h  forward mode: north-south SNAT (fluxvm_lb_snat)
 *   lb_fwd_dsr.h   forward mode: routed DSR (fluxvm_lb_dsr)
 *   lb_send_tc.h   sending in TC: deliver, DSR forwarding, host routing
 *   lb_send_xdp.h  sending in XDP: route, next-hop cache, XDP_TX/redirect
 *   lb_reply.h     the reply path (TC): fluxvm_lb_reply_ew, fluxvm_lb_reply
 *
 * This header only gathers them for the entry objects.
 */
#ifndef FLUXVM_LIB_LB_H
#define FLUXVM_LIB_LB_H

/*
 * The forward paths, one per mode, each in the same stages:
 *
 *   conntrack (fluxvm_ct_stage) -> select (fluxvm_select) -> learn
 *   -> deliver (fluxvm_nat_deliver for the NAT modes)
 *
 * A packet whose flow keeps its backend skips selection and learning. The
 * learn stage writes every piece of state the flow's replies need before
 * the deliver stage, whose helpers invalidate packet pointers; a piece
 * that cannot be written takes the others with it. From the first write
 * to the packet on, a failure drops: nothing half-translated leaves.
 * A sampled flow's record (lib/flows.h) has its id reserved before the
 * learn writes, which keep it, and is written only after all of them
 * succeeded; a packet counts into it after the deliver stage, only when
 * the path sends it (fluxvm_flow_sent): one dropped, or one XDP leaves to
 * TC, is not counted forwarded here.
 *
 * They take the frontend's service id and flags as scalars: the frontend
 * entry may be replaced while the packet is in flight.
 */

#include "lb_types.h"
#include "lb_frontend.h"
#include "lb_ct.h"
#include "lb_select.h"
#include "lb_fwd_nat.h"
#include "lb_fwd_snat.h"
#include "lb_fwd_dsr.h"
#include "lb_send_tc.h"
#include "lb_send_xdp.h"
#include "lb_reply.h"

#endif /* FLUXVM_LIB_LB_H */
