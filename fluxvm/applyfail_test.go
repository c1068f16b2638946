package fluxvm

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/intent"
)

// errSwapFault is the error of the map updates the tests below make fail.
var errSwapFault = errors.New("injected fluxvm_maglev update failure")

// failSwaps makes the table swaps (datapathMaps.SwapTable) fail with errSwapFault for the updates f
// picks (inner nil: the slot is emptied), until the test ends or it is
// called again with nil.
func failSwaps(t *testing.T, f func(sid uint32, inner *ebpf.Map) bool) {
	t.Helper()
	if f == nil {
		swapFault = nil
		return
	}
	swapFault = func(sid uint32, inner *ebpf.Map) error {
		if f(sid, inner) {
			return errSwapFault
		}
		return nil
	}
	t.Cleanup(func() { swapFault = nil })
}

// twoPorts is benchService i (backend weight w) on TCP ports 80 and 443:
// two frontends.
func twoPorts(i int, w uint32) Service {
	s := benchService(i, w)
	s.Ports = append(s.Ports, ServicePort{Port: 443, Protocol: TCP})
	return s
}

// kernelFrontend reads what the kernel has of frontend f: whether its
// entry exists, and its guard.
func kernelFrontend(t *testing.T, d *Dataplane, f FrontendStatus) (entry bool, g bpf.Guard) {
	t.Helper()
	_, entry, err := lookupFrontend(d, feKey(f.VIP.Addr(), f.VIP.Port(), f.Protocol.Number()))
	if err != nil {
		t.Fatal(err)
	}
	if err := d.dp.Maps().FluxvmSguard.Lookup(f.ServiceID, &g); err != nil {
		t.Fatalf("guard of %d: %v", f.ServiceID, err)
	}
	return entry, g
}

// checkServing checks that service name is listed as svc and that every
// frontend of it is in the kernel with its entry, its table and its guard
// open, and not pending repair.
func checkServing(t *testing.T, what string, d *Dataplane, svc Service) ServiceStatus {
	t.Helper()
	st, err := d.Service(svc.Name)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if *st.Service.Backends[0].Weight != *svc.Backends[0].Weight || len(st.Frontends) != len(svc.Ports) {
		t.Errorf("%s: listed with weight %d and %d frontends, want %d and %d", what,
			*st.Service.Backends[0].Weight, len(st.Frontends), *svc.Backends[0].Weight, len(svc.Ports))
	}
	for _, f := range st.Frontends {
		entry, g := kernelFrontend(t, d, f)
		if !entry || g.State != bpf.GuardOpen || !f.GuardOpen || f.RepairPending {
			t.Errorf("%s: frontend %s: entry %v, kernel guard %+v, status guard_open %v, repair_pending %v; want it serving",
				what, f.VIP, entry, g, f.GuardOpen, f.RepairPending)
		}
	}
	checkTables(t, what, d, st)
	return st
}

// checkClosed checks that every frontend of service name is closed in
// the kernel (guard closed) and that Service shows it pending repair.
func checkClosed(t *testing.T, what string, d *Dataplane, name string) {
	t.Helper()
	st, err := d.Service(name)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	for _, f := range st.Frontends {
		_, g := kernelFrontend(t, d, f)
		if g.State == bpf.GuardOpen || f.GuardOpen || !f.RepairPending {
			t.Errorf("%s: frontend %s: kernel guard %+v, status guard_open %v, repair_pending %v; want it closed and pending repair",
				what, f.VIP, g, f.GuardOpen, f.RepairPending)
		}
	}
}

// inCatalog reads the catalog on disk (as a restart would) and returns
// service name's weight, or 0 when it has no such service.
func inCatalog(t *testing.T, d *Dataplane, path, name string) uint32 {
	t.Helper()
	d.store.WaitCompaction()
	cat, err := catalog.Read(path, d.log)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(cat.Services, func(cs catalogService) bool { return cs.Service.Name == name })
	if i < 0 {
		return 0
	}
	return *cat.Services[i].Service.Backends[0].Weight
}

