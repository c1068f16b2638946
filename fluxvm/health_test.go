package fluxvm

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"go.uber.org/goleak"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/health"
)

// healthService is a TCP service on both VIPs with vm2 (listening on
// 8080) and vm3 on port 8081 (nothing listens: refused), both families.
func (e *env) healthService(hc *HealthCheck) Service {
	s := Service{Name: "web", VIPs: []netip.Addr{vip4, vip6}, Ports: []ServicePort{{Port: 80, Protocol: TCP}}, HealthCheck: hc}
	for _, a := range []netip.Addr{e.backends[0].Addr4, e.backends[0].Addr6} {
		s.Backends = append(s.Backends, Backend{Address: a, Port: 8080})
	}
	for _, a := range []netip.Addr{e.backends[1].Addr4, e.backends[1].Addr6} {
		s.Backends = append(s.Backends, Backend{Address: a, Port: 8081})
	}
	return s
}

// signalDials gives d a health-check dialer that dials as Open's does and
// sends on the returned channel (without blocking) whenever a check of ep
// starts. Call it before applying a service with a health check: rounds
// read the dialer without d.mu.
func signalDials(d *Dataplane, ep netip.AddrPort) <-chan struct{} {
	ch := make(chan struct{}, 1)
	dial := func(ctx context.Context, network, address string) (net.Conn, error) {
		if address == ep.String() {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
		return d.dialNode(ctx, network, address)
	}
	d.mu.Lock()
	d.testHealthDial = dial
	d.mu.Unlock()
	return ch
}

// await fails t unless ch delivers within the time given.
func await(t *testing.T, ch <-chan struct{}, within time.Duration, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(within):
		t.Fatalf("%s: not within %v", what, within)
	}
}

