package pressure

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
	"github.com/fluxvm/servicefabric/fluxvm/internal/gctimer"
)

const capacity = 1000 // every map's, in the fake

// fakeDP is a dataplane in memory: each map's entries, and what the
// controller asked of it. GC removes gcFree entries of each flow map
// over, Shed shedFree[horizon index] of fluxvm_fct4, Grow doubles a map
// when grow is set, Compact keeps what it is told (or fails).
type fakeDP struct {
	mu       sync.Mutex
	entries  map[string]int64
	size     map[string]uint32
	readErr  error
	failures uint64
	gcFree   int64
	shedFree []int64 // by call
	grow     bool
	failComp error
	block    chan struct{} // GC waits on it when set
	inGC     chan struct{}

	calls []string
}

func newFake(entries map[string]int64) *fakeDP {
	f := &fakeDP{entries: entries, size: map[string]uint32{}}
	for name := range entries {
		f.size[name] = capacity
	}
	return f
}

func (f *fakeDP) call(s string, a ...any) {
	f.calls = append(f.calls, fmt.Sprintf(s, a...))
}

func (f *fakeDP) Read() Reading {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := Reading{InsertFailures: f.failures, GCInterval: 30 * time.Second, Err: f.readErr}
	if f.readErr == nil {
		r.Fills = map[string]bpf.MapFill{}
		for name, n := range f.entries {
			r.Fills[name] = bpf.MapFill{Entries: n, MaxEntries: f.size[name]}
		}
	}
	return r
}

func (f *fakeDP) InsertFailures() (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failures, nil
}

