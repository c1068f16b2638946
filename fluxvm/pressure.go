package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
)

// Map pressure control (pressure_soft_percent, pressure_hard_percent):
// the fill level of every hash map of the datapath, read every
// DefaultPressureInterval through the kernel's own count (bpf.MapEntries:
// one walk of the map table, under a millisecond at tier L), and, when a
// flow map (conntrack, reverse NAT) is above the soft threshold, a round
// that makes room: a GC now, then, while still above it, the flows
// closest to their end shed first (conntrack.Shed: every closed TCP flow,
// then UDP flows idle for a quarter of their timeout and handshakes that
// long unanswered; established TCP flows, with timeouts of hours, are
// never reached by these horizons). A family's conntrack map still at or
// above the hard threshold after that is rebuilt by rank, with the pins
// and programs reloaded (compact.go). Datapath insert failures (drops
// ct_update, nat_update) are read every twentieth of the interval (100 ms
// by default) and start a round at once whatever the levels.
const (
	DefaultPressureSoftPercent = 80
	DefaultPressureHardPercent = 95
	// DefaultPressureInterval is how often the controller reads the
	// levels.
	DefaultPressureInterval = 2 * time.Second
)

// Pressure levels.
const (
	PressureOK   = "ok"
	PressureSoft = "soft"
	PressureHard = "hard"
)

// pressureMaps are the maps a round can make room in: flows.
var pressureMaps = []string{"fluxvm_fct4", "fluxvm_fct6", "fluxvm_nat4", "fluxvm_nat6"}

// MapPressure is one map's fill.
type MapPressure struct {
	Entries    int64   `json:"entries"`
	MaxEntries uint32  `json:"max_entries"`
	Percent    float64 `json:"percent"`
}

// PressureStatus is the fill of the datapath's hash maps and what the
// controller last did.
type PressureStatus struct {
	SoftPercent int `json:"soft_percent"`
	HardPercent int `json:"hard_percent"`
	// Level is the highest of the flow maps' levels: ok, soft or hard.
	Level string `json:"level"`
	// Maps are every hash map by name (flows, socket LB, policy, ...).
	Maps map[string]MapPressure `json:"maps,omitempty"`
	// InsertFailures are the datapath's failed flow inserts so far
	// (drops ct_update and nat_update).
	InsertFailures uint64 `json:"insert_failures"`
	// LastRound is the last round that acted; Rounds counts them.
	LastRound *PressureRound `json:"last_round,omitempty"`
	Rounds    uint64         `json:"rounds"`
	// GCInterval is the GC timer's period now (it adapts: shorter while
	// flows expire in bulk, longer when idle; 0: no timer). Its next GC
	// is due this long after the last GC began, whoever ran it (a round
	// included).
	GCInterval Duration `json:"gc_interval,omitzero"`
	// Error is why the levels could not be read; Unsupported says the
	// kernel cannot count (before 6.6): the controller then runs its GC
	// only when inserts fail.
	Error       string `json:"error,omitempty"`
	Unsupported bool   `json:"unsupported,omitempty"`
}

// PressureRound is what one round did.
type PressureRound struct {
	At time.Time `json:"at"`
	// Level and Over are the level and the flow maps above the soft
	// threshold when it started; After the flow maps' percent when it
	// ended.
	Level string             `json:"level"`
	Over  []string           `json:"over,omitempty"`
	After map[string]float64 `json:"after,omitempty"`
	// GC is the collection the round ran first, nil when nothing was over.
	GC *GCResult `json:"gc,omitempty"`
	// Shed counts the flows removed before their deadline, by state,
	// and Horizon the largest horizon used.
	Shed    conntrack.ShedCounts `json:"shed"`
	Horizon Duration             `json:"horizon,omitzero"`
	// Compaction is the hard action, when a flow map was still at the
	// hard threshold after the shedding (compact.go).
	Compaction *PressureCompaction `json:"compaction,omitempty"`
	// InsertFailures is how many failed inserts since the previous round
	// woke it (0: the levels did).
	InsertFailures uint64   `json:"insert_failures,omitempty"`
	Duration       Duration `json:"duration"`
}

// pressureCtl is the controller's state.
type pressureCtl struct {
	soft, hard int
	mu         sync.Mutex // serializes rounds
	stMu       sync.Mutex
	last       *PressureRound
	rounds     uint64
	failures   uint64 // insert failures seen by the last tick
	// compactFailed is when the last compaction failed (UnixNano), 0 if
	// none did (compact.go).
	compactFailed atomic.Int64
}

