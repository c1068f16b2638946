package fluxvm

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// BenchmarkApplyGrow times, at FLUXVM_BENCH_TIER (default L), an apply
// that grows flow maps from their token size to the tier's capacity
// against the same apply on maps already grown: each iteration opens a
// fresh dataplane (untimed), applies an IPv4 east-west service (which
// grows fluxvm_fct4, untimed), then times the case's apply:
//
//   - fct6: the first IPv6 service, growing fluxvm_fct6;
//   - nat4: the fifth frontend listing the same IPv4 backends (its flows
//     store reverse halves), growing fluxvm_nat4;
//   - none: the same IPv6 service, with fluxvm_fct6 grown beforehand
//     (untimed): the apply alone.
//
// Run: FLUXVM_REQUIRE_PRIVILEGED=1 go test -run '^$' -bench BenchmarkApplyGrow -benchtime 8x -count 3 ./fluxvm
func BenchmarkApplyGrow(b *testing.B) {
	tier := bpf.TierL
	if s := os.Getenv("FLUXVM_BENCH_TIER"); s != "" {
		t, err := bpf.ParseTier(s)
		if err != nil {
			b.Fatal(err)
		}
		tier = t
	}
	// s(i) lists the backends of ewService4: the fifth frontend listing
	// them (web4's, then s0..s3) stores reverse halves.
	ew := func(i int) Service {
		return ewService4(fmt.Sprintf("s%d", i), netip.AddrFrom4([4]byte{10, 96, 1, byte(i)}))
	}
	v6 := Service{Name: "web6", VIPs: []netip.Addr{netip.MustParseAddr("fd00:96::10")}, Ports: []ServicePort{{Port: 80, Protocol: TCP}}}
	for i := range 3 {
		v6.Backends = append(v6.Backends, Backend{Address: netip.AddrFrom16([16]byte{0xfd, 0, 2, 15: byte(10 + i)}), Port: 8080})
	}
	for _, tc := range []struct {
		name  string
		pre   []string  // grown before the timed apply
		first []Service // applied before it
		apply Service
		grows int
	}{
		{"fct6", nil, nil, v6, 1},
		{"nat4", nil, []Service{ew(0), ew(1), ew(2)}, ew(3), 1},
		{"none", []string{"fluxvm_fct6"}, nil, v6, 0},
	} {
		b.Run(fmt.Sprintf("tier=%s/grow=%s", tier, tc.name), func(b *testing.B) {
			root := testenv.PinRoot(b)
			var grown, worst time.Duration
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				opts := Options{
					Loader:              bpf.Options{PinRoot: filepath.Join(root, fmt.Sprintf("s%d", i)), Tier: tier},
					CatalogPath:         filepath.Join(b.TempDir(), "catalog.json"),
					ConntrackGCInterval: -1,
				}
				d, err := Open(context.Background(), opts)
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				if _, err := d.ApplyService(ctx, ewService4("web4", netip.MustParseAddr("10.96.0.10"))); err != nil {
					b.Fatal(err)
				}
				for _, s := range tc.first {
					if _, err := d.ApplyService(ctx, s); err != nil {
						b.Fatal(err)
					}
				}
				if len(tc.pre) > 0 {
					d.flowMu.Lock() // growMaps lets it go
					err := d.growMaps("bench", tc.pre, map[string]sizeNeed{}, time.Now())
					if err != nil {
						b.Fatal(err)
					}
				}
				before := d.Status().MapSizes.LastGrowth
				b.StartTimer()
				t0 := time.Now()
				if _, err := d.ApplyService(ctx, tc.apply); err != nil {
					b.Fatal(err)
				}
				worst = max(worst, time.Since(t0))
				b.StopTimer()
				g := d.Status().MapSizes.LastGrowth
				if n := 0; g != before {
					n = len(g.Maps)
					if n != tc.grows {
						b.Fatalf("grew %d maps, want %d", n, tc.grows)
					}
					grown += g.Switch.Duration
				} else if tc.grows != 0 {
					b.Fatal("nothing grew")
				}
				if err := d.Cleanup(context.Background()); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			b.ReportMetric(float64(grown.Microseconds())/float64(b.N), "switch-µs/op")
			b.ReportMetric(float64(worst.Milliseconds()), "max-ms")
		})
	}
}
