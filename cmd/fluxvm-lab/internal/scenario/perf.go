//go:build linux

package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// PerfPath is one way from a client to a backend in Perf. The east-west
// paths go from the client VM vm1 to the backend VM vm2, the north-south
// ones (perf_ns.go) from the external client ext to the backend VM vm3;
// all paths of a group end at the same servers in the same VM.
type PerfPath string

// The east-west paths Perf compares.
const (
	// PathBare is the backend's own address with the datapath programs
	// detached from the VM edges: plain forwarding by the node.
	PathBare PerfPath = "bare"
	// PathDirect is the backend's own address with the programs attached,
	// as in production: the baseline for the cost of VIP translation.
	PathDirect PerfPath = "direct"
	// PathVIP is our VIP (VIP4), Maglev over the one backend.
	PathVIP PerfPath = "vip"
	// PathNFT is NFTVIP4, translated by a kube-proxy style nftables
	// DNAT load balancer in the node namespace.
	PathNFT PerfPath = "nft"
)

// PerfWorkload is one workload of Perf.
type PerfWorkload string

// The workloads, both IPv4 TCP.
const (
	// WorkloadConns is short connections: connect, read the identity
	// line, one 4-byte request echoed back, close.
	WorkloadConns PerfWorkload = "conns"
	// WorkloadBulk is long streams into a sink for the whole duration.
	WorkloadBulk PerfWorkload = "bulk"
)

// Addresses and ports of Perf besides the scenario's VIP4 and BackendPort.
const (
	// SinkPort is where Perf's sink listens in the backend VM: it reads
	// a stream to its end and answers with the byte count.
	SinkPort = BackendPort + 1
	// PerfEchoPort and PerfSinkPort are the service ports of both VIPs,
	// leading to BackendPort and SinkPort.
	PerfEchoPort = 80
	PerfSinkPort = 81
)

// NFTVIP4 is the VIP of the nftables load balancer.
var NFTVIP4 = netip.MustParseAddr("10.96.0.20")

// Names in the node namespace's nftables ruleset.
const (
	nftTable      = "kube-proxy"
	nftProbeTable = "fluxvm-perf-probe"
	nftEchoCount  = "svc_echo"
	nftSinkCount  = "svc_sink"
	probeOurVIP   = "to_fluxvm_vip"
	probeNFTVIP   = "to_nft_vip"
)

// Bounds of one operation (connect, a read, a write) and of a stream's
// final answer; nothing in Perf waits longer.
const (
	perfOpTimeout    = 2 * time.Second
	perfFinalTimeout = 5 * time.Second
)

// PerfOptions configure Perf.
type PerfOptions struct {
	// Rounds is how often every path is measured; each round rotates
	// the order of the paths. 1..500 (the paired intervals that resolve
	// 2% need on the order of 100; see docs/lab-perf.md).
	Rounds int
	// Duration of one measurement (one workload on one path). 50ms..60s.
	Duration time.Duration
	// Workers are the parallel connection loops of WorkloadConns. 1..256.
	Workers int
	// Streams are the parallel streams of WorkloadBulk. 1..16.
	Streams int
	// MaxConns bounds the connections of one measurement. 1..10000000.
	MaxConns int
	// Paths are the paths to measure (EastWestPaths, PathSockLB,
	// PathSockDirect, NorthSouthPaths; ParsePerfPaths reads a list);
	// empty means EastWestPaths. The north-south ones add a table, and so
	// do PathSockLB and PathSockDirect (with PathDirect and PathVIP; they
	// make every east-west client a worker process, see perf_sock.go).
	Paths []PerfPath
	// Bare keeps PathBare among the paths: each such measurement
	// detaches the datapath programs from the VM edges and attaches them
	// again after it. False drops it from Paths.
	Bare bool
	// MaxOthers makes Perf robust on a shared machine: a round during
	// one of whose measurements other processes used more than this
	// share of all CPUs (PerfSample.Others) is disturbed; it is kept in
	// the report but left out of the results and run again, at most
	// Rounds extra times. 0 keeps every round. 0..1.
	MaxOthers float64
	// BPFStats reports the datapath programs' own run time
	// (PerfSample.BPF). It turns on the kernel's BPF run-time statistics
	// (BPF_ENABLE_STATS) for as long as the run lasts: they are
	// machine-wide and add two clock reads to every BPF program run,
	// ours included, so they are off by default. Needs TCX attachment.
	BPFStats bool
	// Goals are bounds on paired ratios to judge besides Issue36Goals
	// (ParsePerfGoal reads one); a goal whose paths the run does not
	// measure is left out of the report.
	Goals []PerfGoal
	// ConnsOnly measures only WorkloadConns in the rounds (the checks
	// before them still run both workloads): what the SLO gate needs.
	ConnsOnly bool
	// Logger receives the dataplane's messages; nil discards them.
	Logger *slog.Logger
}

