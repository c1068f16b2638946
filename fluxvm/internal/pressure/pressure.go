// Package pressure is the map pressure controller of the dataplane
// (pressure_soft_percent, pressure_hard_percent, pressure_interval), a
// component of package fluxvm.
//
// It reads the fill level of every hash map of the datapath every
// Config.Interval (through the kernel's own count: one walk of the map
// table, under a millisecond at tier L) and, when a flow map (conntrack,
// reverse NAT) is above the soft threshold, runs a round that makes room:
// a map below its tier's capacity grows first; otherwise a GC now, then,
// while still above it, the flows closest to their end shed first
// (conntrack.Shed: every closed TCP flow, then UDP flows idle for a
// quarter of their timeout and handshakes that long unanswered;
// established TCP flows, with timeouts of hours, are never reached by
// these horizons). A family's conntrack map still at or above the hard
// threshold after that is rebuilt by rank (the hard action: Plan decides
// which map keeps how many entries, the facade compacts). Datapath insert
// failures (drops ct_update, nat_update) are read every twentieth of the
// interval (100 ms by default) and start a round at once whatever the
// levels. A round that frees nothing is not repeated every tick (the
// ticks skipped double, up to a minute at the default interval).
//
// What it owns: the thresholds, the last round and the count of rounds,
// when the last compaction failed (the next waits CompactRetry), the
// insert failures seen, its loop goroutine. Its lock (mu) serializes
// rounds; stMu guards what Status reports. What it needs is the
// Dataplane interface of its Deps, which the facade implements: read the
// levels, run a GC, shed, grow, compact.
//
// Lock order: the facade may call StatusOf and Level with its own lock
// (d.mu) held; this component's status lock is taken after it, never
// before. Status, Round, Start and Close call the Dataplane (which takes
// d.mu as it needs): the facade calls them without d.mu. A round holds
// the component's round lock while it calls the Dataplane; the facade
// never waits for that lock while holding d.mu. No Dataplane method is
// called with the status lock held.
package pressure

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/duration"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
	"github.com/fluxvm/servicefabric/fluxvm/internal/gctimer"
)

// Levels.
const (
	LevelOK   = "ok"
	LevelSoft = "soft"
	LevelHard = "hard"
)

// FlowMaps are the maps a round can make room in: flows.
var FlowMaps = []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"}

// CompactRetry is how long the controller waits after a compaction that
// failed before it tries another (each costs a copy of the map and a
// program load).
const CompactRetry = time.Minute

// maxBackoff bounds the ticks skipped after rounds that freed nothing (a
// minute at the default interval).
const maxBackoff = 32

// Reading is one reading of the datapath's maps (Dataplane.Read).
type Reading struct {
	// Fills are every hash map's entries by name; Err is why they could
	// not be read (one matching bpf.ErrMapCountUnsupported: the kernel
	// cannot count, before 6.6; errs.ErrClosed: the dataplane closed).
	Fills map[string]bpf.MapFill
	Err   error
	// InsertFailures are the datapath's failed flow inserts so far.
	InsertFailures uint64
	// GCInterval is the GC timer's period now.
	GCInterval time.Duration
}

// Dataplane is what the controller needs from the rest of the dataplane.
// Each method takes the facade's locks it needs; none is called with the
// component's status lock held.
type Dataplane interface {
	// Read reads the levels now.
	Read() Reading
	// InsertFailures sums the datapath's failed flow inserts so far (the
	// loop reads it every failure check).
	InsertFailures() (uint64, error)
	// GC runs a conntrack GC now (the GC timer counts from it).
	GC(ctx context.Context) (gctimer.Result, error)
	// Shed removes the flows closest to their end up to horizon
	// (conntrack.Map.Shed).
	Shed(ctx context.Context, horizon time.Duration) (conntrack.ShedCounts, error)
	// Grow grows to their tier's capacity the flow maps of over that are
	// below it, and reports whether it grew one. Every round calls it,
	// over empty or not.
	Grow(over []string) bool
	// Compact rebuilds the conntrack maps of keep with that many entries
	// each (the hard action); a Compaction with Deferred set says it
	// could not now. Its error is the compaction's failure.
	Compact(keep map[string]int) (*Compaction, error)
}

