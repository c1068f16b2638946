package fluxvm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestApplyConcurrency measures how applies scale with concurrent
// clients: weight changes of the services of a 1,000-service catalog
// (tier L, catalog on disk, fsync included) by one client and by eight
// clients at once, each client changing services of its own, directly
// through the SDK (Dataplane.ApplyService) and through the REST handler
// over real HTTP on loopback inside a network namespace of the test. The
// one-client and eight-client rounds alternate, so that both see the same
// machine; it prints each round's rates and the medians and their ratio.
// Last, one client and then eight delete services (SDK), once.
// It is a benchmark, not a test: it runs only with FLUXVM_APPLYBENCH=1 and
// never fails on timing.
//
//	FLUXVM_APPLYBENCH=1 go test -run TestApplyConcurrency -v -count=1 -timeout 30m ./fluxvm/
//
// FLUXVM_APPLYBENCH_ROUNDS sets the rounds per path (default 5) and
// FLUXVM_APPLYBENCH_OPS the applies per round (default 400);
// FLUXVM_APPLYBENCH_DIR the directory of the catalog (see
// TestApplyAtScale).
func TestApplyConcurrency(t *testing.T) {
	fluxvm.BenchOnly(t)
	rounds := fluxvm.BenchEnvInt(t, "FLUXVM_APPLYBENCH_ROUNDS", 5, 1)
	ops := fluxvm.BenchEnvInt(t, "FLUXVM_APPLYBENCH_OPS", 400, 16)
	const services, clients = 1000, 8
	var fill time.Duration
	d, _ := fluxvm.BenchDataplane(t, services, &fill)
	ctx := context.Background()

	// The REST handler, served on loopback inside a namespace of the test.
	ns := testenv.NewNetNS(t, "fvapply")
	var ln net.Listener
	if err := ns.Do(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			return err
		}
		ln, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	h, err := api.New(api.RolesOf(d), api.Options{AdminTokens: []string{"bench-admin"}})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	url := "http://" + ln.Addr().String() + "/v1/network/services"
	httpc := &http.Client{Transport: &http.Transport{DialContext: ns.DialContext, MaxIdleConnsPerHost: clients}, Timeout: time.Minute}
	t.Cleanup(httpc.CloseIdleConnections)

	sdk := func(svc fluxvm.Service) error {
		_, err := d.ApplyService(ctx, svc)
		return err
	}
	rest := func(svc fluxvm.Service) error {
		body, err := json.Marshal(svc)
		if err != nil {
			return err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer bench-admin")
		req.Header.Set("Content-Type", "application/json")
		resp, err := httpc.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s: %s", resp.Status, b)
		}
		return nil
	}

	// Every apply changes the weight of its service's first backend: the
	// k-th change of a service sets 2 + k%2 (the catalog has 1).
	changes := make([]int, services)
	var cmu sync.Mutex
	next := func(i int) fluxvm.Service {
		cmu.Lock()
		changes[i]++
		w := uint32(2 + changes[i]%2)
		cmu.Unlock()
		return fluxvm.BenchService(i, w)
	}
	// round runs ops applies by n clients; client c changes services
	// c, c+n, c+2n, ... in turn. It returns applies/s and the latencies.
	round := func(apply func(fluxvm.Service) error, n int) (float64, []time.Duration) {
		return fluxvm.BenchClients(t, n, ops/n, func(c, k int) func() error {
			svc := next((c + k*n) % services)
			return func() error { return apply(svc) }
		})
	}

	for _, path := range []struct {
		name  string
		apply func(fluxvm.Service) error
	}{{"sdk", sdk}, {"rest", rest}} {
		round(path.apply, clients) // warm-up: connections, first tables
		var one, many, ratios []float64
		var oneLat, manyLat []time.Duration
		for r := range rounds {
			r1, l1 := round(path.apply, 1)
			r8, l8 := round(path.apply, clients)
			if t.Failed() {
				t.FailNow()
			}
			one, many, ratios = append(one, r1), append(many, r8), append(ratios, r8/r1)
			oneLat, manyLat = append(oneLat, l1...), append(manyLat, l8...)
			t.Logf("%s round %d: 1 client %.0f applies/s (p50 %s), %d clients %.0f applies/s (p50 %s), ratio %.2f×",
				path.name, r+1, r1, pct(l1, 0.5), clients, r8, pct(l8, 0.5), r8/r1)
		}
		t.Logf("%s, %d services, %d rounds of %d applies: 1 client %s applies/s (p50 %s, p99 %s); %d clients %s applies/s (p50 %s, p99 %s); ratio %s×",
			path.name, services, rounds, ops, spread(one), pct(oneLat, 0.5), pct(oneLat, 0.99),
			clients, spread(many), pct(manyLat, 0.5), pct(manyLat, 0.99), spread(ratios))
	}

	// Deletes (SDK), once, since they use the services up: one client
	// deletes 160 services, then eight clients 80 each.
	del := func(first, n, per int) (float64, []time.Duration) {
		return fluxvm.BenchClients(t, n, per, func(c, k int) func() error {
			return func() error {
				if err := d.DeleteService(ctx, fluxvm.BenchService(first+c*per+k, 1).Name); err != nil {
					return fmt.Errorf("delete: %w", err)
				}
				return nil
			}
		})
	}
	d1, l1 := del(0, 1, 160)
	d8, l8 := del(160, clients, 80)
	t.Logf("sdk deletes: 1 client %.0f deletes/s (p50 %s), %d clients %.0f deletes/s (p50 %s), ratio %.2f×",
		d1, pct(l1, 0.5), clients, d8, pct(l8, 0.5), d8/d1)
}

// spread is the median of v and its range, "median [min–max]".
func spread(v []float64) string {
	s := slices.Clone(v)
	slices.Sort(s)
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	f := "%.0f [%.0f–%.0f]"
	if med < 10 {
		f = "%.2f [%.2f–%.2f]"
	}
	return fmt.Sprintf(f, med, s[0], s[len(s)-1])
}

func pct(l []time.Duration, p float64) time.Duration {
	return fluxvm.BenchPct(l, p).Round(10 * time.Microsecond)
}
