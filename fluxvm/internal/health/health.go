// Package health is the active health-check component of the dataplane.
//
// A service with a health_check has every enabled backend (of both
// families) probed with a TCP connect (Deps.Dial: the facade dials from
// the node's network namespace) every interval_ms; the root package
// health applies the thresholds. The result is a runtime overlay: the
// intent is never rewritten. What the datapath gets for a backend is its
// effective state (EffectiveState): the intent state, except that a Ready
// backend observed Unhealthy is programmed Unhealthy (no new flows; its
// flows fail over), and Ready again once it is observed Healthy. Draining
// and Unhealthy intents are programmed as they are, whatever the checks
// say.
//
// What it owns, under its own lock: one checker per health-checked
// service (its config, its probe targets, its goroutine) and the observed
// states. The facade tells it of every change of intent (Sync); it reads
// the services itself only through a View, at Start and for Report. One
// round per service runs at a time, whether started by the timer or by
// Reconcile; all rounds share one health.Prober, so at most
// Config.Concurrency checks run at once on the node. A round holds no
// lock while it probes, and neither the component's nor the facade's
// while it records: it takes the component's lock to read its targets and
// again to record the results. When the effective state of a backend may
// have changed, it calls Deps.Changed (the facade reprograms the service
// and recomputes the advertisements) after releasing its lock.
//
// Removing a service or its health_check stops its checks and drops its
// overlay. Changing its health_check keeps the observed health of the
// backends it keeps; a backend that joins starts Unknown (which counts as
// healthy).
//
// Lock order: the facade calls Sync, EffectiveState and Retry with its
// own lock (d.mu) held; this component's lock is taken after it, never
// before. The component calls the facade (View, Deps.Changed) only
// without its own lock held.
package health

import (
	"context"
	"errors"
	"iter"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"time"

	probe "github.com/fluxvm/servicefabric/health"
	"github.com/fluxvm/servicefabric/intent"
)

// View is the read-only view of the services the component needs.
type View interface {
	// HealthChecked yields the intent of every service with a health
	// check. The implementation holds the services' lock (the facade's
	// d.mu) for the whole iteration; the component calls it without its
	// own lock held, and takes its lock inside the loop (in lock order).
	HealthChecked() iter.Seq[*intent.Service]
}

// Change says what a round saw change; Deps.Changed gets it.
type Change struct {
	Service string
	// Backends are the endpoints whose observed health crossed between
	// unhealthy and not unhealthy.
	Backends []netip.AddrPort
	// Retry says that an earlier reprogram of the service failed or was
	// deferred (or Retry was called): reprogram even if nothing changed.
	Retry bool
}

// Affects says whether the change can alter what the datapath has for
// svc, the current intent of the service: a retry, or a changed backend
// whose intent state is Ready (the overlay changes only Ready backends).
func (c Change) Affects(svc *intent.Service) bool {
	if c.Retry {
		return true
	}
	for i := range svc.Backends {
		b := &svc.Backends[i]
		if b.EffectiveState() == intent.BackendReady && slices.Contains(c.Backends, b.Endpoint()) {
			return true
		}
	}
	return false
}

// Config is the component's configuration.
type Config struct {
	// Concurrency bounds the checks running at once on the node; 0
	// means health.DefaultConcurrency.
	Concurrency int
	// Logger receives the changes of observed health; nil discards them.
	Logger *slog.Logger
}

// Deps is what the component needs from the rest of the dataplane. Every
// field is required.
type Deps struct {
	View View
	// Dial opens the connection of one TCP check.
	Dial func(ctx context.Context, network, address string) (net.Conn, error)
	// Changed is called, without the component's lock, from the round's
	// goroutine, after a round recorded a Change. A non-nil error says the
	// datapath was not reprogrammed: the service's next round calls it
	// again with Retry set.
	Changed func(Change) error
}

// Checks runs the health checks of every health-checked service.
type Checks struct {
	view    View
	changed func(Change) error
	log     *slog.Logger
	prober  *probe.Prober
	ctx     context.Context // ends at Close
	cancel  context.CancelFunc
	wg      sync.WaitGroup // the checkers' goroutines and the rounds of Reconcile

	mu      sync.Mutex // guards the fields below; taken after the facade's lock, never before
	started bool
	closed  bool
	// checkers has one entry per service with a health check.
	checkers map[string]*checker
	// observed is the overlay: per service, per enabled backend.
	observed map[string]map[netip.AddrPort]*probe.Status
}

