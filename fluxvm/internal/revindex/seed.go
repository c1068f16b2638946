package revindex

import (
	"iter"
	"slices"

	"github.com/fluxvm/servicefabric/bpf"
)

// Seed starts the model from the entries of the index pinned at Open,
// before the restore programs the catalog, so that the slots keep their
// order across a restart, a generation reload or a tier change. Each
// slot is Seeded until Add confirms it; entries of an unknown family are
// skipped, a frontend named twice in one entry is listed once. Without a
// pinned index (first start, or a pin of another layout or schema, which
// the facade ignores) call it with none: the restore then lists the
// frontends in catalog order.
func (x *Index) Seed(pinned iter.Seq2[bpf.Be2feKey, bpf.Be2feValue]) {
	x.Reset()
	for k, v := range pinned {
		if k.Family != bpf.FamilyIPv4 && k.Family != bpf.FamilyIPv6 {
			continue
		}
		var list []Slot
		for _, s := range v.Slots[:min(int(v.Count), bpf.Be2feSlots)] {
			f := Key{bpf.Addr(s.Vip, k.Family), bpf.Port(s.Vport), k.Proto}
			if slotIndex(list, f) < 0 {
				list = append(list, Slot{Key: f, ServiceID: s.ServiceId, BackendID: s.BackendId, Seeded: true})
			}
		}
		if len(list) > 0 {
			x.lists[k] = list
		}
	}
}

// Settle ends the restore: with a catalog (Config.Catalog) the
// seeded slots the restore did not confirm go (the later ones move down);
// then the map, whose entries now are have, is made to hold exactly the
// model (after a reload or a tier change it is new, and the restore wrote
// only the entries it changed). The services component then refreshes
// SvcFlagRevStored of the frontends that have it (RefreshRevStored).
func (x *Index) Settle(have map[bpf.Be2feKey]bpf.Be2feValue) error {
	for k, list := range x.lists {
		if !x.cfg.Catalog {
			break
		}
		if !slices.ContainsFunc(list, func(s Slot) bool { return s.Seeded }) {
			continue
		}
		list = slices.DeleteFunc(slices.Clone(list), func(s Slot) bool { return s.Seeded })
		if len(list) == 0 {
			delete(x.lists, k)
		} else {
			x.lists[k] = list
		}
	}
	for k, list := range x.lists {
		if v, ok := have[k]; !ok || v != ValueOf(list) {
			if err := x.write(k, list); err != nil {
				return err
			}
		}
	}
	for k := range have {
		if _, ok := x.lists[k]; !ok {
			if err := x.write(k, nil); err != nil {
				return err
			}
		}
	}
	return nil
}