// pressureLevel is the level of percent p.
func (c *pressureCtl) level(p float64) string {
	switch {
	case p >= float64(c.hard):
		return PressureHard
	case p >= float64(c.soft):
		return PressureSoft
	}
	return PressureOK
}

// Pressure reads the fill of the datapath's hash maps now. A ctx that
// ended before the read fails with an error wrapping ctx's.
func (d *Dataplane) Pressure(ctx context.Context) (PressureStatus, error) {
	if err := d.begin(ctx, "pressure"); err != nil {
		return PressureStatus{}, err
	}
	// Under mu, as Status: Close cannot release the maps meanwhile.
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("pressure"); err != nil {
		return PressureStatus{}, err
	}
	if err := ctxErr(ctx, "pressure"); err != nil {
		return PressureStatus{}, err
	}
	return d.pressureStatus()
}

// pressureStatus reads the levels; the caller checked that the
// dataplane is open (Status holds mu meanwhile: it takes none).
func (d *Dataplane) pressureStatus() (PressureStatus, error) {
	c := d.pressure
	st := PressureStatus{SoftPercent: c.soft, HardPercent: c.hard, Level: PressureOK,
		GCInterval: Duration{time.Duration(d.gcEvery.Load())}}
	c.stMu.Lock()
	st.LastRound, st.Rounds = c.last, c.rounds
	c.stMu.Unlock()
	st.InsertFailures, _ = d.insertFailures()
	fills, err := d.dp.MapEntries()
	if err != nil {
		st.Error, st.Unsupported = err.Error(), errors.Is(err, bpf.ErrMapCountUnsupported)
		return st, fmt.Errorf("fluxvm: pressure: %w", err)
	}
	st.Maps = make(map[string]MapPressure, len(fills))
	for name, f := range fills {
		st.Maps[name] = MapPressure{Entries: f.Entries, MaxEntries: f.MaxEntries, Percent: f.Percent()}
	}
	// The identity LPM tries keep their count from the kernel's map
	// iterator; only the control plane writes them, so what it wrote is
	// what they hold.
	m := d.dp.Maps()
	v4, v6 := d.pol.IPCacheSizes()
	for _, t := range []struct {
		name string
		m    *ebpf.Map
		n    int
	}{{"fluxvm_sid4", m.FluxvmSid4, v4}, {"fluxvm_sid6", m.FluxvmSid6, v6}} {
		if t.m != nil {
			f := bpf.MapFill{Entries: int64(t.n), MaxEntries: t.m.MaxEntries()}
			st.Maps[t.name] = MapPressure{Entries: f.Entries, MaxEntries: f.MaxEntries, Percent: f.Percent()}
		}
	}
	for _, name := range pressureMaps {
		if l := c.level(st.Maps[name].Percent); l == PressureHard || (l == PressureSoft && st.Level == PressureOK) {
			st.Level = l
		}
	}
	return st, nil
}

// insertFailures sums the datapath's failed flow inserts: two per-CPU
// slots of fluxvm_drops, cheap enough to read every failureCheck. The
// caller holds mu (a compaction replaces the datapath's map handles).
func (d *Dataplane) insertFailures() (uint64, error) {
	m := d.dp.Maps().FluxvmDrops
	if m == nil {
		return 0, ErrClosed
	}
	var sum uint64
	var perCPU []uint64
	for _, r := range []bpf.DropReason{bpf.DropCTUpdate, bpf.DropNATUpdate} {
		if err := m.Lookup(uint32(r), &perCPU); err != nil {
			return 0, fmt.Errorf("read drops: %w", err)
		}
		for _, v := range perCPU {
			sum += v
		}
	}
	return sum, nil
}

// failureCheck is how often the controller's loop reads the insert
// failures between two readings of the levels: a failed insert wakes a
// round within it.
func failureCheck(every time.Duration) time.Duration {
	return min(max(every/20, 20*time.Millisecond), every)
}

// ReconcilePressure runs one round now and returns what it did: when a
// flow map is above the soft threshold (or force, as when inserts failed),
// a GC, then shedding with growing horizons while a flow map stays above
// it. A round with nothing over the threshold does nothing.
func (d *Dataplane) ReconcilePressure(ctx context.Context) (PressureRound, error) {
	if err := d.opened("reconcile pressure"); err != nil {
		return PressureRound{}, err
	}
	return d.pressureRound(ctx, 0)
}

