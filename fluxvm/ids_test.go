package fluxvm

import (
	"context"
	"testing"
)

// TestIDPoolQuarantineMark: a GC frees only the ids that were quarantined
// before its scan began. An id released while the scan runs may still be
// named by flows the scan already passed, so it waits for the next GC,
// also when two GCs overlap.
func TestIDPoolQuarantineMark(t *testing.T) {
	p := newIDPool(8)
	var ids []uint32
	for range 6 {
		ids = append(ids, p.get())
	}
	p.release(ids[0])
	p.release(ids[1])
	gcA := p.quarantineMark() // GC A starts: ids[0], ids[1] are in quarantine
	p.release(ids[2])
	gcB := p.quarantineMark() // GC B starts
	p.release(ids[3])         // while both scan
	p.releaseQuarantinedBefore(gcA)
	for i, want := range []bool{false, false, true, true} {
		if p.used[ids[i]] != want {
			t.Errorf("after GC A: id %d used %v, want %v", ids[i], p.used[ids[i]], want)
		}
	}
	p.releaseQuarantinedBefore(gcB)
	for i, want := range []bool{false, false, false, true} {
		if p.used[ids[i]] != want {
			t.Errorf("after GC B: id %d used %v, want %v", ids[i], p.used[ids[i]], want)
		}
	}
	if got, want := p.available(), 8-1-6+3; got != want {
		t.Errorf("available %d, want %d", got, want)
	}
	p.releaseQuarantinedBefore(p.quarantineMark())
	if !p.used[ids[4]] || p.used[ids[3]] || p.available() != 8-1-6+4 {
		t.Errorf("after a third GC: used %v, available %d", p.used, p.available())
	}
}

// TestIDPoolDoubleRelease: releasing an id again while it is in
// quarantine (a removal retried after a failure) frees it once, so the
// pool never counts more free ids than it has, and a freed id can be
// released again after it is reused.
func TestIDPoolDoubleRelease(t *testing.T) {
	p := newIDPool(4)
	a, b := p.get(), p.get()
	p.release(a)
	p.release(a)
	p.releaseQuarantined()
	if got := p.available(); got != 2 {
		t.Fatalf("available %d after releasing one id twice, want 2", got)
	}
	if c := p.get(); c == 0 || c == b {
		t.Fatalf("get %d", c)
	}
	a2 := p.get()
	if a2 != a && p.available() != 0 {
		t.Fatalf("pool state: got %d, available %d", a2, p.available())
	}
	p.release(a)
	p.releaseQuarantined()
	if got := p.available(); got != 1 {
		t.Errorf("available %d after releasing the reused id, want 1", got)
	}
}

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
	for _, fe := range d.frontends {
		if id := fe.backends[gone]; id != 0 {
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
			out = append(out, d.bids.used[id])
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