// Config is the controller's configuration (fluxvm.Options.Pressure after
// WithDefaults, and the conntrack timeouts).
type Config struct {
	// SoftPercent and HardPercent are the thresholds: 1..100, soft below
	// hard (no zero: the facade fills the defaults).
	SoftPercent, HardPercent int
	// Interval is how often the loop reads the levels; 0 or negative: no
	// loop (Round only).
	Interval time.Duration
	// Timeouts are the conntrack timeouts, which set the shedding
	// horizons.
	Timeouts conntrack.Timeouts
	// Logger receives the rounds; nil discards them.
	Logger *slog.Logger
}

// Deps is what the controller needs.
type Deps struct {
	// Dataplane is required.
	Dataplane Dataplane
}

// Controller is the component. Its zero value is not usable: call New.
type Controller struct {
	cfg  Config
	dp   Dataplane
	log  *slog.Logger
	stop chan struct{}
	done chan struct{} // closed when the loop ended (nil: none started)

	mu     sync.Mutex // serializes rounds (and Close's wait for one)
	closed bool       // under mu: Round fails with ErrClosed
	// compactFailed is when the last compaction failed (zero: none did),
	// under mu.
	compactFailed time.Time

	stMu   sync.Mutex // guards the fields below (and done)
	last   *Round
	rounds uint64
}

// New checks cfg and returns the controller; it starts nothing.
func New(cfg Config, deps Deps) (*Controller, error) {
	if deps.Dataplane == nil {
		return nil, errors.New("pressure: Deps.Dataplane is required")
	}
	if cfg.SoftPercent < 1 || cfg.HardPercent > 100 || cfg.SoftPercent >= cfg.HardPercent {
		return nil, fmt.Errorf("pressure: thresholds %d%% and %d%%: want 1..100, soft below hard", cfg.SoftPercent, cfg.HardPercent)
	}
	c := &Controller{cfg: cfg, dp: deps.Dataplane, log: cfg.Logger, stop: make(chan struct{})}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	return c, nil
}

// Start starts the loop (with an Interval; once, and not after Close).
func (c *Controller) Start() {
	c.stMu.Lock()
	defer c.stMu.Unlock()
	if c.cfg.Interval <= 0 || c.done != nil {
		return
	}
	select {
	case <-c.stop:
		return
	default:
	}
	c.done = make(chan struct{})
	go c.loop(c.done)
}

// Close stops the loop and waits for it and for a round in progress (the
// facade cancels the round's GC and shedding first). Rounds after it fail
// with an error matching errs.ErrClosed. Idempotent; call it without the
// facade's lock.
func (c *Controller) Close() error {
	c.stMu.Lock()
	select {
	case <-c.stop:
	default:
		close(c.stop)
	}
	done := c.done
	c.stMu.Unlock()
	if done != nil {
		<-done
	}
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	return nil
}

// Level is the level of percent p.
func (c *Controller) Level(p float64) string {
	switch {
	case p >= float64(c.cfg.HardPercent):
		return LevelHard
	case p >= float64(c.cfg.SoftPercent):
		return LevelSoft
	}
	return LevelOK
}

// Status reads the levels (Dataplane.Read) and returns them with what the
// controller last did. Call it without the facade's lock; with it held,
// read the levels and call StatusOf.
func (c *Controller) Status() (Status, error) { return c.StatusOf(c.dp.Read()) }

// StatusOf is the status with the levels of r. Its error says why r
// holds no levels (Status.Error says it too, and Status.Unsupported when
// the kernel cannot count).
func (c *Controller) StatusOf(r Reading) (Status, error) {
	st := Status{SoftPercent: c.cfg.SoftPercent, HardPercent: c.cfg.HardPercent, Level: LevelOK,
		InsertFailures: r.InsertFailures, GCInterval: duration.Duration{Duration: r.GCInterval}}
	c.stMu.Lock()
	st.LastRound, st.Rounds = c.last, c.rounds
	c.stMu.Unlock()
	if r.Err != nil {
		st.Error, st.Unsupported = r.Err.Error(), errors.Is(r.Err, bpf.ErrMapCountUnsupported)
		return st, fmt.Errorf("pressure: %w", r.Err)
	}
	st.Maps = make(map[string]Fill, len(r.Fills))
	for name, f := range r.Fills {
		st.Maps[name] = Fill{Entries: f.Entries, MaxEntries: f.MaxEntries, Percent: f.Percent()}
	}
	for _, name := range FlowMaps {
		if l := c.Level(st.Maps[name].Percent); l == LevelHard || (l == LevelSoft && st.Level == LevelOK) {
			st.Level = l
		}
	}
	return st, nil
}

