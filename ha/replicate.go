package ha

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"
)

// Active is the edge whose flows a Replicator copies: its journals'
// deltas, snapshots and acks (the conntrack/delta, export and delta/ack
// routes of the REST API, or a Dataplane in process).
type Active interface {
	// Delta returns the batches of service's journal after the cursor
	// (journal, seq), at most maxOps ops but at least one batch, or
	// ResetRequired.
	Delta(ctx context.Context, service, journal string, seq uint64, maxOps int) (Delta, error)
	// Export writes a snapshot of service's flows, with its journal's
	// checkpoint in the header, to w.
	Export(ctx context.Context, service string, w io.Writer) error
	// Ack trims service's journal up to seq.
	Ack(ctx context.Context, service string, seq uint64) error
}

// Standby is the edge a Replicator copies flows to.
type Standby interface {
	// Cursor is how far the standby applied service's journal on the
	// active (zero: nothing yet, or lost in a restart).
	Cursor(ctx context.Context, service string) (Cursor, error)
	// Import loads a snapshot from r (with prune: a snapshot-diff) and
	// resets the standby's cursor to its checkpoint.
	Import(ctx context.Context, service string, r io.Reader, prune bool) (ImportResult, error)
	// ImportDelta applies a delta that continues the standby's cursor and
	// returns the cursor after it; it wraps ErrResetRequired, ErrGap or
	// ErrStaleEpoch when it cannot.
	ImportDelta(ctx context.Context, service string, d Delta) (Cursor, error)
}

// Replicator does the control plane's part of flow replication for one
// active and one standby edge: each round, for every service, it pulls
// the deltas after the standby's cursor, applies them, and acks them on
// the active (with one standby, its cursor is the minimum Fabric acks);
// when the deltas cannot continue the standby (a new journal incarnation,
// history gone, a gap, a standby that restarted) it loads a snapshot
// instead. Every DiffEvery it runs the snapshot-diff (a snapshot import
// with prune) whatever the deltas say: the backstop for records the
// active's queue dropped and for changes the queue does not carry.
type Replicator struct {
	Active  Active
	Standby Standby
	// Services are replicated in order.
	Services []string
	// MaxOps bounds one delta (0: DefaultMaxBatchOps * 4); MaxPages the
	// deltas a round pulls for one service (0: 64), so that one busy
	// service cannot starve the others.
	MaxOps, MaxPages int
	// DiffEvery is the period of the snapshot-diff (0: never; then only a
	// reset loads a snapshot).
	DiffEvery time.Duration
	// Log receives a line per snapshot and per refused delta (nil: none).
	Log *slog.Logger
	// Group replicates from one edge of a group to another
	// (GroupReplicator): snapshots are imported without prune, since a
	// snapshot-diff would delete the flows the target holds of the
	// group's other edges, and nothing is acked on the active, whose
	// journals serve every other edge: the group acks the least cursor of
	// them all.
	Group bool

	lastDiff map[string]time.Time
}

// RoundResult counts what one round did for one service.
type RoundResult struct {
	Service string `json:"service"`
	// Cursor is the standby's cursor after the round.
	Cursor Cursor `json:"cursor"`
	// Deltas and Ops applied; Snapshot when a snapshot (Diff: a periodic
	// snapshot-diff) was loaded, with what it did.
	Deltas   int           `json:"deltas"`
	Ops      int           `json:"ops"`
	Snapshot *ImportResult `json:"snapshot,omitempty"`
	Diff     bool          `json:"diff,omitempty"`
	// Reason says why a snapshot was loaded (reset_required, gap, no
	// cursor, diff).
	Reason string `json:"reason,omitempty"`
}

// Round runs one round over every service. A service that fails does not
// stop the others; the errors are joined. Data of a stale epoch (the
// active was superseded) is an error wrapping ErrStaleEpoch: nothing of
// it is applied.
func (r *Replicator) Round(ctx context.Context) ([]RoundResult, error) {
	if r.Active == nil || r.Standby == nil {
		return nil, errors.New("ha: replicator: an active and a standby are required")
	}
	if r.lastDiff == nil {
		r.lastDiff = map[string]time.Time{}
	}
	var errs []error
	out := make([]RoundResult, 0, len(r.Services))
	for _, svc := range r.Services {
		res, err := r.service(ctx, svc)
		out = append(out, res)
		if err != nil {
			errs = append(errs, fmt.Errorf("ha: replicate %s: %w", svc, err))
		}
	}
	return out, errors.Join(errs...)
}

