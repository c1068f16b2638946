//go:build linux

package scenario

import (
	"math"
	"strings"
	"testing"
	"time"
)

// TestStudentT975 compares the quantile with published t tables.
func TestStudentT975(t *testing.T) {
	for _, c := range []struct {
		df   int
		want float64
	}{
		{1, 12.7062}, {2, 4.3027}, {3, 3.1824}, {4, 2.7764}, {9, 2.2622},
		{29, 2.0452}, {99, 1.9842}, {1000, 1.9623},
	} {
		if got := studentT975(c.df); math.Abs(got-c.want) > 5e-4 {
			t.Errorf("t(0.975, %d) = %.5f, want %.4f", c.df, got, c.want)
		}
	}
}

// TestPairedLogInterval checks the interval against values computed
// independently (mean and sample standard deviation of the log-ratios,
// t(0.975, 3) = 3.182446305).
func TestPairedLogInterval(t *testing.T) {
	for _, c := range []struct {
		name          string
		a, b          []float64
		ok            bool
		n             int
		ratio, lo, hi float64
	}{
		{"four rounds", []float64{1.1, 1.0, 0.9, 1.2}, []float64{1, 1, 1, 1}, true, 4, 1.044008681704849, 0.8572855550491985, 1.2714014846693014},
		{"scale-free", []float64{110, 200, 9, 1.2}, []float64{100, 200, 10, 1}, true, 4, 1.044008681704849, 0.8572855550491985, 1.2714014846693014},
		{"constant ratio", []float64{2, 4, 6}, []float64{1, 2, 3}, true, 3, 2, 2, 2},
		{"zeros and NaN left out", []float64{1, 0, 2, math.NaN()}, []float64{2, 1, 0, 1}, true, 1, 0.5, 0.5, 0.5},
		{"no pair", []float64{0}, []float64{1}, false, 0, 0, 0, 0},
		{"unequal lengths", []float64{3, 3, 3}, []float64{1}, true, 1, 3, 3, 3},
	} {
		iv, ok := pairedLogInterval(c.a, c.b)
		if ok != c.ok || iv.N != c.n {
			t.Errorf("%s: ok %v n %d, want %v %d", c.name, ok, iv.N, c.ok, c.n)
			continue
		}
		for _, v := range []struct {
			what      string
			got, want float64
		}{{"ratio", iv.Ratio, c.ratio}, {"lo", iv.Lo, c.lo}, {"hi", iv.Hi, c.hi}} {
			if math.Abs(v.got-v.want) > 1e-9 {
				t.Errorf("%s: %s %.12f, want %.12f", c.name, v.what, v.got, v.want)
			}
		}
		if c.name == "four rounds" && math.Abs(iv.SD-0.12383682181902173) > 1e-12 {
			t.Errorf("%s: sd %.12f, want 0.123836821819", c.name, iv.SD)
		}
		if iv.Resolved() != (c.n >= 2) {
			t.Errorf("%s: resolved %v with %d pairs", c.name, iv.Resolved(), c.n)
		}
		// b/a is the mirror image of a/b.
		if inv, _ := pairedLogInterval(c.b, c.a); ok && (math.Abs(inv.Lo*iv.Hi-1) > 1e-9 || math.Abs(inv.Hi*iv.Lo-1) > 1e-9) {
			t.Errorf("%s: b/a %+v is not the inverse of a/b %+v", c.name, inv, iv)
		}
	}
}

// TestPairedInterval: the report pairs samples by round, leaves out
// disturbed rounds (while an undisturbed one exists), the other workload
// and rounds that miss one of the paths.
func TestPairedInterval(t *testing.T) {
	conns := func(round int, path PerfPath, ok int, disturbed bool) PerfSample {
		return PerfSample{Round: round, Path: path, Workload: WorkloadConns, OK: ok, Elapsed: time.Second, Disturbed: disturbed}
	}
	r := &PerfReport{Samples: []PerfSample{
		conns(0, PathVIP, 5, false), conns(0, PathDirect, 100, false), // checks: never paired
		conns(1, PathVIP, 110, false), conns(1, PathDirect, 100, false),
		conns(2, PathVIP, 90, false), conns(2, PathDirect, 100, false),
		conns(3, PathVIP, 500, true), conns(3, PathDirect, 100, true), // disturbed
		conns(4, PathVIP, 120, false), // direct missing in round 4
		conns(5, PathDirect, 100, false),
		conns(6, PathVIP, 100, false), conns(6, PathDirect, 100, false),
		conns(7, PathVIP, 120, false), conns(7, PathDirect, 100, false),
		{Round: 1, Path: PathVIP, Workload: WorkloadBulk, Bytes: 1, Elapsed: time.Second},
	}}
	iv, ok := r.PairedInterval(PathVIP, PathDirect, WorkloadConns, PerfSample.Rate)
	want, _ := pairedLogInterval([]float64{1.1, 0.9, 1.0, 1.2}, []float64{1, 1, 1, 1})
	if !ok || iv != want {
		t.Errorf("paired interval %+v (ok %v), want %+v: the pairs of rounds 1, 2, 6, 7", iv, ok, want)
	}
	if _, ok := r.PairedInterval(PathVIP, PathNFT, WorkloadConns, PerfSample.Rate); ok {
		t.Errorf("an interval against a path never measured")
	}
}

