/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Backend selection: the Maglev pick of a new flow over the service's
 * Ready backends (DESIGN.md §3).
 */
#ifndef FLUXVM_LIB_LB_SELECT_H
#define FLUXVM_LIB_LB_SELECT_H

#include "maps.h"
#include "counters.h"
#include "hash.h"
#include "svc.h"

/*
 * The select stage: the Maglev pick for a new flow of service @sid whose
 * tuple hashes to @hash, with its id in *@bid; or NULL, the drop counted
 * (no table or an empty slot; a slot naming a backend that is not Ready).
 */
static __always_inline struct fluxvm_backend *
fluxvm_select(__u32 sid, __u32 hash, __u32 *bid, struct fluxvm_svc_stats_value *st,
	      struct fluxvm_svc_stats_value *es)
{
	struct fluxvm_backend *be;

	*bid = fluxvm_maglev_pick(sid, hash);
	if (!*bid) {
		fluxvm_drop(FLUXVM_DROP_NO_BACKEND, st, es);
		return NULL;
	}
	be = fluxvm_backend_ready(*bid, sid);
	if (!be)
		fluxvm_drop(FLUXVM_DROP_BACKEND_INVALID, st, es);
	return be;
}

#endif /* FLUXVM_LIB_LB_SELECT_H */
