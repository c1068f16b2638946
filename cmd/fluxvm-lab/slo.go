//go:build linux

package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/fluxvm/servicefabric/cmd/fluxvm-lab/internal/scenario"
)

func init() {
	commands["slo"] = command{
		summary: "SLO gate: connect latency p50/p99, connections/s and errors through the VIP against direct in the same rounds; exits non-zero with the failed figures",
		run: func(ctx context.Context, args []string) error {
			fs := flag.NewFlagSet("slo", flag.ContinueOnError)
			fs.Usage = func() {
				fmt.Fprint(fs.Output(), sloUsage)
				fs.PrintDefaults()
			}
			o := scenario.DefaultSLOOptions()
			fs.IntVar(&o.Rounds, "rounds", o.Rounds, "interleaved rounds, each measures direct and vip (1..50)")
			fs.DurationVar(&o.Duration, "duration", o.Duration, "duration of one measurement (50ms..60s)")
			fs.IntVar(&o.Workers, "workers", o.Workers, "parallel connection loops (1..256)")
			fs.Float64Var(&o.MaxOthers, "max-others", o.MaxOthers, "repeat a round when other processes used more than this share of the CPUs (0..1; 0 keeps all)")
			fs.Var(&o.Thresholds.ConnectP50, "connect-p50", "connect p50: vip <= direct × FACTOR + SLACK, as FACTOR+SLACK")
			fs.Var(&o.Thresholds.ConnectP99, "connect-p99", "connect p99: vip <= direct × FACTOR + SLACK")
			fs.Var(&o.Thresholds.ConnP50, "conn-p50", "connection (connect to close) p50: vip <= direct × FACTOR + SLACK")
			fs.Var(&o.Thresholds.ConnP99, "conn-p99", "connection (connect to close) p99: vip <= direct × FACTOR + SLACK")
			fs.Float64Var(&o.Thresholds.MinRateRatio, "min-rate-ratio", o.Thresholds.MinRateRatio, "vip connections/s >= direct × this (paired ratio)")
			fs.IntVar(&o.Thresholds.MaxErrors, "max-errors", o.Thresholds.MaxErrors, "failed connections allowed over all rounds")
			if help, err := parseArgs(fs, args); help || err != nil {
				return err
			}
			if err := o.Thresholds.Validate(); err != nil {
				return err
			}
			rep, err := scenario.SLO(ctx, os.Stdout, o)
			if err != nil {
				return err
			}
			if len(rep.Failed) > 0 {
				return fmt.Errorf("slo gate failed: %s", strings.Join(rep.Failed, "; "))
			}
			return nil
		},
	}
}

const sloUsage = `usage: fluxvm-lab slo [flags]

The SLO gate. Short TCP connections (connect, identity line, a 4-byte
echo, close) from the client VM vm1 to the backend VM vm2, through our VIP
(Maglev in the TC programs) and direct (the backend's address, programs
attached), in interleaved rounds (the perf machinery: each round rotates
the order, the checks that each path is translated by what it claims run
first). Gated on the medians over the rounds:
  connect p50/p99 and connection p50/p99 (connect to close), each
      with its own bound (-connect-p50, -connect-p99, -conn-p50,
      -conn-p99): vip <= direct × FACTOR + SLACK
  connections/s: vip/direct (paired, the median of per-round ratios)
      >= -min-rate-ratio
  errors (failed connections, both paths, all rounds) <= -max-errors
Exits 1 and prints each failed figure with its value and bound. The
defaults are the bounds scripts/test-service-fabric-slo.sh gates with.
Needs root and nft (for the checks).

Flags:
`