func reconcile(t *testing.T, d *Dataplane, n int) HealthReport {
	t.Helper()
	var rep HealthReport
	for range n {
		var err error
		if rep, err = d.ReconcileHealth(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	return rep
}

func backendHealth(t *testing.T, rep HealthReport, ep netip.AddrPort) BackendHealth {
	t.Helper()
	for _, s := range rep.Services {
		for _, b := range s.Backends {
			if netip.AddrPortFrom(b.Address, b.Port) == ep {
				return b
			}
		}
	}
	t.Fatalf("%s not in the report %+v", ep, rep)
	return BackendHealth{}
}

// datapathState reads the state of ep in the backend entries of every
// frontend of the service.
func datapathState(t *testing.T, d *Dataplane, ep netip.AddrPort) []uint8 {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []uint8
	for _, fe := range d.prog.Frontends() {
		id := fe.BackendID(ep)
		if id == 0 {
			continue
		}
		var v bpf.Backend
		if err := d.dp.Maps().FluxvmBackends.Lookup(id, &v); err != nil {
			t.Fatal(err)
		}
		out = append(out, v.State)
	}
	return out
}

func eligible(t *testing.T, d *Dataplane, want int) {
	t.Helper()
	st, err := d.Service("web")
	if err != nil {
		t.Fatal(err)
	}
	for _, fe := range st.Frontends {
		if fe.Eligible != want || !fe.GuardOpen {
			t.Errorf("frontend %s/%s: %d eligible (guard open %v), want %d", fe.VIP, fe.Protocol, fe.Eligible, fe.GuardOpen, want)
		}
	}
	for _, b := range st.Service.Backends {
		if b.State != "" {
			t.Errorf("intent of %s rewritten to %q", b.Endpoint(), b.State)
		}
	}
}

// TestDataplaneHealthOverlay runs the checks against the lab's backends
// from the node namespace: a refused backend becomes unhealthy after the
// threshold and leaves the Maglev tables, the intent stays ready, a
// server that starts brings it back after the healthy threshold, updates
// keep the overlay, and removing the check or the service drops it. No
// goroutine outlives Close.
func TestDataplaneHealthOverlay(t *testing.T) {
	e := newEnv(t)
	leaks := goleak.IgnoreCurrent()
	d := e.open(t)
	ctx := context.Background()
	// A long interval: the timer runs the first round only; the test
	// drives the others.
	hc := &HealthCheck{Kind: "tcp", TimeoutMs: 500, IntervalMs: 60_000, UnhealthyThreshold: 2, HealthyThreshold: 2}
	svc := e.healthService(hc)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	up4 := netip.AddrPortFrom(e.backends[0].Addr4, 8080)
	down4 := netip.AddrPortFrom(e.backends[1].Addr4, 8081)
	down6 := netip.AddrPortFrom(e.backends[1].Addr6, 8081)

	rep := reconcile(t, d, 2)
	if len(rep.Services) != 1 || rep.Services[0].Name != "web" || len(rep.Services[0].Backends) != 4 {
		t.Fatalf("report %+v", rep)
	}
	if rep.Services[0].HealthCheck != *hc {
		t.Errorf("report check %+v, want %+v", rep.Services[0].HealthCheck, *hc)
	}
	for _, ep := range []netip.AddrPort{down4, down6} {
		b := backendHealth(t, rep, ep)
		if b.Observed != health.Unhealthy || b.EffectiveState != BackendUnhealthy || b.IntentState != BackendReady ||
			b.ConsecutiveFailures < 2 || b.ConsecutiveSuccesses != 0 || !strings.Contains(b.LastError, "refused") || b.LastCheck == nil {
			t.Errorf("%s: %+v, want observed and effective unhealthy after refused connects", ep, b)
		}
		if got := datapathState(t, d, ep); len(got) != 1 || got[0] != uint8(bpf.BackendUnhealthy) {
			t.Errorf("%s: datapath states %v, want unhealthy", ep, got)
		}
	}
	if b := backendHealth(t, rep, up4); b.Observed != health.Healthy || b.EffectiveState != BackendReady || b.ConsecutiveSuccesses < 2 || b.LastError != "" {
		t.Errorf("%s: %+v, want healthy", up4, b)
	}
	eligible(t, d, 1)
	for range 10 {
		c := e.dial(t, vip4)
		c.Close()
		if c.Backend != "vm2" {
			t.Fatalf("a new connection went to %s, which is unhealthy", c.Backend)
		}
	}

	// A server on 8081: one success is below the healthy threshold.
	srv, err := e.backends[1].Serve(8081)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	rep = reconcile(t, d, 1)
	if b := backendHealth(t, rep, down4); b.Observed != health.Unhealthy || b.ConsecutiveSuccesses != 1 || b.ConsecutiveFailures != 0 {
		t.Errorf("after one success: %+v", b)
	}
	eligible(t, d, 1)
	rep = reconcile(t, d, 1)
	changed := backendHealth(t, rep, down4)
	if changed.Observed != health.Healthy || changed.EffectiveState != BackendReady || !strings.Contains(changed.LastError, "refused") {
		t.Errorf("after two successes: %+v", changed)
	}
	if got := datapathState(t, d, down4); len(got) != 1 || got[0] != uint8(bpf.BackendReady) {
		t.Errorf("datapath states %v, want ready", got)
	}
	eligible(t, d, 2)

	// An update that keeps the check keeps the overlay.
	svc.Backends[0].Weight = u32(3)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if b := backendHealth(t, d.Health(), down4); b.Observed != health.Healthy || !b.LastChange.Equal(changed.LastChange) {
		t.Errorf("after an update: %+v, want the overlay kept (%+v)", b, changed)
	}

	// Down again, then the check is removed: its overlay goes with it.
	srv.Close()
	reconcile(t, d, 2)
	eligible(t, d, 1)
	svc.HealthCheck = nil
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	eligible(t, d, 2)
	if rep := d.Health(); len(rep.Services) != 0 {
		t.Errorf("report after removing the check: %+v", rep)
	}
	st := d.health.Status()
	if n, m := st.Checked, st.Observed; n != 0 || m != 0 {
		t.Errorf("%d checkers, %d overlays left after removing the check", n, m)
	}

	// Back on: the refused backend starts unknown (ready) again.
	svc.HealthCheck = hc
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	reconcile(t, d, 2)
	eligible(t, d, 1)
	if err := d.DeleteService(ctx, "web"); err != nil {
		t.Fatal(err)
	}
	st = d.health.Status()
	if n, m := st.Checked, st.Observed; n != 0 || m != 0 {
		t.Errorf("%d checkers, %d overlays left after the delete", n, m)
	}

	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	// Every goroutine started since Open (checkers, rounds, the
	// advertiser) has ended.
	goleak.VerifyNone(t, leaks)
}

// TestDataplaneHealthProbesWithoutLock checks that a round whose checks
// hang (an address nobody answers ARP for) does not hold the dataplane:
// reads and applies go on meanwhile, and the round ends with the timeout.
func TestDataplaneHealthProbesWithoutLock(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	hc := &HealthCheck{Kind: "tcp", TimeoutMs: 800, IntervalMs: 60_000, UnhealthyThreshold: 1, HealthyThreshold: 1}
	svc := e.healthService(hc)
	// In vm3's subnet, but not vm3's address: the node's ARP requests go
	// unanswered.
	silent := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 200, 3, 99}), 8080)
	svc.Backends = append(svc.Backends, Backend{Address: silent.Addr(), Port: silent.Port()})
	probing := signalDials(d, silent)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	done := make(chan HealthReport)
	start := time.Now()
	go func() {
		rep, err := d.ReconcileHealth(ctx)
		if err != nil {
			t.Error(err)
		}
		done <- rep
	}()
	// A round (the timer's first, or the reconcile's) waits on the
	// silent backend for 800ms from now.
	await(t, probing, 5*time.Second, "a check of the silent backend")
	t0 := time.Now()
	_ = d.Services()
	_ = d.Health()
	svc.Backends[0].Weight = u32(2)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(t0); took > 300*time.Millisecond {
		t.Errorf("reads and an apply took %v during a round", took)
	}
	rep := <-done
	took := time.Since(start)
	if b := backendHealth(t, rep, silent); b.Observed != health.Unhealthy || !strings.Contains(b.LastError, "no answer within 800ms") {
		t.Errorf("silent backend: %+v", b)
	}
	if took < 700*time.Millisecond || took > 3*time.Second {
		t.Errorf("the round took %v with a timeout of 800ms", took)
	}
}

