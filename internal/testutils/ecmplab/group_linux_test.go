//go:build linux

package ecmplab

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/testutils/daemontest"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// groupFlow is one long-lived flow of the group test.
type groupFlow struct {
	*Flow
	kind   string // "SNAT TCP", "DSR TCP", "SNAT UDP"
	origin *Edge  // the edge that carried it when it opened
	opened time.Time
	// snat is a SNAT flow's translation when it opened: what its backend
	// knows it by.
	snat   netip.AddrPort
	broken bool // it failed a check: not counted again
	why    string
}

// flowSpec is a kind of flow the group test opens.
type flowSpec struct {
	kind, network string
	vip           netip.Addr
}

var (
	snatTCP = flowSpec{"SNAT TCP", "tcp", DefaultSNATVIP}
	dsrTCP  = flowSpec{"DSR TCP", "tcp", DefaultDSRVIP}
	snatUDP = flowSpec{"SNAT UDP", "udp", DefaultSNATVIP}
)

// openGroupFlow opens one flow of kind s from client c, with the edge
// carrying it and, for SNAT, its translation. Safe for concurrent use.
func openGroupFlow(t *testing.T, l *Lab, c *lab.VM, s flowSpec) (*groupFlow, error) {
	f, err := Dial(c, s.network, netip.AddrPortFrom(s.vip, ServicePort), 3*time.Second)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { f.Close() })
	g := &groupFlow{Flow: f, kind: s.kind, opened: time.Now()}
	// Its edge: the one holding it, before replication copies it (about
	// a second).
	e, en, err := l.EdgeOf(f)
	if err == nil && s.vip == DefaultSNATVIP && en.SNAT.Addr() != e.SNAT {
		err = fmt.Errorf("%s %s on %s translated to %s, not the edge's address", s.kind, f.Local, e, en.SNAT)
	}
	g.origin, g.snat = e, en.SNAT
	return g, err
}

// openGroupFlows opens snat SNAT TCP, dsr DSR TCP and udp SNAT UDP flows
// from the clients in turn, 8 at a time, each with the edge carrying it.
func openGroupFlows(t *testing.T, l *Lab, snat, dsr, udp int) []*groupFlow {
	t.Helper()
	var specs []flowSpec
	for range snat {
		specs = append(specs, snatTCP)
	}
	for range dsr {
		specs = append(specs, dsrTCP)
	}
	for range udp {
		specs = append(specs, snatUDP)
	}
	out := make([]*groupFlow, len(specs))
	errs := make(chan error, len(specs))
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < len(specs); i += 8 {
				g, err := openGroupFlow(t, l, l.Clients[i%len(l.Clients)], specs[i])
				if err != nil {
					errs <- err
				}
				out[i] = g
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}
	return out
}

// trickle opens a flow every interval (SNAT TCP, DSR TCP, SNAT UDP in
// turn, from the clients in turn) until the returned func is called,
// which returns them: flows of every age up to the event they span.
func trickle(t *testing.T, l *Lab, every time.Duration) func() []*groupFlow {
	stop, done := make(chan struct{}), make(chan struct{})
	var once sync.Once
	halt := func() { once.Do(func() { close(stop); <-done }) }
	t.Cleanup(halt) // a test that fails before it stops them
	var out []*groupFlow
	var errs []error
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(every):
			}
			g, err := openGroupFlow(t, l, l.Clients[i%len(l.Clients)], []flowSpec{snatTCP, dsrTCP, snatUDP}[i%3])
			if err != nil {
				errs = append(errs, err)
				continue
			}
			out = append(out, g)
		}
	}()
	return func() []*groupFlow {
		t.Helper()
		halt()
		for _, err := range errs {
			t.Error(err)
		}
		if t.Failed() {
			t.FailNow()
		}
		return out
	}
}

// waitReplicated waits until every flow is in the flow table of every
// edge of members, and returns each flow's lag: from its first exchange
// to the moment the last edge held it (polled every 20 ms).
func waitReplicated(t *testing.T, l *Lab, fs []*groupFlow, members []*Edge, timeout time.Duration) []time.Duration {
	t.Helper()
	var lags []time.Duration
	pending := slices.Clone(fs)
	deadline := time.Now().Add(timeout)
	for len(pending) > 0 {
		next := pending[:0]
		for _, f := range pending {
			if es, _ := l.Holders(f.Flow); len(es) == len(members) {
				lags = append(lags, time.Since(f.opened))
			} else {
				next = append(next, f)
			}
		}
		pending = next
		if len(pending) > 0 && time.Now().After(deadline) {
			es, _ := l.Holders(pending[0].Flow)
			t.Fatalf("%d flows not on every edge of %v after %v: e.g. %s %s (on %s) held by %v", len(pending), members, timeout,
				pending[0].kind, pending[0].Local, pending[0].origin, es)
		}
		time.Sleep(20 * time.Millisecond)
	}
	slices.Sort(lags)
	return lags
}