// checker runs the rounds of one service's health check.
type checker struct {
	service string
	cfg     intent.HealthCheck // with defaults
	ctx     context.Context
	cancel  context.CancelFunc
	round   chan struct{} // one round at a time: holds a token while one runs
	// Guarded by Checks.mu: targets are the enabled backends in intent
	// order, states their intent states (for the log); unprogrammed says
	// that the last reprogram after a health change failed, so the next
	// round reprograms even if nothing changes then.
	targets      []netip.AddrPort
	states       map[netip.AddrPort]intent.BackendState
	unprogrammed bool
}

// New makes the component; it starts nothing.
func New(cfg Config, deps Deps) (*Checks, error) {
	if deps.View == nil || deps.Dial == nil || deps.Changed == nil {
		return nil, errors.New("health: Deps.View, Deps.Dial and Deps.Changed are required")
	}
	if cfg.Concurrency < 0 {
		return nil, errors.New("health: negative concurrency")
	}
	h := &Checks{view: deps.View, changed: deps.Changed, log: cfg.Logger,
		prober:   probe.NewProber(deps.Dial, cfg.Concurrency),
		checkers: map[string]*checker{}, observed: map[string]map[netip.AddrPort]*probe.Status{}}
	if h.log == nil {
		h.log = slog.New(slog.DiscardHandler)
	}
	h.ctx, h.cancel = context.WithCancel(context.Background())
	return h, nil
}

// Start starts the checks of every health-checked service of the View.
// Sync before Start records nothing: Start reads every service.
func (h *Checks) Start() {
	h.mu.Lock()
	h.started = true
	h.mu.Unlock()
	for svc := range h.view.HealthChecked() {
		h.Sync(svc.Name, svc)
	}
}

// Close stops every check and waits for the checkers' goroutines and the
// rounds under way (their Changed calls included) to end. It is
// idempotent and must be called without the facade's lock (a round may
// be waiting for it in Changed). Report keeps answering with the states
// observed until then.
func (h *Checks) Close() error {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil
	}
	h.closed = true
	h.cancel()
	clear(h.checkers)
	h.mu.Unlock()
	h.wg.Wait()
	return nil
}

// Sync brings the check and the overlay of service name in line with its
// intent svc (nil: the service is gone). It does not reprogram: callers
// program the intent, which reads the overlay.
func (h *Checks) Sync(name string, svc *intent.Service) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.started {
		return
	}
	c := h.checkers[name]
	if svc == nil || svc.HealthCheck == nil || h.closed {
		if c != nil {
			c.cancel()
			delete(h.checkers, name)
		}
		delete(h.observed, name)
		return
	}
	obs := h.observed[name]
	if obs == nil {
		obs = map[netip.AddrPort]*probe.Status{}
		h.observed[name] = obs
	}
	targets, states := probeTargets(svc)
	now := time.Now().UTC()
	for _, ep := range targets {
		if obs[ep] == nil {
			st := probe.NewStatus(now)
			obs[ep] = &st
		}
	}
	for ep := range obs {
		if _, ok := states[ep]; !ok {
			delete(obs, ep)
		}
	}
	cfg := svc.HealthCheck.WithDefaults()
	if c == nil || c.cfg != cfg {
		if c != nil {
			c.cancel()
		}
		c = &checker{service: name, cfg: cfg, round: make(chan struct{}, 1)}
		c.ctx, c.cancel = context.WithCancel(h.ctx)
		h.checkers[name] = c
		h.wg.Add(1)
		go h.runChecker(c)
	}
	c.targets, c.states = targets, states
}

// probeTargets lists the endpoints of svc's enabled backends, in intent
// order, and the intent states of its backends.
func probeTargets(svc *intent.Service) ([]netip.AddrPort, map[netip.AddrPort]intent.BackendState) {
	var out []netip.AddrPort
	states := map[netip.AddrPort]intent.BackendState{}
	for i := range svc.Backends {
		if b := &svc.Backends[i]; b.IsEnabled() {
			out = append(out, b.Endpoint())
			states[b.Endpoint()] = b.EffectiveState()
		}
	}
	return out, states
}

