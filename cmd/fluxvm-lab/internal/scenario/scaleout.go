//go:build linux

package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/bpffs"
	"github.com/fluxvm/servicefabric/internal/testutils/ecmplab"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
)

// ScaleOutOptions are the scale-out scenario's binaries and bounds.
type ScaleOutOptions struct {
	// Fluxvmd and Adapter are the fluxvmd and fluxvm-bird binaries
	// (required).
	Fluxvmd, Adapter string
	// Replicator, when set, is the fluxvm-replicator binary: the edges
	// then run as a group sharing their flows (ha_group, the replicator
	// with -group in the router's namespace), and the flows survive the
	// leave and the join. Empty: no state shared (the baseline).
	Replicator string
	// Edges is how many edges start (2..8); one more joins later.
	Edges int
	// Short is how many short TCP connections show the split (1..10000).
	Short int
	// Flows is how many long-lived flows the tables follow across the
	// leave and the join (2..200), half SNAT, half routed DSR.
	Flows int
	// Timeout bounds the whole run (10s..30m).
	Timeout time.Duration
}

// DefaultScaleOutOptions are the scenario's defaults.
func DefaultScaleOutOptions() ScaleOutOptions {
	return ScaleOutOptions{Edges: 3, Short: 300, Flows: 12, Timeout: 3 * time.Minute}
}

func (o ScaleOutOptions) validate() error {
	switch {
	case o.Fluxvmd == "" || o.Adapter == "":
		return errors.New("scale-out: the fluxvmd and fluxvm-bird binaries are required")
	case o.Edges < 2 || o.Edges > ecmplab.MaxEdges-1:
		return fmt.Errorf("scale-out: edges %d out of 2..%d", o.Edges, ecmplab.MaxEdges-1)
	case o.Short < 1 || o.Short > 10000:
		return fmt.Errorf("scale-out: short %d out of 1..10000", o.Short)
	case o.Flows < 2 || o.Flows > 200:
		return fmt.Errorf("scale-out: flows %d out of 2..200", o.Flows)
	case o.Timeout < 10*time.Second || o.Timeout > 30*time.Minute:
		return fmt.Errorf("scale-out: timeout %v out of 10s..30m", o.Timeout)
	}
	return nil
}