// maglevIDs returns the backend ids the kernel's Maglev table of
// frontend sid names.
func maglevIDs(t *testing.T, d *Dataplane, sid uint32) map[uint32]bool {
	t.Helper()
	var inner *ebpf.Map
	if err := d.dp.Maps().FluxvmMaglev.Lookup(sid, &inner); err != nil {
		t.Fatalf("maglev table of service id %d: %v", sid, err)
	}
	defer inner.Close()
	ids := map[uint32]bool{}
	var slot, id uint32
	it := inner.Iterate()
	for it.Next(&slot, &id) {
		ids[id] = true
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestHealthReprogramRetried: when reprogramming after a health change
// fails, the overlay already says unhealthy (and so do the report and the
// advertisements), but the kernel's tables still pick the backend. The
// next round must retry, even though the observed health does not change
// again.
func TestHealthReprogramRetried(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	hc := &HealthCheck{Kind: "tcp", TimeoutMs: 500, IntervalMs: 60_000, UnhealthyThreshold: 3, HealthyThreshold: 1}
	svc := e.healthService(hc)
	svc.VIPs = svc.VIPs[:1] // IPv4 only
	svc.Backends = []Backend{svc.Backends[0], svc.Backends[2]}
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	down := netip.AddrPortFrom(e.backends[1].Addr4, 8081)
	// Every new Maglev table fails to be created from now on.
	d.mu.Lock()
	newTableFault = func() error { return errors.New("no table (test)") }
	d.mu.Unlock()
	t.Cleanup(func() { newTableFault = nil })
	for i := 0; ; i++ {
		rep := reconcile(t, d, 1)
		if backendHealth(t, rep, down).Observed == health.Unhealthy {
			break
		}
		if i == 5 {
			t.Fatalf("%s not unhealthy: %+v", down, rep)
		}
	}
	d.mu.Lock()
	newTableFault = nil
	var sid, downID uint32
	for _, fe := range d.prog.Frontends() {
		sid, downID = fe.ID(), fe.BackendID(down)
	}
	d.mu.Unlock()
	rep := reconcile(t, d, 1)
	if b := backendHealth(t, rep, down); b.Observed != health.Unhealthy || b.EffectiveState != BackendUnhealthy {
		t.Fatalf("%s: %+v", down, b)
	}
	if ids := maglevIDs(t, d, sid); ids[downID] || len(ids) != 1 {
		t.Errorf("the Maglev table names backend ids %v; %s (id %d) is unhealthy and must not be picked", ids, down, downID)
	}
	eligible(t, d, 1)
}

// TestReconcileHealthHonoursItsContext: a reconcile that finds a round of
// slow checks already running returns when its own context ends, not when
// that round does.
func TestReconcileHealthHonoursItsContext(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	hc := &HealthCheck{Kind: "tcp", TimeoutMs: 1500, IntervalMs: 60_000, UnhealthyThreshold: 1, HealthyThreshold: 1}
	svc := e.healthService(hc)
	silent := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 200, 3, 99}), 8080)
	svc.Backends = append(svc.Backends, Backend{Address: silent.Addr(), Port: silent.Port()})
	probing := signalDials(d, silent)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	first := make(chan error, 1)
	go func() {
		_, err := d.ReconcileHealth(ctx)
		first <- err
	}()
	// A round holds the service's round token for 1500ms from now.
	await(t, probing, 5*time.Second, "a check of the silent backend")

	short, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := d.ReconcileHealth(short)
	if took := time.Since(start); took > 700*time.Millisecond {
		t.Errorf("a reconcile with a 150ms context returned after %v", took)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("reconcile error %v, want the context's deadline", err)
	}
	if err := <-first; err != nil {
		t.Errorf("first reconcile: %v", err)
	}
}
