package gctimer

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
)

// fakeMarks is the pinned mark in memory.
type fakeMarks struct {
	mu      sync.Mutex
	mark    bpf.GCMark
	err     error // GCMark's error (bpf.ErrNoGCMark: none pinned)
	writes  []bpf.GCMark
	failSet error
}

func (f *fakeMarks) GCMark() (bpf.GCMark, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.mark, f.err
}

func (f *fakeMarks) SetGCMark(m bpf.GCMark) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failSet != nil {
		return f.failSet
	}
	f.writes = append(f.writes, m)
	f.mark, f.err = m, nil
	return nil
}

func (f *fakeMarks) written() []bpf.GCMark {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]bpf.GCMark(nil), f.writes...)
}

func TestNextInterval(t *testing.T) {
	const base = 30 * time.Second
	for _, tc := range []struct {
		name    string
		base    time.Duration
		cur     time.Duration
		scanned int
		removed int
		want    time.Duration
	}{
		{"bulk expiry halves", base, base, 1000, 100, 15 * time.Second},
		{"bulk expiry stops at an eighth", base, 4 * time.Second, 1000, 500, base / 8},
		{"idle doubles", base, base, 1000, 0, 2 * base},
		{"idle stops at twice", base, 2 * base, 1000, 0, 2 * base},
		{"empty table is idle", base, base, 0, 0, 2 * base},
		{"some expiry goes back up", base, 10 * time.Second, 1000, 5, 20 * time.Second},
		{"some expiry goes back down", base, 2 * base, 1000, 5, base},
		{"steady", base, base, 1000, 5, base},
		// A short configured period never goes below the floor.
		{"floor", time.Second, time.Second, 10, 10, time.Second},
		{"floor above an eighth", 4 * time.Second, 2 * time.Second, 10, 10, time.Second},
		// A configured period below the floor does not shorten.
		{"below the floor", 400 * time.Millisecond, 400 * time.Millisecond, 10, 10, 400 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := NextInterval(tc.base, time.Second, tc.cur, Result{Scanned: tc.scanned, Expired: tc.removed}); got != tc.want {
				t.Errorf("next after %v: %v, want %v", tc.cur, got, tc.want)
			}
		})
	}
}

