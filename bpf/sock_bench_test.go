package bpf

import (
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/internal/testutils/cgtest"
)

// BenchmarkSocketConnect times what a node-local client pays per short TCP
// connection on each way to a backend, with real sockets: processes in VM
// vm1 (whose node-side interface has the TC programs, as on a node)
// connect, ask getpeername (as Go's dial does) and close with a reset, one
// connection after the other, to the one backend of a service (vm2). The
// ways:
//
//	direct       the backend's own address, from a cgroup with the socket hooks (they run and find nothing)
//	sock         the VIP from that cgroup: the hooks rewrite it at connect
//	direct-bare  the backend's own address, from a cgroup without hooks
//	tc           the VIP from that cgroup: TC translates every packet
//
// Each process alternates its two ways connection by connection, so that
// sock/direct and tc/direct-bare share every drift of the machine's speed;
// the two processes take turns in blocks, and the ratios across them
// (sock/tc, direct/direct-bare) are means of the per-block ratios.
//
//	go test -run '^$' -bench BenchmarkSocketConnect -benchtime 1x ./bpf/
//
// FLUXVM_BENCH_ROUNDS (default 20) and FLUXVM_BENCH_CONNS (connections per
// block and process, default 2000) size it. For ablations:
// FLUXVM_BENCH_BPF_STATS=1 logs each socket program's mean run time (over
// both hooked ways); FLUXVM_BENCH_SOCK_OBJECT loads another build of the
// connect object (for example one with a part compiled out; its counters
// are not checked); FLUXVM_BENCH_SOCK_SKIP=getpeername4,sock_release leaves
// those hooks unattached.
func BenchmarkSocketConnect(b *testing.B) {
	rounds := benchEnvInt(b, "FLUXVM_BENCH_ROUNDS", 20)
	conns := benchEnvInt(b, "FLUXVM_BENCH_CONNS", 2000)
	s := newSockLabIn(b, true)
	bare := cgtest.Start(b, cgtest.New(b), s.client.NS.Handle())
	vip := netip.MustParseAddrPort("10.96.0.11:80")
	s.h.service(3, vip, 6)
	s.h.backend(21, 3, netip.AddrPortFrom(s.vms[0].Addr4, 8080), BackendReady, 0)
	s.h.table(3, s.h.weighted(map[uint32]int{21: 1}))
	addrs := []string{netip.AddrPortFrom(s.vms[0].Addr4, 8080).String(), vip.String()}

	names := []string{"direct", "sock", "direct-bare", "tc"}
	per := make([][]float64, len(names)) // median ns of a connection, per block
	run := func(c *cgtest.Child, first int, count int) {
		b.Helper()
		r := c.Do(cgtest.Request{Op: cgtest.OpConnectLoop, Addrs: addrs, Count: 2 * count, TimeoutMS: 60_000})
		if err := r.Error(); err != nil {
			b.Fatalf("%s: %v", names[first], err)
		}
		if first < 0 {
			return
		}
		for i, ns := range r.MedianNS {
			per[first+i] = append(per[first+i], float64(ns))
		}
	}
	if os.Getenv("FLUXVM_BENCH_BPF_STATS") == "1" {
		st, err := ebpf.EnableStats(unix.BPF_STATS_RUN_TIME)
		if err != nil {
			b.Fatal(err)
		}
		defer st.Close()
		defer func() {
			for name, p := range s.coll.Programs {
				if st, err := p.Stats(); err == nil && st.RunCount > 0 {
					b.Logf("%-26s %9d runs %6.0f ns/run", name, st.RunCount, float64(st.Runtime.Nanoseconds())/float64(st.RunCount))
				}
			}
		}()
	}
	sockBefore := s.h.counters()[CounterSockRewritten]
	for round := range rounds {
		order := []func(){func() { run(s.child, 0, conns) }, func() { run(bare, 2, conns) }}
		if round%2 == 1 {
			slices.Reverse(order)
		}
		for _, f := range order {
			f()
		}
	}
	if got, want := s.h.counters()[CounterSockRewritten]-sockBefore, uint64(rounds*conns); got != want {
		b.Fatalf("sock_rewritten +%d, want +%d: the hooked process's VIP connections were not all rewritten", got, want)
	}
	paired := func(x, y int) float64 {
		var sum float64
		for i := range per[x] {
			sum += per[x][i] / per[y][i]
		}
		return sum / float64(len(per[x]))
	}
	for i, n := range names {
		b.ReportMetric(median(per[i]), n+"-ns/conn")
	}
	b.ReportMetric(paired(1, 0), "sock/direct")
	b.ReportMetric(paired(3, 2), "tc/direct-bare")
	b.ReportMetric(paired(1, 3), "sock/tc")
	b.ReportMetric(paired(0, 2), "direct/direct-bare")
	for i, n := range names {
		b.Logf("%-12s ns/conn per block:%s", n, fmtRounds(per[i]))
	}
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func fmtRounds(v []float64) string {
	var sb strings.Builder
	for _, x := range v {
		fmt.Fprintf(&sb, " %.0f", x)
	}
	return sb.String()
}

func benchEnvInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: a positive integer", name, v)
	}
	return n
}
