package fluxvm

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
)

// The reverse translation index, fluxvm_be2fe: which frontends list each
// backend endpoint, in a stable slot order, and which frontends are past
// the map's slots (SvcFlagRevStored). Its rules and its model are the
// component's (fluxvm/internal/services, reverse.go; docs/architecture.md,
// "Reverse translation index"); these are the facade's thin calls into
// it, under d.mu, and what they need of the facade: its maps, the
// frontends' entries, the pinned index at Open.

// index names frontend k for the reverse translation index.
func (k feKey) index() services.Frontend {
	return services.Frontend{VIP: k.vip, Port: k.port, Proto: k.proto}
}

// entry is what the reverse translation index knows of fe's entry.
func (fe *frontend) entry() services.Entry {
	return services.Entry{Frontend: fe.key.index(), ServiceID: fe.sid, Revision: fe.rev, Flags: fe.flags, Live: fe.live}
}

// frontendEntries writes the frontend entries for the index.
type frontendEntries struct{ d *Dataplane }

func (f frontendEntries) Lookup(k services.Frontend) (bpf.SvcValue, bool, error) {
	return f.d.lookupFrontend(feKey{k.VIP, k.Port, k.Proto})
}

func (f frontendEntries) Put(k services.Frontend, v bpf.SvcValue) error {
	return f.d.putFrontend(feKey{k.VIP, k.Port, k.Proto}, v)
}

// newReverseIndex makes the (empty) index of an opening dataplane.
func (d *Dataplane) newReverseIndex() error {
	x, err := services.NewReverseIndex(services.ReverseConfig{Catalog: d.opts.CatalogPath != ""}, services.ReverseDeps{
		Map:       func() services.Map { return d.dp.Maps().FluxvmBe2fe },
		Tier:      func() bpf.Tier { return d.dp.Status().Tier },
		Frontends: frontendEntries{d},
	})
	if err != nil {
		return fmt.Errorf("fluxvm: open: %w", err)
	}
	d.be2fe = x
	return nil
}

// indexed reports whether the frontends of svc are listed for their
// backends (services.Indexed).
func indexed(svc *Service) bool { return services.Indexed(svcFlags(svc)) }

// addSlot lists fe for backend endpoint ep with backend id bid
// (ReverseIndex.Add).
func (d *Dataplane) addSlot(fe *frontend, ep netip.AddrPort, bid uint32, listNew bool) error {
	return d.be2fe.Add(fe.key.index(), fe.sid, ep, bid, listNew)
}

// removeSlot takes fe out of the list of backend endpoint ep and clears
// SvcFlagRevStored of the frontends that no longer need it.
func (d *Dataplane) removeSlot(fe *frontend, ep netip.AddrPort) error {
	recheck, err := d.be2fe.Remove(fe.key.index(), ep)
	if err != nil {
		return err
	}
	var errs []error
	for _, k := range recheck {
		errs = append(errs, d.refreshRevStored(feKey{k.VIP, k.Port, k.Proto}))
	}
	return errors.Join(errs...)
}

// revStoredOf is SvcFlagRevStored if fe is past the slots of the list of
// any of its backends, else 0.
func (d *Dataplane) revStoredOf(fe *frontend) uint32 {
	return d.be2fe.RevStoredOf(fe.key.index(), maps.Keys(fe.backends))
}

// refreshRevStored rewrites the live frontend entry of k when its
// SvcFlagRevStored is not what the index says.
func (d *Dataplane) refreshRevStored(k feKey) error {
	fe := d.frontends[k]
	if fe == nil {
		return nil
	}
	var err error
	fe.flags, err = d.be2fe.RefreshRevStored(fe.entry(), maps.Keys(fe.backends))
	return err
}

// markRevStored sets SvcFlagRevStored in the frontend entry of fe that is
// live now, if there is one (ReverseIndex.MarkRevStored).
func (d *Dataplane) markRevStored(fe *frontend) error {
	var err error
	fe.flags, err = d.be2fe.MarkRevStored(fe.entry())
	return err
}

// seedBe2fe starts the index from the one pinned now, before restore
// programs the catalog (ReverseIndex.Seed): after a generation reload or
// a tier change the pin is still the previous map until Activate. A pin
// of another layout, or of another schema, is ignored.
func (d *Dataplane) seedBe2fe() error {
	if err := d.newReverseIndex(); err != nil {
		return err
	}
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
	pinned, err := readBe2fe(pm)
	if err != nil {
		return fmt.Errorf("fluxvm: open: read the pinned reverse translation index: %w", err)
	}
	d.be2fe.Seed(maps.All(pinned))
	return nil
}

// settleBe2fe ends the restore (ReverseIndex.Settle), and then the
// frontends that moved into the slots lose SvcFlagRevStored.
func (d *Dataplane) settleBe2fe() error {
	have, err := readBe2fe(d.dp.Maps().FluxvmBe2fe)
	if err != nil {
		return fmt.Errorf("reverse translation index: %w", err)
	}
	if err := d.be2fe.Settle(have); err != nil {
		return err
	}
	var errs []error
	for _, fe := range d.frontends {
		if fe.flags&bpf.SvcFlagRevStored != 0 {
			errs = append(errs, d.refreshRevStored(fe.key))
		}
	}
	return errors.Join(errs...)
}

// readBe2fe reads every entry of an index map.
func readBe2fe(m *ebpf.Map) (map[bpf.Be2feKey]bpf.Be2feValue, error) {
	var (
		k   bpf.Be2feKey
		v   bpf.Be2feValue
		out = map[bpf.Be2feKey]bpf.Be2feValue{}
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		out[k] = v
	}
	return out, it.Err()
}