func (d *Dataplane) pressureRound(ctx context.Context, failures uint64) (PressureRound, error) {
	c := d.pressure
	c.mu.Lock()
	defer c.mu.Unlock()
	start := time.Now()
	r := PressureRound{At: start.UTC(), InsertFailures: failures}
	st, err := d.Pressure(ctx)
	if err != nil {
		if !st.Unsupported || failures == 0 {
			return r, err
		}
		// No levels on this kernel, but inserts failed: a GC at least.
		gc, err := d.GC(ctx)
		if err != nil {
			return r, fmt.Errorf("fluxvm: pressure: %w", err)
		}
		r.GC, r.Duration = &gc, Duration{time.Since(start)}
		return r, nil
	}
	r.Level = st.Level
	over := func(st PressureStatus) []string {
		var out []string
		for _, name := range pressureMaps {
			if st.Maps[name].Percent >= float64(c.soft) {
				out = append(out, name)
			}
		}
		return out
	}
	r.Over = over(st)
	// A map below its tier's capacity grows instead (sizing.go).
	if d.growUnderPressure(r.Over) {
		if st, err = d.Pressure(ctx); err != nil {
			return r, err
		}
		r.Over = over(st)
	}
	if len(r.Over) == 0 && failures == 0 {
		r.Duration = Duration{time.Since(start)}
		return r, nil
	}
	gc, err := d.GC(ctx)
	if err != nil {
		return r, fmt.Errorf("fluxvm: pressure: %w", err)
	}
	r.GC = &gc
	// The horizons: past closed TCP flows (FIN, RST: all of them), then
	// three quarters of the shorter of the UDP and SYN timeouts (UDP
	// flows and handshakes idle for at least a quarter of it). Neither
	// reaches past half the established timeout: an established flow goes
	// only when it has been idle for more than half of its (hours, by
	// default).
	to := d.opts.Timeouts
	reach := to.TCPEstablished / 2
	horizons := []time.Duration{min(max(to.TCPFin, to.TCPRst), reach), min(min(to.UDP, to.TCPSyn)*3/4, reach)}
	for _, h := range horizons {
		if st, err = d.Pressure(ctx); err != nil {
			return r, err
		}
		if len(over(st)) == 0 {
			break
		}
		res, err := d.shed(ctx, h)
		if err != nil {
			return r, fmt.Errorf("fluxvm: pressure: %w", err)
		}
		r.Shed.Closed += res.Shed.Closed
		r.Shed.HalfOpen += res.Shed.HalfOpen
		r.Shed.IdleUDP += res.Shed.IdleUDP
		r.Shed.Established += res.Shed.Established
		r.Horizon = Duration{h}
	}
	// Still at the hard threshold: the hard action (compact.go), then a
	// GC for the reverse-NAT halves of the flows it left out.
	if st, err = d.Pressure(ctx); err == nil {
		if keep := d.compactionPlan(st); len(keep) > 0 {
			pc, cerr := d.compactFlows(keep)
			r.Compaction = pc
			if cerr != nil {
				d.log.Error("fluxvm: map pressure: compaction failed", "err", cerr)
			} else if pc != nil && len(pc.Maps) > 0 {
				if gc, err := d.GC(ctx); err == nil {
					r.GC.Orphans += gc.Orphans
					r.GC.Expired += gc.Expired
					r.GC.Drained += gc.Drained
					r.GC.BackendGone += gc.BackendGone
				}
				for _, m := range pc.Maps {
					d.log.Warn("fluxvm: map pressure at the hard threshold: flow map rebuilt", "map", m.Map,
						"kept", m.Kept, "dropped", m.Dropped, "dropped_by", m.DroppedBy, "caught_up", m.CaughtUp)
				}
			}
		}
	}
	if st, err = d.Pressure(ctx); err == nil {
		r.After = map[string]float64{}
		for _, name := range pressureMaps {
			r.After[name] = st.Maps[name].Percent
		}
	}
	r.Duration = Duration{time.Since(start)}
	c.stMu.Lock()
	c.last = &r
	c.rounds++
	c.stMu.Unlock()
	lvl := slog.LevelDebug
	if gc.Expired+gc.Drained+gc.BackendGone > 0 || r.Shed.Total() > 0 {
		lvl = slog.LevelInfo
	}
	d.log.Log(ctx, lvl, "fluxvm: map pressure round", "level", r.Level, "over", strings.Join(r.Over, ","),
		"gc_removed", gc.Expired+gc.Drained+gc.BackendGone, "shed_closed", r.Shed.Closed, "shed_half_open", r.Shed.HalfOpen,
		"shed_idle_udp", r.Shed.IdleUDP, "insert_failures", failures, "duration", r.Duration.Duration)
	return r, nil
}