// over are the flow maps of st at or above the soft threshold.
func (c *Controller) over(st Status) []string {
	var out []string
	for _, name := range FlowMaps {
		if st.Maps[name].Percent >= float64(c.cfg.SoftPercent) {
			out = append(out, name)
		}
	}
	return out
}

// Horizons are the shedding horizons of a round, in order: past closed
// TCP flows (FIN, RST: all of them), then three quarters of the shorter
// of the UDP and SYN timeouts (UDP flows and handshakes idle for at least
// a quarter of it). Neither reaches past half the established timeout: an
// established flow goes only when it has been idle for more than half of
// its (hours, by default).
func Horizons(to conntrack.Timeouts) []time.Duration {
	reach := to.TCPEstablished / 2
	return []time.Duration{min(max(to.TCPFin, to.TCPRst), reach), min(min(to.UDP, to.TCPSyn)*3/4, reach)}
}

// Plan returns the conntrack maps a hard round rebuilds, with the
// entries each keeps: a family's fluxvm_fct map when it or its
// reverse-NAT map is at or above the hard threshold and it holds more
// than it would keep, kept to one point below the soft one (the flows
// learned while it is rebuilt, copied after the switch, do not put it
// straight back above).
func (c *Controller) Plan(st Status) map[string]int {
	keep := map[string]int{}
	for _, fam := range [][2]string{{"fluxvm_fct4", "fluxvm_nat4"}, {"fluxvm_fct6", "fluxvm_nat6"}} {
		ct, nt := st.Maps[fam[0]], st.Maps[fam[1]]
		if c.Level(ct.Percent) != LevelHard && c.Level(nt.Percent) != LevelHard {
			continue
		}
		if k := int(int64(ct.MaxEntries) * int64(c.cfg.SoftPercent-1) / 100); ct.Entries > int64(k) {
			keep[fam[0]] = k
		}
	}
	return keep
}

// Round runs one round now and returns what it did: when a flow map is
// above the soft threshold (or inserts failed: failures, the count since
// the previous round, 0 for a round on demand), a GC, then shedding with
// growing horizons while a flow map stays above it, then the hard action
// while one is at the hard threshold. A round with nothing over the
// threshold does nothing (and is not counted).
func (c *Controller) Round(ctx context.Context, failures uint64) (Round, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	start := time.Now()
	r := Round{At: start.UTC(), InsertFailures: failures}
	if c.closed {
		return r, fmt.Errorf("pressure: %w", errs.ErrClosed)
	}
	st, err := c.Status()
	if err != nil {
		if !st.Unsupported || failures == 0 {
			return r, err
		}
		// No levels on this kernel, but inserts failed: a GC at least.
		gc, err := c.dp.GC(ctx)
		if err != nil {
			return r, fmt.Errorf("pressure: %w", err)
		}
		r.GC, r.Duration = &gc, duration.Duration{Duration: time.Since(start)}
		return r, nil
	}
	r.Level = st.Level
	r.Over = c.over(st)
	// A map below its tier's capacity grows instead.
	if c.dp.Grow(r.Over) {
		if st, err = c.Status(); err != nil {
			return r, err
		}
		r.Over = c.over(st)
	}
	if len(r.Over) == 0 && failures == 0 {
		r.Duration = duration.Duration{Duration: time.Since(start)}
		return r, nil
	}
	gc, err := c.dp.GC(ctx)
	if err != nil {
		return r, fmt.Errorf("pressure: %w", err)
	}
	r.GC = &gc
	for _, h := range Horizons(c.cfg.Timeouts) {
		if st, err = c.Status(); err != nil {
			return r, err
		}
		if len(c.over(st)) == 0 {
			break
		}
		shed, err := c.dp.Shed(ctx, h)
		if err != nil {
			return r, fmt.Errorf("pressure: %w", err)
		}
		r.Shed.Closed += shed.Closed
		r.Shed.HalfOpen += shed.HalfOpen
		r.Shed.IdleUDP += shed.IdleUDP
		r.Shed.Established += shed.Established
		r.Horizon = duration.Duration{Duration: h}
	}
	// Still at the hard threshold: the hard action, then a GC for the
	// reverse-NAT halves of the flows it left out.
	if st, err = c.Status(); err == nil {
		r.Compaction = c.compact(ctx, c.Plan(st), r.GC)
	}
	if st, err = c.Status(); err == nil {
		r.After = map[string]float64{}
		for _, name := range FlowMaps {
			r.After[name] = st.Maps[name].Percent
		}
	}
	r.Duration = duration.Duration{Duration: time.Since(start)}
	c.stMu.Lock()
	c.last = &r
	c.rounds++
	c.stMu.Unlock()
	lvl := slog.LevelDebug
	if gc.Removed() > 0 || r.Shed.Total() > 0 {
		lvl = slog.LevelInfo
	}
	c.log.Log(ctx, lvl, "fluxvm: map pressure round", "level", r.Level, "over", strings.Join(r.Over, ","),
		"gc_removed", gc.Removed(), "shed_closed", r.Shed.Closed, "shed_half_open", r.Shed.HalfOpen,
		"shed_idle_udp", r.Shed.IdleUDP, "insert_failures", failures, "duration", r.Duration.Duration)
	return r, nil
}

