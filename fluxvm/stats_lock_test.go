package fluxvm

import (
	"context"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
	flowview "github.com/fluxvm/servicefabric/fluxvm/internal/flows"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestStatsReadsWithoutDataplaneLock: Stats holds d.mu only to copy the
// services' ids; the flows component reads the counter maps without it,
// so a slow read does not hold up Apply. The probe, run in the middle of
// the read, takes d.mu itself (TryLock: it would fail while Stats held
// it) and checks that the counters still come out of the maps.
func TestStatsReadsWithoutDataplaneLock(t *testing.T) {
	testenv.RequirePrivileged(t)
	d := openStatusT(t)
	m := d.dp.Maps()
	var reads, locked int
	probe := func() {
		reads++
		if d.mu.TryLock() {
			d.mu.Unlock()
		} else {
			locked++
		}
	}
	s, err := flowview.New(flowview.Config{EdgeSlots: d.caps.Edges}, flowview.Deps{
		SvcStats: m.FluxvmSvcStats, EdgeStats: m.FluxvmEdgeStats, EdgeSlots: m.FluxvmEdgeSlots,
		Drops:    func() (bpf.Drops, error) { probe(); return bpf.ReadDrops(m.FluxvmDrops) },
		Counters: func() (bpf.Counters, error) { probe(); return bpf.ReadCounters(m.FluxvmCounters) },
	})
	if err != nil {
		t.Fatal(err)
	}
	d.mu.Lock()
	d.scope = s
	d.mu.Unlock()
	st, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if reads != 2 || locked != 0 {
		t.Errorf("%d of the %d reads ran with d.mu held", locked, reads)
	}
	if len(st.Drops) != bpf.NumDropReasons-1 || len(st.Parser) != bpf.NumCounters {
		t.Errorf("stats read through the probe: %d drops, %d parser counters", len(st.Drops), len(st.Parser))
	}
}