func (f *fakeDP) GC(ctx context.Context) (gctimer.Result, error) {
	f.mu.Lock()
	block, in := f.block, f.inGC
	f.mu.Unlock()
	if block != nil {
		in <- struct{}{}
		<-block
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.call("gc")
	var r gctimer.Result
	for _, name := range FlowMaps {
		n := min(f.gcFree, f.entries[name])
		if n > 0 && float64(f.entries[name])*100/float64(f.size[name]) >= 50 {
			f.entries[name] -= n
			r.Expired += int(n)
		}
		r.Scanned += int(f.entries[name])
	}
	return r, ctx.Err()
}

func (f *fakeDP) Shed(_ context.Context, h time.Duration) (conntrack.ShedCounts, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.call("shed %v", h)
	var n int64
	if len(f.shedFree) > 0 {
		n, f.shedFree = min(f.shedFree[0], f.entries["fluxvm_fct4"]), f.shedFree[1:]
	}
	f.entries["fluxvm_fct4"] -= n
	return conntrack.ShedCounts{Closed: int(n)}, nil
}

func (f *fakeDP) Grow(over []string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.call("grow %v", over)
	if !f.grow || len(over) == 0 {
		return false
	}
	for _, name := range over {
		f.size[name] *= 2
	}
	return true
}

func (f *fakeDP) Compact(keep map[string]int) (*Compaction, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.call("compact %v", keep)
	if f.failComp != nil {
		return &Compaction{Error: f.failComp.Error()}, f.failComp
	}
	pc := &Compaction{}
	for name, k := range keep {
		pc.Maps = append(pc.Maps, bpf.FlowMapCompaction{Map: name, Kept: k, Dropped: int(f.entries[name]) - k})
		f.entries[name] = int64(k)
		// The reverse-NAT halves of the dropped flows go with the GC.
		f.entries["fluxvm_nat"+name[len(name)-1:]] = int64(k)
	}
	return pc, nil
}

func (f *fakeDP) log() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func newController(t *testing.T, f *fakeDP, interval time.Duration) *Controller {
	t.Helper()
	to := conntrack.DefaultTimeouts()
	c, err := New(Config{SoftPercent: 80, HardPercent: 95, Interval: interval, Timeouts: to}, Deps{Dataplane: f})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func flows(ct4, nat4 int64) map[string]int64 {
	return map[string]int64{"fluxvm_fct4": ct4, "fluxvm_fct6": 0, "fluxvm_nat4": nat4, "fluxvm_nat6": 0, "fluxvm_sock": capacity}
}

// TestStatusLevels: the level is the highest of the flow maps' (socket
// LB's full map counts for nothing), at or above each threshold; a
// kernel that cannot count says so.
func TestStatusLevels(t *testing.T) {
	for _, tc := range []struct {
		name      string
		ct4, nat4 int64
		err       error
		level     string
		unsup     bool
	}{
		{name: "ok", ct4: 799, nat4: 10, level: LevelOK},
		{name: "soft at the threshold", ct4: 800, level: LevelSoft},
		{name: "soft by reverse NAT", ct4: 10, nat4: 900, level: LevelSoft},
		{name: "hard at the threshold", ct4: 950, nat4: 900, level: LevelHard},
		{name: "hard by reverse NAT", ct4: 850, nat4: 1000, level: LevelHard},
		{name: "cannot count", err: fmt.Errorf("map count: %w", bpf.ErrMapCountUnsupported), level: LevelOK, unsup: true},
		{name: "closed", err: errs.ErrClosed, level: LevelOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(flows(tc.ct4, tc.nat4))
			f.readErr, f.failures = tc.err, 7
			st, err := newController(t, f, 0).Status()
			if (err != nil) != (tc.err != nil) || (tc.err != nil && !errors.Is(err, tc.err)) {
				t.Fatalf("Status: %v, want %v", err, tc.err)
			}
			if st.Level != tc.level || st.Unsupported != tc.unsup || st.InsertFailures != 7 || st.GCInterval.Duration != 30*time.Second ||
				st.SoftPercent != 80 || st.HardPercent != 95 {
				t.Errorf("status %+v: want level %s, unsupported %t", st, tc.level, tc.unsup)
			}
			if tc.err == nil && st.Maps["fluxvm_fct4"] != (Fill{Entries: tc.ct4, MaxEntries: capacity, Percent: float64(tc.ct4) / 10}) {
				t.Errorf("fct4 %+v", st.Maps["fluxvm_fct4"])
			}
		})
	}
}

// TestRound: what a round does by the levels it finds and what each step
// frees, and what it reports.
func TestRound(t *testing.T) {
	to := conntrack.DefaultTimeouts()
	h := Horizons(to)
	if want := []time.Duration{to.TCPFin, to.UDP * 3 / 4}; !reflect.DeepEqual(h, want) {
		t.Fatalf("horizons %v, want %v", h, want)
	}
	for _, tc := range []struct {
		name      string
		ct4, nat4 int64
		failures  uint64
		gcFree    int64
		shedFree  []int64
		grow      bool
		calls     []string
		shed      int
		horizon   time.Duration
		compacted bool
		expired   int
		after     float64 // fct4's percent after, -1: not read
		counted   bool
	}{
		{name: "nothing over", ct4: 700, calls: []string{"grow []"}, after: -1},
		{name: "inserts failed, nothing over", ct4: 700, failures: 3, calls: []string{"grow []", "gc"}, after: 70, counted: true},
		{name: "the GC is enough", ct4: 850, gcFree: 100, calls: []string{"grow [fluxvm_fct4]", "gc"}, after: 75, counted: true},
		{name: "one horizon", ct4: 850, gcFree: 10, shedFree: []int64{100},
			calls: []string{"grow [fluxvm_fct4]", "gc", "shed " + h[0].String()}, shed: 100, horizon: h[0], after: 74, counted: true},
		{name: "both horizons", ct4: 850, gcFree: 10, shedFree: []int64{20, 30},
			calls: []string{"grow [fluxvm_fct4]", "gc", "shed " + h[0].String(), "shed " + h[1].String()}, shed: 50, horizon: h[1], after: 79, counted: true},
		{name: "grown instead", ct4: 850, grow: true, calls: []string{"grow [fluxvm_fct4]"}, after: -1},
		{name: "hard: compacted", ct4: 990, nat4: 990, gcFree: 5, shedFree: []int64{5, 5},
			calls: []string{"grow [fluxvm_fct4 fluxvm_nat4]", "gc", "shed " + h[0].String(), "shed " + h[1].String(), "compact map[fluxvm_fct4:790]", "gc"},
			shed:  10, horizon: h[1], compacted: true, expired: 20, after: 78.5, counted: true},
		{name: "hard by reverse NAT, conntrack below the kept count", ct4: 700, nat4: 990,
			calls: []string{"grow [fluxvm_nat4]", "gc", "shed " + h[0].String(), "shed " + h[1].String()}, horizon: h[1], after: 70, counted: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(flows(tc.ct4, tc.nat4))
			f.gcFree, f.shedFree, f.grow = tc.gcFree, tc.shedFree, tc.grow
			c := newController(t, f, 0)
			r, err := c.Round(context.Background(), tc.failures)
			if err != nil {
				t.Fatal(err)
			}
			if calls := f.log(); !reflect.DeepEqual(calls, tc.calls) {
				t.Errorf("calls %q, want %q", calls, tc.calls)
			}
			if r.Shed.Closed != tc.shed || r.Horizon.Duration != tc.horizon || (r.Compaction != nil) != tc.compacted || r.InsertFailures != tc.failures {
				t.Errorf("round %+v: want %d shed to %v, compacted %t", r, tc.shed, tc.horizon, tc.compacted)
			}
			if got, ok := r.After["fluxvm_fct4"]; (tc.after < 0) == ok || (ok && got != tc.after) {
				t.Errorf("fct4 after %v (%t), want %v", got, ok, tc.after)
			}
			if (r.GC != nil) != (len(tc.calls) > 1) {
				t.Errorf("round GC %+v after calls %q", r.GC, tc.calls)
			}
			if tc.compacted && r.GC.Expired != tc.expired {
				t.Errorf("round GC %+v: want both GCs counted", r.GC)
			}
			st, _ := c.Status()
			if n := st.Rounds; (n == 1) != tc.counted || (tc.counted && !reflect.DeepEqual(*st.LastRound, r)) {
				t.Errorf("status: %d rounds, last %+v; want counted %t", n, st.LastRound, tc.counted)
			}
		})
	}
}

