// Package ecmplab builds a group of FluxVM edges behind a real ECMP
// router, all in network namespaces it creates and removes:
//
//	cli1 ─┐                 ┌─ uplink  e1 (fluxvmd + BIRD + fluxvm-bird) uplink2 ─┐
//	cli2 ─┼─ rtr (BIRD 2) ──┼─ uplink  e2 (fluxvmd + BIRD + fluxvm-bird) uplink2 ─┼─ bbr (bridge in rtr) ─ be1, be2, be3
//	      │  eBGP to each   └─ uplink  e3 (fluxvmd + BIRD + fluxvm-bird) uplink2 ─┘
//
// The router runs BIRD 2 with an eBGP session to every edge and installs
// what it learns with its kernel protocol merging paths: one route per VIP
// with one nexthop per edge announcing it, hashed on L4
// (fib_multipath_hash_policy=1). Every edge runs the real fluxvmd with the
// same seeds and the same catalog (applied over REST, as Fabric would),
// its own SNAT address, and BIRD fed by the real fluxvm-bird adapter.
// Backends share an L2 segment (a bridge in the router's namespace) with
// every edge's uplink2, so routed DSR reaches them without tunnels.
// Their replies to SNAT addresses go through the router: every edge
// announces its SNAT address over BGP beside the VIPs (advertise_snat),
// holds the other edges' as SNAT peers, and a survivor takes over the
// address of an edge that is gone (Lab.TakeOver).
//
// With Config.Group the edges are one group (ha_group): the real
// fluxvm-replicator -group runs in the router's namespace and replicates
// every edge's flows to every other; an edge advertises once it joined
// (Lab.Regroup, docs/scale-out.md).
//
// The code is Linux only; on other systems the package is empty.
package ecmplab
