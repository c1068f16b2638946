//go:build linux

package scenario

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
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
	// the order of the paths. 1..50.
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
	case o.Rounds < 1 || o.Rounds > 50:
		return fmt.Errorf("scenario: perf: rounds %d not in 1..50", o.Rounds)
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
	// CPU is the CPU time the measurement cost: the machine's busy time
	// (all CPUs) less what other processes and the hypervisor (steal)
	// took. It covers client, servers, kernel threads and the softirqs
	// that run on otherwise idle CPUs. It depends less than the rates on
	// what else the machine runs, though not at all less on how fast the
	// hypervisor runs the vCPUs; it is tick-sampled (USER_HZ).
	CPU time.Duration
	// BPF is the run time of our datapath programs during the
	// measurement (PerfOptions.BPFStats), and BPFRuns how often they ran.
	BPF     time.Duration
	BPFRuns uint64
	// Others is the share of the machine's CPU time (all CPUs) that
	// other processes (not kernel threads) and steal took during the
	// measurement: how much the rest of a shared machine competed.
	Others float64
}

// CPUPerUnit is CPU time in µs per connection (conns) or per GB (bulk).
func (s PerfSample) CPUPerUnit() float64 {
	if s.Workload == WorkloadBulk {
		if s.Bytes == 0 {
			return 0
		}
		return float64(s.CPU) / 1e3 / (float64(s.Bytes) / 1e9)
	}
	if s.OK == 0 {
		return 0
	}
	return float64(s.CPU) / 1e3 / float64(s.OK)
}

// cpuSnap is a reading of the machine's CPU accounting, in USER_HZ ticks
// (100 per second on every Linux architecture Go supports).
type cpuSnap struct {
	busy   uint64 // all CPUs: user, nice, system, irq, softirq, steal
	steal  uint64
	others uint64 // user and children time of other processes
	ok     bool
}

// readCPU reads /proc/stat and every other process's /proc/<pid>/stat
// (other than ours and than skip: the perf workers, whose CPU time is the
// measurement's).
// A process that ends is reaped by a parent whose children time then
// grows by all of it, so the sum over the processes alive at each
// reading grows by exactly what ran in between. Kernel threads are left
// out of it: their work here is mostly the workload's own (ksoftirqd,
// RCU, kworkers).
func readCPU(skip ...int) cpuSnap {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSnap{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return cpuSnap{}
	}
	var c cpuSnap
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system irq softirq steal
		v, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return cpuSnap{}
		}
		c.busy += v
		if i == 8 {
			c.steal = v
		}
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return cpuSnap{}
	}
	self := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self || pid == 2 || slices.Contains(skip, pid) {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue // gone meanwhile
		}
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		// After the command: state ppid ... utime(14) stime cutime cstime.
		r := strings.Fields(string(b[i+1:]))
		if len(r) < 15 || r[1] == "2" {
			continue
		}
		for _, v := range r[11:15] {
			n, _ := strconv.ParseInt(v, 10, 64)
			if n > 0 {
				c.others += uint64(n)
			}
		}
	}
	c.ok = true
	return c
}

// account sets s.CPU and s.Others from readings before and after it.
func (s *PerfSample) account(a, b cpuSnap, elapsed time.Duration) {
	if !a.ok || !b.ok || elapsed <= 0 {
		return
	}
	tick := 10 * time.Millisecond
	others := (b.steal - a.steal) + max(b.others, a.others) - a.others
	if busy := b.busy - a.busy; busy > others {
		s.CPU = time.Duration(busy-others) * tick
	}
	s.Others = float64(time.Duration(others)*tick) / float64(elapsed) / float64(runtime.NumCPU())
}

// BPFPerUnit is our programs' run time in µs per connection (conns) or
// per GB (bulk).
func (s PerfSample) BPFPerUnit() float64 {
	c := s
	c.CPU = s.BPF
	return c.CPUPerUnit()
}