// TestDeleteSwapFailureKeepsService: a delete whose emptying of a
// fluxvm_maglev slot fails (the second frontend's, after the first one's
// went) fails and leaves the service as it was: listed, in the catalog,
// and serving (entries, tables and guards back), not listed with its
// frontend entries gone. When putting it back fails too, its frontends
// are closed and pending repair, and an apply of the same intent
// programs it again instead of answering "unchanged".
func TestDeleteSwapFailureKeepsService(t *testing.T) {
	d, _, path := newApplyTest(t)
	ctx := context.Background()
	svc := twoPorts(0, 3)
	if _, err := d.ApplyService(ctx, benchService(1, 1)); err != nil {
		t.Fatal(err)
	}
	st, err := d.ApplyService(ctx, svc)
	if err != nil {
		t.Fatal(err)
	}
	second := st.Frontends[1].ServiceID

	// The second slot cannot be emptied; putting tables back works.
	failSwaps(t, func(sid uint32, inner *ebpf.Map) bool { return sid == second && inner == nil })
	if err := d.DeleteService(ctx, svc.Name); !errors.Is(err, errSwapFault) {
		t.Fatalf("delete with a failing slot removal: %v, want errSwapFault", err)
	}
	checkServing(t, "after the failed delete", d, svc)
	if w := inCatalog(t, d, path, svc.Name); w != 3 {
		t.Errorf("catalog after the failed delete: weight %d, want 3", w)
	}

	// Now nothing of the second slot can change: the delete fails, and
	// so does putting the service back.
	failSwaps(t, func(sid uint32, _ *ebpf.Map) bool { return sid == second })
	if err := d.DeleteService(ctx, svc.Name); !errors.Is(err, errSwapFault) {
		t.Fatalf("delete with a failing slot: %v, want errSwapFault", err)
	}
	checkClosed(t, "after the failed delete and restore", d, svc.Name)

	// The same intent again repairs it.
	failSwaps(t, nil)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	checkServing(t, "after the repairing apply", d, svc)
	if err := d.DeleteService(ctx, svc.Name); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Service(svc.Name); !errors.Is(err, ErrNotFound) {
		t.Errorf("after the delete: %v, want ErrNotFound", err)
	}
	checkServing(t, "the other service", d, benchService(1, 1))
}

// TestApplyRollbackFailureFailsClosed: when an apply's swap fails after
// an earlier frontend got its new table, and the rollback fails too,
// the service's frontends (which may hold a mix of both intents) are
// closed in the kernel, and Service shows them pending repair; the next
// apply, of the same intent as before, programs them and opens them, and
// removes the frontend that the failed apply added.
func TestApplyRollbackFailureFailsClosed(t *testing.T) {
	d, _, _ := newApplyTest(t)
	ctx := context.Background()
	svc := twoPorts(0, 1)
	st, err := d.ApplyService(ctx, svc)
	if err != nil {
		t.Fatal(err)
	}
	second := st.Frontends[1].ServiceID
	failSwaps(t, func(sid uint32, _ *ebpf.Map) bool { return sid == second })
	three := twoPorts(0, 2)
	three.Ports = append(three.Ports, ServicePort{Port: 8443, Protocol: TCP})
	_, err = d.ApplyService(ctx, three)
	if !errors.Is(err, errSwapFault) {
		t.Fatalf("apply with a failing swap and rollback: %v, want errSwapFault", err)
	}
	checkClosed(t, "after the failed apply and rollback", d, svc.Name)
	if !strings.Contains(err.Error(), "rollback failed") {
		t.Errorf("the error does not say that the rollback failed: %v", err)
	}

	added := feKey(svc.VIPs[0], 8443, TCP.Number())
	d.mu.Lock()
	fe := d.prog.Frontend(added)
	d.mu.Unlock()
	if fe == nil {
		t.Fatal("the failed apply left no trace of its new frontend: the fault did not hit where the test expects")
	}
	sid := fe.ID()

	failSwaps(t, nil)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	checkServing(t, "after the repairing apply", d, svc)
	d.mu.Lock()
	still := d.prog.Frontend(added) != nil
	d.mu.Unlock()
	var g bpf.Guard
	if err := d.dp.Maps().FluxvmSguard.Lookup(sid, &g); still || err != nil || g != (bpf.Guard{}) {
		t.Errorf("the failed apply's new frontend after the repair: in the dataplane %v, guard %+v (%v)", still, g, err)
	}
}

