//go:build linux

package ecmplab

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
)

// Config is a lab's shape and the binaries it runs.
type Config struct {
	// Edges is how many edges start (0: 3; at most MaxEdges, counting
	// those AddEdge adds later).
	Edges int
	// Clients is how many external client namespaces hang off the
	// router (0: 2; at most 9).
	Clients int
	// Backends is how many backend namespaces share the edges' backend
	// segment (0: 3; at most 9).
	Backends int
	// Fluxvmd and Adapter are the fluxvmd and fluxvm-bird binaries
	// (required).
	Fluxvmd, Adapter string
	// Bird and Birdc are BIRD 2's binaries ("": looked up, see FindBIRD).
	Bird, Birdc string
	// PinBase is a directory on a bpffs under which each edge gets its
	// pin root (required; the caller creates and removes it).
	PinBase string
	// HoldTime is the BGP hold time of every session (0: 3 s, BIRD's
	// floor); keepalives go at a third of it.
	HoldTime time.Duration
	// HashSeed and MaglevSeed are every edge's seeds (0: 777 and 42).
	// The group needs them equal for a moved flow to meet the same
	// backend.
	HashSeed, MaglevSeed uint32
	// Group runs the edges as one group (docs/operations.md, "Edges of
	// a group"): each edge with ha_group, a lease epoch of its own
	// (ha_epoch 10+i for edge i), HAInterval, and its REST API on its
	// uplink address too, and the real fluxvm-replicator -group in the
	// router's namespace replicating every running edge to every other
	// and joining them (see Lab.Regroup). Without it the edges share no
	// flow state.
	Group bool
	// Replicator is the fluxvm-replicator binary (required with Group).
	Replicator string
	// HAInterval is the edges' ha_interval and the replicator's
	// -interval with Group (0: 1 s, the default of both).
	HAInterval time.Duration
}

// MaxEdges bounds the edges of a lab (interface names and addresses).
const MaxEdges = 9

// The lab's fixed addresses.
var (
	// RouterBackside is the router's address on the backend segment:
	// the backends' default route, by which their replies reach the
	// edges' SNAT addresses.
	RouterBackside = netip.MustParseAddr("10.251.0.1")
	// RouterBacksideMAC is the router's MAC on the segment (the bridge's,
	// set so that ports joining do not change it).
	RouterBacksideMAC = net.HardwareAddr{0x02, 0xfb, 0x00, 0x00, 0x00, 0x01}
	// DefaultSNATVIP is the VIP of DefaultServices' SNAT service, and
	// DefaultDSRVIP the one of its routed-DSR service.
	DefaultSNATVIP = netip.MustParseAddr("10.96.0.10")
	DefaultDSRVIP  = netip.MustParseAddr("10.96.0.20")
)

const (
	// ServicePort is the frontend port of DefaultServices.
	ServicePort = 80
	// BackendPort is where backends serve the SNAT service.
	BackendPort = 8080
)

// Lab is a running topology. Its methods are for one goroutine at a
// time, except EdgeOf and the flows' methods, which any number may call
// at once.
type Lab struct {
	cfg    Config
	suffix string
	tmp    string
	Router *nsutil.NS
	rtrNL  *netlink.Handle
	rbird  *bird
	// Clients are the external clients (lab.VM: Name, NS, Addr4).
	Clients []*lab.VM
	// Backends serve BackendPort (TCP, UDP) and DefaultDSRVIP:80 (TCP),
	// answering with their name (lab.Server).
	Backends []*lab.VM
	servers  []*lab.Server
	// Edges in the order they were created: Edges[i].Name is "e<i+1>".
	Edges []*Edge
	// Services is the catalog applied to every edge (Apply), and to an
	// edge that joins.
	Services []fluxvm.Service
	// held maps the SNAT address of an edge that is gone to the edge
	// that took it over (TakeOver) and announces it.
	held map[netip.Addr]*Edge
	// token is every edge's admin token (the replicator's too).
	token string
	// repl is the group's replicator (Config.Group), replLines what
	// every replicator run printed on stdout (one JSON object a line).
	repl      *proc
	replLines *lineLog

	mu     sync.Mutex // guards nss and closed
	nss    []*nsutil.NS
	closed bool
	// flowMu serialises EdgeOf: it opens and replaces edges' map
	// handles.
	flowMu sync.Mutex
}

