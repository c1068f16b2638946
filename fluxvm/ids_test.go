package fluxvm

import (
	"context"
	"testing"
)

// The pools themselves are tested in fluxvm/internal/services (TestIDs).

// TestGCKeepsIDsReleasedDuringTheScan removes a backend while a GC scans
// the flow tables: its id must stay quarantined after that GC (the scan
// may have passed flows that name it), and be free after the next.
func TestGCKeepsIDsReleasedDuringTheScan(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 1, 1)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	gone := svc.Backends[0].Endpoint()
	var goneIDs []uint32
	d.mu.Lock()
	for _, fe := range d.prog.Frontends() {
		if id := fe.BackendID(gone); id != 0 {
			goneIDs = append(goneIDs, id)
		}
	}
	d.mu.Unlock()
	if len(goneIDs) == 0 {
		t.Fatalf("%s has no backend id", gone)
	}
	smaller := svc.Clone()
	smaller.Backends = smaller.Backends[1:]
	d.afterGCScan = func() {
		if _, err := d.ApplyService(ctx, smaller); err != nil {
			t.Error(err)
		}
	}
	if _, err := d.GC(ctx); err != nil {
		t.Fatal(err)
	}
	d.afterGCScan = nil
	used := func() []bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		var out []bool
		for _, id := range goneIDs {
			out = append(out, d.prog.BackendIDs().Used(id))
		}
		return out
	}
	for i, u := range used() {
		if !u {
			t.Errorf("backend id %d of %s was freed by the GC whose scan it was removed during", goneIDs[i], gone)
		}
	}
	if _, err := d.GC(ctx); err != nil {
		t.Fatal(err)
	}
	for i, u := range used() {
		if u {
			t.Errorf("backend id %d of %s still in use after the next GC", goneIDs[i], gone)
		}
	}
}
