//go:build linux

package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"sort"
	"strings"
	"time"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// DemoOptions bound the demo's traffic.
type DemoOptions struct {
	// Connections is how many short TCP connections go through the VIP
	// to show the distribution (1..100000).
	Connections int
	// LongLived is how many connections stay open across the live drain
	// (1..1000).
	LongLived int
	// Weights of the three backends.
	Weights []uint32
	// Progress draws progress bars (carriage returns): for a terminal
	// only, so that a log or a pipe gets plain lines.
	Progress bool
	// TopFlows is how many FluxScope flow records the closing table
	// shows (1..100).
	TopFlows int
}

// DefaultDemoOptions are the demo's defaults.
func DefaultDemoOptions() DemoOptions {
	return DemoOptions{Connections: 600, LongLived: 12, Weights: []uint32{1, 2, 3}, TopFlows: 10}
}

// Demo builds the lab, runs the dataplane and shows a weighted east-west
// VIP at work: the distribution of real connections against the weights,
// the service statistics, and a live drain in which established
// connections stay on the draining backend while new ones move away.
func Demo(ctx context.Context, w io.Writer, o DemoOptions) (err error) {
	if o.Connections < 1 || o.Connections > 100000 {
		return fmt.Errorf("demo: connections %d out of 1..100000", o.Connections)
	}
	if o.LongLived < 1 || o.LongLived > 1000 {
		return fmt.Errorf("demo: long-lived %d out of 1..1000", o.LongLived)
	}
	if len(o.Weights) != 3 {
		return errors.New("demo: three weights, one per backend")
	}
	if o.TopFlows < 1 || o.TopFlows > 100 {
		return fmt.Errorf("demo: top flows %d out of 1..100", o.TopFlows)
	}
	fmt.Fprintln(w, "== FluxVM Service Fabric lab demo")
	fmt.Fprintln(w, "building the lab: a node namespace, a client VM, three backend VMs, an external client")
	env, err := NewEnvConfig(3, nil, func(c *fluxvm.Config) {
		c.NorthSouthInterfaces = []string{"uplink"}
		c.SNATAddress = DemoSNAT4
		c.SNATAddressV6 = DemoSNAT6
		// FluxScope: every flow gets a record, for the closing table.
		c.FlowSampleRate = 1
	})
	if err != nil {
		return err
	}
	defer func() {
		cerr := env.Close()
		if cerr == nil {
			fmt.Fprintln(w, "\n== teardown: namespaces, programs, pins and catalog removed")
		}
		err = errors.Join(err, cerr)
	}()
	fmt.Fprint(w, indent(env.Lab.Describe()))

	st := env.DP.Status()
	fmt.Fprintf(w, "\n== dataplane: schema %d, program generation %d, map tier %s, pins under %s\n",
		st.SchemaVersion, st.Generation, st.Tier, st.PinRoot)
	for _, ifc := range st.Interfaces {
		var hooks []string
		for _, h := range ifc.Hooks {
			hooks = append(hooks, h.Hook+"/"+h.Mode)
		}
		who := "VM " + ifc.VMID
		if ifc.VMID == "" {
			who = ifc.Kind
		}
		fmt.Fprintf(w, "   %-6s (%s): %s\n", ifc.Name, who, strings.Join(hooks, " "))
	}

	svc := env.Service("web", o.Weights)
	svc.Exposure = fluxvm.ExposureBoth
	applied, err := env.DP.ApplyService(ctx, svc)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "\n== service %q (exposure %s): Maglev over %d backends with weights %v\n", svc.Name, svc.Exposure, len(env.Backends), o.Weights)
	for _, fe := range applied.Frontends {
		fmt.Fprintf(w, "   %-22s %s  service id %d, %d eligible backends\n", fe.VIP, fe.Protocol, fe.ServiceID, fe.Eligible)
	}

	fmt.Fprintf(w, "\n== %d TCP connections through the VIP (IPv4 and IPv6 alternating)\n", o.Connections)
	got, err := connect(ctx, w, env, o.Connections, o.Progress)
	if err != nil {
		return err
	}
	var total uint32
	for _, x := range o.Weights {
		total += x
	}
	fmt.Fprintf(w, "   %-8s %6s %8s %8s\n", "backend", "weight", "share", "got")
	for i, vm := range env.Backends {
		fmt.Fprintf(w, "   %-8s %6d %7.1f%% %7.1f%%  (%d)\n", vm.Name, o.Weights[i],
			100*float64(o.Weights[i])/float64(total), 100*float64(got[vm.Name])/float64(o.Connections), got[vm.Name])
	}
	for _, vip := range []netip.Addr{VIP4, VIP6} {
		name, err := env.Client.AskUDP(netip.AddrPortFrom(vip, 80), 2*time.Second)
		if err != nil {
			return fmt.Errorf("demo: UDP through %s: %w", vip, err)
		}
		fmt.Fprintf(w, "   UDP to %s answered by %s\n", netip.AddrPortFrom(vip, 80), name)
	}
	if err := printStats(w, env.DP); err != nil {
		return err
	}
	if err := northSouth(ctx, w, env); err != nil {
		return err
	}

	// The live drain.
	fmt.Fprintf(w, "\n== live drain: %d long-lived connections open\n", o.LongLived)
	long := make([]*lab.Conn, 0, o.LongLived)
	defer func() {
		for _, c := range long {
			c.Close()
		}
	}()
	on := map[string]int{}
	for i := range o.LongLived {
		if err := ctx.Err(); err != nil {
			return err
		}
		c, err := env.Client.DialTCP(netip.AddrPortFrom(pick(i), 80), 3*time.Second)
		if err != nil {
			return fmt.Errorf("demo: long-lived connection: %w", err)
		}
		long = append(long, c)
		on[c.Backend]++
	}
	victim := busiest(on)
	_, vi, err := env.Backend(victim)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "   per backend: %s; draining %s for 10 minutes\n", formatCounts(on), victim)
	drain := env.Service("web", o.Weights)
	deadline := time.Now().Add(10 * time.Minute).UnixMilli()
	for i := range drain.Backends {
		if i/2 == vi {
			drain.Backends[i].State = fluxvm.BackendDraining
			drain.Backends[i].DrainUntilUnixMs = deadline
		}
	}
	if _, err := env.DP.ApplyService(ctx, drain); err != nil {
		return err
	}
	stayed := 0
	for i, c := range long {
		if err := c.Echo([]byte(fmt.Sprintf("still there %d", i)), 3*time.Second); err != nil {
			return fmt.Errorf("demo: established connection to %s broke during the drain: %w", c.Backend, err)
		}
		if c.Backend == victim {
			stayed++
		}
	}
	fmt.Fprintf(w, "   established connections still answering: %d/%d (%d of them on %s)\n", len(long), len(long), stayed, victim)
	n := max(o.Connections/2, 1)
	after, err := connect(ctx, w, env, n, o.Progress)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "   %d new connections after the drain: %s\n", n, formatCounts(after))
	if after[victim] != 0 {
		return fmt.Errorf("demo: %d new connections went to draining %s", after[victim], victim)
	}
	fmt.Fprintf(w, "   %s took no new connections; its established ones stay until the deadline\n", victim)
	if err := printStats(w, env.DP); err != nil {
		return err
	}
	return printTopFlows(w, env.DP, o.TopFlows)
}

