package services

import (
	"errors"
	"iter"
	"maps"
	"net/netip"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/revindex"
)

// The Programmer's calls into its reverse translation index
// (revindex.Index: its rules and model), for a frontend's backends.

// removeSlot takes fe out of the list of backend endpoint ep and clears
// SvcFlagRevStored of the frontends that no longer need it.
func (p *Programmer) removeSlot(fe *Frontend, ep netip.AddrPort) error {
	recheck, err := p.index.Remove(fe.key, ep)
	if err != nil {
		return err
	}
	var errs []error
	for _, k := range recheck {
		errs = append(errs, p.refreshRevStored(k))
	}
	return errors.Join(errs...)
}

// revStoredOf is SvcFlagRevStored if fe is past the slots of the list of
// any of its backends, else 0.
func (p *Programmer) revStoredOf(fe *Frontend) uint32 {
	return p.index.RevStoredOf(fe.key, maps.Keys(fe.backends))
}

// entry is what the reverse translation index knows of fe's entry.
func (fe *Frontend) entry() revindex.Entry {
	return revindex.Entry{Key: fe.key, ServiceID: fe.sid, Revision: fe.rev, Flags: fe.flags, Live: fe.live}
}

// refreshRevStored rewrites the live frontend entry of k when its
// SvcFlagRevStored is not what the index says.
func (p *Programmer) refreshRevStored(k Key) error {
	fe := p.frontends[k]
	if fe == nil {
		return nil
	}
	var err error
	fe.flags, err = p.index.RefreshRevStored(fe.entry(), maps.Keys(fe.backends))
	return err
}

// markRevStored sets SvcFlagRevStored in the frontend entry of fe that is
// live now, if there is one (revindex.Index.MarkRevStored).
func (p *Programmer) markRevStored(fe *Frontend) error {
	var err error
	fe.flags, err = p.index.MarkRevStored(fe.entry())
	return err
}

// Seed starts the index from the entries of the map pinned at Open,
// before the restore programs the catalog (revindex.Index.Seed).
func (p *Programmer) Seed(pinned iter.Seq2[bpf.Be2feKey, bpf.Be2feValue]) { p.index.Seed(pinned) }

// Settle ends the restore (revindex.Index.Settle) with have, the entries
// the map holds now; then the frontends that moved into the slots lose
// SvcFlagRevStored.
func (p *Programmer) Settle(have map[bpf.Be2feKey]bpf.Be2feValue) error {
	if err := p.index.Settle(have); err != nil {
		return err
	}
	var errs []error
	for _, fe := range p.frontends {
		if fe.flags&bpf.SvcFlagRevStored != 0 {
			errs = append(errs, p.refreshRevStored(fe.key))
		}
	}
	return errors.Join(errs...)
}