// Rate is connections per second (conns) or bits per second (bulk).
func (s PerfSample) Rate() float64 {
	if s.Elapsed <= 0 {
		return 0
	}
	if s.Workload == WorkloadBulk {
		return float64(s.Bytes) * 8 / s.Elapsed.Seconds()
	}
	return float64(s.OK) / s.Elapsed.Seconds()
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

// samples returns the samples of one path and workload (any workload if
// w is empty) that the results use, in round order: those of undisturbed
// rounds, or of all rounds when every round was disturbed.
func (r *PerfReport) samples(p PerfPath, w PerfWorkload) []PerfSample {
	all := r.Clean() == 0
	var out []PerfSample
	for _, s := range r.Samples {
		if s.Path == p && (s.Workload == w || w == "") && s.Round > 0 && (all || !s.Disturbed) {
			out = append(out, s)
		}
	}
	return out
}

// Clean counts the rounds that were not disturbed.
func (r *PerfReport) Clean() int {
	rounds := map[int]bool{}
	for _, s := range r.Samples {
		if s.Round > 0 {
			rounds[s.Round] = rounds[s.Round] || s.Disturbed
		}
	}
	n := 0
	for _, d := range rounds {
		if !d {
			n++
		}
	}
	return n
}

// Median returns the median, minimum and maximum over the rounds of
// f(sample) for a path and workload; ok is false without samples.
func (r *PerfReport) Median(p PerfPath, w PerfWorkload, f func(PerfSample) float64) (med, lo, hi float64, ok bool) {
	var v []float64
	for _, s := range r.samples(p, w) {
		v = append(v, f(s))
	}
	if len(v) == 0 {
		return 0, 0, 0, false
	}
	slices.Sort(v)
	med = v[len(v)/2]
	if len(v)%2 == 0 {
		med = (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	return med, v[0], v[len(v)-1], true
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
	w        io.Writer
	env      *Env
	backend  *lab.VM
	nft      *nftRunner
	sink     *perfSink
	dialer   *perfDialer
	ns       *perfNS   // nil without north-south paths
	sock     *perfSock // nil without PathSockLB
	rep      *PerfReport
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
	if err := perfAddAddrs(p.env.Client, perfSourceVIP, perfSourceNFT, perfSourceBare, perfSourceSock, perfSourceSockDirect); err != nil {
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

// perfCounts is a reading of the datapath counters Perf checks.
type perfCounts struct {
	flows                     uint64 // new flows of all of Perf's services
	xdp, xdpPassed, xdpEgress uint64
	drops, snatFailed         uint64
	sockRewritten, sockOpen   uint64
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

// openBPFStats turns the kernel's BPF run-time statistics on and opens
// the datapath programs (openBPFProgs).
func (p *perfRun) openBPFStats() error {
	var err error
	if p.bpfStats, err = ebpf.EnableStats(unix.BPF_STATS_RUN_TIME); err != nil {
		return fmt.Errorf("BPF run-time statistics: %w", err)
	}
	return p.openBPFProgs()
}

// openBPFProgs opens the programs attached to the client's VM edge (each
// program is one object on every edge, so its statistics cover all of
// them) and, with north-south paths, those on the uplink: its TC
// programs and the XDP program while one runs. A reopened dataplane
// runs new objects: setXDP calls it again.
func (p *perfRun) openBPFProgs() error {
	for _, pr := range p.progs {
		pr.Close()
	}
	p.progs = nil
	if p.sock != nil {
		sp, err := p.sock.sockProgs()
		p.progs = append(p.progs, sp...)
		if err != nil {
			return err
		}
	}
	return p.env.Lab.Node.Do(func() error {
		targets := []struct {
			name  string
			index int
		}{{p.env.Client.NodeIf, p.env.Client.NodeIfIndex}}
		if p.ns != nil {
			targets = append(targets, struct {
				name  string
				index int
			}{p.ns.ext.NodeIf, p.ns.ext.NodeIfIndex})
		}
		for _, t := range targets {
			n := len(p.progs)
			for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				q, err := link.QueryPrograms(link.QueryOptions{Target: t.index, Attach: at})
				if err != nil {
					return fmt.Errorf("BPF statistics need TCX attachment: query %s: %w", t.name, err)
				}
				for _, ap := range q.Programs {
					pr, err := ebpf.NewProgramFromID(ap.ID)
					if err != nil {
						return err
					}
					p.progs = append(p.progs, pr)
				}
			}
			if len(p.progs) == n {
				return fmt.Errorf("BPF statistics: no program on %s", t.name)
			}
		}
		if p.ns == nil || !p.ns.xdp {
			return nil
		}
		l, err := netlink.LinkByName(perfUplink)
		if err != nil {
			return err
		}
		x := l.Attrs().Xdp
		if x == nil || x.ProgId == 0 {
			return fmt.Errorf("BPF statistics: no XDP program on %s", perfUplink)
		}
		pr, err := ebpf.NewProgramFromID(ebpf.ProgramID(x.ProgId))
		if err != nil {
			return err
		}
		p.progs = append(p.progs, pr)
		return nil
	})
}

// bpfTime sums the run time and runs of the datapath programs (zero
// without BPFStats).
func (p *perfRun) bpfTime() (time.Duration, uint64, error) {
	var rt time.Duration
	var n uint64
	for _, pr := range p.progs {
		st, err := pr.Stats()
		if err != nil {
			return 0, 0, err
		}
		rt += st.Runtime
		n += st.RunCount
	}
	return rt, n, nil
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

func (p *perfRun) header() {
	st := p.env.DP.Status()
	mode := "?"
	if len(st.Interfaces) > 0 && len(st.Interfaces[0].Hooks) > 0 {
		mode = st.Interfaces[0].Hooks[0].Mode
	}
	var uts syscall.Utsname
	_ = syscall.Uname(&uts)
	p.printf("fluxvm-lab perf: %d rounds x %s per measurement, %d connection workers, %d bulk stream(s)\n",
		p.o.Rounds, p.o.Duration, p.o.Workers, p.o.Streams)
	p.printf("host: %d CPUs, GOMAXPROCS %d, kernel %s; datapath tier %s, attach %s; node netns %s\n",
		runtime.NumCPU(), runtime.GOMAXPROCS(0), perfUTS(uts.Release[:]), st.Tier, mode, p.env.Lab.Node.Name)
	if p.o.eastWest() {
		p.printf("east-west paths (client vm1, one backend %s in vm2; conns / bulk destination):\n", p.backend.Addr4)
		for _, path := range p.rep.Paths {
			if !path.northSouth() {
				p.printf("  %-*s from %s to %s\n", p.pathWidth(), path, p.source(path), perfDescribe(path, p.target(path, WorkloadConns), p.target(path, WorkloadBulk)))
			}
		}
	}
	if p.sock != nil {
		p.sockHeader()
	}
	if p.ns != nil {
		p.printf("north-south paths (external client ext behind the node's %s, one backend %s in vm3; SNAT %s; conns / bulk destination):\n",
			perfUplink, p.ns.backend.Addr4, perfNSSNAT4)
		for _, path := range p.rep.Paths {
			if path.northSouth() {
				p.printf("  %-*s from %s to %s\n", p.pathWidth(), path, p.source(path), perfDescribe(path, p.target(path, WorkloadConns), p.target(path, WorkloadBulk)))
			}
		}
		p.printf("  ext computes its TX checksums (offload off) and vm3's eth0 runs an XDP_PASS program, for all three (XDP needs both)\n")
		p.printf("  one dataplane has one xdp_mode: it is switched between measurements by reopening the dataplane (SDK Close + Open), never during one\n")
	}
	if p.o.BPFStats {
		p.printf("BPF run-time statistics are on for this run: every BPF program on the machine, ours included, does two more clock reads per run\n")
	}
	p.printf("workloads: conns = connect, read identity, 4-byte echo, close (%d workers, at most %d per measurement); bulk = %d stream(s) into a sink\n\n",
		p.o.Workers, p.o.MaxConns, p.o.Streams)
}

// pathWidth is the width of the path names in the header: 9, or the
// longest path's.
func (p *perfRun) pathWidth() int {
	w := 9
	for _, path := range p.rep.Paths {
		w = max(w, len(path))
	}
	return w
}

func perfDescribe(path PerfPath, echo, sink string) string {
	switch path {
	case PathBare:
		return fmt.Sprintf("%s / %s, routed by the node, datapath programs detached", echo, sink)
	case PathDirect:
		return fmt.Sprintf("%s / %s, routed by the node, datapath programs attached (baseline)", echo, sink)
	case PathVIP:
		return fmt.Sprintf("%s / %s, our VIP: Maglev in the TC programs, one backend", echo, sink)
	case PathNFT:
		return fmt.Sprintf("%s / %s, kube-proxy style nftables DNAT (table loaded for these measurements only)", echo, sink)
	case PathSockLB:
		return fmt.Sprintf("%s / %s, our VIP addressed to the backend at connect by the socket hooks (client in the hooked cgroup), no per-packet NAT", echo, sink)
	case PathSockDirect:
		return fmt.Sprintf("%s / %s, the backend's address from sock-lb's worker in the hooked cgroup: the hooks run, rewrite nothing (diagnostic)", echo, sink)
	case PathNSDirect:
		return fmt.Sprintf("%s / %s, routed by the node, TC programs on the uplink, xdp_mode off (baseline)", echo, sink)
	case PathNSTC:
		return fmt.Sprintf("%s / %s, north-south VIP: DNAT+SNAT in the TC programs, xdp_mode off", echo, sink)
	case PathNSXDP:
		return fmt.Sprintf("%s / %s, the same VIP with xdp_mode native: the XDP program translates and redirects", echo, sink)
	}
	return string(path)
}

func perfUTS(b []int8) string {
	var s []byte
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
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
	bpf0, runs0, err := p.bpfTime()
	if err != nil {
		return s, err
	}
	skip := p.workerPIDs()
	cpu0, t0 := readCPU(skip...), time.Now()
	switch wk := p.workerFor(path); {
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
	s.account(cpu0, readCPU(skip...), time.Since(t0))
	bpf1, runs1, err := p.bpfTime()
	if err != nil {
		return s, err
	}
	s.BPF, s.BPFRuns = bpf1-bpf0, runs1-runs0
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
	return s, nil
}

// checkSample fails the run when a measurement did not go through the
// path it claims, or moved nothing.
func (p *perfRun) checkSample(s PerfSample) error {
	if s.OK == 0 {
		return fmt.Errorf("%s on %s moved no traffic (%d failed: %s)", s.Workload, s.Path, s.Failed, s.FirstError)
	}
	ok := uint64(s.OK)
	switch {
	case s.Path == PathVIP && (s.DatapathFlows < ok || s.NFTConns != 0):
		return fmt.Errorf("%s on %s: %d connections, but the datapath counted %d new flows and nftables %d", s.Workload, s.Path, s.OK, s.DatapathFlows, s.NFTConns)
	case s.Path == PathNFT && (s.NFTConns < ok || s.DatapathFlows != 0):
		return fmt.Errorf("%s on %s: %d connections, but nftables counted %d and the datapath %d new flows", s.Workload, s.Path, s.OK, s.NFTConns, s.DatapathFlows)
	case (s.Path == PathDirect || s.Path == PathBare || s.Path == PathNSDirect || s.Path == PathSockDirect) && (s.DatapathFlows != 0 || s.NFTConns != 0):
		return fmt.Errorf("%s on %s was translated: %d datapath flows, %d nftables connections", s.Workload, s.Path, s.DatapathFlows, s.NFTConns)
	}
	return errors.Join(checkSockSample(s), checkNSSample(s))
}

func (p *perfRun) printSample(s PerfSample) {
	tag := "checks"
	if s.Round > 0 {
		tag = fmt.Sprintf("round %d", s.Round)
	}
	var fig string
	if s.Workload == WorkloadBulk {
		fig = fmt.Sprintf("%8.2f Gbit/s  %.0f ms CPU/GB; %d stream(s), %.1f MB", s.Rate()/1e9, s.CPUPerUnit()/1e3, s.OK, float64(s.Bytes)/1e6)
	} else {
		fig = fmt.Sprintf("%8.0f conn/s  %.1f µs CPU/conn; p50 %s p99 %s, %d connections", s.Rate(), s.CPUPerUnit(), perfMicros(s.P50), perfMicros(s.P99), s.OK)
	}
	via := ""
	switch s.Path {
	case PathVIP:
		via = fmt.Sprintf("; datapath new flows %d", s.DatapathFlows)
	case PathNFT:
		via = fmt.Sprintf("; nftables new conns %d", s.NFTConns)
	case PathNSTC, PathNSXDP:
		via = fmt.Sprintf("; datapath new flows %d", s.DatapathFlows)
	case PathSockLB, PathSockDirect:
		via = fmt.Sprintf("; sock_rewritten +%d; datapath new flows %d", s.SockRewritten, s.DatapathFlows)
	}
	if s.SockFailOpen > 0 || (s.SockRewritten > 0 && !s.Path.sockPath()) {
		via += fmt.Sprintf("; sock_rewritten +%d, sock_fail_open_* +%d", s.SockRewritten, s.SockFailOpen)
	}
	if s.Path.northSouth() {
		via += fmt.Sprintf("; xdp_translated +%d", s.XDPTranslated)
		if s.XDPPassed > 0 {
			via += fmt.Sprintf(" (xdp_pass_* +%d)", s.XDPPassed)
		}
	}
	if s.Drops > 0 {
		via += fmt.Sprintf("; datapath drops +%d (snat_failed +%d)", s.Drops, s.SNATFailed)
	}
	if p.o.BPFStats {
		unit := "µs/conn"
		v := s.BPFPerUnit()
		if s.Workload == WorkloadBulk {
			unit, v = "ms/GB", v/1e3
		}
		via += fmt.Sprintf("; BPF %.2f %s (%d runs)", v, unit, s.BPFRuns)
	}
	failed := fmt.Sprintf("; others %.0f%%", s.Others*100)
	if s.Failed > 0 {
		failed += fmt.Sprintf("; %d FAILED (%s)", s.Failed, s.FirstError)
	}
	width := 6
	if p.ns != nil || p.sock != nil {
		width = 9
	}
	for _, path := range p.rep.Paths {
		width = max(width, len(path))
	}
	p.printf("%-11s %-5s %-*s %s%s%s\n", tag, s.Workload, width, s.Path, fig, via, failed)
}

func perfMicros(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Microsecond), 'f', 0, 64) + "µs"
}

// verify proves, with a short burst of both workloads per path, that
// PathVIP is translated by our datapath and never seen by netfilter
// (neither at the start of prerouting nor by the nftables services),
// that PathNFT is translated by nftables and not by our datapath, that
// PathDirect is translated by neither, and that netfilter conntrack does
// nothing in the node while the nftables table is not loaded. The bursts
// also warm every path up. With north-south paths it proves what
// nsChecks says of them.
func (p *perfRun) verify(ctx context.Context) error {
	burst := min(p.o.Duration, 500*time.Millisecond)
	const burstConns = 200
	if p.o.eastWest() {
		n := "three"
		if p.sock != nil {
			n = "four"
			if slices.Contains(p.rep.Paths, PathSockDirect) {
				n = "five"
			}
		}
		p.printf("checks (nftables table and a prerouting probe loaded for all %s paths):\n", n)
		if err := p.verifyEastWest(ctx, burst, burstConns); err != nil {
			return err
		}
	}
	if p.ns != nil {
		p.printf("checks of the north-south paths (xdp_mode switched as each path needs):\n")
		if err := p.nsChecks(ctx, burst, burstConns); err != nil {
			return err
		}
	}
	var failed []string
	for _, c := range p.rep.Checks {
		mark := "ok  "
		if !c.OK {
			mark = "FAIL"
			failed = append(failed, c.Name)
		}
		p.printf("  %s %s: %s\n", mark, c.Name, c.Detail)
	}
	p.printf("\n")
	if len(failed) > 0 {
		return fmt.Errorf("checks failed: %s", strings.Join(failed, "; "))
	}
	return nil
}

// verifyEastWest makes the checks of the east-west paths.
func (p *perfRun) verifyEastWest(ctx context.Context, burst time.Duration, burstConns int) (err error) {
	if err := p.loadNFT(ctx); err != nil {
		return err
	}
	defer func() {
		if uerr := p.unloadNFT(); uerr != nil {
			err = errors.Join(err, uerr)
		}
	}()
	probe := probeRuleset(nftProbeTable, map[string]netip.Addr{probeOurVIP: VIP4, probeNFTVIP: NFTVIP4})
	if err := p.nft.apply(ctx, probe); err != nil {
		return err
	}
	checked := []PerfPath{PathDirect, PathVIP, PathNFT}
	if p.sock != nil {
		checked = append(checked, PathSockLB)
		if slices.Contains(p.rep.Paths, PathSockDirect) {
			checked = append(checked, PathSockDirect)
		}
	}
	for _, path := range checked {
		c0, err := p.datapathCounts()
		if err != nil {
			return err
		}
		m0, err := p.nft.counters(ctx)
		if err != nil {
			return err
		}
		b, err := p.checkBurst(ctx, path, burst, burstConns)
		if err != nil {
			return err
		}
		flows, okConns := b.flows, b.ok
		c1, err := p.datapathCounts()
		if err != nil {
			return err
		}
		rew := c1.sockRewritten - c0.sockRewritten
		// The burst's last packets (a FIN, a reset) may reach the
		// prerouting probe after its connections returned: wait until
		// the counters hold still, so that they count to this path and
		// not to the next one.
		m1, err := p.nft.counters(ctx)
		for settle := 0; err == nil && settle < 20; settle++ {
			time.Sleep(100 * time.Millisecond)
			var again map[string]uint64
			if again, err = p.nft.counters(ctx); err == nil {
				if maps.Equal(again, m1) {
					break
				}
				m1 = again
			}
		}
		if err != nil {
			return err
		}
		delta := func(table, name string) (uint64, error) {
			a, err := nftCounter(m0, table, name)
			if err != nil {
				return 0, err
			}
			b, err := nftCounter(m1, table, name)
			return b - a, err
		}
		var d [4]uint64
		for i, c := range []struct{ t, n string }{
			{nftProbeTable, probeOurVIP}, {nftProbeTable, probeNFTVIP}, {nftTable, nftEchoCount}, {nftTable, nftSinkCount},
		} {
			if d[i], err = delta(c.t, c.n); err != nil {
				return err
			}
		}
		toOurs, toNFT, nftSvc := d[0], d[1], d[2]+d[3]
		var c PerfCheck
		switch path {
		case PathDirect:
			c = PerfCheck{Name: "direct is translated by neither",
				OK: flows == 0 && nftSvc == 0 && toOurs == 0 && toNFT == 0 && rew == 0}
		case PathVIP:
			c = PerfCheck{Name: "vip is translated by our datapath before netfilter sees it",
				OK: flows >= okConns && nftSvc == 0 && toOurs == 0 && rew == 0}
		case PathNFT:
			c = PerfCheck{Name: "nft is translated by nftables, passed on untouched by our datapath",
				OK: flows == 0 && nftSvc >= okConns && toNFT > 0 && rew == 0}
		case PathSockLB:
			c = PerfCheck{Name: "sock-lb is addressed to the backend at connect by the socket hooks; TC and netfilter translate nothing",
				OK: rew >= okConns && flows == 0 && nftSvc == 0 && toOurs == 0 && toNFT == 0}
		case PathSockDirect:
			c = PerfCheck{Name: "sock-direct passes the socket hooks untouched; translated by nothing",
				OK: rew == 0 && flows == 0 && nftSvc == 0 && toOurs == 0 && toNFT == 0}
		}
		c.Detail = fmt.Sprintf("%d connections; datapath new flows %d; nftables service chains %d; prerouting packets to %s %d, to %s %d",
			okConns, flows, nftSvc, VIP4, toOurs, NFTVIP4, toNFT)
		if p.sock != nil {
			c.Detail += fmt.Sprintf("; sock_rewritten +%d", rew)
		}
		p.rep.Checks = append(p.rep.Checks, c)
	}
	if err := p.unloadNFT(); err != nil {
		return err
	}
	// Without the table, netfilter conntrack must not track anything in
	// the node: the direct and vip paths do not pay for it.
	ct0, err := p.conntrackCount()
	if err != nil {
		return err
	}
	var conns int
	for _, path := range []PerfPath{PathDirect, PathVIP} {
		s, err := p.measure(ctx, 0, path, WorkloadConns, burst, burstConns, true)
		if err != nil {
			return err
		}
		conns += s.OK
	}
	ct1, err := p.conntrackCount()
	if err != nil {
		return err
	}
	p.rep.Checks = append(p.rep.Checks, PerfCheck{
		Name:   "netfilter conntrack is idle in the node without the nftables table",
		OK:     ct1 <= ct0 && conns > 0,
		Detail: fmt.Sprintf("%d direct and vip connections; node conntrack entries %d before, %d after", conns, ct0, ct1),
	})
	return nil
}

// perfRatio is a ratio column of a results table: a over b.
type perfRatio struct {
	name string
	a, b PerfPath
}

// table formats medians over the rounds with spreads and ratios: one
// table of the east-west paths, one of the north-south paths, each with
// its targets or comparisons below.
func (p *perfRun) table() string {
	r := p.rep
	var b strings.Builder
	rounds := 0
	for _, s := range r.Samples {
		rounds = max(rounds, s.Round)
	}
	switch clean := r.Clean(); {
	case clean == 0:
		fmt.Fprintf(&b, "results: median of %d round(s), ALL disturbed by other processes; spread = (max-min)/median\n", rounds)
	case clean < rounds:
		fmt.Fprintf(&b, "results: median of %d undisturbed round(s) of %d; spread = (max-min)/median\n", clean, rounds)
	default:
		fmt.Fprintf(&b, "results: median of %d round(s); spread = (max-min)/median\n", rounds)
	}
	var ew, ns, sock []PerfPath
	for _, path := range r.Paths {
		switch {
		case path.northSouth():
			ns = append(ns, path)
		case path.sockPath():
		default:
			ew = append(ew, path)
		}
		if slices.Contains(SocketDiagPaths, path) && slices.ContainsFunc(r.Paths, PerfPath.sockPath) {
			sock = append(sock, path)
		}
	}
	// With sock-lb, the east-west table is printed when it has more
	// than the socket table shows.
	if len(sock) > 0 && !slices.ContainsFunc(ew, func(p PerfPath) bool { return !slices.Contains(SocketDiagPaths, p) }) {
		ew = nil
	}
	if len(ew) > 0 {
		p.tableOf(&b, ew, []perfRatio{{"vip/direct", PathVIP, PathDirect}, {"vip/nft", PathVIP, PathNFT}})
	}
	if r.Clean() < p.o.Rounds {
		fmt.Fprintf(&b, "note: only %d of the %d rounds asked for ran undisturbed by other processes; expect noise\n", r.Clean(), p.o.Rounds)
	}
	if len(ew) > 0 {
		p.targets(&b)
	}
	if len(sock) > 0 {
		if len(ew) > 0 {
			fmt.Fprintf(&b, "\n")
		}
		hooked := "sock-lb's"
		if slices.Contains(r.Paths, PathSockDirect) {
			hooked = "sock-lb's and sock-direct's"
		}
		fmt.Fprintf(&b, "socket LB (vm1 -> vm2; every client a worker process, %s in the hooked cgroup):\n", hooked)
		ratios := []perfRatio{{"sock-lb/direct", PathSockLB, PathDirect}, {"sock-lb/vip", PathSockLB, PathVIP}}
		if slices.Contains(r.Paths, PathSockDirect) {
			ratios = append(ratios, perfRatio{"sock-direct/direct", PathSockDirect, PathDirect}, perfRatio{"sock-lb/sock-direct", PathSockLB, PathSockDirect})
		}
		p.tableOf(&b, sock, ratios)
		p.sockTargets(&b)
	}
	if len(ns) > 0 {
		if len(ew) > 0 {
			fmt.Fprintf(&b, "\n")
		}
		fmt.Fprintf(&b, "north-south (external client ext -> vm3 through the uplink):\n")
		p.tableOf(&b, ns, []perfRatio{{"xdp/tc", PathNSXDP, PathNSTC}, {"xdp/direct", PathNSXDP, PathNSDirect}, {"tc/direct", PathNSTC, PathNSDirect}})
		p.nsComparisons(&b)
		b.WriteString(p.nsSummary())
	}
	return b.String()
}

// tableOf writes the table of some paths with ratio columns.
func (p *perfRun) tableOf(b *strings.Builder, paths []PerfPath, ratios []perfRatio) {
	r := p.rep
	tw := tabwriter.NewWriter(b, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := []string{"", ""}
	for _, path := range paths {
		head = append(head, string(path))
	}
	for _, rt := range ratios {
		head = append(head, rt.name)
	}
	head = append(head, "")
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	blank := make([]string, len(ratios)+1)
	type row struct {
		name   string
		wl     PerfWorkload
		f      func(PerfSample) float64
		format func(float64) string
	}
	rows := []row{
		{"connections/s", WorkloadConns, PerfSample.Rate, func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) }},
		{"conn latency p50 µs", WorkloadConns, func(s PerfSample) float64 { return float64(s.P50) / 1e3 }, func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) }},
		{"conn latency p99 µs", WorkloadConns, func(s PerfSample) float64 { return float64(s.P99) / 1e3 }, func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) }},
		{"conn CPU µs/conn", WorkloadConns, PerfSample.CPUPerUnit, func(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }},
		{"bulk Gbit/s", WorkloadBulk, PerfSample.Rate, func(v float64) string { return strconv.FormatFloat(v/1e9, 'f', 2, 64) }},
		{"bulk CPU ms/GB", WorkloadBulk, PerfSample.CPUPerUnit, func(v float64) string { return strconv.FormatFloat(v/1e3, 'f', 1, 64) }},
		{"conn datapath BPF µs/conn", WorkloadConns, PerfSample.BPFPerUnit, func(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }},
		{"bulk datapath BPF ms/GB", WorkloadBulk, PerfSample.BPFPerUnit, func(v float64) string { return strconv.FormatFloat(v/1e3, 'f', 2, 64) }},
		{"others' CPU share %", "", func(s PerfSample) float64 { return s.Others * 100 }, func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) }},
	}
	for _, rw := range rows {
		if strings.Contains(rw.name, "BPF") && !p.o.BPFStats || rw.wl == WorkloadBulk && p.o.ConnsOnly {
			continue
		}
		cells := []string{rw.name, ""}
		spread := []string{"  spread", ""}
		med := map[PerfPath]float64{}
		for _, path := range paths {
			m, lo, hi, ok := r.Median(path, rw.wl, rw.f)
			if !ok {
				cells = append(cells, "-")
				spread = append(spread, "")
				continue
			}
			med[path] = m
			cells = append(cells, rw.format(m))
			if m > 0 {
				spread = append(spread, fmt.Sprintf("%.1f%%", (hi-lo)/m*100))
			} else {
				spread = append(spread, "")
			}
		}
		if rw.wl == "" {
			cells = append(cells, blank...)
		} else {
			for _, rt := range ratios {
				if med[rt.b] == 0 {
					cells = append(cells, "-")
				} else {
					cells = append(cells, fmt.Sprintf("%.3f", med[rt.a]/med[rt.b]))
				}
			}
			cells = append(cells, "")
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
		if strings.Contains(rw.name, "latency") || rw.wl == "" {
			continue
		}
		fmt.Fprintln(tw, strings.Join(append(spread, blank...), "\t"))
	}
	tw.Flush()
}

