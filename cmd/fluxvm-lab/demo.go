//go:build linux

package main

import (
	"context"
	"flag"
	"os"

	"github.com/fluxvm/servicefabric/cmd/fluxvm-lab/internal/scenario"
)

func init() {
	commands["demo"] = command{
		summary: "VIP traffic through the real datapath: weighted Maglev, stats, a live drain",
		run: func(ctx context.Context, args []string) error {
			fs := flag.NewFlagSet("demo", flag.ContinueOnError)
			o := scenario.DefaultDemoOptions()
			fs.IntVar(&o.Connections, "connections", o.Connections, "connections to send through the VIP (1..100000)")
			fs.IntVar(&o.LongLived, "long-lived", o.LongLived, "connections kept open across the drain (1..1000)")
			if err := fs.Parse(args); err != nil {
				return err
			}
			return scenario.Demo(ctx, os.Stdout, o)
		},
	}
}
