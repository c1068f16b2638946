package conntrack

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/mapscan"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
	"github.com/fluxvm/servicefabric/nat"
)

// TestGCExpiresEachStateOnItsTimeout learns one flow in every protocol
// state with real packets, then moves GC's clock past one deadline after
// the other: each flow goes exactly when its own state's timeout passed,
// with its NAT half, and not a nanosecond before.
func TestGCExpiresEachStateOnItsTimeout(t *testing.T) {
	d := sharedDataplane(t)
	for _, v := range []variant{variants()[0], variants()[2]} {
		t.Run(strings.TrimSuffix(v.name, "_tcp"), func(t *testing.T) {
			d.t = t
			d.reset()
			type flow struct {
				k     Key
				state bpf.CTState
			}
			var flows []flow
			for i, sc := range stateCases {
				v.proto = sc.proto
				v.setup(d)
				k := v.flow(uint16(44000 + i))
				d.send(k, sc.flags...)
				flows = append(flows, flow{k, sc.state})
			}
			// Shortest timeout first: RST 5s, FIN 15s, SYN 20s, UDP 40s, established 300s.
			slices.SortFunc(flows, func(a, b flow) int { return int(testTimeouts.For(a.state) - testTimeouts.For(b.state)) })
			for i, f := range flows {
				e, ok := d.lookup(f.k)
				if !ok || e.State != f.state {
					t.Fatalf("%s: entry %+v (present %v), want state %s", f.k, e, ok, f.state)
				}
				if res := d.gc(e.Deadline); res.Removed() != 0 {
					t.Fatalf("GC at the %s deadline removed %d entries: %v", f.state, res.Removed(), res)
				}
				res := d.gc(e.Deadline + 1)
				want := GCResult{Scanned: len(flows) - i, Expired: 1, PairedNATRemoved: 1, NATScanned: len(flows) - i - 1}
				if res != want {
					t.Errorf("GC just past the %s deadline: %v\nwant %v", f.state, res, want)
				}
				for j, g := range flows {
					_, ok := d.lookup(g.k)
					_, nok := d.natLookup(v.natOf(g.k, 0))
					if gone := j <= i; ok == gone || nok == gone {
						t.Errorf("after the %s deadline: %s (%s) conntrack %v, NAT %v", f.state, g.k, g.state, ok, nok)
					}
				}
			}
		})
	}
}

// TestGCBackendReasons: the backend's state decides, as the datapath would.
func TestGCBackendReasons(t *testing.T) {
	d := sharedDataplane(t)
	tests := []struct {
		name string
		// change alters the flow's backend (index 0 of the variant) at
		// time t0; GC then runs at t0.
		change   func(d *dataplane, v variant, t0 time.Duration)
		want     GCResult
		removed  bool
		deadline bool // run GC past the flow's own deadline instead
	}{
		{"ready keeps", func(*dataplane, variant, time.Duration) {},
			GCResult{Scanned: 1, NATScanned: 1}, false, false},
		{"unhealthy keeps: the datapath moves the flow on its next packet", func(d *dataplane, v variant, _ time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendUnhealthy, 0)
		}, GCResult{Scanned: 1, NATScanned: 1}, false, false},
		{"draining before its deadline keeps", func(d *dataplane, v variant, t0 time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0+1)
		}, GCResult{Scanned: 1, NATScanned: 1}, false, false},
		{"draining at its deadline removes (the datapath's now < drain_until)", func(d *dataplane, v variant, t0 time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0)
		}, GCResult{Scanned: 1, Drained: 1, PairedNATRemoved: 1}, true, false},
		{"draining past its deadline removes", func(d *dataplane, v variant, t0 time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0-time.Second)
		}, GCResult{Scanned: 1, Drained: 1, PairedNATRemoved: 1}, true, false},
		{"backend removed", func(d *dataplane, v variant, _ time.Duration) {
			d.removeBackend(v.ids[0])
		}, GCResult{Scanned: 1, BackendGone: 1, NATScanned: 1, StaleNATRemoved: 1}, true, false},
		{"backend slot given to another service", func(d *dataplane, v variant, _ time.Duration) {
			d.backend(v.ids[0], sid+1, v.backends[2], bpf.BackendReady, 0)
		}, GCResult{Scanned: 1, BackendGone: 1, NATScanned: 1, StaleNATRemoved: 1}, true, false},
		{"expired and drained counts as expired", func(d *dataplane, v variant, t0 time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0)
		}, GCResult{Scanned: 1, Expired: 1, PairedNATRemoved: 1}, true, true},
	}
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					d.t = t
					d.reset()
					v.setup(d)
					k := v.flow(45000)
					d.send(k, established...)
					e, _ := d.lookup(k)
					t0 := now(t)
					if tt.deadline {
						t0 = e.Deadline + time.Second
					}
					tt.change(d, v, t0)
					if res := d.gc(t0); res != tt.want {
						t.Errorf("GC: %v\nwant %v", res, tt.want)
					}
					_, ok := d.lookup(k)
					_, nok := d.natLookup(v.natOf(k, 0))
					if ok == tt.removed || nok == tt.removed {
						t.Errorf("conntrack present %v, NAT present %v; want removed=%v", ok, nok, tt.removed)
					}
					if _, broken := d.pairing(); broken != 0 {
						t.Errorf("%d broken halves after GC", broken)
					}
				})
			}
		})
	}
}

