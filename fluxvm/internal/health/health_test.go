package health

import (
	"context"
	"errors"
	"iter"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	probe "github.com/fluxvm/servicefabric/health"
	"github.com/fluxvm/servicefabric/intent"
)

var (
	beA = netip.MustParseAddrPort("10.200.2.2:8080")
	beB = netip.MustParseAddrPort("10.200.3.2:8080")
	beC = netip.MustParseAddrPort("[fd00:200:2::2]:8080")
)

// fakeView is the facade's side: a catalog under a lock (its d.mu).
type fakeView struct {
	mu       sync.Mutex
	services map[string]*intent.Service
}

func (v *fakeView) HealthChecked() iter.Seq[*intent.Service] {
	return func(yield func(*intent.Service) bool) {
		v.mu.Lock()
		defer v.mu.Unlock()
		for _, s := range v.services {
			if s.HealthCheck != nil && !yield(s) {
				return
			}
		}
	}
}

var errRefused = errors.New("connection refused")

// fakeNet answers checks: an endpoint that is up gets a connection, one
// that is down a refusal; hang makes every dial wait for its context.
type fakeNet struct {
	mu     sync.Mutex
	up     map[string]bool
	dials  int
	active int
	hang   bool
	gate   chan struct{} // when set, every dial waits for it to close
}

func (n *fakeNet) dial(ctx context.Context, _, address string) (net.Conn, error) {
	n.mu.Lock()
	n.dials++
	n.active++
	up, hang, gate := n.up[address], n.hang, n.gate
	n.mu.Unlock()
	if gate != nil {
		<-gate
	}
	defer func() {
		n.mu.Lock()
		n.active--
		n.mu.Unlock()
	}()
	if hang {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if !up {
		return nil, errRefused
	}
	c, peer := net.Pipe()
	peer.Close()
	return c, nil
}

func (n *fakeNet) set(ep netip.AddrPort, up bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.up[ep.String()] = up
}

// harness is a Checks over a fakeView and a fakeNet whose Changed does
// what the facade's does: it takes the view's lock and reads effective
// states (which takes the component's lock: a Changed called with it
// held deadlocks).
type harness struct {
	t    *testing.T
	view *fakeView
	net  *fakeNet
	h    *Checks

	mu      sync.Mutex
	changes []Change
	fail    error         // Changed's answer
	block   chan struct{} // when set, Changed waits for it to close
	inCall  chan struct{} // when set, Changed signals it started
}

func newHarness(t *testing.T, svcs ...intent.Service) *harness {
	t.Helper()
	hs := &harness{t: t, view: &fakeView{services: map[string]*intent.Service{}}, net: &fakeNet{up: map[string]bool{}}}
	for _, s := range svcs {
		hs.view.services[s.Name] = &s
	}
	h, err := New(Config{Concurrency: 4}, Deps{View: hs.view, Dial: hs.net.dial, Changed: hs.changed})
	if err != nil {
		t.Fatal(err)
	}
	hs.h = h
	t.Cleanup(func() {
		closed := make(chan struct{})
		go func() {
			h.Close()
			close(closed)
		}()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Error("Close hung (a deadlock: left behind)")
		}
	})
	return hs
}

func (hs *harness) changed(ch Change) error {
	hs.mu.Lock()
	block, inCall := hs.block, hs.inCall
	hs.mu.Unlock()
	if inCall != nil {
		inCall <- struct{}{}
	}
	if block != nil {
		<-block
	}
	hs.view.mu.Lock()
	if s := hs.view.services[ch.Service]; s != nil {
		for i := range s.Backends {
			hs.h.EffectiveState(s, &s.Backends[i])
		}
	}
	hs.view.mu.Unlock()
	hs.mu.Lock()
	defer hs.mu.Unlock()
	hs.changes = append(hs.changes, ch)
	return hs.fail
}

func (hs *harness) takeChanges() []Change {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	out := hs.changes
	hs.changes = nil
	return out
}

// start starts the checks and waits for the first round of each (it
// runs at once) to be recorded.
func (hs *harness) start() {
	hs.t.Helper()
	hs.h.Start()
	hs.settle()
}

// settle waits until every observed backend has been checked once.
func (hs *harness) settle() {
	hs.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		checked := true
		for _, s := range hs.report().Services {
			for _, b := range s.Backends {
				checked = checked && b.LastCheck != nil
			}
		}
		if checked {
			return
		}
		if time.Now().After(deadline) {
			hs.t.Fatalf("the first rounds did not finish: %+v", hs.report())
		}
		time.Sleep(time.Millisecond)
	}
}

