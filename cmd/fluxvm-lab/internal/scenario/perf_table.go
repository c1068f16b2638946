//go:build linux

package scenario

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// samples returns the samples of one path and workload (any workload if
// w is empty) that the results use, in round order: those of undisturbed
// rounds, or of all rounds when every round was disturbed.
func (r *PerfReport) samples(p PerfPath, w PerfWorkload) []PerfSample {
	all := r.Clean() == 0
	var out []PerfSample
	for _, s := range r.Samples {
		if s.Path == p && (s.Workload == w || w == "") && s.Round > 0 && (all || !s.Disturbed) {
			out = append(out, s)
		}
	}
	return out
}

// Clean counts the rounds that were not disturbed.
func (r *PerfReport) Clean() int {
	rounds := map[int]bool{}
	for _, s := range r.Samples {
		if s.Round > 0 {
			rounds[s.Round] = rounds[s.Round] || s.Disturbed
		}
	}
	n := 0
	for _, d := range rounds {
		if !d {
			n++
		}
	}
	return n
}

// Median returns the median, minimum and maximum over the rounds of
// f(sample) for a path and workload; ok is false without samples.
func (r *PerfReport) Median(p PerfPath, w PerfWorkload, f func(PerfSample) float64) (med, lo, hi float64, ok bool) {
	var v []float64
	for _, s := range r.samples(p, w) {
		v = append(v, f(s))
	}
	if len(v) == 0 {
		return 0, 0, 0, false
	}
	slices.Sort(v)
	med = v[len(v)/2]
	if len(v)%2 == 0 {
		med = (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	return med, v[0], v[len(v)-1], true
}

// perfRatio is a ratio column of a results table: a over b.
type perfRatio struct {
	name string
	a, b PerfPath
}

// table formats medians over the rounds with spreads and ratios: one
// table of the east-west paths, one of the north-south paths, each with
// its targets or comparisons below.
func (p *perfRun) table() string {
	r := p.rep
	var b strings.Builder
	rounds := 0
	for _, s := range r.Samples {
		rounds = max(rounds, s.Round)
	}
	const method = "spread = (max-min)/median; a/b = paired ratio (geometric mean of the per-round ratios) with its 95% CI below (Student t on the log-ratios)"
	switch clean := r.Clean(); {
	case clean == 0:
		fmt.Fprintf(&b, "results: median of %d round(s), ALL disturbed by other processes; %s\n", rounds, method)
	case clean < rounds:
		fmt.Fprintf(&b, "results: median of %d undisturbed round(s) of %d; %s\n", clean, rounds, method)
	default:
		fmt.Fprintf(&b, "results: median of %d round(s); %s\n", rounds, method)
	}
	fmt.Fprintf(&b, "CPU: machine-wide (all CPUs, irq and softirq included; less steal and other processes' user time); its parts softirq+irq, client worker and lab process (servers, dataplane, in-process clients) overlap: a softirq is charged to the process it interrupted\n")
	var ew, ns, sock []PerfPath
	for _, path := range r.Paths {
		switch {
		case path.northSouth():
			ns = append(ns, path)
		case path.sockPath():
		default:
			ew = append(ew, path)
		}
		if slices.Contains(SocketDiagPaths, path) && slices.ContainsFunc(r.Paths, PerfPath.sockPath) {
			sock = append(sock, path)
		}
	}
	// With sock-lb, the east-west table is printed when it has more
	// than the socket table shows.
	if len(sock) > 0 && !slices.ContainsFunc(ew, func(p PerfPath) bool { return !slices.Contains(SocketDiagPaths, p) }) {
		ew = nil
	}
	if len(ew) > 0 {
		p.tableOf(&b, ew, []perfRatio{{"vip/direct", PathVIP, PathDirect}, {"vip/nft", PathVIP, PathNFT}, {"direct/bare", PathDirect, PathBare}, {"direct/noop", PathDirect, PathNoop}, {"noop/bare", PathNoop, PathBare}})
	}
	if r.Clean() < p.o.Rounds {
		fmt.Fprintf(&b, "note: only %d of the %d rounds asked for ran undisturbed by other processes; expect noise\n", r.Clean(), p.o.Rounds)
	}
	if len(ew) > 0 {
		p.targets(&b)
	}
	if len(sock) > 0 {
		if len(ew) > 0 {
			fmt.Fprintf(&b, "\n")
		}
		hooked := "sock-lb's"
		if slices.Contains(r.Paths, PathSockDirect) {
			hooked = "sock-lb's and sock-direct's"
		}
		fmt.Fprintf(&b, "socket LB (vm1 -> vm2; every client a worker process, %s in the hooked cgroup):\n", hooked)
		ratios := []perfRatio{{"sock-lb/direct", PathSockLB, PathDirect}, {"sock-lb/vip", PathSockLB, PathVIP}}
		if slices.Contains(r.Paths, PathSockDirect) {
			ratios = append(ratios, perfRatio{"sock-direct/direct", PathSockDirect, PathDirect}, perfRatio{"sock-lb/sock-direct", PathSockLB, PathSockDirect})
		}
		p.tableOf(&b, sock, ratios)
		p.sockTargets(&b)
	}
	if len(ns) > 0 {
		if len(ew) > 0 {
			fmt.Fprintf(&b, "\n")
		}
		fmt.Fprintf(&b, "north-south (external client ext -> vm3 through the uplink):\n")
		p.tableOf(&b, ns, []perfRatio{{"xdp/tc", PathNSXDP, PathNSTC}, {"xdp/direct", PathNSXDP, PathNSDirect}, {"tc/direct", PathNSTC, PathNSDirect}})
		p.nsComparisons(&b)
		b.WriteString(p.nsSummary())
	}
	if p.o.BPFStats {
		p.bpfProgTable(&b)
	}
	p.goals(&b)
	return b.String()
}

// perfRow is a row of a results table: a figure of one workload's
// samples, and (with ci) a row of spreads and paired intervals below it.
type perfRow struct {
	name   string
	wl     PerfWorkload
	f      func(PerfSample) float64
	format func(float64) string
	ci     bool
	only   func(PerfPath) bool // the paths that have the figure; nil: all
}

func perfFormat(prec int, scale float64) func(float64) string {
	return func(v float64) string { return strconv.FormatFloat(v/scale, 'f', prec, 64) }
}

// rows are the rows of the results tables of this run.
func (p *perfRun) rows() []perfRow {
	worker := func(path PerfPath) bool { return p.workerFor(path) != nil }
	us := func(f func(PerfSample) time.Duration) func(PerfSample) float64 {
		return func(s PerfSample) float64 { return float64(f(s)) / 1e3 }
	}
	rows := []perfRow{
		{"connections/s", WorkloadConns, PerfSample.Rate, perfFormat(0, 1), true, nil},
		{"conn latency p50 µs", WorkloadConns, us(func(s PerfSample) time.Duration { return s.P50 }), perfFormat(0, 1), false, nil},
		{"conn latency p99 µs", WorkloadConns, us(func(s PerfSample) time.Duration { return s.P99 }), perfFormat(0, 1), false, nil},
		{"conn CPU µs/conn", WorkloadConns, PerfSample.CPUPerUnit, perfFormat(1, 1), true, nil},
		{"  softirq+irq µs/conn", WorkloadConns, PerfSample.SoftIRQPerUnit, perfFormat(1, 1), true, nil},
		{"  client worker µs/conn", WorkloadConns, PerfSample.ClientPerUnit, perfFormat(1, 1), true, worker},
		{"  lab process µs/conn", WorkloadConns, PerfSample.LabPerUnit, perfFormat(1, 1), true, nil},
		{"bulk Gbit/s", WorkloadBulk, PerfSample.Rate, perfFormat(2, 1e9), true, nil},
		{"bulk CPU ms/GB", WorkloadBulk, PerfSample.CPUPerUnit, perfFormat(1, 1e3), true, nil},
		{"  softirq+irq ms/GB", WorkloadBulk, PerfSample.SoftIRQPerUnit, perfFormat(1, 1e3), true, nil},
		{"  client worker ms/GB", WorkloadBulk, PerfSample.ClientPerUnit, perfFormat(1, 1e3), true, worker},
		{"  lab process ms/GB", WorkloadBulk, PerfSample.LabPerUnit, perfFormat(1, 1e3), true, nil},
	}
	if p.o.BPFStats {
		rows = append(rows,
			perfRow{"conn datapath BPF µs/conn", WorkloadConns, PerfSample.BPFPerUnit, perfFormat(2, 1), true, nil},
			perfRow{"conn datapath BPF ns/run", WorkloadConns, PerfSample.BPFPerRun, perfFormat(0, 1), true, nil},
			perfRow{"conn datapath BPF runs/conn", WorkloadConns, PerfSample.BPFRunsPerConn, perfFormat(1, 1), false, nil},
			perfRow{"bulk datapath BPF ms/GB", WorkloadBulk, PerfSample.BPFPerUnit, perfFormat(2, 1e3), true, nil},
			perfRow{"bulk datapath BPF ns/run", WorkloadBulk, PerfSample.BPFPerRun, perfFormat(0, 1), true, nil},
			perfRow{"bulk datapath BPF runs/MB", WorkloadBulk, PerfSample.BPFRunsPerConn, perfFormat(1, 1), false, nil})
	}
	rows = append(rows, perfRow{"others' CPU share %", "", func(s PerfSample) float64 { return s.Others * 100 }, perfFormat(0, 1), false, nil})
	if p.o.ConnsOnly {
		rows = slices.DeleteFunc(rows, func(rw perfRow) bool { return rw.wl == WorkloadBulk })
	}
	return rows
}

// tableOf writes the table of some paths with ratio columns: in each
// ratio column the paired ratio, and below it its 95% CI.
func (p *perfRun) tableOf(b *strings.Builder, paths []PerfPath, ratios []perfRatio) {
	r := p.rep
	ratios = slices.DeleteFunc(slices.Clone(ratios), func(rt perfRatio) bool {
		return !slices.Contains(paths, rt.a) || !slices.Contains(paths, rt.b)
	})
	tw := tabwriter.NewWriter(b, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := []string{"", ""}
	for _, path := range paths {
		head = append(head, string(path))
	}
	for _, rt := range ratios {
		head = append(head, rt.name)
	}
	head = append(head, "")
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	for _, rw := range p.rows() {
		has := func(path PerfPath) bool { return rw.only == nil || rw.only(path) }
		if !slices.ContainsFunc(paths, has) {
			continue
		}
		cells := []string{rw.name, ""}
		spread := []string{"  spread | 95% CI", ""}
		for _, path := range paths {
			m, lo, hi, ok := r.Median(path, rw.wl, rw.f)
			switch {
			case !ok || !has(path):
				cells, spread = append(cells, "-"), append(spread, "")
			case m > 0:
				cells, spread = append(cells, rw.format(m)), append(spread, fmt.Sprintf("%.1f%%", (hi-lo)/m*100))
			default:
				cells, spread = append(cells, rw.format(m)), append(spread, "")
			}
		}
		for _, rt := range ratios {
			iv, ok := r.PairedInterval(rt.a, rt.b, rw.wl, rw.f)
			switch {
			case rw.wl == "":
				cells, spread = append(cells, ""), append(spread, "")
			case !ok || !has(rt.a) || !has(rt.b):
				cells, spread = append(cells, "-"), append(spread, "")
			case !iv.Resolved():
				cells, spread = append(cells, fmt.Sprintf("%.3f", iv.Ratio)), append(spread, "n<2")
			default:
				cells, spread = append(cells, fmt.Sprintf("%.3f", iv.Ratio)), append(spread, fmt.Sprintf("[%.3f,%.3f]", iv.Lo, iv.Hi))
			}
		}
		fmt.Fprintln(tw, strings.Join(append(cells, ""), "\t"))
		if rw.ci {
			fmt.Fprintln(tw, strings.Join(append(spread, ""), "\t"))
		}
	}
	tw.Flush()
}

// pairedCell is "label ±x% [lo, hi] paired (±y% medians)": the paired
// ratio of a over b with its 95% CI, then the ratio of the medians; with
// a goal (g.A set), its verdict after "text". ok is false without pairs.
func (r *PerfReport) pairedCell(label string, a, b PerfPath, wl PerfWorkload, f func(PerfSample) float64, text string, g PerfGoal) (string, bool) {
	iv, ok1 := r.PairedInterval(a, b, wl, f)
	ma, _, _, ok2 := r.Median(a, wl, f)
	mb, _, _, ok3 := r.Median(b, wl, f)
	if !ok1 || !ok2 || !ok3 || mb == 0 {
		return "", false
	}
	c := fmt.Sprintf("%s %s paired (%+6.1f%% medians)", label, fmtInterval(iv), (ma/mb-1)*100)
	if g.A != "" {
		c += fmt.Sprintf(": %s %s", text, g.Judge(iv))
	}
	return c, true
}

// targets writes the east-west targets: within 5% of direct, ahead of
// nftables. They are judged on the paired ratio's 95% CI (PerfGoal.Judge):
// met or MISSED only when the interval lies wholly on one side of the
// bound, unresolved otherwise. The ratio of the medians is printed too.
func (p *perfRun) targets(b *strings.Builder) {
	r := p.rep
	for _, t := range []struct {
		name   string
		m      PerfMetric
		nftTxt string
	}{
		{"target connections/s:   ", MetricConns, "ahead"},
		{"target bulk throughput: ", MetricBulk, "ahead"},
		{"cost   CPU/connection:  ", MetricConnCPU, "cheaper"},
		{"cost   CPU/GB:          ", MetricBulkCPU, "cheaper"},
	} {
		pm := perfMetricOf(t.m)
		atLeast := t.m == MetricConns || t.m == MetricBulk
		direct := PerfGoal{PathVIP, PathDirect, t.m, atLeast, 0.95}
		if !atLeast {
			direct.Bound = 1.05
		}
		cd, ok1 := r.pairedCell("vip vs direct", PathVIP, PathDirect, pm.wl, pm.f, "within 5%", direct)
		cn, ok2 := r.pairedCell("vip vs nft", PathVIP, PathNFT, pm.wl, pm.f, t.nftTxt, PerfGoal{PathVIP, PathNFT, t.m, atLeast, 1})
		if ok1 && ok2 {
			fmt.Fprintf(b, "%s %s  %s\n", t.name, cd, cn)
		}
	}
}

// comparisons writes paired ratios without targets: one line per metric,
// one cell per pair.
func (p *perfRun) comparisons(b *strings.Builder, prefix string, pairs []perfRatio) {
	for _, pm := range perfMetrics {
		var parts []string
		for _, pr := range pairs {
			if c, ok := p.rep.pairedCell(pr.name, pr.a, pr.b, pm.wl, pm.f, "", PerfGoal{}); ok {
				parts = append(parts, c)
			}
		}
		if len(parts) > 0 {
			fmt.Fprintf(b, "%s %-17s %s\n", prefix, pm.long+":", strings.Join(parts, "  "))
		}
	}
}

// nsComparisons writes the north-south paired ratios (their goals are
// Issue36Goals): XDP against TC, XDP against direct, TC against direct,
// on the rates and on the CPU cost.
func (p *perfRun) nsComparisons(b *strings.Builder) {
	p.comparisons(b, "ns", []perfRatio{{"xdp vs tc", PathNSXDP, PathNSTC}, {"xdp vs direct", PathNSXDP, PathNSDirect}, {"tc vs direct", PathNSTC, PathNSDirect}})
}

// PairedRatio is the median over the rounds of f(a)/f(b), each ratio
// taken within one round; ok is false without a pair.
func (r *PerfReport) PairedRatio(a, b PerfPath, w PerfWorkload, f func(PerfSample) float64) (ratio float64, ok bool) {
	as, bs := r.samples(a, w), r.samples(b, w)
	var v []float64
	for _, x := range as {
		for _, y := range bs {
			if x.Round == y.Round && f(y) != 0 {
				v = append(v, f(x)/f(y))
			}
		}
	}
	if len(v) == 0 {
		return 0, false
	}
	slices.Sort(v)
	if len(v)%2 == 0 {
		return (v[len(v)/2-1] + v[len(v)/2]) / 2, true
	}
	return v[len(v)/2], true
}

// bpfProgTable writes our programs' run time per connection by program
// and path: the median over the rounds of µs per connection, and in
// brackets of runs per connection (0 where a program did not run).
func (p *perfRun) bpfProgTable(b *strings.Builder) {
	r := p.rep
	var names []string
	for _, s := range r.Samples {
		for name := range s.BPFProgs {
			if s.Round > 0 && s.Workload == WorkloadConns && !slices.Contains(names, name) {
				names = append(names, name)
			}
		}
	}
	if len(names) == 0 {
		return
	}
	slices.Sort(names)
	fmt.Fprintf(b, "BPF per program, conns: µs per connection (runs per connection), median over the rounds:\n")
	tw := tabwriter.NewWriter(b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join(append(append([]string{""}, pathNames(r.Paths)...), ""), "\t"))
	for _, name := range names {
		cells := []string{name}
		for _, path := range r.Paths {
			us, _, _, ok1 := r.Median(path, WorkloadConns, func(s PerfSample) float64 { return s.perUnit(s.BPFProgs[name].Time) })
			runs, _, _, ok2 := r.Median(path, WorkloadConns, func(s PerfSample) float64 {
				if s.OK == 0 {
					return 0
				}
				return float64(s.BPFProgs[name].Runs) / float64(s.OK)
			})
			if !ok1 || !ok2 {
				cells = append(cells, "-")
				continue
			}
			cells = append(cells, fmt.Sprintf("%.2f (%.1f)", us, runs))
		}
		fmt.Fprintln(tw, strings.Join(append(cells, ""), "\t"))
	}
	tw.Flush()
}