// FindBIRD returns the paths of bird and birdc (Debian package bird2), in
// $PATH or the sbin directories.
func FindBIRD() (birdBin, birdc string, err error) {
	find := func(name string) string {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
		for _, dir := range []string{"/usr/sbin", "/usr/local/sbin", "/sbin"} {
			if st, err := os.Stat(filepath.Join(dir, name)); err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o111 != 0 {
				return filepath.Join(dir, name)
			}
		}
		return ""
	}
	birdBin, birdc = find("bird"), find("birdc")
	if birdBin == "" || birdc == "" {
		return "", "", errors.New("ecmplab: BIRD 2 (bird and birdc, Debian package bird2) is not installed")
	}
	return birdBin, birdc, nil
}

func (c *Config) defaults() error {
	if c.Edges == 0 {
		c.Edges = 3
	}
	if c.Clients == 0 {
		c.Clients = 2
	}
	if c.Backends == 0 {
		c.Backends = 3
	}
	if c.HoldTime == 0 {
		c.HoldTime = 3 * time.Second
	}
	if c.HashSeed == 0 {
		c.HashSeed = 777
	}
	if c.MaglevSeed == 0 {
		c.MaglevSeed = 42
	}
	if c.HAInterval == 0 {
		c.HAInterval = time.Second
	}
	switch {
	case c.Edges < 1 || c.Edges > MaxEdges:
		return fmt.Errorf("ecmplab: edges %d out of 1..%d", c.Edges, MaxEdges)
	case c.Clients < 1 || c.Clients > 9:
		return fmt.Errorf("ecmplab: clients %d out of 1..9", c.Clients)
	case c.Backends < 1 || c.Backends > 9:
		return fmt.Errorf("ecmplab: backends %d out of 1..9", c.Backends)
	case c.Fluxvmd == "" || c.Adapter == "":
		return errors.New("ecmplab: the fluxvmd and fluxvm-bird binaries are required")
	case c.PinBase == "":
		return errors.New("ecmplab: a pin base directory is required")
	case c.Group && c.Replicator == "":
		return errors.New("ecmplab: a group needs the fluxvm-replicator binary")
	case c.HAInterval < 0:
		return fmt.Errorf("ecmplab: ha interval %v is negative", c.HAInterval)
	}
	if c.Bird == "" || c.Birdc == "" {
		var err error
		if c.Bird, c.Birdc, err = FindBIRD(); err != nil {
			return err
		}
	}
	return nil
}

