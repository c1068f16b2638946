package fluxvm

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestApplyAtScale measures the latency of ApplyService (creates and
// weight updates) and DeleteService at several catalog sizes, and the
// throughput of concurrent updaters, on a real pin root of tier L with
// the catalog on disk (fsync included). It is a benchmark, not a test:
// it runs only with FLUXVM_APPLYBENCH=1 and never fails on timing.
//
//	FLUXVM_APPLYBENCH=1 go test -run TestApplyAtScale -v -timeout 60m ./fluxvm/
//
// FLUXVM_APPLYBENCH_SIZES overrides the catalog sizes (comma-separated;
// default 10,1000,4095: tier L has 4096 service ids and id 0 means none),
// FLUXVM_APPLYBENCH_OPS the samples per operation and size (default 200)
// and FLUXVM_APPLYBENCH_DIR the directory of the catalog (default a test
// temporary directory, which must be on a disk for fsync to cost what it
// does on a node).
func TestApplyAtScale(t *testing.T) {
	benchOnly(t)
	sizes := []int{10, 1000, 4095}
	if s := os.Getenv("FLUXVM_APPLYBENCH_SIZES"); s != "" {
		sizes = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 9 {
				t.Fatalf("FLUXVM_APPLYBENCH_SIZES: %q (sizes of at least 9)", f)
			}
			sizes = append(sizes, n)
		}
	}
	ops := benchEnvInt(t, "FLUXVM_APPLYBENCH_OPS", 200, 10)
	type row struct {
		n                            int
		create, update, del, conc    latencies
		concPerSec                   float64
		fill                         time.Duration
		catalogBytes, journalBytes   int64
		concurrentClients, concTotal int
	}
	var rows []row
	for _, n := range sizes {
		r := row{n: n}
		d, dir := benchDataplane(t, n, &r.fill)
		ctx := context.Background()

		// Updates: a weight change of one backend, on services in turn.
		for i := range ops {
			svc := benchService(i%n, uint32(1+(i/n+1)%2))
			start := time.Now()
			if _, err := d.ApplyService(ctx, svc); err != nil {
				t.Fatalf("update: %v", err)
			}
			r.update = append(r.update, time.Since(start))
		}
		// Deletes then creates of the same services, a batch at a time,
		// so that the catalog stays within a few services of n.
		batch := min(n, 20)
		for done := 0; done < ops; done += batch {
			first := (done / batch * batch) % (n - batch + 1)
			for i := first; i < first+batch; i++ {
				start := time.Now()
				if err := d.DeleteService(ctx, benchName(i)); err != nil {
					t.Fatalf("delete: %v", err)
				}
				r.del = append(r.del, time.Since(start))
			}
			// A GC frees the ids of the deleted services for the creates.
			if _, err := d.GC(ctx); err != nil {
				t.Fatal(err)
			}
			for i := first; i < first+batch; i++ {
				start := time.Now()
				if _, err := d.ApplyService(ctx, benchService(i, 1)); err != nil {
					t.Fatalf("create: %v", err)
				}
				r.create = append(r.create, time.Since(start))
			}
		}
		// Eight clients, each updating the weights of a service of its own.
		const clients = 8
		per := max(ops/clients, 10)
		var mu sync.Mutex
		var wg sync.WaitGroup
		start := time.Now()
		for c := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var mine latencies
				for i := range per {
					svc := benchService(c, uint32(2+i%2))
					t0 := time.Now()
					if _, err := d.ApplyService(ctx, svc); err != nil {
						t.Errorf("concurrent update: %v", err)
						return
					}
					mine = append(mine, time.Since(t0))
				}
				mu.Lock()
				r.conc = append(r.conc, mine...)
				mu.Unlock()
			}()
		}
		wg.Wait()
		r.concPerSec = float64(len(r.conc)) / time.Since(start).Seconds()
		r.concurrentClients, r.concTotal = clients, len(r.conc)
		r.catalogBytes, r.journalBytes = catalogSizes(dir)
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		rows = append(rows, r)
		t.Logf("%d services: fill %v; create %s; update %s; delete %s; %d concurrent updaters: %.0f applies/s, %s",
			n, r.fill.Round(time.Millisecond), r.create, r.update, r.del, clients, r.concPerSec, r.conc)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n| services | create p50 / p99 | update p50 / p99 | delete p50 / p99 | 8 updaters: applies/s, p50 / p99 | catalog files |\n|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %.0f/s, %s | %d B + %d B journal |\n", r.n, r.create, r.update, r.del, r.concPerSec, r.conc, r.catalogBytes, r.journalBytes)
	}
	if len(rows) > 1 {
		first, last := rows[0], rows[len(rows)-1]
		fmt.Fprintf(&b, "\np99 at %d ÷ p99 at %d: create %.2f×, update %.2f×, delete %.2f×\n", last.n, first.n,
			ratio(last.create, first.create), ratio(last.update, first.update), ratio(last.del, first.del))
	}
	t.Log(b.String())
}

