//go:build linux

package scenario

// The statistics of Perf's paired ratios (issue 36): the 95% confidence
// interval of a ratio a/b whose two measurements are paired within a
// round, and goals judged on it.
//
// Method: for every round that has both measurements (undisturbed, both
// figures > 0), d = ln(a/b). The ratio is exp(mean d), the geometric mean
// of the per-round ratios, and its interval exp(mean d ± t·s/√n), with s
// the sample standard deviation of d, n the number of pairs and t the
// 97.5% quantile of Student's t with n−1 degrees of freedom. Logs make a
// ratio and its inverse symmetric (a/b in [l, h] is b/a in [1/h, 1/l]),
// and pairing within a round cancels the machine's drift between rounds.

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// PerfInterval is a paired ratio with its 95% confidence interval.
type PerfInterval struct {
	// N is the number of pairs (rounds with both measurements).
	N int
	// Ratio is the geometric mean of the per-round ratios.
	Ratio float64
	// Lo and Hi bound the 95% confidence interval of Ratio; both are
	// Ratio when N < 2 (no interval: see Resolved).
	Lo, Hi float64
	// SD is the sample standard deviation of the per-round log-ratios
	// (0 when N < 2): the noise of one pair, which PairsFor turns into
	// the pairs a given resolution needs.
	SD float64
}

// PairsFor is about how many pairs put the interval's ends within a
// factor 1±rel of the ratio, at the noise of this run (SD): n with
// t(0.975, n−1)·SD/√n ≤ ln(1+rel). 0 when the run has no interval.
func (iv PerfInterval) PairsFor(rel float64) int {
	if !iv.Resolved() || !(rel > 0) {
		return 0
	}
	target := math.Log1p(rel)
	for n := 2; n < 100000; n++ {
		if studentT975(n-1)*iv.SD/math.Sqrt(float64(n)) <= target {
			return n
		}
	}
	return 100000
}

// Resolved reports whether the interval exists (two pairs at least).
func (iv PerfInterval) Resolved() bool { return iv.N >= 2 }

// pairedLogInterval is the interval of a/b over the pairs (a[i], b[i]);
// pairs with a figure ≤ 0 (or NaN) are left out. ok is false without a
// pair.
func pairedLogInterval(a, b []float64) (iv PerfInterval, ok bool) {
	var d []float64
	for i := range min(len(a), len(b)) {
		if a[i] > 0 && b[i] > 0 { // false for NaN too
			d = append(d, math.Log(a[i]/b[i]))
		}
	}
	if len(d) == 0 {
		return PerfInterval{}, false
	}
	var sum float64
	for _, v := range d {
		sum += v
	}
	n := float64(len(d))
	mean := sum / n
	iv = PerfInterval{N: len(d), Ratio: math.Exp(mean), Lo: math.Exp(mean), Hi: math.Exp(mean)}
	if len(d) < 2 {
		return iv, true
	}
	var ss float64
	for _, v := range d {
		ss += (v - mean) * (v - mean)
	}
	iv.SD = math.Sqrt(ss / (n - 1))
	half := studentT975(len(d)-1) * iv.SD / math.Sqrt(n)
	iv.Lo, iv.Hi = math.Exp(mean-half), math.Exp(mean+half)
	return iv, true
}

// studentT975 is the 97.5% quantile of Student's t distribution with df
// degrees of freedom (df ≥ 1): the t of a two-sided 95% interval. It
// inverts the distribution function by bisection.
func studentT975(df int) float64 {
	lo, hi := 0.0, 100.0 // t(0.975, 1) = 12.706
	for range 200 {
		mid := (lo + hi) / 2
		if studentTCDF(mid, float64(df)) < 0.975 {
			lo = mid
		} else {
			hi = mid
		}
	}
	return (lo + hi) / 2
}

// studentTCDF is P(T ≤ t) for t ≥ 0 and nu degrees of freedom:
// 1 − I_x(nu/2, 1/2)/2 with x = nu/(nu+t²).
func studentTCDF(t, nu float64) float64 {
	return 1 - regIncBeta(nu/(nu+t*t), nu/2, 0.5)/2
}

// regIncBeta is the regularized incomplete beta function I_x(a, b), from
// its continued fraction (evaluated with the modified Lentz method), on
// the side of x where it converges fast.
func regIncBeta(x, a, b float64) float64 {
	switch {
	case x <= 0:
		return 0
	case x >= 1:
		return 1
	case x > (a+1)/(a+b+2):
		return 1 - regIncBeta(1-x, b, a)
	}
	la, _ := math.Lgamma(a)
	lb, _ := math.Lgamma(b)
	lab, _ := math.Lgamma(a + b)
	front := math.Exp(lab - la - lb + a*math.Log(x) + b*math.Log(1-x))
	const tiny = 1e-300
	guard := func(v float64) float64 {
		if math.Abs(v) < tiny {
			return tiny
		}
		return v
	}
	// The fraction 1/(1+ d1/(1+ d2/(1+ ...))): f = C/D products.
	c, d := 1.0, 1/guard(1-(a+b)*x/(a+1))
	f := d
	for m := 1; m <= 300; m++ {
		mf := float64(m)
		for _, num := range []float64{
			mf * (b - mf) * x / ((a + 2*mf - 1) * (a + 2*mf)),            // d_2m
			-(a + mf) * (a + b + mf) * x / ((a + 2*mf) * (a + 2*mf + 1)), // d_2m+1
		} {
			d = 1 / guard(1+num*d)
			c = guard(1 + num/c)
			f *= c * d
		}
		if math.Abs(c*d-1) < 1e-15 {
			break
		}
	}
	return front * f / a
}

