//go:build linux

package scenario

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
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
	switch clean := r.Clean(); {
	case clean == 0:
		fmt.Fprintf(&b, "results: median of %d round(s), ALL disturbed by other processes; spread = (max-min)/median\n", rounds)
	case clean < rounds:
		fmt.Fprintf(&b, "results: median of %d undisturbed round(s) of %d; spread = (max-min)/median\n", clean, rounds)
	default:
		fmt.Fprintf(&b, "results: median of %d round(s); spread = (max-min)/median\n", rounds)
	}
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
		p.tableOf(&b, ew, []perfRatio{{"vip/direct", PathVIP, PathDirect}, {"vip/nft", PathVIP, PathNFT}})
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
	return b.String()
}

// tableOf writes the table of some paths with ratio columns.
func (p *perfRun) tableOf(b *strings.Builder, paths []PerfPath, ratios []perfRatio) {
	r := p.rep
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
	blank := make([]string, len(ratios)+1)
	type row struct {
		name   string
		wl     PerfWorkload
		f      func(PerfSample) float64
		format func(float64) string
	}
	rows := []row{
		{"connections/s", WorkloadConns, PerfSample.Rate, func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) }},
		{"conn latency p50 µs", WorkloadConns, func(s PerfSample) float64 { return float64(s.P50) / 1e3 }, func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) }},
		{"conn latency p99 µs", WorkloadConns, func(s PerfSample) float64 { return float64(s.P99) / 1e3 }, func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) }},
		{"conn CPU µs/conn", WorkloadConns, PerfSample.CPUPerUnit, func(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }},
		{"bulk Gbit/s", WorkloadBulk, PerfSample.Rate, func(v float64) string { return strconv.FormatFloat(v/1e9, 'f', 2, 64) }},
		{"bulk CPU ms/GB", WorkloadBulk, PerfSample.CPUPerUnit, func(v float64) string { return strconv.FormatFloat(v/1e3, 'f', 1, 64) }},
		{"conn datapath BPF µs/conn", WorkloadConns, PerfSample.BPFPerUnit, func(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }},
		{"bulk datapath BPF ms/GB", WorkloadBulk, PerfSample.BPFPerUnit, func(v float64) string { return strconv.FormatFloat(v/1e3, 'f', 2, 64) }},
		{"others' CPU share %", "", func(s PerfSample) float64 { return s.Others * 100 }, func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) }},
	}
	for _, rw := range rows {
		if strings.Contains(rw.name, "BPF") && !p.o.BPFStats || rw.wl == WorkloadBulk && p.o.ConnsOnly {
			continue
		}
		cells := []string{rw.name, ""}
		spread := []string{"  spread", ""}
		med := map[PerfPath]float64{}
		for _, path := range paths {
			m, lo, hi, ok := r.Median(path, rw.wl, rw.f)
			if !ok {
				cells = append(cells, "-")
				spread = append(spread, "")
				continue
			}
			med[path] = m
			cells = append(cells, rw.format(m))
			if m > 0 {
				spread = append(spread, fmt.Sprintf("%.1f%%", (hi-lo)/m*100))
			} else {
				spread = append(spread, "")
			}
		}
		if rw.wl == "" {
			cells = append(cells, blank...)
		} else {
			for _, rt := range ratios {
				if med[rt.b] == 0 {
					cells = append(cells, "-")
				} else {
					cells = append(cells, fmt.Sprintf("%.3f", med[rt.a]/med[rt.b]))
				}
			}
			cells = append(cells, "")
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
		if strings.Contains(rw.name, "latency") || rw.wl == "" {
			continue
		}
		fmt.Fprintln(tw, strings.Join(append(spread, blank...), "\t"))
	}
	tw.Flush()
}

