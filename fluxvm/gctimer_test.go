package fluxvm

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/gctimer"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// gcNode is a dataplane with the GC timer on a pin root of its own, with
// no interfaces, its interface operations in a namespace of the test's.
type gcNode struct {
	opts Options
	ct4  *ebpf.Map // the pinned fluxvm_fct4, open across restarts
	n    int       // flows written
}

func newGCNode(t *testing.T, every time.Duration) *gcNode {
	t.Helper()
	th := testenv.NewThread(t)
	return &gcNode{opts: Options{
		Loader:              bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierS},
		ConntrackGCInterval: every,
		Pressure:            PressureOptions{Interval: -1}, // only the GC timer and the test run GCs
		Logger:              slog.New(slog.DiscardHandler),
		InNamespace: func(f func() error) error {
			var err error
			th.Do(func() { err = f() })
			return err
		},
	}}
}

func (n *gcNode) open(t *testing.T) *Dataplane {
	t.Helper()
	d, err := Open(context.Background(), n.opts)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	if n.ct4 == nil {
		if n.ct4, err = ebpf.LoadPinnedMap(filepath.Join(n.opts.Loader.PinRoot, "maps", "fluxvm_fct4"), nil); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { n.ct4.Close() }) // the one open then
	}
	return d
}

// expired writes an east-west flow whose deadline passed a second ago
// into the pinned conntrack map and returns its key.
func (n *gcNode) expired(t *testing.T) bpf.Tuple4 {
	t.Helper()
	now, err := conntrack.Now()
	if err != nil {
		t.Error(err)
		return bpf.Tuple4{}
	}
	n.n++
	client := netip.AddrFrom4([4]byte{10, 1, byte(n.n >> 8), byte(n.n)})
	k := bpf.Tuple4{Saddr: bpf.AddrWords(client)[0], Daddr: bpf.AddrWords(vip4)[0], Sport: bpf.Port(40000), Dport: bpf.Port(80), Proto: 6}
	v := bpf.CTValue{ServiceId: 1, BackendId: 1, CreatedNs: uint64(now - time.Minute), LastSeenNs: uint64(now - time.Minute),
		DeadlineNs: uint64(now - time.Second), State: uint8(bpf.CTTCPEstablished), Flags: bpf.CTFlagRevDerived}
	if err := n.ct4.Put(k, v); err != nil {
		t.Error(err)
	}
	return k
}

// reload opens the pinned fluxvm_fct4 again, after a tier change
// replaced it.
func (n *gcNode) reload(t *testing.T) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(n.opts.Loader.PinRoot, "maps", "fluxvm_fct4"), nil)
	if err != nil {
		t.Fatal(err)
	}
	n.ct4.Close()
	n.ct4 = m
}

func (n *gcNode) present(t *testing.T, k bpf.Tuple4) bool {
	var v bpf.CTValue
	err := n.ct4.Lookup(k, &v)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Error(err)
	}
	return err == nil
}

// TestGCTimerAcrossRestarts restarts the dataplane every half GC interval
// (400 ms) for five intervals while expired flows are written into its
// conntrack map every 50 ms: every flow is removed within the period (the
// time no process was running aside, when the next one to start runs the
// overdue GC at once), so no two GCs are further apart than that. Before
// the timer counted from the last GC, each start waited a whole interval
// and the flows stayed.
func TestGCTimerAcrossRestarts(t *testing.T) {
	const (
		base   = 400 * time.Millisecond
		life   = base / 2
		rounds = 10                     // five intervals
		slack  = 250 * time.Millisecond // the poll, the scheduler of a shared machine
	)
	n := newGCNode(t, base)
	d := n.open(t)

	type flow struct {
		key     bpf.Tuple4
		written time.Time
	}
	var (
		mu      sync.Mutex
		latency []time.Duration // of each flow removed
		pending []flow
	)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			mu.Lock()
			if i%5 == 0 {
				pending = append(pending, flow{n.expired(t), time.Now()})
			}
			left := pending[:0]
			for _, f := range pending {
				if n.present(t, f.key) {
					left = append(left, f)
					continue
				}
				latency = append(latency, time.Since(f.written))
			}
			pending = left
			mu.Unlock()
		}
	}()

	// Restarts: each process lives half an interval; down is the longest
	// time between two (Close, then Open up to its timer's start).
	var down, closing time.Duration
	for range rounds {
		time.Sleep(life)
		start := time.Now()
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		closing = max(closing, time.Since(start))
		d = n.open(t)
		down = max(down, time.Since(start))
	}
	close(stop)
	<-done

	bound := base + down + slack
	var worst time.Duration
	for _, l := range latency {
		worst = max(worst, l)
	}
	t.Logf("%d restarts, longest down %v (Close %v): %d expired flows removed, longest after %v (bound %v); %d still there",
		rounds, down, closing, len(latency), worst, bound, len(pending))
	if worst > bound {
		t.Errorf("an expired flow was removed %v after it was written: two GCs further apart than the period %v (+%v down, +%v)",
			worst, base, down, slack)
	}
	for _, f := range pending {
		if age := time.Since(f.written); age > bound {
			t.Errorf("an expired flow written %v ago is still in the map (bound %v)", age, bound)
			break
		}
	}
	if len(latency) < rounds {
		t.Errorf("%d flows removed over %d restarts", len(latency), rounds)
	}
}