// PerfMetric names a figure of a workload that goals compare.
type PerfMetric string

// The metrics of goals.
const (
	MetricConns   PerfMetric = "conns"    // connections/s
	MetricConnCPU PerfMetric = "cpu/conn" // machine-wide CPU per connection
	MetricBulk    PerfMetric = "bulk"     // bulk throughput
	MetricBulkCPU PerfMetric = "cpu/GB"   // machine-wide CPU per GB of bulk
)

// perfMetricDef is a metric with its printed name, the workload and the
// figure of a sample it reads.
type perfMetricDef struct {
	m    PerfMetric
	name string // short, in the goals and diagnoses
	long string // in the comparisons
	wl   PerfWorkload
	f    func(PerfSample) float64
}

// perfMetrics lists the metrics in the order of the reports, with the
// workload and figure each reads.
var perfMetrics = []perfMetricDef{
	{MetricConns, "conn/s", "connections/s", WorkloadConns, PerfSample.Rate},
	{MetricBulk, "bulk", "bulk throughput", WorkloadBulk, PerfSample.Rate},
	{MetricConnCPU, "CPU/conn", "CPU/connection", WorkloadConns, PerfSample.CPUPerUnit},
	{MetricBulkCPU, "CPU/GB", "CPU/GB", WorkloadBulk, PerfSample.CPUPerUnit},
}

// PerfGoal is a bound on a paired ratio: A/B of Metric at least (AtLeast)
// or at most Bound. It is met only when the ratio's 95% confidence
// interval lies wholly on the right side of Bound, missed when it lies
// wholly on the wrong side, and unresolved when it contains Bound.
type PerfGoal struct {
	A, B    PerfPath
	Metric  PerfMetric
	AtLeast bool
	Bound   float64
}

func (g PerfGoal) String() string {
	op := "<="
	if g.AtLeast {
		op = ">="
	}
	return fmt.Sprintf("%s/%s:%s%s%s", g.A, g.B, g.Metric, op, strconv.FormatFloat(g.Bound, 'f', -1, 64))
}

// ParsePerfGoal reads a goal written "a/b:metric>=x" or "a/b:metric<=x",
// e.g. "sock-lb/vip:conns>=1.03" (metrics: conns, cpu/conn, bulk,
// cpu/GB).
func ParsePerfGoal(s string) (PerfGoal, error) {
	bad := func(why string) (PerfGoal, error) {
		return PerfGoal{}, fmt.Errorf("scenario: perf: goal %q: %s (want a/b:metric>=x or <=x, metric one of conns, cpu/conn, bulk, cpu/GB)", s, why)
	}
	pair, cond, ok := strings.Cut(strings.TrimSpace(s), ":")
	if !ok {
		return bad("no ':'")
	}
	a, b, ok := strings.Cut(pair, "/")
	if !ok {
		return bad("no a/b")
	}
	g := PerfGoal{A: PerfPath(a), B: PerfPath(b)}
	for _, p := range []PerfPath{g.A, g.B} {
		if !isPerfPath(p) {
			return bad(fmt.Sprintf("unknown path %q", p))
		}
	}
	if g.A == g.B {
		return bad("a path against itself")
	}
	m, x, ok := strings.Cut(cond, ">=")
	g.AtLeast = ok
	if !ok {
		if m, x, ok = strings.Cut(cond, "<="); !ok {
			return bad("no >= or <=")
		}
	}
	g.Metric = PerfMetric(m)
	if !isPerfMetric(g.Metric) {
		return bad(fmt.Sprintf("unknown metric %q", m))
	}
	v, err := strconv.ParseFloat(x, 64)
	if err != nil || !(v > 0) || math.IsInf(v, 0) {
		return bad(fmt.Sprintf("bound %q is not a positive number", x))
	}
	g.Bound = v
	return g, nil
}

func isPerfMetric(m PerfMetric) bool { return perfMetricOf(m).m != "" }

func isPerfPath(p PerfPath) bool { return slices.Contains(allPerfPaths(), p) }