// ScaleOut builds a group of edges behind a BIRD 2 router doing ECMP
// (ecmplab), shows the router's multipath route and which edge carries
// each flow, then kills one edge (-9), has a survivor take over its SNAT
// address, and adds another edge, showing what the router and the flows
// did. Everything is removed on return, on error and
// when ctx ends (Ctrl-C).
func ScaleOut(ctx context.Context, w io.Writer, o ScaleOutOptions) (err error) {
	if err := o.validate(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	fmt.Fprintln(w, "== FluxVM Service Fabric: scaling out behind ECMP")
	if _, err := bpffs.Ensure(bpffs.DefaultRoot); err != nil {
		return err
	}
	pins := filepath.Join(bpffs.DefaultRoot, "fluxvm-lab-"+nsutil.Suffix())
	if err := os.Mkdir(pins, 0o700); err != nil {
		return err
	}
	defer func() { err = errors.Join(err, os.RemoveAll(pins)) }()
	group := o.Replicator != ""
	shared := "no flow state shared (run with -fluxvm-replicator for a group that shares it)"
	if group {
		shared = "the edges a group (ha_group): fluxvm-replicator -group shares every edge's flows with the others every second"
	}
	fmt.Fprintf(w, "building: a router (BIRD 2, multipath), %d edges (fluxvmd + BIRD + fluxvm-bird each), 3 backends, 2 clients;\n   %s\n", o.Edges, shared)
	l, err := ecmplab.New(ctx, ecmplab.Config{Edges: o.Edges, Fluxvmd: o.Fluxvmd, Adapter: o.Adapter, PinBase: pins,
		Group: group, Replicator: o.Replicator})
	if err != nil {
		return err
	}
	defer func() {
		cerr := l.Close()
		if cerr == nil {
			fmt.Fprintln(w, "\n== teardown: processes stopped; namespaces, pins and files removed")
		}
		err = errors.Join(err, cerr)
	}()
	describe(w, l)
	svcs := l.DefaultServices()
	if err := l.Apply(ctx, svcs...); err != nil {
		return err
	}
	fmt.Fprintf(w, "\n== the same catalog applied to every edge over REST (hash_seed and maglev_seed equal on all)\n")
	for _, s := range svcs {
		mode := "SNAT (each edge its own SNAT address)"
		if s.Mode != "" && s.Mode != "nat" {
			mode = "routed DSR (backends hold the VIP; replies bypass the edges)"
		}
		fmt.Fprintf(w, "   %-8s %s:%d, %d backends, %s\n", s.Name, s.VIPs[0], s.Ports[0].Port, len(s.Backends), mode)
	}
	for _, vip := range []netip.Addr{ecmplab.DefaultSNATVIP, ecmplab.DefaultDSRVIP} {
		if _, err := l.WaitNexthops(ctx, vip, l.Edges, 30*time.Second); err != nil {
			return err
		}
	}
	for _, e := range l.Edges {
		if _, err := l.WaitNexthops(ctx, e.SNAT, []*ecmplab.Edge{e}, 30*time.Second); err != nil {
			return err
		}
	}
	printRoutes(w, l, "the router learned both VIPs from every edge and merged the paths; each SNAT address from its edge")

	fmt.Fprintf(w, "\n== %d short TCP connections to %s from both clients (new source port each)\n", o.Short, ecmplab.DefaultSNATVIP)
	if err := printSplit(ctx, w, l, o.Short); err != nil {
		return err
	}

	fmt.Fprintf(w, "\n== %d long-lived flows\n", o.Flows)
	flows, err := openFlows(ctx, l, o.Flows)
	defer func() {
		for _, f := range flows {
			f.Close()
		}
	}()
	if err != nil {
		return err
	}
	edges := make([]*ecmplab.Edge, len(flows))
	for i, f := range flows {
		if edges[i], _, err = l.EdgeOf(f); err != nil {
			return err
		}
	}
	if group {
		// A flow's state reaches the other edges within about two
		// intervals (the edge seals its journal, the replicator pulls).
		fmt.Fprintf(w, "   (waiting 3 s: the edges seal their journals every second and the replicator pulls them, so\n   every flow's state reaches the other edges)\n")
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(3 * time.Second):
		}
	}
	dead := make([]bool, len(flows))
	printFlows(w, l, flows, edges, dead, nil)

	if err := ctx.Err(); err != nil {
		return err
	}
	victim := edges[0]
	fmt.Fprintf(w, "\n== %s leaves: kill -9 of its fluxvmd, BIRD and adapter (a crash)\n", victim.Name)
	killed := time.Now()
	victim.Kill()
	var rest []*ecmplab.Edge
	for _, e := range l.Edges {
		if e != victim {
			rest = append(rest, e)
		}
	}
	if _, err := l.WaitNexthops(ctx, ecmplab.DefaultSNATVIP, rest, 10*time.Second); err != nil {
		return err
	}
	fmt.Fprintf(w, "   the router withdrew %s after %v: the kernel closed the dead BIRD's TCP session (a silent\n   failure would wait for the hold timer, 3 s here)\n",
		victim.Name, time.Since(killed).Round(time.Millisecond))
	if _, err := l.WaitNexthops(ctx, victim.SNAT, nil, 10*time.Second); err != nil {
		return err
	}
	printRoutes(w, l, "")

	if err := ctx.Err(); err != nil {
		return err
	}
	by := rest[0]
	fmt.Fprintf(w, "\n== %s takes over %s's SNAT address %s (POST /v1/network/services/snat/peers with announce)\n", by.Name, victim.Name, victim.SNAT)
	took, err := l.TakeOver(ctx, victim, by)
	if err != nil {
		return err
	}
	holds := "which holds no translation for %s's flows (no state shared)"
	if group {
		holds = "which holds every one of %s's flows (replicated): they go on"
	}
	fmt.Fprintf(w, "   the router routes %s via %s %v after the POST (adapter, BIRD, BGP update): the backends'\n"+
		"   replies to it reach %s, "+holds+"\n",
		victim.SNAT, by.Name, took.Round(time.Millisecond), by.Name, victim.Name)
	printRoutes(w, l, "")
	edges = printFlows(w, l, flows, edges, dead, victim)

	if err := ctx.Err(); err != nil {
		return err
	}
	fmt.Fprintf(w, "\n== a new edge joins: started, given the catalog, then peered by the router\n")
	joined := time.Now()
	e, err := l.AddEdge(ctx)
	if err != nil {
		return err
	}
	if _, err := l.WaitNexthops(ctx, ecmplab.DefaultSNATVIP, append(rest, e), 20*time.Second); err != nil {
		return err
	}
	fmt.Fprintf(w, "   %s: fluxvmd serving, BGP %s, in the multipath route %v after it was started\n", e.Name, e.BGPState(), time.Since(joined).Round(time.Millisecond))
	printRoutes(w, l, "")
	printFlows(w, l, flows, edges, dead, nil)
	fmt.Fprintf(w, "\n== %d new short TCP connections after the join\n", o.Short)
	if err := printSplit(ctx, w, l, o.Short); err != nil {
		return err
	}
	if group {
		fmt.Fprintln(w, "\nWhy no flow broke: a flow the router moves to another edge meets the same backend there (same\n"+
			"seeds, same Maglev table), and the edge holds its state: the replicator copied every edge's\n"+
			"flows to the others (same backend, same SNAT address and port, so the backend sees nothing\n"+
			"change), the survivor that took the dead edge's SNAT address over translates its replies, and\n"+
			"the new edge advertised only once it held the group's flows (the join gate). Only flows younger\n"+
			"than the replication lag (about two intervals) can break. docs/scale-out.md.")
		return nil
	}
	fmt.Fprintln(w, "\nWhy flows broke: a flow the router moves to another edge meets the same backend there (same\n"+
		"seeds, same Maglev table), which is enough for routed DSR (nothing translated). A SNAT flow\n"+
		"breaks: its translation lives on the old edge only, the new edge gives it another SNAT address.\n"+
		"Taking over a dead edge's SNAT address brings the backends' replies to a survivor, which\n"+
		"cannot continue the flows without their state.\n"+
		"The router's hash-threshold multipath also moves flows between edges that stay when the set\n"+
		"changes. Sharing flow state in the group (docs/scale-out.md) is the remedy.")
	return nil
}

