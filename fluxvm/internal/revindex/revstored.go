package revindex

import (
	"fmt"
	"iter"
	"net/netip"

	"github.com/fluxvm/servicefabric/bpf"
)

// Entry is what the services component knows of a frontend's entry in fluxvm_svc4/6.
type Entry struct {
	Key       Key
	ServiceID uint32
	Revision  uint32
	// Flags are the entry's flags as written, while Live.
	Flags uint32
	// Live: this process wrote the entry (with Flags and Revision).
	Live bool
}

// RevStoredOf is bpf.SvcFlagRevStored if f is past the slots of the list
// of any of its backend endpoints eps, else 0.
func (x *Index) RevStoredOf(f Key, eps iter.Seq[netip.AddrPort]) uint32 {
	if x.PastSlots(f, eps) {
		return bpf.SvcFlagRevStored
	}
	return 0
}

// RefreshRevStored rewrites the live entry e, of a frontend listing
// backend endpoints eps, when its SvcFlagRevStored is not what the index
// says (after slots moved down), and returns the flags the entry has
// then (e.Flags when it was not rewritten). A frontend not live yet gets
// the flag with its first write.
func (x *Index) RefreshRevStored(e Entry, eps iter.Seq[netip.AddrPort]) (uint32, error) {
	if !e.Live {
		return e.Flags, nil
	}
	want := e.Flags&^bpf.SvcFlagRevStored | x.RevStoredOf(e.Key, eps)
	if want == e.Flags {
		return e.Flags, nil
	}
	if err := x.deps.Frontends.Put(e.Key, bpf.SvcValue{ServiceId: e.ServiceID, Flags: want, Revision: e.Revision}); err != nil {
		return e.Flags, fmt.Errorf("frontend %s: %w", e.Key, err)
	}
	return want, nil
}

// MarkRevStored sets SvcFlagRevStored in the frontend entry of e that is
// live now, if there is one, before a table of the frontend that names a
// backend past the slots goes in: its new flows store reverse-NAT halves
// from the first packet. An entry written by an earlier process (a
// restart) counts as live too. It returns the flags of e's entry as this
// process knows it (e.Flags unless e is Live and was rewritten).
func (x *Index) MarkRevStored(e Entry) (uint32, error) {
	if e.Live {
		if e.Flags&bpf.SvcFlagRevStored != 0 {
			return e.Flags, nil
		}
		v := bpf.SvcValue{ServiceId: e.ServiceID, Flags: e.Flags | bpf.SvcFlagRevStored, Revision: e.Revision}
		if err := x.deps.Frontends.Put(e.Key, v); err != nil {
			return e.Flags, err
		}
		return v.Flags, nil
	}
	v, ok, err := x.deps.Frontends.Lookup(e.Key)
	if err != nil || !ok || v.Flags&bpf.SvcFlagRevStored != 0 {
		return e.Flags, err
	}
	v.Flags |= bpf.SvcFlagRevStored
	return e.Flags, x.deps.Frontends.Put(e.Key, v)
}
