package hasync

import (
	"context"
	"errors"
	"fmt"

	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
	"github.com/fluxvm/servicefabric/ha"
)

// floor is the oldest epoch this edge takes data of src from: the newest
// it accepted from that source, and in a pair its own lease when newer
// (the peer's data is then stale: this edge took over). In a group the
// edges' leases are their own, so only the source's counts. s.mu held.
func (s *Sync) floor(src source) ha.Epoch {
	if s.cfg.Group {
		return s.cursors[src].Epoch
	}
	return max(s.cursors[src].Epoch, s.epoch, s.pending)
}

// sourceOf is whose data an import of service is, named node by the data:
// in a pair the one peer (whatever it names), in a group the edge it
// names, which must be another one (ErrSource).
func (s *Sync) sourceOf(service, node string) (source, error) {
	if !s.cfg.Group {
		return source{service: service}, nil
	}
	switch node {
	case "":
		return source{}, fmt.Errorf("data that names no source edge, in a group: %w", ErrSource)
	case s.cfg.Node:
		return source{}, fmt.Errorf("data of this edge itself (%s): %w", node, ErrSource)
	}
	return source{service: service, node: node}, nil
}

// beginImport takes targetMu for an import and makes ctx cancellable by
// a lease that advances (UpdateLease): the edge is then the active, and
// what its old active sends is stale. end releases both.
func (s *Sync) beginImport(ctx context.Context) (context.Context, func()) {
	s.targetMu.Lock()
	ctx, cancel := context.WithCancel(ctx)
	s.mu.Lock()
	s.importCancel = cancel
	s.mu.Unlock()
	return ctx, func() {
		s.mu.Lock()
		s.importCancel = nil
		s.mu.Unlock()
		cancel()
		s.targetMu.Unlock()
	}
}

// setCursor stores src's cursor after an import, unless the service
// went away meanwhile (its cursor must not outlive it: a service applied
// again under the name starts from a snapshot) or, in a pair, the edge's
// lease advanced past the data's epoch meanwhile.
func (s *Sync) setCursor(src source, c ha.Cursor) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.services[src.service] {
		return fmt.Errorf("the service was deleted meanwhile: %w", errs.ErrNotFound)
	}
	if e := max(s.epoch, s.pending); !s.cfg.Group && c.Epoch < e {
		return fmt.Errorf("data of epoch %d, the edge's lease advanced to %d meanwhile: %w", c.Epoch, e, ha.ErrStaleEpoch)
	}
	s.cursors[src] = c
	return nil
}

// ImportDelta applies delta, a batch run of service's journal on the
// peer (in a group: on the edge delta.Node names), with apply, after
// checking that it continues this edge's cursor of it: an error wrapping
// ha.ErrStaleEpoch (data of an epoch older than the newest this edge
// accepted from the source, or in a pair its own lease),
// ha.ErrResetRequired, ha.ErrGap or ErrSource applies nothing. Imports run one at a time (targetMu, held
// while apply runs); ctx is cancelled by a lease that advances meanwhile.
// A ctx that ended before the delta is applied applies nothing and moves
// no cursor; an apply that fails keeps the cursor where it was. Its
// errors do not name the service.
func (s *Sync) ImportDelta(ctx context.Context, service string, delta ha.Delta,
	apply func(context.Context, ha.Delta) (ha.ImportResult, error)) (DeltaResult, error) {
	ctx, end := s.beginImport(ctx)
	defer end()
	// Cancelled while it waited for another import: nothing applied.
	if err := ctx.Err(); err != nil {
		return DeltaResult{}, err
	}
	src, err := s.sourceOf(service, delta.Node)
	if err != nil {
		return DeltaResult{}, err
	}
	s.mu.Lock()
	c := s.cursors[src]
	check := c
	check.Epoch = s.floor(src)
	s.mu.Unlock()
	if err := check.Check(delta); err != nil {
		return DeltaResult{Cursor: c}, err
	}
	res, err := apply(ctx, delta)
	if err != nil {
		return DeltaResult{Cursor: c, Applied: res}, err
	}
	c.Advance(delta)
	return DeltaResult{Cursor: c, Applied: res}, s.setCursor(src, c)
}

// ErrCursorStays wraps the error of an ImportSnapshot that applied the
// snapshot but could not move the cursor to its checkpoint.
var ErrCursorStays = errors.New("applied, but the cursor stays")

