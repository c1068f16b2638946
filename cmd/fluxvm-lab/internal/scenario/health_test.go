//go:build linux

package scenario

// End-to-end test of active health checks: the node probes the backend
// VMs' identity servers from its own namespace, and new connections
// through the VIPs follow what the checks observe.

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/health"
)

// healthWait polls the dataplane's health report until every backend
// endpoint of vm is observed want (and programmed accordingly), and
// returns how long that took; it fails the test after bound.
func healthWait(t *testing.T, e *Env, vm string, want health.State, bound time.Duration) time.Duration {
	t.Helper()
	b, _, err := e.Backend(vm)
	if err != nil {
		t.Fatal(err)
	}
	eps := map[netip.AddrPort]bool{
		netip.AddrPortFrom(b.Addr4, BackendPort): true,
		netip.AddrPortFrom(b.Addr6, BackendPort): true,
	}
	wantEffective := fluxvm.BackendReady
	if want == health.Unhealthy {
		wantEffective = fluxvm.BackendUnhealthy
	}
	start := time.Now()
	var last []fluxvm.BackendHealth
	for {
		last = last[:0]
		for _, s := range e.DP.Health().Services {
			for _, bh := range s.Backends {
				if eps[netip.AddrPortFrom(bh.Address, bh.Port)] {
					last = append(last, bh)
				}
			}
		}
		done := len(last) == len(eps)
		for _, bh := range last {
			done = done && bh.Observed == want && bh.EffectiveState == wantEffective
		}
		took := time.Since(start)
		if done {
			return took
		}
		if took > bound {
			t.Fatalf("%s not observed %s within %v: %+v", vm, want, bound, last)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// healthIntentReady checks that the intent still says ready for every
// backend: health never rewrites it.
func healthIntentReady(t *testing.T, e *Env, phase string) {
	t.Helper()
	st, err := e.DP.Service("web")
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range st.Service.Backends {
		if b.EffectiveState() != fluxvm.BackendReady {
			t.Errorf("%s: intent of %s is %s, want ready", phase, b.Endpoint(), b.EffectiveState())
		}
	}
}

// healthNewConns opens n new TCP connections to each VIP and counts the
// backends that answered.
func healthNewConns(t *testing.T, e *Env, n int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for _, fam := range e2eFamilies {
		for range n {
			c, err := e.Client.DialTCP(netip.AddrPortFrom(fam.vip, 80), e2eOK)
			if err != nil {
				t.Fatalf("%s: new connection: %v", fam.name, err)
			}
			got[c.Backend]++
			c.Close()
		}
	}
	return got
}

// TestE2EHealthCheckFollowsServer stops one backend's server: within
// unhealthy_threshold x interval + timeout (+ slack) the checks mark both
// of its endpoints unhealthy and every new connection goes to the other
// backend; the server starts again and the backend returns within
// healthy_threshold x interval (+ slack) and takes new connections again.
// The intent says ready throughout.
func TestE2EHealthCheckFollowsServer(t *testing.T) {
	e := e2eNewEnv(t, 2)
	hc := &fluxvm.HealthCheck{Kind: "tcp", TimeoutMs: 100, IntervalMs: 200, UnhealthyThreshold: 2, HealthyThreshold: 2}
	svc := e2eService(t, e, e2eBackend{vm: "vm2", weight: 1}, e2eBackend{vm: "vm3", weight: 1})
	svc.Ports = []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}}
	svc.HealthCheck = hc
	e2eApply(t, e, svc)
	const slack = 600 * time.Millisecond
	interval, timeout := time.Duration(hc.IntervalMs)*time.Millisecond, time.Duration(hc.TimeoutMs)*time.Millisecond
	downBound := time.Duration(hc.UnhealthyThreshold)*interval + timeout + slack
	upBound := time.Duration(hc.HealthyThreshold)*interval + timeout + slack

	healthWait(t, e, "vm3", health.Healthy, interval+timeout+slack)
	got := healthNewConns(t, e, 20)
	t.Logf("both serving: %v", got)
	if got["vm2"] == 0 || got["vm3"] == 0 {
		t.Fatalf("new connections %v, want both backends", got)
	}

	_, i, err := e.Backend("vm3")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.servers[i].Close(); err != nil {
		t.Fatal(err)
	}
	took := healthWait(t, e, "vm3", health.Unhealthy, downBound)
	t.Logf("vm3 stopped: observed unhealthy after %v (bound %v)", took, downBound)
	healthIntentReady(t, e, "vm3 down")
	for _, fe := range mustService(t, e).Frontends {
		if fe.Eligible != 1 {
			t.Errorf("vm3 down: frontend %s: %d eligible backends, want 1", fe.VIP, fe.Eligible)
		}
	}
	got = healthNewConns(t, e, 20)
	t.Logf("vm3 down: %v", got)
	e2eOnly(t, "vm3 down", got, "vm2")

	srv, err := e.Backends[i].Serve(BackendPort)
	if err != nil {
		t.Fatal(err)
	}
	e.servers[i] = srv // Env.Close stops it
	took = healthWait(t, e, "vm3", health.Healthy, upBound)
	t.Logf("vm3 restarted: observed healthy after %v (bound %v)", took, upBound)
	healthIntentReady(t, e, "vm3 back")
	got = healthNewConns(t, e, 20)
	t.Logf("vm3 back: %v", got)
	if got["vm2"] == 0 || got["vm3"] == 0 {
		t.Errorf("vm3 back: new connections %v, want both backends", got)
	}

	// The REST reconcile path: one round now agrees with the timer.
	rep, err := e.DP.ReconcileHealth(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range rep.Services {
		for _, b := range s.Backends {
			if b.Observed != health.Healthy || b.EffectiveState != fluxvm.BackendReady || b.IntentState != fluxvm.BackendReady {
				t.Errorf("after reconcile: %+v", b)
			}
		}
	}
}

func mustService(t *testing.T, e *Env) fluxvm.ServiceStatus {
	t.Helper()
	st, err := e.DP.Service("web")
	if err != nil {
		t.Fatal(err)
	}
	return st
}