// targets writes the east-west targets: within 5% of direct, ahead of
// nftables. They are judged on the paired figure, the median of the
// per-round ratios: the two measurements of a pair are seconds apart, so
// drift of the machine's speed between rounds cancels out of it, which
// it does not from the ratio of the medians (printed first, and in the
// table).
func (p *perfRun) targets(b *strings.Builder) {
	r := p.rep
	verdict := func(ok bool) string {
		if ok {
			return "met"
		}
		return "MISSED"
	}
	for _, t := range []struct {
		name string
		wl   PerfWorkload
	}{{"connections/s", WorkloadConns}, {"bulk throughput", WorkloadBulk}} {
		v, _, _, ok1 := r.Median(PathVIP, t.wl, PerfSample.Rate)
		d, _, _, ok2 := r.Median(PathDirect, t.wl, PerfSample.Rate)
		n, _, _, ok3 := r.Median(PathNFT, t.wl, PerfSample.Rate)
		if !ok1 || !ok2 || !ok3 || d == 0 || n == 0 {
			continue
		}
		pd, _ := r.PairedRatio(PathVIP, PathDirect, t.wl, PerfSample.Rate)
		pn, _ := r.PairedRatio(PathVIP, PathNFT, t.wl, PerfSample.Rate)
		fmt.Fprintf(b, "target %-16s vip vs direct %+6.1f%% paired (%+6.1f%% medians): within 5%% %-6s  vip vs nft %+6.1f%% paired (%+6.1f%% medians): ahead %s\n",
			t.name+":", (pd-1)*100, (v/d-1)*100, verdict(pd >= 0.95), (pn-1)*100, (v/n-1)*100, verdict(pn > 1))
	}
	// The same targets on the CPU cost.
	for _, t := range []struct {
		name string
		wl   PerfWorkload
	}{{"CPU/connection:", WorkloadConns}, {"CPU/GB:", WorkloadBulk}} {
		v, _, _, ok1 := r.Median(PathVIP, t.wl, PerfSample.CPUPerUnit)
		d, _, _, ok2 := r.Median(PathDirect, t.wl, PerfSample.CPUPerUnit)
		n, _, _, ok3 := r.Median(PathNFT, t.wl, PerfSample.CPUPerUnit)
		if !ok1 || !ok2 || !ok3 || d == 0 || n == 0 {
			continue
		}
		pd, _ := r.PairedRatio(PathVIP, PathDirect, t.wl, PerfSample.CPUPerUnit)
		pn, _ := r.PairedRatio(PathVIP, PathNFT, t.wl, PerfSample.CPUPerUnit)
		fmt.Fprintf(b, "cost   %-16s vip vs direct %+6.1f%% paired (%+6.1f%% medians): within 5%% %-6s  vip vs nft %+6.1f%% paired (%+6.1f%% medians): cheaper %s\n",
			t.name, (pd-1)*100, (v/d-1)*100, verdict(pd <= 1.05), (pn-1)*100, (v/n-1)*100, verdict(pn < 1))
	}
}