// reconcile runs a round of every check, failing on a deadlock.
func (hs *harness) reconcile() Report {
	hs.t.Helper()
	return hs.within("Reconcile", func() (Report, error) {
		rep, _, err := hs.h.Reconcile(context.Background())
		return rep, err
	})
}

// report is Report, failing on a deadlock.
func (hs *harness) report() Report {
	hs.t.Helper()
	return hs.within("Report", func() (Report, error) { return hs.h.Report(), nil })
}

// within runs fn and fails the test when it errs or does not return (a
// Changed called with the component's lock held deadlocks: it reads
// effective states).
func (hs *harness) within(what string, fn func() (Report, error)) Report {
	hs.t.Helper()
	type out struct {
		rep Report
		err error
	}
	done := make(chan out, 1)
	go func() {
		rep, err := fn()
		done <- out{rep, err}
	}()
	select {
	case o := <-done:
		if o.err != nil {
			hs.t.Fatal(o.err)
		}
		return o.rep
	case <-time.After(10 * time.Second):
		hs.t.Fatalf("%s did not return: Changed called with the component's lock held?", what)
		return Report{}
	}
}

func backendOf(t *testing.T, rep Report, service string, ep netip.AddrPort) BackendHealth {
	t.Helper()
	for _, s := range rep.Services {
		if s.Name != service {
			continue
		}
		for _, b := range s.Backends {
			if netip.AddrPortFrom(b.Address, b.Port) == ep {
				return b
			}
		}
	}
	t.Fatalf("%s %s not in the report %+v", service, ep, rep)
	return BackendHealth{}
}

// checkedService is a service with a health check (no timer rounds after
// the first) on its backends.
func checkedService(name string, hc intent.HealthCheck, eps ...netip.AddrPort) intent.Service {
	hc.Kind, hc.IntervalMs = intent.HealthCheckKindTCP, intent.MaxHealthIntervalMs
	s := intent.Service{Name: name, HealthCheck: &hc}
	for _, ep := range eps {
		s.Backends = append(s.Backends, intent.Backend{Address: ep.Addr(), Port: ep.Port()})
	}
	return s
}

// TestThresholds: rounds move a backend between the observed states by
// the thresholds, and Changed is called (outside the component's lock)
// exactly after the rounds that crossed between unhealthy and not.
func TestThresholds(t *testing.T) {
	U, H, X := probe.Unknown, probe.Healthy, probe.Unhealthy
	tests := []struct {
		name      string
		unhealthy uint32
		healthy   uint32
		up        []bool        // the backend's answer in each round; the first is Start's
		want      []probe.State // observed after each round
		effective []intent.BackendState
		changes   []bool // Changed called after the round
	}{
		{"up stays healthy", 2, 2, []bool{true, true, true}, []probe.State{H, H, H},
			[]intent.BackendState{"ready", "ready", "ready"}, []bool{false, false, false}},
		{"one failure under the threshold", 2, 2, []bool{false, true, false}, []probe.State{U, H, H},
			[]intent.BackendState{"ready", "ready", "ready"}, []bool{false, false, false}},
		{"down at the threshold, back after two successes", 2, 2,
			[]bool{false, false, false, true, true, true}, []probe.State{U, X, X, X, H, H},
			[]intent.BackendState{"ready", "unhealthy", "unhealthy", "unhealthy", "ready", "ready"},
			[]bool{false, true, false, false, true, false}},
		{"thresholds of one", 1, 1, []bool{false, true, false}, []probe.State{X, H, X},
			[]intent.BackendState{"unhealthy", "ready", "unhealthy"}, []bool{true, true, true}},
		{"healthy to unhealthy", 3, 1, []bool{true, false, false, false}, []probe.State{H, H, H, X},
			[]intent.BackendState{"ready", "ready", "ready", "unhealthy"}, []bool{false, false, false, true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			svc := checkedService("web", intent.HealthCheck{UnhealthyThreshold: tt.unhealthy, HealthyThreshold: tt.healthy}, beA, beB)
			hs := newHarness(t, svc)
			hs.net.set(beB, true)
			for i, up := range tt.up {
				hs.net.set(beA, up)
				var rep Report
				if i == 0 {
					hs.start()
					rep = hs.report()
				} else {
					rep = hs.reconcile()
				}
				b := backendOf(t, rep, "web", beA)
				if b.Observed != tt.want[i] || b.EffectiveState != tt.effective[i] || b.IntentState != intent.BackendReady {
					t.Errorf("round %d: observed %s effective %s, want %s %s", i, b.Observed, b.EffectiveState, tt.want[i], tt.effective[i])
				}
				if got := hs.h.EffectiveState(hs.view.services["web"], &svc.Backends[0]); got != tt.effective[i] {
					t.Errorf("round %d: EffectiveState %s, want %s", i, got, tt.effective[i])
				}
				if other := backendOf(t, rep, "web", beB); other.Observed != H {
					t.Errorf("round %d: the healthy backend is %s", i, other.Observed)
				}
				changes := hs.takeChanges()
				if !tt.changes[i] {
					if len(changes) != 0 {
						t.Errorf("round %d: Changed %+v, want no call", i, changes)
					}
					continue
				}
				if len(changes) != 1 || changes[0].Service != "web" || !slices.Equal(changes[0].Backends, []netip.AddrPort{beA}) || changes[0].Retry {
					t.Errorf("round %d: Changed %+v, want one call for %s", i, changes, beA)
				}
			}
		})
	}
}

