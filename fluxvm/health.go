package fluxvm

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sort"
	"sync"
	"time"

	"github.com/fluxvm/servicefabric/health"
)

// Active health checks.
//
// A service with a health_check has every enabled backend (of both
// families) probed with a TCP connect from the node's network namespace
// (Options.InNamespace) every interval_ms; package health applies the
// thresholds. The result is a runtime overlay: the intent (the catalog,
// Services()) is never rewritten. What the datapath gets for a backend is
// its effective state: the intent state, except that a Ready backend
// observed Unhealthy is programmed Unhealthy (no new flows; its flows fail
// over), and Ready again once it is observed Healthy. Draining and
// Unhealthy intents are programmed as they are, whatever the checks say.
//
// Probing never holds the dataplane's lock: a round copies its targets
// under the lock, probes without it, and takes it again only to record
// the results and, when an effective state changed, to reprogram that one
// service through the same path as ApplyService (tables swapped whole,
// the guard left as it is). One round per service runs at a time, whether
// started by the timer or by ReconcileHealth; all rounds share one
// health.Prober, so at most Options.HealthCheckConcurrency checks run at once
// on the node.
//
// Removing a service or its health_check stops its checks and drops its
// overlay. Changing its health_check keeps the observed health of the
// backends it keeps; a backend that joins starts Unknown (which counts as
// healthy).

// healthChecks is the health-check state of a Dataplane. Its maps and
// closed are guarded by Dataplane.mu.
type healthChecks struct {
	prober *health.Prober
	ctx    context.Context // ends at Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // the timer goroutines
	closed bool
	// checkers has one entry per service with a health check.
	checkers map[string]*checker
	// observed is the overlay: per service, per enabled backend.
	observed map[string]map[netip.AddrPort]*health.Status
}

// checker runs the rounds of one service's health check.
type checker struct {
	service string
	cfg     HealthCheck // with defaults
	ctx     context.Context
	cancel  context.CancelFunc
	round   chan struct{} // one round at a time: holds a token while one runs
	// unprogrammed says that the last reprogram after a health change
	// failed: the datapath may not have the overlay yet, so the next
	// round reprograms even if nothing changes then. Guarded by
	// Dataplane.mu.
	unprogrammed bool
}

func (c *checker) thresholds() health.Thresholds {
	return health.Thresholds{Unhealthy: c.cfg.UnhealthyThreshold, Healthy: c.cfg.HealthyThreshold}
}

// initHealth prepares the health-check state; Open calls it before the
// catalog is restored.
func (d *Dataplane) initHealth() {
	d.health.ctx, d.health.cancel = context.WithCancel(context.Background())
	d.health.prober = health.NewProber(d.dialNode, d.opts.HealthCheckConcurrency)
	d.health.checkers = map[string]*checker{}
	d.health.observed = map[string]map[netip.AddrPort]*health.Status{}
}

// dialNode dials from the node's network namespace.
func (d *Dataplane) dialNode(ctx context.Context, network, address string) (net.Conn, error) {
	var c net.Conn
	err := d.opts.InNamespace(func() (err error) {
		var dl net.Dialer
		c, err = dl.DialContext(ctx, network, address)
		return err
	})
	return c, err
}

// startHealth starts the checks of every service in the catalog; Open
// calls it once the catalog is restored.
func (d *Dataplane) startHealth() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for name := range d.services {
		d.syncHealth(name)
	}
}

// stopHealth stops every check and waits for the timer goroutines to
// end. It is idempotent. It must be called without d.mu.
func (d *Dataplane) stopHealth() {
	d.mu.Lock()
	if d.health.cancel == nil {
		d.mu.Unlock()
		return
	}
	d.health.closed = true
	d.health.cancel()
	clear(d.health.checkers)
	d.mu.Unlock()
	d.health.wg.Wait()
}

// syncHealth brings the checks and the overlay of one service in line
// with its intent (or its absence). d.mu must be held. It does not
// reprogram: callers program the intent, which reads the overlay.
func (d *Dataplane) syncHealth(name string) {
	hc := &d.health
	s := d.services[name]
	c := hc.checkers[name]
	if s == nil || s.intent.HealthCheck == nil || hc.closed {
		if c != nil {
			c.cancel()
			delete(hc.checkers, name)
		}
		delete(hc.observed, name)
		return
	}
	obs := hc.observed[name]
	if obs == nil {
		obs = map[netip.AddrPort]*health.Status{}
		hc.observed[name] = obs
	}
	want := map[netip.AddrPort]bool{}
	now := time.Now().UTC()
	for _, ep := range probeTargets(&s.intent) {
		want[ep] = true
		if obs[ep] == nil {
			st := health.NewStatus(now)
			obs[ep] = &st
		}
	}
	for ep := range obs {
		if !want[ep] {
			delete(obs, ep)
		}
	}
	cfg := s.intent.HealthCheck.WithDefaults()
	if c != nil && c.cfg == cfg {
		return
	}
	if c != nil {
		c.cancel()
	}
	c = &checker{service: name, cfg: cfg, round: make(chan struct{}, 1)}
	c.ctx, c.cancel = context.WithCancel(hc.ctx)
	hc.checkers[name] = c
	hc.wg.Add(1)
	go d.runChecker(c)
}

