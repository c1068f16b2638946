package maglev

import (
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"
)

var (
	benchSizes   = []uint32{SizeS, SizeM, SizeL}
	benchCounts  = []int{10, 100, 1000}
	benchWeights = []struct {
		name string
		f    func(int) uint32
	}{{"equal", equalWeights}, {"mixed", mixedWeights}}
)

type benchKey struct {
	m uint32
	n int
}

// textbookNs caches the baseline's ns/op per (M, N), measured in the same
// run as the benchmark that compares against it, so that the ratio is not
// skewed by another machine or another load. (testing.Benchmark cannot be
// called from inside a benchmark, hence the plain timing loop.)
var (
	textbookMu sync.Mutex
	textbookNs = map[benchKey]float64{}
)

func textbookBaseline(m uint32, n int) float64 {
	textbookMu.Lock()
	defer textbookMu.Unlock()
	k := benchKey{m, n}
	if ns, ok := textbookNs[k]; ok {
		return ns
	}
	bs := testBackends(n, equalWeights)
	textbook(m, 0, bs) // warm up
	runtime.GC()
	runs, start := 0, time.Now()
	for runs < 3 || time.Since(start) < 500*time.Millisecond {
		textbook(m, 0, bs)
		runs++
	}
	ns := float64(time.Since(start).Nanoseconds()) / float64(runs)
	textbookNs[k] = ns
	return ns
}

// reportVsTextbook adds the speed-up over the textbook baseline for the
// same M and N (unweighted, as the textbook has no weights) as a metric.
func reportVsTextbook(b *testing.B, m uint32, n int) {
	ours := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(textbookBaseline(m, n)/ours, "x_faster_than_textbook")
}

// BenchmarkTextbook is the baseline: the paper's algorithm with the N×M
// permutation materialised, equal weights.
func BenchmarkTextbook(b *testing.B) {
	for _, m := range benchSizes {
		for _, n := range benchCounts {
			b.Run(fmt.Sprintf("M=%d/N=%d", m, n), func(b *testing.B) {
				bs := testBackends(n, equalWeights)
				b.ReportAllocs()
				for b.Loop() {
					textbook(m, 0, bs)
				}
			})
		}
	}
}

// BenchmarkNew builds a table from scratch, allocation included.
func BenchmarkNew(b *testing.B) {
	for _, m := range benchSizes {
		for _, n := range benchCounts {
			for _, w := range benchWeights {
				b.Run(fmt.Sprintf("M=%d/N=%d/%s", m, n, w.name), func(b *testing.B) {
					bs := testBackends(n, w.f)
					b.ReportAllocs()
					for b.Loop() {
						if _, err := New(Config{Size: m}, bs); err != nil {
							b.Fatal(err)
						}
					}
					reportVsTextbook(b, m, n)
				})
			}
		}
	}
}

// BenchmarkRebuild is the control plane's steady state: the backend set
// changes (here it alternates between two sets of the same size that
// differ in one backend) and the table is rebuilt in place.
func BenchmarkRebuild(b *testing.B) {
	for _, m := range benchSizes {
		for _, n := range benchCounts {
			for _, w := range benchWeights {
				b.Run(fmt.Sprintf("M=%d/N=%d/%s", m, n, w.name), func(b *testing.B) {
					sets := [2][]Backend{testBackends(n, w.f), testBackends(n, w.f)}
					sets[1][n/2].Addr = netip.MustParseAddr("192.0.2.1")
					slices.Reverse(sets[1])
					t, err := New(Config{Size: m}, sets[1])
					if err != nil {
						b.Fatal(err)
					}
					b.ReportAllocs()
					i := 0
					for b.Loop() {
						if err := t.Rebuild(sets[i&1]); err != nil {
							b.Fatal(err)
						}
						i++
					}
					reportVsTextbook(b, m, n)
				})
			}
		}
	}
}

func BenchmarkLookup(b *testing.B) {
	t, err := New(Config{Size: SizeM}, testBackends(1000, mixedWeights))
	if err != nil {
		b.Fatal(err)
	}
	var sink uint32
	h := uint32(0)
	for b.Loop() {
		be, _ := t.Lookup(h)
		sink += be.ID
		h += 0x9e3779b9
	}
	_ = sink
}
