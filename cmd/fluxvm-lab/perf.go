//go:build linux

package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	"github.com/fluxvm/servicefabric/cmd/fluxvm-lab/internal/scenario"
)

func init() {
	commands["perf"] = command{
		summary: "the same workload direct, through our VIP and through nftables DNAT, side by side",
		run: func(ctx context.Context, args []string) error {
			fs := flag.NewFlagSet("perf", flag.ContinueOnError)
			o := scenario.DefaultPerfOptions()
			fs.IntVar(&o.Rounds, "rounds", o.Rounds, "measurement rounds; each rotates the order of the paths (1..50)")
			fs.DurationVar(&o.Duration, "duration", o.Duration, "duration of one measurement: one workload on one path (50ms..60s)")
			fs.IntVar(&o.Workers, "workers", o.Workers, "parallel workers of the short-connection workload (1..256)")
			fs.IntVar(&o.Streams, "streams", o.Streams, "parallel streams of the bulk workload (1..16)")
			fs.IntVar(&o.MaxConns, "max-conns", o.MaxConns, "connections per measurement at most (1..10000000)")
			paths := fs.String("paths", "east-west", "paths to measure, comma-separated: bare, direct, vip, nft (east-west: client VM to backend VM), ns-direct, ns-tc, ns-xdp (north-south: external client through the uplink, direct, VIP with TC only, the same VIP with XDP native), or the groups east-west, north-south, all")
			fs.BoolVar(&o.Bare, "bare", o.Bare, "keep the bare path (direct with the datapath programs detached) when -paths has it")
			fs.Float64Var(&o.MaxOthers, "max-others", o.MaxOthers, "repeat a round (at most -rounds times) when other processes used more than this share of the CPUs during it; 0 keeps all (0..1)")
			fs.BoolVar(&o.BPFStats, "bpf-stats", o.BPFStats, "report the datapath programs' own run time (turns on the kernel's machine-wide BPF statistics for the run)")
			if err := fs.Parse(args); err != nil {
				return err
			}
			if fs.NArg() > 0 {
				return fmt.Errorf("perf: unexpected arguments %q", fs.Args())
			}
			var err error
			if o.Paths, err = scenario.ParsePerfPaths(*paths); err != nil {
				return err
			}
			_, err = scenario.Perf(ctx, os.Stdout, o)
			return err
		},
	}
}
