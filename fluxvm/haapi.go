package fluxvm

import (
	"context"
	"fmt"

	"github.com/fluxvm/servicefabric/ha"
)

// HA is the flow-state replication of a Dataplane (HAOptions.Epoch,
// ha_epoch): the journals its standbys follow (FlowDelta, AckFlowDelta),
// the deltas it applies as a standby (ImportFlowDelta), its lease
// (UpdateLease) and their status. Dataplane.HA returns it; it holds
// nothing of its own, so it may be kept or fetched again at will, and
// copied.
//
// Snapshots (Dataplane.ExportFlows and ImportFlows) stay on Dataplane:
// they need the north-south edge alone, not replication.
//
// With replication off, every call but Status fails with a
// ValidationError of kind ErrPrerequisite naming ha_epoch. The zero HA,
// and the HA of a nil Dataplane or of one Open did not make, is usable:
// every call fails with an error matching ErrClosed (Status returns the
// zero HAStatus), as do the calls of a closed Dataplane's.
type HA struct {
	d *Dataplane
}

// HA returns the dataplane's flow-state replication (see HA). It is
// valid on any Dataplane, nil included.
func (d *Dataplane) HA() HA { return HA{d: d} }

// FlowDelta returns the batches of service's journal after the cursor
// (req.Journal, req.Seq) a standby holds, at most req.MaxOps ops but at
// least one batch (ha.Journal.Since): or ResetRequired when the journal
// cannot continue it (another incarnation, none yet, or history acked or
// dropped since), and the standby loads a snapshot (ExportFlows). A
// superseded edge serves nothing (ha.ErrFenced). A ctx that ended before
// the read fails with an error wrapping ctx's, and no journal is made for
// the service.
func (r HA) FlowDelta(ctx context.Context, service string, req FlowDeltaRequest) (ha.Delta, error) {
	j, err := r.journal(ctx, "flow delta", service)
	if err != nil {
		return ha.Delta{}, err
	}
	delta, err := j.Since(req.Seq, req.Journal, req.MaxOps)
	if err != nil {
		return ha.Delta{}, fmt.Errorf("fluxvm: flow delta of %s: %w", service, err)
	}
	delta.Node = r.d.opts.NodeName // whose journal: what a group edge keeps its cursor under
	return delta, nil
}

// journal is service's journal for op, a call of the source side.
func (r HA) journal(ctx context.Context, op, service string) (*ha.Journal, error) {
	if err := r.d.begin(ctx, op); err != nil {
		return nil, err
	}
	return r.d.sourceJournal(ctx, op+" of", service)
}

// AckFlowDelta trims service's journal up to seq: the control plane
// passes the minimum cursor its standbys replicated. An ack past the last
// sealed batch wraps ha.ErrCursorAhead. A ctx that ended before the trim
// fails with an error wrapping ctx's and trims nothing.
func (r HA) AckFlowDelta(ctx context.Context, service string, seq uint64) (ha.JournalStats, error) {
	j, err := r.journal(ctx, "ack flow delta", service)
	if err != nil {
		return ha.JournalStats{}, err
	}
	if err := ctxErr(ctx, "ack flow delta of "+service); err != nil {
		return j.Stats(), err
	}
	if err := j.Ack(seq); err != nil {
		return j.Stats(), fmt.Errorf("fluxvm: ack flow delta of %s: %w", service, err)
	}
	return j.Stats(), nil
}

// ImportFlowDelta applies a delta of service's journal on its peer (what
// FlowDelta there returned) to this edge, after checking that it
// continues this edge's cursor: an error wrapping ha.ErrStaleEpoch (data
// of an epoch older than the newest this edge accepted or its own
// lease), ha.ErrResetRequired (load a snapshot: ImportFlows) or ha.ErrGap
// changes nothing. Deltas are applied one at a time. A ctx that ended
// before the delta is applied (on entry, or while the call waited for
// another import) applies nothing, moves no cursor and fails with an
// error wrapping ctx's; one that ends while the batches are applied stops
// the apply at its next op (ha.Apply), keeping the cursor where it was.
func (r HA) ImportFlowDelta(ctx context.Context, service string, delta ha.Delta) (HADeltaResult, error) {
	d := r.d
	if err := d.begin(ctx, "import flow delta"); err != nil {
		return HADeltaResult{}, err
	}
	h, err := d.haOn("import flow delta of " + service)
	if err != nil {
		return HADeltaResult{}, err
	}
	ctx, done, err := d.haBegin(ctx, "import flow delta of "+service)
	if err != nil {
		return HADeltaResult{}, err
	}
	// Writes into the flow maps: not while a compaction replaces them.
	d.flowMu.RLock()
	defer d.flowMu.RUnlock()
	defer done()
	t, err := d.haTarget("import flow delta of", service, false)
	if err != nil {
		return HADeltaResult{}, err
	}
	res, err := h.ImportDelta(ctx, service, delta, func(ctx context.Context, delta ha.Delta) (ha.ImportResult, error) {
		return ha.Apply(ctx, delta, t)
	})
	if err != nil {
		return res, fmt.Errorf("fluxvm: import flow delta of %s: %w", service, err)
	}
	return res, nil
}