// New builds the topology, starts the router and cfg.Edges edges, and
// returns once every edge's daemon serves and its BGP session is up.
// Nothing is applied yet (Apply). On error everything is removed.
func New(ctx context.Context, cfg Config) (l *Lab, err error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	l = &Lab{cfg: cfg, suffix: nsutil.Suffix(), held: map[netip.Addr]*Edge{}, replLines: &lineLog{}}
	l.token = "fluxvm-ecmplab-" + l.suffix
	defer func() {
		if err != nil {
			err = errors.Join(err, l.Close())
			l = nil
		}
	}()
	if l.tmp, err = os.MkdirTemp("", "fluxvm-ecmplab-"); err != nil {
		return l, err
	}
	if l.Router, err = l.newNS("r", map[string]string{
		"net/ipv4/fib_multipath_hash_policy":   "1", // L4: flows of one client spread
		"net/ipv6/fib_multipath_hash_policy":   "1",
		"net/ipv4/conf/all/send_redirects":     "0", // DSR replies come back out of bbr
		"net/ipv4/conf/default/send_redirects": "0",
	}); err != nil {
		return l, err
	}
	if l.rtrNL, err = netlink.NewHandleAt(l.Router.Handle()); err != nil {
		return l, fmt.Errorf("ecmplab: netlink in router: %w", err)
	}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "bbr"}}
	if err := l.rtrNL.LinkAdd(br); err != nil {
		return l, fmt.Errorf("ecmplab: bridge: %w", err)
	}
	// A bridge without an address of its own takes its ports' lowest:
	// an edge joining with a lower one would change the router's MAC on
	// the segment, and the backends, still sending to the old one, would
	// lose every reply (DSR's and SNAT's) until their ARP entry expired.
	if err := l.rtrNL.LinkSetHardwareAddr(br, RouterBacksideMAC); err != nil {
		return l, fmt.Errorf("ecmplab: bridge address: %w", err)
	}
	if err := setUp(l.rtrNL, "bbr", netip.PrefixFrom(RouterBackside, 24)); err != nil {
		return l, err
	}
	for i := 1; i <= cfg.Clients; i++ {
		if err := l.addClient(i); err != nil {
			return l, err
		}
	}
	for i := 1; i <= cfg.Backends; i++ {
		if err := l.addBackend(i); err != nil {
			return l, err
		}
	}
	for i := 1; i <= cfg.Edges; i++ {
		if _, err := l.createEdge(ctx, i); err != nil {
			return l, err
		}
	}
	rdir := filepath.Join(l.tmp, "router")
	if err := os.Mkdir(rdir, 0o700); err != nil {
		return l, err
	}
	if l.rbird, err = startBIRD(ctx, l.Router, cfg.Bird, cfg.Birdc, "router bird", rdir, routerConf(l.Edges, cfg.HoldTime)); err != nil {
		return l, err
	}
	for _, e := range l.Edges {
		if err := l.waitEstablished(ctx, e); err != nil {
			return l, err
		}
	}
	if cfg.Group {
		if err := l.Regroup(ctx); err != nil {
			return l, err
		}
	}
	return l, nil
}

// newNS creates namespace "fvec<kind>-<suffix>" with forwarding on,
// reverse-path filtering off, sysctls extra, and lo up.
func (l *Lab) newNS(kind string, extra map[string]string) (*nsutil.NS, error) {
	ns, err := nsutil.Create(fmt.Sprintf("fvec%s-%s", kind, l.suffix))
	if err != nil {
		return nil, fmt.Errorf("ecmplab: %w", err)
	}
	l.mu.Lock()
	l.nss = append(l.nss, ns)
	l.mu.Unlock()
	kv := map[string]string{
		"net/ipv4/ip_forward":              "1",
		"net/ipv4/conf/all/rp_filter":      "0",
		"net/ipv4/conf/default/rp_filter":  "0",
		"net/ipv6/conf/default/accept_dad": "0",
	}
	for k, v := range extra {
		kv[k] = v
	}
	err = ns.Do(func() error {
		var errs []error
		for k, v := range kv {
			errs = append(errs, os.WriteFile("/proc/sys/"+k, []byte(v), 0o644))
		}
		return errors.Join(errs...)
	})
	if err != nil {
		return ns, fmt.Errorf("ecmplab: sysctls of %s: %w", ns.Name, err)
	}
	h, err := netlink.NewHandleAt(ns.Handle())
	if err != nil {
		return ns, fmt.Errorf("ecmplab: netlink in %s: %w", ns.Name, err)
	}
	defer h.Close()
	return ns, setUp(h, "lo", netip.Prefix{})
}

// link creates a veth pair: rtrIf in the router (enslaved to the bridge
// when bridged, else with address rtrAddr) and ifname in ns with address
// addr; both up.
func (l *Lab) link(ns *nsutil.NS, rtrIf string, rtrAddr netip.Prefix, bridged bool, ifname string, addr netip.Prefix) error {
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: rtrIf}, PeerName: ifname, PeerNamespace: netlink.NsFd(int(ns.Handle()))}
	if err := l.rtrNL.LinkAdd(veth); err != nil {
		return fmt.Errorf("ecmplab: veth %s-%s: %w", rtrIf, ifname, err)
	}
	if bridged {
		rl, err := l.rtrNL.LinkByName(rtrIf)
		if err != nil {
			return fmt.Errorf("ecmplab: %w", err)
		}
		br, err := l.rtrNL.LinkByName("bbr")
		if err != nil {
			return fmt.Errorf("ecmplab: %w", err)
		}
		if err := l.rtrNL.LinkSetMaster(rl, br); err != nil {
			return fmt.Errorf("ecmplab: %s into the bridge: %w", rtrIf, err)
		}
	}
	if err := setUp(l.rtrNL, rtrIf, rtrAddr); err != nil {
		return err
	}
	h, err := netlink.NewHandleAt(ns.Handle())
	if err != nil {
		return fmt.Errorf("ecmplab: netlink in %s: %w", ns.Name, err)
	}
	defer h.Close()
	return setUp(h, ifname, addr)
}