// Issue36Goals are the goals of issue 36, printed by every run that has
// both paths of one: socket LB ahead of the TC path, XDP ahead of TC,
// and the price of being attached (direct against bare).
var Issue36Goals = []PerfGoal{
	{PathSockLB, PathVIP, MetricConns, true, 1.03},
	{PathSockLB, PathDirect, MetricConns, true, 0.98},
	{PathSockLB, PathVIP, MetricConnCPU, false, 1},
	{PathSockLB, PathVIP, MetricBulk, true, 1},
	{PathNSXDP, PathNSTC, MetricConns, true, 1},
	{PathNSXDP, PathNSTC, MetricConnCPU, false, 0.95},
	{PathNSXDP, PathNSTC, MetricBulkCPU, false, 0.85},
	{PathNSTC, PathNSDirect, MetricConns, true, 0.95},
	{PathDirect, PathBare, MetricConns, true, 0.98},
	{PathDirect, PathBare, MetricConnCPU, false, 1.02},
}

// PerfVerdict is how a goal fares against its interval.
type PerfVerdict string

// The verdicts.
const (
	VerdictMet        PerfVerdict = "met"        // the interval lies wholly on the right side
	VerdictMissed     PerfVerdict = "MISSED"     // wholly on the wrong side
	VerdictUnresolved PerfVerdict = "unresolved" // it contains the bound, or there is no interval
)

// Judge is the verdict of the goal on an interval of its ratio.
func (g PerfGoal) Judge(iv PerfInterval) PerfVerdict {
	if !iv.Resolved() {
		return VerdictUnresolved
	}
	switch {
	case g.AtLeast && iv.Lo >= g.Bound, !g.AtLeast && iv.Hi <= g.Bound:
		return VerdictMet
	case g.AtLeast && iv.Hi < g.Bound, !g.AtLeast && iv.Lo > g.Bound:
		return VerdictMissed
	}
	return VerdictUnresolved
}

// PairedInterval is the interval of f(a)/f(b) over the rounds whose
// samples the results use (see samples), each ratio within one round.
func (r *PerfReport) PairedInterval(a, b PerfPath, w PerfWorkload, f func(PerfSample) float64) (PerfInterval, bool) {
	byRound := map[int]float64{}
	for _, y := range r.samples(b, w) {
		byRound[y.Round] = f(y)
	}
	var xa, xb []float64
	for _, x := range r.samples(a, w) {
		if v, ok := byRound[x.Round]; ok {
			xa, xb = append(xa, f(x)), append(xb, v)
		}
	}
	return pairedLogInterval(xa, xb)
}

// fmtInterval is an interval as percentages off 1: "-3.2% [-4.1%, -2.3%]".
func fmtInterval(iv PerfInterval) string {
	pc := func(v float64) string { return fmt.Sprintf("%+.1f%%", (v-1)*100) }
	if !iv.Resolved() {
		return fmt.Sprintf("%6s [no interval: %d pair]", pc(iv.Ratio), iv.N)
	}
	return fmt.Sprintf("%6s [%s, %s]", pc(iv.Ratio), pc(iv.Lo), pc(iv.Hi))
}

// goals writes the verdict of every goal whose paths the run measured.
func (p *perfRun) goals(b *strings.Builder) {
	var lines []string
	for _, g := range p.allGoals() {
		pm := perfMetricOf(g.Metric)
		if pm.wl == WorkloadBulk && p.o.ConnsOnly {
			continue
		}
		iv, ok := p.rep.PairedInterval(g.A, g.B, pm.wl, pm.f)
		if !ok {
			continue
		}
		side := "at least"
		if !g.AtLeast {
			side = "at most"
		}
		l := fmt.Sprintf("goal %-28s %s/%s %s %s %.3f: %.3f [%.3f, %.3f], n=%d: %s",
			g.String(), g.A, g.B, pm.name, side, g.Bound, iv.Ratio, iv.Lo, iv.Hi, iv.N, g.Judge(iv))
		if iv.Resolved() {
			l += fmt.Sprintf(" (log-ratio sd %.3f: ±2%% takes ~%d pairs)", iv.SD, iv.PairsFor(0.02))
		}
		lines = append(lines, l)
	}
	if len(lines) == 0 {
		return
	}
	fmt.Fprintf(b, "goals (paired ratio, geometric mean with its 95%% CI; met or MISSED only when the CI lies wholly on one side):\n")
	for _, l := range lines {
		fmt.Fprintf(b, "  %s\n", l)
	}
}

// allGoals are Issue36Goals and the run's own (-goal), without repeats.
func (p *perfRun) allGoals() []PerfGoal {
	var out []PerfGoal
	for _, g := range slices.Concat(Issue36Goals, p.o.Goals) {
		if !slices.Contains(out, g) {
			out = append(out, g)
		}
	}
	return out
}

func perfMetricOf(m PerfMetric) perfMetricDef {
	for _, x := range perfMetrics {
		if x.m == m {
			return x
		}
	}
	return perfMetricDef{}
}