// nsComparisons writes the north-south paired ratios (no targets yet):
// XDP against TC, XDP against direct, TC against direct, on the rates and
// on the CPU cost.
func (p *perfRun) nsComparisons(b *strings.Builder) {
	r := p.rep
	pairs := []perfRatio{{"xdp vs tc", PathNSXDP, PathNSTC}, {"xdp vs direct", PathNSXDP, PathNSDirect}, {"tc vs direct", PathNSTC, PathNSDirect}}
	for _, t := range []struct {
		name string
		wl   PerfWorkload
		f    func(PerfSample) float64
	}{
		{"connections/s:", WorkloadConns, PerfSample.Rate},
		{"bulk throughput:", WorkloadBulk, PerfSample.Rate},
		{"CPU/connection:", WorkloadConns, PerfSample.CPUPerUnit},
		{"CPU/GB:", WorkloadBulk, PerfSample.CPUPerUnit},
	} {
		var parts []string
		for _, pr := range pairs {
			pd, ok1 := r.PairedRatio(pr.a, pr.b, t.wl, t.f)
			a, _, _, ok2 := r.Median(pr.a, t.wl, t.f)
			c, _, _, ok3 := r.Median(pr.b, t.wl, t.f)
			if !ok1 || !ok2 || !ok3 || c == 0 {
				continue
			}
			parts = append(parts, fmt.Sprintf("%s %+6.1f%% paired (%+6.1f%% medians)", pr.name, (pd-1)*100, (a/c-1)*100))
		}
		if len(parts) > 0 {
			fmt.Fprintf(b, "ns %-17s %s\n", t.name, strings.Join(parts, "  "))
		}
	}
}

