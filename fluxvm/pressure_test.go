package fluxvm

import (
	"context"
	"net/netip"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/nat"
)

// TestMapPressure fills a tier-S conntrack map (65,536 IPv4 entries) past
// the soft threshold with flows of every state, pinned to the service's
// real frontend and backend: a round sheds the closed TCP flows first
// and, still above the threshold, idle UDP flows and unanswered
// handshakes, counted by state, and no established flow; the level falls
// below the threshold. Past the hard threshold the level reads hard.
// Every figure also in Status.
func TestMapPressure(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	c, ct, fill := pressureFill(t, e, d)
	to := conntrack.DefaultTimeouts()
	n := fill(45000, conntrack.ProtoTCP, bpf.CTTCPEstablished, time.Minute, to.TCPEstablished)
	fill(5000, conntrack.ProtoTCP, bpf.CTTCPFin, 5*time.Second, to.TCPFin)
	fill(3000, conntrack.ProtoTCP, bpf.CTTCPSyn, 25*time.Second, to.TCPSyn)
	n = fill(5000, conntrack.ProtoUDP, bpf.CTUDP, 20*time.Second, to.UDP)
	testMapPressure(t, d, c, ct, n)
	testHardPressure(t, e, d, c, ct)
}

// TestMapPressureLoop: the controller's own loop finds the same map above
// the soft threshold and brings it below by itself.
func TestMapPressureLoop(t *testing.T) {
	e := newEnv(t)
	e.opts.Pressure.Interval = 100 * time.Millisecond
	d := e.open(t)
	_, _, fill := pressureFill(t, e, d)
	to := conntrack.DefaultTimeouts()
	// The closed flows first: the level crosses the threshold only with
	// the last established ones, so a round the loop runs meanwhile
	// finds all 8,000.
	fill(8000, conntrack.ProtoTCP, bpf.CTTCPFin, 5*time.Second, to.TCPFin)
	fill(50000, conntrack.ProtoTCP, bpf.CTTCPEstablished, time.Minute, to.TCPEstablished)
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := d.Pressure(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if st.Rounds > 0 && st.Level == PressureOK {
			if r := st.LastRound; r == nil || r.Shed.Closed != 8000 {
				t.Errorf("last round %+v: want the 8,000 closed flows shed", r)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the loop did not relieve the pressure: %+v", st)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestMapPressureWakesOnInsertFailure: a failed datapath insert wakes a
// round well before the next reading of the levels (5 s here): the loop
// reads the two failure counters every pressure.FailureCheck (250 ms).
func TestMapPressureWakesOnInsertFailure(t *testing.T) {
	e := newEnv(t)
	e.opts.Pressure.Interval = 5 * time.Second
	d := e.open(t)
	time.Sleep(300 * time.Millisecond) // the loop has read the counters once
	// The datapath counts a failed conntrack insert in fluxvm_drops;
	// written here as it would (the LRU maps refuse inserts only under
	// contention, which a test cannot produce at will).
	m := d.dp.Maps().FluxvmDrops
	vals := make([]uint64, ebpf.MustPossibleCPU())
	vals[0] = 3
	if err := m.Put(uint32(bpf.DropCTUpdate), vals); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for {
		st, err := d.Pressure(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if r := st.LastRound; r != nil {
			if r.InsertFailures != 3 || r.GC == nil {
				t.Errorf("round %+v: want one woken by 3 insert failures, with a GC", r)
			}
			if wait := time.Since(start); wait > 2*time.Second {
				t.Errorf("the round came %v after the failure", wait)
			}
			return
		}
		if time.Since(start) > 4*time.Second {
			t.Fatalf("no round 4 s after an insert failure: %+v", st)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pressureFill applies the test service with one live connection and
// returns it, the conntrack map, and a filler of IPv4 entries pinned to
// the connection's frontend and backend (count entries in state, idle
// for idle, of timeout timeout; it returns the entries written so far).
func pressureFill(t *testing.T, e *env, d *Dataplane) (*lab.Conn, *conntrack.Map, func(int, uint8, bpf.CTState, time.Duration, time.Duration) int) {
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 0, 0)); err != nil {
		t.Fatal(err)
	}
	c := e.dial(t, vip4)
	echo(t, c, "real")
	ct, err := d.Conntrack()
	if err != nil {
		t.Fatal(err)
	}
	real, err := ct.List(conntrack.Filter{Family: conntrack.IPv4})
	if err != nil || len(real) != 1 {
		t.Fatalf("the real flow: %v, %v", real, err)
	}
	sid, bid := real[0].ServiceID, real[0].BackendID
	now, err := conntrack.Now()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	fill := func(count int, proto uint8, state bpf.CTState, idle, timeout time.Duration) int {
		t.Helper()
		for range count {
			n++
			client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{172, 16, byte(n >> 8), byte(n)}), uint16(1024+n%60000))
			en := conntrack.Entry{Key: conntrack.Key{Client: client, VIP: netip.AddrPortFrom(vip4, 80), Proto: proto},
				ServiceID: sid, BackendID: bid, State: state, Kind: conntrack.EastWest, ReverseDerived: true,
				Created: now - idle, LastSeen: now - idle, Deadline: now - idle + timeout}
			if _, err := ct.Restore(en, false); err != nil {
				t.Fatal(err)
			}
		}
		return n
	}
	return c, ct, fill
}

func testMapPressure(t *testing.T, d *Dataplane, c *lab.Conn, ct *conntrack.Map, n int) {
	ctx := context.Background()
	st, err := d.Pressure(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ct4 := st.Maps["fluxvm_fct4"]
	if ct4.Entries != int64(n+1) || ct4.MaxEntries != 65536 || st.Level != PressureSoft {
		t.Fatalf("before: fct4 %+v, level %s; want %d entries, soft", ct4, st.Level, n+1)
	}
	r, err := d.ReconcilePressure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := conntrack.ShedCounts{Closed: 5000, HalfOpen: 3000, IdleUDP: 5000}
	if r.Shed != want || r.GC == nil || r.Level != PressureSoft || len(r.Over) != 1 || r.Over[0] != "fluxvm_fct4" {
		t.Errorf("round %+v: want shed %+v after a GC, fct4 over", r, want)
	}
	if p := r.After["fluxvm_fct4"]; p >= float64(DefaultPressureSoftPercent) {
		t.Errorf("fct4 at %.1f%% after the round", p)
	}
	es, err := ct.List(conntrack.Filter{Family: conntrack.IPv4})
	if err != nil {
		t.Fatal(err)
	}
	states := map[bpf.CTState]int{}
	for _, en := range es {
		states[en.State]++
	}
	if states[bpf.CTTCPEstablished] != 45001 || len(es) != 45001 {
		t.Errorf("after the round: %v; want the 45,001 established flows and nothing else", states)
	}
	echo(t, c, "after the round")
	if st := d.Status(); st.Pressure == nil || st.Pressure.Rounds != 1 || st.Pressure.LastRound == nil || st.Pressure.LastRound.Shed != want {
		t.Errorf("status %+v", st.Pressure)
	}
	// Nothing over: a round does nothing.
	if r, err := d.ReconcilePressure(ctx); err != nil || r.GC != nil || r.Shed.Total() != 0 {
		t.Errorf("round below the threshold: %+v, %v", r, err)
	}
}

// testHardPressure: past the hard threshold (95%) with 62,300 established
// flows, 17,300 of them idle for 90 s and with a reverse-NAT half each
// (stored east-west flows), nothing is left to shed: a round rebuilds fct4
// with the flows that fit one point below the soft threshold (51,773 of
// 65,536), established ones the most recently seen first, and reloads the
// pins and programs, while a long-lived connection echoes and short
// connections come and go through the VIP: none of them fails, every flow
// seen a minute ago survives, only ones idle for 90 s are dropped, with
// their halves (the GC that follows brings none back); the pin names a
// new map, the generation marker is back.
func testHardPressure(t *testing.T, e *env, d *Dataplane, c *lab.Conn, ct *conntrack.Map) {
	ctx := context.Background()
	to := conntrack.DefaultTimeouts()
	real, err := ct.List(conntrack.Filter{Family: conntrack.IPv4})
	if err != nil {
		t.Fatal(err)
	}
	var sid, bid uint32
	for _, en := range real {
		if en.Key.Client.Addr().As4()[0] != 172 {
			sid, bid = en.ServiceID, en.BackendID
		}
	}
	if sid == 0 {
		t.Fatal("the live connection's flow is gone")
	}
	ref, err := conntrack.Now()
	if err != nil {
		t.Fatal(err)
	}
	// The halves stand for an upgraded node's generation-3 flows, whose
	// pinned reverse-NAT map is kept at its size: grown here, as nothing
	// in this east-west catalog needs it (sizing.go).
	growForTest(t, d, "fluxvm_nat4")
	// The 17,300 old flows and their halves; 90 s, not longer: the
	// monotonic clock of a machine just booted starts at 0.
	const idle = 90 * time.Second
	backend := netip.AddrPortFrom(e.backends[0].Addr4, 8080)
	for i := range 17300 {
		n := 50000 + i
		client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{172, 17, byte(n >> 8), byte(n)}), uint16(1024+n%60000))
		k := conntrack.Key{Client: client, VIP: netip.AddrPortFrom(vip4, 80), Proto: conntrack.ProtoTCP}
		en := conntrack.Entry{Key: k, ServiceID: sid, BackendID: bid, State: bpf.CTTCPEstablished, Kind: conntrack.EastWest,
			Created: ref - idle, LastSeen: ref - idle, Deadline: ref - idle + to.TCPEstablished}
		if _, err := ct.Restore(en, false); err != nil {
			t.Fatal(err)
		}
		if err := ct.NAT().Put(nat.Entry{Key: nat.Key{Backend: backend, Client: client, Proto: conntrack.ProtoTCP},
			VIP: k.VIP, ServiceID: sid, BackendID: bid, LastSeen: ref - idle}); err != nil {
			t.Fatal(err)
		}
	}
	if st, err := d.Pressure(context.Background()); err != nil || st.Level != PressureHard {
		t.Fatalf("at %.1f%%: level %s, %v; want hard", st.Maps["fluxvm_fct4"].Percent, st.Level, err)
	}
	recent, old, halves := 0, 0, 0
	count := func() {
		t.Helper()
		recent, old, halves = 0, 0, 0
		err := ct.Scan(conntrack.Filter{Family: conntrack.IPv4}, func(es []conntrack.Entry) error {
			for _, en := range es {
				switch a := en.Key.Client.Addr().As4(); {
				case a[0] != 172:
				case a[1] == 17:
					old++
				default:
					recent++
				}
			}
			return nil
		})
		if err == nil {
			err = ct.NAT().Scan(nat.Filter{Family: nat.IPv4}, func(es []nat.Entry) error {
				for _, en := range es {
					if a := en.Client.Addr().As4(); a[0] == 172 && a[1] == 17 {
						halves++
					}
				}
				return nil
			})
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	count()
	if recent != 45000 || old != 17300 || halves != 17300 {
		t.Fatalf("before: %d recent, %d old flows, %d halves", recent, old, halves)
	}
	pinned := func() ebpf.MapID {
		m, err := ebpf.LoadPinnedMap(filepath.Join(e.opts.Loader.PinRoot, "maps", "fluxvm_fct4"), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		info, err := m.Info()
		if err != nil {
			t.Fatal(err)
		}
		id, _ := info.ID()
		return id
	}
	before := pinned()

	// Traffic throughout: the long-lived connection echoes, short ones
	// connect, echo and close.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var longErr, shortErr atomic.Value
	var echoes, shorts, shortFails atomic.Int64
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := c.Echo([]byte("during"), 3*time.Second); err != nil {
				longErr.Store(err)
				return
			}
			echoes.Add(1)
			time.Sleep(2 * time.Millisecond)
		}
	})
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			sc, err := e.cli.DialTCP(netip.AddrPortFrom(vip4, 80), 3*time.Second)
			if err == nil {
				err = sc.Echo([]byte("short"), 3*time.Second)
				sc.Close()
			}
			if err != nil {
				shortErr.Store(err)
				shortFails.Add(1)
			} else {
				shorts.Add(1)
			}
			time.Sleep(5 * time.Millisecond)
		}
	})
	time.Sleep(100 * time.Millisecond)
	r, err := d.ReconcilePressure(ctx)
	time.Sleep(200 * time.Millisecond)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if err, _ := longErr.Load().(error); err != nil {
		t.Errorf("the long-lived connection broke (after %d echoes): %v", echoes.Load(), err)
	}
	// A connection in flight at the switch can lose: the old programs
	// learned it, a reply reaches the new ones before the catch-up copies
	// its flow, untranslated, and the client resets it (docs/operations.md
	// "The hard action"). One at a time here: at most one of them.
	if n := shortFails.Load(); n > 1 {
		err, _ := shortErr.Load().(error)
		t.Errorf("%d short connections failed (%d succeeded), the last: %v", n, shorts.Load(), err)
	} else if n == 1 {
		t.Logf("the short connection in flight at the switch failed: %v", shortErr.Load())
	}
	pc := r.Compaction
	if pc == nil || len(pc.Maps) != 1 || pc.Error != "" || pc.Deferred != "" {
		t.Fatalf("round %+v: want a compaction of fct4", r)
	}
	m := pc.Maps[0]
	const keep = 65536 * 79 / 100
	if m.Map != "fluxvm_fct4" || m.Kept < keep || m.DroppedBy["established"] < 10400 || len(pc.Links) == 0 {
		t.Errorf("compaction %+v, links %v: want fct4 kept >= %d, ~10,528 established dropped", m, pc.Links, keep)
	}
	count()
	// 51,773 kept: the live flows (the long-lived one and the short ones
	// established when the copy read the map) and the 45,000 seen a
	// minute ago first, then the most recent of the 90 s idle ones; the
	// halves of the dropped ones gone with them, none brought back.
	if recent != 45000 || old < keep-45000-5 || old > keep-45000 || halves != old {
		t.Errorf("after: %d recent flows (want all 45,000), %d old ones (want ~%d) with %d halves",
			recent, old, keep-45000, halves)
	}
	if r.GC == nil || r.GC.Repaired != 0 {
		t.Errorf("GC after the compaction: %+v; want nothing repaired", r.GC)
	}
	if p := r.After["fluxvm_fct4"]; p >= float64(DefaultPressureHardPercent) {
		t.Errorf("fct4 at %.1f%% after the hard round", p)
	}
	if after := pinned(); after == before || after != m.MapID {
		t.Errorf("pinned fct4 %d (was %d), compaction says %d", after, before, m.MapID)
	}
	if meta, err := d.dp.ReadMeta(); err != nil || meta.ProgramGeneration != bpf.ProgramGeneration {
		t.Errorf("generation marker %d, %v", meta.ProgramGeneration, err)
	}
	echo(t, c, "after the hard round")
	t.Logf("hard round: %v (the lock held %v), kept %d, dropped %v, caught up %d; %d echoes and %d short connections during it",
		pc.Duration, pc.Switch, m.Kept, m.DroppedBy, m.CaughtUp, echoes.Load(), shorts.Load())
	if pc.Switch.Duration <= 0 || pc.Switch.Duration > pc.Duration.Duration {
		t.Errorf("switch %v of a %v compaction", pc.Switch, pc.Duration)
	}
	// The views follow the new map: a GC scans it and brings nothing back.
	if gc, err := d.GC(ctx); err != nil || gc.Scanned < keep || gc.Repaired != 0 {
		t.Errorf("GC after: %+v, %v", gc, err)
	}
}

