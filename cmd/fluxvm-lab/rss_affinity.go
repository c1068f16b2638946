//go:build linux

package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/fluxvm/servicefabric/cmd/fluxvm-lab/internal/scenario"
)

// The bounds of scripts/test-service-fabric-rss-affinity.sh's full run
// (tier L, 1M entries), the flags' defaults.
const (
	affinityMaxRSS  = 96  // MiB
	affinityMaxMap  = 720 // MiB
	affinityMaxGC   = 3 * time.Second
	affinityMinKept = 0.99
)

func init() {
	commands["rss-affinity"] = command{
		summary: "RSS-affinity gate: the real fluxvmd with 1M affinity (conntrack) entries; its memory, the map memory and one GC against bounds",
		run: func(ctx context.Context, args []string) error {
			fs := flag.NewFlagSet("rss-affinity", flag.ContinueOnError)
			fs.Usage = func() {
				fmt.Fprint(fs.Output(), affinityUsage)
				fs.PrintDefaults()
			}
			o := scenario.AffinityOptions{Tier: "L", Entries: 1_000_000, MinKept: affinityMinKept, MaxGC: affinityMaxGC}
			fs.StringVar(&o.Daemon, "fluxvmd", "", "the fluxvmd binary (go build ./cmd/fluxvmd); required")
			fs.StringVar(&o.Tier, "tier", o.Tier, "map tier: S (65,536 conntrack entries), M (262,144) or L (1,048,576)")
			fs.IntVar(&o.Entries, "entries", o.Entries, "affinity entries to fill (at most 97% of the tier's conntrack map)")
			maxRSS := fs.Float64("max-rss", affinityMaxRSS, "bound on the daemon's memory, max(VmRSS with the map full, VmHWM after the GC), MiB (0: measured only)")
			maxMap := fs.Float64("max-map", affinityMaxMap, "bound on the BPF map memory, MiB (0: measured only)")
			fs.DurationVar(&o.MaxGC, "max-gc", o.MaxGC, "bound on one conntrack GC over the entries (0: measured only)")
			fs.Float64Var(&o.MinKept, "min-kept", o.MinKept, "share of the entries that must be in the map after the GC (0..1)")
			if help, err := parseArgs(fs, args); help || err != nil {
				return err
			}
			switch {
			case o.Daemon == "":
				return fmt.Errorf("rss-affinity: -fluxvmd is required")
			case *maxRSS < 0 || *maxMap < 0 || o.MaxGC < 0 || o.MinKept < 0 || o.MinKept > 1:
				return fmt.Errorf("rss-affinity: bounds out of range")
			}
			o.MaxRSS, o.MaxMap = uint64(*maxRSS*(1<<20)), uint64(*maxMap*(1<<20))
			rep, err := scenario.RSSAffinity(ctx, os.Stdout, o)
			if err != nil {
				return err
			}
			if len(rep.Failed) > 0 {
				return fmt.Errorf("rss-affinity gate failed: %s", strings.Join(rep.Failed, "; "))
			}
			return nil
		},
	}
}

const affinityUsage = `usage: fluxvm-lab rss-affinity -fluxvmd BIN [flags]

The RSS-affinity gate. A lab (client VM vm1, backend VM vm2), the real
daemon (BIN) at -tier with one service (10.96.0.10:80 to vm2:8080), one
real connection through the VIP whose conntrack entry is cloned into
-entries affinity entries of fluxvm_fct4 (a batch update of the pinned
map: other clients, the same frontend and backend, established, a deadline
an hour away, so that GC keeps them). Then the daemon's resident memory
(VmRSS, VmHWM), the map memory (GET …/status memory.total_bytes) and the
time of one conntrack GC over them (POST /v1/network/services/conntrack/gc).
Exits 1 and prints each figure above its bound. Needs root. Everything is
removed on exit and on Ctrl-C.

Flags:
`
