package fluxvm

import (
	"context"
	"errors"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
)

// The conntrack GC timer (conntrack_gc_interval, Options.ConntrackGCInterval).
//
// Its next GC is due one period after the last GC began, whoever ran it:
// the timer itself, GC on demand (POST …/conntrack/gc), a pressure round,
// or an earlier process on the same pins. The time of the last GC and the
// period in force are kept with the pins (bpf.GCMark, a small map in the
// pin root that restarts, generation reloads, tier changes and
// compactions leave in place), so a restart neither postpones the GC nor
// resets an adapted period: however often the node restarts, two GCs are
// never further apart than the period, as long as a process is running
// when it is due (one that starts later runs the overdue GC at once).
// Times are on the datapath's clock (bpf.Now), the one the flows'
// deadlines are stamped on; the pins do not outlive it (a reboot clears
// both).

// gcEarly is how early a GC may run: the datapath's clock is coarse (one
// kernel tick), so the timer may fire that much before the clock reads
// the due time.
const gcEarly = 10 * time.Millisecond

// gcBounds are the limits of the timer's adaptive period around base.
func gcBounds(base time.Duration) (lo, hi time.Duration) {
	return max(base/8, min(MinConntrackGCInterval, base)), 2 * base
}

// resumeGC readies the timer with the configured period base, before
// gcLoop starts: it counts from the last GC of the pinned mark, in the
// period that GC left when base is unchanged. Without a usable mark (the
// pins are new, or were written by a release without it) it counts from
// now, and writes the mark at once, so that a restart before the first
// GC counts from this start too. It returns base.
func (d *Dataplane) resumeGC(base time.Duration) time.Duration {
	d.gcBase = base
	d.gcEvery.Store(int64(base))
	now, err := bpf.Now()
	if err != nil {
		d.log.Warn("fluxvm: conntrack gc: no clock; the timer counts from its start", "err", err)
		return base
	}
	m, err := d.dp.GCMark()
	switch {
	case err == nil && time.Duration(m.Last) <= now:
		d.gcLast.Store(int64(m.Last))
		lo, hi := gcBounds(base)
		if p := time.Duration(m.Period); time.Duration(m.Base) == base && p >= lo && p <= hi {
			d.gcEvery.Store(int64(p))
		}
		d.log.Debug("fluxvm: conntrack gc resumed", "last_ago", now-time.Duration(m.Last),
			"interval", time.Duration(d.gcEvery.Load()), "configured", base)
		return base
	case err == nil:
		d.log.Warn("fluxvm: conntrack gc: the pinned mark is ahead of the clock; counting from now",
			"mark", time.Duration(m.Last), "now", now)
	case !errors.Is(err, bpf.ErrNoGCMark):
		d.log.Warn("fluxvm: conntrack gc: the pinned mark is unusable; counting from now", "err", err)
	}
	d.gcLast.Store(int64(now))
	d.writeGCMark()
	return base
}

// noteGC records a GC that began at now (the datapath's clock) and found
// r: the timer counts from it. A GC of the timer (timer) also adapts the
// period to what it found (nextGCInterval). The mark with the pins
// follows, for the next process. The caller holds mu.
func (d *Dataplane) noteGC(now time.Duration, r GCResult, timer bool) {
	if timer && d.gcBase > 0 {
		cur := time.Duration(d.gcEvery.Load())
		if next := nextGCInterval(d.gcBase, cur, r); next != cur {
			d.log.Debug("fluxvm: conntrack gc interval adapted", "interval", next, "configured", d.gcBase)
			d.gcEvery.Store(int64(next))
		}
	}
	// Two GCs may overlap: the later start counts.
	if int64(now) > d.gcLast.Load() {
		d.gcLast.Store(int64(now))
	}
	d.writeGCMark()
}

// writeGCMark pins the time of the last GC and the period in force. A
// failure costs only the next process's count (it counts from its start),
// so it is logged, not returned.
func (d *Dataplane) writeGCMark() {
	m := bpf.GCMark{Last: uint64(d.gcLast.Load()), Period: uint64(d.gcEvery.Load()), Base: uint64(d.gcBase)}
	if err := d.dp.SetGCMark(m); err != nil {
		d.log.Warn("fluxvm: conntrack gc: the mark with the pins was not written; a restart counts from its start", "err", err)
	}
}

// gcWait is how long until the timer's next GC is due: one period after
// the last GC began, and never more than the period.
func (d *Dataplane) gcWait() time.Duration {
	every := time.Duration(d.gcEvery.Load())
	now, err := bpf.Now()
	if err != nil {
		return every
	}
	return min(max(time.Duration(d.gcLast.Load())+every-now, 0), every)
}

// gcLoop is the GC timer, base the configured period (resumeGC readied
// it).
func (d *Dataplane) gcLoop(base time.Duration) {
	defer close(d.done)
	t := time.NewTimer(d.gcWait())
	defer t.Stop()
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
		}
		// A GC run by anyone else since the timer was set moved the
		// due time on.
		if wait := d.gcWait(); wait > gcEarly {
			t.Reset(wait)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), base)
		r, err := d.gc(ctx, true)
		cancel()
		switch {
		case errors.Is(err, ErrClosed):
			return
		case err != nil:
			// The mark did not move: tried again one period on.
			d.log.Warn("fluxvm: conntrack gc failed", "err", err)
			t.Reset(time.Duration(d.gcEvery.Load()))
			continue
		case r.Expired+r.Drained+r.BackendGone+r.Orphans+r.Repaired > 0:
			d.log.Debug("fluxvm: conntrack gc", "scanned", r.Scanned, "expired", r.Expired,
				"drained", r.Drained, "backend_gone", r.BackendGone, "orphans", r.Orphans, "repaired", r.Repaired)
		}
		t.Reset(d.gcWait())
	}
}

// nextGCInterval adapts the GC period to what the last run found: while
// flows expire in bulk (a tenth or more of the entries scanned removed)
// it halves, down to an eighth of the configured period (and never below
// MinConntrackGCInterval), so that a table filling with dead flows is
// emptied before it is full; when a run removes nothing it doubles, up to
// twice the configured period; otherwise it moves back toward the
// configured period.
func nextGCInterval(base, cur time.Duration, r GCResult) time.Duration {
	lo, hi := gcBounds(base)
	removed := r.Expired + r.Drained + r.BackendGone
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
