//go:build linux

package scenario

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// SLOThresholds are the SLO gate's bounds on the VIP path against the
// direct path measured in the same rounds (scripts/test-service-fabric-slo.sh
// states the values it gates with).
type SLOThresholds struct {
	// Latency, each figure with its own bound: VIP <= direct × Factor +
	// Slack, on the connect latency (the handshake) and on the whole
	// connection (connect to close), p50 and p99.
	ConnectP50, ConnectP99, ConnP50, ConnP99 LatencyBound
	// MinRateRatio: VIP connections/s >= direct × MinRateRatio (the
	// paired figure: the median of the per-round ratios).
	MinRateRatio float64
	// MaxErrors: failed connections over all rounds, both paths, at most.
	MaxErrors int
}

// LatencyBound is VIP latency <= direct × Factor + Slack.
type LatencyBound struct {
	Factor float64
	Slack  time.Duration
}

func (b LatencyBound) String() string {
	return strconv.FormatFloat(b.Factor, 'g', -1, 64) + "+" + b.Slack.String()
}

// Set parses "FACTOR+SLACK" ("1.5+100us"); a flag.Value.
func (b *LatencyBound) Set(s string) error {
	f, d, ok := strings.Cut(s, "+")
	if !ok {
		return fmt.Errorf("%q is not FACTOR+SLACK (1.5+100us)", s)
	}
	factor, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
	if err != nil {
		return fmt.Errorf("%q: factor: %w", s, err)
	}
	slack, err := time.ParseDuration(strings.TrimSpace(d))
	if err != nil {
		return fmt.Errorf("%q: slack: %w", s, err)
	}
	nb := LatencyBound{Factor: factor, Slack: slack}
	if err := nb.validate(); err != nil {
		return err
	}
	*b = nb
	return nil
}

func (b LatencyBound) validate() error {
	switch {
	case !(b.Factor >= 1 && b.Factor <= 100):
		return fmt.Errorf("scenario: slo: latency factor %v not in [1, 100]", b.Factor)
	case b.Slack < 0:
		return fmt.Errorf("scenario: slo: negative latency slack %s", b.Slack)
	}
	return nil
}

// SLOOptions configure SLO.
type SLOOptions struct {
	Rounds   int           // interleaved rounds (1..50)
	Duration time.Duration // one measurement (one path in one round)
	Workers  int           // parallel connection loops
	// MaxOthers: see PerfOptions.MaxOthers.
	MaxOthers  float64
	Thresholds SLOThresholds
	Logger     *slog.Logger
}

// DefaultSLOThresholds are the bounds scripts/test-service-fabric-slo.sh
// gates with (the script states them and why).
func DefaultSLOThresholds() SLOThresholds {
	return SLOThresholds{
		ConnectP50:   LatencyBound{1.5, 100 * time.Microsecond},
		ConnectP99:   LatencyBound{2, 5 * time.Millisecond},
		ConnP50:      LatencyBound{1.5, 200 * time.Microsecond},
		ConnP99:      LatencyBound{2, 10 * time.Millisecond},
		MinRateRatio: 0.75,
	}
}

// DefaultSLOOptions are the options of `fluxvm-lab slo`.
func DefaultSLOOptions() SLOOptions {
	return SLOOptions{Rounds: 5, Duration: 2 * time.Second, Workers: 4, MaxOthers: 0.2, Thresholds: DefaultSLOThresholds()}
}

// SLOFigure is one gated figure: the VIP's value, the direct one, the
// bound derived from it and whether the VIP stays within it.
type SLOFigure struct {
	Name          string
	VIP, Direct   float64
	Bound         float64
	AtLeast       bool // the bound is a minimum (rates), else a maximum
	Unit          string
	OK            bool
	Paired, Ratio float64      // rates: the paired ratio the bound is judged on
	Latency       LatencyBound // latencies: the bound's factor and slack
}

// SLOReport is what SLO measured and judged.
type SLOReport struct {
	Perf    *PerfReport
	Figures []SLOFigure
	Errors  int    // failed connections, all rounds, both paths
	Conns   int    // successful connections, all rounds, both paths
	First   string // the first failure's description
	Failed  []string
}