// TestGCTimerCountsFromLastGC: a GC on demand moves the timer's next GC
// to one period after it; a restart with a tier change (which recreates
// the maps) keeps counting from the timer's last GC, in the period it
// adapted to (halved: its GC removed every flow it scanned).
func TestGCTimerCountsFromLastGC(t *testing.T) {
	const (
		base  = 2 * time.Second
		early = 50 * time.Millisecond  // the datapath's coarse clock, the timer's own slack
		late  = 500 * time.Millisecond // the scheduler of a shared machine
	)
	ctx := context.Background()
	n := newGCNode(t, base)
	d := n.open(t)
	opened := time.Now()
	time.Sleep(base / 2)
	manual, err := d.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	k := n.expired(t)

	// The timer's GC: one period after the one on demand, not after Open.
	timer := awaitGC(t, d, manual.At, base+late+time.Second)
	if gap := timer.At.Sub(manual.At); gap < base-early || gap > base+late {
		t.Fatalf("the timer's GC came %v after the one on demand (%v after Open), want %v", gap, timer.At.Sub(opened), base)
	}
	if timer.Expired != 1 || n.present(t, k) {
		t.Errorf("the timer's GC %+v: want the expired flow removed", timer)
	}
	p, err := d.Pressure(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	period := p.GCInterval.Duration
	if period != base/2 {
		t.Errorf("period after a GC that removed all it scanned: %v, want %v", period, base/2)
	}

	// A tier change: the next process counts from the timer's last GC,
	// in the adapted period (TestResumeGC checks the period it starts
	// with). An expired flow goes over with the migration.
	k = n.expired(t)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	n.opts.Loader.Tier = bpf.TierM
	d = n.open(t)
	up := time.Now()
	if !d.dp.Status().TierChanged {
		t.Fatalf("loader status %+v, want a tier change", d.dp.Status())
	}
	n.reload(t)
	due := timer.At.Add(period)
	next := awaitGC(t, d, time.Time{}, period+late+time.Second)
	t.Logf("on demand %v after Open, timer %v after it; tier change up %v after the timer's GC, its first GC %v after it (due %v)",
		manual.At.Sub(opened), timer.At.Sub(manual.At), up.Sub(timer.At), next.At.Sub(timer.At), period)
	switch {
	case up.Before(due) && next.At.Before(due.Add(-early)):
		t.Errorf("the first GC after the restart came %v after the last, before the period %v", next.At.Sub(timer.At), period)
	case next.At.After(later(due, up).Add(late)):
		t.Errorf("the first GC after the restart came %v after the last (up after %v), want %v", next.At.Sub(timer.At), up.Sub(timer.At), period)
	}
	if next.Expired != 1 || n.present(t, k) {
		t.Errorf("the first GC after the restart %+v: want the expired flow removed", next)
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// awaitGC waits until d's last GC is one that began after after, and
// returns it.
func awaitGC(t *testing.T, d *Dataplane, after time.Time, within time.Duration) GCResult {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if r := d.Status().LastGC; r != nil && r.At.After(after) {
			return *r
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("no GC within %v", within)
	return GCResult{}
}

// TestResumeGC: what the GC timer of a new process counts from, by what
// the pins hold: the last GC's mark, in the period it left while the
// configured one is the same; otherwise (no mark, a mark of another
// layout, one ahead of the clock) its own start, with the mark written
// at once.
func TestResumeGC(t *testing.T) {
	const base = 2 * time.Second
	n := newGCNode(t, -1) // the timer is started by hand below
	d := n.open(t)
	path := filepath.Join(n.opts.Loader.PinRoot, "maps", bpf.GCMarkPin)
	now, err := bpf.Now()
	if err != nil {
		t.Fatal(err)
	}
	ago := func(a time.Duration) uint64 { return uint64(now - a) }
	for _, tc := range []struct {
		name  string
		pin   func(t *testing.T) // what the pins hold
		every time.Duration      // the period the timer starts in
		wait  time.Duration      // roughly how long until its first GC
		fresh bool               // counts from now, the mark rewritten
	}{
		{"none", func(t *testing.T) {}, base, base, true},
		{"adapted", func(t *testing.T) {
			setGCMark(t, d, bpf.GCMark{Last: ago(300 * time.Millisecond), Period: uint64(base / 2), Base: uint64(base)})
		}, base / 2, base/2 - 300*time.Millisecond, false},
		{"stretched", func(t *testing.T) {
			setGCMark(t, d, bpf.GCMark{Last: ago(time.Second), Period: uint64(2 * base), Base: uint64(base)})
		}, 2 * base, 2*base - time.Second, false},
		{"overdue", func(t *testing.T) {
			setGCMark(t, d, bpf.GCMark{Last: ago(time.Minute), Period: uint64(base), Base: uint64(base)})
		}, base, 0, false},
		{"another configured period", func(t *testing.T) {
			setGCMark(t, d, bpf.GCMark{Last: ago(300 * time.Millisecond), Period: uint64(base), Base: uint64(3 * base)})
		}, base, base - 300*time.Millisecond, false},
		{"a timer-less GC", func(t *testing.T) {
			setGCMark(t, d, bpf.GCMark{Last: ago(300 * time.Millisecond)})
		}, base, base - 300*time.Millisecond, false},
		{"period out of bounds", func(t *testing.T) {
			setGCMark(t, d, bpf.GCMark{Last: ago(300 * time.Millisecond), Period: uint64(5 * base), Base: uint64(base)})
		}, base, base - 300*time.Millisecond, false},
		{"ahead of the clock", func(t *testing.T) {
			setGCMark(t, d, bpf.GCMark{Last: uint64(now + time.Hour), Period: uint64(base), Base: uint64(base)})
		}, base, base, true},
		{"another layout", func(t *testing.T) {
			m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if err := m.Pin(path); err != nil {
				t.Fatal(err)
			}
		}, base, base, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Fatal(err)
			}
			tc.pin(t)
			before, err := bpf.Now()
			if err != nil {
				t.Fatal(err)
			}
			// The timer's GC (due at once when overdue) does not run:
			// the mark stays as the start left it.
			gt, err := gctimer.New(gctimer.Config{Base: base, Min: MinConntrackGCInterval},
				gctimer.Deps{Marks: d.dp, GC: func(context.Context) (GCResult, error) { return GCResult{}, ErrClosed }})
			if err != nil {
				t.Fatal(err)
			}
			gt.Start()
			defer gt.Close()
			if every := gt.Status().Interval; every != tc.every {
				t.Errorf("period %v, want %v", every, tc.every)
			}
			// The clock has moved on since now: the wait is at most
			// what was asked, and not by much less.
			if w := gt.Wait(); w > tc.wait || w < tc.wait-time.Second/2 {
				t.Errorf("first GC in %v, want about %v", w, tc.wait)
			}
			m, err := d.dp.GCMark()
			switch {
			case err != nil:
				t.Errorf("mark after the start: %v", err)
			case tc.fresh && (time.Duration(m.Last) < before || m.Period != uint64(base) || m.Base != uint64(base)):
				t.Errorf("mark after the start %+v, want one counting from the start (%v) in %v", m, before, base)
			case !tc.fresh && time.Duration(m.Last) >= before:
				t.Errorf("mark after the start %+v: rewritten, want the last GC's kept", m)
			}
		})
	}
}

func setGCMark(t *testing.T, d *Dataplane, m bpf.GCMark) {
	t.Helper()
	if err := d.dp.SetGCMark(m); err != nil {
		t.Fatal(err)
	}
}