// TestGCPairing: orphans are repaired or removed, and the repaired flows
// work in the real program afterwards.
func TestGCPairing(t *testing.T) {
	d := sharedDataplane(t)
	timeout := func(v variant) time.Duration {
		if v.proto == ProtoTCP {
			return testTimeouts.TCPEstablished
		}
		return testTimeouts.UDP
	}
	tests := []struct {
		name string
		// run breaks the flow k (learned on the variant's backend 0) and
		// returns when GC should run.
		run func(t *testing.T, d *dataplane, v variant, k Key) time.Duration
		// check, if set, proves the state after GC.
		check func(t *testing.T, d *dataplane, v variant, k Key)
		want  GCResult
	}{
		{"lost NAT half is recreated and translates replies", func(t *testing.T, d *dataplane, v variant, k Key) time.Duration {
			d.must(d.nat.Delete(v.natOf(k, 0)))
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key) {
			c, _ := d.lookup(k)
			e, ok := d.natLookup(v.natOf(k, 0))
			want := nat.Entry{Key: v.natOf(k, 0), VIP: v.vip, ServiceID: sid, BackendID: v.ids[0], LastSeen: c.LastSeen}
			if !ok || e != want {
				t.Errorf("NAT half %+v (present %v)\nwant %+v", e, ok, want)
			}
			if got := d.reply(v.backends[0], k); got != v.vip {
				t.Errorf("reply not translated to the VIP (got %s)", got)
			}
		}, GCResult{Scanned: 1, NATRepaired: 1}},

		{"lost conntrack half is recreated from a fresh NAT half and keeps the flow on its backend", func(t *testing.T, d *dataplane, v variant, k Key) time.Duration {
			d.must(d.ct.rawCT(k).Delete(rawKey(k)))
			n, _ := d.natLookup(v.natOf(k, 0))
			return n.LastSeen + timeout(v) // the last fresh instant
		}, func(t *testing.T, d *dataplane, v variant, k Key) {
			n, _ := d.natLookup(v.natOf(k, 0))
			c, ok := d.lookup(k)
			state := bpf.CTUDP
			if v.proto == ProtoTCP {
				state = bpf.CTTCPEstablished
			}
			want := Entry{Key: k, ServiceID: sid, BackendID: v.ids[0], State: state,
				Created: n.LastSeen, LastSeen: n.LastSeen, Deadline: n.LastSeen + timeout(v)}
			if !ok || c != want {
				t.Errorf("conntrack %+v (present %v)\nwant %+v", c, ok, want)
			}
			d.table(sid, v.ids[1])
			if got := d.send(k, pkt.ACK); got != v.backends[0] {
				t.Errorf("repaired flow went to %s, want its backend %s", got, v.backends[0])
			}
		}, GCResult{NATScanned: 1, CTRepaired: 1}},

		{"NAT half idle past the timeout without conntrack is removed", func(t *testing.T, d *dataplane, v variant, k Key) time.Duration {
			d.must(d.ct.rawCT(k).Delete(rawKey(k)))
			n, _ := d.natLookup(v.natOf(k, 0))
			return n.LastSeen + timeout(v) + 1
		}, nil, GCResult{NATScanned: 1, StaleNATRemoved: 1}},

		{"NAT half without conntrack on an unhealthy backend is removed", func(t *testing.T, d *dataplane, v variant, k Key) time.Duration {
			d.must(d.ct.rawCT(k).Delete(rawKey(k)))
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendUnhealthy, 0)
			return now(t)
		}, nil, GCResult{NATScanned: 1, StaleNATRemoved: 1}},

		{"NAT half without conntrack on a draining backend is recreated until the drain deadline", func(t *testing.T, d *dataplane, v variant, k Key) time.Duration {
			d.must(d.ct.rawCT(k).Delete(rawKey(k)))
			t0 := now(t)
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0+time.Minute)
			return t0
		}, nil, GCResult{NATScanned: 1, CTRepaired: 1}},

		{"failover takes the old backend's NAT half with it", func(t *testing.T, d *dataplane, v variant, k Key) time.Duration {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendUnhealthy, 0)
			d.table(sid, v.ids[1])
			if got := d.send(k, pkt.ACK); got != v.backends[1] {
				t.Fatalf("failover went to %s", got)
			}
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key) {
			if _, ok := d.natLookup(v.natOf(k, 0)); ok {
				t.Error("old backend's NAT half survived")
			}
			if got := d.reply(v.backends[1], k); got != v.vip {
				t.Error("new backend's replies are not translated")
			}
		}, GCResult{Scanned: 1, NATScanned: 1}},

		{"a superseded NAT half goes", func(t *testing.T, d *dataplane, v variant, k Key) time.Duration {
			// As left by a datapath that could not name it (the
			// earlier flow's backend slot was gone when it re-picked).
			d.must(d.nat.Create(nat.Entry{Key: v.natOf(k, 2), VIP: v.vip, ServiceID: sid, BackendID: v.ids[2], LastSeen: now(t)}))
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key) {
			if _, ok := d.natLookup(v.natOf(k, 2)); ok {
				t.Error("the superseded NAT half survived")
			}
			if got := d.reply(v.backends[0], k); got != v.vip {
				t.Error("the flow's replies are not translated")
			}
		}, GCResult{Scanned: 1, NATScanned: 2, SupersededNATRemoved: 1}},

		{"backend id given a new address: old NAT half goes, new one is made", func(t *testing.T, d *dataplane, v variant, k Key) time.Duration {
			d.backend(v.ids[0], sid, v.backends[2], bpf.BackendReady, 0)
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key) {
			if got := d.reply(v.backends[2], k); got != v.vip {
				t.Error("replies from the new address are not translated")
			}
			if got := d.reply(v.backends[0], k); got.IsValid() {
				t.Error("replies from the old address are still translated")
			}
		}, GCResult{Scanned: 1, NATScanned: 1, SupersededNATRemoved: 1, NATRepaired: 1}},
	}
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					d.t = t
					d.reset()
					v.setup(d)
					k := v.flow(46000)
					d.send(k, established...)
					at := tt.run(t, d, v, k)
					if res := d.gc(at); res != tt.want {
						t.Errorf("GC: %v\nwant %v", res, tt.want)
					}
					if _, broken := d.pairing(); broken != 0 {
						t.Errorf("%d broken halves after GC", broken)
					}
					if tt.check != nil {
						tt.check(t, d, v, k)
					}
				})
			}
		})
	}
}

