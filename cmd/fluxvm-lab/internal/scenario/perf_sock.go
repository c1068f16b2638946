//go:build linux

package scenario

// The socket-LB path of Perf (issue 18): a node-local process in a cgroup
// with the socket hooks (cgroup connect4/6, sendmsg, recvmsg,
// getpeername) connects to the VIP, and the connect hook addresses its
// socket to the backend: the packets carry the backend's address from the
// first SYN, so neither the TC programs nor netfilter translate anything.
//
// The hooks apply to processes by cgroup, whatever their network
// namespace, so the client runs in the same client namespace (vm1) as the
// direct and vip paths: the three differ only in who translates. A cgroup
// holds processes, not goroutines, so the client of sock-lb is a process
// of its own: the lab binary re-executed as a worker (PerfWorkerEnv) and
// born into a cgroup the lab creates under the cgroup v2 root
// (CLONE_INTO_CGROUP), alone in it. That cgroup is the dataplane's
// cgroup_path. So that the paths also differ in nothing else, every
// east-west client of such a run is a worker process: the other paths'
// one is born into a sibling cgroup without hooks. Both run the same
// workload code as the in-process clients (perfRunConns, perfRunBulk) on
// requests of the lab process; the lab reads the counters and the CPU
// accounting around each request as for any other measurement (the
// workers' CPU time is the measurement's, not other processes').

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/cgroup2"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
)

// PathSockLB is the client VM's namespace to VIP4 from a process in a
// cgroup with the socket hooks attached: the connect hook addresses the
// socket to the backend (datapath counter sock_rewritten), and the
// packets pass the TC programs and the node untranslated.
const PathSockLB PerfPath = "sock-lb"

// PathSockDirect is a diagnostic path: the backend's own address, as
// PathDirect, from sock-lb's worker in the hooked cgroup. The hooks run
// (connect4 finds no service and returns, getpeername4 no reverse entry,
// the release nothing) but rewrite nothing: against PathDirect it costs
// having the hooks (and the hooked worker), and PathSockLB against it
// costs the rewrite.
const PathSockDirect PerfPath = "sock-direct"

// SocketPaths is the group "socket": socket LB against the TC path and
// direct, side by side.
var SocketPaths = []PerfPath{PathDirect, PathVIP, PathSockLB}

// SocketDiagPaths is the group "socket-diag": the socket group and
// PathSockDirect, which splits sock-lb's cost against direct into that of
// the hooks and that of the rewrite.
var SocketDiagPaths = []PerfPath{PathDirect, PathVIP, PathSockDirect, PathSockLB}

// allPerfPaths are all paths in table order.
func allPerfPaths() []PerfPath {
	return slices.Concat([]PerfPath{PathBare, PathNoop}, EastWestPaths[1:], []PerfPath{PathSockDirect, PathSockLB}, NorthSouthPaths)
}

// sockPath reports whether a path's client is the worker in the hooked
// cgroup.
func (p PerfPath) sockPath() bool { return p == PathSockLB || p == PathSockDirect }

// diagnostic reports whether a path is only measured when named (or by
// its group), not by "all": PathSockDirect and PathNoop.
func (p PerfPath) diagnostic() bool { return p == PathSockDirect || p == PathNoop }

// perfSourceSock is sock-lb's client address on vm1's eth0, and
// perfSourceSockDirect sock-direct's.
var (
	perfSourceSock       = netip.MustParseAddr("10.200.1.6")
	perfSourceSockDirect = netip.MustParseAddr("10.200.1.7")
)

// The datapath counters of socket LB.
const (
	cntSockRewritten = "sock_rewritten"
	cntSockFailOpen  = "sock_fail_open_"
)

// PerfWorkerEnv set to 1 makes the lab binary (or a test binary of this
// package) a perf worker: RunPerfWorkerIfAsked then serves requests on
// stdin and never returns.
const PerfWorkerEnv = "FLUXVM_LAB_PERF_WORKER"

