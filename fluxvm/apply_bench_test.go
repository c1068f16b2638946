package fluxvm

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// BenchmarkApply times the apply path on a dataplane that already holds
// 24 services (tier S, GC timer off), with the catalog journal on disk
// (each change a synced journal record) and in memory:
//
//   - weights: ApplyService of one of them with one backend's weight
//     changed (new Maglev tables for its two frontends, journal record);
//   - create-delete: ApplyService of a new service, then DeleteService
//     of it (ids, frontend entries, tables, two journal records); the
//     GC that gives its ids back is not timed.
//
// It is the before/after instrument of the fluxvm reshape (issue 35):
// scripts/apply-pair.sh runs two builds of it in turn.
//
// Run: FLUXVM_REQUIRE_PRIVILEGED=1 go test -run '^$' -bench BenchmarkApply$ -benchtime 200x -count 5 ./fluxvm
func BenchmarkApply(b *testing.B) {
	const services = 24
	svc := func(i int) Service {
		s := Service{
			Name:  fmt.Sprintf("bench%d", i),
			VIPs:  []netip.Addr{netip.AddrFrom4([4]byte{10, 97, byte(i >> 8), byte(i)})},
			Ports: []ServicePort{{Port: 80, Protocol: TCP}, {Port: 53, Protocol: UDP}},
		}
		for j := range 8 {
			s.Backends = append(s.Backends, Backend{Address: netip.AddrFrom4([4]byte{10, 2, byte(i), byte(10 + j)}), Port: 8080})
		}
		return s
	}
	root := testenv.PinRoot(b)
	for _, catalog := range []string{"disk", "memory"} {
		b.Run("catalog="+catalog, func(b *testing.B) {
			opts := Options{
				Loader:              bpf.Options{PinRoot: filepath.Join(root, catalog), Tier: bpf.TierS},
				ConntrackGCInterval: -1,
			}
			if catalog == "disk" {
				opts.CatalogPath = filepath.Join(b.TempDir(), "catalog.json")
			}
			d, err := Open(context.Background(), opts)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() {
				if err := d.Cleanup(context.Background()); err != nil {
					b.Error(err)
				}
			})
			ctx := context.Background()
			for i := range services {
				if _, err := d.ApplyService(ctx, svc(i)); err != nil {
					b.Fatal(err)
				}
			}
			b.Run("weights", func(b *testing.B) {
				s := svc(7)
				for i := 0; b.Loop(); i++ {
					w := uint32(1 + i%4)
					s.Backends[3].Weight = &w
					if _, err := d.ApplyService(ctx, s); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("create-delete", func(b *testing.B) {
				s := svc(services)
				for b.Loop() {
					if _, err := d.ApplyService(ctx, s); err != nil {
						b.Fatal(err)
					}
					if err := d.DeleteService(ctx, s.Name); err != nil {
						b.Fatal(err)
					}
					// A deleted service's ids come back at the next GC.
					b.StopTimer()
					if _, err := d.GC(ctx); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
			})
		})
	}
}