// describe prints the lab's namespaces and addresses.
func describe(w io.Writer, l *ecmplab.Lab) {
	fmt.Fprintf(w, "   router   netns %-14s AS %d, clients on 10.250.<i>.0/24, backend segment 10.251.0.0/24 (bridge)\n", l.Router.Name, ecmplab.RouterAS)
	for _, e := range l.Edges {
		fmt.Fprintf(w, "   %-8s netns %-14s AS %d, uplink %s, uplink2 %s, SNAT %s, BGP %s\n", e.Name, e.NS.Name, ecmplab.EdgeAS, e.Uplink, e.Backside, e.SNAT, e.BGPState())
	}
	for _, b := range l.Backends {
		fmt.Fprintf(w, "   %-8s netns %-14s %s, default route via the router (%s): SNAT replies follow BGP\n", b.Name, b.NS.Name, b.Addr4, ecmplab.RouterBackside)
	}
	for _, c := range l.Clients {
		fmt.Fprintf(w, "   %-8s netns %-14s %s\n", c.Name, c.NS.Name, c.Addr4)
	}
}

// printRoutes prints the router's route to each VIP and to each edge's
// SNAT address (withdrawn, or via the edge that took it over).
func printRoutes(w io.Writer, l *ecmplab.Lab, note string) {
	if note != "" {
		fmt.Fprintf(w, "\n== %s\n", note)
	}
	route := func(label string, addr netip.Addr, tail string) {
		nh, err := l.Nexthops(addr)
		var parts []string
		for _, e := range nh {
			parts = append(parts, fmt.Sprintf("via %s (%s)", e.Uplink, e.Name))
		}
		switch {
		case err != nil:
			parts = append(parts, err.Error())
		case len(nh) == 0:
			parts = append(parts, "withdrawn")
		}
		fmt.Fprintf(w, "   router: %-4s %s/32 %s%s\n", label, addr, strings.Join(parts, " "), tail)
	}
	for _, vip := range []netip.Addr{ecmplab.DefaultSNATVIP, ecmplab.DefaultDSRVIP} {
		route("VIP", vip, "")
	}
	for _, e := range l.Edges {
		tail := fmt.Sprintf("   %s's own", e.Name)
		if by := l.HeldBy(e); by != nil {
			tail = fmt.Sprintf("   %s's, taken over by %s", e.Name, by.Name)
		}
		route("SNAT", e.SNAT, tail)
	}
}

