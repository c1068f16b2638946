package fluxvm

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

func TestNextGCInterval(t *testing.T) {
	const base = 30 * time.Second
	for _, tc := range []struct {
		name    string
		cur     time.Duration
		scanned int
		removed int
		want    time.Duration
	}{
		{"bulk expiry halves", base, 1000, 100, 15 * time.Second},
		{"bulk expiry stops at an eighth", 4 * time.Second, 1000, 500, base / 8},
		{"idle doubles", base, 1000, 0, 2 * base},
		{"idle stops at twice", 2 * base, 1000, 0, 2 * base},
		{"empty table is idle", base, 0, 0, 2 * base},
		{"some expiry goes back up", 10 * time.Second, 1000, 5, 20 * time.Second},
		{"some expiry goes back down", 2 * base, 1000, 5, base},
		{"steady", base, 1000, 5, base},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := nextGCInterval(base, tc.cur, GCResult{Scanned: tc.scanned, Expired: tc.removed}); got != tc.want {
				t.Errorf("next after %v: %v, want %v", tc.cur, got, tc.want)
			}
		})
	}
	// A short configured period never goes below the GC's minimum.
	if got := nextGCInterval(time.Second, time.Second, GCResult{Scanned: 10, Expired: 10}); got != time.Second {
		t.Errorf("1s period under bulk expiry: %v", got)
	}
}

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
	testMapPressure(t, d, c, ct, fill, n)
}

// TestMapPressureLoop: the controller's own loop finds the same map above
// the soft threshold and brings it below by itself.
func TestMapPressureLoop(t *testing.T) {
	e := newEnv(t)
	e.opts.PressureInterval = 100 * time.Millisecond
	d := e.open(t)
	_, _, fill := pressureFill(t, e, d)
	to := conntrack.DefaultTimeouts()
	fill(50000, conntrack.ProtoTCP, bpf.CTTCPEstablished, time.Minute, to.TCPEstablished)
	fill(8000, conntrack.ProtoTCP, bpf.CTTCPFin, 5*time.Second, to.TCPFin)
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := d.Pressure()
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

func testMapPressure(t *testing.T, d *Dataplane, c *lab.Conn, ct *conntrack.Map, fill func(int, uint8, bpf.CTState, time.Duration, time.Duration) int, n int) {
	ctx := context.Background()
	to := conntrack.DefaultTimeouts()
	st, err := d.Pressure()
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

	// Past the hard threshold (95%): 62,300 established flows.
	fill(17300, conntrack.ProtoTCP, bpf.CTTCPEstablished, time.Minute, to.TCPEstablished)
	if st, err := d.Pressure(); err != nil || st.Level != PressureHard {
		t.Errorf("at %.1f%%: level %s, %v; want hard", st.Maps["fluxvm_fct4"].Percent, st.Level, err)
	}
}