// targets writes the east-west targets: within 5% of direct, ahead of
// nftables. They are judged on the paired figure, the median of the
// per-round ratios: the two measurements of a pair are seconds apart, so
// drift of the machine's speed between rounds cancels out of it, which
// it does not from the ratio of the medians (printed first, and in the
// table).
func (p *perfRun) targets(b *strings.Builder) {
	r := p.rep
	verdict := func(ok bool) string {
		if ok {
			return "met"
		}
		return "MISSED"
	}
	for _, t := range []struct {
		name string
		wl   PerfWorkload
	}{{"connections/s", WorkloadConns}, {"bulk throughput", WorkloadBulk}} {
		v, _, _, ok1 := r.Median(PathVIP, t.wl, PerfSample.Rate)
		d, _, _, ok2 := r.Median(PathDirect, t.wl, PerfSample.Rate)
		n, _, _, ok3 := r.Median(PathNFT, t.wl, PerfSample.Rate)
		if !ok1 || !ok2 || !ok3 || d == 0 || n == 0 {
			continue
		}
		pd, _ := r.PairedRatio(PathVIP, PathDirect, t.wl, PerfSample.Rate)
		pn, _ := r.PairedRatio(PathVIP, PathNFT, t.wl, PerfSample.Rate)
		fmt.Fprintf(b, "target %-16s vip vs direct %+6.1f%% paired (%+6.1f%% medians): within 5%% %-6s  vip vs nft %+6.1f%% paired (%+6.1f%% medians): ahead %s\n",
			t.name+":", (pd-1)*100, (v/d-1)*100, verdict(pd >= 0.95), (pn-1)*100, (v/n-1)*100, verdict(pn > 1))
	}
	// The same targets on the CPU cost.
	for _, t := range []struct {
		name string
		wl   PerfWorkload
	}{{"CPU/connection:", WorkloadConns}, {"CPU/GB:", WorkloadBulk}} {
		v, _, _, ok1 := r.Median(PathVIP, t.wl, PerfSample.CPUPerUnit)
		d, _, _, ok2 := r.Median(PathDirect, t.wl, PerfSample.CPUPerUnit)
		n, _, _, ok3 := r.Median(PathNFT, t.wl, PerfSample.CPUPerUnit)
		if !ok1 || !ok2 || !ok3 || d == 0 || n == 0 {
			continue
		}
		pd, _ := r.PairedRatio(PathVIP, PathDirect, t.wl, PerfSample.CPUPerUnit)
		pn, _ := r.PairedRatio(PathVIP, PathNFT, t.wl, PerfSample.CPUPerUnit)
		fmt.Fprintf(b, "cost   %-16s vip vs direct %+6.1f%% paired (%+6.1f%% medians): within 5%% %-6s  vip vs nft %+6.1f%% paired (%+6.1f%% medians): cheaper %s\n",
			t.name, (pd-1)*100, (v/d-1)*100, verdict(pd <= 1.05), (pn-1)*100, (v/n-1)*100, verdict(pn < 1))
	}
}

// nsComparisons writes the north-south paired ratios (no targets yet):
// XDP against TC, XDP against direct, TC against direct, on the rates and
// on the CPU cost.
func (p *perfRun) nsComparisons(b *strings.Builder) {
	r := p.rep
	pairs := []perfRatio{{"xdp vs tc", PathNSXDP, PathNSTC}, {"xdp vs direct", PathNSXDP, PathNSDirect}, {"tc vs direct", PathNSTC, PathNSDirect}}
	for _, t := range []struct {
		name string
		wl   PerfWorkload
		f    func(PerfSample) float64
	}{
		{"connections/s:", WorkloadConns, PerfSample.Rate},
		{"bulk throughput:", WorkloadBulk, PerfSample.Rate},
		{"CPU/connection:", WorkloadConns, PerfSample.CPUPerUnit},
		{"CPU/GB:", WorkloadBulk, PerfSample.CPUPerUnit},
	} {
		var parts []string
		for _, pr := range pairs {
			pd, ok1 := r.PairedRatio(pr.a, pr.b, t.wl, t.f)
			a, _, _, ok2 := r.Median(pr.a, t.wl, t.f)
			c, _, _, ok3 := r.Median(pr.b, t.wl, t.f)
			if !ok1 || !ok2 || !ok3 || c == 0 {
				continue
			}
			parts = append(parts, fmt.Sprintf("%s %+6.1f%% paired (%+6.1f%% medians)", pr.name, (pd-1)*100, (a/c-1)*100))
		}
		if len(parts) > 0 {
			fmt.Fprintf(b, "ns %-17s %s\n", t.name, strings.Join(parts, "  "))
		}
	}
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