// PairedRatio is the median over the rounds of f(a)/f(b), each ratio
// taken within one round; ok is false without a pair.
func (r *PerfReport) PairedRatio(a, b PerfPath, w PerfWorkload, f func(PerfSample) float64) (ratio float64, ok bool) {
	as, bs := r.samples(a, w), r.samples(b, w)
	var v []float64
	for _, x := range as {
		for _, y := range bs {
			if x.Round == y.Round && f(y) != 0 {
				v = append(v, f(x)/f(y))
			}
		}
	}
	if len(v) == 0 {
		return 0, false
	}
	slices.Sort(v)
	if len(v)%2 == 0 {
		return (v[len(v)/2-1] + v[len(v)/2]) / 2, true
	}
	return v[len(v)/2], true
}

// perfRunConns runs the short-connection workload from workers goroutines
// for d or maxConns connections, whichever ends first.
func perfRunConns(ctx context.Context, dl *perfDialer, src netip.Addr, addr, want string, workers int, d time.Duration, maxConns int) (PerfSample, error) {
	var (
		budget   atomic.Int64
		mu       sync.Mutex
		lat      []time.Duration
		conn     []time.Duration
		s        PerfSample
		fatal    error
		wg       sync.WaitGroup
		firstErr string
	)
	budget.Store(int64(maxConns))
	start := time.Now()
	deadline := start.Add(d)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var my, myConn []time.Duration
			var ok, failed int
			var ferr string
			buf := make([]byte, 256)
			for ctx.Err() == nil && time.Now().Before(deadline) && budget.Add(-1) >= 0 {
				t0 := time.Now()
				dt, err := perfOneConn(ctx, dl, src, addr, want, buf)
				if errors.Is(err, errStrayThread) {
					mu.Lock()
					fatal = err
					mu.Unlock()
					// Returning while locked retires the
					// thread that is in the wrong namespace.
					return
				}
				if err != nil {
					if ctx.Err() != nil {
						break
					}
					failed++
					if ferr == "" {
						ferr = err.Error()
					}
					continue
				}
				ok++
				my = append(my, time.Since(t0))
				myConn = append(myConn, dt)
			}
			mu.Lock()
			lat = append(lat, my...)
			conn = append(conn, myConn...)
			s.OK += ok
			s.Failed += failed
			if firstErr == "" {
				firstErr = ferr
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	s.Elapsed = time.Since(start)
	s.FirstError = firstErr
	if fatal != nil {
		return s, fatal
	}
	if err := ctx.Err(); err != nil {
		return s, err
	}
	if len(lat) > 0 {
		slices.Sort(lat)
		s.P50 = lat[len(lat)/2]
		s.P99 = lat[min(len(lat)-1, len(lat)*99/100)]
		slices.Sort(conn)
		s.ConnectP50 = conn[len(conn)/2]
		s.ConnectP99 = conn[min(len(conn)-1, len(conn)*99/100)]
	}
	return s, nil
}

// perfOneConn is one short connection: connect, read the server's identity
// line (it must be want), write 4 bytes, read them back, close.
func perfOneConn(ctx context.Context, dl *perfDialer, src netip.Addr, addr, want string, buf []byte) (connect time.Duration, err error) {
	t0 := time.Now()
	c, err := dl.dial(ctx, src, addr)
	if err != nil {
		return 0, err
	}
	connect = time.Since(t0)
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(perfOpTimeout)); err != nil {
		return connect, err
	}
	n := 0
	for {
		m, err := c.Read(buf[n:])
		n += m
		if i := bytes.IndexByte(buf[:n], '\n'); i >= 0 {
			if string(buf[:i]) != want || i+1 != n {
				return connect, fmt.Errorf("identity %q, want %q", buf[:n], want+"\n")
			}
			break
		}
		if err != nil {
			return connect, fmt.Errorf("identity: %w", err)
		}
		if n == len(buf) {
			return connect, fmt.Errorf("identity too long: %q", buf[:n])
		}
	}
	ping := []byte("ping")
	if _, err := c.Write(ping); err != nil {
		return connect, err
	}
	if _, err := io.ReadFull(c, buf[:len(ping)]); err != nil {
		return connect, fmt.Errorf("echo: %w", err)
	}
	if !bytes.Equal(buf[:len(ping)], ping) {
		return connect, fmt.Errorf("echo %q, want %q", buf[:len(ping)], ping)
	}
	return connect, nil
}

