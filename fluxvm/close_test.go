package fluxvm

import (
	"context"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// TestCloseEndsGoroutines opens a dataplane with every component that
// owns a goroutine running: the GC timer, the advertisement publisher and
// the health checks of a service (with a round under way), and checks that
// none of the goroutines started since Open outlives Close. The GC and
// check intervals are long, so a goroutine Close forgot would wait on its
// timer and be found.
func TestCloseEndsGoroutines(t *testing.T) {
	e := newEnv(t)
	e.opts.ConntrackGCInterval = time.Hour
	e.opts.AdvertisementsPath = filepath.Join(t.TempDir(), "service-advertisements.json")
	leaks := goleak.IgnoreCurrent()
	d := e.open(t)
	// A threshold of 1: the first round reprograms the service, possibly
	// while ApplyService returns (under -race this once caught
	// ApplyService reading the service after releasing the lock).
	hc := &HealthCheck{Kind: "tcp", TimeoutMs: 500, IntervalMs: 3_600_000, UnhealthyThreshold: 1, HealthyThreshold: 1}
	svc := e.healthService(hc)
	probing := signalDials(d, netip.AddrPortFrom(e.backends[0].Addr4, 8080))
	if _, err := d.ApplyService(context.Background(), svc); err != nil {
		t.Fatal(err)
	}
	await(t, probing, 5*time.Second, "the first health round")
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	goleak.VerifyNone(t, leaks)
}