// printTopFlows shows the FluxScope records of the busiest flows (by
// bytes both ways), read with Dataplane.Flows, the call behind GET
// /v1/network/services/flows.
func printTopFlows(w io.Writer, d *fluxvm.Dataplane, top int) error {
	recs, err := d.Flows(context.Background(), flows.MaxLimit, flows.Filter{})
	if err != nil {
		return err
	}
	if len(recs) == 0 {
		return errors.New("demo: no flow records although flow_sample_rate is 1")
	}
	verdicts := map[flows.Verdict]int{}
	for _, r := range recs {
		verdicts[r.Verdict]++
	}
	fmt.Fprintf(w, "\n== FluxScope: %d flow records (%d forwarded, %d dropped); the %d busiest:\n",
		len(recs), verdicts[flows.Forwarded], verdicts[flows.Dropped], min(top, len(recs)))
	sort.SliceStable(recs, func(i, j int) bool {
		return recs[i].Forward.Bytes+recs[i].Reply.Bytes > recs[j].Forward.Bytes+recs[j].Reply.Bytes
	})
	const row = "   %-7s %-24s %-22s %-4s %11s %13s  %s\n"
	fmt.Fprintf(w, row, "service", "client", "backend", "hook", "packets", "bytes", "verdict")
	for _, r := range recs[:min(top, len(recs))] {
		backend, verdict := "-", string(r.Verdict)
		if r.Backend.IsValid() {
			backend = r.Backend.String()
		}
		if r.Reason != "" {
			verdict += " (" + r.Reason + ")"
		}
		fmt.Fprintf(w, row, r.Service, r.Client, backend, shortHook(r.Hook),
			fmt.Sprintf("%d/%d", r.Forward.Packets, r.Reply.Packets), fmt.Sprintf("%d/%d", r.Forward.Bytes, r.Reply.Bytes), verdict)
	}
	fmt.Fprintln(w, "   (packets and bytes: client to backend / back; GET /v1/network/services/flows reads the same records)")
	return nil
}

