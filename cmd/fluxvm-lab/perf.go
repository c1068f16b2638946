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
		summary: "the same workload direct, through our VIP and through nftables DNAT, side by side (-paths north-south: XDP vs TC-only vs direct from outside; -paths socket: socket LB vs TC vs direct)",
		run: func(ctx context.Context, args []string) error {
			fs := flag.NewFlagSet("perf", flag.ContinueOnError)
			fs.Usage = func() {
				fmt.Fprint(fs.Output(), perfUsage)
				fs.PrintDefaults()
			}
			o := scenario.DefaultPerfOptions()
			fs.IntVar(&o.Rounds, "rounds", o.Rounds, "measurement rounds; each rotates the order of the paths (1..500; about 100 resolve 2%, see docs/lab-perf.md)")
			fs.DurationVar(&o.Duration, "duration", o.Duration, "duration of one measurement: one workload on one path (50ms..60s)")
			fs.IntVar(&o.Workers, "workers", o.Workers, "parallel workers of the short-connection workload (1..256)")
			fs.IntVar(&o.Streams, "streams", o.Streams, "parallel streams of the bulk workload (1..16)")
			fs.IntVar(&o.MaxConns, "max-conns", o.MaxConns, "connections per measurement at most (1..10000000)")
			paths := fs.String("paths", "east-west", "paths to measure, comma-separated: bare, noop, direct, vip, nft (east-west: client VM to backend VM), sock-lb (the VIP from a client in a cgroup with the socket-LB hooks), sock-direct (diagnostic: the backend's address from that client), ns-direct, ns-tc, ns-xdp (north-south: external client through the uplink, direct, VIP with TC only, the same VIP with XDP native), or the groups east-west, socket (direct, vip, sock-lb), socket-diag (socket and sock-direct), attach-diag (bare, noop, direct), north-south, all (without the diagnostic sock-direct and noop)")
			fs.BoolVar(&o.Bare, "bare", o.Bare, "keep the bare path (direct with the datapath programs detached) when -paths has it")
			fs.Float64Var(&o.MaxOthers, "max-others", o.MaxOthers, "repeat a round (at most -rounds times) when other processes used more than this share of the CPUs during it; 0 keeps all (0..1)")
			fs.BoolVar(&o.BPFStats, "bpf-stats", o.BPFStats, "report the datapath programs' own run time (turns on the kernel's machine-wide BPF statistics for the run)")
			fs.BoolVar(&o.ConnsOnly, "conns-only", o.ConnsOnly, "measure only the short-connection workload in the rounds (the checks still run both): for profiles of the connection path")
			fs.Func("goal", "a goal on a paired ratio, a/b:metric>=x or a/b:metric<=x (metric conns, cpu/conn, bulk or cpu/GB), e.g. sock-lb/vip:conns>=1.03; met only when the ratio's 95% CI lies wholly on its side; repeatable; issue 36's goals are always judged", func(v string) error {
				g, err := scenario.ParsePerfGoal(v)
				o.Goals = append(o.Goals, g)
				return err
			})
			if help, err := parseArgs(fs, args); help || err != nil {
				return err
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

const perfUsage = `usage: fluxvm-lab perf [flags]

Measures short TCP connections per second and bulk throughput on several
paths in one lab, in interleaved rounds (each round rotates the order of
the paths; ratios are paired within rounds), after checking that every
path is translated by what it claims and by nothing else. Needs root (and
nft for the east-west paths).

Every ratio a/b is the geometric mean of the per-round ratios with its 95%
confidence interval (Student t on the log-ratios) below it; a target or
goal (issue 36's, and -goal) is met or MISSED only when the interval lies
wholly on one side of its bound, and unresolved otherwise: resolving 2%
takes on the order of 100 rounds (docs/lab-perf.md). CPU is machine-wide,
softirq included, less steal and other processes' user time, with its
parts: softirq+irq, the client worker (its cgroup) and the lab process
(servers, dataplane, in-process clients). -bpf-stats adds our programs'
run time per connection, per GB and per run (one packet through one
program).

East-west paths (client VM vm1 to backend VM vm2), the default:
  bare       the backend's address, datapath programs detached
  direct     the backend's address, programs attached (the baseline)
  vip        our VIP, translated by the TC programs
  nft        a kube-proxy style nftables DNAT VIP
  noop       (diagnostic; -paths attach-diag = bare,noop,direct) the
             backend's address with a do-nothing program at our hooks
             instead of ours: noop/bare is what a TC hook costs the kernel,
             direct/noop what our programs add to it
Socket LB (-paths socket = direct,vip,sock-lb, or all):
  sock-lb    our VIP from a client process in a cgroup with the socket-LB
             hooks (cgroup connect4/6, sendmsg, recvmsg, getpeername): the
             connect hook addresses the socket to the backend, so no packet
             is translated
  sock-direct (diagnostic; -paths socket-diag = socket and sock-direct)
             the backend's address from sock-lb's client: the hooks run and
             rewrite nothing. sock-direct/direct is the cost of the hooks,
             sock-lb/sock-direct that of the rewrite; every sock-direct
             measurement must leave sock_rewritten and the datapath's new
             flows alone
The lab creates a cgroup under the cgroup v2 root (fluxvm-lab-perf-<suffix>)
with two children: sock-lb, the dataplane's cgroup_path, and plain, without
hooks. With sock-lb in the run, every east-west client is a worker process
(this binary re-executed) in vm1's network namespace, alone in its cgroup:
sock-lb's in sock-lb, the other paths' in plain, so the paths differ only in
who translates. Every sock-lb measurement must raise the datapath counter
sock_rewritten at least once per connection and leave the TC services' new
flows and nftables alone; every other one must leave sock_rewritten alone.
Target: sock-lb within 2% of direct on connections/s and ahead of vip
(paired, judged on the interval). The cgroups and the workers are removed on exit and on Ctrl-C.
North-south paths (external client ext through the node's uplink to
backend VM vm3; -paths north-south, or all):
  ns-direct  the backend's address, TC programs on the uplink, xdp_mode off
  ns-tc      a north-south VIP (DNAT+SNAT) in the TC programs, xdp_mode off
  ns-xdp     the same VIP with xdp_mode native: the XDP program translates
One dataplane has one xdp_mode: perf switches it between measurements by
reopening the dataplane (Close, Open with the other mode), and prints each
switch. Every ns-xdp measurement must raise the datapath counter
xdp_translated (at least once per connection, and once per 64 KiB in
bulk) and every other one must leave it alone, or the run fails; the
report prints the counts. ext computes its own TX checksums and vm3's
eth0 runs an XDP_PASS program on all three north-south paths, as XDP on
veths needs. Every north-south connection takes an SNAT port: the lab
uses the widest SNAT range and tcp_fin_timeout/tcp_rst_timeout 2s, and
runs the GC before each north-south measurement, so that the range does
not run dry (datapath drops, snat_failed among them, are printed). With the north-south paths (-paths all) a run takes about twice as long
as the default.

Flags:
`