// UpdateLease records what the control plane says about leases (see
// HALease) and keeps it next to the catalog, so that a restart does not
// go back to an older ha_epoch. Nothing changes when the update is
// refused. A lease that advances cancels an import from the peer under
// way (it is the edge's old active's: it stops at its next chunk or
// batch, before a snapshot-diff's deletes, and moves no cursor) and
// forgets the edge's cursors: as the active, it applies nobody's
// journal, and should it be a standby again it resyncs from a snapshot.
//
// A ctx that ended before the update takes effect (on entry, or while
// the call waited for another lease update) changes nothing and fails
// with an error wrapping ctx's. Past that point (the import under way
// cancelled, the lease file written) the call finishes, whatever ctx
// says: a lease half recorded would leave the edge's epoch and its
// journals disagreeing.
func (r HA) UpdateLease(ctx context.Context, l HALease) (HAStatus, error) {
	d := r.d
	if err := d.begin(ctx, "update lease"); err != nil {
		return HAStatus{}, err
	}
	h, err := d.haOn("update lease")
	if err != nil {
		return HAStatus{}, err
	}
	if l.Epoch == 0 && l.SupersededBy == 0 {
		return HAStatus{}, verr(ErrInvalid, "lease", "neither an epoch nor a superseding epoch")
	}
	if _, err := h.UpdateLease(ctx, l); err != nil {
		return HAStatus{}, fmt.Errorf("fluxvm: update lease: %w", err)
	}
	return r.Status(), nil
}

// Join tells a group edge (ha_group) that the control plane loaded the
// other edges' flows into it since it started: until then it withdraws
// every advertisement (reason "joining the group"), so that no router
// sends it a flow another edge carries before it holds that flow's
// state; afterwards it advertises as its services say. The control plane
// calls it once every other edge that is up delivered its journals
// (ha.GroupReplicator does); a group's first edge, with nothing to load,
// is joined by hand. It is idempotent; a restart joins anew. An edge
// outside a group refuses it (ErrPrerequisite naming ha_group).
func (r HA) Join(ctx context.Context) (HAStatus, error) {
	d := r.d
	if err := d.begin(ctx, "join the group"); err != nil {
		return HAStatus{}, err
	}
	h, err := d.haOn("join the group")
	if err != nil {
		return HAStatus{}, err
	}
	if !d.opts.HA.Group {
		return HAStatus{}, fmt.Errorf("fluxvm: %w", verr(ErrPrerequisite, "ha_group", "join the group: this edge is not one of a group"))
	}
	if h.Join() {
		d.mu.Lock()
		if err := d.checkOpen("join the group"); err != nil {
			d.mu.Unlock()
			return HAStatus{}, err
		}
		d.advertise()
		d.mu.Unlock()
		d.log.Info("fluxvm: HA group joined: advertising", "node", d.opts.NodeName)
	}
	return r.Status(), nil
}

// Status reports flow-state replication (Enabled false when it is off,
// and the zero HAStatus on a Dataplane Open did not make). It reads no
// kernel state and takes no context.
func (r HA) Status() HAStatus {
	d := r.d
	if d.unopened() || d.ha == nil {
		return HAStatus{}
	}
	return haStatusOf(d.ha.Status())
}

// FlowDelta is d.HA().FlowDelta.
//
// Deprecated: use d.HA().FlowDelta; this wrapper goes in the next release.
func (d *Dataplane) FlowDelta(ctx context.Context, service string, req FlowDeltaRequest) (ha.Delta, error) {
	return d.HA().FlowDelta(ctx, service, req)
}

// AckFlowDelta is d.HA().AckFlowDelta.
//
// Deprecated: use d.HA().AckFlowDelta; this wrapper goes in the next
// release.
func (d *Dataplane) AckFlowDelta(ctx context.Context, service string, seq uint64) (ha.JournalStats, error) {
	return d.HA().AckFlowDelta(ctx, service, seq)
}

// ImportFlowDelta is d.HA().ImportFlowDelta.
//
// Deprecated: use d.HA().ImportFlowDelta; this wrapper goes in the next
// release.
func (d *Dataplane) ImportFlowDelta(ctx context.Context, service string, delta ha.Delta) (HADeltaResult, error) {
	return d.HA().ImportFlowDelta(ctx, service, delta)
}

// UpdateLease is d.HA().UpdateLease.
//
// Deprecated: use d.HA().UpdateLease; this wrapper goes in the next
// release.
func (d *Dataplane) UpdateLease(ctx context.Context, l HALease) (HAStatus, error) {
	return d.HA().UpdateLease(ctx, l)
}

// HAStatus is d.HA().Status.
//
// Deprecated: use d.HA().Status; this wrapper goes in the next release.
func (d *Dataplane) HAStatus() HAStatus { return d.HA().Status() }
