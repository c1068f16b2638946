//go:build linux

package scenario

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/cgroup2"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestMain lets this test binary serve as Perf's worker process (the
// sock-lb client runs in a cgroup of its own, as a re-executed binary).
func TestMain(m *testing.M) {
	RunPerfWorkerIfAsked()
	os.Exit(m.Run())
}

// TestPerfSmoke runs the whole of `fluxvm-lab perf` with tiny bounds: the
// checks must pass, every path must move traffic in both workloads through
// what it claims to measure, and the table must have every row. It says
// nothing about speed.
func TestPerfSmoke(t *testing.T) {
	testenv.RequirePrivileged(t)
	if _, err := NFTPath(); err != nil {
		if testenv.Required() {
			t.Fatalf("%v (%s=1 is set, so this fails instead of skipping)", err, testenv.RequireEnv)
		}
		t.Skipf("skipping: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	o := DefaultPerfOptions()
	o.Rounds = 1
	o.Duration = 200 * time.Millisecond
	o.Workers = 2
	o.MaxConns = 2000
	o.MaxOthers = 0 // one round, however busy the machine
	var out bytes.Buffer
	rep, err := Perf(ctx, &out, o)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}

	if len(rep.Checks) != 4 {
		t.Errorf("%d checks, want 4", len(rep.Checks))
	}
	for _, c := range rep.Checks {
		if !c.OK {
			t.Errorf("check failed: %s: %s", c.Name, c.Detail)
		}
	}
	want := []PerfPath{PathBare, PathDirect, PathVIP, PathNFT}
	if strings.Join(pathNames(rep.Paths), ",") != strings.Join(pathNames(want), ",") {
		t.Errorf("paths %v, want %v", rep.Paths, want)
	}
	for _, p := range want {
		for _, wl := range []PerfWorkload{WorkloadConns, WorkloadBulk} {
			ss := rep.samples(p, wl)
			if len(ss) != 1 {
				t.Errorf("%s on %s: %d samples, want 1", wl, p, len(ss))
				continue
			}
			s := ss[0]
			if s.OK == 0 || s.Rate() <= 0 {
				t.Errorf("%s on %s moved no traffic: %+v", wl, p, s)
			}
			if wl == WorkloadBulk && s.Bytes == 0 {
				t.Errorf("bulk on %s: no bytes", p)
			}
			switch p {
			case PathVIP:
				if s.DatapathFlows < uint64(s.OK) || s.NFTConns != 0 {
					t.Errorf("%s on vip: %d ok, datapath flows %d, nft %d", wl, s.OK, s.DatapathFlows, s.NFTConns)
				}
			case PathNFT:
				if s.NFTConns < uint64(s.OK) || s.DatapathFlows != 0 {
					t.Errorf("%s on nft: %d ok, nft %d, datapath flows %d", wl, s.OK, s.NFTConns, s.DatapathFlows)
				}
			default:
				if s.DatapathFlows != 0 || s.NFTConns != 0 {
					t.Errorf("%s on %s was translated: %+v", wl, p, s)
				}
			}
		}
	}
	for _, row := range []string{"connections/s", "conn latency p50 µs", "conn latency p99 µs", "conn CPU µs/conn", "bulk Gbit/s", "bulk CPU ms/GB", "vip/direct", "vip/nft",
		"target connections/s:", "target bulk throughput:", "cost   CPU/connection:", "cost   CPU/GB:"} {
		if !strings.Contains(rep.Table, row) {
			t.Errorf("table has no %q:\n%s", row, rep.Table)
		}
	}
	if !strings.Contains(out.String(), rep.Table) {
		t.Errorf("the table was not printed")
	}
}

// TestPerfNorthSouth runs the north-south paths of `fluxvm-lab perf`
// alone with tiny bounds: the checks must pass, every path must move
// traffic in both workloads, xdp_translated must rise on ns-xdp (at
// least once per connection) and stay put on ns-tc and ns-direct, and
// the north-south table must have its rows and ratios. It says nothing
// about speed.
func TestPerfNorthSouth(t *testing.T) {
	testenv.RequirePrivileged(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	o := DefaultPerfOptions()
	o.Paths = NorthSouthPaths
	o.Rounds = 1
	o.Duration = 200 * time.Millisecond
	o.Workers = 2
	o.MaxConns = 2000
	o.MaxOthers = 0
	o.BPFStats = true
	var out bytes.Buffer
	rep, err := Perf(ctx, &out, o)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(pathNames(rep.Paths), ",") != "ns-direct,ns-tc,ns-xdp" {
		t.Errorf("paths %v, want the north-south ones", rep.Paths)
	}
	if len(rep.Checks) != 3 {
		t.Errorf("%d checks, want 3", len(rep.Checks))
	}
	for _, c := range rep.Checks {
		if !c.OK {
			t.Errorf("check failed: %s: %s", c.Name, c.Detail)
		}
	}
	for _, p := range NorthSouthPaths {
		for _, wl := range []PerfWorkload{WorkloadConns, WorkloadBulk} {
			ss := rep.samples(p, wl)
			if len(ss) != 1 {
				t.Errorf("%s on %s: %d samples, want 1", wl, p, len(ss))
				continue
			}
			s := ss[0]
			if s.OK == 0 || s.Rate() <= 0 || s.Failed != 0 {
				t.Errorf("%s on %s: %d ok, %d failed (%s), rate %v", wl, p, s.OK, s.Failed, s.FirstError, s.Rate())
			}
			if wl == WorkloadBulk && s.Bytes == 0 {
				t.Errorf("bulk on %s: no bytes", p)
			}
			if s.NFTConns != 0 || s.SNATFailed != 0 {
				t.Errorf("%s on %s: nftables counted %d, snat_failed +%d", wl, p, s.NFTConns, s.SNATFailed)
			}
			// Issue 36: the programs of ours on the uplink (XDP too,
			// after each reopen) ran at least once per connection; the
			// client runs in the lab process.
			if s.BPF <= 0 || s.BPFRuns < uint64(s.OK) || s.ClientWorker || s.Lab <= 0 {
				t.Errorf("%s on %s: BPF %s in %d runs (%d ok), client worker %v, lab CPU %s", wl, p, s.BPF, s.BPFRuns, s.OK, s.ClientWorker, s.Lab)
			}
			switch p {
			case PathNSXDP:
				if s.XDPTranslated < uint64(s.OK) || s.DatapathFlows < uint64(s.OK) {
					t.Errorf("%s on ns-xdp: %d ok, xdp_translated +%d, datapath flows %d", wl, s.OK, s.XDPTranslated, s.DatapathFlows)
				}
				if s.XDPPassEgress != 0 {
					t.Errorf("%s on ns-xdp: xdp_pass_egress +%d: vm3's edge was not an XDP egress", wl, s.XDPPassEgress)
				}
			case PathNSTC:
				if s.XDPTranslated != 0 || s.XDPPassed != 0 || s.DatapathFlows < uint64(s.OK) {
					t.Errorf("%s on ns-tc: %d ok, xdp_translated +%d, xdp_pass_* +%d, datapath flows %d", wl, s.OK, s.XDPTranslated, s.XDPPassed, s.DatapathFlows)
				}
			case PathNSDirect:
				if s.XDPTranslated != 0 || s.DatapathFlows != 0 {
					t.Errorf("%s on ns-direct was translated: xdp_translated +%d, datapath flows %d", wl, s.XDPTranslated, s.DatapathFlows)
				}
			}
		}
	}
	for _, row := range []string{"north-south (", "ns-direct", "xdp/tc", "xdp/direct", "tc/direct", "connections/s", "bulk Gbit/s",
		"ns connections/s:", "ns bulk throughput:", "xdp_translated per measurement", "xdp_mode switched", "GC run before each north-south measurement"} {
		if !strings.Contains(rep.Table, row) {
			t.Errorf("table has no %q:\n%s", row, rep.Table)
		}
	}
	if strings.Contains(rep.Table, "vip/nft") {
		t.Errorf("the east-west table was printed without east-west paths:\n%s", rep.Table)
	}
	if !strings.Contains(out.String(), "xdp_mode native: dataplane reopened") || !strings.Contains(out.String(), "xdp_mode off: dataplane reopened") {
		t.Errorf("the output does not say that xdp_mode was switched both ways")
	}
}

// TestCheckNSSample: the per-measurement check fails a run whose XDP
// counter contradicts the path.
func TestCheckNSSample(t *testing.T) {
	for _, c := range []struct {
		name string
		s    PerfSample
		ok   bool
	}{
		{"xdp conns", PerfSample{Path: PathNSXDP, Workload: WorkloadConns, OK: 100, DatapathFlows: 100, XDPTranslated: 600}, true},
		{"xdp conns, XDP idle", PerfSample{Path: PathNSXDP, Workload: WorkloadConns, OK: 100, DatapathFlows: 100}, false},
		{"xdp conns, XDP for some", PerfSample{Path: PathNSXDP, Workload: WorkloadConns, OK: 100, DatapathFlows: 100, XDPTranslated: 99}, false},
		{"xdp conns, untranslated", PerfSample{Path: PathNSXDP, Workload: WorkloadConns, OK: 100, XDPTranslated: 600}, false},
		{"xdp bulk", PerfSample{Path: PathNSXDP, Workload: WorkloadBulk, OK: 2, DatapathFlows: 2, Bytes: 100 << 20, XDPTranslated: 70000}, true},
		{"xdp bulk, XDP for the start only", PerfSample{Path: PathNSXDP, Workload: WorkloadBulk, OK: 2, DatapathFlows: 2, Bytes: 100 << 20, XDPTranslated: 10}, false},
		{"tc", PerfSample{Path: PathNSTC, Workload: WorkloadConns, OK: 100, DatapathFlows: 100}, true},
		{"tc, XDP moved", PerfSample{Path: PathNSTC, Workload: WorkloadBulk, OK: 2, DatapathFlows: 2, Bytes: 1 << 20, XDPTranslated: 1}, false},
		{"tc, untranslated", PerfSample{Path: PathNSTC, Workload: WorkloadConns, OK: 100, DatapathFlows: 10}, false},
		{"ns direct, XDP moved", PerfSample{Path: PathNSDirect, Workload: WorkloadConns, OK: 100, XDPTranslated: 5}, false},
		{"east-west vip, XDP moved", PerfSample{Path: PathVIP, Workload: WorkloadConns, OK: 100, DatapathFlows: 100, XDPTranslated: 5}, false},
		{"east-west vip", PerfSample{Path: PathVIP, Workload: WorkloadConns, OK: 100, DatapathFlows: 100}, true},
	} {
		err := checkNSSample(c.s)
		if (err == nil) != c.ok {
			t.Errorf("%s: error %v, want ok %v", c.name, err, c.ok)
		}
	}
}

func TestParsePerfPaths(t *testing.T) {
	for in, want := range map[string]string{
		"east-west":         "bare,direct,vip,nft",
		"ew":                "bare,direct,vip,nft",
		"ns":                "ns-direct,ns-tc,ns-xdp",
		"north-south":       "ns-direct,ns-tc,ns-xdp",
		"all":               "bare,direct,vip,nft,sock-lb,ns-direct,ns-tc,ns-xdp",
		"socket":            "direct,vip,sock-lb",
		"socket-diag":       "direct,vip,sock-direct,sock-lb",
		"sock-direct,all":   "bare,direct,vip,nft,sock-direct,sock-lb,ns-direct,ns-tc,ns-xdp",
		"sock-direct":       "sock-direct",
		"sock,nft":          "direct,vip,nft,sock-lb",
		"sock-lb":           "sock-lb",
		"ns-xdp, direct,ns": "direct,ns-direct,ns-tc,ns-xdp",
		"vip,vip":           "vip",
		"attach-diag":       "bare,noop,direct",
		"noop,all":          "bare,noop,direct,vip,nft,sock-lb,ns-direct,ns-tc,ns-xdp",
	} {
		got, err := ParsePerfPaths(in)
		if err != nil || strings.Join(pathNames(got), ",") != want {
			t.Errorf("ParsePerfPaths(%q) = %v, %v; want %s", in, got, err, want)
		}
	}
	for _, in := range []string{"", "xdp", "ns,", "direct;vip"} {
		if got, err := ParsePerfPaths(in); err == nil {
			t.Errorf("ParsePerfPaths(%q) = %v, want an error", in, got)
		}
	}
	o := DefaultPerfOptions()
	o.Paths, _ = ParsePerfPaths("all")
	o.Bare = false
	if got := strings.Join(pathNames(o.paths()), ","); got != "direct,vip,nft,sock-lb,ns-direct,ns-tc,ns-xdp" {
		t.Errorf("all without bare: %s", got)
	}
	if !o.northSouth() || !o.eastWest() || !o.sockLB() {
		t.Errorf("all: north-south %v, east-west %v", o.northSouth(), o.eastWest())
	}
	o.Paths = NorthSouthPaths
	if o.eastWest() {
		t.Errorf("north-south paths count as east-west")
	}
	if got := strings.Join(pathNames(DefaultPerfOptions().paths()), ","); got != "bare,direct,vip,nft" {
		t.Errorf("default paths %s, want the east-west ones", got)
	}
	if DefaultPerfOptions().sockLB() {
		t.Errorf("the default run has sock-lb")
	}
}

func TestPerfOptionsValidate(t *testing.T) {
	if err := DefaultPerfOptions().Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for name, mut := range map[string]func(*PerfOptions){
		"rounds":      func(o *PerfOptions) { o.Rounds = 0 },
		"rounds high": func(o *PerfOptions) { o.Rounds = 501 },
		"duration":    func(o *PerfOptions) { o.Duration = time.Millisecond },
		"workers":     func(o *PerfOptions) { o.Workers = 1000 },
		"streams":     func(o *PerfOptions) { o.Streams = 0 },
		"max conns":   func(o *PerfOptions) { o.MaxConns = 0 },
		"max others":  func(o *PerfOptions) { o.MaxOthers = 1.5 },
		"path":        func(o *PerfOptions) { o.Paths = []PerfPath{"xdp"} },
		"path twice":  func(o *PerfOptions) { o.Paths = []PerfPath{PathNSTC, PathNSTC} },
		"no path":     func(o *PerfOptions) { o.Paths, o.Bare = []PerfPath{PathBare}, false },
	} {
		o := DefaultPerfOptions()
		mut(&o)
		if o.Validate() == nil {
			t.Errorf("%s: out of bounds accepted", name)
		}
	}
}

func TestKubeProxyRuleset(t *testing.T) {
	s := kubeProxyRuleset("kp", netip.MustParsePrefix("10.96.0.0/16"), netip.MustParsePrefix("10.200.0.0/16"), []nftService{{
		Name: "perf/echo/tcp/p80", Counter: "c", VIP: VIP4, Port: 80,
		Endpoints: []netip.AddrPort{netip.MustParseAddrPort("10.200.2.2:8080"), netip.MustParseAddrPort("10.200.3.2:8080")},
	}})
	for _, want := range []string{
		"add chain ip kp nat-prerouting { type nat hook prerouting priority -100 ; }",
		"add rule ip kp services ip daddr . meta l4proto . th dport vmap @service-ips",
		"add element ip kp service-ips { 10.96.0.10 . tcp . 80 : goto service-perf/echo/tcp/p80 }",
		`add rule ip kp service-perf/echo/tcp/p80 counter name "c" numgen random mod 2 vmap { 0 : goto endpoint-perf/echo/tcp/p80__10.200.2.2/8080, 1 : goto endpoint-perf/echo/tcp/p80__10.200.3.2/8080 }`,
		"add rule ip kp endpoint-perf/echo/tcp/p80__10.200.3.2/8080 meta l4proto tcp dnat to 10.200.3.2:8080",
		"add rule ip kp service-perf/echo/tcp/p80 ip daddr 10.96.0.10 ip saddr != 10.200.0.0/16 jump mark-for-masquerade",
	} {
		if !strings.Contains(s, want+"\n") {
			t.Errorf("ruleset lacks %q:\n%s", want, s)
		}
	}
}

// TestPerfSocketLB runs the socket group of `fluxvm-lab perf` (direct,
// vip, sock-lb) with tiny bounds: the checks must pass; every sock-lb
// measurement must raise sock_rewritten at least once per connection and
// leave the TC services' new flows and nftables alone, every direct and
// vip one must leave sock_rewritten alone; the socket table and its
// target line must be there; and the cgroups and the worker processes
// must be gone afterwards. It says nothing about speed.
func TestPerfSocketLB(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, need := range []func() error{
		func() error { _, err := NFTPath(); return err },
		func() error { _, err := cgroup2.Root(); return err },
	} {
		if err := need(); err != nil {
			if testenv.Required() {
				t.Fatalf("%v (%s=1 is set, so this fails instead of skipping)", err, testenv.RequireEnv)
			}
			t.Skipf("skipping: %v", err)
		}
	}
	root, _ := cgroup2.Root()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	o := DefaultPerfOptions()
	o.Paths = SocketPaths
	o.Rounds = 1
	o.Duration = 200 * time.Millisecond
	o.Workers = 2
	o.MaxConns = 2000
	o.MaxOthers = 0
	var out bytes.Buffer
	rep, err := Perf(ctx, &out, o)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(pathNames(rep.Paths), ","); got != "direct,vip,sock-lb" {
		t.Errorf("paths %s, want direct,vip,sock-lb", got)
	}
	if len(rep.Checks) != 5 {
		t.Errorf("%d checks, want 5", len(rep.Checks))
	}
	for _, c := range rep.Checks {
		if !c.OK {
			t.Errorf("check failed: %s: %s", c.Name, c.Detail)
		}
	}
	for _, p := range SocketPaths {
		for _, wl := range []PerfWorkload{WorkloadConns, WorkloadBulk} {
			ss := rep.samples(p, wl)
			if len(ss) != 1 {
				t.Errorf("%s on %s: %d samples, want 1", wl, p, len(ss))
				continue
			}
			s := ss[0]
			if s.OK == 0 || s.Rate() <= 0 || s.Failed != 0 {
				t.Errorf("%s on %s: %d ok, %d failed (%s), rate %v", wl, p, s.OK, s.Failed, s.FirstError, s.Rate())
			}
			if s.NFTConns != 0 || s.SockFailOpen != 0 {
				t.Errorf("%s on %s: nftables %d, sock_fail_open_* +%d", wl, p, s.NFTConns, s.SockFailOpen)
			}
			switch p {
			case PathSockLB:
				if s.SockRewritten < uint64(s.OK) || s.DatapathFlows != 0 {
					t.Errorf("%s on sock-lb: %d ok, sock_rewritten +%d, datapath new flows %d", wl, s.OK, s.SockRewritten, s.DatapathFlows)
				}
			case PathVIP:
				if s.SockRewritten != 0 || s.DatapathFlows < uint64(s.OK) {
					t.Errorf("%s on vip: %d ok, sock_rewritten +%d, datapath new flows %d", wl, s.OK, s.SockRewritten, s.DatapathFlows)
				}
			case PathDirect:
				if s.SockRewritten != 0 || s.DatapathFlows != 0 {
					t.Errorf("%s on direct: sock_rewritten +%d, datapath new flows %d", wl, s.SockRewritten, s.DatapathFlows)
				}
			}
		}
	}
	for _, row := range []string{"socket LB (", "sock-lb/direct", "sock-lb/vip", "connections/s", "bulk Gbit/s",
		"target sock-lb connections/s:", "within 2%", "compare sock-lb bulk throughput:", "sock-lb over all rounds:"} {
		if !strings.Contains(rep.Table, row) {
			t.Errorf("table has no %q:\n%s", row, rep.Table)
		}
	}
	if strings.Contains(rep.Table, "vip/nft") {
		t.Errorf("the east-west table was printed for the socket group alone:\n%s", rep.Table)
	}
	for _, want := range []string{"socket LB: hooks connect4,", "CLONE_INTO_CGROUP"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the output does not say how sock-lb ran (%q)", want)
		}
	}
	// Nothing left: no cgroup of ours, no worker.
	if rep.SockCgroup == "" || !strings.HasPrefix(rep.SockCgroup, root+"/fluxvm-lab-perf-") {
		t.Errorf("sock cgroup %q, want one of ours under %s", rep.SockCgroup, root)
	}
	if _, err := os.Stat(rep.SockCgroup); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("cgroup %s left behind: %v", rep.SockCgroup, err)
	}
	for _, pid := range rep.WorkerPIDs {
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("worker %d still there: %v", pid, err)
		}
	}
}

