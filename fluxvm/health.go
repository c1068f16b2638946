package fluxvm

import (
	"context"
	"errors"
	"iter"
	"net"
	"net/netip"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/fluxvm/internal/advertisements"
	healthchecks "github.com/fluxvm/servicefabric/fluxvm/internal/health"
)

// Active health checks: package fluxvm/internal/health (healthchecks
// here) runs them and keeps the observed health; this file wires it to
// the dataplane. The facade tells it of every change of intent
// (syncHealth, under d.mu), asks it for a backend's effective state while
// programming (under d.mu: its lock comes after d.mu), and reprograms a
// service when a round says its health changed (reprogramHealth, called
// by the component without its own lock).

// The health report types (package fluxvm/internal/health's).
type (
	// HealthReport is the observed health of the backends of every
	// service with a health check (GET /v1/network/services/health).
	HealthReport = healthchecks.Report
	// ServiceHealth is the health of one service's enabled backends.
	ServiceHealth = healthchecks.ServiceHealth
	// BackendHealth is one backend's intent, observed health and
	// effective state.
	BackendHealth = healthchecks.BackendHealth
)

// newHealth makes the health-check component; Open calls it before the
// catalog is restored (programming reads effective states).
func (d *Dataplane) newHealth() (*healthchecks.Checks, error) {
	return healthchecks.New(healthchecks.Config{Concurrency: d.opts.HealthCheckConcurrency, Logger: d.log},
		healthchecks.Deps{View: servicesView{d}, Dial: d.dialHealth, Changed: d.reprogramHealth})
}

// dialHealth dials a health check: from the node's network namespace, or
// with testHealthDial when a test set it (before the first check).
func (d *Dataplane) dialHealth(ctx context.Context, network, address string) (net.Conn, error) {
	if d.testHealthDial != nil {
		return d.testHealthDial(ctx, network, address)
	}
	return d.dialNode(ctx, network, address)
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

// syncHealth brings the checks and the overlay of one service in line
// with its intent (or its absence). d.mu must be held. It does not
// reprogram: callers program the intent, which reads the overlay.
func (d *Dataplane) syncHealth(name string) {
	var svc *Service
	if s := d.services[name]; s != nil {
		svc = &s.Intent
	}
	d.health.Sync(name, svc)
}

// effectiveState is the state the datapath gets for backend b of svc
// (healthchecks.Checks.EffectiveState). d.mu must be held.
func (d *Dataplane) effectiveState(svc *Service, b *Backend) BackendState {
	return d.health.EffectiveState(svc, b)
}

// errApplyUnderWay defers a health reprogram to the service's next round.
var errApplyUnderWay = errors.New("a change of the service is under way")

// reprogramHealth is the health component's Changed: after a round
// changed the observed health of backends of a service, it reprograms the
// service through the same path as ApplyService (tables swapped whole, the
// guard left as it is) and recomputes the VIP advertisements (a VIP whose
// service has no effectively Ready backend is withdrawn). It takes d.mu.
// An error makes the next round retry.
func (d *Dataplane) reprogramHealth(ch healthchecks.Change) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.services[ch.Service]
	if s == nil || !ch.Affects(&s.Intent) {
		return nil
	}
	if d.busy[ch.Service] > 0 {
		// An apply of the service is building its tables: its commit
		// sees the changed overlay and programs it (ApplyService).
		// Until then the next round retries.
		return errApplyUnderWay
	}
	if err := d.prog.Program(s.Intent, s); err != nil {
		d.log.Error("fluxvm: reprogramming after a health change failed; the next round retries", "service", ch.Service, "err", err)
		return err
	}
	d.advertise()
	return nil
}

// servicesView is the read-only view of the services that the health and
// advertisement components declare.
type servicesView struct{ d *Dataplane }

// HealthChecked yields the services with a health check, holding d.mu
// for the iteration (healthchecks.View).
func (v servicesView) HealthChecked() iter.Seq[*Service] {
	return func(yield func(*Service) bool) {
		v.d.mu.Lock()
		defer v.d.mu.Unlock()
		for _, s := range v.d.services {
			if s.Intent.HealthCheck != nil && !yield(&s.Intent) {
				return
			}
		}
	}
}

// Services yields every service; the caller holds d.mu
// (advertisements.View).
func (v servicesView) Services() iter.Seq[*Service] {
	return func(yield func(*Service) bool) {
		for _, s := range v.d.services {
			if !yield(&s.Intent) {
				return
			}
		}
	}
}

// EffectiveState is d.effectiveState; the caller holds d.mu
// (advertisements.View).
func (v servicesView) EffectiveState(svc *Service, b *Backend) BackendState {
	return v.d.effectiveState(svc, b)
}

// Health reports the observed health of every health-checked service's
// backends. After Close it reports them as they were at Close; after
// Cleanup the report is empty.
func (d *Dataplane) Health() HealthReport {
	if d.unopened() {
		return HealthReport{Services: []ServiceHealth{}}
	}
	return d.health.Report()
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
	err = d.checkOpen("reconcile health")
	d.mu.Unlock()
	if err != nil {
		return HealthReport{}, err
	}
	rep, rounds, err := d.health.Reconcile(ctx)
	backends := 0
	for _, s := range rep.Services {
		backends += len(s.Backends)
	}
	span.SetAttributes(AttrServices.Int(rounds), AttrHealthBackends.Int(backends))
	return rep, err
}

// SNAT is the node's SNAT addresses for the advertisements: its own, the
// peers' it took over, and advertise_snat; the caller holds d.mu
// (advertisements.View).
func (v servicesView) SNAT() advertisements.SNAT {
	ns := v.d.opts.NorthSouth
	s := advertisements.SNAT{Advertise: ns.AdvertiseSNAT}
	for _, a := range []netip.Addr{ns.SNATAddress, ns.SNATAddressV6} {
		if a.IsValid() {
			s.Own = append(s.Own, a.Unmap())
		}
	}
	for _, p := range v.d.snatPeers {
		if p.Announce {
			s.TakenOver = append(s.TakenOver, p.Addr)
		}
	}
	return s
}

// Hold withdraws every advertisement while the node is an edge of a group
// that has not joined since it started (HA.Join); the caller holds d.mu
// (advertisements.View).
func (v servicesView) Hold() advert.Reason {
	if v.d.ha != nil && !v.d.ha.Joined() {
		return advert.ReasonGroupJoining
	}
	return ""
}