// workloads are the workloads of a round.
func (o PerfOptions) workloads() []PerfWorkload {
	if o.ConnsOnly {
		return []PerfWorkload{WorkloadConns}
	}
	return []PerfWorkload{WorkloadConns, WorkloadBulk}
}

// DefaultPerfOptions are the options of `fluxvm-lab perf`.
func DefaultPerfOptions() PerfOptions {
	return PerfOptions{Rounds: 5, Duration: 2 * time.Second, Workers: 4, Streams: 2, MaxConns: 1_000_000, Bare: true, MaxOthers: 0.2}
}

// Validate checks the bounds documented on PerfOptions.
func (o PerfOptions) Validate() error {
	switch {
	case o.Rounds < 1 || o.Rounds > 500:
		return fmt.Errorf("scenario: perf: rounds %d not in 1..500", o.Rounds)
	case o.Duration < 50*time.Millisecond || o.Duration > time.Minute:
		return fmt.Errorf("scenario: perf: duration %s not in 50ms..60s", o.Duration)
	case o.Workers < 1 || o.Workers > 256:
		return fmt.Errorf("scenario: perf: workers %d not in 1..256", o.Workers)
	case o.Streams < 1 || o.Streams > 16:
		return fmt.Errorf("scenario: perf: streams %d not in 1..16", o.Streams)
	case o.MaxConns < 1 || o.MaxConns > 10_000_000:
		return fmt.Errorf("scenario: perf: max connections %d not in 1..10000000", o.MaxConns)
	case !(o.MaxOthers >= 0 && o.MaxOthers <= 1):
		return fmt.Errorf("scenario: perf: max others %v not in 0..1", o.MaxOthers)
	case len(o.paths()) == 0:
		return fmt.Errorf("scenario: perf: no path to measure (bare alone, with bare off)")
	}
	seen := map[PerfPath]bool{}
	for _, p := range o.Paths {
		if !slices.Contains(allPerfPaths(), p) {
			return fmt.Errorf("scenario: perf: unknown path %q", p)
		}
		if seen[p] {
			return fmt.Errorf("scenario: perf: path %q twice", p)
		}
		seen[p] = true
	}
	return nil
}

// paths are the paths to measure, in table order.
func (o PerfOptions) paths() []PerfPath {
	ps := o.Paths
	if len(ps) == 0 {
		ps = EastWestPaths
	}
	var out []PerfPath
	for _, p := range allPerfPaths() {
		if slices.Contains(ps, p) && (p != PathBare || o.Bare) {
			out = append(out, p)
		}
	}
	return out
}

// eastWest and northSouth report whether the paths include any of the
// group.
func (o PerfOptions) eastWest() bool {
	return slices.ContainsFunc(o.paths(), func(p PerfPath) bool { return !p.northSouth() })
}

func (o PerfOptions) northSouth() bool { return slices.ContainsFunc(o.paths(), PerfPath.northSouth) }

// sockLB reports whether the paths include PathSockLB or PathSockDirect:
// the hooked cgroup and the workers.
func (o PerfOptions) sockLB() bool { return slices.ContainsFunc(o.paths(), PerfPath.sockPath) }

