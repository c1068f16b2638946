//go:build linux

package scenario

import (
	"bytes"
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

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

func pathNames(ps []PerfPath) []string {
	var s []string
	for _, p := range ps {
		s = append(s, string(p))
	}
	return s
}

func TestPerfOptionsValidate(t *testing.T) {
	if err := DefaultPerfOptions().Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for name, mut := range map[string]func(*PerfOptions){
		"rounds":     func(o *PerfOptions) { o.Rounds = 0 },
		"duration":   func(o *PerfOptions) { o.Duration = time.Millisecond },
		"workers":    func(o *PerfOptions) { o.Workers = 1000 },
		"streams":    func(o *PerfOptions) { o.Streams = 0 },
		"max conns":  func(o *PerfOptions) { o.MaxConns = 0 },
		"max others": func(o *PerfOptions) { o.MaxOthers = 1.5 },
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
