package fluxvm

import (
	"context"
	"fmt"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
)

// GC removes dead flows now (the timer does the same periodically) and
// then frees the ids that removed services and backends held. The scan
// runs without the dataplane's lock, so other calls proceed meanwhile;
// Close cancels it and waits for it to return, and a GC it interrupted,
// or one called after Close, fails with an error matching ErrClosed.
// The GC timer counts from it: the timer's next GC is due one period
// after the last GC began, whoever ran it (fluxvm/internal/gctimer).
func (d *Dataplane) GC(ctx context.Context) (GCResult, error) {
	if err := d.opened("gc"); err != nil {
		return GCResult{}, err
	}
	return d.gc(ctx, false)
}

// gc is GC; timer says the GC timer runs it, whose period adapts to
// what it found (gctimer.Timer.Note).
func (d *Dataplane) gc(ctx context.Context, timer bool) (_ GCResult, err error) {
	ctx, span := d.startSpan(ctx, SpanGC)
	defer endSpan(span, &err)
	now, err := conntrack.Now()
	if err != nil {
		return GCResult{}, fmt.Errorf("fluxvm: gc: %w", err)
	}
	// Not while a compaction replaces the flow maps (compact.go).
	d.flowMu.RLock()
	defer d.flowMu.RUnlock()
	// Only the ids in quarantine before the scan are free of flows after
	// it: an id released meanwhile may be named by a flow already passed.
	d.mu.Lock()
	if err := d.checkOpen("gc"); err != nil {
		d.mu.Unlock()
		return GCResult{}, err
	}
	// Added under mu while open: Close's wait (stopGC) comes after.
	d.gcRuns.Add(1)
	defer d.gcRuns.Done()
	smark, bmark := d.prog.ServiceIDs().QuarantineMark(), d.prog.BackendIDs().QuarantineMark()
	d.mu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(d.gcCtx, cancel)()
	if d.beforeGCScan != nil {
		d.beforeGCScan()
	}
	start := time.Now()
	r, err := d.ct.GC(ctx, now)
	if d.afterGCScan != nil {
		d.afterGCScan()
	}
	if err != nil {
		if d.gcCtx.Err() != nil {
			return GCResult{}, fmt.Errorf("fluxvm: gc: interrupted by Close: %w", ErrClosed)
		}
		return GCResult{}, fmt.Errorf("fluxvm: gc: %w", err)
	}
	res := GCResult{
		At: start, Duration: time.Since(start), Scanned: r.Scanned,
		Expired: r.Expired, Drained: r.Drained, BackendGone: r.BackendGone,
		Orphans:  r.StaleNATRemoved + r.SupersededNATRemoved,
		Repaired: r.CTRepaired + r.NATRepaired,
	}
	span.SetAttributes(AttrGCScanned.Int(res.Scanned), AttrGCExpired.Int(res.Expired), AttrGCDrained.Int(res.Drained),
		AttrGCBackendGone.Int(res.BackendGone), AttrGCOrphans.Int(res.Orphans), AttrGCRepaired.Int(res.Repaired),
		AttrGCCollected.Int(res.Expired+res.Drained+res.BackendGone+res.Orphans))
	d.mu.Lock()
	d.lastGC = &res
	d.gcTimer.Note(now, res, timer)
	// Flows naming the ids quarantined before the scan are gone now.
	d.prog.ServiceIDs().ReleaseQuarantinedBefore(smark)
	if d.prog.BackendIDs().ReleaseQuarantinedBefore(bmark) > 0 {
		// A backend id may name another backend from now on: XDP must
		// not reuse a route it cached under it.
		d.invalidateXDPRoutes()
	}
	d.mu.Unlock()
	return res, nil
}