// PerfSample is one measurement: one workload on one path in one round.
type PerfSample struct {
	Round int // 1-based; 0 for the checks before the rounds
	// Disturbed marks a sample of a round that other processes disturbed
	// (see PerfOptions.MaxOthers); the results leave it out.
	Disturbed bool
	Path      PerfPath
	Workload  PerfWorkload
	// Elapsed is the measured time: from the start of the first
	// connection to the end of the last (conns), or from the first byte
	// to the sink's count of the slowest stream (bulk).
	Elapsed time.Duration
	// OK and Failed count connections (conns) or streams (bulk).
	OK, Failed int
	// FirstError describes the first failure, if any.
	FirstError string
	// Bytes is what the sink received (bulk).
	Bytes int64
	// P50 and P99 are connection latencies (conns): connect to close.
	P50, P99 time.Duration
	// ConnectP50 and ConnectP99 are connect latencies (conns): from
	// socket(2) to an established connection (the handshake), of the
	// connections that succeeded.
	ConnectP50, ConnectP99 time.Duration
	// DatapathFlows is the number of new flows our datapath counted for
	// Perf's services during the measurement.
	DatapathFlows uint64
	// NFTConns is the number of new connections the nftables service
	// chains counted (the table exists only while PathNFT is measured).
	NFTConns uint64
	// XDPTranslated is how much the datapath counter xdp_translated
	// rose during the measurement (packets the XDP program translated
	// and sent itself), XDPPassed how much the xdp_pass_* counters rose
	// (VIP packets it left to TC), XDPPassEgress the xdp_pass_egress
	// part of that.
	XDPTranslated, XDPPassed, XDPPassEgress uint64
	// Drops is how many packets the datapath dropped during the
	// measurement (all reasons), SNATFailed the snat_failed part: new
	// north-south NAT flows that found no free SNAT port.
	Drops, SNATFailed uint64
	// SockRewritten is how much the datapath counter sock_rewritten rose
	// during the measurement (connects and sends to a VIP that the
	// socket hooks addressed to a backend), SockFailOpen how much the
	// sock_fail_open_* counters rose (left to TC).
	SockRewritten, SockFailOpen uint64
	// Parsed is how many IP packets our programs parsed during the
	// measurement (the datapath counters ipv4 and ipv6): none on the
	// paths without them (PathBare, PathNoop).
	Parsed uint64
	// CPU is the machine-wide CPU time the measurement cost: the
	// machine's busy time (wall time × CPUs less idle, iowait and steal:
	// user, system, irq, softirq) less other processes' user time
	// (perf_cpu.go says why not their system time). It covers client,
	// servers, kernel threads and every softirq (TC and XDP run there),
	// wherever it ran. It depends less than the rates on what else the
	// machine runs, though not at all less on how fast the hypervisor
	// runs the vCPUs.
	CPU time.Duration
	// SoftIRQ is the machine's irq and softirq time during the
	// measurement (part of CPU), and OthersSys other processes' system
	// time (in CPU too: it may hold our softirqs).
	SoftIRQ, OthersSys time.Duration
	// Lab is the lab process's CPU time (servers, dataplane, and the
	// client unless ClientWorker), Client the client worker's (its
	// cgroup's usage; with ClientWorker only). Both are scheduler run
	// time, softirqs that ran on top of them included.
	Lab, Client  time.Duration
	ClientWorker bool
	// BPF is the run time of our datapath programs during the
	// measurement (PerfOptions.BPFStats), and BPFRuns how often they ran;
	// BPFProgs splits them by program name (the programs that ran).
	BPF      time.Duration
	BPFRuns  uint64
	BPFProgs map[string]PerfProgTime
	// Others is the share of the machine's CPU time (all CPUs) that
	// other processes (not kernel threads) and steal took during the
	// measurement: how much the rest of a shared machine competed.
	Others float64
}

// PerfCheck is one verification Perf makes before measuring: that each
// path is translated by what it claims to measure, and by nothing else.
type PerfCheck struct {
	Name   string
	OK     bool
	Detail string
}

