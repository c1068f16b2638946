//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * fluxvm_map_count: a map iterator that reports how many entries each BPF
 * map of the node holds, as the kernel counts them (bpf_map_sum_elem_count,
 * Linux 6.6: hash maps of every kind, LRU included, keep a per-CPU count
 * of their elements). One record of struct fluxvm_map_count per map, 16
 * bytes: the cost of a reading is one kernel walk over the map table, not
 * over any map's entries, so the map pressure controller can read it
 * every few seconds at tier L (a walk of 1M LRU entries from userspace
 * takes most of a second). LRU evictions are invisible to userspace;
 * the count is what is there.
 *
 * Its own object, loaded at first use: a kernel without the kfunc must
 * still load the datapath. It uses no map.
 */
#include <linux/types.h>
#include <bpf/bpf_helpers.h>

/* The kernel's types, as far as this reads them (CO-RE). */
struct seq_file;

struct bpf_map___fluxvm {
	__u32 id;
} __attribute__((preserve_access_index));

struct bpf_iter_meta___fluxvm {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

struct bpf_iter__bpf_map___fluxvm {
	struct bpf_iter_meta___fluxvm *meta;
	struct bpf_map___fluxvm *map;
} __attribute__((preserve_access_index));

extern __s64 bpf_map_sum_elem_count(const struct bpf_map___fluxvm *map) __ksym;

struct fluxvm_map_count {
	__u32 id;
	__u32 pad;
	__s64 entries;
};
_Static_assert(sizeof(struct fluxvm_map_count) == 16, "fluxvm_map_count size");

SEC("iter/bpf_map")
int fluxvm_map_count(struct bpf_iter__bpf_map___fluxvm *ctx)
{
	struct bpf_map___fluxvm *map = ctx->map;
	struct fluxvm_map_count out = {};

	if (!map)
		return 0;
	out.id = map->id;
	out.entries = bpf_map_sum_elem_count(map);
	bpf_seq_write(ctx->meta->seq, &out, sizeof(out));
	return 0;
}

char _license[] SEC("license") = "Dual BSD/GPL";
