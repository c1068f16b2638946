//go:build linux

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"

	"github.com/fluxvm/servicefabric/cmd/fluxvm-lab/internal/scenario"
)

func init() {
	commands["scale-out"] = command{
		summary: "edges behind a BIRD 2 ECMP router: the multipath route, which edge carries each flow, an edge leaving (kill -9) and one joining",
		run: func(ctx context.Context, args []string) error {
			fs := flag.NewFlagSet("scale-out", flag.ContinueOnError)
			fs.Usage = func() {
				fmt.Fprint(fs.Output(), scaleOutUsage)
				fs.PrintDefaults()
			}
			o := scenario.DefaultScaleOutOptions()
			fs.StringVar(&o.Fluxvmd, "fluxvmd", "", "the fluxvmd binary (go build ./cmd/fluxvmd); required")
			fs.StringVar(&o.Adapter, "fluxvm-bird", "", "the fluxvm-bird binary (go build ./cmd/fluxvm-bird); required")
			fs.StringVar(&o.Replicator, "fluxvm-replicator", "", "the fluxvm-replicator binary (go build ./cmd/fluxvm-replicator): the edges share their flows as a group, and no flow breaks")
			fs.IntVar(&o.Edges, "edges", o.Edges, "edges at the start (2..8); one more joins")
			fs.IntVar(&o.Short, "short", o.Short, "short TCP connections showing the split, before the leave and after the join (1..10000)")
			fs.IntVar(&o.Flows, "flows", o.Flows, "long-lived flows followed across the leave and the join, half SNAT, half DSR (2..200)")
			fs.DurationVar(&o.Timeout, "timeout", o.Timeout, "bound on the whole run (10s..30m)")
			if help, err := parseArgs(fs, args); help || err != nil {
				return err
			}
			if o.Fluxvmd == "" || o.Adapter == "" {
				return errors.New("scale-out: -fluxvmd and -fluxvm-bird are required")
			}
			return scenario.ScaleOut(ctx, os.Stdout, o)
		},
	}
}

const scaleOutUsage = `usage: fluxvm-lab scale-out -fluxvmd BIN -fluxvm-bird BIN [flags]

A group of edges behind a real ECMP router, in namespaces: the router runs
BIRD 2 with an eBGP session to each edge and merges their paths into one
multipath route per VIP (hashed on L4); each edge runs fluxvmd (same
seeds, same catalog over REST), BIRD and the fluxvm-bird adapter, and
announces its SNAT address beside the VIPs. Shows the edges and their BGP
state, the routes, which edge carries each flow, then an edge killed with
-9, a survivor taking over its SNAT address, and a new edge joining: what
the router did and which flows survived. With -fluxvm-replicator the edges
run as a group that shares its flows (ha_group, fluxvm-replicator -group):
none of the long-lived flows breaks; without it (the baseline) the killed
edge's SNAT flows and many flows moved by the join do. Needs root and BIRD 2 (Debian package bird2).
Everything is removed on exit and on Ctrl-C. See docs/scale-out.md.

Flags:
`