// rawCT and rawKey reach the raw conntrack map, to break flows the way
// the LRU does.
func (m *Map) rawCT(k Key) interface{ Delete(any) error } {
	if k.Family() == IPv4 {
		return m.ct4
	}
	return m.ct6
}

func rawKey(k Key) any {
	if k.Family() == IPv4 {
		return key4(k)
	}
	return key6(k)
}

// TestGCRepairsLRUEviction fills one map of a small-capacity object with
// real flows until its LRU evicts halves of live flows, then shows that GC
// leaves every conntrack entry with its NAT half and vice versa, and that
// the live flows work.
//
// 400 TCP flows are established first; 3000 UDP flows follow and push the
// TCP flows' halves out of the small map. GC then runs just after the UDP
// timeout: the UDP flows are dead and go (both halves), and the TCP flows,
// well within the established timeout, get their lost halves back in the
// room that freed.
func TestGCRepairsLRUEviction(t *testing.T) {
	testenv.RequirePrivileged(t)
	const tcpFlows, udpFlows = 400, 3000
	for _, tc := range []struct {
		name string
		sz   sizes
	}{
		{"NAT halves evicted", sizes{ct: 8192, nat: 1024}},
		{"conntrack halves evicted", sizes{ct: 1024, nat: 8192}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDataplane(t, tc.sz, Timeouts{}) // the datapath's built-in timeouts
			v := variants()[0]
			v.setup(d)
			var tcp []Key
			for i := range tcpFlows {
				k := v.flow(uint16(20000 + i))
				d.send(k, established...)
				tcp = append(tcp, k)
			}
			u := v
			u.proto = ProtoUDP
			u.setup(d)
			for i := range udpFlows {
				d.send(u.flow(uint16(30000 + i)))
			}

			lostNAT, lostCT := 0, 0
			for _, k := range tcp {
				if _, ok := d.lookup(k); !ok {
					lostCT++
				}
				if _, ok := d.natLookup(v.natOf(k, 0)); !ok {
					lostNAT++
				}
			}
			_, broken := d.pairing()
			t.Logf("before GC: %d broken halves; TCP flows lost %d conntrack and %d NAT halves", broken, lostCT, lostNAT)
			if lostCT+lostNAT == 0 {
				t.Fatal("the LRU evicted no half of a live flow; the test proves nothing")
			}

			res := d.gc(now(t) + DefaultTimeouts().UDP + time.Second)
			t.Logf("GC: %v", res)
			flows, broken := d.pairing()
			if flows != tcpFlows || broken != 0 {
				t.Errorf("after GC: %d complete flows, %d broken halves; want %d and 0", flows, broken, tcpFlows)
			}
			if res.NATRepaired != lostNAT || res.CTRepaired != lostCT {
				t.Errorf("repaired %d NAT and %d conntrack halves, want %d and %d", res.NATRepaired, res.CTRepaired, lostNAT, lostCT)
			}
			if udp, _ := d.ct.List(Filter{}); len(udp) != tcpFlows {
				t.Errorf("%d conntrack entries left, want the %d TCP flows", len(udp), tcpFlows)
			}

			// The live flows work both ways: replies are translated, and
			// new packets stay on their backend although the table moved.
			d.table(sid, v.ids[1])
			for _, k := range tcp {
				if got := d.reply(v.backends[0], k); got != v.vip {
					t.Fatalf("%s: reply not translated", k)
				}
				if got := d.send(k, pkt.ACK); got != v.backends[0] {
					t.Fatalf("%s: went to %s, want its backend %s", k, got, v.backends[0])
				}
			}
		})
	}
}