// perfRunBulk runs streams parallel streams into the sink for d.
func perfRunBulk(ctx context.Context, dl *perfDialer, src netip.Addr, addr string, streams int, d time.Duration) (PerfSample, error) {
	type result struct {
		bytes   int64
		elapsed time.Duration
		err     error
	}
	res := make([]result, streams)
	conns := make([]net.Conn, streams)
	var s PerfSample
	for i := range streams {
		// Dial on a goroutine of its own: a failed return to the
		// home namespace must retire its thread, not ours.
		done := make(chan struct{})
		go func() {
			defer close(done)
			conns[i], res[i].err = dl.dial(ctx, src, addr)
		}()
		<-done
		if errors.Is(res[i].err, errStrayThread) {
			perfCloseAll(conns)
			return s, res[i].err
		}
	}
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	for i := range streams {
		if res[i].err != nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i].bytes, res[i].err = perfStream(ctx, conns[i], deadline)
			res[i].elapsed = time.Since(start)
		}()
	}
	wg.Wait()
	perfCloseAll(conns)
	for _, r := range res {
		if r.err != nil {
			s.Failed++
			if s.FirstError == "" {
				s.FirstError = r.err.Error()
			}
			continue
		}
		s.OK++
		s.Bytes += r.bytes
		s.Elapsed = max(s.Elapsed, r.elapsed)
	}
	return s, ctx.Err()
}