// TestPairsFor: the pairs a resolution takes are the fewest whose
// interval is that narrow at the run's noise.
func TestPairsFor(t *testing.T) {
	for _, c := range []struct {
		sd, rel  float64
		min, max int
	}{
		{0.1238, 0.02, 140, 170}, // about (1.98·sd/ln 1.02)²
		{0.05, 0.02, 20, 30},
		{0, 0.02, 2, 2},
	} {
		iv := PerfInterval{N: 5, SD: c.sd}
		n := iv.PairsFor(c.rel)
		if n < c.min || n > c.max {
			t.Errorf("sd %v rel %v: %d pairs, want %d..%d", c.sd, c.rel, n, c.min, c.max)
		}
		half := func(n int) float64 { return studentT975(n-1) * c.sd / math.Sqrt(float64(n)) }
		if half(n) > math.Log1p(c.rel) || (n > 2 && half(n-1) <= math.Log1p(c.rel)) {
			t.Errorf("sd %v rel %v: %d pairs is not the fewest that resolve it", c.sd, c.rel, n)
		}
	}
	if n := (PerfInterval{N: 1, SD: 0.1}).PairsFor(0.02); n != 0 {
		t.Errorf("one pair: %d, want 0 (no noise estimate)", n)
	}
}

func TestPerfGoalJudge(t *testing.T) {
	atLeast := PerfGoal{PathSockLB, PathVIP, MetricConns, true, 1.03}
	atMost := PerfGoal{PathNSXDP, PathNSTC, MetricConnCPU, false, 0.95}
	iv := func(lo, hi float64) PerfInterval { return PerfInterval{N: 10, Ratio: (lo + hi) / 2, Lo: lo, Hi: hi} }
	for _, c := range []struct {
		name string
		g    PerfGoal
		iv   PerfInterval
		want PerfVerdict
	}{
		{"at least, wholly above", atLeast, iv(1.031, 1.06), VerdictMet},
		{"at least, lower end on the bound", atLeast, iv(1.03, 1.06), VerdictMet},
		{"at least, straddles", atLeast, iv(1.02, 1.06), VerdictUnresolved},
		{"at least, wholly below", atLeast, iv(0.95, 1.029), VerdictMissed},
		{"at least, point above but one pair", atLeast, PerfInterval{N: 1, Ratio: 2, Lo: 2, Hi: 2}, VerdictUnresolved},
		{"at most, wholly below", atMost, iv(0.90, 0.95), VerdictMet},
		{"at most, straddles", atMost, iv(0.90, 0.96), VerdictUnresolved},
		{"at most, wholly above", atMost, iv(0.951, 1.2), VerdictMissed},
	} {
		if got := c.g.Judge(c.iv); got != c.want {
			t.Errorf("%s: %s on [%v, %v]: %s, want %s", c.name, c.g, c.iv.Lo, c.iv.Hi, got, c.want)
		}
	}
}

func TestParsePerfGoal(t *testing.T) {
	for _, c := range []struct {
		in   string
		want PerfGoal
		ok   bool
	}{
		{"sock-lb/vip:conns>=1.03", PerfGoal{PathSockLB, PathVIP, MetricConns, true, 1.03}, true},
		{" ns-xdp/ns-tc:cpu/GB<=0.85 ", PerfGoal{PathNSXDP, PathNSTC, MetricBulkCPU, false, 0.85}, true},
		{"direct/bare:cpu/conn<=1.02", PerfGoal{PathDirect, PathBare, MetricConnCPU, false, 1.02}, true},
		{"sock-lb/vip:bulk>=1", PerfGoal{PathSockLB, PathVIP, MetricBulk, true, 1}, true},
		{"sock-lb/vip conns>=1", PerfGoal{}, false},
		{"sock-lb:conns>=1", PerfGoal{}, false},
		{"xdp/ns-tc:conns>=1", PerfGoal{}, false},
		{"vip/vip:conns>=1", PerfGoal{}, false},
		{"vip/direct:latency>=1", PerfGoal{}, false},
		{"vip/direct:conns>1", PerfGoal{}, false},
		{"vip/direct:conns>=-1", PerfGoal{}, false},
		{"vip/direct:conns>=x", PerfGoal{}, false},
		{"vip/direct:conns>=Inf", PerfGoal{}, false},
	} {
		g, err := ParsePerfGoal(c.in)
		if (err == nil) != c.ok || (c.ok && g != c.want) {
			t.Errorf("ParsePerfGoal(%q) = %+v, %v; want %+v, ok %v", c.in, g, err, c.want, c.ok)
		}
		if c.ok {
			if back, err := ParsePerfGoal(g.String()); err != nil || back != g {
				t.Errorf("%q: String %q reads back as %+v, %v", c.in, g.String(), back, err)
			}
		}
	}
}

