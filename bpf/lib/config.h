/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Load-time node configuration: the node-level features, each a constant
 * the loader sets before the programs load (package bpf, features.go:
 * bpf.Options.Features, through cilium/ebpf CollectionSpec.Variables).
 *
 * Each feature is one byte in .rodata, declared `volatile const`:
 *   - const: it lands in .rodata, which cilium/ebpf loads into a map it
 *     freezes before the programs load. The verifier reads a frozen
 *     read-only map's bytes as known scalars, so a test of a feature that
 *     is off is a branch it never takes: the feature's code is not
 *     explored (no processed instructions, no stack), and the kernel
 *     rewrites the dead branch away (no run-time cost either).
 *   - volatile: clang must load the value rather than fold the default
 *     below into the code, or the loader's choice would be ignored.
 *
 * The compiled default is 1 (the feature in the program): an object
 * loaded without setting the variables behaves as before features were
 * chosen at load, each feature then decided per packet at run time by
 * the meta map (FLUXVM_META_F_HA, flow_sample_rate) or its own map
 * (fluxvm_edt). A feature set to 0 is absent whatever the maps say.
 *
 * Test a feature with FLUXVM_FEATURE_ON(name), at the entry of the
 * feature's functions, so that its callers need no test of their own:
 *
 *	if (!FLUXVM_FEATURE_ON(flows))
 *		return 0;
 *
 * or, on a hot inline path, with FLUXVM_FEATURE_MASK(name) folded into a
 * test that is there anyway.
 *
 * The features (the Go side names them in bpf.Feature*):
 *   ha     flow-state replication: records of north-south entries queued
 *          in fluxvm_haq, XDP leaving those packets to TC (lib/ha.h). The
 *          node's ha_epoch.
 *   flows  FluxScope flow records in fluxvm_sflows: sampled new flows,
 *          their packet counts, drop records (lib/flows.h). The node's
 *          flow_sample_rate not 0.
 *   edt    EDT pacing of services' replies (lib/edt.h). The node's
 *          edt_enabled.
 * Per-service state (a service's policy, its L7 part, host routing, DSR,
 * its pacing rate) stays in maps the control plane writes at run time:
 * see docs/operations.md, "Load-time features".
 */
#ifndef FLUXVM_LIB_CONFIG_H
#define FLUXVM_LIB_CONFIG_H

#include "common.h"

/* 1: every feature compiled in and decided at run time (the default). A
 * build may define it 0 to test the other end; the loader sets each
 * variable anyway. */
#ifndef FLUXVM_FEATURE_DEFAULT
#define FLUXVM_FEATURE_DEFAULT 1
#endif

/* The load-time variable of feature @name: fluxvm_feature_<name>. */
#define FLUXVM_FEATURE_VAR(name) fluxvm_feature_##name
#define FLUXVM_DECLARE_FEATURE(name) volatile const __u8 FLUXVM_FEATURE_VAR(name) = FLUXVM_FEATURE_DEFAULT

FLUXVM_DECLARE_FEATURE(ha);
FLUXVM_DECLARE_FEATURE(flows);
FLUXVM_DECLARE_FEATURE(edt);

/* Whether feature @name is in the loaded program (a constant to the
 * verifier). */
#define FLUXVM_FEATURE_ON(name) (FLUXVM_FEATURE_VAR(name) != 0)

/* All ones while feature @name is loaded, else 0: ANDed into the value
 * an existing test reads, the feature's guard without a branch of its
 * own, where a hot inline path is verified in many states and every
 * branch counts (lib/edt.h). */
#define FLUXVM_FEATURE_MASK(name) (-(__u64)FLUXVM_FEATURE_VAR(name))

#endif /* FLUXVM_LIB_CONFIG_H */
