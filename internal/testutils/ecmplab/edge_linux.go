//go:build linux

package ecmplab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
	"github.com/fluxvm/servicefabric/internal/testutils/restjson"
	"github.com/fluxvm/servicefabric/nat"
)

// apiAddr is where the lab reaches every edge's fluxvmd, inside its
// namespace; apiPort its port (a group's edges listen on every address,
// the replicator reaching them at their uplink's).
const (
	apiAddr = "127.0.0.1:7788"
	apiPort = 7788
)

// Edge is one edge: a namespace with an uplink toward the router (VIP
// traffic and the BGP session) and uplink2 on the backend segment, the
// real fluxvmd, BIRD and the fluxvm-bird adapter.
type Edge struct {
	Name string
	NS   *nsutil.NS
	// Uplink is its address toward the router (the BGP session's, and
	// the nexthop the router installs, for the VIPs and for its SNAT
	// address); Backside its address on the backend segment, out of
	// which it sends flows to the backends (their replies come back
	// through the router).
	Uplink, Backside netip.Addr
	// SNAT is its SNAT address (one per edge), announced over BGP: the
	// router routes it to this edge, or to the edge that took it over
	// once this one is gone (Lab.TakeOver).
	SNAT netip.Addr

	lab        *Lab
	routerSide netip.Addr
	dir        string
	pinRoot    string
	token      string
	http       *http.Client
	fluxvmd    *proc
	bird       *bird
	adapter    *proc
	ct         *conntrack.Map
	maps       []*ebpf.Map
}

// createEdge wires edge i and starts it (not yet peered by the router).
func (l *Lab) createEdge(ctx context.Context, i int) (*Edge, error) {
	ns, err := l.newNS(fmt.Sprintf("e%d", i), nil)
	if err != nil {
		return nil, err
	}
	e := &Edge{
		Name: fmt.Sprintf("e%d", i), NS: ns, lab: l,
		Uplink:     netip.MustParseAddr(fmt.Sprintf("10.252.%d.2", i)),
		routerSide: netip.MustParseAddr(fmt.Sprintf("10.252.%d.1", i)),
		Backside:   netip.MustParseAddr(fmt.Sprintf("10.251.0.%d", 10+i)),
		SNAT:       netip.MustParseAddr(fmt.Sprintf("10.97.0.%d", i)),
		token:      l.token,
		http:       &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: ns.DialContext}},
	}
	e.dir = filepath.Join(l.tmp, e.Name)
	e.pinRoot = filepath.Join(l.cfg.PinBase, e.Name)
	l.Edges = append(l.Edges, e)
	if err := os.Mkdir(e.dir, 0o700); err != nil {
		return e, fmt.Errorf("ecmplab: %w", err)
	}
	if err := l.link(ns, fmt.Sprintf("re%d", i), netip.PrefixFrom(e.routerSide, 24), false, "uplink", netip.PrefixFrom(e.Uplink, 24)); err != nil {
		return e, err
	}
	if err := l.link(ns, fmt.Sprintf("rb%d", i), netip.Prefix{}, true, "uplink2", netip.PrefixFrom(e.Backside, 24)); err != nil {
		return e, err
	}
	if err := addRoute(ns, anyRoute4, e.routerSide); err != nil {
		return e, err
	}
	// The way back for SNAT flows is BGP: the edge announces its SNAT
	// address beside the VIPs (advertise_snat), the router routes it
	// here, and the backends reach it through their default route, the
	// router's leg on the segment. A packet to an SNAT address that the
	// datapath does not translate (no flow of it here) stops at the
	// edge: without this route the kernel would send it back to the
	// router, which routes it here again, until its TTL runs out.
	if err := addRoute(ns, snatRange, netip.Addr{}); err != nil {
		return e, err
	}
	conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = "S"
pin_root = %q
catalog_path = %q
advertisements_path = %q
node_name = "ecmp-%s"
north_south_interfaces = ["uplink", "uplink2"]
snat_address = %q
advertise_snat = true
snat_port_min = 40000
snat_port_max = 49999
hash_seed = %d
maglev_seed = %d
`, e.pinRoot, filepath.Join(e.dir, "catalog.json"), e.advPath(), e.Name, e.SNAT, l.cfg.HashSeed, l.cfg.MaglevSeed)
	if l.cfg.Group {
		conf += fmt.Sprintf(`ha_epoch = %d
ha_interval = %q
ha_group = true