// PerfReport is what Perf measured.
type PerfReport struct {
	Options PerfOptions
	// Paths in table order.
	Paths   []PerfPath
	Checks  []PerfCheck
	Samples []PerfSample
	// SockCgroup is the cgroup the socket hooks were attached to, and
	// WorkerPIDs the worker processes (with PathSockLB; both are gone
	// when Perf returns).
	SockCgroup string
	WorkerPIDs []int
	// Table is the printed results table.
	Table string
}

// Perf measures the same workloads through the paths of o.Paths in one
// lab. East-west (PathDirect, PathVIP, PathNFT, and PathBare with
// o.Bare): client VM vm1, one backend VM vm2 running the identity server
// and a sink. North-south (PathNSDirect, PathNSTC, PathNSXDP): the
// external client ext behind the node's uplink, a backend VM vm3 of its
// own with the same servers. It verifies first that each path is
// translated by what it claims to measure and by nothing else, then runs
// o.Rounds rounds of every workload on every path, rotating the path
// order per round because a shared machine's speed drifts (and repeating
// rounds that other processes disturbed, see PerfOptions.MaxOthers),
// prints progress and tables of medians and ratios to w, and removes
// everything it created, also on error and when ctx is cancelled.
func Perf(ctx context.Context, w io.Writer, o PerfOptions) (rep *PerfReport, err error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	var nftPath string
	if o.eastWest() { // the east-west checks use nftables
		if nftPath, err = NFTPath(); err != nil {
			return nil, err
		}
	}
	// Socket LB: the cgroups exist before the dataplane opens with its
	// hooks on one of them, and go after it (and the workers) closed.
	var sock *perfSock
	if o.sockLB() {
		if sock, err = newPerfSock(); err != nil {
			return nil, fmt.Errorf("scenario: perf: %w", err)
		}
		defer func() {
			if cerr := sock.remove(); cerr != nil {
				err = errors.Join(err, fmt.Errorf("scenario: perf: teardown: %w", cerr))
			}
		}()
	}
	configure := func(c *fluxvm.Config) {
		if o.northSouth() {
			perfNSConfig(c)
		}
		if sock != nil {
			sock.configure(c)
		}
	}
	backends := 1
	if o.northSouth() {
		backends = 2
	}
	env, err := NewEnvConfig(backends, o.Logger, configure)
	if err != nil {
		return nil, fmt.Errorf("scenario: perf: %w", err)
	}
	defer func() {
		if cerr := env.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("scenario: perf: teardown: %w", cerr))
		}
	}()
	p := &perfRun{o: o, w: w, env: env, backend: env.Backends[0], nft: &nftRunner{path: nftPath, ns: env.Lab.Node}, sock: sock}
	p.rep = &PerfReport{Options: o}
	defer p.close()
	if err := p.setup(ctx); err != nil {
		return p.rep, fmt.Errorf("scenario: perf: %w", err)
	}
	if err := p.run(ctx); err != nil {
		if ctx.Err() != nil {
			return p.rep, fmt.Errorf("scenario: perf: interrupted: %w", ctx.Err())
		}
		return p.rep, fmt.Errorf("scenario: perf: %w", err)
	}
	return p.rep, nil
}

type perfRun struct {
	o        PerfOptions
	bpfStats io.Closer
	progs    []*ebpf.Program
	// progNames are progs' names and where they are attached
	// (name@interface, name@interface/xdp, name@cgroup).
	progNames []string
	w         io.Writer
	env       *Env
	backend   *lab.VM
	nft       *nftRunner
	sink      *perfSink
	dialer    *perfDialer
	ns        *perfNS   // nil without north-south paths
	sock      *perfSock // nil without PathSockLB
	rep       *PerfReport
}

func (p *perfRun) printf(format string, a ...any) { fmt.Fprintf(p.w, format, a...) }

// close stops what setup started; the namespaces go with the Env.
func (p *perfRun) close() {
	for _, pr := range p.progs {
		pr.Close()
	}
	if p.bpfStats != nil {
		p.bpfStats.Close()
	}
	if p.sink != nil {
		p.sink.close()
	}
	if p.dialer != nil {
		p.dialer.close()
	}
	if p.ns != nil {
		p.ns.close()
	}
	if p.sock != nil {
		p.sock.stopWorkers()
	}
}