// shortHook abbreviates a record's hook for the table.
func shortHook(h string) string {
	switch h {
	case "from_vm":
		return "vm"
	case "ns_in":
		return "ns"
	}
	return h
}

// The demo's SNAT addresses: held by no interface; VM backends reach them
// through their default route, and the node translates their replies on
// the VM edge.
var (
	DemoSNAT4 = netip.MustParseAddr("10.254.0.1")
	DemoSNAT6 = netip.MustParseAddr("fd00:254::1")
)

// northSouth shows the external client reaching the VIPs through the
// node's north-south interface: DNAT plus SNAT, so the backends see the
// node's SNAT address, and the replies translated back.
func northSouth(ctx context.Context, w io.Writer, env *Env) error {
	ext := env.Lab.External
	fmt.Fprintf(w, "\n== north-south: %s (%s, %s) through %q\n", ext.Name, ext.Addr4, ext.Addr6, ext.NodeIf)
	got := map[string]int{}
	const n = 60
	for i := range n {
		if err := ctx.Err(); err != nil {
			return err
		}
		c, err := ext.DialTCP(netip.AddrPortFrom(pick(i), 80), 3*time.Second)
		if err != nil {
			return fmt.Errorf("demo: north-south connection %d: %w", i, err)
		}
		got[c.Backend]++
		c.Close()
	}
	fmt.Fprintf(w, "   %d TCP connections from %s: %s\n", n, ext.Name, formatCounts(got))
	for _, vip := range []netip.Addr{VIP4, VIP6} {
		name, err := ext.AskUDP(netip.AddrPortFrom(vip, 80), 2*time.Second)
		if err != nil {
			return fmt.Errorf("demo: north-south UDP through %s: %w", vip, err)
		}
		fmt.Fprintf(w, "   UDP to %s answered by %s\n", netip.AddrPortFrom(vip, 80), name)
	}
	var snat4, snat6, direct int
	for _, s := range env.servers {
		for _, p := range s.Peers() {
			switch p.Addr() {
			case DemoSNAT4:
				snat4++
			case DemoSNAT6:
				snat6++
			case ext.Addr4, ext.Addr6:
				direct++
			}
		}
	}
	fmt.Fprintf(w, "   the backends saw %s as %d client ports of %s and %d of %s; %s itself %d times\n",
		ext.Name, snat4, DemoSNAT4, snat6, DemoSNAT6, ext.Name, direct)
	if direct != 0 || snat4 == 0 || snat6 == 0 {
		return fmt.Errorf("demo: north-south traffic was not source-translated")
	}
	return nil
}

// pick alternates between the two VIPs.
func pick(i int) netip.Addr {
	if i%2 == 0 {
		return VIP4
	}
	return VIP6
}

// connect opens and closes n connections through the VIPs, drawing a
// progress bar when progress is set, and counts them by the backend that
// answered.
func connect(ctx context.Context, w io.Writer, env *Env, n int, progress bool) (map[string]int, error) {
	got := map[string]int{}
	step := max(n/40, 1)
	for i := range n {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		c, err := env.Client.DialTCP(netip.AddrPortFrom(pick(i), 80), 3*time.Second)
		if err != nil {
			return nil, fmt.Errorf("demo: connection %d through the VIP: %w", i, err)
		}
		got[c.Backend]++
		c.Close()
		if progress && ((i+1)%step == 0 || i+1 == n) {
			done := (i + 1) * 40 / n
			fmt.Fprintf(w, "\r   [%s%s] %d/%d", strings.Repeat("#", done), strings.Repeat(".", 40-done), i+1, n)
		}
	}
	if progress {
		fmt.Fprintln(w)
	} else {
		fmt.Fprintf(w, "   %d/%d connected\n", n, n)
	}
	return got, nil
}

func printStats(w io.Writer, d *fluxvm.Dataplane) error {
	st, err := d.Stats(context.Background())
	if err != nil {
		return err
	}
	c := st.Services["web"]
	fmt.Fprintf(w, "   service stats: %d packets / %d bytes in, %d packets / %d bytes back, %d new flows, %d failovers, %d drops\n",
		c.Packets, c.Bytes, c.ReplyPackets, c.ReplyBytes, c.NewFlows, c.Failovers, c.Drops)
	vm, err := d.VMStats(context.Background(), "vm1")
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "   client VM vm1: %d packets to VIPs, %d replies, %d new flows\n",
		vm.Counters.Packets, vm.Counters.ReplyPackets, vm.Counters.NewFlows)
	return nil
}

func busiest(m map[string]int) string {
	best, n := "", -1
	for k, v := range m {
		if v > n || (v == n && k < best) {
			best, n = k, v
		}
	}
	return best
}

func formatCounts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func indent(s string) string {
	return "   " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n   ") + "\n"
}