// TestCheckSockSample: the per-measurement check fails a run whose socket
// counters contradict the path.
func TestCheckSockSample(t *testing.T) {
	for _, c := range []struct {
		name string
		s    PerfSample
		ok   bool
	}{
		{"sock-lb", PerfSample{Path: PathSockLB, Workload: WorkloadConns, OK: 100, SockRewritten: 100}, true},
		{"sock-lb, some left to TC", PerfSample{Path: PathSockLB, Workload: WorkloadConns, OK: 100, SockRewritten: 99, DatapathFlows: 1}, false},
		{"sock-lb, hooks idle", PerfSample{Path: PathSockLB, Workload: WorkloadBulk, OK: 2}, false},
		{"sock-lb, TC translated too", PerfSample{Path: PathSockLB, Workload: WorkloadConns, OK: 100, SockRewritten: 100, DatapathFlows: 100}, false},
		{"sock-lb, nftables", PerfSample{Path: PathSockLB, Workload: WorkloadConns, OK: 100, SockRewritten: 100, NFTConns: 1}, false},
		{"vip", PerfSample{Path: PathVIP, Workload: WorkloadConns, OK: 100, DatapathFlows: 100}, true},
		{"vip, hooked", PerfSample{Path: PathVIP, Workload: WorkloadConns, OK: 100, DatapathFlows: 100, SockRewritten: 3}, false},
		{"direct, hooked", PerfSample{Path: PathDirect, Workload: WorkloadBulk, OK: 2, SockRewritten: 1}, false},
		{"sock-direct", PerfSample{Path: PathSockDirect, Workload: WorkloadConns, OK: 100}, true},
		{"sock-direct, rewritten", PerfSample{Path: PathSockDirect, Workload: WorkloadConns, OK: 100, SockRewritten: 1}, false},
		{"sock-direct, TC translated", PerfSample{Path: PathSockDirect, Workload: WorkloadBulk, OK: 2, DatapathFlows: 2}, false},
	} {
		err := checkSockSample(c.s)
		if (err == nil) != c.ok {
			t.Errorf("%s: error %v, want ok %v", c.name, err, c.ok)
		}
	}
}