// TestResume: what a timer starting counts from, by what the pins hold:
// the last GC's mark, in the period it left while the configured period
// is the same; otherwise (no mark, an unusable one, one ahead of the
// clock) its own start, with the mark written at once. Without a clock
// it counts a whole period and writes nothing.
func TestResume(t *testing.T) {
	const (
		base = 2 * time.Second
		now  = time.Hour // the datapath's clock, frozen
	)
	ago := func(a time.Duration) uint64 { return uint64(now - a) }
	fresh := bpf.GCMark{Last: uint64(now), Period: uint64(base), Base: uint64(base)}
	for _, tc := range []struct {
		name    string
		mark    bpf.GCMark
		err     error
		noClock bool
		every   time.Duration // the period it starts in
		wait    time.Duration // until its first GC
		write   *bpf.GCMark   // the mark written at the start, nil: none
	}{
		{name: "none", err: bpf.ErrNoGCMark, every: base, wait: base, write: &fresh},
		{name: "adapted", mark: bpf.GCMark{Last: ago(300 * time.Millisecond), Period: uint64(base / 2), Base: uint64(base)},
			every: base / 2, wait: base/2 - 300*time.Millisecond},
		{name: "stretched", mark: bpf.GCMark{Last: ago(time.Second), Period: uint64(2 * base), Base: uint64(base)},
			every: 2 * base, wait: 2*base - time.Second},
		{name: "overdue", mark: bpf.GCMark{Last: ago(time.Minute), Period: uint64(base), Base: uint64(base)}, every: base, wait: 0},
		{name: "another configured period", mark: bpf.GCMark{Last: ago(300 * time.Millisecond), Period: uint64(base / 2), Base: uint64(3 * base)},
			every: base, wait: base - 300*time.Millisecond},
		{name: "a timer-less GC", mark: bpf.GCMark{Last: ago(300 * time.Millisecond)}, every: base, wait: base - 300*time.Millisecond},
		{name: "period out of bounds", mark: bpf.GCMark{Last: ago(300 * time.Millisecond), Period: uint64(5 * base), Base: uint64(base)},
			every: base, wait: base - 300*time.Millisecond},
		{name: "ahead of the clock", mark: bpf.GCMark{Last: uint64(now + time.Hour), Period: uint64(base), Base: uint64(base)},
			every: base, wait: base, write: &fresh},
		{name: "unusable", err: errors.New("another layout"), every: base, wait: base, write: &fresh},
		{name: "no clock", mark: bpf.GCMark{Last: ago(300 * time.Millisecond), Period: uint64(base / 2), Base: uint64(base)},
			noClock: true, every: base, wait: base},
	} {
		t.Run(tc.name, func(t *testing.T) {
			marks := &fakeMarks{mark: tc.mark, err: tc.err}
			clock := func() (time.Duration, error) { return now, nil }
			if tc.noClock {
				clock = func() (time.Duration, error) { return 0, errors.New("no clock") }
			}
			gcs := make(chan struct{}, 1)
			tm, err := New(Config{Base: base, Min: time.Second}, Deps{Marks: marks, Now: clock,
				GC: func(context.Context) (Result, error) {
					select {
					case gcs <- struct{}{}:
					default:
					}
					return Result{}, errs.ErrClosed
				}})
			if err != nil {
				t.Fatal(err)
			}
			tm.Start()
			defer tm.Close()
			if every := tm.Status().Interval; every != tc.every {
				t.Errorf("period %v, want %v", every, tc.every)
			}
			if w := tm.Wait(); !tc.noClock && w != tc.wait {
				t.Errorf("first GC in %v, want %v", w, tc.wait)
			}
			switch w := marks.written(); {
			case tc.write == nil && len(w) != 0:
				t.Errorf("marks written %+v, want the last GC's kept", w)
			case tc.write != nil && (len(w) != 1 || w[0] != *tc.write):
				t.Errorf("marks written %+v, want %+v", w, *tc.write)
			}
			if tc.wait == 0 {
				select {
				case <-gcs:
				case <-time.After(5 * time.Second):
					t.Error("an overdue GC did not run at once")
				}
			}
		})
	}
}