// TestPerfAccount: the machine-wide CPU is the wall time on all CPUs less
// idle and steal, and keeps the softirqs, also those the kernel charged
// to other processes' system time: it subtracts their user time only.
func TestPerfAccount(t *testing.T) {
	t0 := time.Unix(1000, 0)
	a := cpuSnap{at: t0, idle: 1000, steal: 10, irq: 100, othersUser: 500, othersSys: 200, ok: true}
	for _, c := range []struct {
		name           string
		a, b           cpuSnap
		cpu, irq, osys time.Duration
		others         float64
	}{
		// 2 s on 2 CPUs: 4 s, of which 1 s idle, 0.1 s steal, 1 s
		// others' user time.
		{"softirq charged to others stays ours", a,
			cpuSnap{at: t0.Add(2 * time.Second), idle: 1100, steal: 20, irq: 250, othersUser: 600, othersSys: 300, ok: true},
			1900 * time.Millisecond, 1500 * time.Millisecond, time.Second, 0.525},
		{"a process gone unreaped counts nothing", a,
			cpuSnap{at: t0.Add(2 * time.Second), idle: 1000, steal: 10, irq: 100, othersUser: 400, othersSys: 100, ok: true},
			4 * time.Second, 0, 0, 0},
		{"others took it all", a,
			cpuSnap{at: t0.Add(time.Second), idle: 1000, steal: 10, irq: 100, othersUser: 800, othersSys: 200, ok: true},
			0, 0, 0, 1},
		{"no time passed", a, a, 0, 0, 0, 0},
		{"no reading", a, cpuSnap{at: t0.Add(time.Second), idle: 2000}, 0, 0, 0, 0},
	} {
		var s PerfSample
		s.account(c.a, c.b, 2)
		if s.CPU != c.cpu || s.SoftIRQ != c.irq || s.OthersSys != c.osys || math.Abs(s.Others-c.others) > 1e-12 {
			t.Errorf("%s: CPU %s softirq %s others' sys %s others %.3f; want %s %s %s %.3f",
				c.name, s.CPU, s.SoftIRQ, s.OthersSys, s.Others, c.cpu, c.irq, c.osys, c.others)
		}
	}
	var s PerfSample
	s.accountProcs(procCPU{lab: time.Second, client: 5 * time.Second}, procCPU{lab: 3 * time.Second, client: 6 * time.Second}, false)
	if s.Lab != 2*time.Second || s.Client != 0 || s.ClientWorker {
		t.Errorf("in-process client: lab %s client %s worker %v", s.Lab, s.Client, s.ClientWorker)
	}
	s.accountProcs(procCPU{lab: time.Second, client: 5 * time.Second}, procCPU{lab: 3 * time.Second, client: 6 * time.Second}, true)
	if s.Lab != 2*time.Second || s.Client != time.Second || !s.ClientWorker {
		t.Errorf("worker client: lab %s client %s worker %v", s.Lab, s.Client, s.ClientWorker)
	}
}