// TestRetry: a Changed that fails (the facade could not reprogram) is
// called again by the next round with Retry, even when nothing changed;
// so is one after Retry (a failed change closed the service); a
// successful one is not repeated.
func TestRetry(t *testing.T) {
	svc := checkedService("web", intent.HealthCheck{UnhealthyThreshold: 1, HealthyThreshold: 1}, beA)
	hs := newHarness(t, svc)
	hs.mu.Lock()
	hs.fail = errors.New("busy")
	hs.mu.Unlock()
	hs.start() // beA down: unhealthy, Changed fails
	if ch := hs.takeChanges(); len(ch) != 1 || ch[0].Retry {
		t.Fatalf("first round: %+v", ch)
	}
	hs.reconcile()
	if ch := hs.takeChanges(); len(ch) != 1 || !ch[0].Retry || len(ch[0].Backends) != 0 {
		t.Fatalf("after a failed Changed: %+v, want a retry", ch)
	}
	hs.mu.Lock()
	hs.fail = nil
	hs.mu.Unlock()
	hs.reconcile()
	if ch := hs.takeChanges(); len(ch) != 1 || !ch[0].Retry {
		t.Fatalf("the retry that succeeds: %+v", ch)
	}
	hs.reconcile()
	if ch := hs.takeChanges(); len(ch) != 0 {
		t.Fatalf("after a successful Changed: %+v, want no call", ch)
	}
	hs.h.Retry("web")
	hs.h.Retry("gone") // no check: nothing
	hs.reconcile()
	if ch := hs.takeChanges(); len(ch) != 1 || !ch[0].Retry || ch[0].Service != "web" {
		t.Fatalf("after Retry: %+v", ch)
	}
}

// TestSync: a changed check keeps the observed health of the backends it
// keeps, a backend that joins starts unknown, one that leaves is
// dropped, and removing the check or the service stops the checks and
// drops the overlay.
func TestSync(t *testing.T) {
	svc := checkedService("web", intent.HealthCheck{UnhealthyThreshold: 1, HealthyThreshold: 1}, beA, beB)
	hs := newHarness(t, svc)
	hs.net.set(beB, true)
	hs.h.Sync("web", &svc) // before Start: nothing
	if st := hs.h.Status(); st.Checked != 0 || st.Observed != 0 {
		t.Fatalf("Sync before Start: %+v", st)
	}
	hs.start()
	if st := hs.h.Status(); st != (Status{Checked: 1, Observed: 1, Backends: 2, Unhealthy: 1}) {
		t.Fatalf("after start: %+v", st)
	}
	was := backendOf(t, hs.h.Report(), "web", beA)

	changed := svc
	hc := *svc.HealthCheck
	hc.TimeoutMs = 700
	changed.HealthCheck = &hc
	changed.Backends = []intent.Backend{svc.Backends[0], {Address: beC.Addr(), Port: beC.Port()}}
	hs.view.mu.Lock()
	hs.view.services["web"] = &changed
	hs.h.Sync("web", &changed)
	hs.view.mu.Unlock()
	rep := hs.h.Report()
	if b := backendOf(t, rep, "web", beA); b.Observed != probe.Unhealthy || !b.LastChange.Equal(was.LastChange) {
		t.Errorf("kept backend after a change of check: %+v, want %+v", b, was)
	}
	if b := backendOf(t, rep, "web", beC); b.Observed != probe.Unknown || b.LastCheck != nil {
		t.Errorf("joined backend: %+v", b)
	}
	if st := hs.h.Status(); st.Backends != 2 || st.Checked != 1 {
		t.Errorf("after the change: %+v (the left backend dropped?)", st)
	}
	if rep.Services[0].HealthCheck.TimeoutMs != 700 {
		t.Errorf("report's check %+v", rep.Services[0].HealthCheck)
	}

	for _, tt := range []struct {
		name string
		svc  *intent.Service
	}{
		{"check removed", &intent.Service{Name: "web", Backends: changed.Backends}},
		{"service deleted", nil},
	} {
		hs.h.Sync("web", &changed)
		hs.h.Sync("web", tt.svc)
		if st := hs.h.Status(); st != (Status{}) {
			t.Errorf("%s: %+v, want nothing left", tt.name, st)
		}
		if got := hs.h.EffectiveState(&changed, &changed.Backends[0]); got != intent.BackendReady {
			t.Errorf("%s: effective state %s, want ready", tt.name, got)
		}
	}
}