// probeTargets lists the endpoints of svc's enabled backends, in intent
// order.
func probeTargets(svc *Service) []netip.AddrPort {
	var out []netip.AddrPort
	for i := range svc.Backends {
		if b := &svc.Backends[i]; b.IsEnabled() {
			out = append(out, b.Endpoint())
		}
	}
	return out
}

// runChecker runs rounds of c: one at once, then one every interval,
// until c is canceled.
func (d *Dataplane) runChecker(c *checker) {
	defer d.health.wg.Done()
	t := time.NewTicker(time.Duration(c.cfg.IntervalMs) * time.Millisecond)
	defer t.Stop()
	for {
		d.runRound(c.ctx, c)
		select {
		case <-c.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// runRound probes every enabled backend of c's service once and records
// the results. It holds d.mu only to read the targets and to record.
func (d *Dataplane) runRound(ctx context.Context, c *checker) {
	// Wait for a running round without outliving ctx: a reconcile must
	// return when its caller gives up, even if a round of many slow
	// checks is still going.
	select {
	case c.round <- struct{}{}:
	case <-ctx.Done():
		return
	}
	defer func() { <-c.round }()
	d.mu.Lock()
	s := d.services[c.service]
	if d.health.checkers[c.service] != c || s == nil {
		d.mu.Unlock()
		return
	}
	timeout := time.Duration(c.cfg.TimeoutMs) * time.Millisecond
	var targets []health.Target
	for _, ep := range probeTargets(&s.intent) {
		targets = append(targets, health.Target{Addr: ep, Timeout: timeout})
	}
	d.mu.Unlock()

	results := d.health.prober.CheckAll(ctx, targets)

	d.mu.Lock()
	defer d.mu.Unlock()
	d.recordHealth(c, results)
}

// recordHealth applies one round's results to the overlay and, when the
// effective state of a backend changed, reprograms the service. d.mu must
// be held. Results of a checker that was replaced or stopped meanwhile,
// and of backends that left the intent, are dropped; canceled checks say
// nothing about a backend and are not counted.
func (d *Dataplane) recordHealth(c *checker, results []health.Result) {
	hc := &d.health
	if hc.closed || hc.checkers[c.service] != c {
		return
	}
	s := d.services[c.service]
	obs := hc.observed[c.service]
	if s == nil || obs == nil {
		return
	}
	intent := map[netip.AddrPort]BackendState{}
	for i := range s.intent.Backends {
		b := &s.intent.Backends[i]
		intent[b.Endpoint()] = b.EffectiveState()
	}
	th := c.thresholds()
	reprogram := false
	for _, r := range results {
		st := obs[r.Addr]
		if st == nil || errors.Is(r.Err, health.ErrCanceled) {
			continue
		}
		was := st.State
		if !st.Observe(r.Err, th, r.At.UTC()) {
			continue
		}
		d.log.Info("fluxvm: backend health changed", "service", c.service, "backend", r.Addr,
			"from", was, "to", st.State, "intent", intent[r.Addr], "last_error", st.LastError)
		if (was == health.Unhealthy) != (st.State == health.Unhealthy) && intent[r.Addr] == BackendReady {
			reprogram = true
		}
	}
	if !reprogram && !c.unprogrammed {
		return
	}
	if d.busy[c.service] > 0 {
		// An apply of the service is building its tables: its commit
		// sees the changed overlay and programs it (ApplyService).
		// Until then the next round retries.
		c.unprogrammed = true
		return
	}
	if err := d.program(s.intent, s); err != nil {
		c.unprogrammed = true
		d.log.Error("fluxvm: reprogramming after a health change failed; the next round retries", "service", c.service, "err", err)
		return
	}
	c.unprogrammed = false
	d.healthChanged(c.service)
}

// healthChanged is called, with d.mu held, after a change of observed
// health changed the effective state of a backend of service and the
// service was reprogrammed. It recomputes the VIP advertisements (a VIP
// whose service has no effectively Ready backend is withdrawn) and hands
// them to the publisher goroutine (advertise.go) without blocking.
// Changes of intent (ApplyService, DeleteService) recompute them
// themselves.
func (d *Dataplane) healthChanged(service string) { d.advertise() }

// effectiveState is the state the datapath gets for backend b of svc: its
// intent state, except Unhealthy for a Ready backend that svc's health
// check observed Unhealthy. d.mu must be held.
func (d *Dataplane) effectiveState(svc *Service, b *Backend) BackendState {
	st := b.EffectiveState()
	if st != BackendReady || svc.HealthCheck == nil {
		return st
	}
	if o := d.health.observed[svc.Name][b.Endpoint()]; o != nil && o.State == health.Unhealthy {
		return BackendUnhealthy
	}
	return st
}

// HealthReport is the observed health of the backends of every service
// with a health check (GET /v1/network/services/health).
type HealthReport struct {
	// Services are sorted by name; services without a health check are
	// not listed.
	Services []ServiceHealth `json:"services"`
}

// ServiceHealth is the health of one service's enabled backends.
type ServiceHealth struct {
	Name string `json:"name"`
	// HealthCheck is the service's check with its defaults filled in.
	HealthCheck HealthCheck `json:"health_check"`
	// Backends are the enabled backends, in the order of the intent.
	Backends []BackendHealth `json:"backends"`
}

// BackendHealth is one backend's intent, observed health and effective
// state.
type BackendHealth struct {
	Address netip.Addr `json:"address"`
	Port    uint16     `json:"port"`
	// IntentState is Fabric's state for the backend (never rewritten).
	IntentState BackendState `json:"intent_state"`
	// Observed is what the checks say: unknown (no threshold reached
	// yet; counts as healthy), healthy or unhealthy.
	Observed health.State `json:"observed"`
	// ConsecutiveSuccesses and ConsecutiveFailures are the current run of
	// checks; one of them is 0.
	ConsecutiveSuccesses uint32 `json:"consecutive_successes"`
	ConsecutiveFailures  uint32 `json:"consecutive_failures"`
	// LastError is the error of the most recent failed check (kept after
	// a recovery).
	LastError string `json:"last_error,omitempty"`
	// LastChange is when Observed last changed (when checking began,
	// while it is unknown).
	LastChange time.Time `json:"last_change"`
	// LastCheck is when the most recent check finished; absent before the
	// first.
	LastCheck *time.Time `json:"last_check,omitempty"`
	// EffectiveState is what the datapath has: IntentState, or unhealthy
	// for a ready backend observed unhealthy.
	EffectiveState BackendState `json:"effective_state"`
}

// Health reports the observed health of every health-checked service's
// backends. After Close it reports them as they were at Close; after
// Cleanup the report is empty.
func (d *Dataplane) Health() HealthReport {
	if d.unopened() {
		return HealthReport{Services: []ServiceHealth{}}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.healthReport()
}

func (d *Dataplane) healthReport() HealthReport {
	rep := HealthReport{Services: []ServiceHealth{}}
	for name, s := range d.services {
		if s.intent.HealthCheck == nil {
			continue
		}
		sh := ServiceHealth{Name: name, HealthCheck: s.intent.HealthCheck.WithDefaults(), Backends: []BackendHealth{}}
		obs := d.health.observed[name]
		for i := range s.intent.Backends {
			b := &s.intent.Backends[i]
			if !b.IsEnabled() {
				continue
			}
			bh := BackendHealth{Address: b.Address, Port: b.Port, IntentState: b.EffectiveState(),
				Observed: health.Unknown, EffectiveState: d.effectiveState(&s.intent, b)}
			if o := obs[b.Endpoint()]; o != nil {
				bh.Observed = o.State
				bh.ConsecutiveSuccesses, bh.ConsecutiveFailures = o.Successes, o.Failures
				bh.LastError, bh.LastChange = o.LastError, o.LastChange
				if !o.LastCheck.IsZero() {
					at := o.LastCheck
					bh.LastCheck = &at
				}
			}
			sh.Backends = append(sh.Backends, bh)
		}
		rep.Services = append(rep.Services, sh)
	}
	sort.Slice(rep.Services, func(i, j int) bool { return rep.Services[i].Name < rep.Services[j].Name })
	return rep
}

// ReconcileHealth runs one round of every service's health check now,
// records it like a scheduled round (reprogramming what changed), and
// returns the report. A round of a service that is already running is
// waited for first. It returns within the largest timeout_ms of a round
// after ctx ends, or when every round is done; its error is ctx's, when
// ctx ended before every round completed (the checks it cut short are not
// counted).
func (d *Dataplane) ReconcileHealth(ctx context.Context) (_ HealthReport, err error) {
	if err := d.opened("reconcile health"); err != nil {
		return HealthReport{}, err
	}
	ctx, span := d.startSpan(ctx, SpanReconcileHealth)
	defer endSpan(span, &err)
	d.mu.Lock()
	if err := d.checkOpen("reconcile health"); err != nil {
		d.mu.Unlock()
		return HealthReport{}, err
	}
	cs := make([]*checker, 0, len(d.health.checkers))
	for _, c := range d.health.checkers {
		cs = append(cs, c)
	}
	d.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// The round ends when the caller gives up or the check stops.
			rctx, cancel := context.WithCancel(ctx)
			defer cancel()
			stop := context.AfterFunc(c.ctx, cancel)
			defer stop()
			d.runRound(rctx, c)
		}()
	}
	wg.Wait()
	rep := d.Health()
	backends := 0
	for _, s := range rep.Services {
		backends += len(s.Backends)
	}
	span.SetAttributes(AttrServices.Int(len(cs)), AttrHealthBackends.Int(backends))
	if err := ctx.Err(); err != nil {
		return rep, err
	}
	return rep, nil
}