// SLO measures short connections through the VIP and direct (the backend's
// own address, the datapath attached) in interleaved rounds with the perf
// machinery (Perf with PathDirect and PathVIP, ConnsOnly), then judges the
// medians over the rounds against t: connect and connection latency
// p50/p99, connections/s (paired), errors. Failed lists the figures out
// of bounds, each with its value and bound; the lab is removed before SLO
// returns.
func SLO(ctx context.Context, w io.Writer, o SLOOptions) (*SLOReport, error) {
	po := DefaultPerfOptions()
	po.Rounds, po.Duration, po.Workers, po.MaxOthers, po.Logger = o.Rounds, o.Duration, o.Workers, o.MaxOthers, o.Logger
	po.Paths = []PerfPath{PathDirect, PathVIP}
	po.Bare, po.ConnsOnly = false, true
	rep, err := Perf(ctx, w, po)
	if err != nil {
		return nil, err
	}
	r := &SLOReport{Perf: rep}
	for _, s := range rep.Samples {
		if s.Round > 0 {
			r.Errors += s.Failed
			r.Conns += s.OK
			if r.First == "" && s.FirstError != "" {
				r.First = fmt.Sprintf("%s round %d: %s", s.Path, s.Round, s.FirstError)
			}
		}
	}
	t := o.Thresholds
	us := func(f func(PerfSample) time.Duration) func(PerfSample) float64 {
		return func(s PerfSample) float64 { return float64(f(s)) / 1e3 }
	}
	lat := []struct {
		name  string
		f     func(PerfSample) float64
		bound LatencyBound
	}{
		{"connect p50", us(func(s PerfSample) time.Duration { return s.ConnectP50 }), t.ConnectP50},
		{"connect p99", us(func(s PerfSample) time.Duration { return s.ConnectP99 }), t.ConnectP99},
		{"connection p50", us(func(s PerfSample) time.Duration { return s.P50 }), t.ConnP50},
		{"connection p99", us(func(s PerfSample) time.Duration { return s.P99 }), t.ConnP99},
	}
	for _, l := range lat {
		v, _, _, ok1 := rep.Median(PathVIP, WorkloadConns, l.f)
		d, _, _, ok2 := rep.Median(PathDirect, WorkloadConns, l.f)
		if !ok1 || !ok2 {
			return r, fmt.Errorf("scenario: slo: no %s samples", l.name)
		}
		bound := d*l.bound.Factor + float64(l.bound.Slack)/1e3
		r.Figures = append(r.Figures, SLOFigure{Name: l.name, VIP: v, Direct: d, Bound: bound, Unit: "µs", OK: v <= bound, Latency: l.bound})
	}
	v, _, _, ok1 := rep.Median(PathVIP, WorkloadConns, PerfSample.Rate)
	d, _, _, ok2 := rep.Median(PathDirect, WorkloadConns, PerfSample.Rate)
	paired, ok3 := rep.PairedRatio(PathVIP, PathDirect, WorkloadConns, PerfSample.Rate)
	if !ok1 || !ok2 || !ok3 {
		return r, fmt.Errorf("scenario: slo: no connections/s samples")
	}
	r.Figures = append(r.Figures, SLOFigure{Name: "connections/s", VIP: v, Direct: d, Bound: d * t.MinRateRatio, AtLeast: true, Unit: "/s",
		OK: paired >= t.MinRateRatio, Paired: paired, Ratio: t.MinRateRatio})
	r.Figures = append(r.Figures, SLOFigure{Name: "errors", VIP: float64(r.Errors), Bound: float64(t.MaxErrors), Unit: "conns", OK: r.Errors <= t.MaxErrors})
	for _, f := range r.Figures {
		if f.OK {
			continue
		}
		switch {
		case f.Name == "errors":
			r.Failed = append(r.Failed, fmt.Sprintf("errors %d > %d (first: %s)", r.Errors, t.MaxErrors, r.First))
		case f.AtLeast:
			r.Failed = append(r.Failed, fmt.Sprintf("connections/s vip/direct %.3f (paired) < %.3f (vip %.0f/s, direct %.0f/s)", f.Paired, f.Ratio, f.VIP, f.Direct))
		default:
			r.Failed = append(r.Failed, fmt.Sprintf("%s vip %.0f µs > %.0f µs (direct %.0f µs × %.2f + %s)", f.Name, f.VIP, f.Bound, f.Direct, f.Latency.Factor, f.Latency.Slack))
		}
	}
	fmt.Fprint(w, r.Table(t))
	return r, nil
}

// Table prints the gated figures with their bounds and verdicts.
func (r *SLOReport) Table(t SLOThresholds) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\nSLO gate (medians over the rounds; vip against direct measured in the same rounds):\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\tvip\tdirect\tbound\tverdict")
	for _, f := range r.Figures {
		verdict := "ok"
		if !f.OK {
			verdict = "FAIL"
		}
		switch {
		case f.Name == "errors":
			fmt.Fprintf(tw, "errors (both paths, %d ok)\t%d\t\t<= %d\t%s\n", r.Conns, r.Errors, t.MaxErrors, verdict)
		case f.AtLeast:
			fmt.Fprintf(tw, "%s\t%.0f\t%.0f\tvip/direct %.3f (paired) >= %.2f\t%s\n", f.Name, f.VIP, f.Direct, f.Paired, f.Ratio, verdict)
		default:
			fmt.Fprintf(tw, "%s µs\t%.0f\t%.0f\t<= %.0f (direct × %.2f + %s)\t%s\n", f.Name, f.VIP, f.Direct, f.Bound, f.Latency.Factor, f.Latency.Slack, verdict)
		}
	}
	tw.Flush()
	if len(r.Failed) == 0 {
		fmt.Fprintf(&b, "SLO: PASS\n")
	} else {
		fmt.Fprintf(&b, "SLO: FAIL: %s\n", strings.Join(r.Failed, "; "))
	}
	return b.String()
}

// Validate checks the thresholds.
func (t SLOThresholds) Validate() error {
	for _, b := range []LatencyBound{t.ConnectP50, t.ConnectP99, t.ConnP50, t.ConnP99} {
		if err := b.validate(); err != nil {
			return err
		}
	}
	switch {
	case !(t.MinRateRatio > 0 && t.MinRateRatio <= 2):
		return fmt.Errorf("scenario: slo: rate ratio %v not in (0, 2]", t.MinRateRatio)
	case t.MaxErrors < 0:
		return fmt.Errorf("scenario: slo: negative max errors")
	}
	return nil
}