// Retry says that the datapath may lack the overlay of service name (a
// failed change left it closed for repair): its next round reprograms it
// even if nothing changes.
func (h *Checks) Retry(name string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if c := h.checkers[name]; c != nil {
		c.unprogrammed = true
	}
}

// runChecker runs rounds of c: one at once, then one every interval,
// until c is canceled.
func (h *Checks) runChecker(c *checker) {
	defer h.wg.Done()
	t := time.NewTicker(time.Duration(c.cfg.IntervalMs) * time.Millisecond)
	defer t.Stop()
	for {
		h.runRound(c.ctx, c)
		select {
		case <-c.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// runRound probes every enabled backend of c's service once, records the
// results and, when they may change the datapath, calls Changed. It holds
// the component's lock only to read the targets and to record.
func (h *Checks) runRound(ctx context.Context, c *checker) {
	// Wait for a running round without outliving ctx: a reconcile must
	// return when its caller gives up, even if a round of many slow
	// checks is still going.
	select {
	case c.round <- struct{}{}:
	case <-ctx.Done():
		return
	}
	defer func() { <-c.round }()
	h.mu.Lock()
	if h.closed || h.checkers[c.service] != c {
		h.mu.Unlock()
		return
	}
	timeout := time.Duration(c.cfg.TimeoutMs) * time.Millisecond
	targets := make([]probe.Target, 0, len(c.targets))
	for _, ep := range c.targets {
		targets = append(targets, probe.Target{Addr: ep, Timeout: timeout})
	}
	h.mu.Unlock()

	results := h.prober.CheckAll(ctx, targets)

	change, ok := h.record(c, results)
	if !ok {
		return
	}
	if err := h.changed(change); err != nil {
		h.Retry(c.service)
	}
}

// record applies one round's results to the overlay and says whether the
// datapath may need to change. Results of a checker that was replaced or
// stopped meanwhile, and of backends that left the intent, are dropped;
// canceled checks say nothing about a backend and are not counted.
func (h *Checks) record(c *checker, results []probe.Result) (Change, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	obs := h.observed[c.service]
	if h.closed || h.checkers[c.service] != c || obs == nil {
		return Change{}, false
	}
	th := probe.Thresholds{Unhealthy: c.cfg.UnhealthyThreshold, Healthy: c.cfg.HealthyThreshold}
	ch := Change{Service: c.service, Retry: c.unprogrammed}
	for _, r := range results {
		st := obs[r.Addr]
		if st == nil || errors.Is(r.Err, probe.ErrCanceled) {
			continue
		}
		was := st.State
		if !st.Observe(r.Err, th, r.At.UTC()) {
			continue
		}
		h.log.Info("fluxvm: backend health changed", "service", c.service, "backend", r.Addr,
			"from", was, "to", st.State, "intent", c.states[r.Addr], "last_error", st.LastError)
		if (was == probe.Unhealthy) != (st.State == probe.Unhealthy) {
			ch.Backends = append(ch.Backends, r.Addr)
		}
	}
	if len(ch.Backends) == 0 && !ch.Retry {
		return Change{}, false
	}
	// Cleared before the call: a Retry that comes during it stays.
	c.unprogrammed = false
	return ch, true
}

// EffectiveState is the state the datapath gets for backend b of svc: its
// intent state, except Unhealthy for a Ready backend that svc's health
// check observed Unhealthy.
func (h *Checks) EffectiveState(svc *intent.Service, b *intent.Backend) intent.BackendState {
	st := b.EffectiveState()
	if st != intent.BackendReady || svc.HealthCheck == nil {
		return st
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.effective(svc, b)
}

// effective is EffectiveState with h.mu held.
func (h *Checks) effective(svc *intent.Service, b *intent.Backend) intent.BackendState {
	st := b.EffectiveState()
	if st != intent.BackendReady || svc.HealthCheck == nil {
		return st
	}
	if o := h.observed[svc.Name][b.Endpoint()]; o != nil && o.State == probe.Unhealthy {
		return intent.BackendUnhealthy
	}
	return st
}

// Report is the observed health of the backends of every service with a
// health check (GET /v1/network/services/health).
type Report struct {
	// Services are sorted by name; services without a health check are
	// not listed.
	Services []ServiceHealth `json:"services"`
}

// ServiceHealth is the health of one service's enabled backends.
type ServiceHealth struct {
	Name string `json:"name"`
	// HealthCheck is the service's check with its defaults filled in.
	HealthCheck intent.HealthCheck `json:"health_check"`
	// Backends are the enabled backends, in the order of the intent.
	Backends []BackendHealth `json:"backends"`
}

// BackendHealth is one backend's intent, observed health and effective
// state.
type BackendHealth struct {
	Address netip.Addr `json:"address"`
	Port    uint16     `json:"port"`
	// IntentState is Fabric's state for the backend (never rewritten).
	IntentState intent.BackendState `json:"intent_state"`
	// Observed is what the checks say: unknown (no threshold reached
	// yet; counts as healthy), healthy or unhealthy.
	Observed probe.State `json:"observed"`
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
	EffectiveState intent.BackendState `json:"effective_state"`
}

// Report reports the observed health of the backends of every
// health-checked service of the View. It must be called without the
// facade's lock (the View takes it).
func (h *Checks) Report() Report {
	rep := Report{Services: []ServiceHealth{}}
	for svc := range h.view.HealthChecked() {
		rep.Services = append(rep.Services, h.serviceHealth(svc))
	}
	sort.Slice(rep.Services, func(i, j int) bool { return rep.Services[i].Name < rep.Services[j].Name })
	return rep
}

func (h *Checks) serviceHealth(svc *intent.Service) ServiceHealth {
	h.mu.Lock()
	defer h.mu.Unlock()
	sh := ServiceHealth{Name: svc.Name, HealthCheck: svc.HealthCheck.WithDefaults(), Backends: []BackendHealth{}}
	obs := h.observed[svc.Name]
	for i := range svc.Backends {
		b := &svc.Backends[i]
		if !b.IsEnabled() {
			continue
		}
		bh := BackendHealth{Address: b.Address, Port: b.Port, IntentState: b.EffectiveState(),
			Observed: probe.Unknown, EffectiveState: h.effective(svc, b)}
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
	return sh
}

// Reconcile runs one round of every service's health check now, records
// it like a scheduled round (calling Changed), and returns the report and
// the number of rounds run. A round of a service that is already running
// is waited for first. It returns within the largest timeout_ms of a
// round after ctx ends, or when every round is done; its error is ctx's,
// when ctx ended before every round completed (the checks it cut short
// are not counted). After Close it runs no round. It must be called
// without the facade's lock.
func (h *Checks) Reconcile(ctx context.Context) (Report, int, error) {
	h.mu.Lock()
	cs := make([]*checker, 0, len(h.checkers))
	for _, c := range h.checkers {
		cs = append(cs, c)
	}
	// Under the lock, before Close can wait: Close waits for these too.
	h.wg.Add(len(cs))
	h.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer h.wg.Done()
			defer wg.Done()
			// The round ends when the caller gives up or the check stops.
			rctx, cancel := context.WithCancel(ctx)
			defer cancel()
			stop := context.AfterFunc(c.ctx, cancel)
			defer stop()
			h.runRound(rctx, c)
		}()
	}
	wg.Wait()
	return h.Report(), len(cs), ctx.Err()
}

// Status counts what the component holds.
type Status struct {
	// Checked is the number of services whose checks run.
	Checked int `json:"checked"`
	// Observed is the number of services with an overlay (as Checked
	// while open; after Close, the overlays kept for Report).
	Observed int `json:"observed"`
	// Backends counts the backends observed; Unhealthy those of them
	// observed unhealthy.
	Backends  int `json:"backends"`
	Unhealthy int `json:"unhealthy"`
}

// Status reports the component's counts. It takes only its own lock.
func (h *Checks) Status() Status {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := Status{Checked: len(h.checkers), Observed: len(h.observed)}
	for _, obs := range h.observed {
		for _, o := range obs {
			st.Backends++
			if o.State == probe.Unhealthy {
				st.Unhealthy++
			}
		}
	}
	return st
}