func TestParseCPUFiles(t *testing.T) {
	var c cpuSnap
	err := parseProcStat([]byte("cpu  100 2 30 4000 5 6 7 8 9 10\ncpu0 1 2 3 4 5 6 7 8 9 10\n"), &c)
	if err != nil || c.idle != 4000+5 || c.irq != 13 || c.steal != 8 {
		t.Errorf("/proc/stat: %+v, %v", c, err)
	}
	if parseProcStat([]byte("intr 1 2 3\n"), &c) == nil {
		t.Errorf("/proc/stat without a cpu line accepted")
	}
	for _, p := range []struct {
		line        string
		user, sys   uint64
		kthread, ok bool
	}{
		{"42 (go build) S 7 42 42 0 -1 4194560 100 0 0 0 11 22 33 44 20 0 1 0", 44, 66, false, true},
		{"43 (a) b) R 1 42 42 0 -1 0 0 0 0 0 5 6 -1 0 20 0 1 0", 5, 6, false, true},
		{"12 (ksoftirqd/0) S 2 0 0 0 -1 0 0 0 0 0 0 90 0 0 20 0 1 0", 0, 90, true, true},
		{"44 (short) S 1 2", 0, 0, false, false},
	} {
		u, s, k, ok := parsePidStat([]byte(p.line))
		if u != p.user || s != p.sys || k != p.kthread || ok != p.ok {
			t.Errorf("%q: user %d sys %d kthread %v ok %v; want %d %d %v %v", p.line, u, s, k, ok, p.user, p.sys, p.kthread, p.ok)
		}
	}
	if d, err := parseCgroupUsage([]byte("usage_usec 1234567\nuser_usec 1\nsystem_usec 2\n")); err != nil || d != 1234567*time.Microsecond {
		t.Errorf("cpu.stat: %s, %v", d, err)
	}
	if _, err := parseCgroupUsage([]byte("user_usec 1\n")); err == nil {
		t.Errorf("cpu.stat without usage_usec accepted")
	}
}

// TestPerfTableIntervals: the results table prints each ratio as the
// paired geometric mean with its 95% CI below it, and judges the goals on
// the interval (values computed independently).
func TestPerfTableIntervals(t *testing.T) {
	rates := map[PerfPath][]int{
		PathBare:   {1000, 1000, 1000, 1000},
		PathDirect: {900, 910, 905, 895},
		PathVIP:    {880, 900, 890, 870},
		PathNFT:    {700, 700, 700, 700},
	}
	var samples []PerfSample
	for path, rs := range rates {
		for i, ok := range rs {
			for _, wl := range []PerfWorkload{WorkloadConns, WorkloadBulk} {
				samples = append(samples, PerfSample{Round: i + 1, Path: path, Workload: wl, OK: ok, Bytes: int64(ok) << 20,
					Elapsed: time.Second, CPU: time.Duration(ok) * time.Millisecond, SoftIRQ: time.Duration(ok) * 100 * time.Microsecond,
					Lab: time.Duration(ok) * 500 * time.Microsecond})
			}
		}
	}
	o := DefaultPerfOptions()
	o.Rounds = 4
	p := &perfRun{o: o, rep: &PerfReport{Options: o, Paths: EastWestPaths, Samples: samples}}
	tab := p.table()
	for _, want := range []string{
		"direct/bare", "0.902", "[0.892,0.913]", // conns and bulk of direct over bare
		"0.981", "[0.969,0.992]", // vip over direct
		"goal direct/bare:conns>=0.98", "0.902 [0.892, 0.913], n=4: MISSED",
		"goal direct/bare:cpu/conn<=1.02", "1.000 [1.000, 1.000], n=4: met",
		"vip vs direct  -1.9% [-3.1%, -0.8%] paired", "within 5% met",
		"softirq+irq µs/conn", "lab process µs/conn",
	} {
		if !strings.Contains(tab, want) {
			t.Errorf("table has no %q:\n%s", want, tab)
		}
	}
	if strings.Contains(tab, "client worker µs") {
		t.Errorf("a client worker row without workers:\n%s", tab)
	}
	// Without nft, no vip/nft column.
	p.rep.Paths = []PerfPath{PathBare, PathDirect, PathVIP}
	if tab := p.table(); strings.Contains(tab, "vip/nft") || !strings.Contains(tab, "direct/bare") {
		t.Errorf("ratio columns without nft:\n%s", tab)
	}
}

// TestPerfAccountBPF: a sample's BPF time is split by program; programs
// that did not run are left out, and the totals are their sums.
func TestPerfAccountBPF(t *testing.T) {
	a := bpfReading{"fluxvm_from_vm": {Time: time.Second, Runs: 1000}, "fluxvm_sock_connect4": {Time: 5 * time.Millisecond, Runs: 10}}
	b := bpfReading{"fluxvm_from_vm": {Time: time.Second + 3*time.Millisecond, Runs: 1011}, "fluxvm_sock_connect4": {Time: 5 * time.Millisecond, Runs: 10},
		"fluxvm_to_vm": {Time: time.Millisecond, Runs: 4}}
	var s PerfSample
	s.accountBPF(a, b)
	want := map[string]PerfProgTime{"fluxvm_from_vm": {3 * time.Millisecond, 11}, "fluxvm_to_vm": {time.Millisecond, 4}}
	if len(s.BPFProgs) != len(want) || s.BPF != 4*time.Millisecond || s.BPFRuns != 15 {
		t.Fatalf("BPF %s in %d runs, by program %v; want 4ms in 15, %v", s.BPF, s.BPFRuns, s.BPFProgs, want)
	}
	for name, w := range want {
		if s.BPFProgs[name] != w {
			t.Errorf("%s: %+v, want %+v", name, s.BPFProgs[name], w)
		}
	}
}

