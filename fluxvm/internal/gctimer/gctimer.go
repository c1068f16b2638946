// Package gctimer is the conntrack GC timer of the dataplane
// (conntrack_gc_interval, fluxvm.Options.ConntrackGCInterval), a component
// of package fluxvm.
//
// Its next GC is due one period after the last GC began, whoever ran it:
// the timer itself, a GC on demand (POST …/conntrack/gc), a pressure
// round, or an earlier process on the same pins. The facade tells it of
// every GC (Note). The time of the last GC and the period in force are
// kept with the pins (bpf.GCMark, a small map in the pin root that
// restarts, generation reloads, tier changes and compactions leave in
// place), so a restart neither postpones the GC nor resets an adapted
// period: however often the node restarts, two GCs are never further
// apart than the period, as long as a process is running when it is due
// (one that starts later runs the overdue GC at once). Times are on the
// datapath's clock (bpf.Now), the one the flows' deadlines are stamped
// on; the pins do not outlive it (a reboot clears both).
//
// The period adapts to what the timer's own GCs find (NextInterval):
// shorter while flows expire in bulk, longer when idle, between an eighth
// and twice the configured period.
//
// What it owns, under its own lock: the period in force and when the
// last GC began, its goroutine. What it needs (Deps): the pinned mark
// (Marks), the datapath's clock and a GC (the facade's, which runs the
// scan and calls Note).
//
// Lock order: the facade calls Note with its own lock (d.mu) held; this
// component's lock is taken after it, never before. The component calls
// its Deps (the mark, GC) only without its own lock held: GC from its
// goroutine, the mark after it released its lock (Note's caller, the
// facade, serializes the writes).
package gctimer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
)

// Result reports one conntrack garbage collection (fluxvm.GCResult).
type Result struct {
	At       time.Time     `json:"at"`
	Duration time.Duration `json:"duration_ns"`
	Scanned  int           `json:"scanned"`
	Expired  int           `json:"expired"`
	Drained  int           `json:"drained"`
	// BackendGone counts flows whose backend was removed.
	BackendGone int `json:"backend_gone"`
	Orphans     int `json:"orphans_removed"`
	Repaired    int `json:"repaired"`
}

// Removed is how many flows the GC removed (expired, drained, backend
// gone), the orphaned halves aside.
func (r Result) Removed() int { return r.Expired + r.Drained + r.BackendGone }

// Marks reads and writes the GC mark pinned with the datapath
// (bpf.Datapath.GCMark, SetGCMark).
type Marks interface {
	// GCMark fails with an error matching bpf.ErrNoGCMark when the pins
	// hold none.
	GCMark() (bpf.GCMark, error)
	SetGCMark(bpf.GCMark) error
}

// Config is the timer's configuration.
type Config struct {
	// Base is the configured period (Options.ConntrackGCInterval after
	// WithDefaults). 0 or negative: no timer; Start starts nothing, and
	// Note still records the GCs others run (with a period of 0 in the
	// mark).
	Base time.Duration
	// Min is the shortest period the timer adapts to, unless Base is
	// shorter (fluxvm.MinConntrackGCInterval); 0: an eighth of Base.
	Min time.Duration
	// Logger receives the timer's failures and adaptations; nil discards
	// them.
	Logger *slog.Logger
}

// Deps is what the timer needs from the rest of the dataplane.
type Deps struct {
	// Marks is the pinned mark. Required.
	Marks Marks
	// Now reads the datapath's clock; nil: bpf.Now.
	Now func() (time.Duration, error)
	// GC runs one GC for the timer, called from the timer's goroutine
	// without its lock; it calls Note with timer set. An error matching
	// errs.ErrClosed ends the timer. Required when Base > 0.
	GC func(ctx context.Context) (Result, error)
}

// Status is the timer's state.
type Status struct {
	// Interval is the period in force (0: no timer); Base the configured
	// one.
	Interval, Base time.Duration
	// Last is when the last GC began on the datapath's clock (0: none
	// known); the next is due at Last+Interval.
	Last time.Duration
}

