// Command fluxvm-bird announces the VIPs a FluxVM node advertises through
// BIRD 2: it turns the advertisement snapshot (package advert,
// docs/advertisements.md) into a BIRD include file of static routes and
// reconfigures BIRD whenever that file changes.
//
//	fluxvm-bird [-snapshot /run/fluxvm/service-advertisements.json]
//	            [-output /etc/bird/fluxvm-vips.conf] [-socket /run/bird/bird.ctl]
//	            [-birdc birdc] [-protocol fluxvm_vips] [-route-type blackhole]
//	            [-interval 500ms] [-retry 5s] [-once]
//
// The include file holds two static protocols, <protocol>4 and
// <protocol>6, with a host route (/32, /128) for every advertised VIP:
//
//	protocol static fluxvm_vips4 {
//		ipv4;
//		route 10.96.0.10/32 blackhole;	# web
//	}
//	protocol static fluxvm_vips6 {
//		ipv6;
//		route fd00:96::10/128 blackhole;	# web
//	}
//
// The node's bird.conf includes it and exports only these protocols to
// its BGP peers (export where proto = "fluxvm_vips4"); the blackhole
// routes exist so that BIRD has something to export, and must stay out of
// the kernel table. docs/advertisements.md has the configuration.
//
// It polls the snapshot's inode, mtime and size every -interval (the
// snapshot is replaced by a rename on every change), reads a new one with
// advert.Read, renders it and, only when the rendered bytes differ from
// the include file, replaces the file atomically and runs
// `birdc -s <socket> configure`. When BIRD refuses the new file the
// previous one is put back (a BIRD restart still parses it); when BIRD is
// not running the new file stays, since BIRD reads it when it starts.
// Either way the configure is tried again every -retry. Errors go to
// standard error; the adapter keeps running. With -once it syncs once
// and exits, 0 when BIRD took the file.
//
// It stops on SIGINT or SIGTERM and leaves the file and BIRD's routes as
// they are: the snapshot, not the adapter, says what is announced.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"regexp"
	"slices"
	"syscall"
	"time"

	"github.com/fluxvm/servicefabric/advert"
)

// DefaultOutput is the include file's path unless -output says otherwise.
const DefaultOutput = "/etc/bird/fluxvm-vips.conf"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stderr))
}

var protocolName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// run is the command: it parses args, then syncs until ctx ends (or once)
// and returns the exit code.
func run(ctx context.Context, args []string, stderr io.Writer) int {
	fl := flag.NewFlagSet("fluxvm-bird", flag.ContinueOnError)
	fl.SetOutput(stderr)
	a := &Adapter{}
	fl.StringVar(&a.Snapshot, "snapshot", advert.DefaultPath, "the advertisement snapshot FluxVM publishes (advertisements_path)")
	fl.StringVar(&a.Output, "output", DefaultOutput, "the include file to write for BIRD")
	fl.StringVar(&a.Socket, "socket", "", "BIRD's control socket (birdc -s); birdc's default when empty")
	fl.StringVar(&a.Birdc, "birdc", "birdc", "the birdc binary")
	fl.StringVar(&a.Render.Protocol, "protocol", "fluxvm_vips", "stem of the static protocols' names: <stem>4 and <stem>6")
	fl.StringVar(&a.Render.RouteType, "route-type", "blackhole", "kind of static route: blackhole, unreachable or prohibit")
	interval := fl.Duration("interval", 500*time.Millisecond, "how often to look at the snapshot")
	fl.DurationVar(&a.Retry, "retry", 5*time.Second, "how long after a failed configure to try again")
	fl.DurationVar(&a.Timeout, "timeout", 30*time.Second, "bound on one birdc run")
	once := fl.Bool("once", false, "sync once and exit (status 1 when BIRD did not take the file)")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	var bad []string
	if fl.NArg() > 0 {
		bad = append(bad, fmt.Sprintf("unexpected arguments %q", fl.Args()))
	}
	if !protocolName.MatchString(a.Render.Protocol) {
		bad = append(bad, fmt.Sprintf("-protocol %q is not a BIRD symbol (letters, digits, _)", a.Render.Protocol))
	}
	if !slices.Contains(RouteTypes, a.Render.RouteType) {
		bad = append(bad, fmt.Sprintf("-route-type %q is not one of %v", a.Render.RouteType, RouteTypes))
	}
	if *interval <= 0 || a.Retry <= 0 || a.Timeout <= 0 {
		bad = append(bad, "-interval, -retry and -timeout must be positive")
	}
	if a.Snapshot == "" || a.Output == "" || a.Birdc == "" {
		bad = append(bad, "-snapshot, -output and -birdc must not be empty")
	}
	if len(bad) > 0 {
		for _, b := range bad {
			fmt.Fprintln(stderr, "fluxvm-bird:", b)
		}
		return 2
	}
	a.Render.Source = a.Snapshot
	a.Log = slog.New(slog.NewTextHandler(stderr, nil)).With("cmd", "fluxvm-bird")

	if *once {
		if err := a.Sync(ctx); err != nil {
			a.Log.Error("sync failed", "err", err)
			return 1
		}
		if !a.configured {
			a.Log.Error("BIRD was not configured", "snapshot", a.Snapshot)
			return 1
		}
		return 0
	}
	a.Log.Info("watching", "snapshot", a.Snapshot, "output", a.Output, "socket", a.Socket, "interval", *interval)
	t := time.NewTicker(*interval)
	defer t.Stop()
	for {
		if err := a.Sync(ctx); err != nil && !errors.Is(err, context.Canceled) {
			a.Log.Error("sync failed", "err", err)
		}
		select {
		case <-ctx.Done():
			a.Log.Info("stopping")
			return 0
		case <-t.C:
		}
	}
}