// perfWorkerRequest is one measurement a worker runs.
type perfWorkerRequest struct {
	Workload PerfWorkload
	Source   netip.Addr
	Target   string
	Want     string
	Workers  int
	Streams  int
	Duration time.Duration
	MaxConns int
}

// perfWorkerReply is a worker's answer: the first line after its start
// (Hello), then one per request (Sample or Error).
type perfWorkerReply struct {
	Hello  *perfWorkerHello `json:",omitempty"`
	Sample *PerfSample      `json:",omitempty"`
	Error  string           `json:",omitempty"`
}

// perfWorkerHello is where a worker runs, from its own view.
type perfWorkerHello struct {
	PID    int
	Cgroup string // the cgroup v2 line of /proc/self/cgroup
	NetNS  string // readlink /proc/self/ns/net
}

// RunPerfWorkerIfAsked runs the perf worker and exits when PerfWorkerEnv
// is 1; otherwise it returns at once. Call it first in main (and in
// TestMain of a test binary that runs Perf).
func RunPerfWorkerIfAsked() {
	if os.Getenv(PerfWorkerEnv) != "1" {
		return
	}
	if err := perfWorker(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "fluxvm-lab perf worker:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// perfWorker serves requests until in ends (the lab process closed it, or
// died). It runs in the client namespace as a whole (started from a
// thread in it), so it dials without switching namespaces.
func perfWorker(in io.Reader, out io.Writer) error {
	signal.Ignore(syscall.SIGINT) // the lab process ends it: stdin closes, or SIGKILL
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	enc := json.NewEncoder(out)
	cg, _ := os.ReadFile("/proc/self/cgroup")
	var line string
	for _, l := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
		if strings.HasPrefix(l, "0::") {
			line = l
		}
	}
	netNS, _ := os.Readlink("/proc/self/ns/net")
	if err := enc.Encode(perfWorkerReply{Hello: &perfWorkerHello{PID: os.Getpid(), Cgroup: line, NetNS: netNS}}); err != nil {
		return err
	}
	dl := &perfDialer{} // no namespace switch: the process is in the client's
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		var rq perfWorkerRequest
		if err := json.Unmarshal(sc.Bytes(), &rq); err != nil {
			return fmt.Errorf("request: %w", err)
		}
		var s PerfSample
		var err error
		if rq.Workload == WorkloadConns {
			s, err = perfRunConns(ctx, dl, rq.Source, rq.Target, rq.Want, rq.Workers, rq.Duration, rq.MaxConns)
		} else {
			s, err = perfRunBulk(ctx, dl, rq.Source, rq.Target, rq.Streams, rq.Duration)
		}
		r := perfWorkerReply{Sample: &s}
		if err != nil {
			r.Error = err.Error()
		}
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return sc.Err()
}

// perfWorkerProc is a running worker, seen from the lab process.
type perfWorkerProc struct {
	name   string
	dir    string // its cgroup, where it is alone
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Scanner
	stderr strings.Builder
	hello  perfWorkerHello
	done   chan struct{} // closed when the process has been waited for
}

// startPerfWorker starts the lab binary as a worker, born into the cgroup
// dir and, by being forked from a thread in it, into the network
// namespace ns.
func startPerfWorker(name, dir string, ns *nsutil.NS) (*perfWorkerProc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cgfd, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer cgfd.Close()
	w := &perfWorkerProc{name: name, dir: dir, done: make(chan struct{})}
	w.cmd = exec.Command(exe)
	w.cmd.Env = append(os.Environ(), PerfWorkerEnv+"=1")
	w.cmd.Stderr = &w.stderr
	w.cmd.SysProcAttr = &syscall.SysProcAttr{
		UseCgroupFD: true, CgroupFD: int(cgfd.Fd()), // CLONE_INTO_CGROUP: never in our cgroup
		Setpgid:   true,            // Ctrl-C reaches the lab, which ends the worker
		Pdeathsig: syscall.SIGKILL, // and it dies with the lab; its stdin closes then too
	}
	if w.in, err = w.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	stdout, err := w.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	w.out = bufio.NewScanner(stdout)
	w.out.Buffer(make([]byte, 64<<10), 1<<20)
	if err := ns.Do(w.cmd.Start); err != nil {
		return nil, fmt.Errorf("start perf worker %s: %w", name, err)
	}
	go func() { w.cmd.Wait(); close(w.done) }()
	var r perfWorkerReply
	if err := w.read(context.Background(), 30*time.Second, &r); err != nil {
		w.kill()
		return nil, err
	}
	if r.Hello == nil {
		w.kill()
		return nil, fmt.Errorf("perf worker %s: no hello", name)
	}
	w.hello = *r.Hello
	return w, nil
}

// read reads the next reply within timeout.
func (w *perfWorkerProc) read(ctx context.Context, timeout time.Duration, r *perfWorkerReply) error {
	errc := make(chan error, 1)
	go func() {
		if !w.out.Scan() {
			errc <- errors.Join(errors.New("worker ended"), w.out.Err())
			return
		}
		errc <- json.Unmarshal(w.out.Bytes(), r)
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case err := <-errc:
		if err != nil {
			w.kill()
			return fmt.Errorf("perf worker %s (pid %d): %w; stderr: %q", w.name, w.cmd.Process.Pid, err, w.tail())
		}
		return nil
	case <-ctx.Done():
		w.kill()
		return ctx.Err()
	case <-t.C:
		w.kill()
		return fmt.Errorf("perf worker %s (pid %d): no answer in %s", w.name, w.cmd.Process.Pid, timeout)
	}
}

func (w *perfWorkerProc) tail() string {
	select {
	case <-w.done:
		s := w.stderr.String()
		return s[max(0, len(s)-400):]
	default:
		return ""
	}
}

// run has the worker run one measurement.
func (w *perfWorkerProc) run(ctx context.Context, rq perfWorkerRequest) (PerfSample, error) {
	b, err := json.Marshal(rq)
	if err != nil {
		return PerfSample{}, err
	}
	if _, err := w.in.Write(append(b, '\n')); err != nil {
		w.kill()
		return PerfSample{}, fmt.Errorf("perf worker %s: %w", w.name, err)
	}
	var r perfWorkerReply
	// Connections take perfOpTimeout at most each, streams their
	// final answer on top.
	if err := w.read(ctx, rq.Duration+2*perfOpTimeout+perfFinalTimeout+10*time.Second, &r); err != nil {
		return PerfSample{}, err
	}
	if r.Sample == nil {
		return PerfSample{}, fmt.Errorf("perf worker %s: no sample (%s)", w.name, r.Error)
	}
	if r.Error != "" {
		return *r.Sample, fmt.Errorf("perf worker %s: %s", w.name, r.Error)
	}
	return *r.Sample, nil
}

// kill ends the worker and waits for it (5 s at most).
func (w *perfWorkerProc) kill() {
	select {
	case <-w.done:
		return
	default:
	}
	w.in.Close()
	w.cmd.Process.Kill()
	select {
	case <-w.done:
	case <-time.After(5 * time.Second):
	}
}

// close ends the worker gently: stdin closes, it exits; killed after 2 s.
func (w *perfWorkerProc) close() {
	w.in.Close()
	select {
	case <-w.done:
	case <-time.After(2 * time.Second):
		w.kill()
	}
}

// perfSock is the socket-LB part of a perfRun: the cgroups and the
// workers. Without PathSockLB there is none and every client runs in the
// lab process.
type perfSock struct {
	dir    string // fluxvm-lab-perf-<suffix> under the cgroup v2 root
	hooked string // dir/sock-lb: the dataplane's cgroup_path
	plain  string // dir/plain: no hooks
	sock   *perfWorkerProc
	other  *perfWorkerProc
}

// newPerfSock creates the cgroups; the workers start once the lab exists.
func newPerfSock() (*perfSock, error) {
	root, err := cgroup2.Root()
	if err != nil {
		return nil, fmt.Errorf("sock-lb: %w", err)
	}
	s := &perfSock{dir: filepath.Join(root, "fluxvm-lab-perf-"+nsutil.Suffix())}
	s.hooked = filepath.Join(s.dir, "sock-lb")
	s.plain = filepath.Join(s.dir, "plain")
	if err := os.Mkdir(s.dir, 0o755); err != nil {
		return nil, fmt.Errorf("sock-lb: create cgroup: %w", err)
	}
	for _, d := range []string{s.hooked, s.plain} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return nil, errors.Join(fmt.Errorf("sock-lb: create cgroup: %w", err), s.remove())
		}
	}
	if err := cgroup2.Check(s.hooked); err != nil {
		return nil, errors.Join(err, s.remove())
	}
	return s, nil
}

