//go:build linux

package scenario

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"
)

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