// printSplit opens n short connections alternating clients and prints
// how many each edge and each backend carried.
func printSplit(ctx context.Context, w io.Writer, l *ecmplab.Lab, n int) error {
	byEdge, byBackend := map[string]int{}, map[string]int{}
	for i := range n {
		if err := ctx.Err(); err != nil {
			return err
		}
		f, err := ecmplab.Dial(l.Clients[i%len(l.Clients)], "tcp", netip.AddrPortFrom(ecmplab.DefaultSNATVIP, ecmplab.ServicePort), 3*time.Second)
		if err != nil {
			return err
		}
		e, _, err := l.EdgeOf(f)
		f.Close()
		if err != nil {
			return err
		}
		byEdge[e.Name]++
		byBackend[f.Backend]++
	}
	fmt.Fprintf(w, "   per edge:    %s\n   per backend: %s\n", formatCounts(byEdge), formatCounts(byBackend))
	return nil
}

// openFlows opens n long-lived TCP flows, alternating clients and
// services (SNAT, DSR).
func openFlows(ctx context.Context, l *ecmplab.Lab, n int) ([]*ecmplab.Flow, error) {
	var fs []*ecmplab.Flow
	for i := range n {
		if err := ctx.Err(); err != nil {
			return fs, err
		}
		vip := ecmplab.DefaultSNATVIP
		if i%2 == 1 {
			vip = ecmplab.DefaultDSRVIP
		}
		f, err := ecmplab.Dial(l.Clients[(i/2)%len(l.Clients)], "tcp", netip.AddrPortFrom(vip, ecmplab.ServicePort), 3*time.Second)
		if err != nil {
			return fs, err
		}
		fs = append(fs, f)
	}
	return fs, nil
}

// printFlows pings every flow and prints a table: where it was, where it
// is now, and whether it still works. It returns the edges the flows are
// on now; dead marks the flows that broke (they are not tried again).
// gone names an edge that just left (its flows are marked).
func printFlows(w io.Writer, l *ecmplab.Lab, flows []*ecmplab.Flow, was []*ecmplab.Edge, dead []bool, gone *ecmplab.Edge) []*ecmplab.Edge {
	now := make([]*ecmplab.Edge, len(flows))
	fmt.Fprintf(w, "   %-3s %-22s %-8s %-8s %-5s %-5s %-18s %s\n", "#", "client", "service", "backend", "was", "now", "translated to", "state")
	ok := 0
	for i, f := range flows {
		svc, snat, state := "web", "-", "ok"
		if f.VIP.Addr() == ecmplab.DefaultDSRVIP {
			svc = "web-dsr"
		}
		now[i] = was[i]
		if dead[i] {
			fmt.Fprintf(w, "   %-3d %-22s %-8s %-8s %-5s %-5s %-18s %s\n", i+1, f.Client.Name+" "+f.Local.String(), svc, f.Backend, was[i].Name, "", "", "broken earlier")
			continue
		}
		perr := f.Ping(2 * time.Second)
		e, en, err := l.EdgeOf(f)
		if err == nil {
			now[i] = e
			if en.Kind == conntrack.SNAT {
				snat = en.SNAT.String()
			}
		}
		switch {
		case perr != nil:
			state = "BROKEN: " + shortErr(perr)
			dead[i] = true
		case now[i] != was[i]:
			state = "ok, moved to another edge"
		}
		if perr == nil {
			ok++
		}
		mark := ""
		if was[i] == gone {
			mark = "*"
		}
		fmt.Fprintf(w, "   %-3d %-22s %-8s %-8s %-5s %-5s %-18s %s\n", i+1, f.Client.Name+" "+f.Local.String(), svc, f.Backend, was[i].Name+mark, now[i].Name, snat, state)
	}
	fmt.Fprintf(w, "   %d of %d flows answer", ok, len(flows))
	if gone != nil {
		fmt.Fprintf(w, " (* were on %s)", gone.Name)
	}
	fmt.Fprintln(w)
	return now
}

func shortErr(err error) string {
	s := err.Error()
	if i := strings.LastIndex(s, ": "); i >= 0 {
		s = s[i+2:]
	}
	return s
}