// TestRoundCannotCount: on a kernel that cannot count, a round woken by
// insert failures runs a GC; one on demand fails, saying why.
func TestRoundCannotCount(t *testing.T) {
	f := newFake(flows(0, 0))
	f.readErr = bpf.ErrMapCountUnsupported
	c := newController(t, f, 0)
	if r, err := c.Round(context.Background(), 0); !errors.Is(err, bpf.ErrMapCountUnsupported) || r.GC != nil {
		t.Errorf("round on demand: %+v, %v; want the error, no GC", r, err)
	}
	if r, err := c.Round(context.Background(), 2); err != nil || r.GC == nil || !reflect.DeepEqual(f.log(), []string{"gc"}) {
		t.Errorf("round after failed inserts: %+v, %v, calls %q; want a GC", r, err, f.log())
	}
}

// TestCompactionRetry: after a failed compaction the next rounds within
// CompactRetry are deferred without compacting; a later one tries again.
func TestCompactionRetry(t *testing.T) {
	f := newFake(flows(990, 0))
	f.failComp = errors.New("cls_bpf")
	c := newController(t, f, 0)
	r, err := c.Round(context.Background(), 0)
	if err != nil || r.Compaction == nil || r.Compaction.Error != "cls_bpf" {
		t.Fatalf("round %+v, %v: want the failed compaction", r, err)
	}
	compacts := func() int {
		n := 0
		for _, s := range f.log() {
			if s == "compact map[fluxvm_fct4:790]" {
				n++
			}
		}
		return n
	}
	r, err = c.Round(context.Background(), 0)
	if err != nil || r.Compaction == nil || r.Compaction.Deferred == "" || compacts() != 1 {
		t.Errorf("round %+v, %v, %d compactions: want the next one deferred", r.Compaction, err, compacts())
	}
	c.mu.Lock()
	c.compactFailed = time.Now().Add(-CompactRetry)
	c.mu.Unlock()
	f.failComp = nil
	if r, err = c.Round(context.Background(), 0); err != nil || r.Compaction == nil || len(r.Compaction.Maps) != 1 || compacts() != 2 {
		t.Errorf("round %+v, %v, %d compactions: want one after CompactRetry", r.Compaction, err, compacts())
	}
}

