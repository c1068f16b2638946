package fluxvm

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"syscall"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
)

// The reverse translation index, fluxvm_be2fe (layout and datapath use in
// bpf/fluxvm_abi_ct.bpf.h; docs/architecture.md, "Reverse translation
// index"): for every backend endpoint (address, port, protocol), the
// frontends that list it, in a stable order. A reply backend:port ->
// client:cport of an east-west flow finds its flow through the slot of
// the flow's frontend, so:
//
//   - east-west NAT frontends list their backends (indexed); north-south
//     only and DSR ones take no new slot, but keep the ones they have;
//
//   - a frontend's slot is written in prepare, before any table of the
//     frontend can name the backend (prepareFrontend);
//   - a frontend keeps its slot index as long as it lists the backend; a
//     new one is appended; one that stops listing it is taken out only
//     after no table of it names the backend (finishFrontend's removal
//     loop, removeFrontend), and the later ones move down. Moving down is
//     safe; moving up past the map's Be2feSlots is not, and never happens;
//   - only the first bpf.Be2feSlots slots are in the map (Count); a longer
//     list is marked Be2feFlagOverflow, and a frontend past the slots of
//     any of its backends has SvcFlagRevStored (revStoredOf), set in its
//     live frontend entry before a table naming such a backend goes in
//     (readyFrontend), and cleared once it moved into the slots
//     everywhere (refreshRevStored);
//   - Draining and Unhealthy backends stay listed: only leaving the intent
//     (or the frontend going) takes a slot out.
//
// The model (d.be2fe) and the map agree after every change: a write that
// fails leaves the model as it was. At Open the order is seeded from the
// map pinned now (seedBe2fe) and restore appends what the catalog adds;
// slots the catalog no longer has go afterwards (settleBe2fe).

// be2feSlot is one frontend listing a backend endpoint.
type be2feSlot struct {
	fe  feKey
	sid uint32 // the frontend's service id
	bid uint32 // the backend's id in that frontend
	// seeded: read from the pinned map at Open and not yet confirmed by
	// the restored catalog (settleBe2fe drops it if it never is).
	seeded bool
}

// be2feKeyOf is the index key of backend endpoint ep of frontend fe.
func be2feKeyOf(fe *frontend, ep netip.AddrPort) bpf.Be2feKey {
	return bpf.MakeBe2feKey(ep, fe.key.proto)
}

// be2feValue is the map value of a list: its first Be2feSlots slots.
func be2feValue(list []be2feSlot) bpf.Be2feValue {
	var v bpf.Be2feValue
	n := min(len(list), bpf.Be2feSlots)
	v.Count = uint8(n)
	if len(list) > bpf.Be2feSlots {
		v.Flags |= bpf.Be2feFlagOverflow
	}
	for i, s := range list[:n] {
		v.Slots[i] = bpf.Be2feSlot{Vip: bpf.AddrWords(s.fe.vip), Vport: bpf.Port(s.fe.port), ServiceId: s.sid, BackendId: s.bid}
	}
	return v
}

func slotIndex(list []be2feSlot, k feKey) int {
	return slices.IndexFunc(list, func(s be2feSlot) bool { return s.fe == k })
}

// setBe2fe makes the list of k new, writing the map first when its value
// changes; on a failed write the model keeps the old list.
func (d *Dataplane) setBe2fe(k bpf.Be2feKey, old, new []be2feSlot) error {
	if be2feValue(old) != be2feValue(new) {
		if err := d.writeBe2fe(k, new); err != nil {
			return err
		}
	}
	if len(new) == 0 {
		delete(d.be2fe, k)
	} else {
		d.be2fe[k] = new
	}
	return nil
}

// writeBe2fe writes the map entry of list (none when it is empty).
func (d *Dataplane) writeBe2fe(k bpf.Be2feKey, list []be2feSlot) error {
	m := d.dp.Maps().FluxvmBe2fe
	if len(list) == 0 {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("reverse translation index: %w", err)
		}
		return nil
	}
	if err := m.Put(k, be2feValue(list)); err != nil {
		if errors.Is(err, syscall.E2BIG) {
			return fmt.Errorf("%w: reverse translation index fluxvm_be2fe is full (%d backend endpoints in tier %s)",
				ErrLimit, m.MaxEntries(), d.dp.Status().Tier)
		}
		return fmt.Errorf("reverse translation index: %w", err)
	}
	return nil
}

