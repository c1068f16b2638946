//go:build linux

package ecmplab

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
)

// The lab's autonomous systems: the router's, and the one every edge
// shares (one AS for the group, as a fleet of edges usually is; BIRD
// merges equal eBGP paths from one neighbour AS).
const (
	RouterAS = 65000
	EdgeAS   = 65001
)

// bird is a BIRD daemon of the lab with its configuration file and
// control socket in dir.
type bird struct {
	birdc, dir string
	p          *proc
}

func (b *bird) conf() string   { return filepath.Join(b.dir, "bird.conf") }
func (b *bird) socket() string { return filepath.Join(b.dir, "bird.ctl") }

// startBIRD writes conf into dir and runs bird in ns in the foreground,
// then waits until it answers on its control socket.
func startBIRD(ctx context.Context, ns *nsutil.NS, birdBin, birdc, name, dir, conf string) (*bird, error) {
	b := &bird{birdc: birdc, dir: dir}
	if err := os.WriteFile(b.conf(), []byte(conf), 0o644); err != nil {
		return nil, fmt.Errorf("ecmplab: %w", err)
	}
	p, err := startProc(ns, name, nil, birdBin, "-f", "-c", b.conf(), "-s", b.socket(), "-P", filepath.Join(dir, "bird.pid"))
	if err != nil {
		return nil, err
	}
	b.p = p
	err = poll(ctx, 10*time.Second, func() bool {
		if p.exited() {
			return true
		}
		out, err := b.cmd("show status")
		return err == nil && strings.Contains(out, "Daemon is up and running")
	})
	if err == nil && p.exited() {
		err = fmt.Errorf("exited: %v", p.err)
	}
	if err != nil {
		b.p.kill()
		return nil, fmt.Errorf("ecmplab: %s did not come up: %w\n%s", name, err, p.Out.Tail(2000))
	}
	return b, nil
}

// cmd runs one birdc command and returns its output.
func (b *bird) cmd(command string) (string, error) {
	out, err := exec.Command(b.birdc, append([]string{"-s", b.socket()}, strings.Fields(command)...)...).CombinedOutput()
	return string(out), err
}

// reconfigure replaces the configuration and makes BIRD load it.
func (b *bird) reconfigure(conf string) error {
	if err := os.WriteFile(b.conf(), []byte(conf), 0o644); err != nil {
		return fmt.Errorf("ecmplab: %w", err)
	}
	out, err := b.cmd("configure")
	if err != nil || !strings.Contains(out, "Reconfigured") {
		return fmt.Errorf("ecmplab: birdc configure: %v: %s", err, out)
	}
	return nil
}

// bgpTimers are the session timers both ends use: a hold time of hold
// (BIRD's floor is 3 s) with keepalives three times as often, fast
// reconnects, and no graceful restart, so that a session that drops
// withdraws its routes at once instead of keeping them stale.
func bgpTimers(hold time.Duration) string {
	h := max(int(hold/time.Second), 3)
	return fmt.Sprintf(`	hold time %d;
	keepalive time %d;
	connect delay time 1;
	connect retry time 1;
	error wait time 1, 2;
	graceful restart off;
`, h, max(h/3, 1))
}

// routerConf is the router's bird.conf: an eBGP session to every edge
// importing whatever it announces (VIPs and SNAT addresses, /32 each)
// (defined even while an edge is down, so it reconnects when the edge
// comes back), and the kernel protocol merging equal paths into one
// multipath route. Only IPv4 is routed in the lab.
func routerConf(edges []*Edge, hold time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, `log stderr all;
router id %s;
protocol device { scan time 1; }
protocol kernel {
	ipv4 { export all; };
	merge paths yes;
}
template bgp edge {
	local as %d;
%s	ipv4 { import all; export none; };
}
`, RouterBackside, RouterAS, bgpTimers(hold))
	for _, e := range edges {
		fmt.Fprintf(&b, "protocol bgp %s from edge {\n\tneighbor %s as %d;\n\tsource address %s;\n}\n", e.Name, e.Uplink, EdgeAS, e.routerSide)
	}
	return b.String()
}

// edgeConf is an edge's bird.conf: the adapter's include file (static
// protocols fluxvm_vips4/6 of blackhole routes, one per advertised VIP
// and one per SNAT address the edge announces: its own, and those it took
// over) and an eBGP session to the router exporting only fluxvm_vips4.
// No kernel protocol: the blackholes stay out of the edge's table.
func edgeConf(e *Edge, include string, hold time.Duration) string {
	return fmt.Sprintf(`log stderr all;
router id %[1]s;
protocol device { }
include %[2]q;
protocol bgp uplink {
	local as %[3]d;
	neighbor %[4]s as %[5]d;
	source address %[1]s;
%[6]s	ipv4 { import none; export where proto = "fluxvm_vips4"; };
}
`, e.Uplink, include, EdgeAS, e.routerSide, RouterAS, bgpTimers(hold))
}

// BGPState is BIRD's state of a BGP protocol ("Established", "Active",
// "Connect"...), read from `birdc show protocols NAME`, or the error.
func (b *bird) bgpState(name string) string {
	out, err := b.cmd("show protocols " + name)
	if err != nil {
		return "unknown (" + strings.TrimSpace(out) + ")"
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= 6 && f[0] == name {
			return strings.Join(f[5:], " ")
		}
	}
	return "unknown"
}

// poll checks cond every 10 ms until it holds, timeout passes or ctx ends.
func poll(ctx context.Context, timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %v", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}
