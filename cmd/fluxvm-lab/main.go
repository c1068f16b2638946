//go:build linux

// Command fluxvm-lab builds a throwaway topology of network namespaces and
// veth pairs (a node running the datapath, a client VM, backend VMs and an
// external client) and runs scenarios through the real datapath:
//
//	fluxvm-lab demo   VIP traffic, weighted distribution, a live drain
//	fluxvm-lab perf   the same workload direct, through our VIP and
//	                  through an nftables DNAT load balancer, side by side;
//	                  with -paths north-south (or all) also from the
//	                  external client: direct, through a north-south VIP
//	                  with TC only and with XDP native on the uplink;
//	                  with -paths socket (or all) a node-local client in a
//	                  cgroup with the socket-LB hooks against vip and direct
//	fluxvm-lab slo    the SLO gate: connect latency p50/p99, connections/s
//	                  and errors through the VIP against direct, same rounds
//	fluxvm-lab rss    the RSS gate: the real fluxvmd per tier with 1,000
//	                  services × 10 backends; its RSS and BPF map memory
//	fluxvm-lab rss-affinity
//	                  the RSS-affinity gate: fluxvmd with 1M conntrack
//	                  entries; its RSS, the map memory and one GC
//	fluxvm-lab scale-out
//	                  edges behind a BIRD 2 ECMP router: the multipath
//	                  route, which edge carries each flow, an edge
//	                  leaving (kill -9) and one joining
//
// The gates exit 1 and print each figure beyond its bound (the scripts
// scripts/test-service-fabric-{slo,rss,rss-affinity}.sh state the bounds).
//
// It needs root. Everything it creates lives in namespaces whose names end
// in a per-run suffix, and is removed on exit, on Ctrl-C and on failure.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"syscall"

	"github.com/fluxvm/servicefabric/cmd/fluxvm-lab/internal/scenario"
)

// command is one subcommand; files register theirs in init.
type command struct {
	summary string
	run     func(ctx context.Context, args []string) error
}

var commands = map[string]command{}

func main() {
	// A perf worker (sock-lb's client in its cgroup) is this binary too.
	scenario.RunPerfWorkerIfAsked()
	if len(os.Args) < 2 || commands[os.Args[1]].run == nil {
		usage()
		os.Exit(2)
	}
	// SIGPIPE too: output piped into a reader that quits (| head) would
	// otherwise end the process on the spot and leave the lab behind; with
	// it the write fails and the lab is torn down. SIGHUP: a closed terminal.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGPIPE)
	err := commands[os.Args[1]].run(ctx, os.Args[2:])
	stop()
	if errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, "fluxvm-lab: interrupted; the lab was torn down")
		os.Exit(130)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "fluxvm-lab:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: fluxvm-lab <command> [flags]")
	var names []string
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(os.Stderr, "  %-13s %s\n", n, commands[n].summary)
	}
}