// benchOnly skips a benchmark of applies unless FLUXVM_APPLYBENCH=1.
func benchOnly(t *testing.T) {
	t.Helper()
	if os.Getenv("FLUXVM_APPLYBENCH") != "1" {
		t.Skip("a benchmark: set FLUXVM_APPLYBENCH=1 to run it")
	}
}

// benchClients runs n clients at once, each of them per operations in
// turn: client c's k-th is op(c, k), and only the function op returns is
// timed. It returns operations/s and their latencies; an error fails the
// test and ends that client.
func benchClients(t *testing.T, n, per int, op func(c, k int) func() error) (float64, []time.Duration) {
	lats := make([][]time.Duration, n)
	var wg sync.WaitGroup
	start := time.Now()
	for c := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range per {
				timed := op(c, k)
				t0 := time.Now()
				if err := timed(); err != nil {
					t.Errorf("client %d: %v", c, err)
					return
				}
				lats[c] = append(lats[c], time.Since(t0))
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	all := slices.Concat(lats...)
	return float64(len(all)) / el.Seconds(), all
}

// benchEnvInt is the number in environment variable name, def when it
// is unset; anything else than a number of at least least fails the test.
func benchEnvInt(t *testing.T, name string, def, least int) int {
	t.Helper()
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < least {
		t.Fatalf("%s: %q (a number of at least %d)", name, s, least)
	}
	return n
}

type latencies []time.Duration

func (l latencies) pct(p float64) time.Duration {
	if len(l) == 0 {
		return 0
	}
	s := slices.Clone(l)
	slices.Sort(s)
	i := int(p*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}

func (l latencies) String() string {
	return fmt.Sprintf("%s / %s", fmtDur(l.pct(0.50)), fmtDur(l.pct(0.99)))
}

func fmtDur(d time.Duration) string {
	if d < time.Millisecond {
		return fmt.Sprintf("%.0f µs", float64(d)/float64(time.Microsecond))
	}
	return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
}

func ratio(a, b latencies) float64 { return float64(a.pct(0.99)) / float64(b.pct(0.99)) }

func benchName(i int) string { return fmt.Sprintf("svc-%05d", i) }

// benchService is service i: one IPv4 VIP, TCP port 80, ten backends,
// the first with weight w.
func benchService(i int, w uint32) Service {
	s := Service{
		Name:  benchName(i),
		VIPs:  []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})},
		Ports: []ServicePort{{Port: 80, Protocol: TCP}},
	}
	for j := range 10 {
		b := Backend{Address: netip.AddrFrom4([4]byte{10, 200, byte(i >> 8), byte(i)}), Port: uint16(8080 + j)}
		if j == 0 {
			b.Weight = u32(w)
		}
		s.Backends = append(s.Backends, b)
	}
	return s
}

// benchDataplane opens a tier L dataplane whose catalog already holds
// services 0..n-1: it writes the catalog file (with the ids the
// dataplane would have given) and lets Open restore it, which is much
// faster than n applies.
func benchDataplane(t *testing.T, n int, fill *time.Duration) (*Dataplane, string) {
	t.Helper()
	dir := os.Getenv("FLUXVM_APPLYBENCH_DIR")
	if dir == "" {
		dir = t.TempDir()
	} else {
		var err error
		if dir, err = os.MkdirTemp(dir, "applybench-"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
	}
	path := filepath.Join(dir, "catalog.json")
	cat := catalogFile{Version: catalogVersion}
	for i := range n {
		svc := benchService(i, 1)
		cf := catalogFrontend{VIP: svc.VIPs[0], Port: 80, Protocol: TCP, ServiceID: uint32(i + 1)}
		for j, b := range svc.Backends {
			cf.Backends = append(cf.Backends, catalogBackend{Endpoint: b.Endpoint(), BackendID: uint32(i*10 + j + 1)})
		}
		cat.Services = append(cat.Services, catalogService{Service: svc, Revision: uint64(i + 1), AppliedAt: time.Now().UTC(), Frontends: []catalogFrontend{cf}})
	}
	data, err := json.Marshal(cat)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	d, err := Open(context.Background(), Options{
		Loader:              bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierL},
		CatalogPath:         path,
		ConntrackGCInterval: -1,
		Logger:              slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	*fill = time.Since(start)
	t.Cleanup(func() { d.Cleanup(context.Background()) })
	return d, dir
}

// catalogSizes returns the size of the catalog file and the total size
// of the journal files next to it.
func catalogSizes(dir string) (catalog, journal int64) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		fi, err := e.Info()
		if err != nil {
			continue
		}
		switch {
		case e.Name() == "catalog.json":
			catalog = fi.Size()
		case strings.HasPrefix(e.Name(), "catalog.json.journal"):
			journal += fi.Size()
		}
	}
	return catalog, journal
}