// awaitRound waits for the controller's loop to have run n rounds.
func awaitRound(t *testing.T, c *Controller, n uint64, within time.Duration) Status {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		st, _ := c.Status()
		if st.Rounds >= n {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d rounds after %v, want %d", st.Rounds, within, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestLoopWakesOnInsertFailure: failed inserts wake a round within the
// failure check (50 ms here), long before the next reading of the levels
// (1 s), even with every map below the threshold.
func TestLoopWakesOnInsertFailure(t *testing.T) {
	f := newFake(flows(100, 0))
	f.failures = 40 // before the start: not this loop's
	c := newController(t, f, time.Second)
	c.Start()
	time.Sleep(100 * time.Millisecond)
	f.mu.Lock()
	f.failures += 3
	f.mu.Unlock()
	start := time.Now()
	st := awaitRound(t, c, 1, 900*time.Millisecond)
	if r := st.LastRound; r.InsertFailures != 3 || r.GC == nil {
		t.Errorf("round %+v: want one woken by 3 insert failures, with a GC", r)
	}
	t.Logf("the round came %v after the failures", time.Since(start))
}

// TestLoopBacksOff: the loop runs a round at a tick where a flow map is
// over; rounds that free nothing are not repeated every tick (1, 2, 4...
// ticks skipped), and one that frees something resets the pace.
func TestLoopBacksOff(t *testing.T) {
	const every = 20 * time.Millisecond
	f := newFake(flows(900, 0))
	c := newController(t, f, every)
	c.Start()
	awaitRound(t, c, 1, time.Second)
	time.Sleep(30 * every)
	st, _ := c.Status()
	// At most the ticks 1, 3, 6, 11, 20, 35 in the 31 ticks.
	if st.Rounds < 2 || st.Rounds > 6 {
		t.Errorf("%d rounds in 30 ticks of rounds that free nothing, want 2..6", st.Rounds)
	}
	f.mu.Lock()
	f.gcFree = 1 // from now on each GC frees one flow: no back-off
	f.mu.Unlock()
	// The pending skip (up to 16 ticks) ends, then a round every tick.
	time.Sleep(17 * every)
	before, _ := c.Status()
	time.Sleep(10 * every)
	after, _ := c.Status()
	if n := after.Rounds - before.Rounds; n < 5 {
		t.Errorf("%d rounds in 10 ticks of rounds that free flows, want about 10", n)
	}
}

// TestCloseWaitsForRound: Close returns only once the round in progress
// (the loop's and one on demand) has ended; a round after Close fails with
// ErrClosed and calls nothing.
func TestCloseWaitsForRound(t *testing.T) {
	for _, loop := range []bool{false, true} {
		t.Run(fmt.Sprintf("loop=%t", loop), func(t *testing.T) {
			f := newFake(flows(900, 0))
			f.block, f.inGC = make(chan struct{}), make(chan struct{}, 1)
			every := time.Duration(0)
			if loop {
				every = 10 * time.Millisecond
			}
			c := newController(t, f, every)
			c.Start()
			if !loop {
				go c.Round(context.Background(), 0)
			}
			<-f.inGC
			closed := make(chan struct{})
			go func() {
				c.Close()
				close(closed)
			}()
			select {
			case <-closed:
				t.Fatal("Close returned during a round")
			case <-time.After(100 * time.Millisecond):
			}
			f.mu.Lock()
			block := f.block
			f.block = nil
			f.mu.Unlock()
			close(block)
			select {
			case <-closed:
			case <-time.After(5 * time.Second):
				t.Fatal("Close did not return after the round")
			}
			n := len(f.log())
			if _, err := c.Round(context.Background(), 0); !errors.Is(err, errs.ErrClosed) || len(f.log()) != n {
				t.Errorf("round after Close: %v, calls %q", err, f.log()[n:])
			}
			if err := c.Close(); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestNew(t *testing.T) {
	f := newFake(flows(0, 0))
	for _, tc := range []struct {
		name string
		cfg  Config
		deps Deps
		ok   bool
	}{
		{"defaults", Config{SoftPercent: 80, HardPercent: 95}, Deps{Dataplane: f}, true},
		{"no dataplane", Config{SoftPercent: 80, HardPercent: 95}, Deps{}, false},
		{"zero thresholds", Config{}, Deps{Dataplane: f}, false},
		{"soft not below hard", Config{SoftPercent: 95, HardPercent: 95}, Deps{Dataplane: f}, false},
		{"hard above 100", Config{SoftPercent: 80, HardPercent: 101}, Deps{Dataplane: f}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(tc.cfg, tc.deps); (err == nil) != tc.ok {
				t.Errorf("New: %v, want ok %t", err, tc.ok)
			}
		})
	}
}