// TestApplyDropsFrontendsWithoutTheLock: an apply that drops a frontend
// (a port) empties its slot of fluxvm_maglev, an RCU grace period,
// without the dataplane's lock, as a delete does; afterwards nothing of
// the frontend is left. When emptying it fails, the apply fails and its
// rollback puts the service back as it was.
func TestApplyDropsFrontendsWithoutTheLock(t *testing.T) {
	d, _, _ := newApplyTest(t)
	ctx := context.Background()
	both := twoPorts(0, 1)
	st, err := d.ApplyService(ctx, both)
	if err != nil {
		t.Fatal(err)
	}
	dropped := st.Frontends[1]
	key := feKey(dropped.VIP.Addr(), dropped.VIP.Port(), dropped.Protocol.Number())

	// Emptying the slot fails: the apply fails and both ports serve.
	failSwaps(t, func(sid uint32, inner *ebpf.Map) bool { return sid == dropped.ServiceID && inner == nil })
	if _, err := d.ApplyService(ctx, benchService(0, 2)); !errors.Is(err, errSwapFault) {
		t.Fatalf("apply with a failing slot removal: %v, want errSwapFault", err)
	}
	checkServing(t, "after the failed apply", d, both)

	var emptied, lockFree bool
	failSwaps(t, func(sid uint32, inner *ebpf.Map) bool {
		if sid == dropped.ServiceID && inner == nil {
			emptied = true
			// Nobody else takes the lock in this test: if it is free,
			// the apply does not hold it.
			if d.mu.TryLock() {
				lockFree = true
				d.mu.Unlock()
			}
		}
		return false
	})
	one := benchService(0, 2)
	if _, err := d.ApplyService(ctx, one); err != nil {
		t.Fatal(err)
	}
	if !emptied {
		t.Fatal("the dropped frontend's slot was never emptied")
	}
	if !lockFree {
		t.Error("the dataplane's lock was held while the dropped frontend's slot was emptied")
	}
	checkServing(t, "after the apply", d, one)
	if _, ok, err := lookupFrontend(d, key); err != nil || ok {
		t.Errorf("dropped frontend's entry: %v, %v", ok, err)
	}
	var id ebpf.MapID
	if err := d.dp.Maps().FluxvmMaglev.Lookup(dropped.ServiceID, &id); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("dropped frontend's maglev slot: %v (map %d)", err, id)
	}
	var g bpf.Guard
	if err := d.dp.Maps().FluxvmSguard.Lookup(dropped.ServiceID, &g); err != nil || g != (bpf.Guard{}) {
		t.Errorf("dropped frontend's guard: %+v, %v", g, err)
	}
	d.mu.Lock()
	still := d.prog.Frontend(key) != nil
	d.mu.Unlock()
	if still {
		t.Errorf("the dataplane still has frontend %s", key)
	}
}

// TestRetryAfterUnsavedChangeIsDurable: an apply that answered
// "programmed, but the catalog was not saved" (a failed journal write)
// and is retried unchanged answers only once the catalog on disk has it
// (the retry heals the journal with a compaction); the same for a delete
// that answered "removed, but the catalog was not saved".
func TestRetryAfterUnsavedChangeIsDurable(t *testing.T) {
	d, _, path := newApplyTest(t)
	ctx := context.Background()
	// breakJournal closes the journal file under the store, so that its
	// next write fails (an apply before opened it).
	breakJournal := func() {
		t.Helper()
		if err := d.store.FailNextWrite(); err != nil {
			t.Fatal(err)
		}
	}
	name := benchName(0)
	if _, err := d.ApplyService(ctx, benchService(0, 1)); err != nil {
		t.Fatal(err)
	}
	breakJournal()
	if _, err := d.ApplyService(ctx, benchService(0, 2)); err == nil || !strings.Contains(err.Error(), "not saved") {
		t.Fatalf("apply with a failing journal write: %v", err)
	}
	if w := inCatalog(t, d, path, name); w != 1 {
		t.Fatalf("catalog after the unsaved apply: weight %d, want 1", w)
	}
	if _, err := d.ApplyService(ctx, benchService(0, 2)); err != nil {
		t.Fatalf("retried apply: %v", err)
	}
	if w := inCatalog(t, d, path, name); w != 2 {
		t.Errorf("catalog after the retried apply answered: weight %d, want 2", w)
	}

	for w := range uint32(2) { // the second opens a journal file, whatever the first did
		if _, err := d.ApplyService(ctx, benchService(1, 1+w)); err != nil {
			t.Fatal(err)
		}
	}
	breakJournal()
	if err := d.DeleteService(ctx, name); err == nil || !strings.Contains(err.Error(), "not saved") {
		t.Fatalf("delete with a failing journal write: %v", err)
	}
	if err := d.DeleteService(ctx, name); err != nil {
		t.Fatalf("retried delete: %v", err)
	}
	if w := inCatalog(t, d, path, name); w != 0 {
		t.Errorf("catalog after the retried delete answered: still has %s (weight %d)", name, w)
	}
	// Once it is durable, a delete of it is the delete of a service that
	// does not exist.
	if err := d.DeleteService(ctx, name); !errors.Is(err, ErrNotFound) {
		t.Errorf("third delete: %v, want ErrNotFound", err)
	}
}