// shed runs conntrack.Shed with horizon, as GC runs the collection (one
// at a time with it, cancelled by Close).
func (d *Dataplane) shed(ctx context.Context, horizon time.Duration) (conntrack.GCResult, error) {
	now, err := conntrack.Now()
	if err != nil {
		return conntrack.GCResult{}, err
	}
	d.flowMu.RLock()
	defer d.flowMu.RUnlock()
	d.mu.Lock()
	if err := d.checkOpen("shed"); err != nil {
		d.mu.Unlock()
		return conntrack.GCResult{}, err
	}
	d.gcRuns.Add(1)
	defer d.gcRuns.Done()
	d.mu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(d.gcCtx, cancel)()
	res, err := d.ct.Shed(ctx, now, horizon)
	if err != nil && d.gcCtx.Err() != nil {
		return res, fmt.Errorf("shed: interrupted by Close: %w", ErrClosed)
	}
	return res, err
}

// pressureLoop reads the levels every interval and runs a round when a
// flow map is above the soft threshold or inserts failed since the last
// tick.
func (d *Dataplane) pressureLoop(every time.Duration, stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(every)
	defer t.Stop()
	// Insert failures are read more often than the levels: one wakes a
	// round at once, not at the next reading.
	ft := time.NewTicker(failureCheck(every))
	defer ft.Stop()
	c := d.pressure
	// Under mu: a compaction replaces the datapath's map handles.
	failures := func() (uint64, error) {
		d.mu.Lock()
		defer d.mu.Unlock()
		if err := d.checkOpen("pressure"); err != nil {
			return 0, err
		}
		return d.insertFailures()
	}
	c.failures, _ = failures()
	// A round that frees nothing (the maps are full of live, established
	// flows) is not repeated every tick: the ticks skipped double, up to
	// maxPressureBackoff, until a round frees something, the level
	// changes or inserts fail.
	skip, backoff, lastLevel := 0, 0, PressureOK
	for {
		levels := false
		select {
		case <-stop:
			return
		case <-t.C:
			levels = true
		case <-ft.C:
		}
		f, err := failures()
		var failed uint64
		if err == nil && f > c.failures {
			failed = f - c.failures
		}
		c.failures = max(c.failures, f)
		if !levels && failed == 0 {
			continue
		}
		st, err := d.Pressure(context.Background())
		if err != nil {
			if errors.Is(err, ErrClosed) {
				return
			}
			continue // a kernel that cannot count: nothing to control
		}
		if st.Level == PressureOK && failed == 0 {
			skip, backoff, lastLevel = 0, 0, PressureOK
			continue
		}
		if failed == 0 && st.Level == lastLevel && skip > 0 {
			skip--
			continue
		}
		lastLevel = st.Level
		ctx, cancel := context.WithTimeout(context.Background(), 10*every)
		r, err := d.pressureRound(ctx, failed)
		cancel()
		switch {
		case err != nil && !errors.Is(err, ErrClosed):
			d.log.Warn("fluxvm: map pressure round failed", "err", err)
		case err == nil && (r.GC == nil || r.GC.Expired+r.GC.Drained+r.GC.BackendGone+r.Shed.Total() == 0):
			backoff = min(max(2*backoff, 1), maxPressureBackoff)
			skip = backoff
		default:
			skip, backoff = 0, 0
		}
	}
}

// maxPressureBackoff bounds the ticks skipped after rounds that freed
// nothing (a minute at the default interval).
const maxPressureBackoff = 32

// newPressureCtl checks the thresholds of o.
func newPressureCtl(o Options) (*pressureCtl, error) {
	// Options.Validate has checked the thresholds, WithDefaults filled
	// them.
	return &pressureCtl{soft: o.Pressure.SoftPercent, hard: o.Pressure.HardPercent}, nil
}

// stopPressure stops the controller's loop and waits for it (a round in
// progress ends: Close cancels its GC). Call it after markClosed, without
// mu.
func (d *Dataplane) stopPressure() {
	if d.pstop != nil {
		close(d.pstop)
		<-d.pdone
		d.pstop = nil
	}
}