func perfCloseAll(cs []net.Conn) {
	for _, c := range cs {
		if c != nil {
			c.Close()
		}
	}
}

// perfStream writes into a sink connection until deadline, ends its half and
// returns the byte count the sink reports.
func perfStream(ctx context.Context, c net.Conn, deadline time.Time) (int64, error) {
	buf := make([]byte, 256<<10)
	var sent int64
	for ctx.Err() == nil && time.Now().Before(deadline) {
		if err := c.SetWriteDeadline(time.Now().Add(perfOpTimeout)); err != nil {
			return 0, err
		}
		n, err := c.Write(buf)
		sent += int64(n)
		if err != nil {
			return 0, err
		}
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return 0, err
	}
	if err := c.SetReadDeadline(time.Now().Add(perfFinalTimeout)); err != nil {
		return 0, err
	}
	var count [8]byte
	if _, err := io.ReadFull(c, count[:]); err != nil {
		return 0, fmt.Errorf("sink count: %w", err)
	}
	got := int64(binary.BigEndian.Uint64(count[:]))
	if got != sent {
		return got, fmt.Errorf("sink received %d bytes of %d", got, sent)
	}
	return got, nil
}

// perfSink is a TCP listener in a VM that reads each connection to its end
// and then answers with the number of bytes it read (8 bytes, big endian).
type perfSink struct {
	ln    net.Listener
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]bool
}