// TestCompactionJournalsDeletes: under HA, the north-south flows a
// compaction drops are journaled as deletes for the standby, as GC's
// removals are; east-west ones (no standby holds them) are not, and a
// kept flow is not.
func TestCompactionJournalsDeletes(t *testing.T) {
	e := newNSEnv(t)
	e.opts.HA = HAOptions{Epoch: 3, Interval: MinHAInterval}
	e.opts.Pressure.Interval = time.Hour // the test's rounds only
	d := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 0, 0)
	svc.Ports = []ServicePort{{Port: 80, Protocol: TCP}}
	svc.Exposure = ExposureBoth
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	c, err := e.lab.External.DialTCP(netip.AddrPortFrom(vip4, 80), 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	echo(t, c, "north-south")
	ct, err := d.Conntrack()
	if err != nil {
		t.Fatal(err)
	}
	es, err := ct.List(conntrack.Filter{Family: conntrack.IPv4})
	if err != nil || len(es) != 1 || es[0].Kind != conntrack.SNAT {
		t.Fatalf("the live flow: %+v, %v; want one SNAT flow", es, err)
	}
	sid, bid := es[0].ServiceID, es[0].BackendID
	now, err := conntrack.Now()
	if err != nil {
		t.Fatal(err)
	}
	put := func(first, n int, kind conntrack.Kind, idle time.Duration) {
		t.Helper()
		to := conntrack.DefaultTimeouts()
		for i := range n {
			k := first + i
			client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{172, byte(16 + k>>16), byte(k >> 8), byte(k)}), 40000)
			en := conntrack.Entry{Key: conntrack.Key{Client: client, VIP: netip.AddrPortFrom(vip4, 80), Proto: conntrack.ProtoTCP},
				ServiceID: sid, BackendID: bid, State: bpf.CTTCPEstablished, Kind: kind, ReverseDerived: kind == conntrack.EastWest,
				Created: now - idle, LastSeen: now - idle, Deadline: now - idle + to.TCPEstablished}
			if _, err := ct.Restore(en, false); err != nil {
				t.Fatal(err)
			}
		}
	}
	// 57,300 east-west flows seen a minute ago, 5,000 seen 80 s ago, and
	// the 2,000 oldest, seen 90 s ago, routed DSR (north-south, no
	// reverse-NAT half): 64,301 of 65,536 with the live one, hard.
	put(0, 57300, conntrack.EastWest, time.Minute)
	put(57300, 5000, conntrack.EastWest, 80*time.Second)
	put(62300, 2000, conntrack.DSR, 90*time.Second)
	before := d.HA().Status().GCDeletes
	r, err := d.ReconcilePressure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r.Compaction == nil || len(r.Compaction.Maps) != 1 {
		t.Fatalf("round %+v: want a compaction", r)
	}
	m := r.Compaction.Maps[0]
	// 51,773 kept: the live flow and the east-west flows of a minute;
	// dropped: the 2,000 DSR flows, the 5,000 of 80 s and the oldest of
	// the rest.
	if m.Dropped < 7000 || m.DroppedBy["established"] != m.Dropped {
		t.Errorf("compaction %+v: want the 7,000 oldest flows and more dropped, all established", m)
	}
	if n := d.HA().Status().GCDeletes - before; n != 2000 {
		t.Errorf("%d deletes journaled, want the 2,000 dropped DSR flows (east-west ones are not replicated)", n)
	}
	echo(t, c, "after the compaction")
	if en, err := ct.Lookup(es[0].Key); err != nil || en.Kind != conntrack.SNAT {
		t.Errorf("the live SNAT flow after the compaction: %+v, %v", en, err)
	}
}