// ImportSnapshot applies a snapshot of service's flows with imp, which
// calls accept with the snapshot's header before it applies any flow:
// accept refuses (ha.ErrStaleEpoch) a snapshot of an epoch older than
// the newest this edge accepted from its source (in a pair: or its own
// lease), and one of a source without a lease; in a group, one that
// names no other edge of it (ErrSource). Once the whole snapshot is applied, the cursor moves
// to its checkpoint; when it cannot, the error wraps ErrCursorStays.
// Imports run one at a time, as ImportDelta's.
func (s *Sync) ImportSnapshot(ctx context.Context, service string,
	imp func(ctx context.Context, accept func(ha.Header) error) (ha.ImportResult, error)) (ha.ImportResult, error) {
	ctx, end := s.beginImport(ctx)
	defer end()
	var src source
	res, err := imp(ctx, func(hd ha.Header) error {
		var err error
		if src, err = s.sourceOf(service, hd.Node); err != nil {
			return err
		}
		s.mu.Lock()
		floor := s.floor(src)
		s.mu.Unlock()
		if hd.Epoch == 0 {
			return fmt.Errorf("snapshot of a source without a lease (epoch 0: it runs without ha_epoch), this edge holds a lease and takes epoch %d or newer: %w", floor, ha.ErrStaleEpoch)
		}
		if hd.Epoch < floor {
			return fmt.Errorf("snapshot of epoch %d, this edge accepted %d: %w", hd.Epoch, floor, ha.ErrStaleEpoch)
		}
		return nil
	})
	if err != nil || res.Header.Journal == "" {
		return res, err
	}
	s.mu.Lock()
	c := s.cursors[src]
	err = c.Reset(res.Header.Journal, res.Header.Seq, res.Header.Epoch)
	s.mu.Unlock()
	if err == nil {
		err = s.setCursor(src, c)
	}
	if err != nil {
		return res, fmt.Errorf("%w: %w", ErrCursorStays, err)
	}
	return res, nil
}

// UpdateLease records what the control plane says about leases (see
// Lease) and keeps it in Config.LeasePath. Nothing changes when the
// update is refused: a zero Lease (intent.ErrInvalid), an epoch older
// than the edge's (ha.ErrStaleEpoch), a ctx that ended before the update
// takes effect, or a lease file that cannot be written. A lease that
// advances cancels the import under way and forgets the cursors; a
// superseding epoch fences the journals; every journal is renewed under
// the new epoch (one that cannot be is dropped: its standby resyncs).
// Past the wait for another update, ctx is not looked at again. changed
// says whether the lease changed.
func (s *Sync) UpdateLease(ctx context.Context, l Lease) (changed bool, err error) {
	if l.Epoch == 0 && l.SupersededBy == 0 {
		return false, errLeaseZero
	}
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	// Cancelled while it waited for another update: nothing changed.
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	prevEpoch, prevFenced := s.epoch, s.fencedBy
	if l.Epoch != 0 && l.Epoch < prevEpoch {
		s.mu.Unlock()
		return false, fmt.Errorf("epoch %d, this edge holds %d: %w", l.Epoch, prevEpoch, ha.ErrStaleEpoch)
	}
	epoch, fenced := prevEpoch, prevFenced
	if l.Epoch != 0 {
		epoch = l.Epoch
		if epoch > fenced {
			fenced = 0
		}
	}
	if l.SupersededBy > epoch {
		fenced = max(fenced, l.SupersededBy)
	}
	// In a pair, a lease that advances makes this edge the active: what
	// its old active sends is stale. In a group the edge's lease is its
	// own, and the other edges' data goes on.
	advanced := epoch > prevEpoch
	if advanced && !s.cfg.Group {
		s.pending = epoch
		if s.importCancel != nil {
			s.importCancel()
		}
	}
	s.mu.Unlock()
	if epoch == prevEpoch && fenced == prevFenced {
		return false, nil
	}
	if err := s.saveLease(leaseFile{Epoch: epoch, SupersededBy: fenced}); err != nil {
		s.mu.Lock()
		s.pending = 0
		s.mu.Unlock()
		return false, err
	}
	s.mu.Lock()
	s.epoch, s.fencedBy, s.pending = epoch, fenced, 0
	if advanced && !s.cfg.Group {
		clear(s.cursors)
	}
	for name, j := range s.journals {
		// Fence first: Renew past the fencing epoch then starts a new
		// incarnation, as a takeover by another edge requires.
		if fenced != 0 {
			j.Fence(fenced)
		}
		if err := j.Renew(epoch); err != nil {
			s.log.Warn("fluxvm: HA lease: journal renew failed; it is dropped, its standby resyncs", "service", name, "err", err)
			delete(s.journals, name)
		}
	}
	s.mu.Unlock()
	s.log.Info("fluxvm: HA lease updated", "epoch", epoch, "previous_epoch", prevEpoch, "superseded_by", fenced)
	return true, nil
}