func startPerfSink(vm *lab.VM, port uint16) (*perfSink, error) {
	s := &perfSink{conns: map[net.Conn]bool{}}
	err := vm.NS.Do(func() (err error) {
		s.ln, err = net.Listen("tcp4", ":"+strconv.Itoa(int(port)))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("sink on %s: %w", vm.Name, err)
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := s.ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns[c] = true
			s.mu.Unlock()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer func() {
					s.mu.Lock()
					delete(s.conns, c)
					s.mu.Unlock()
					c.Close()
				}()
				buf := make([]byte, 256<<10)
				var n int64
				for {
					m, err := c.Read(buf)
					n += int64(m)
					if err == io.EOF {
						break
					}
					if err != nil {
						return
					}
				}
				var count [8]byte
				binary.BigEndian.PutUint64(count[:], uint64(n))
				c.SetWriteDeadline(time.Now().Add(perfOpTimeout))
				c.Write(count[:])
			}()
		}
	}()
	return s, nil
}

// perfAddAddrs adds IPv4 addresses (/24) to the VM's eth0.
func perfAddAddrs(vm *lab.VM, addrs ...netip.Addr) error {
	h, err := netlink.NewHandleAt(vm.NS.Handle())
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", vm.Name, err)
	}
	defer h.Close()
	l, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("%s eth0: %w", vm.Name, err)
	}
	for _, a := range addrs {
		ipn := &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(24, 32)}
		if err := h.AddrAdd(l, &netlink.Addr{IPNet: ipn}); err != nil {
			return fmt.Errorf("add %s to %s: %w", a, vm.Name, err)
		}
	}
	return nil
}

func (s *perfSink) close() {
	s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// errStrayThread means a dialing thread could not return to the home
// namespace; the goroutine that saw it must end so that the runtime
// retires the thread.
var errStrayThread = errors.New("scenario: could not leave the client namespace")

// perfDialer dials TCP connections whose sockets belong to a VM's network
// namespace. A socket belongs to the namespace of the thread that created
// it, so dial enters ns on a locked thread for socket(2) only and leaves
// in the dialer's Control hook, before connect(2) can park the goroutine:
// everything else runs on ordinary goroutines and threads, as a client
// inside the VM would, without a thread handoff per blocking call.
type perfDialer struct {
	ns   *nsutil.NS
	home netns.NsHandle
}

func newPerfDialer(ns *nsutil.NS) (*perfDialer, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	home, err := netns.Get()
	if err != nil {
		return nil, fmt.Errorf("current netns: %w", err)
	}
	return &perfDialer{ns: ns, home: home}, nil
}

func (d *perfDialer) close() {
	if d.ns != nil {
		d.home.Close()
	}
}

// dial connects from src to addr (IPv4 "a.b.c.d:port") in the namespace.
// The port is chosen at connect(2) (IP_BIND_ADDRESS_NO_PORT), as without
// a bind, so ports are shared between destinations. On errStrayThread the
// calling goroutine stays locked to its thread and must end. A dialer
// without ns (a perf worker's, which runs in the client's namespace)
// dials with the same options and switches nothing.
func (d *perfDialer) dial(ctx context.Context, src netip.Addr, addr string) (net.Conn, error) {
	if d.ns == nil {
		return d.dialerFrom(src, func() error { return nil }).DialContext(ctx, "tcp4", addr)
	}
	runtime.LockOSThread()
	if err := netns.Set(d.ns.Handle()); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("enter %s: %w", d.ns.Name, err)
	}
	inside := true
	var leaveErr error
	leave := func() error {
		if inside {
			inside = false
			if leaveErr = netns.Set(d.home); leaveErr == nil {
				runtime.UnlockOSThread()
			}
		}
		return leaveErr
	}
	nd := d.dialerFrom(src, leave)
	c, err := nd.DialContext(ctx, "tcp4", addr)
	if lerr := leave(); lerr != nil {
		if c != nil {
			c.Close()
		}
		return nil, fmt.Errorf("%w: %v", errStrayThread, lerr)
	}
	return c, err
}

// dialerFrom is the net.Dialer of dial: from src, its port chosen at
// connect(2), leave called after socket(2), before bind(2) and connect(2).
func (d *perfDialer) dialerFrom(src netip.Addr, leave func() error) *net.Dialer {
	return &net.Dialer{
		Timeout:   perfOpTimeout,
		KeepAlive: -1,
		LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0)),
		ControlContext: func(_ context.Context, _, _ string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_BIND_ADDRESS_NO_PORT, 1)
			}); err != nil {
				serr = err
			}
			return errors.Join(leave(), serr)
		},
	}
}

// checkSums are the counts of a check burst on one path, both workloads.
type checkSums struct {
	flows, ok, xdp, passEgress uint64
}

// checkBurst runs a short burst of both workloads on path, prints them
// and sums what the checks read; a workload that moved nothing fails.
func (p *perfRun) checkBurst(ctx context.Context, path PerfPath, burst time.Duration, burstConns int) (checkSums, error) {
	var b checkSums
	for _, wl := range []PerfWorkload{WorkloadConns, WorkloadBulk} {
		s, err := p.measure(ctx, 0, path, wl, burst, burstConns, false)
		if err != nil {
			return b, err
		}
		p.printSample(s)
		if s.OK == 0 {
			return b, fmt.Errorf("check: %s on %s moved no traffic (%s)", wl, path, s.FirstError)
		}
		b.flows += s.DatapathFlows
		b.ok += uint64(s.OK)
		b.xdp += s.XDPTranslated
		b.passEgress += s.XDPPassEgress
	}
	return b, nil
}