[sandbox.dataplane.service.api]
listen = "0.0.0.0:%d"
allow_insecure_non_loopback = true
`, 10+i, l.cfg.HAInterval, apiPort)
	}
	if err := os.WriteFile(e.cfgPath(), []byte(conf), 0o600); err != nil {
		return e, fmt.Errorf("ecmplab: %w", err)
	}
	return e, e.start(ctx)
}

func (e *Edge) cfgPath() string { return filepath.Join(e.dir, "fluxvmd.toml") }
func (e *Edge) advPath() string { return filepath.Join(e.dir, "service-advertisements.json") }
func (e *Edge) include() string { return filepath.Join(e.dir, "fluxvm-vips.conf") }
func (e *Edge) birdDir() string { return filepath.Join(e.dir, "bird") }
func (e *Edge) Running() bool   { return e.fluxvmd != nil && !e.fluxvmd.exited() }
func (e *Edge) PinRoot() string { return e.pinRoot }
func (e *Edge) String() string  { return e.Name }

// Start starts the edge's fluxvmd (waiting until it serves), the adapter
// and BIRD (waiting until it answers). The catalog persists across a
// restart (catalog_path); a new edge gets it from AddEdge. In a group
// (Config.Group) the edge rejoins it: Start returns once the replicator
// (restarted with it among the members) joined it.
func (e *Edge) Start(ctx context.Context) error {
	if err := e.start(ctx); err != nil {
		return err
	}
	e.lab.dropMaps(e) // a restart may have replaced them
	if !e.lab.cfg.Group {
		return nil
	}
	if err := e.lab.Regroup(ctx); err != nil {
		return err
	}
	return e.waitJoined(ctx)
}

func (e *Edge) start(ctx context.Context) (err error) {
	if e.Running() {
		return fmt.Errorf("ecmplab: %s already runs", e.Name)
	}
	defer func() {
		if err != nil {
			e.Kill()
		}
	}()
	cfg := e.lab.cfg
	if e.fluxvmd, err = startProc(e.NS, e.Name+" fluxvmd", []string{"FLUXVM_ADMIN_TOKEN=" + e.token}, cfg.Fluxvmd, "-config", e.cfgPath()); err != nil {
		return err
	}
	select {
	case <-e.fluxvmd.Out.Serving():
	case <-e.fluxvmd.done:
		return fmt.Errorf("ecmplab: %s fluxvmd exited (%v) before serving:\n%s", e.Name, e.fluxvmd.err, e.fluxvmd.Out.Tail(3000))
	case <-time.After(30 * time.Second):
		return fmt.Errorf("ecmplab: %s fluxvmd did not come up within 30s:\n%s", e.Name, e.fluxvmd.Out.Tail(3000))
	case <-ctx.Done():
		return ctx.Err()
	}
	// The group's SNAT addresses, as Fabric would set them: this edge
	// gets every other edge's address, the others get this one's; an
	// edge that took this one's address over gives it back, so that the
	// address has one owner again once this edge announces it.
	delete(e.lab.held, e.SNAT)
	if err := e.lab.syncPeers(ctx); err != nil {
		return err
	}
	// The adapter first, as at boot: it writes the include file (no
	// routes yet), which BIRD's configuration needs.
	if e.adapter, err = startProc(e.NS, e.Name+" fluxvm-bird", nil, cfg.Adapter, "-snapshot", e.advPath(), "-output", e.include(),
		"-birdc", cfg.Birdc, "-socket", filepath.Join(e.birdDir(), "bird.ctl"), "-interval", "200ms", "-retry", "300ms"); err != nil {
		return err
	}
	if err := poll(ctx, 10*time.Second, func() bool { _, err := os.Stat(e.include()); return err == nil }); err != nil {
		return fmt.Errorf("ecmplab: %s adapter wrote no include file: %w\n%s", e.Name, err, e.adapter.Out.Tail(2000))
	}
	if err := os.MkdirAll(e.birdDir(), 0o700); err != nil {
		return fmt.Errorf("ecmplab: %w", err)
	}
	e.bird, err = startBIRD(ctx, e.NS, cfg.Bird, cfg.Birdc, e.Name+" bird", e.birdDir(), edgeConf(e, e.include(), cfg.HoldTime))
	return err
}

// Stop stops the edge in order: BIRD first (its session closes with a
// notification, so the router withdraws at once), then the adapter and
// fluxvmd (SIGTERM). fluxvmd's programs stay attached (pinned links), as
// after any daemon stop; the edge gets no traffic once withdrawn.
func (e *Edge) Stop() error {
	var errs []error
	if e.bird != nil {
		e.Thaw() // a frozen BIRD would not see the SIGTERM
		errs = append(errs, e.bird.p.stop(10*time.Second))
	}
	errs = append(errs, e.adapter.stop(5*time.Second), e.fluxvmd.stop(20*time.Second))
	return errors.Join(errs...)
}

// Kill ends fluxvmd, BIRD and the adapter with SIGKILL, as a crash would.
// The kernel closes BIRD's TCP session, so the router learns at once;
// Freeze is the silent failure that waits for the hold timer.
func (e *Edge) Kill() {
	if e.bird != nil {
		e.bird.p.kill()
	}
	e.adapter.kill()
	e.fluxvmd.kill()
}

// Freeze stops the edge's BIRD with SIGSTOP: its session stays open but
// silent, as behind a dead link or a hung node, so the router withdraws
// the edge when the hold timer expires. Thaw resumes it.
func (e *Edge) Freeze() error { return e.signalBIRD(true) }

// Thaw resumes a frozen BIRD (SIGCONT).
func (e *Edge) Thaw() error { return e.signalBIRD(false) }

func (e *Edge) signalBIRD(stop bool) error {
	if e.bird == nil || e.bird.p.exited() {
		return fmt.Errorf("ecmplab: %s: BIRD does not run", e.Name)
	}
	sig := syscall.SIGCONT
	if stop {
		sig = syscall.SIGSTOP
	}
	if err := e.bird.p.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("ecmplab: %s: %v to BIRD: %w", e.Name, sig, err)
	}
	return nil
}

// BGPState is the state of the edge's session as the router's BIRD sees
// it ("Established", "Active", "Connect"...).
func (e *Edge) BGPState() string { return e.lab.rbird.bgpState(e.Name) }

// Output is the end of what the edge's processes printed, for an error
// message.
func (e *Edge) Output() string {
	var b bytes.Buffer
	for _, p := range []*proc{e.fluxvmd, e.adapter} {
		if p != nil {
			fmt.Fprintf(&b, "--- %s:\n%s\n", p.name, p.Out.Tail(3000))
		}
	}
	if e.bird != nil {
		fmt.Fprintf(&b, "--- %s:\n%s\n", e.bird.p.name, e.bird.p.Out.Tail(3000))
	}
	return b.String()
}

// Request sends method path with body as JSON (nil: none) to the edge's
// REST API with its admin token and decodes the answer into out (nil:
// discarded); a status of 300 or more is an error.
func (e *Edge) Request(ctx context.Context, method, path string, body, out any) error {
	if err := restjson.Do(ctx, e.http, e.token, method, "http://"+apiAddr+path, body, out); err != nil {
		return fmt.Errorf("%s: %w", e.Name, err)
	}
	return nil
}

// Conntrack opens (once) the edge's pinned flow maps for reading; the
// daemon is their only writer.
func (e *Edge) Conntrack() (*conntrack.Map, error) {
	if e.ct != nil {
		return e.ct, nil
	}
	var ms []*ebpf.Map
	load := func(name string) *ebpf.Map {
		m, err := ebpf.LoadPinnedMap(filepath.Join(e.pinRoot, "maps", name), nil)
		if err == nil {
			ms = append(ms, m)
		}
		return m
	}
	ct4, ct6, be, n4, n6 := load("fluxvm_fct4"), load("fluxvm_fct6"), load("fluxvm_backends"), load("fluxvm_nat4"), load("fluxvm_nat6")
	fail := func(err error) (*conntrack.Map, error) {
		for _, m := range ms {
			m.Close()
		}
		return nil, fmt.Errorf("ecmplab: %s flow maps: %w", e.Name, err)
	}
	if len(ms) != 5 {
		return fail(errors.New("not all pinned"))
	}
	nt, err := nat.New(n4, n6)
	if err != nil {
		return fail(err)
	}
	ct, err := conntrack.New(conntrack.Config{CT4: ct4, CT6: ct6, Backends: be, NAT: nt})
	if err != nil {
		return fail(err)
	}
	e.ct, e.maps = ct, ms
	return ct, nil
}

func (e *Edge) closeMaps() {
	for _, m := range e.maps {
		m.Close()
	}
	e.ct, e.maps = nil, nil
}

// AddEdge creates a new edge (the next free number), starts it, applies
// the lab's catalog to it, then peers the router with it (birdc
// configure) and waits until the session is established: the edge has
// the catalog before it announces anything. In a group (Config.Group) the
// replicator is restarted with the edge among its members, and AddEdge
// returns once the edge is joined (it loaded every other running edge's
// flows) and the router routes its SNAT address to it.
func (l *Lab) AddEdge(ctx context.Context) (*Edge, error) {
	if len(l.Edges) >= MaxEdges {
		return nil, fmt.Errorf("ecmplab: at most %d edges", MaxEdges)
	}
	e, err := l.createEdge(ctx, len(l.Edges)+1)
	if err != nil {
		return e, err
	}
	for _, s := range l.Services {
		if err := e.Request(ctx, "POST", "/v1/network/services", s, nil); err != nil {
			return e, fmt.Errorf("ecmplab: apply %s on %s: %w", s.Name, e.Name, err)
		}
	}
	l.dropMaps(e)
	if l.cfg.Group {
		// The replicator learns the edge once it has the catalog (the
		// other edges' flows need its services); it joins the edge
		// after a round that brought it every other edge's journals.
		if err := l.Regroup(ctx); err != nil {
			return e, err
		}
	}
	if err := l.rbird.reconfigure(routerConf(l.Edges, l.cfg.HoldTime)); err != nil {
		return e, err
	}
	if err := l.waitEstablished(ctx, e); err != nil || !l.cfg.Group {
		return e, err
	}
	if err := e.waitJoined(ctx); err != nil {
		return e, err
	}
	// Joined, it announces: its SNAT address first of all.
	if _, err := l.WaitNexthops(ctx, e.SNAT, []*Edge{e}, 20*time.Second); err != nil {
		return e, fmt.Errorf("ecmplab: %s joined but not announced: %w", e.Name, err)
	}
	return e, nil
}

func (l *Lab) waitEstablished(ctx context.Context, e *Edge) error {
	if err := poll(ctx, 30*time.Second, func() bool { return e.BGPState() == "Established" }); err != nil {
		return fmt.Errorf("ecmplab: %s's BGP session (%s): %w\n%s", e.Name, e.BGPState(), err, e.Output())
	}
	return nil
}

// Nexthops returns the edges the router's kernel table sends vip to (the
// gateways of its /32 route, multipath or not), sorted by name; none when
// it has no route. vip may be a VIP or an edge's SNAT address.
func (l *Lab) Nexthops(vip netip.Addr) ([]*Edge, error) {
	routes, err := l.rtrNL.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Dst: netlink.NewIPNet(vip.AsSlice())}, netlink.RT_FILTER_DST)
	if err != nil {
		return nil, fmt.Errorf("ecmplab: router's routes to %s: %w", vip, err)
	}
	if len(routes) > 1 {
		return nil, fmt.Errorf("ecmplab: router holds %d routes to %s, want one (multipath)", len(routes), vip)
	}
	var gws []netip.Addr
	for _, r := range routes {
		if r.Gw != nil {
			a, _ := netip.AddrFromSlice(r.Gw)
			gws = append(gws, a.Unmap())
		}
		for _, nh := range r.MultiPath {
			a, _ := netip.AddrFromSlice(nh.Gw)
			gws = append(gws, a.Unmap())
		}
	}
	var out []*Edge
	for _, e := range l.Edges {
		if slices.Contains(gws, e.Uplink) {
			out = append(out, e)
		}
	}
	if len(out) != len(gws) {
		return out, fmt.Errorf("ecmplab: router routes %s via %v, not all of them edges", vip, gws)
	}
	return out, nil
}

// ReturnPath is the gateway backend be's kernel picks to reach addr (an
// edge's SNAT address: the router's leg on the segment, RouterBackside,
// since SNAT addresses are routed over BGP); invalid when addr is on
// its link.
func (l *Lab) ReturnPath(be *lab.VM, addr netip.Addr) (netip.Addr, error) {
	h, err := netlink.NewHandleAt(be.NS.Handle())
	if err != nil {
		return netip.Addr{}, fmt.Errorf("ecmplab: netlink in %s: %w", be.Name, err)
	}
	defer h.Close()
	routes, err := h.RouteGet(addr.AsSlice())
	if err != nil || len(routes) == 0 {
		return netip.Addr{}, fmt.Errorf("ecmplab: %s's route to %s: %v", be.Name, addr, err)
	}
	gw, _ := netip.AddrFromSlice(routes[0].Gw)
	return gw.Unmap(), nil
}

// WaitNexthops polls the router's route to vip (a VIP or an SNAT address)
// every 5 ms until it has exactly the edges want (nil: no route), and
// returns how long that took.
func (l *Lab) WaitNexthops(ctx context.Context, vip netip.Addr, want []*Edge, timeout time.Duration) (time.Duration, error) {
	start := time.Now()
	deadline := start.Add(timeout)
	for {
		got, err := l.Nexthops(vip)
		if err == nil && slices.Equal(got, want) {
			return time.Since(start), nil
		}
		if time.Now().After(deadline) {
			return time.Since(start), fmt.Errorf("ecmplab: router routes %s via %v (%v), want %v after %v", vip, got, err, want, timeout)
		}
		select {
		case <-ctx.Done():
			return time.Since(start), ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}
