/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Global per-CPU packet counters, indexed by enum fluxvm_counter. */
#ifndef FLUXVM_LIB_COUNTERS_H
#define FLUXVM_LIB_COUNTERS_H

#include "common.h"

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, enum fluxvm_counter); /* puts the enum in BTF for Go */
	__type(value, __u64);
	__uint(max_entries, FLUXVM_CNT_MAX);
} fluxvm_counters SEC(".maps");

/* Per-CPU slots need no atomics: a program runs to completion on one CPU. */
static __always_inline void fluxvm_count(enum fluxvm_counter c)
{
	enum fluxvm_counter key = c;
	__u64 *v = bpf_map_lookup_elem(&fluxvm_counters, &key);

	if (v)
		*v += 1;
}

#endif /* FLUXVM_LIB_COUNTERS_H */