// source is the client address a path's connections come from. Each
// path has its own, so that no path meets state another one left behind.
// The ports of short connections linger in TIME_WAIT, and their number
// makes connect(2) slower: each path fills a port space of its own, as
// much as the others.
func (p *perfRun) source(path PerfPath) netip.Addr {
	switch path {
	case PathBare:
		return perfSourceBare
	case PathNoop:
		return perfSourceNoop
	case PathVIP:
		return perfSourceVIP
	case PathNFT:
		return perfSourceNFT
	case PathSockLB:
		return perfSourceSock
	case PathSockDirect:
		return perfSourceSockDirect
	case PathNSDirect:
		return perfSourceNSDirect
	case PathNSTC:
		return perfSourceNSTC
	case PathNSXDP:
		return perfSourceNSXDP
	}
	return p.env.Client.Addr4
}

// dialerFor is the dialer of a path's client: vm1, or ext for the
// north-south paths.
func (p *perfRun) dialerFor(path PerfPath) *perfDialer {
	if path.northSouth() {
		return p.ns.dialer
	}
	return p.dialer
}

// backendFor is the backend VM a path ends at.
func (p *perfRun) backendFor(path PerfPath) *lab.VM {
	if path.northSouth() {
		return p.ns.backend
	}
	return p.backend
}

// Extra client addresses, on vm1's eth0 next to 10.200.1.2 (direct).
var (
	perfSourceVIP  = netip.MustParseAddr("10.200.1.3")
	perfSourceNFT  = netip.MustParseAddr("10.200.1.4")
	perfSourceBare = netip.MustParseAddr("10.200.1.5")
)

// target is where a path's workload connects.
func (p *perfRun) target(path PerfPath, wl PerfWorkload) string {
	bulk := wl == WorkloadBulk
	pick := func(echo, sink uint16) uint16 {
		if bulk {
			return sink
		}
		return echo
	}
	var ap netip.AddrPort
	switch path {
	case PathVIP, PathSockLB:
		ap = netip.AddrPortFrom(VIP4, pick(PerfEchoPort, PerfSinkPort))
	case PathNFT:
		ap = netip.AddrPortFrom(NFTVIP4, pick(PerfEchoPort, PerfSinkPort))
	case PathNSTC, PathNSXDP:
		ap = netip.AddrPortFrom(NSVIP4, pick(PerfEchoPort, PerfSinkPort))
	default:
		ap = netip.AddrPortFrom(p.backendFor(path).Addr4, pick(BackendPort, SinkPort))
	}
	return ap.String()
}

func (p *perfRun) setup(ctx context.Context) error {
	var err error
	// Short connections leave TIME_WAIT behind in the client, which
	// closes first; without reuse a few rounds would exhaust its ports.
	err = p.env.Client.NS.Do(func() error {
		return errors.Join(
			os.WriteFile("/proc/sys/net/ipv4/ip_local_port_range", []byte("1024 65535"), 0o644),
			os.WriteFile("/proc/sys/net/ipv4/tcp_tw_reuse", []byte("1"), 0o644))
	})
	if err != nil {
		return fmt.Errorf("client sysctls: %w", err)
	}
	if err := perfAddAddrs(p.env.Client, perfSourceVIP, perfSourceNFT, perfSourceBare, perfSourceSock, perfSourceSockDirect, perfSourceNoop); err != nil {
		return err
	}
	if p.sink, err = startPerfSink(p.backend, SinkPort); err != nil {
		return err
	}
	if p.dialer, err = newPerfDialer(p.env.Client.NS); err != nil {
		return err
	}
	one := uint32(1)
	echo := p.env.Service("perf", []uint32{1})
	// vm2 only: in a lab with north-south paths vm3 is theirs.
	echo.Backends = slices.DeleteFunc(echo.Backends, func(b fluxvm.Backend) bool {
		return b.Address != p.backend.Addr4 && b.Address != p.backend.Addr6
	})
	sinkSvc := fluxvm.Service{
		Name:     "perf-sink",
		VIPs:     []netip.Addr{VIP4},
		Ports:    []fluxvm.ServicePort{{Port: PerfSinkPort, Protocol: fluxvm.TCP}},
		Backends: []fluxvm.Backend{{Address: p.backend.Addr4, Port: SinkPort, Weight: &one}},
	}
	for _, s := range []fluxvm.Service{echo, sinkSvc} {
		if _, err := p.env.DP.ApplyService(ctx, s); err != nil {
			return err
		}
	}
	if p.o.northSouth() {
		if err := p.setupNS(ctx); err != nil {
			return err
		}
	}
	if p.sock != nil {
		if err := p.setupSock(); err != nil {
			return err
		}
	}
	if p.o.BPFStats {
		if err := p.openBPFStats(); err != nil {
			return err
		}
	}
	p.rep.Paths = p.o.paths()
	return nil
}

