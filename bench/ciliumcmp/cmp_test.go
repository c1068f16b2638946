// Package ciliumcmp compares package maglev with Cilium's pkg/maglev, the
// best-known Go Maglev, on the grid of maglev's own benchmarks. It is a
// module of its own so that the project's go.mod does not depend on
// Cilium; see README.md for the commands.
package ciliumcmp

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/cilium/cilium/pkg/clustermesh/types"
	"github.com/cilium/cilium/pkg/loadbalancer"
	cilium "github.com/cilium/cilium/pkg/maglev"
	"github.com/cilium/hive/hivetest"

	"github.com/fluxvm/servicefabric/maglev"
)

// Table sizes: Cilium accepts only primes from its own list, which has
// 65521 where maglev.SizeM is 65537.
var (
	sizes   = [][2]uint32{{16381, maglev.SizeS}, {65521, maglev.SizeM}, {131071, maglev.SizeL}}
	counts  = []int{10, 100, 1000}
	weights = []string{"equal", "mixed"}
)

// weight is the weight of backend i, as in maglev's benchmarks: 1, or
// 1, 2, 3, 5, 8 in turn.
func weight(kind string, i int) uint32 {
	if kind == "mixed" {
		return []uint32{1, 2, 3, 5, 8}[i%5]
	}
	return 1
}

func addr(i int) netip.Addr {
	var a [4]byte
	binary.BigEndian.PutUint32(a[:], uint32(10<<24|i))
	return netip.AddrFrom4(a)
}

// ciliumTable is a long-lived Cilium Maglev and its backends, warmed up:
// the first build allocates the permutation buffer that later builds
// reuse, as a Cilium agent's does.
func ciliumTable(tb testing.TB, m uint32, n int, kind string) func() {
	cfg, err := cilium.UserConfig{TableSize: uint(m), HashSeed: cilium.DefaultHashSeed}.ToConfig()
	if err != nil {
		tb.Fatal(err)
	}
	ml := cilium.New(cfg, hivetest.Lifecycle(tb))
	bs := make([]cilium.BackendInfo, n)
	for i := range bs {
		a := loadbalancer.NewL3n4Addr(loadbalancer.TCP, types.AddrClusterFrom(addr(i), 0), 8080, 0)
		bs[i] = cilium.BackendInfo{ID: loadbalancer.BackendID(i + 1), Addr: a, Weight: uint16(weight(kind, i))}
	}
	build := func() { ml.GetLookupTable(slices.Values(bs)) }
	build()
	return build
}

// ours returns two backend sets of n that differ in one backend, as
// maglev's BenchmarkRebuild alternates between.
func ours(n int, kind string) [2][]maglev.Backend {
	var sets [2][]maglev.Backend
	for k := range sets {
		sets[k] = make([]maglev.Backend, n)
		for i := range sets[k] {
			sets[k][i] = maglev.Backend{ID: uint32(i + 1), Addr: addr(i), Port: 8080, Proto: 6, Weight: weight(kind, i), Ready: true}
		}
	}
	sets[1][n/2].Addr = netip.MustParseAddr("192.0.2.1")
	slices.Reverse(sets[1])
	return sets
}

// BenchmarkCilium times Cilium's GetLookupTable on the grid of maglev's
// BenchmarkNew and BenchmarkRebuild.
func BenchmarkCilium(b *testing.B) {
	for _, sz := range sizes {
		for _, n := range counts {
			for _, kind := range weights {
				b.Run(fmt.Sprintf("M=%d/N=%d/%s", sz[0], n, kind), func(b *testing.B) {
					build := ciliumTable(b, sz[0], n, kind)
					b.ReportAllocs()
					for b.Loop() {
						build()
					}
				})
			}
		}
	}
}

func envInt(k string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(k)); err == nil && v > 0 {
		return v
	}
	return def
}

func median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}

// TestCompare times Cilium's GetLookupTable, maglev.New and Table.Rebuild
// in adjacent blocks of builds, round after round, so that the slow and
// fast periods of a shared machine hit all three alike. A round's ratio is
// Cilium's block median over ours; it prints the medians over the rounds
// and the range of the ratios. It runs only when asked for
// (CILIUMCMP=1); CILIUMCMP_N, _ROUNDS and _BLOCK set the backend count
// (10), the rounds (30) and the builds per block (5).
func TestCompare(t *testing.T) {
	if os.Getenv("CILIUMCMP") == "" {
		t.Skip("set CILIUMCMP=1 to run the comparison")
	}
	n, rounds, block := envInt("CILIUMCMP_N", 10), envInt("CILIUMCMP_ROUNDS", 30), envInt("CILIUMCMP_BLOCK", 5)
	fmt.Printf("%-8s %-6s %10s %10s %8s %-12s %10s %8s %-12s\n", "M", "weights",
		"Cilium µs", "New µs", "C/New", "(rounds)", "Rebuild µs", "C/Reb", "(rounds)")
	for _, sz := range sizes {
		for _, kind := range weights {
			cb := ciliumTable(t, sz[0], n, kind)
			sets := ours(n, kind)
			cfg := maglev.Config{Size: sz[1]}
			tab, err := maglev.New(cfg, sets[1])
			if err != nil {
				t.Fatal(err)
			}
			timeBlock := func(f func(b int)) float64 {
				d := make([]float64, block)
				for b := range d {
					start := time.Now()
					f(b)
					d[b] = float64(time.Since(start).Nanoseconds()) / 1e3
				}
				return median(d)
			}
			var tc, tn, tr, rn, rr []float64
			for r := range rounds {
				c := timeBlock(func(int) { cb() })
				nw := timeBlock(func(int) {
					if _, err := maglev.New(cfg, sets[0]); err != nil {
						t.Fatal(err)
					}
				})
				rb := timeBlock(func(b int) {
					if err := tab.Rebuild(sets[(r+b)&1]); err != nil {
						t.Fatal(err)
					}
				})
				tc, tn, tr = append(tc, c), append(tn, nw), append(tr, rb)
				rn, rr = append(rn, c/nw), append(rr, c/rb)
			}
			fmt.Printf("%-8d %-6s %10.0f %10.0f %7.1f× %4.1f–%-6.1f %10.0f %7.1f× %4.1f–%-6.1f\n",
				sz[1], kind, median(tc), median(tn), median(rn), slices.Min(rn), slices.Max(rn),
				median(tr), median(rr), slices.Min(rr), slices.Max(rr))
		}
	}
}