// TestPerfSocketDiag runs the socket-diag group (direct, vip, sock-direct,
// sock-lb) with tiny bounds: the checks must pass; every sock-direct
// measurement, from the hooked worker to the backend's own address, must
// leave sock_rewritten, the datapath's new flows and nftables alone, and
// sock-lb must still be rewritten; the table must have the diagnostic
// ratios and lines besides sock-lb's; and the cgroups and the workers must
// be gone afterwards. It says nothing about speed.
func TestPerfSocketDiag(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, need := range []func() error{
		func() error { _, err := NFTPath(); return err },
		func() error { _, err := cgroup2.Root(); return err },
	} {
		if err := need(); err != nil {
			if testenv.Required() {
				t.Fatalf("%v (%s=1 is set, so this fails instead of skipping)", err, testenv.RequireEnv)
			}
			t.Skipf("skipping: %v", err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	o := DefaultPerfOptions()
	o.Paths, _ = ParsePerfPaths("socket-diag")
	o.Rounds = 2 // two pairs: an interval
	o.Duration = 100 * time.Millisecond
	o.Workers = 2
	o.MaxConns = 1000
	o.MaxOthers = 0
	o.BPFStats = true
	var out bytes.Buffer
	rep, err := Perf(ctx, &out, o)
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	// Issue 36: every client is a worker whose CPU is read from its
	// cgroup, beside the lab process's; our programs ran (TC on every
	// path, the socket hooks too on the hooked ones) and their run time
	// was read.
	for _, p := range rep.Paths {
		for _, wl := range []PerfWorkload{WorkloadConns, WorkloadBulk} {
			for _, s := range rep.samples(p, wl) {
				if !s.ClientWorker || s.Client <= 0 || s.Lab <= 0 || s.BPF <= 0 || s.BPFRuns < uint64(s.OK) {
					t.Errorf("%s on %s round %d: client worker %v, client CPU %s, lab CPU %s, BPF %s in %d runs (%d ok)",
						wl, p, s.Round, s.ClientWorker, s.Client, s.Lab, s.BPF, s.BPFRuns, s.OK)
				}
				// The connect hook runs once per connection from the
				// hooked worker, never from the plain one.
				if c := s.BPFProgs["fluxvm_sock_connect4"].Runs; p.sockPath() != (c >= uint64(s.OK)) || !p.sockPath() && c != 0 {
					t.Errorf("%s on %s round %d: connect4 ran %d times for %d connections", wl, p, s.Round, c, s.OK)
				}
			}
		}
	}
	for _, want := range []string{"client worker µs/conn", "lab process µs/conn", "softirq+irq µs/conn", "conn datapath BPF ns/run", "BPF per program", "fluxvm_sock_connect4", "fluxvm_sock_release",
		"spread | 95% CI", "goal sock-lb/vip:conns>=1.03", "goal sock-lb/direct:conns>=0.98", ", n=2: "} {
		if !strings.Contains(rep.Table, want) {
			t.Errorf("table has no %q:\n%s", want, rep.Table)
		}
	}
	if !strings.Contains(out.String(), "@cgroup") || !strings.Contains(out.String(), "ours, counted") {
		t.Errorf("the output does not list the socket hooks among the programs counted")
	}
	if got := strings.Join(pathNames(rep.Paths), ","); got != "direct,vip,sock-direct,sock-lb" {
		t.Errorf("paths %s, want direct,vip,sock-direct,sock-lb", got)
	}
	if len(rep.Checks) != 6 {
		t.Errorf("%d checks, want 6", len(rep.Checks))
	}
	for _, c := range rep.Checks {
		if !c.OK {
			t.Errorf("check failed: %s: %s", c.Name, c.Detail)
		}
	}
	for _, p := range []PerfPath{PathSockDirect, PathSockLB} {
		for _, wl := range []PerfWorkload{WorkloadConns, WorkloadBulk} {
			ss := rep.samples(p, wl)
			if len(ss) != o.Rounds {
				t.Errorf("%s on %s: %d samples, want %d", wl, p, len(ss), o.Rounds)
			}
			for _, s := range ss {
				if s.OK == 0 || s.Failed != 0 || s.NFTConns != 0 || s.SockFailOpen != 0 || s.DatapathFlows != 0 {
					t.Errorf("%s on %s: %d ok, %d failed (%s), nftables %d, sock_fail_open_* +%d, datapath new flows %d",
						wl, p, s.OK, s.Failed, s.FirstError, s.NFTConns, s.SockFailOpen, s.DatapathFlows)
				}
				if rewritten := s.SockRewritten >= uint64(s.OK); (p == PathSockLB) != rewritten || (p == PathSockDirect && s.SockRewritten != 0) {
					t.Errorf("%s on %s: %d ok, sock_rewritten +%d", wl, p, s.OK, s.SockRewritten)
				}
			}
		}
	}
	for _, row := range []string{"sock-lb/direct", "sock-lb/vip", "sock-direct/direct", "sock-lb/sock-direct",
		"target sock-lb connections/s:", "diag connections/s:", "hooks (sock-direct vs direct)", "rewrite (sock-lb vs sock-direct)",
		"sock-lb over all rounds:", "sock-direct over all rounds:"} {
		if !strings.Contains(rep.Table, row) {
			t.Errorf("table has no %q:\n%s", row, rep.Table)
		}
	}
	if !strings.Contains(out.String(), "sock-lb and sock-direct from pid") {
		t.Errorf("the output does not say sock-direct runs from the hooked worker")
	}
	if _, err := os.Stat(rep.SockCgroup); rep.SockCgroup == "" || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("cgroup %q left behind: %v", rep.SockCgroup, err)
	}
	for _, pid := range rep.WorkerPIDs {
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("worker %d still there: %v", pid, err)
		}
	}
}