func (p *perfRun) nftServices() []nftService {
	return []nftService{
		{Name: "perf/echo/tcp/p80", Counter: nftEchoCount, VIP: NFTVIP4, Port: PerfEchoPort,
			Endpoints: []netip.AddrPort{netip.AddrPortFrom(p.backend.Addr4, BackendPort)}},
		{Name: "perf/sink/tcp/p81", Counter: nftSinkCount, VIP: NFTVIP4, Port: PerfSinkPort,
			Endpoints: []netip.AddrPort{netip.AddrPortFrom(p.backend.Addr4, SinkPort)}},
	}
}

func (p *perfRun) loadNFT(ctx context.Context) error {
	return p.nft.apply(ctx, kubeProxyRuleset(nftTable, netip.MustParsePrefix("10.96.0.0/16"),
		netip.MustParsePrefix("10.200.0.0/16"), p.nftServices()))
}

// unloadNFT removes the tables even when ctx is already cancelled.
func (p *perfRun) unloadNFT() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return errors.Join(p.nft.deleteTable(ctx, nftTable), p.nft.deleteTable(ctx, nftProbeTable))
}

// nftConns sums the service chains' counters; 0 without the table (or
// without nftables, in a run of north-south paths only).
func (p *perfRun) nftConns(ctx context.Context) (uint64, error) {
	if p.nft.path == "" {
		return 0, nil
	}
	m, err := p.nft.counters(ctx)
	if err != nil {
		return 0, err
	}
	var sum uint64
	for _, c := range []string{nftEchoCount, nftSinkCount} {
		sum += m[nftTable+"/"+c]
	}
	return sum, nil
}

// The datapath counters of parsed IP packets (bpf.CounterIPv4, IPv6).
const (
	cntParsedIPv4 = "ipv4"
	cntParsedIPv6 = "ipv6"
)

// perfCounts is a reading of the datapath counters Perf checks.
type perfCounts struct {
	flows                     uint64 // new flows of all of Perf's services
	xdp, xdpPassed, xdpEgress uint64
	drops, snatFailed         uint64
	sockRewritten, sockOpen   uint64
	parsed                    uint64 // IP packets our programs parsed
}

// datapathCounts reads them through the SDK (fluxvm.Dataplane.Stats).
func (p *perfRun) datapathCounts() (perfCounts, error) {
	st, err := p.env.DP.Stats(context.Background())
	if err != nil {
		return perfCounts{}, err
	}
	var c perfCounts
	for _, svc := range []string{"perf", "perf-sink", "perf-ns", "perf-ns-sink"} {
		c.flows += st.Services[svc].NewFlows
	}
	c.xdp = st.Parser[cntXDPTranslated]
	for _, n := range cntXDPPassed {
		c.xdpPassed += st.Parser[n]
	}
	c.xdpEgress = st.Parser[cntXDPPassEgress]
	for _, n := range st.Drops {
		c.drops += n
	}
	c.snatFailed = st.Drops["snat_failed"]
	c.sockRewritten = st.Parser[cntSockRewritten]
	c.parsed = st.Parser[cntParsedIPv4] + st.Parser[cntParsedIPv6]
	for n, v := range st.Parser {
		if strings.HasPrefix(n, cntSockFailOpen) {
			c.sockOpen += v
		}
	}
	return c, nil
}