// TestTimerCountsFromLastGC: a GC on demand (Note without timer) moves
// the timer's next GC to one period after it; the timer's own GCs adapt
// the period (halved after one that removed everything it scanned,
// doubled back after one that removed nothing), and the mark follows
// each GC.
func TestTimerCountsFromLastGC(t *testing.T) {
	const base = 400 * time.Millisecond
	t0 := time.Now()
	clock := func() (time.Duration, error) { return time.Hour + time.Since(t0), nil }
	marks := &fakeMarks{err: bpf.ErrNoGCMark}
	var tm *Timer
	type gc struct {
		at    time.Duration // since t0
		every time.Duration // the period before it
	}
	gcs := make(chan gc, 8)
	results := []Result{{Scanned: 10, Expired: 10}, {Scanned: 10}}
	n := 0
	tm, err := New(Config{Base: base, Min: 50 * time.Millisecond}, Deps{Marks: marks, Now: clock,
		GC: func(ctx context.Context) (Result, error) {
			now, _ := clock()
			every := tm.Status().Interval
			r := results[min(n, len(results)-1)]
			n++
			tm.Note(now, r, true) // as the facade's GC does
			gcs <- gc{now - time.Hour, every}
			return r, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	tm.Start()
	defer tm.Close()
	time.Sleep(base / 2)
	manual, _ := clock()
	tm.Note(manual, Result{Scanned: 10, Expired: 10}, false)
	if st := tm.Status(); st.Interval != base || st.Last != manual {
		t.Fatalf("after a GC on demand: %+v, want the period unchanged, counting from it", st)
	}
	manualAt := manual - time.Hour
	const late = 300 * time.Millisecond // the scheduler of a shared machine
	first := <-gcs
	if first.at < manualAt+base-early || first.at > manualAt+base+late {
		t.Errorf("the timer's first GC %v after the start, want %v (one period after the GC on demand at %v)", first.at, manualAt+base, manualAt)
	}
	if st := tm.Status(); st.Interval != base/2 {
		t.Errorf("period after a GC that removed all it scanned: %v, want %v", st.Interval, base/2)
	}
	second := <-gcs
	if gap := second.at - first.at; second.every != base/2 || gap < base/2-early || gap > base/2+late {
		t.Errorf("second GC %v after the first in a period of %v, want %v", gap, second.every, base/2)
	}
	if st := tm.Status(); st.Interval != base {
		t.Errorf("period after a GC that removed nothing: %v, want %v", st.Interval, base)
	}
	w := marks.written()
	if last := w[len(w)-1]; time.Duration(last.Last) != second.at+time.Hour || last.Period != uint64(base) || last.Base != uint64(base) {
		t.Errorf("mark %+v after the second GC (at %v)", last, second.at+time.Hour)
	}
}

// TestCloseWaitsForGC: Close cancels the timer's GC in progress and
// returns only once it has returned; no GC runs after Close.
func TestCloseWaitsForGC(t *testing.T) {
	marks := &fakeMarks{mark: bpf.GCMark{Last: 1}} // overdue: the GC starts at once
	started := make(chan struct{})
	var mu sync.Mutex
	returned, calls := false, 0
	tm, err := New(Config{Base: time.Hour}, Deps{Marks: marks, Now: func() (time.Duration, error) { return 2 * time.Hour, nil },
		GC: func(ctx context.Context) (Result, error) {
			mu.Lock()
			calls++
			mu.Unlock()
			close(started)
			<-ctx.Done()
			time.Sleep(50 * time.Millisecond)
			mu.Lock()
			returned = true
			mu.Unlock()
			return Result{}, ctx.Err()
		}})
	if err != nil {
		t.Fatal(err)
	}
	tm.Start()
	<-started
	if err := tm.Close(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !returned || calls != 1 {
		t.Errorf("Close returned with the GC returned %t after %d calls", returned, calls)
	}
	if err := tm.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestNew(t *testing.T) {
	marks := &fakeMarks{}
	gc := func(context.Context) (Result, error) { return Result{}, nil }
	for _, tc := range []struct {
		name string
		cfg  Config
		deps Deps
		ok   bool
	}{
		{"timer", Config{Base: time.Second}, Deps{Marks: marks, GC: gc}, true},
		{"off without GC", Config{Base: -1}, Deps{Marks: marks}, true},
		{"no marks", Config{}, Deps{GC: gc}, false},
		{"timer without GC", Config{Base: time.Second}, Deps{Marks: marks}, false},
		{"negative floor", Config{Min: -1}, Deps{Marks: marks, GC: gc}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tm, err := New(tc.cfg, tc.deps)
			if (err == nil) != tc.ok {
				t.Fatalf("New: %v, want ok %t", err, tc.ok)
			}
			if err == nil {
				tm.Start() // with no period: nothing to start
				tm.Note(5, Result{}, false)
				if err := tm.Close(); err != nil {
					t.Error(err)
				}
			}
		})
	}
	// Without a timer, GCs are still recorded in the mark (period 0).
	tm, _ := New(Config{}, Deps{Marks: marks})
	tm.Note(7*time.Second, Result{Scanned: 1, Expired: 1}, false)
	if w := marks.written(); w[len(w)-1] != (bpf.GCMark{Last: uint64(7 * time.Second)}) || tm.Status().Interval != 0 {
		t.Errorf("mark %+v, status %+v", w[len(w)-1], tm.Status())
	}
}
