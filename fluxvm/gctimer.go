package fluxvm

import (
	"context"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm/internal/gctimer"
)

// The conntrack GC timer (conntrack_gc_interval,
// Options.ConntrackGCInterval) is package fluxvm/internal/gctimer: its
// next GC is due one period after the last GC began, whoever ran it (the
// timer, GC on demand, a pressure round, an earlier process on the same
// pins: bpf.GCMark), and its period adapts to what its GCs find. The
// facade runs the GCs (gc, in dataplane.go) and tells the timer of each
// (gctimer.Timer.Note, under d.mu).

// GCResult reports one conntrack garbage collection (package
// fluxvm/internal/gctimer's).
type GCResult = gctimer.Result

// newGCTimer makes the GC timer with the configured period base (0 or
// negative: no timer; it still records the GCs others run in the mark);
// Open starts it last.
func (d *Dataplane) newGCTimer(base time.Duration) (*gctimer.Timer, error) {
	return gctimer.New(gctimer.Config{Base: base, Min: MinConntrackGCInterval, Logger: d.log},
		gctimer.Deps{Marks: d.dp, GC: func(ctx context.Context) (GCResult, error) { return d.gc(ctx, true) }})
}