// Timer is the component. Its zero value is not usable: call New.
type Timer struct {
	cfg  Config
	deps Deps
	log  *slog.Logger
	ctx  context.Context // ends at Close: cancels the timer's GC
	stop context.CancelFunc
	done chan struct{} // closed when the goroutine ended (nil: none started)

	mu      sync.Mutex // guards the fields below; taken after the facade's lock, never before
	every   time.Duration
	last    time.Duration
	started bool
}

// New checks cfg and deps and returns the timer; it starts nothing.
func New(cfg Config, deps Deps) (*Timer, error) {
	cfg.Base = max(cfg.Base, 0)
	if deps.Marks == nil || (cfg.Base > 0 && deps.GC == nil) {
		return nil, errors.New("gctimer: Deps.Marks (and Deps.GC with a period) are required")
	}
	if cfg.Min < 0 {
		return nil, fmt.Errorf("gctimer: negative minimum period %v", cfg.Min)
	}
	if deps.Now == nil {
		deps.Now = bpf.Now
	}
	t := &Timer{cfg: cfg, deps: deps, log: cfg.Logger, every: cfg.Base}
	if t.log == nil {
		t.log = slog.New(slog.DiscardHandler)
	}
	t.ctx, t.stop = context.WithCancel(context.Background())
	return t, nil
}

// bounds are the limits of the adaptive period around base.
func bounds(base, floor time.Duration) (lo, hi time.Duration) {
	return max(base/8, min(floor, base)), 2 * base
}

// NextInterval adapts the period cur to what the last run found r, base
// the configured period and floor Config.Min: while flows expire in bulk
// (a tenth or more of the entries scanned removed) it halves, down to an
// eighth of base (and never below floor unless base is), so that a table
// filling with dead flows is emptied before it is full; when a run
// removes nothing it doubles, up to twice base; otherwise it moves back
// toward base.
func NextInterval(base, floor, cur time.Duration, r Result) time.Duration {
	lo, hi := bounds(base, floor)
	removed := r.Removed()
	switch {
	case r.Scanned > 0 && removed*10 >= r.Scanned:
		return max(cur/2, lo)
	case removed == 0:
		return min(cur*2, hi)
	case cur < base:
		return min(cur*2, base)
	case cur > base:
		return max(cur/2, base)
	}
	return cur
}

// Start readies the timer and starts its goroutine (with a period; once):
// it counts from the last GC of the pinned mark, in the period that GC
// left when the configured period is unchanged. Without a usable mark
// (the pins are new, or were written by a release without it) it counts
// from now, and writes the mark at once, so that a restart before the
// first GC counts from this start too.
func (t *Timer) Start() {
	t.mu.Lock()
	start := t.cfg.Base > 0 && !t.started && t.ctx.Err() == nil
	t.started = true
	if start {
		t.done = make(chan struct{})
	}
	t.mu.Unlock()
	if start {
		t.resume()
		go t.loop()
	}
}

func (t *Timer) resume() {
	base := t.cfg.Base
	now, err := t.deps.Now()
	if err != nil {
		t.log.Warn("fluxvm: conntrack gc: no clock; the timer counts from its start", "err", err)
		return
	}
	m, err := t.deps.Marks.GCMark()
	switch {
	case err == nil && time.Duration(m.Last) <= now:
		lo, hi := bounds(base, t.cfg.Min)
		t.mu.Lock()
		t.last = time.Duration(m.Last)
		if p := time.Duration(m.Period); time.Duration(m.Base) == base && p >= lo && p <= hi {
			t.every = p
		}
		every := t.every
		t.mu.Unlock()
		t.log.Debug("fluxvm: conntrack gc resumed", "last_ago", now-time.Duration(m.Last), "interval", every, "configured", base)
		return
	case err == nil:
		t.log.Warn("fluxvm: conntrack gc: the pinned mark is ahead of the clock; counting from now",
			"mark", time.Duration(m.Last), "now", now)
	case !errors.Is(err, bpf.ErrNoGCMark):
		t.log.Warn("fluxvm: conntrack gc: the pinned mark is unusable; counting from now", "err", err)
	}
	t.mu.Lock()
	t.last = now
	mark := t.markLocked()
	t.mu.Unlock()
	t.writeMark(mark)
}