// setUp sets ifname up, with address p when valid.
func setUp(h *netlink.Handle, ifname string, p netip.Prefix) error {
	lk, err := h.LinkByName(ifname)
	if err != nil {
		return fmt.Errorf("ecmplab: %w", err)
	}
	if p.IsValid() {
		a := &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}, Flags: unix.IFA_F_NODAD}
		if err := h.AddrAdd(lk, a); err != nil {
			return fmt.Errorf("ecmplab: %s %s: %w", ifname, p, err)
		}
	}
	if err := h.LinkSetUp(lk); err != nil {
		return fmt.Errorf("ecmplab: %s up: %w", ifname, err)
	}
	return nil
}

// addRoute adds (replaces) the route to dst via gw in ns; an invalid gw
// makes it unreachable (packets to dst dropped, an ICMP error to their
// source).
func addRoute(ns *nsutil.NS, dst netip.Prefix, gw netip.Addr) error {
	h, err := netlink.NewHandleAt(ns.Handle())
	if err != nil {
		return fmt.Errorf("ecmplab: netlink in %s: %w", ns.Name, err)
	}
	defer h.Close()
	r := &netlink.Route{Dst: &net.IPNet{IP: dst.Addr().AsSlice(), Mask: net.CIDRMask(dst.Bits(), dst.Addr().BitLen())}, Gw: gw.AsSlice()}
	if !gw.IsValid() {
		r.Type = unix.RTN_UNREACHABLE
	}
	if err := h.RouteReplace(r); err != nil {
		return fmt.Errorf("ecmplab: %s: route %s via %s: %w", ns.Name, dst, gw, err)
	}
	return nil
}

var (
	anyRoute4 = netip.MustParsePrefix("0.0.0.0/0")
	// snatRange holds every edge's SNAT address (10.97.0.<i>).
	snatRange = netip.MustParsePrefix("10.97.0.0/24")
)

// addClient wires client i: 10.250.i.2/24, router 10.250.i.1.
func (l *Lab) addClient(i int) error {
	ns, err := l.newNS(fmt.Sprintf("c%d", i), nil)
	if err != nil {
		return err
	}
	vm := &lab.VM{Name: fmt.Sprintf("cli%d", i), NS: ns, Addr4: netip.MustParseAddr(fmt.Sprintf("10.250.%d.2", i))}
	l.Clients = append(l.Clients, vm)
	gw := netip.MustParseAddr(fmt.Sprintf("10.250.%d.1", i))
	if err := l.link(ns, fmt.Sprintf("rc%d", i), netip.PrefixFrom(gw, 24), false, "eth0", netip.PrefixFrom(vm.Addr4, 24)); err != nil {
		return err
	}
	return addRoute(ns, anyRoute4, gw)
}

// addBackend wires backend i on the bridge (10.251.0.(100+i)), gives it
// the DSR VIP on lo (not announced: arp_ignore/arp_announce) and starts
// its servers.
func (l *Lab) addBackend(i int) error {
	ns, err := l.newNS(fmt.Sprintf("b%d", i), map[string]string{
		"net/ipv4/conf/all/arp_ignore":   "1",
		"net/ipv4/conf/all/arp_announce": "2",
	})
	if err != nil {
		return err
	}
	vm := &lab.VM{Name: fmt.Sprintf("be%d", i), NS: ns, Addr4: netip.MustParseAddr(fmt.Sprintf("10.251.0.%d", 100+i))}
	l.Backends = append(l.Backends, vm)
	if err := l.link(ns, fmt.Sprintf("rk%d", i), netip.Prefix{}, true, "eth0", netip.PrefixFrom(vm.Addr4, 24)); err != nil {
		return err
	}
	if err := addRoute(ns, anyRoute4, RouterBackside); err != nil {
		return err
	}
	if err := vm.AddLocalAddress(DefaultDSRVIP); err != nil {
		return err
	}
	snat, err := vm.Serve(BackendPort)
	if err != nil {
		return err
	}
	l.servers = append(l.servers, snat)
	dsr, err := vm.ServeOn(netip.AddrPortFrom(DefaultDSRVIP, ServicePort))
	if err != nil {
		return err
	}
	l.servers = append(l.servers, dsr)
	return nil
}