// TestApplyDropConcurrency measures applies that add and drop a port
// (every other apply of a service empties the slot of the frontend it
// drops), by one client going over eight services and by eight clients
// at once, one service each, in alternating rounds; it prints both rates
// and their ratio. A benchmark: set FLUXVM_APPLYBENCH=1 to run it
// (FLUXVM_APPLYBENCH_ROUNDS, default 3). Tier S, catalog on disk.
func TestApplyDropConcurrency(t *testing.T) {
	benchOnly(t)
	rounds := benchEnvInt(t, "FLUXVM_APPLYBENCH_ROUNDS", 3, 1)
	d, _, _ := newApplyTest(t)
	ctx := context.Background()
	const services, per = 8, 20
	for i := range services {
		if _, err := d.ApplyService(ctx, benchService(i, 1)); err != nil {
			t.Fatal(err)
		}
	}
	run := func(clients int) float64 {
		rate, _ := benchClients(t, clients, services*per/clients, func(c, i int) func() error {
			k, two := c, i%2 == 0
			if clients == 1 {
				k, two = i%services, (i/services)%2 == 0
			}
			svc := benchService(k, 1)
			if two {
				svc = twoPorts(k, 1)
			}
			return func() error {
				_, err := d.ApplyService(ctx, svc)
				return err
			}
		})
		if t.Failed() {
			t.FailNow()
		}
		// The dropped frontends' ids come back with a GC.
		if _, err := d.GC(ctx); err != nil {
			t.Fatal(err)
		}
		return rate
	}
	for r := range rounds {
		one, eight := run(1), run(8)
		t.Logf("round %d: 1 client %.0f applies/s, 8 clients %.0f applies/s, 8 ÷ 1 = %.2f", r+1, one, eight, eight/one)
	}
}

// TestHealthRoundRepairsClosedService: a service left closed for repair
// by a failed apply whose rollback failed too is programmed again by its
// next health-check round (ReconcileHealth here), without an apply. The
// checks dial nothing: the prober's dialer answers every check with a
// connection of its own (net.Pipe), healthy.
func TestHealthRoundRepairsClosedService(t *testing.T) {
	d, _, _ := newApplyTest(t)
	d.mu.Lock()
	d.testHealthDial = func(context.Context, string, string) (net.Conn, error) {
		c, peer := net.Pipe()
		peer.Close()
		return c, nil
	}
	d.mu.Unlock()
	ctx := context.Background()
	svc := twoPorts(0, 1)
	svc.HealthCheck = &HealthCheck{Kind: "tcp", IntervalMs: intent.MaxHealthIntervalMs}
	st, err := d.ApplyService(ctx, svc)
	if err != nil {
		t.Fatal(err)
	}
	// The first round, which starts with the check, is over.
	if _, err := d.ReconcileHealth(ctx); err != nil {
		t.Fatal(err)
	}
	second := st.Frontends[1].ServiceID
	failSwaps(t, func(sid uint32, _ *ebpf.Map) bool { return sid == second })
	changed := svc
	changed.Backends = slices.Clone(svc.Backends)
	changed.Backends[0].Weight = u32(2)
	if _, err := d.ApplyService(ctx, changed); !errors.Is(err, errSwapFault) {
		t.Fatalf("apply with a failing swap and rollback: %v, want errSwapFault", err)
	}
	checkClosed(t, "after the failed apply and rollback", d, svc.Name)

	failSwaps(t, nil)
	if _, err := d.ReconcileHealth(ctx); err != nil {
		t.Fatal(err)
	}
	checkServing(t, "after a health round", d, svc)
}
