package pressure

import (
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/fluxvm/internal/duration"
	"github.com/fluxvm/servicefabric/fluxvm/internal/gctimer"
)

// The status types package fluxvm exports (fluxvm.PressureStatus,
// PressureRound, MapPressure, PressureCompaction).

// Fill is one map's fill (fluxvm.MapPressure).
type Fill struct {
	Entries    int64   `json:"entries"`
	MaxEntries uint32  `json:"max_entries"`
	Percent    float64 `json:"percent"`
}

// Status is the fill of the datapath's hash maps and what the controller
// last did (fluxvm.PressureStatus).
type Status struct {
	SoftPercent int `json:"soft_percent"`
	HardPercent int `json:"hard_percent"`
	// Level is the highest of the flow maps' levels: ok, soft or hard.
	Level string `json:"level"`
	// Maps are every hash map by name (flows, socket LB, policy, ...).
	Maps map[string]Fill `json:"maps,omitempty"`
	// InsertFailures are the datapath's failed flow inserts so far
	// (drops ct_update and nat_update).
	InsertFailures uint64 `json:"insert_failures"`
	// LastRound is the last round that acted; Rounds counts them.
	LastRound *Round `json:"last_round,omitempty"`
	Rounds    uint64 `json:"rounds"`
	// GCInterval is the GC timer's period now (it adapts: shorter while
	// flows expire in bulk, longer when idle; 0: no timer). Its next GC
	// is due this long after the last GC began, whoever ran it (a round
	// included).
	GCInterval duration.Duration `json:"gc_interval,omitzero"`
	// Error is why the levels could not be read; Unsupported says the
	// kernel cannot count (before 6.6): the controller then runs its GC
	// only when inserts fail.
	Error       string `json:"error,omitempty"`
	Unsupported bool   `json:"unsupported,omitempty"`
}

// Round is what one round did (fluxvm.PressureRound).
type Round struct {
	At time.Time `json:"at"`
	// Level and Over are the level and the flow maps above the soft
	// threshold when it started; After the flow maps' percent when it
	// ended.
	Level string             `json:"level"`
	Over  []string           `json:"over,omitempty"`
	After map[string]float64 `json:"after,omitempty"`
	// GC is the collection the round ran first, nil when nothing was over.
	GC *gctimer.Result `json:"gc,omitempty"`
	// Shed counts the flows removed before their deadline, by state,
	// and Horizon the largest horizon used.
	Shed    conntrack.ShedCounts `json:"shed"`
	Horizon duration.Duration    `json:"horizon,omitzero"`
	// Compaction is the hard action, when a flow map was still at the
	// hard threshold after the shedding.
	Compaction *Compaction `json:"compaction,omitempty"`
	// InsertFailures is how many failed inserts since the previous round
	// woke it (0: the levels did).
	InsertFailures uint64            `json:"insert_failures,omitempty"`
	Duration       duration.Duration `json:"duration"`
}

// Compaction is what a round's hard action did
// (fluxvm.PressureCompaction).
type Compaction struct {
	// Maps are the flow maps rebuilt, with what each kept and dropped.
	Maps []bpf.FlowMapCompaction `json:"maps,omitempty"`
	// Links are the pinned attachments switched to the reloaded programs.
	Links []string `json:"links,omitempty"`
	// Switch is how long the switch held the dataplane's lock (applies,
	// status and health transitions waited that long, not the whole
	// Duration: the copy and the program loads run without it).
	Switch duration.Duration `json:"switch,omitzero"`
	// Deferred says why the round could not compact now (a GC or an HA
	// import was writing the flow maps, or the last compaction failed
	// less than CompactRetry ago); the next round tries again.
	Deferred string `json:"deferred,omitempty"`
	// Error is why the compaction failed (the maps stay as they were
	// unless it says the generation marker stays cleared).
	Error    string            `json:"error,omitempty"`
	Duration duration.Duration `json:"duration"`
}