// conntrackCount is the node's netfilter conntrack entry count (0 when
// conntrack was never loaded).
func (p *perfRun) conntrackCount() (int, error) {
	var n int
	err := p.env.Lab.Node.Do(func() error {
		b, err := os.ReadFile("/proc/sys/net/netfilter/nf_conntrack_count")
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		n, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err
	})
	return n, err
}

// detach and attach take the datapath programs off the VM edges and put
// them back, for PathBare.
func (p *perfRun) detach() error {
	for _, vm := range p.env.Lab.VMs {
		if err := p.env.DP.RemoveInterface(context.Background(), vm.NodeIf); err != nil {
			return err
		}
	}
	return nil
}

func (p *perfRun) attach() error {
	var errs []error
	for _, vm := range p.env.Lab.VMs {
		if _, err := p.env.DP.AddInterface(context.Background(), fluxvm.VMEdgeInterface{Name: vm.NodeIf, VMID: vm.Name}); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (p *perfRun) run(ctx context.Context) error {
	p.header()
	if err := p.verify(ctx); err != nil {
		return err
	}
	for r := 1; p.rep.Clean() < p.o.Rounds && r <= 2*p.o.Rounds; r++ {
		first := len(p.rep.Samples)
		disturbed := false
		for _, wl := range p.o.workloads() {
			n := len(p.rep.Paths)
			for i := range n {
				path := p.rep.Paths[(i+r-1)%n]
				s, err := p.measure(ctx, r, path, wl, p.o.Duration, p.o.MaxConns, true)
				if err != nil {
					return err
				}
				p.rep.Samples = append(p.rep.Samples, s)
				p.printSample(s)
				if err := p.checkSample(s); err != nil {
					return err
				}
				disturbed = disturbed || (p.o.MaxOthers > 0 && s.Others > p.o.MaxOthers)
			}
		}
		if disturbed {
			for i := first; i < len(p.rep.Samples); i++ {
				p.rep.Samples[i].Disturbed = true
			}
			p.printf("round %d disturbed: other processes used more than %.0f%% of the CPUs; it is left out and run again\n", r, p.o.MaxOthers*100)
		}
	}
	p.rep.Table = p.table()
	p.printf("\n%s", p.rep.Table)
	return nil
}

// measure runs one workload on one path; with setup, the path's setup
// (detaching the programs, loading the nftables table) is done around it.
func (p *perfRun) measure(ctx context.Context, round int, path PerfPath, wl PerfWorkload, d time.Duration, maxConns int, setup bool) (s PerfSample, err error) {
	switch {
	case !setup:
	case path == PathBare:
		if err := p.detach(); err != nil {
			return s, errors.Join(err, p.attach())
		}
		defer func() { err = errors.Join(err, p.attach()) }()
	case path == PathNoop:
		undo, err := p.attachNoop()
		if err != nil {
			return s, err
		}
		defer func() { err = errors.Join(err, undo()) }()
	case path == PathNFT:
		if err := p.loadNFT(ctx); err != nil {
			return s, err
		}
		defer func() { err = errors.Join(err, p.unloadNFT()) }()
	}
	// The uplink's XDP mode is the path's, in the checks too.
	if on, ok := path.xdpWanted(); ok {
		if err := p.setXDP(on); err != nil {
			return s, err
		}
		if err := p.nsGC(ctx); err != nil {
			return s, err
		}
	}
	c0, err := p.datapathCounts()
	if err != nil {
		return s, err
	}
	nft0, err := p.nftConns(ctx)
	if err != nil {
		return s, err
	}
	bpf0, err := p.bpfTime()
	if err != nil {
		return s, err
	}
	skip := p.workerPIDs()
	wk := p.workerFor(path)
	var cg string
	if wk != nil {
		cg = wk.dir
	}
	proc0, err := readProcCPU(cg)
	if err != nil {
		return s, err
	}
	cpu0 := readCPU(skip...)
	switch {
	case wk != nil:
		s, err = wk.run(ctx, perfWorkerRequest{Workload: wl, Source: p.source(path), Target: p.target(path, wl), Want: p.backendFor(path).Name,
			Workers: p.o.Workers, Streams: p.o.Streams, Duration: d, MaxConns: maxConns})
	case wl == WorkloadConns:
		s, err = perfRunConns(ctx, p.dialerFor(path), p.source(path), p.target(path, wl), p.backendFor(path).Name, p.o.Workers, d, maxConns)
	default:
		s, err = perfRunBulk(ctx, p.dialerFor(path), p.source(path), p.target(path, wl), p.o.Streams, d)
	}
	if err != nil {
		return s, err
	}
	s.account(cpu0, readCPU(skip...), ncpu())
	proc1, err := readProcCPU(cg)
	if err != nil {
		return s, err
	}
	s.accountProcs(proc0, proc1, wk != nil)
	bpf1, err := p.bpfTime()
	if err != nil {
		return s, err
	}
	s.accountBPF(bpf0, bpf1)
	s.Round, s.Path, s.Workload = round, path, wl
	c1, err := p.datapathCounts()
	if err != nil {
		return s, err
	}
	nft1, err := p.nftConns(ctx)
	if err != nil {
		return s, err
	}
	s.DatapathFlows, s.NFTConns = c1.flows-c0.flows, nft1-nft0
	s.XDPTranslated, s.XDPPassed, s.XDPPassEgress = c1.xdp-c0.xdp, c1.xdpPassed-c0.xdpPassed, c1.xdpEgress-c0.xdpEgress
	s.Drops, s.SNATFailed = c1.drops-c0.drops, c1.snatFailed-c0.snatFailed
	s.SockRewritten, s.SockFailOpen = c1.sockRewritten-c0.sockRewritten, c1.sockOpen-c0.sockOpen
	s.Parsed = c1.parsed - c0.parsed
	return s, nil
}

// strayFlows is how many new flows a measurement of ok connections may
// count for a translator that is not its path's: late packets of the
// connections measured just before it (a FIN or an ACK retransmitted
// after their close, which the datapath or nftables learns as a new
// flow; seen once in 15 rounds of 12,000 connections), at most one in a
// thousand. A path that is translated counts one per connection. The
// bursts of the checks before the rounds allow none.
func strayFlows(ok uint64) uint64 { return ok / 1000 }

// checkSample fails the run when a measurement did not go through the
// path it claims, or moved nothing.
func (p *perfRun) checkSample(s PerfSample) error {
	if s.OK == 0 {
		return fmt.Errorf("%s on %s moved no traffic (%d failed: %s)", s.Workload, s.Path, s.Failed, s.FirstError)
	}
	ok := uint64(s.OK)
	stray := strayFlows(ok)
	switch {
	case s.Path == PathVIP && (s.DatapathFlows < ok || s.NFTConns > stray):
		return fmt.Errorf("%s on %s: %d connections, but the datapath counted %d new flows and nftables %d", s.Workload, s.Path, s.OK, s.DatapathFlows, s.NFTConns)
	case s.Path == PathNFT && (s.NFTConns < ok || s.DatapathFlows > stray):
		return fmt.Errorf("%s on %s: %d connections, but nftables counted %d and the datapath %d new flows", s.Workload, s.Path, s.OK, s.NFTConns, s.DatapathFlows)
	case (s.Path == PathDirect || s.Path == PathBare || s.Path == PathNoop || s.Path == PathNSDirect || s.Path == PathSockDirect) && (s.DatapathFlows > stray || s.NFTConns > stray):
		return fmt.Errorf("%s on %s was translated: %d datapath flows, %d nftables connections", s.Workload, s.Path, s.DatapathFlows, s.NFTConns)
	case (s.Path == PathBare || s.Path == PathNoop) && s.Parsed > stray:
		return fmt.Errorf("%s on %s: our programs parsed %d packets; they should have been detached", s.Workload, s.Path, s.Parsed)
	case (s.Path == PathDirect || s.Path == PathVIP) && s.Parsed < ok:
		return fmt.Errorf("%s on %s: %d connections, but our programs parsed only %d packets", s.Workload, s.Path, s.OK, s.Parsed)
	}
	return errors.Join(checkSockSample(s), checkNSSample(s))
}