// TestGCModesAgree runs the same mixed GC (every reason, every repair)
// with batch map commands and with the key-by-key fallback, in chunks
// small enough to take several, and requires the same outcome.
func TestGCModesAgree(t *testing.T) {
	d := sharedDataplane(t)
	var results []GCResult
	var survivors [][]Key
	for _, mode := range []string{"batch", "iterate"} {
		t.Run(mode, func(t *testing.T) {
			d.t = t
			d.ct.mode.SetBatch(!(mode == "iterate"))
			d.ct.chunk = mapscan.MinChunk
			t.Cleanup(func() { d.ct.mode.SetBatch(!(false)); d.ct.chunk = mapscan.DefaultChunk })
			d.reset()
			var all []Key
			for _, v := range variants() {
				v.setup(d)
				d.table(sid, v.ids[:]...) // spread new flows over all three
				for i := range 150 {
					k := v.flow(uint16(47000 + i))
					d.send(k, established...)
					all = append(all, k)
				}
			}
			t0 := now(t) + testTimeouts.UDP + time.Second // UDP expired, TCP alive
			for _, v := range variants() {
				d.backend(v.ids[1], sid, v.backends[1], bpf.BackendDraining, t0-1)
				d.removeBackend(v.ids[2])
			}
			// Break pairs the way eviction does.
			for i, k := range all {
				if k.Proto != ProtoTCP {
					continue
				}
				c, _ := d.lookup(k)
				if c.BackendID != 1 && c.BackendID != 4 {
					continue
				}
				switch i % 3 {
				case 1:
					nk, _ := d.natHalf(c, d.backendOf(c.BackendID))
					d.must(d.nat.Delete(nk))
				case 2:
					d.must(d.ct.rawCT(k).Delete(rawKey(k)))
				}
			}
			res := d.gc(t0)
			t.Logf("%s: %v", mode, res)
			if res.Expired == 0 || res.Drained == 0 || res.BackendGone == 0 || res.NATRepaired == 0 || res.CTRepaired == 0 {
				t.Errorf("the scenario misses a reason: %v", res)
			}
			if _, broken := d.pairing(); broken != 0 {
				t.Errorf("%d broken halves after GC", broken)
			}
			left, err := d.ct.List(Filter{})
			d.must(err)
			var keys []Key
			for _, e := range left {
				keys = append(keys, e.Key)
			}
			slices.SortFunc(keys, func(a, b Key) int { return strings.Compare(a.String(), b.String()) })
			results = append(results, res)
			survivors = append(survivors, keys)
		})
	}
	if len(results) == 2 && (results[0] != results[1] || !slices.Equal(survivors[0], survivors[1])) {
		t.Errorf("batch and iteration disagree:\n%v\n%v", results[0], results[1])
	}
}