// indexed reports whether the frontends of svc are listed for their
// backends: those whose east-west replies are translated back on the VM
// edges. A north-south-only frontend is never served there (its replies
// meet the SNAT mapping), and DSR translates nothing, so neither takes a
// slot another frontend could use.
func indexed(svc *Service) bool {
	return svcFlags(svc)&(bpf.SvcFlagNoEastWest|bpf.SvcFlagDSR) == 0
}

// addSlot lists fe for backend endpoint ep with backend id bid: fe keeps
// its slot if it has one (a seeded one is confirmed), else it is appended
// if listNew. A frontend that needs no slot (indexed) keeps the one it
// has: flows it learned before a change of mode or exposure may still
// need it.
func (d *Dataplane) addSlot(fe *frontend, ep netip.AddrPort, bid uint32, listNew bool) error {
	k := be2feKeyOf(fe, ep)
	old := d.be2fe[k]
	s := be2feSlot{fe: fe.key, sid: fe.sid, bid: bid}
	i := slotIndex(old, fe.key)
	if i >= 0 && old[i] == s || i < 0 && !listNew {
		return nil
	}
	var list []be2feSlot
	if i >= 0 {
		list = slices.Clone(old)
		list[i] = s
	} else {
		list = append(slices.Clip(old), s)
	}
	if err := d.setBe2fe(k, old, list); err != nil {
		return fmt.Errorf("backend %s: %w", ep, err)
	}
	return nil
}

// removeSlot takes fe out of the list of backend endpoint ep (the later
// slots move down) and clears SvcFlagRevStored of the frontends that no
// longer need it.
func (d *Dataplane) removeSlot(fe *frontend, ep netip.AddrPort) error {
	k := be2feKeyOf(fe, ep)
	old := d.be2fe[k]
	i := slotIndex(old, fe.key)
	if i < 0 {
		return nil
	}
	if err := d.setBe2fe(k, old, slices.Delete(slices.Clone(old), i, i+1)); err != nil {
		return fmt.Errorf("backend %s: %w", ep, err)
	}
	// The frontend that moved into the last slot, and fe itself, may
	// need the flag no more.
	var errs []error
	if i < bpf.Be2feSlots && len(old) > bpf.Be2feSlots {
		errs = append(errs, d.refreshRevStored(old[bpf.Be2feSlots].fe))
	}
	errs = append(errs, d.refreshRevStored(fe.key))
	return errors.Join(errs...)
}

// revStoredOf is SvcFlagRevStored if fe is past the slots of the list of
// any of its backends, else 0.
func (d *Dataplane) revStoredOf(fe *frontend) uint32 {
	for ep := range fe.backends {
		if slotIndex(d.be2fe[be2feKeyOf(fe, ep)], fe.key) >= bpf.Be2feSlots {
			return bpf.SvcFlagRevStored
		}
	}
	return 0
}

// refreshRevStored rewrites the live frontend entry of k when its
// SvcFlagRevStored is not what the index says (after slots moved down).
// A frontend not live yet gets the flag with its first write.
func (d *Dataplane) refreshRevStored(k feKey) error {
	fe := d.frontends[k]
	if fe == nil || !fe.live {
		return nil
	}
	want := fe.flags&^bpf.SvcFlagRevStored | d.revStoredOf(fe)
	if want == fe.flags {
		return nil
	}
	if err := d.putFrontend(fe.key, bpf.SvcValue{ServiceId: fe.sid, Flags: want, Revision: fe.rev}); err != nil {
		return fmt.Errorf("frontend %s: %w", k, err)
	}
	fe.flags = want
	return nil
}

