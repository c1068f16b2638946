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

// The bounds of scripts/test-service-fabric-rss.sh (MAX_RSS, MAX_MAP), the
// flags' defaults.
const (
	rssMaxRSS = "S=64,M=96,L=96"
	rssMaxMap = "S=48,M=192,L=720"
)

func init() {
	commands["rss"] = command{
		summary: "RSS gate: the real fluxvmd per tier with services × backends applied over REST; its resident memory and BPF map memory against bounds",
		run: func(ctx context.Context, args []string) error {
			fs := flag.NewFlagSet("rss", flag.ContinueOnError)
			fs.Usage = func() {
				fmt.Fprint(fs.Output(), rssUsage)
				fs.PrintDefaults()
			}
			o := scenario.RSSOptions{Services: 1000, Backends: 10}
			fs.StringVar(&o.Daemon, "fluxvmd", "", "the fluxvmd binary (go build ./cmd/fluxvmd); required")
			tiers := fs.String("tiers", "S,M,L", "tiers to measure, comma-separated")
			fs.IntVar(&o.Services, "services", o.Services, "services to apply (1..4000; tier S takes at most 250)")
			fs.IntVar(&o.Backends, "backends", o.Backends, "backends per service (1..16)")
			maxRSS := fs.String("max-rss", rssMaxRSS, "bounds on the daemon's VmRSS per tier, MiB (\"\": measured only)")
			maxMap := fs.String("max-map", rssMaxMap, "bounds on the BPF map memory per tier, MiB (\"\": measured only)")
			if help, err := parseArgs(fs, args); help || err != nil {
				return err
			}
			switch {
			case o.Daemon == "":
				return fmt.Errorf("rss: -fluxvmd is required")
			case o.Services < 1 || o.Services > 4000:
				return fmt.Errorf("rss: services %d not in 1..4000", o.Services)
			case o.Backends < 1 || o.Backends > 16:
				return fmt.Errorf("rss: backends %d not in 1..16", o.Backends)
			}
			o.Tiers = strings.Split(*tiers, ",")
			var err error
			if o.MaxRSS, err = scenario.ParseTierBounds(*maxRSS); err != nil {
				return fmt.Errorf("rss: -max-rss: %w", err)
			}
			if o.MaxMap, err = scenario.ParseTierBounds(*maxMap); err != nil {
				return fmt.Errorf("rss: -max-map: %w", err)
			}
			rep, err := scenario.RSS(ctx, os.Stdout, o)
			if err != nil {
				return err
			}
			if len(rep.Failed) > 0 {
				return fmt.Errorf("rss gate failed: %s", strings.Join(rep.Failed, "; "))
			}
			return nil
		},
	}
}

const rssUsage = `usage: fluxvm-lab rss -fluxvmd BIN [flags]

The RSS gate. Per tier: a lab node namespace, the real daemon (BIN) in it
with a pin root of its own, -services services (one VIP, port 80/tcp)
with -backends backends each applied over REST (POST
/v1/network/services), then the daemon's resident memory (VmRSS in
/proc/<pid>/status, with its peak VmHWM) and the datapath's map memory
(GET /v1/network/services/status, memory.total_bytes). Tier S holds 256
services: it gets 250. Exits 1 and prints each figure above its bound.
Needs root. The daemon is stopped and its namespace and pins removed after
each tier, also on Ctrl-C.

Flags:
`