// Close stops the timer and waits for its goroutine: its GC in progress
// is cancelled (its context ends). Idempotent. Call it without the
// facade's lock (the timer's GC takes it).
func (t *Timer) Close() error {
	t.stop()
	t.mu.Lock()
	done := t.done
	t.mu.Unlock()
	if done != nil {
		<-done
	}
	return nil
}

// Status returns the period in force and the last GC.
func (t *Timer) Status() Status {
	t.mu.Lock()
	defer t.mu.Unlock()
	return Status{Interval: t.every, Base: t.cfg.Base, Last: t.last}
}

// Note records a GC that began at now (the datapath's clock) and found
// r: the timer counts from it. A GC of the timer's own (timer) also
// adapts the period to what it found (NextInterval). The mark with the
// pins follows, for the next process. The facade calls it with its lock
// held, which serializes the mark's writes.
func (t *Timer) Note(now time.Duration, r Result, timer bool) {
	t.mu.Lock()
	if base := t.cfg.Base; timer && base > 0 {
		if next := NextInterval(base, t.cfg.Min, t.every, r); next != t.every {
			t.log.Debug("fluxvm: conntrack gc interval adapted", "interval", next, "configured", base)
			t.every = next
		}
	}
	// Two GCs may overlap: the later start counts.
	t.last = max(t.last, now)
	mark := t.markLocked()
	t.mu.Unlock()
	t.writeMark(mark)
}

func (t *Timer) markLocked() bpf.GCMark {
	return bpf.GCMark{Last: uint64(t.last), Period: uint64(t.every), Base: uint64(t.cfg.Base)}
}

// writeMark pins m. A failure costs only the next process's count (it
// counts from its start), so it is logged, not returned.
func (t *Timer) writeMark(m bpf.GCMark) {
	if err := t.deps.Marks.SetGCMark(m); err != nil {
		t.log.Warn("fluxvm: conntrack gc: the mark with the pins was not written; a restart counts from its start", "err", err)
	}
}

// Wait is how long until the timer's next GC is due: one period after
// the last GC began, and never more than the period.
func (t *Timer) Wait() time.Duration {
	t.mu.Lock()
	every, last := t.every, t.last
	t.mu.Unlock()
	now, err := t.deps.Now()
	if err != nil {
		return every
	}
	return min(max(last+every-now, 0), every)
}

// early is how early a GC may run: the datapath's clock is coarse (one
// kernel tick), so the timer may fire that much before the clock reads
// the due time.
const early = 10 * time.Millisecond

// loop is the timer's goroutine.
func (t *Timer) loop() {
	defer close(t.done)
	tm := time.NewTimer(t.Wait())
	defer tm.Stop()
	for {
		select {
		case <-t.ctx.Done():
			return
		case <-tm.C:
		}
		// A GC run by anyone else since the timer was set moved the
		// due time on.
		if wait := t.Wait(); wait > early {
			tm.Reset(wait)
			continue
		}
		ctx, cancel := context.WithTimeout(t.ctx, t.cfg.Base)
		r, err := t.deps.GC(ctx)
		cancel()
		switch {
		case errors.Is(err, errs.ErrClosed) || t.ctx.Err() != nil:
			return
		case err != nil:
			// The mark did not move: tried again one period on.
			t.log.Warn("fluxvm: conntrack gc failed", "err", err)
			tm.Reset(t.Status().Interval)
			continue
		case r.Removed()+r.Orphans+r.Repaired > 0:
			t.log.Debug("fluxvm: conntrack gc", "scanned", r.Scanned, "expired", r.Expired,
				"drained", r.Drained, "backend_gone", r.BackendGone, "orphans", r.Orphans, "repaired", r.Repaired)
		}
		tm.Reset(t.Wait())
	}
}