// TestCloseWaits: Close ends the checks under way and waits for the
// checkers' goroutines and for a Changed in progress; rounds after Close
// run nothing.
func TestCloseWaits(t *testing.T) {
	leaks := goleak.IgnoreCurrent()
	t.Run("hung checks", func(t *testing.T) {
		hs := newHarness(t, checkedService("web", intent.HealthCheck{TimeoutMs: 3_600_000}, beA, beB))
		hs.net.mu.Lock()
		hs.net.hang = true
		hs.net.mu.Unlock()
		hs.h.Start()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			hs.net.mu.Lock()
			active := hs.net.active
			hs.net.mu.Unlock()
			if active == 2 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the checks did not start")
			}
		}
		if err := hs.h.Close(); err != nil {
			t.Fatal(err)
		}
		hs.net.mu.Lock()
		active, dials := hs.net.active, hs.net.dials
		hs.net.mu.Unlock()
		if active != 0 {
			t.Errorf("%d checks still running after Close", active)
		}
		if rep, n, err := hs.h.Reconcile(context.Background()); n != 0 || err != nil || len(rep.Services) != 1 {
			t.Errorf("Reconcile after Close: %d rounds, %v, %+v", n, err, rep)
		}
		hs.net.mu.Lock()
		defer hs.net.mu.Unlock()
		if hs.net.dials != dials {
			t.Errorf("%d checks after Close", hs.net.dials-dials)
		}
	})
	t.Run("Changed in progress", func(t *testing.T) {
		hs := newHarness(t, checkedService("web", intent.HealthCheck{UnhealthyThreshold: 1}, beA))
		block, inCall := make(chan struct{}), make(chan struct{}, 1)
		hs.mu.Lock()
		hs.block, hs.inCall = block, inCall
		hs.mu.Unlock()
		hs.h.Start() // beA down: the first round calls Changed, which waits
		select {
		case <-inCall:
		case <-time.After(10 * time.Second):
			t.Fatal("Changed not called")
		}
		closed := make(chan struct{})
		go func() {
			hs.h.Close()
			close(closed)
		}()
		select {
		case <-closed:
			t.Fatal("Close returned while Changed was running")
		case <-time.After(50 * time.Millisecond):
		}
		close(block)
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatal("Close did not return after Changed")
		}
		if ch := hs.takeChanges(); len(ch) != 1 {
			t.Errorf("changes %+v", ch)
		}
		if err := hs.h.Close(); err != nil { // idempotent
			t.Fatal(err)
		}
	})
	goleak.VerifyNone(t, leaks)
}

// TestEffectiveState is the overlay rule: only a Ready backend of a
// health-checked service that is observed Unhealthy changes.
func TestEffectiveState(t *testing.T) {
	ep := beA
	check := &intent.HealthCheck{Kind: "tcp"}
	tests := []struct {
		intent   intent.BackendState
		check    *intent.HealthCheck
		observed probe.State // "" = not tracked
		want     intent.BackendState
	}{
		{intent.BackendReady, check, "", intent.BackendReady},
		{intent.BackendReady, check, probe.Unknown, intent.BackendReady},
		{intent.BackendReady, check, probe.Healthy, intent.BackendReady},
		{intent.BackendReady, check, probe.Unhealthy, intent.BackendUnhealthy},
		{"", check, probe.Unhealthy, intent.BackendUnhealthy},
		{intent.BackendReady, nil, probe.Unhealthy, intent.BackendReady}, // check removed: overlay ignored
		{intent.BackendDraining, check, probe.Unhealthy, intent.BackendDraining},
		{intent.BackendDraining, check, probe.Healthy, intent.BackendDraining},
		{intent.BackendUnhealthy, check, probe.Healthy, intent.BackendUnhealthy},
		{intent.BackendUnhealthy, check, probe.Unknown, intent.BackendUnhealthy},
	}
	for _, tt := range tests {
		h := newHarness(t).h
		if tt.observed != "" {
			st := probe.NewStatus(time.Now())
			st.State = tt.observed
			h.observed["web"] = map[netip.AddrPort]*probe.Status{ep: &st}
		}
		svc := intent.Service{Name: "web", HealthCheck: tt.check}
		b := intent.Backend{Address: ep.Addr(), Port: ep.Port(), State: tt.intent}
		if got := h.EffectiveState(&svc, &b); got != tt.want {
			t.Errorf("intent %q, check %v, observed %q: %s, want %s", tt.intent, tt.check != nil, tt.observed, got, tt.want)
		}
	}
}