// TestPerfBPFProgTable: the per-program table has a row per program that
// ran and a cell per path, 0 where it did not run there.
func TestPerfBPFProgTable(t *testing.T) {
	o := DefaultPerfOptions()
	o.BPFStats = true
	sample := func(round int, path PerfPath, progs map[string]PerfProgTime) PerfSample {
		return PerfSample{Round: round, Path: path, Workload: WorkloadConns, OK: 1000, Elapsed: time.Second, BPFProgs: progs}
	}
	var samples []PerfSample
	for r := 1; r <= 3; r++ {
		samples = append(samples,
			sample(r, PathDirect, map[string]PerfProgTime{"fluxvm_from_vm": {2 * time.Millisecond, 11000}}),
			sample(r, PathSockLB, map[string]PerfProgTime{"fluxvm_from_vm": {time.Duration(r) * time.Millisecond, 11000}, "fluxvm_sock_connect4": {500 * time.Microsecond, 1000}}))
	}
	p := &perfRun{o: o, rep: &PerfReport{Options: o, Paths: []PerfPath{PathDirect, PathSockLB}, Samples: samples}}
	var b strings.Builder
	p.bpfProgTable(&b)
	lines := map[string]string{}
	for _, l := range strings.Split(b.String(), "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			lines[f[0]] = strings.Join(f[1:], " ")
		}
	}
	for name, want := range map[string]string{
		"fluxvm_from_vm":       "2.00 (11.0) 2.00 (11.0)", // sock-lb: median of 1, 2, 3 ms
		"fluxvm_sock_connect4": "0.00 (0.0) 0.50 (1.0)",
	} {
		if lines[name] != want {
			t.Errorf("%s: %q, want %q in:\n%s", name, lines[name], want, b.String())
		}
	}
}

// TestCheckSampleStrays: a measurement of a path no translator serves
// may count late flows of the paths before it, one in a thousand
// connections at most; more, and the path was translated. The paths
// without our programs (bare, noop) may see as many parsed packets as
// stray flows; the attached ones at least one a connection.
func TestCheckSampleStrays(t *testing.T) {
	var p perfRun
	for _, tt := range []struct {
		path         PerfPath
		ok           int
		flows, nft   uint64
		sockRewrites uint64
		parsed       uint64
		fail         bool
	}{
		{PathSockDirect, 12000, 0, 0, 0, 0, false},
		{PathSockDirect, 12000, 1, 0, 0, 0, false},
		{PathSockDirect, 12000, 12, 0, 0, 0, false},
		{PathSockDirect, 12000, 13, 0, 0, 0, true},
		{PathDirect, 500, 1, 0, 0, 5500, true},
		{PathDirect, 12000, 0, 13, 0, 132000, true},
		{PathDirect, 12000, 0, 0, 0, 132000, false},
		{PathDirect, 12000, 0, 0, 0, 11999, true},
		{PathBare, 2000, 2, 2, 0, 0, false},
		{PathBare, 2000, 0, 0, 0, 3, true},
		{PathNoop, 2000, 2, 0, 0, 2, false},
		{PathNoop, 2000, 3, 0, 0, 0, true},
		{PathNoop, 2000, 0, 0, 0, 22000, true},
		{PathVIP, 12000, 11999, 0, 0, 132000, true},
		{PathVIP, 12000, 12000, 3, 0, 132000, false},
		{PathVIP, 12000, 12000, 0, 0, 0, true},
		{PathNFT, 12000, 13, 12000, 0, 0, true},
		{PathSockLB, 12000, 1, 0, 12000, 0, false},
		{PathSockLB, 12000, 13, 0, 12000, 0, true},
		{PathSockDirect, 12000, 0, 0, 1, 0, true},
	} {
		s := PerfSample{Path: tt.path, Workload: WorkloadConns, OK: tt.ok, DatapathFlows: tt.flows, NFTConns: tt.nft, SockRewritten: tt.sockRewrites, Parsed: tt.parsed}
		if err := p.checkSample(s); (err != nil) != tt.fail {
			t.Errorf("%s, %d connections, %d datapath flows, %d nftables, %d parsed: %v, want failure %v", tt.path, tt.ok, tt.flows, tt.nft, tt.parsed, err, tt.fail)
		}
	}
}