// pct is the p-quantile of sorted ds.
func pct(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	return ds[int(p*float64(len(ds)-1))].Round(time.Millisecond)
}

// waitAge sleeps until the youngest of fs is age old.
func waitAge(fs []*groupFlow, age time.Duration) {
	var youngest time.Time
	for _, f := range fs {
		if f.opened.After(youngest) {
			youngest = f.opened
		}
	}
	time.Sleep(time.Until(youngest.Add(age)))
}

// pingFlows pings every flow not broken yet at once (3 s each) and
// returns those that failed, marking them broken.
func pingFlows(fs []*groupFlow) []*groupFlow {
	var mu sync.Mutex
	var wg sync.WaitGroup
	var bad []*groupFlow
	for _, f := range fs {
		if f.broken {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f.Ping(3 * time.Second); err != nil {
				mu.Lock()
				f.broken, f.why = true, err.Error()
				bad = append(bad, f)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return bad
}

// retranslated returns the SNAT flows of fs (not broken) that an edge
// holds with another translation than they had, marking them broken: an
// edge without their state translated them anew (a UDP flow's backend
// answers even so; a TCP one resets it).
func retranslated(l *Lab, fs []*groupFlow) []*groupFlow {
	var bad []*groupFlow
	for _, f := range fs {
		if f.broken || !f.snat.IsValid() {
			continue
		}
		es, ens := l.Holders(f.Flow)
		for i, en := range ens {
			if en.SNAT != f.snat && !f.broken {
				f.broken, f.why = true, fmt.Sprintf("translated to %s on %s, was %s", en.SNAT, es[i], f.snat)
				bad = append(bad, f)
			}
		}
	}
	return bad
}

// alive are the flows of fs not broken yet.
func alive(fs []*groupFlow) []*groupFlow {
	var out []*groupFlow
	for _, f := range fs {
		if !f.broken {
			out = append(out, f)
		}
	}
	return out
}

// byKind counts flows by kind, for a log line.
func byKind(fs []*groupFlow) string {
	n := map[string]int{}
	for _, f := range fs {
		n[f.kind]++
	}
	var parts []string
	for _, k := range sortedKeys(n) {
		parts = append(parts, fmt.Sprintf("%d %s", n[k], k))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// moved counts the flows of fs (not broken) that another edge carries
// now than before (by: the edge each was on), records the new one, and
// counts those whose edge it cannot tell. The edge carrying a flow is
// the one whose entry a packet refreshed since checked (the datapath
// clock when the check that pinged every flow began), besides, for SNAT,
// the edge its replies reach (announcer): the others hold copies,
// refreshed only by their source's journal. (Which edge the
// router picks cannot be computed from the 5-tuple here: a local
// socket's packets carry its random hash, sk_txhash, which the router's
// multipath hash uses as it is.)
func moved(t *testing.T, l *Lab, fs []*groupFlow, by map[*groupFlow]*Edge, checked time.Duration) (n, unknown int) {
	t.Helper()
	for _, f := range fs {
		if f.broken {
			continue
		}
		var now []*Edge
		es, ens := l.Holders(f.Flow)
		for i, en := range ens {
			if en.LastSeen >= checked {
				now = append(now, es[i])
			}
		}
		// A SNAT flow's replies go to the edge announcing its SNAT
		// address, which refreshes its copy too: the other one is where
		// the router sends the client's packets.
		if len(now) == 2 && ens[0].Kind == conntrack.SNAT {
			replies := l.announcer(ens[0].SNAT.Addr())
			now = slices.DeleteFunc(now, func(e *Edge) bool { return e == replies })
		}
		if len(now) != 1 {
			unknown++
			continue
		}
		if by[f] != now[0] {
			n++
		}
		by[f] = now[0]
	}
	return n, unknown
}

// explain logs, for the broken flows (at most 8), where the router sends
// each now and what every running edge's flow table holds of it.
func explain(t *testing.T, l *Lab, what string, bad []*groupFlow) {
	t.Helper()
	for i, f := range bad {
		if i == 8 {
			t.Logf("%s: ... %d more", what, len(bad)-i)
			break
		}
		now, _, err := l.EdgeOf(f.Flow)
		var held []string
		es, ens := l.Holders(f.Flow)
		for j, e := range es {
			en := ens[j]
			held = append(held, fmt.Sprintf("%s: %v backend id %d snat %v state %v last seen %v", e.Name, en.Kind, en.BackendID, en.SNAT, en.State, en.LastSeen.Round(time.Second)))
		}
		t.Logf("%s: %s %s -> %s (backend %s) opened on %s %v ago: %s; last seen on %v (%v); held by [%s]",
			what, f.kind, f.Local, f.VIP, f.Backend, f.origin, time.Since(f.opened).Round(time.Millisecond), f.why, now, err, strings.Join(held, "; "))
	}
}

// event checks old (every one at least minAge old at the event, at) and
// young flows after an event, logs the counts and fails for any old flow
// broken, explaining which.
// Right after the old flows' pings, before their refreshes replicate, it
// logs how many of them another edge carries than before (moved; to: how
// many are on that edge, when not nil).
func event(t *testing.T, l *Lab, name string, at time.Time, old, young []*groupFlow, by map[*groupFlow]*Edge, to *Edge) {
	t.Helper()
	const minAge = 5 * time.Second
	oldest, youngest := time.Duration(0), time.Duration(1<<62)
	for _, f := range old {
		age := at.Sub(f.opened)
		oldest, youngest = max(oldest, age), min(youngest, age)
	}
	if youngest < minAge-100*time.Millisecond {
		t.Fatalf("%s: an old flow was %v old at the event, want at least %v", name, youngest, minAge)
	}
	var yAge []time.Duration
	for _, f := range young {
		yAge = append(yAge, at.Sub(f.opened))
	}
	slices.Sort(yAge)
	checked, err := conntrack.Now()
	if err != nil {
		t.Fatal(err)
	}
	badOld := pingFlows(old)
	logMoved(t, l, name, old, by, checked, to)
	badOld = append(badOld, retranslated(l, old)...)
	badYoung := append(pingFlows(young), retranslated(l, young)...)
	var bAge []time.Duration
	for _, f := range badYoung {
		bAge = append(bAge, at.Sub(f.opened))
	}
	slices.Sort(bAge)
	t.Logf("%s: %d of %d flows %v..%v old at the event broke (%s); %d of %d younger flows (%v..%v old) broke (%s; %v..%v old)",
		name, len(badOld), len(old), youngest.Round(time.Millisecond), oldest.Round(time.Millisecond), byKind(badOld),
		len(badYoung), len(young), pct(yAge, 0), pct(yAge, 1), byKind(badYoung), pct(bAge, 0), pct(bAge, 1))
	if len(badOld) > 0 {
		t.Errorf("%s: %d flows at least %v old broke, want 0", name, len(badOld), minAge)
		explain(t, l, name+": broken", badOld)
	}
	explain(t, l, name+": young, broken", badYoung)
}

// replicatorLag reads the replicator's lines since from: the rounds that
// changed something and how long they took, and the failed ones.
func replicatorLag(t *testing.T, l *Lab, from int) string {
	t.Helper()
	var ds []time.Duration
	failed := 0
	lines := l.ReplicatorLines()
	for _, s := range lines[min(from, len(lines)):] {
		var r struct {
			Duration string           `json:"duration"`
			Pairs    []ha.GroupResult `json:"pairs"`
			Error    string           `json:"error"`
		}
		if err := json.Unmarshal([]byte(s), &r); err != nil {
			t.Fatalf("replicator line %q: %v", s, err)
		}
		if r.Error != "" {
			failed++
		}
		d, _ := time.ParseDuration(r.Duration)
		ds = append(ds, d)
	}
	slices.Sort(ds)
	return fmt.Sprintf("%d rounds printed (%d failed), round time p50 %v max %v", len(ds), failed, pct(ds, 0.5), pct(ds, 1))
}

// TestECMPGroup is issue 37's point 4: the lab's edges as one group
// (ha_group, the real fluxvm-replicator -group in the router's
// namespace, ha_interval 1 s), long-lived flows from three clients
// (SNAT TCP, routed DSR TCP, SNAT UDP) through it, every counted flow at
// least 5 s old at each event, and three events that must break none of
// them: an edge killed with -9 (its SNAT address taken over by a
// survivor), an edge added (the router moves a share of the flows to
// it), and a backend's weight changed, then an edge removed. It reports
// how many younger flows broke, the time from the kill to the router's
// withdrawal, and the replication lag (first exchange to the flow on
// every other edge).
func TestECMPGroup(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	l := newTestLabWith(t, ctx, func(c *Config) {
		c.Clients = 3
		c.Group = true
		c.Replicator = daemontest.BuildCommand(t, "./cmd/fluxvm-replicator")
	})
	e1, e2, e3 := l.Edges[0], l.Edges[1], l.Edges[2]
	for _, vip := range []netip.Addr{DefaultSNATVIP, DefaultDSRVIP} {
		if _, err := l.WaitNexthops(ctx, vip, []*Edge{e1, e2, e3}, 20*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("group of %v up, joined and routed %v after the start", l.GroupMembers(), time.Since(start).Round(time.Millisecond))

	// a. An edge killed with -9. 150 SNAT TCP, 50 DSR TCP, 20 SNAT UDP.
	oldA := openGroupFlows(t, l, 150, 50, 20)
	on := map[*groupFlow]*Edge{}
	split := map[string]int{}
	for _, f := range oldA {
		on[f] = f.origin
		split[f.origin.Name]++
	}
	lags := waitReplicated(t, l, oldA, l.GroupMembers(), 15*time.Second)
	t.Logf("%d flows (%s) over the edges %v; replication lag (first exchange -> on both other edges): p50 %v p99 %v max %v",
		len(oldA), byKind(oldA), split, pct(lags, 0.5), pct(lags, 0.99), pct(lags, 1))
	for _, e := range l.GroupMembers() {
		st, err := e.HAStatus(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: joined %v, cursors %v", e.Name, st.Joined, st.Sources)
	}
	waitAge(oldA, 5*time.Second)
	youngA := openGroupFlows(t, l, 20, 10, 5)
	for _, f := range youngA {
		on[f] = f.origin
	}
	killed := time.Now()
	e2.Kill()
	if _, err := l.WaitNexthops(ctx, DefaultSNATVIP, []*Edge{e1, e3}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	took := time.Since(killed)
	if _, err := l.WaitNexthops(ctx, DefaultDSRVIP, []*Edge{e1, e3}, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	tookOver, err := l.TakeOver(ctx, e2, e1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kill -9 of %s (carried %d of the old flows) -> withdrawn by the router %v after the kill; %s took its SNAT address over, routed %v after the POST",
		e2.Name, countOrigin(oldA, e2), took.Round(time.Millisecond), e1.Name, tookOver.Round(time.Millisecond))
	event(t, l, "a. edge killed", killed, oldA, youngA, on, nil)

	// b. An edge added: fresh flows on the survivors, 5 s old, with the
	// survivors of a (older still).
	oldB := openGroupFlows(t, l, 60, 20, 10)
	for _, f := range oldB {
		on[f] = f.origin
	}
	waitReplicated(t, l, oldB, l.GroupMembers(), 15*time.Second)
	waitAge(oldB, 5*time.Second)
	// The younger flows: one every 60 ms while e4 starts and joins,
	// so that they span every age up to the route change.
	stopYoung := trickle(t, l, 60*time.Millisecond)
	linesBefore := len(l.ReplicatorLines())
	added := time.Now()
	e4, err := l.AddEdge(ctx)
	if err != nil {
		t.Fatal(err)
	}
	routedSNAT := time.Now()
	var youngB []*groupFlow
	for _, f := range stopYoung() {
		if f.opened.Before(routedSNAT) {
			youngB = append(youngB, f)
			on[f] = f.origin
		} else {
			f.Close() // opened after the event: not counted
		}
	}
	if _, err := l.WaitNexthops(ctx, DefaultSNATVIP, []*Edge{e1, e3, e4}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := l.WaitNexthops(ctx, DefaultDSRVIP, []*Edge{e1, e3, e4}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	routed := time.Now()
	oldAll := append(alive(oldA), alive(youngA)...)
	oldAll = append(oldAll, oldB...)
	t.Logf("%s added: joined and routed %v after its start (replicator restarted with it: %s)",
		e4.Name, routed.Sub(added).Round(time.Millisecond), replicatorLag(t, l, linesBefore))
	event(t, l, "b. edge added", routedSNAT, oldAll, youngB, on, e4)

	// c. A backend's weight changed (be1: 6, the others 1: Maglev moves
	// about half of the new picks), then an edge removed (e3, stopped;
	// its SNAT address taken over by e4) while the old flows run.
	oldC := append(alive(oldAll), alive(youngB)...)
	waitAge(oldC, 5*time.Second)
	svcs := slices.Clone(l.Services)
	for i := range svcs {
		svcs[i].Backends = slices.Clone(svcs[i].Backends)
		w := uint32(6)
		svcs[i].Backends[0].Weight = &w
	}
	if err := l.Apply(ctx, svcs...); err != nil {
		t.Fatal(err)
	}
	youngC := openGroupFlows(t, l, 20, 10, 5)
	for _, f := range youngC {
		on[f] = f.origin
	}
	removed := time.Now()
	if err := e3.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := l.WaitNexthops(ctx, DefaultSNATVIP, []*Edge{e1, e4}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	withdrawn := time.Since(removed)
	if _, err := l.TakeOver(ctx, e3, e4); err != nil {
		t.Fatal(err)
	}
	t.Logf("backend %s's weight 6 on every edge, then %s stopped (withdrawn %v after) and its SNAT address taken over by %s",
		l.Backends[0].Name, e3.Name, withdrawn.Round(time.Millisecond), e4.Name)
	event(t, l, "c. weight changed, edge removed", removed, oldC, youngC, on, nil)
	t.Logf("whole run %v", time.Since(start).Round(time.Millisecond))
}

// announcer is the edge the router sends addr (an SNAT address) to: its
// edge, or the edge that took it over.
func (l *Lab) announcer(addr netip.Addr) *Edge {
	if e := l.held[addr]; e != nil {
		return e
	}
	for _, e := range l.Edges {
		if e.SNAT == addr {
			return e
		}
	}
	return nil
}

// logMoved logs moved's counts (and how many flows are on to, when not
// nil).
func logMoved(t *testing.T, l *Lab, name string, fs []*groupFlow, by map[*groupFlow]*Edge, checked time.Duration, to *Edge) {
	t.Helper()
	n, unknown := moved(t, l, fs, by, checked)
	on := ""
	if to != nil {
		on = fmt.Sprintf(", %d flows on %s now", countNow(fs, by, to), to.Name)
	}
	t.Logf("%s: %d of the %d old flows that work are on another edge than before (%d on no edge or on several: not told)%s",
		name, n, len(alive(fs)), unknown, on)
}

// countNow counts the flows of fs (not broken) on e now (by).
func countNow(fs []*groupFlow, by map[*groupFlow]*Edge, e *Edge) int {
	n := 0
	for _, f := range fs {
		if !f.broken && by[f] == e {
			n++
		}
	}
	return n
}

func countOrigin(fs []*groupFlow, e *Edge) int {
	n := 0
	for _, f := range fs {
		if f.origin == e {
			n++
		}
	}
	return n
}

// TestECMPGroupMemberDown: an edge of the group killed and left in the
// replicator's members (Fabric has not ended its lease yet, no
// takeover), the other edges go on replicating each other's new flows
// within two intervals (the edges' seal, the replicator's round): the
// replicator neither stops at the seed check nor backs off because one
// member does not answer.
func TestECMPGroupMemberDown(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	l := newTestLabWith(t, ctx, func(c *Config) {
		c.Group = true
		c.Replicator = daemontest.BuildCommand(t, "./cmd/fluxvm-replicator")
	})
	e1, e2, e3 := l.Edges[0], l.Edges[1], l.Edges[2]
	if _, err := l.WaitNexthops(ctx, DefaultSNATVIP, []*Edge{e1, e2, e3}, 20*time.Second); err != nil {
		t.Fatal(err)
	}
	e2.Kill()
	if _, err := l.WaitNexthops(ctx, DefaultSNATVIP, []*Edge{e1, e3}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	// Long enough for a backing-off replicator to wait 2 s, then 4 s.
	time.Sleep(5 * time.Second)
	fs := openGroupFlows(t, l, 20, 5, 5)
	lags := waitReplicated(t, l, fs, []*Edge{e1, e3}, 40*time.Second)
	bound := 2*l.cfg.HAInterval + time.Second
	t.Logf("%s down, still a member: %d new flows on both survivors after p50 %v max %v (bound %v); %s",
		e2.Name, len(fs), pct(lags, 0.5), pct(lags, 1), bound, replicatorLag(t, l, 0))
	if lags[len(lags)-1] > bound {
		t.Errorf("with %s down the survivors' flows replicated after up to %v, want within %v", e2.Name, lags[len(lags)-1], bound)
	}
}