// DefaultServices is the catalog the lab's test and scenario apply: "web"
// (DefaultSNATVIP:80 TCP and UDP, SNAT to every backend's BackendPort)
// and "web-dsr" (DefaultDSRVIP:80 TCP, routed DSR to every backend, which
// holds the VIP), both north-south and advertised.
func (l *Lab) DefaultServices() []fluxvm.Service {
	snat := fluxvm.Service{
		Name: "web", Exposure: fluxvm.ExposureNorthSouth, Advertise: true,
		VIPs:  []netip.Addr{DefaultSNATVIP},
		Ports: []fluxvm.ServicePort{{Port: ServicePort, Protocol: fluxvm.TCP}, {Port: ServicePort, Protocol: fluxvm.UDP}},
	}
	dsr := fluxvm.Service{
		Name: "web-dsr", Exposure: fluxvm.ExposureNorthSouth, Advertise: true, Mode: fluxvm.ModeDSR,
		VIPs:  []netip.Addr{DefaultDSRVIP},
		Ports: []fluxvm.ServicePort{{Port: ServicePort, Protocol: fluxvm.TCP}},
	}
	for _, be := range l.Backends {
		snat.Backends = append(snat.Backends, fluxvm.Backend{Address: be.Addr4, Port: BackendPort})
		dsr.Backends = append(dsr.Backends, fluxvm.Backend{Address: be.Addr4, Port: ServicePort})
	}
	return []fluxvm.Service{snat, dsr}
}

// Apply posts every service to every running edge over REST, as Fabric
// would, and keeps them for edges that join later (a service of a name
// applied before replaces it).
func (l *Lab) Apply(ctx context.Context, svcs ...fluxvm.Service) error {
	for _, s := range svcs {
		for _, e := range l.Edges {
			if !e.Running() {
				continue
			}
			if err := e.Request(ctx, "POST", "/v1/network/services", s, nil); err != nil {
				return fmt.Errorf("ecmplab: apply %s on %s: %w", s.Name, e.Name, err)
			}
		}
		if i := slices.IndexFunc(l.Services, func(o fluxvm.Service) bool { return o.Name == s.Name }); i >= 0 {
			l.Services[i] = s
		} else {
			l.Services = append(l.Services, s)
		}
	}
	l.dropMaps(l.Edges...)
	return nil
}

// dropMaps closes the flow maps the lab opened of edges (EdgeOf,
// Holders), to be opened again at the next lookup: an apply may grow
// them, and a daemon that grows its maps replaces them (a handle of the
// old ones reads nothing new).
func (l *Lab) dropMaps(edges ...*Edge) {
	l.flowMu.Lock()
	defer l.flowMu.Unlock()
	for _, e := range edges {
		e.closeMaps()
	}
}

// Close stops every process (SIGTERM), removes the namespaces, the
// edges' pins and the lab's files. It may be called more than once.
func (l *Lab) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	var errs []error
	errs = append(errs, l.repl.stop(10*time.Second))
	for _, s := range l.servers {
		errs = append(errs, s.Close())
	}
	if l.rbird != nil {
		errs = append(errs, l.rbird.p.stop(10*time.Second))
	}
	for _, e := range l.Edges {
		errs = append(errs, e.Stop())
		e.closeMaps()
		errs = append(errs, os.RemoveAll(e.pinRoot))
	}
	if l.rtrNL != nil {
		l.rtrNL.Close()
	}
	for i := len(l.nss) - 1; i >= 0; i-- {
		errs = append(errs, l.nss[i].Delete())
	}
	if l.tmp != "" {
		errs = append(errs, os.RemoveAll(l.tmp))
	}
	return errors.Join(errs...)
}