func TestGCStopsOnContext(t *testing.T) {
	d := sharedDataplane(t)
	v := variants()[0]
	v.setup(d)
	d.send(v.flow(48000))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	res, err := d.ct.GC(ctx, now(t))
	if !errors.Is(err, context.Canceled) || res != (GCResult{}) {
		t.Errorf("GC with a canceled context = %v, %v", res, err)
	}
	if _, err := d.ct.GC(context.Background(), -1); err == nil {
		t.Error("GC at a negative time succeeded")
	}
	if _, ok := d.lookup(v.flow(48000)); !ok {
		t.Error("a stopped GC removed an entry")
	}
}

func TestNowIsTheDatapathClock(t *testing.T) {
	d := sharedDataplane(t)
	v := variants()[0]
	v.setup(d)
	before, err := Now()
	if err != nil {
		t.Fatal(err)
	}
	k := v.flow(48001)
	d.send(k)
	after, _ := Now()
	e, _ := d.lookup(k)
	// Both sides read the same coarse clock, so the stamp lies between.
	if e.Created < before || e.Created > after {
		t.Errorf("created %v, not within [%v, %v]", e.Created, before, after)
	}
}

// TestMapOverReopenedPins is a daemon restart: the flows live in pinned
// maps, a new process opens the pins and its Map sees and collects them.
func TestMapOverReopenedPins(t *testing.T) {
	root := testenv.PinRoot(t)
	d := sharedDataplane(t)
	maps := map[string]*ebpf.Map{
		"fluxvm_fct4": d.o.Maps.FluxvmFct4, "fluxvm_fct6": d.o.Maps.FluxvmFct6,
		"fluxvm_nat4": d.o.Maps.FluxvmNat4, "fluxvm_nat6": d.o.Maps.FluxvmNat6, "fluxvm_backends": d.o.Maps.FluxvmBackends,
	}
	for name, m := range maps {
		if err := m.Pin(filepath.Join(root, name)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Unpin() })
	}
	v := variants()[0]
	v.setup(d)
	k := v.flow(49000)
	d.send(k, established...)
	before, _ := d.lookup(k)

	open := map[string]*ebpf.Map{}
	for name := range maps {
		m, err := ebpf.LoadPinnedMap(filepath.Join(root, name), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		open[name] = m
	}
	tab, err := nat.New(open["fluxvm_nat4"], open["fluxvm_nat6"])
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(Config{CT4: open["fluxvm_fct4"], CT6: open["fluxvm_fct6"], Backends: open["fluxvm_backends"], NAT: tab, Timeouts: testTimeouts})
	if err != nil {
		t.Fatal(err)
	}
	if e, err := m.Lookup(k); err != nil || e != before {
		t.Fatalf("reopened Lookup = %+v, %v; want %+v", e, err, before)
	}
	res, err := m.GC(context.Background(), before.Deadline+1)
	if err != nil || res.Expired != 1 || res.PairedNATRemoved != 1 {
		t.Fatalf("reopened GC = %v, %v", res, err)
	}
	// The loaded object's own handles see the same maps.
	if _, ok := d.lookup(k); ok {
		t.Error("entry still visible to the loader's handle")
	}
	if _, ok := d.natLookup(v.natOf(k, 0)); ok {
		t.Error("NAT half still visible to the loader's handle")
	}
}
