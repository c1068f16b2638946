package fluxvm

import (
	"context"
	"fmt"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/gctimer"
	"github.com/fluxvm/servicefabric/fluxvm/internal/pressure"
)

// Map pressure control (pressure_soft_percent, pressure_hard_percent):
// package fluxvm/internal/pressure decides (the levels, when a round
// runs, what it does: a GC, shedding with growing horizons, the hard
// action; its loop), this file gives it what it needs from the dataplane
// (pressureDeps: the levels read under d.mu, the insert failures, GC,
// shedding, growing a map, the compaction of compact.go). Datapath insert
// failures (drops ct_update, nat_update) are read every twentieth of the
// interval (100 ms by default) and start a round at once whatever the
// levels.
const (
	DefaultPressureSoftPercent = 80
	DefaultPressureHardPercent = 95
	// DefaultPressureInterval is how often the controller reads the
	// levels.
	DefaultPressureInterval = 2 * time.Second
)

// Pressure levels.
const (
	PressureOK   = pressure.LevelOK
	PressureSoft = pressure.LevelSoft
	PressureHard = pressure.LevelHard
)

// The map pressure status types (package fluxvm/internal/pressure's).
type (
	// MapPressure is one map's fill.
	MapPressure = pressure.Fill
	// PressureStatus is the fill of the datapath's hash maps and what the
	// controller last did.
	PressureStatus = pressure.Status
	// PressureRound is what one round did.
	PressureRound = pressure.Round
	// PressureCompaction is what a round's hard action did (compact.go).
	PressureCompaction = pressure.Compaction
)

// newPressure makes the controller (started at the end of Open);
// Options.Validate has checked the thresholds, WithDefaults filled them.
func (d *Dataplane) newPressure() (*pressure.Controller, error) {
	return pressure.New(pressure.Config{SoftPercent: d.opts.Pressure.SoftPercent, HardPercent: d.opts.Pressure.HardPercent,
		Interval: d.opts.Pressure.Interval, Timeouts: d.opts.Timeouts, Logger: d.log},
		pressure.Deps{Dataplane: pressureDeps{d}})
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

// pressureStatus reads the levels; the caller holds mu and checked that
// the dataplane is open.
func (d *Dataplane) pressureStatus() (PressureStatus, error) {
	st, err := d.pressure.StatusOf(d.readPressure())
	if err != nil {
		return st, fmt.Errorf("fluxvm: %w", err)
	}
	return st, nil
}

// readPressure reads the fill of every hash map and the insert failures;
// the caller holds mu and checked that the dataplane is open.
func (d *Dataplane) readPressure() pressure.Reading {
	r := pressure.Reading{GCInterval: d.gcTimer.Status().Interval}
	r.InsertFailures, _ = d.insertFailures()
	if r.Fills, r.Err = d.dp.MapEntries(); r.Err != nil {
		return r
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
			r.Fills[t.name] = bpf.MapFill{Entries: int64(t.n), MaxEntries: t.m.MaxEntries()}
		}
	}
	return r
}

// insertFailures sums the datapath's failed flow inserts: two per-CPU
// slots of fluxvm_drops, cheap enough to read every failure check. The
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

// ReconcilePressure runs one round now and returns what it did: when a
// flow map is above the soft threshold, a GC, then shedding with growing
// horizons while a flow map stays above it, then, while one is at the
// hard threshold, the hard action (compact.go). A round with nothing
// over the threshold does nothing.
func (d *Dataplane) ReconcilePressure(ctx context.Context) (PressureRound, error) {
	if err := d.begin(ctx, "reconcile pressure"); err != nil {
		return PressureRound{}, err
	}
	r, err := d.pressure.Round(ctx, 0)
	if err != nil {
		return r, fmt.Errorf("fluxvm: %w", err)
	}
	return r, nil
}

// pressureDeps is what the controller needs of the dataplane
// (pressure.Dataplane). The controller calls it without d.mu held; each
// method takes what it needs.
type pressureDeps struct{ d *Dataplane }

func (p pressureDeps) Read() pressure.Reading {
	d := p.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return pressure.Reading{Err: ErrClosed}
	}
	return d.readPressure()
}

func (p pressureDeps) InsertFailures() (uint64, error) {
	d := p.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("pressure"); err != nil {
		return 0, err
	}
	return d.insertFailures()
}

func (p pressureDeps) GC(ctx context.Context) (gctimer.Result, error) { return p.d.GC(ctx) }

func (p pressureDeps) Shed(ctx context.Context, horizon time.Duration) (conntrack.ShedCounts, error) {
	res, err := p.d.shed(ctx, horizon)
	return res.Shed, err
}

func (p pressureDeps) Grow(over []string) bool { return p.d.growUnderPressure(over) }

func (p pressureDeps) Compact(keep map[string]int) (*PressureCompaction, error) {
	return p.d.compactFlows(keep)
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
