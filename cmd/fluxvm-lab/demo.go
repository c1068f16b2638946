//go:build linux

package main

import (
	"context"
	"flag"
	"os"

	"golang.org/x/sys/unix"

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
			fs.IntVar(&o.TopFlows, "top-flows", o.TopFlows, "FluxScope flow records in the closing table (1..100)")
			if err := fs.Parse(args); err != nil {
				return err
			}
			// Progress bars only on a terminal: a pipe or a log gets
			// plain lines.
			_, err := unix.IoctlGetTermios(int(os.Stdout.Fd()), unix.TCGETS)
			o.Progress = err == nil
			return scenario.Demo(ctx, os.Stdout, o)
		},
	}
}
