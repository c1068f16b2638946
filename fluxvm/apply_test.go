package fluxvm

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
	"github.com/fluxvm/servicefabric/maglev"
)

// newApplyTest opens a tier S dataplane on a pin root of the test, with
// its catalog in a directory of the test; it returns the root and the
// catalog's path too, to open them again (a restart) or read the catalog.
func newApplyTest(t *testing.T) (d *Dataplane, root, path string) {
	t.Helper()
	root = filepath.Join(testenv.PinRoot(t), "service")
	path = filepath.Join(t.TempDir(), "catalog.json")
	return ixOpen(t, root, path, bpf.TierS), root, path
}

// kernelMaglevMap opens the inner map in the kernel behind slot sid of
// fluxvm_maglev (datapath service sid's Maglev table); the caller closes it.
func kernelMaglevMap(t *testing.T, d *Dataplane, sid uint32) *ebpf.Map {
	t.Helper()
	var id ebpf.MapID
	if err := d.dp.Maps().FluxvmMaglev.Lookup(sid, &id); err != nil {
		t.Fatalf("maglev slot %d: %v", sid, err)
	}
	m, err := ebpf.NewMapFromID(id)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// kernelTable reads the Maglev table of datapath service sid from the
// kernel: the inner map behind its slot of fluxvm_maglev, slot by slot.
func kernelTable(t *testing.T, d *Dataplane, sid uint32) []uint32 {
	t.Helper()
	m := kernelMaglevMap(t, d, sid)
	defer m.Close()
	out := make([]uint32, m.MaxEntries())
	for i := range out {
		if err := m.Lookup(uint32(i), &out[i]); err != nil {
			t.Fatalf("maglev table of %d, slot %d: %v", sid, i, err)
		}
	}
	return out
}

// checkTables checks that the kernel holds, for every frontend of the
// service st, the Maglev table of st's intent: built here from its
// backends (with the ids the dataplane gave them) and compared slot by
// slot.
func checkTables(t *testing.T, what string, d *Dataplane, st ServiceStatus) {
	t.Helper()
	if len(st.Frontends) == 0 {
		t.Fatalf("%s: %s has no frontends", what, st.Service.Name)
	}
	for _, f := range st.Frontends {
		d.mu.Lock()
		fe := d.prog.Frontend(feKey(f.VIP.Addr(), f.VIP.Port(), f.Protocol.Number()))
		var mb []maglev.Backend
		for _, b := range st.Service.Backends {
			if fe != nil && b.IsEnabled() && b.Address.Is4() == f.VIP.Addr().Is4() {
				mb = append(mb, maglev.Backend{ID: fe.BackendID(b.Endpoint()), Addr: b.Address.Unmap(), Port: b.Port,
					Proto: f.Protocol.Number(), Weight: b.EffectiveWeight(), Ready: true})
			}
		}
		d.mu.Unlock()
		if fe == nil {
			t.Fatalf("%s: frontend %s/%s not in the dataplane", what, f.VIP, f.Protocol)
		}
		want, err := maglev.New(maglev.Config{Size: f.MaglevSize, Seed: d.opts.MaglevSeed}, mb)
		if err != nil {
			t.Fatal(err)
		}
		if got := kernelTable(t, d, f.ServiceID); !slices.Equal(got, want.Entries()) {
			t.Errorf("%s: the kernel's table of %s/%s (service id %d) is not the one of the intent %+v", what, f.VIP, f.Protocol, f.ServiceID, st.Service.Backends)
		}
	}
}

// TestApplySwapsTablesWithoutTheLock: an apply does not hold the
// dataplane's lock while its new tables go into fluxvm_maglev. Each swap
// waits for an RCU grace period in the kernel (milliseconds); under the
// lock it serialised every apply of the node, and every reader. A reader
// that queued for the lock just before the swap gets it while the apply
// is still in flight: it sees the service's previous revision. (The
// reader runs on its own goroutine, so a scheduler that lets it miss the
// whole window is possible: one attempt of five must see it.)
func TestApplySwapsTablesWithoutTheLock(t *testing.T) {
	d, _, _ := newApplyTest(t)
	ctx := context.Background()
	prev, err := d.ApplyService(ctx, benchService(0, 1))
	if err != nil {
		t.Fatal(err)
	}
	const attempts = 5
	for i := range attempts {
		seen := make(chan uint64, 1)
		var once sync.Once
		d.beforeSwap = func(fe *services.Frontend, _ uint32) {
			once.Do(func() {
				go func() {
					st, err := d.Service(benchName(0))
					if err != nil {
						t.Error(err)
					}
					seen <- st.Revision
				}()
			})
		}
		st, err := d.ApplyService(ctx, benchService(0, uint32(2+i)))
		d.mu.Lock()
		d.beforeSwap = nil
		d.mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		rev := <-seen
		checkTables(t, fmt.Sprintf("apply %d", i+1), d, st)
		if rev == prev.Revision && st.Revision > rev {
			t.Logf("attempt %d: a reader got the lock during the swap (it saw revision %d; the apply made %d)", i+1, rev, st.Revision)
			return
		}
		prev = st
	}
	t.Errorf("in %d applies, a reader queued for the dataplane's lock before the table swap got it only once the apply was done: the lock is held across the swap", attempts)
}

// TestConcurrentAppliesOfOneService: concurrent applies of one service
// (among applies of others) lose no update. Each returns only once its
// record is durable, and they take effect one at a time: the one that
// returned the highest revision, the last journaled, is what the
// dataplane reports, what the kernel's tables hold, what the journal
// replays to, and what a restart restores.
func TestConcurrentAppliesOfOneService(t *testing.T) {
	d, root, path := newApplyTest(t)
	ctx := context.Background()
	const name, clients, per = 0, 8, 5
	for i := range 4 {
		if _, err := d.ApplyService(ctx, benchService(i, 1)); err != nil {
			t.Fatal(err)
		}
	}
	type result struct {
		rev uint64
		w   uint32
	}
	results := make(chan result, clients*per)
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range per {
				// Every apply of service 0 has a weight of its own; the
				// odd clients change the other services in between.
				w := uint32(2 + c*per + i)
				st, err := d.ApplyService(ctx, benchService(name, w))
				if err != nil {
					t.Error(err)
					return
				}
				results <- result{st.Revision, w}
				if c%2 == 1 {
					if _, err := d.ApplyService(ctx, benchService(1+c%3, w)); err != nil {
						t.Error(err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(results)
	if t.Failed() {
		t.FailNow()
	}
	var last result
	revs := map[uint64]bool{}
	for r := range results {
		if revs[r.rev] {
			t.Errorf("two applies returned revision %d", r.rev)
		}
		revs[r.rev] = true
		if r.rev > last.rev {
			last = r
		}
	}
	check := func(what string, d *Dataplane, wantRev bool) {
		t.Helper()
		st, err := d.Service(benchName(name))
		if err != nil {
			t.Fatal(err)
		}
		if got := *st.Service.Backends[0].Weight; got != last.w || wantRev && st.Revision != last.rev {
			t.Errorf("%s: weight %d at revision %d, want %d at %d (the last apply)", what, got, st.Revision, last.w, last.rev)
		}
		checkTables(t, what, d, st)
	}
	check("after the applies", d, true)

	// The journal as a node killed now would replay it.
	cat, err := catalog.Read(path, d.log)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(cat.Services, func(cs catalogService) bool { return cs.Service.Name == benchName(name) })
	if i < 0 {
		t.Fatal("the catalog lost the service")
	}
	if cs := cat.Services[i]; *cs.Service.Backends[0].Weight != last.w || cs.Revision != last.rev {
		t.Errorf("catalog on disk: weight %d at revision %d, want %d at %d", *cs.Service.Backends[0].Weight, cs.Revision, last.w, last.rev)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	check("after a restart", ixOpen(t, root, path, bpf.TierS), true)
}

// TestDeleteEmptiesTablesWithoutTheLock: a delete does not hold the
// dataplane's lock while its frontends' slots of fluxvm_maglev are
// emptied (an RCU grace period each). Whoever takes the lock while the
// delete is in flight may find the service still listed with its
// frontend entry already gone: a state no holder of the lock could see
// when the whole delete ran under it. One attempt of five must see it
// (the poller runs on the test's goroutine, which the scheduler may hold
// back for the whole window). After each delete everything of the
// service is gone: entry, table, guard, backends, catalog record.
func TestDeleteEmptiesTablesWithoutTheLock(t *testing.T) {
	d, _, path := newApplyTest(t)
	ctx := context.Background()
	name := benchName(0)
	if _, err := d.ApplyService(ctx, benchService(1, 1)); err != nil {
		t.Fatal(err)
	}
	const attempts = 5
	seen := false
	for i := 0; i < attempts && !seen; i++ {
		st, err := d.ApplyService(ctx, benchService(0, uint32(1+i)))
		if err != nil {
			t.Fatal(err)
		}
		f := st.Frontends[0]
		key := feKey(f.VIP.Addr(), f.VIP.Port(), f.Protocol.Number())
		done := make(chan error, 1)
		go func() { done <- d.DeleteService(ctx, name) }()
	poll:
		for {
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
				break poll
			default:
			}
			d.mu.Lock()
			listed := d.services[name] != nil
			_, entry, err := lookupFrontend(d, key)
			d.mu.Unlock()
			if err != nil {
				t.Fatal(err)
			}
			if listed && !entry && !seen {
				seen = true
				t.Logf("attempt %d: the lock was free while the delete was in flight (service listed, entry gone)", i+1)
			}
			runtime.Gosched()
		}
		// Everything of it is gone.
		if _, ok, err := lookupFrontend(d, key); err != nil || ok {
			t.Errorf("attempt %d: frontend entry after the delete: %v, %v", i+1, ok, err)
		}
		var id ebpf.MapID
		if err := d.dp.Maps().FluxvmMaglev.Lookup(f.ServiceID, &id); !errors.Is(err, ebpf.ErrKeyNotExist) {
			t.Errorf("attempt %d: maglev slot %d after the delete: %v (map %d)", i+1, f.ServiceID, err, id)
		}
		var g bpf.Guard
		if err := d.dp.Maps().FluxvmSguard.Lookup(f.ServiceID, &g); err != nil || g != (bpf.Guard{}) {
			t.Errorf("attempt %d: guard after the delete: %+v, %v", i+1, g, err)
		}
		d.mu.Lock()
		stillFE := d.prog.Frontend(key) != nil
		d.mu.Unlock()
		if stillFE {
			t.Errorf("attempt %d: the dataplane still has frontend %s", i+1, key)
		}
		cat, err := catalog.Read(path, d.log)
		if err != nil {
			t.Fatal(err)
		}
		if slices.ContainsFunc(cat.Services, func(cs catalogService) bool { return cs.Service.Name == name }) {
			t.Errorf("attempt %d: the catalog on disk still has %s", i+1, name)
		}
		// The ids are free again: a GC hands them out.
		if _, err := d.GC(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if !seen {
		t.Errorf("in %d deletes, nobody holding the lock saw one in flight: the lock is held across the table slots' removal", attempts)
	}
	// The other service was never touched.
	st, err := d.Service(benchName(1))
	if err != nil {
		t.Fatal(err)
	}
	checkTables(t, "the other service", d, st)
}