// configure is the dataplane's socket LB setting: hooks on s.hooked only.
func (s *perfSock) configure(c *fluxvm.Config) {
	c.CgroupConnect = true
	c.CgroupPath = s.hooked
}

// stopWorkers ends both workers.
func (s *perfSock) stopWorkers() {
	for _, w := range []*perfWorkerProc{s.sock, s.other} {
		if w != nil {
			w.close()
		}
	}
}

// remove ends whatever still runs in the cgroups and removes them, bottom
// up. Idempotent.
func (s *perfSock) remove() error {
	s.stopWorkers()
	if _, err := os.Stat(s.dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	var errs []error
	for _, d := range []string{s.hooked, s.plain, s.dir} {
		if _, err := os.Stat(d); errors.Is(err, fs.ErrNotExist) {
			continue
		}
		_ = os.WriteFile(filepath.Join(d, "cgroup.kill"), []byte("1"), 0)
		var err error
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if err = os.Remove(d); err == nil || errors.Is(err, fs.ErrNotExist) || time.Now().After(deadline) {
				break
			}
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// cgroupProcs lists the pids in a cgroup directory itself.
func cgroupProcs(dir string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		pid, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("%s/cgroup.procs: %q", dir, f)
		}
		pids = append(pids, pid)
	}
	return pids, nil
}

// setupSock starts the two workers in vm1's namespace and checks where
// they run and where the hooks are.
func (p *perfRun) setupSock() error {
	s := p.sock
	st := p.env.DP.Status().SocketLB
	if !st.Enabled || st.CgroupPath != s.hooked || !slices.Contains(st.Hooks, "connect4") {
		return fmt.Errorf("sock-lb: socket hooks: status %+v, want connect4 on %s", st, s.hooked)
	}
	var err error
	if s.sock, err = startPerfWorker("sock-lb", s.hooked, p.env.Client.NS); err != nil {
		return err
	}
	if s.other, err = startPerfWorker("plain", s.plain, p.env.Client.NS); err != nil {
		return err
	}
	p.rep.SockCgroup, p.rep.WorkerPIDs = s.hooked, p.workerPIDs()
	root, err := cgroup2.Root()
	if err != nil {
		return err
	}
	var clientNS string
	if err := p.env.Client.NS.Do(func() (err error) { clientNS, err = os.Readlink("/proc/thread-self/ns/net"); return err }); err != nil {
		return err
	}
	for _, w := range []*perfWorkerProc{s.sock, s.other} {
		dir := filepath.Join(root, strings.TrimPrefix(w.hello.Cgroup, "0::"))
		want := s.hooked
		if w == s.other {
			want = s.plain
		}
		if dir != want || w.hello.NetNS != clientNS {
			return fmt.Errorf("perf worker %s runs in cgroup %s, netns %s; want %s, %s", w.name, dir, w.hello.NetNS, want, clientNS)
		}
		pids, err := cgroupProcs(want)
		if err != nil {
			return err
		}
		if len(pids) != 1 || pids[0] != w.hello.PID {
			return fmt.Errorf("cgroup %s holds %v, want the worker %d alone", want, pids, w.hello.PID)
		}
	}
	return nil
}

// workerFor is the worker that runs a path's client: the hooked one for
// sock-lb and sock-direct, the plain one for the other east-west paths;
// nil (in the lab process) without them, and for the north-south paths.
func (p *perfRun) workerFor(path PerfPath) *perfWorkerProc {
	switch {
	case p.sock == nil || path.northSouth():
		return nil
	case path.sockPath():
		return p.sock.sock
	}
	return p.sock.other
}

// workerPIDs are the workers' pids: the CPU accounting counts them as the
// measurement's, not as other processes'.
func (p *perfRun) workerPIDs() []int {
	if p.sock == nil {
		return nil
	}
	var pids []int
	for _, w := range []*perfWorkerProc{p.sock.sock, p.sock.other} {
		if w != nil {
			pids = append(pids, w.cmd.Process.Pid)
		}
	}
	return pids
}

// sockHeader says how the socket-LB run is made.
func (p *perfRun) sockHeader() {
	s := p.sock
	st := p.env.DP.Status().SocketLB
	p.printf("socket LB: hooks %s attached (cgroup_connect, pinned links) to cgroup %s (id %d), created by the lab under the cgroup v2 root\n",
		strings.Join(st.Hooks, ","), s.hooked, st.CgroupID)
	p.printf("  every east-west client of this run is a worker process (fluxvm-lab re-executed, %s=1) in vm1's network namespace, running the same workload code on the lab's requests:\n", PerfWorkerEnv)
	hooked := "sock-lb"
	if slices.Contains(p.rep.Paths, PathSockDirect) {
		hooked = "sock-lb and sock-direct"
	}
	p.printf("  %s from pid %d, born into %s (CLONE_INTO_CGROUP) and alone in it; the other paths from pid %d, alone in the sibling %s without hooks\n",
		hooked, s.sock.hello.PID, s.hooked, s.other.hello.PID, s.plain)
	p.printf("  the lab process keeps the servers and reads counters and CPU around each request; the workers' CPU counts as the measurement's\n")
	if p.o.BPFStats {
		p.printf("  the BPF rows count the socket hooks on %s besides the TC programs (sock-lb and sock-direct run connect4, getpeername4 and sock_release per connection)\n", s.hooked)
	}
}

// checkSockSample fails a measurement that the socket hooks translated
// when they should not have, or did not translate alone when they should.
func checkSockSample(s PerfSample) error {
	ok := uint64(s.OK)
	stray := strayFlows(ok)
	if s.Path == PathSockLB {
		if s.SockRewritten < ok || s.DatapathFlows > stray || s.NFTConns > stray {
			return fmt.Errorf("%s on %s: %d connections, but sock_rewritten +%d (want at least one per connection), datapath new flows %d and nftables %d (want 0: the packets carry the backend's address)",
				s.Workload, s.Path, s.OK, s.SockRewritten, s.DatapathFlows, s.NFTConns)
		}
		return nil
	}
	if s.Path == PathSockDirect {
		if s.SockRewritten != 0 || s.DatapathFlows > stray || s.NFTConns > stray {
			return fmt.Errorf("%s on %s: sock_rewritten +%d, datapath new flows %d, nftables %d; want 0 each (flows: at most %d late ones of other paths): the backend's own address is no service, the hooks run but rewrite nothing",
				s.Workload, s.Path, s.SockRewritten, s.DatapathFlows, s.NFTConns, stray)
		}
		return nil
	}
	if s.SockRewritten != 0 {
		return fmt.Errorf("%s on %s: sock_rewritten +%d, want 0: its client is not in the hooked cgroup", s.Workload, s.Path, s.SockRewritten)
	}
	return nil
}

// sockTargets writes the socket-LB targets: connections/s within 2% of
// direct and ahead of the TC path (vip), judged on the paired ratios' 95%
// CI (PerfGoal.Judge); bulk and the CPU costs are compared without a
// target (Issue36Goals has more).
func (p *perfRun) sockTargets(b *strings.Builder) {
	r := p.rep
	pm := perfMetricOf(MetricConns)
	cd, ok1 := r.pairedCell("vs direct", PathSockLB, PathDirect, pm.wl, pm.f, "within 2%", PerfGoal{PathSockLB, PathDirect, MetricConns, true, 0.98})
	cv, ok2 := r.pairedCell("vs vip", PathSockLB, PathVIP, pm.wl, pm.f, "ahead", PerfGoal{PathSockLB, PathVIP, MetricConns, true, 1})
	if ok1 && ok2 {
		fmt.Fprintf(b, "target sock-lb connections/s:     %s  %s\n", cd, cv)
	}
	for _, t := range []struct {
		name string
		m    PerfMetric
	}{
		{"compare sock-lb bulk throughput:", MetricBulk},
		{"cost    sock-lb CPU/connection: ", MetricConnCPU},
		{"cost    sock-lb CPU/GB:         ", MetricBulkCPU},
	} {
		pm := perfMetricOf(t.m)
		cd, ok1 := r.pairedCell("vs direct", PathSockLB, PathDirect, pm.wl, pm.f, "", PerfGoal{})
		cv, ok2 := r.pairedCell("vs vip", PathSockLB, PathVIP, pm.wl, pm.f, "", PerfGoal{})
		if ok1 && ok2 {
			fmt.Fprintf(b, "%s %s  %s\n", t.name, cd, cv)
		}
	}
	if slices.Contains(r.Paths, PathSockDirect) {
		defer p.sockDiag(b)
	}
	if !slices.Contains(r.Paths, PathSockLB) {
		return
	}
	// What the hooks did, over the rounds.
	var rew, conns, failOpen uint64
	for _, s := range r.Samples {
		if s.Round > 0 && s.Path == PathSockLB {
			rew += s.SockRewritten
			conns += uint64(s.OK)
			failOpen += s.SockFailOpen
		}
	}
	fmt.Fprintf(b, "sock-lb over all rounds: %d connections, sock_rewritten +%d, sock_fail_open_* +%d, datapath new flows 0 (checked per measurement)\n", conns, rew, failOpen)
}

// sockDiag writes the split of sock-lb's cost against direct: sock-direct
// against direct is the cost of the hooks (and of the hooked worker),
// sock-lb against sock-direct that of the rewrite. No targets.
func (p *perfRun) sockDiag(b *strings.Builder) {
	r := p.rep
	p.comparisons(b, "diag", []perfRatio{
		{"hooks (sock-direct vs direct)", PathSockDirect, PathDirect},
		{"rewrite (sock-lb vs sock-direct)", PathSockLB, PathSockDirect},
	})
	var rew, conns, failOpen uint64
	for _, s := range r.Samples {
		if s.Round > 0 && s.Path == PathSockDirect {
			rew += s.SockRewritten
			conns += uint64(s.OK)
			failOpen += s.SockFailOpen
		}
	}
	fmt.Fprintf(b, "sock-direct over all rounds: %d connections, sock_rewritten +%d, sock_fail_open_* +%d, datapath new flows 0 (checked per measurement)\n", conns, rew, failOpen)
}

// sockProgs opens the socket hooks attached to the hooked cgroup, for the
// BPF run-time statistics: with them, a path's BPF time covers the hooks
// its connections ran (sock-lb and sock-direct: connect4, getpeername4,
// which Go's dial calls, and sock_release for every socket that closes;
// the others: none) besides the TC programs.
func (s *perfSock) sockProgs() ([]*ebpf.Program, error) {
	f, err := os.Open(s.hooked)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var progs []*ebpf.Program
	for _, at := range []ebpf.AttachType{
		ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect,
		ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupUDP6Sendmsg,
		ebpf.AttachCGroupUDP4Recvmsg, ebpf.AttachCGroupUDP6Recvmsg,
		ebpf.AttachCgroupInet4GetPeername, ebpf.AttachCgroupInet6GetPeername,
		ebpf.AttachCgroupInetSockRelease,
	} {
		q, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: at})
		if err != nil {
			return progs, fmt.Errorf("BPF statistics: query %s on %s: %w", at, s.hooked, err)
		}
		for _, ap := range q.Programs {
			pr, err := ebpf.NewProgramFromID(ap.ID)
			if err != nil {
				return progs, err
			}
			progs = append(progs, pr)
		}
	}
	if len(progs) == 0 {
		return nil, fmt.Errorf("BPF statistics: no socket hook on %s", s.hooked)
	}
	return progs, nil
}