func (r *Replicator) service(ctx context.Context, svc string) (RoundResult, error) {
	res := RoundResult{Service: svc}
	c, err := r.Standby.Cursor(ctx, svc)
	if err != nil {
		return res, fmt.Errorf("standby cursor: %w", err)
	}
	res.Cursor = c
	if c.Journal == "" {
		return r.snapshot(ctx, svc, "no cursor", false, res)
	}
	var diffErr error
	if r.DiffEvery > 0 && time.Since(r.lastDiff[svc]) >= r.DiffEvery {
		dres, err := r.snapshot(ctx, svc, "diff", true, res)
		if err == nil {
			return dres, nil
		}
		// The deltas go on: a diff that fails (too big for the standby's
		// limit, too slow) must not stop replication; it is retried at
		// the next period, and its error reported with the round's.
		r.lastDiff[svc] = time.Now()
		diffErr = err
		if errors.Is(err, ErrStaleEpoch) || errors.Is(err, ErrFenced) {
			return res, err
		}
		if r.Log != nil {
			r.Log.Warn("ha: replicator: snapshot-diff failed; deltas go on", "service", svc, "err", err)
		}
	}
	res, err = r.deltas(ctx, svc, c, res)
	return res, errors.Join(err, diffErr)
}

// deltas pulls, applies and acks the deltas after c, or loads a snapshot
// when they cannot continue it.
func (r *Replicator) deltas(ctx context.Context, svc string, c Cursor, res RoundResult) (RoundResult, error) {
	maxOps, pages := r.MaxOps, r.MaxPages
	if maxOps <= 0 {
		maxOps = 4 * DefaultMaxBatchOps
	}
	if pages <= 0 {
		pages = 64
	}
	for range pages {
		d, err := r.Active.Delta(ctx, svc, c.Journal, c.Seq, maxOps)
		if err != nil {
			return res, fmt.Errorf("delta after %s/%d: %w", c.Journal, c.Seq, err)
		}
		if d.ResetRequired {
			return r.snapshot(ctx, svc, "reset_required", false, res)
		}
		if len(d.Batches) == 0 {
			return res, nil
		}
		next, err := r.Standby.ImportDelta(ctx, svc, d)
		switch {
		case errors.Is(err, ErrResetRequired):
			return r.snapshot(ctx, svc, "reset_required", false, res)
		case errors.Is(err, ErrGap):
			return r.snapshot(ctx, svc, "gap", false, res)
		case err != nil:
			return res, fmt.Errorf("import delta %d..%d: %w", d.From, d.To, err)
		}
		res.Deltas++
		for _, b := range d.Batches {
			res.Ops += len(b.Ops)
		}
		c, res.Cursor = next, next
		if r.Group {
			continue
		}
		if err := r.Active.Ack(ctx, svc, next.Seq); err != nil {
			return res, fmt.Errorf("ack %d: %w", next.Seq, err)
		}
	}
	return res, nil
}

// errReaderGone ends an export whose standby stopped reading.
var errReaderGone = errors.New("ha: replicator: the standby stopped reading")

// snapshot streams a snapshot from the active into the standby, then
// acks its checkpoint on the active.
func (r *Replicator) snapshot(ctx context.Context, svc, reason string, diff bool, res RoundResult) (RoundResult, error) {
	res.Reason, res.Diff = reason, diff
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pr, pw := io.Pipe()
	exported := make(chan error, 1)
	go func() {
		err := r.Active.Export(ctx, svc, pw)
		pw.CloseWithError(err)
		exported <- err
	}()
	imp, err := r.Standby.Import(ctx, svc, pr, !r.Group)
	// The import read the stream to its end, or failed: either way the
	// export ends (a failed import closes the pipe under it).
	pr.CloseWithError(errReaderGone)
	eerr := <-exported
	switch {
	case err != nil && (eerr == nil || errors.Is(eerr, errReaderGone) || errors.Is(err, ErrStaleEpoch)):
		// The standby refused or failed on its own.
		return res, fmt.Errorf("snapshot (%s): %w", reason, err)
	case eerr != nil && !errors.Is(eerr, errReaderGone):
		// The active failed (fenced, gone): the standby's error is only
		// the cut stream's echo.
		return res, fmt.Errorf("snapshot (%s): export: %w (import: %v)", reason, eerr, err)
	}
	res.Snapshot = &imp
	res.Cursor = Cursor{Journal: imp.Header.Journal, Seq: imp.Header.Seq, Epoch: imp.Header.Epoch}
	r.lastDiff[svc] = time.Now()
	if r.Log != nil {
		r.Log.Info("ha: replicator: snapshot loaded", "service", svc, "reason", reason, "flows", imp.Flows,
			"written", imp.Written, "fresher", imp.Fresher, "pruned", imp.Pruned, "journal", imp.Header.Journal, "seq", imp.Header.Seq)
	}
	if r.Group {
		return res, nil
	}
	if err := r.Active.Ack(ctx, svc, imp.Header.Seq); err != nil {
		return res, fmt.Errorf("ack snapshot checkpoint %d: %w", imp.Header.Seq, err)
	}
	return res, nil
}