// markRevStored sets SvcFlagRevStored in the frontend entry of fe that is
// live now, if there is one, before a table of fe that names a backend
// past the slots goes in: its new flows store reverse-NAT halves from the
// first packet. An entry written by an earlier process (a restart) counts
// as live too.
func (d *Dataplane) markRevStored(fe *frontend) error {
	if fe.live {
		if fe.flags&bpf.SvcFlagRevStored != 0 {
			return nil
		}
		v := bpf.SvcValue{ServiceId: fe.sid, Flags: fe.flags | bpf.SvcFlagRevStored, Revision: fe.rev}
		if err := d.putFrontend(fe.key, v); err != nil {
			return err
		}
		fe.flags = v.Flags
		return nil
	}
	v, ok, err := d.lookupFrontend(fe.key)
	if err != nil || !ok || v.Flags&bpf.SvcFlagRevStored != 0 {
		return err
	}
	v.Flags |= bpf.SvcFlagRevStored
	return d.putFrontend(fe.key, v)
}

// seedBe2fe starts the model from the index pinned now, before restore
// programs the catalog, so that the slots keep their order across a
// restart, a generation reload or a tier change (after the last two the
// pin is still the previous map until Activate). A pin of another layout,
// or of another schema, is ignored: restore then lists the frontends in
// catalog order.
func (d *Dataplane) seedBe2fe() error {
	d.be2fe = map[bpf.Be2feKey][]be2feSlot{}
	st := d.dp.Status()
	if st.Created || st.SchemaRebuilt {
		return nil
	}
	pm, err := d.dp.PinnedMap(d.dp.Maps().FluxvmBe2fe)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil
	case errors.Is(err, bpf.ErrObjectMismatch):
		d.log.Warn("fluxvm: the pinned reverse translation index has another layout; its order is not carried over", "err", err)
		return nil
	case err != nil:
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	defer pm.Close()
	var (
		k bpf.Be2feKey
		v bpf.Be2feValue
	)
	it := pm.Iterate()
	for it.Next(&k, &v) {
		if k.Family != bpf.FamilyIPv4 && k.Family != bpf.FamilyIPv6 {
			continue
		}
		var list []be2feSlot
		for _, s := range v.Slots[:min(int(v.Count), bpf.Be2feSlots)] {
			fk := feKey{bpf.Addr(s.Vip, k.Family), bpf.Port(s.Vport), k.Proto}
			if slotIndex(list, fk) < 0 {
				list = append(list, be2feSlot{fe: fk, sid: s.ServiceId, bid: s.BackendId, seeded: true})
			}
		}
		if len(list) > 0 {
			d.be2fe[k] = list
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("fluxvm: open: read the pinned reverse translation index: %w", err)
	}
	return nil
}

// settleBe2fe ends the restore: the seeded slots the catalog did not
// confirm go (the later ones move down), the map is made to hold exactly
// the model (after a reload or tier change it is new, and restore wrote
// only the entries it changed), and then the frontends that moved into
// the slots lose SvcFlagRevStored.
//
// Without a catalog nothing was restored, and the frontends the adopted
// maps still serve are unknown here: their slots stay until the embedder
// applies those frontends again (which confirms each slot in place) or
// Cleanup, so that their flows' replies keep being translated meanwhile.
func (d *Dataplane) settleBe2fe() error {
	for k, list := range d.be2fe {
		if d.opts.CatalogPath == "" {
			break
		}
		if !slices.ContainsFunc(list, func(s be2feSlot) bool { return s.seeded }) {
			continue
		}
		list = slices.DeleteFunc(slices.Clone(list), func(s be2feSlot) bool { return s.seeded })
		if len(list) == 0 {
			delete(d.be2fe, k)
		} else {
			d.be2fe[k] = list
		}
	}
	m := d.dp.Maps().FluxvmBe2fe
	var (
		k    bpf.Be2feKey
		v    bpf.Be2feValue
		have = map[bpf.Be2feKey]bpf.Be2feValue{}
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		have[k] = v
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("reverse translation index: %w", err)
	}
	for k, list := range d.be2fe {
		if v, ok := have[k]; !ok || v != be2feValue(list) {
			if err := d.writeBe2fe(k, list); err != nil {
				return err
			}
		}
	}
	for k := range have {
		if _, ok := d.be2fe[k]; !ok {
			if err := d.writeBe2fe(k, nil); err != nil {
				return err
			}
		}
	}
	var errs []error
	for _, fe := range d.frontends {
		if fe.flags&bpf.SvcFlagRevStored != 0 {
			errs = append(errs, d.refreshRevStored(fe.key))
		}
	}
	return errors.Join(errs...)
}