// compact runs the hard action on the maps of keep (none: nothing), adds
// the GC that follows it to gc, and returns what it did. c.mu is held.
func (c *Controller) compact(ctx context.Context, keep map[string]int, gc *gctimer.Result) *Compaction {
	if len(keep) == 0 {
		return nil
	}
	if at := c.compactFailed; !at.IsZero() && time.Since(at) < CompactRetry {
		return &Compaction{Deferred: fmt.Sprintf("the last compaction failed %v ago; the next is tried %v after it",
			time.Since(at).Round(time.Second), CompactRetry)}
	}
	pc, err := c.dp.Compact(keep)
	if err != nil {
		c.compactFailed = time.Now()
		c.log.Error("fluxvm: map pressure: compaction failed", "err", fmt.Errorf("pressure: compact: %w", err))
		return pc
	}
	if pc == nil || len(pc.Maps) == 0 {
		return pc
	}
	if more, err := c.dp.GC(ctx); err == nil {
		gc.Orphans += more.Orphans
		gc.Expired += more.Expired
		gc.Drained += more.Drained
		gc.BackendGone += more.BackendGone
	}
	for _, m := range pc.Maps {
		c.log.Warn("fluxvm: map pressure at the hard threshold: flow map rebuilt", "map", m.Map,
			"kept", m.Kept, "dropped", m.Dropped, "dropped_by", m.DroppedBy, "caught_up", m.CaughtUp)
	}
	return pc
}

// FailureCheck is how often the loop reads the insert failures between
// two readings of the levels every: a failed insert wakes a round within
// it.
func FailureCheck(every time.Duration) time.Duration {
	return min(max(every/20, 20*time.Millisecond), every)
}

// loop reads the levels every interval and runs a round when a flow map
// is above the soft threshold or inserts failed since the last tick.
func (c *Controller) loop(done chan<- struct{}) {
	defer close(done)
	every := c.cfg.Interval
	t := time.NewTicker(every)
	defer t.Stop()
	// Insert failures are read more often than the levels: one wakes a
	// round at once, not at the next reading.
	ft := time.NewTicker(FailureCheck(every))
	defer ft.Stop()
	seen, _ := c.dp.InsertFailures()
	// A round that frees nothing (the maps are full of live, established
	// flows) is not repeated every tick: the ticks skipped double, up to
	// maxBackoff, until a round frees something, the level changes or
	// inserts fail.
	skip, backoff, lastLevel := 0, 0, LevelOK
	for {
		levels := false
		select {
		case <-c.stop:
			return
		case <-t.C:
			levels = true
		case <-ft.C:
		}
		f, err := c.dp.InsertFailures()
		var failed uint64
		if err == nil && f > seen {
			failed = f - seen
		}
		seen = max(seen, f)
		if !levels && failed == 0 {
			continue
		}
		st, err := c.Status()
		if err != nil {
			if errors.Is(err, errs.ErrClosed) {
				return
			}
			continue // a kernel that cannot count: nothing to control
		}
		if st.Level == LevelOK && failed == 0 {
			skip, backoff, lastLevel = 0, 0, LevelOK
			continue
		}
		if failed == 0 && st.Level == lastLevel && skip > 0 {
			skip--
			continue
		}
		lastLevel = st.Level
		ctx, cancel := context.WithTimeout(context.Background(), 10*every)
		r, err := c.Round(ctx, failed)
		cancel()
		switch {
		case err != nil && !errors.Is(err, errs.ErrClosed):
			c.log.Warn("fluxvm: map pressure round failed", "err", err)
		case err == nil && (r.GC == nil || r.GC.Removed()+r.Shed.Total() == 0):
			backoff = min(max(2*backoff, 1), maxBackoff)
			skip = backoff
		default:
			skip, backoff = 0, 0
		}
	}
}