// TestChangeAffects: a change reprograms a service only when it is a
// retry or a changed backend is Ready in the current intent.
func TestChangeAffects(t *testing.T) {
	svc := intent.Service{Name: "web", Backends: []intent.Backend{
		{Address: beA.Addr(), Port: beA.Port()},
		{Address: beB.Addr(), Port: beB.Port(), State: intent.BackendDraining, DrainUntilUnixMs: 1},
		{Address: beC.Addr(), Port: beC.Port(), State: intent.BackendUnhealthy},
	}}
	tests := []struct {
		name string
		ch   Change
		want bool
	}{
		{"ready backend", Change{Backends: []netip.AddrPort{beA}}, true},
		{"draining backend", Change{Backends: []netip.AddrPort{beB}}, false},
		{"unhealthy intent", Change{Backends: []netip.AddrPort{beC}}, false},
		{"left the intent", Change{Backends: []netip.AddrPort{netip.MustParseAddrPort("10.9.9.9:1")}}, false},
		{"one of several", Change{Backends: []netip.AddrPort{beB, beA}}, true},
		{"retry", Change{Retry: true}, true},
		{"nothing", Change{}, false},
	}
	for _, tt := range tests {
		if got := tt.ch.Affects(&svc); got != tt.want {
			t.Errorf("%s: %v, want %v", tt.name, got, tt.want)
		}
	}
}

func TestNewRejects(t *testing.T) {
	v, dial, changed := &fakeView{}, (&fakeNet{}).dial, func(Change) error { return nil }
	for _, tt := range []struct {
		name string
		cfg  Config
		deps Deps
	}{
		{"no view", Config{}, Deps{Dial: dial, Changed: changed}},
		{"no dial", Config{}, Deps{View: v, Changed: changed}},
		{"no Changed", Config{}, Deps{View: v, Dial: dial}},
		{"negative concurrency", Config{Concurrency: -1}, Deps{View: v, Dial: dial, Changed: changed}},
	} {
		if _, err := New(tt.cfg, tt.deps); err == nil {
			t.Errorf("%s: accepted", tt.name)
		}
	}
}

// TestRoundWithoutFacadeLock: a round probes and records while the
// facade's lock (the view's) is held elsewhere, by an apply or an export
// say; only its Changed, which reprograms, waits for that lock.
func TestRoundWithoutFacadeLock(t *testing.T) {
	hs := newHarness(t, checkedService("web", intent.HealthCheck{UnhealthyThreshold: 1, HealthyThreshold: 1}, beA, beB))
	hs.net.set(beB, true)
	inCall := make(chan struct{}, 1)
	hs.mu.Lock()
	hs.inCall = inCall
	hs.mu.Unlock()
	gate := make(chan struct{})
	hs.net.mu.Lock()
	hs.net.gate = gate
	hs.net.mu.Unlock()
	hs.h.Start() // its first rounds wait in their dials
	hs.view.mu.Lock()
	close(gate)
	// The first round, started by Start, records beA down with the
	// lock held.
	for deadline := time.Now().Add(10 * time.Second); hs.h.Status().Unhealthy != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			hs.view.mu.Unlock()
			t.Fatalf("the round did not record while the facade's lock was held: %+v", hs.h.Status())
		}
	}
	if got := hs.h.EffectiveState(hs.view.services["web"], &hs.view.services["web"].Backends[0]); got != intent.BackendUnhealthy {
		t.Errorf("effective state %s during the hold, want unhealthy", got)
	}
	select {
	case <-inCall: // Changed started: it now waits for the lock
	case <-time.After(10 * time.Second):
		t.Fatal("Changed not called")
	}
	if ch := hs.takeChanges(); len(ch) != 0 {
		t.Errorf("Changed finished while the facade's lock was held: %+v", ch)
	}
	hs.view.mu.Unlock()
	if err := hs.h.Close(); err != nil { // waits for Changed
		t.Fatal(err)
	}
	if ch := hs.takeChanges(); len(ch) != 1 || !slices.Equal(ch[0].Backends, []netip.AddrPort{beA}) {
		t.Errorf("changes %+v", ch)
	}
}
