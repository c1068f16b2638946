package conntrack

import (
	"context"
	"errors"
	"net/netip"
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
// with its NAT half if it is stored (none is looked for if its replies are
// derived), and not a nanosecond before.
func TestGCExpiresEachStateOnItsTimeout(t *testing.T) {
	d := sharedDataplane(t)
	for _, v := range []variant{variants()[0], variants()[2], storedVariants()[0], storedVariants()[2]} {
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
				d.removed, d.removedIdle = nil, nil
				res := d.gc(e.Deadline + 1)
				if !slices.Equal(d.removed, []Key{f.k}) {
					t.Errorf("GC just past the %s deadline told Config.Removed of %v, want [%s]", f.state, d.removed, f.k)
				}
				// Idle for its timeout and a nanosecond: what a target of
				// replication weighs the delete against.
				if want := e.Deadline + 1 - e.LastSeen; len(d.removedIdle) != 1 || d.removedIdle[0] != want {
					t.Errorf("GC just past the %s deadline told idle %v, want %v", f.state, d.removedIdle, want)
				}
				want := GCResult{Scanned: len(flows) - i, Expired: 1, PairedNATRemoved: v.halves(), NATScanned: (len(flows) - i - 1) * v.halves()}
				if res != want {
					t.Errorf("GC just past the %s deadline: %v\nwant %v", f.state, res, want)
				}
				for j, g := range flows {
					_, ok := d.lookup(g.k)
					_, nok := d.natLookup(v.natOf(g.k, 0))
					if gone := j <= i; ok == gone || nok != (v.stored && !gone) {
						t.Errorf("after the %s deadline: %s (%s) conntrack %v, NAT %v", f.state, g.k, g.state, ok, nok)
					}
				}
			}
		})
	}
}

// TestGCBackendReasons: the backend's state decides, as the datapath would.
// A stored flow goes with its NAT half (named from the conntrack side, or
// found without its conntrack half when the backend slot is gone); a flow
// with derived replies has none, and GC neither removes nor finds one.
func TestGCBackendReasons(t *testing.T) {
	d := sharedDataplane(t)
	tests := []struct {
		name string
		// change alters the flow's backend (index 0 of the variant) at
		// time t0; GC then runs at t0.
		change func(d *dataplane, v variant, t0 time.Duration)
		// want is the result for a stored flow, derived for a flow with
		// derived replies.
		want, derived GCResult
		removed       bool
		deadline      bool // run GC past the flow's own deadline instead
	}{
		{"ready keeps", func(*dataplane, variant, time.Duration) {},
			GCResult{Scanned: 1, NATScanned: 1},
			GCResult{Scanned: 1}, false, false},
		{"unhealthy keeps: the datapath moves the flow on its next packet", func(d *dataplane, v variant, _ time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendUnhealthy, 0)
		}, GCResult{Scanned: 1, NATScanned: 1},
			GCResult{Scanned: 1}, false, false},
		{"draining before its deadline keeps", func(d *dataplane, v variant, t0 time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0+1)
		}, GCResult{Scanned: 1, NATScanned: 1},
			GCResult{Scanned: 1}, false, false},
		{"draining at its deadline removes (the datapath's now < drain_until)", func(d *dataplane, v variant, t0 time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0)
		}, GCResult{Scanned: 1, Drained: 1, PairedNATRemoved: 1},
			GCResult{Scanned: 1, Drained: 1}, true, false},
		{"draining past its deadline removes", func(d *dataplane, v variant, t0 time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0-time.Second)
		}, GCResult{Scanned: 1, Drained: 1, PairedNATRemoved: 1},
			GCResult{Scanned: 1, Drained: 1}, true, false},
		{"backend removed", func(d *dataplane, v variant, _ time.Duration) {
			d.removeBackend(v.ids[0])
		}, GCResult{Scanned: 1, BackendGone: 1, NATScanned: 1, StaleNATRemoved: 1},
			GCResult{Scanned: 1, BackendGone: 1}, true, false},
		{"backend slot given to another service", func(d *dataplane, v variant, _ time.Duration) {
			d.backend(v.ids[0], sid+1, v.backends[2], bpf.BackendReady, 0)
		}, GCResult{Scanned: 1, BackendGone: 1, NATScanned: 1, StaleNATRemoved: 1},
			GCResult{Scanned: 1, BackendGone: 1}, true, false},
		{"expired and drained counts as expired", func(d *dataplane, v variant, t0 time.Duration) {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0)
		}, GCResult{Scanned: 1, Expired: 1, PairedNATRemoved: 1},
			GCResult{Scanned: 1, Expired: 1}, true, true},
	}
	for _, v := range append(variants(), storedVariants()...) {
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
					if e.ReverseDerived == v.stored {
						t.Fatalf("flow of a frontend with stored=%v: %+v", v.stored, e)
					}
					tt.change(d, v, t0)
					want := tt.want
					if !v.stored {
						want = tt.derived
					}
					if res := d.gc(t0); res != want {
						t.Errorf("GC: %v\nwant %v", res, want)
					}
					_, ok := d.lookup(k)
					_, nok := d.natLookup(v.natOf(k, 0))
					if ok == tt.removed || nok != (v.stored && !tt.removed) {
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
// work in the real program afterwards. These are stored flows (a frontend
// with bpf.SvcFlagRevStored): flows with derived replies have no half to
// lose (TestGCDerived).
func TestGCPairing(t *testing.T) {
	const flowID = 0x5eed
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
			// The flow's FluxScope record goes with it into the new half.
			var raw bpf.CTValue
			d.must(d.ct.rawCT(k).Lookup(rawKey(k), &raw))
			raw.Flow = flowID
			d.must(d.ct.rawCT(k).Put(rawKey(k), &raw))
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key) {
			c, _ := d.lookup(k)
			e, ok := d.natLookup(v.natOf(k, 0))
			want := nat.Entry{Key: v.natOf(k, 0), VIP: v.vip, ServiceID: sid, BackendID: v.ids[0], LastSeen: c.LastSeen, Flow: flowID}
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
			// The flow's FluxScope record goes with it into the new half.
			d.must(d.nat.Delete(n.Key))
			n.Flow = flowID
			d.must(d.nat.Create(n))
			return n.LastSeen + timeout(v) // the last fresh instant
		}, func(t *testing.T, d *dataplane, v variant, k Key) {
			n, _ := d.natLookup(v.natOf(k, 0))
			c, ok := d.lookup(k)
			state := bpf.CTUDP
			if v.proto == ProtoTCP {
				state = bpf.CTTCPEstablished
			}
			want := Entry{Key: k, ServiceID: sid, BackendID: v.ids[0], State: state,
				Created: n.LastSeen, LastSeen: n.LastSeen, Deadline: n.LastSeen + timeout(v), Flow: flowID}
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
	for _, v := range storedVariants() {
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

// TestGCDerived: a flow with derived replies (the datapath's default for
// east-west flows) has no reverse-NAT half and never gets one; an
// east-west entry at its key is a leftover of an earlier, stored flow on
// the tuple and goes; sweep 3 runs only for entries that need a half.
func TestGCDerived(t *testing.T) {
	d := sharedDataplane(t)
	// other learns a flow of another service (sid+1, VIP port 81, on
	// backends[1] as id ids[0]+10), stored when stored is set, and
	// returns it with its NAT key.
	other := func(t *testing.T, d *dataplane, v variant, stored bool) (Key, nat.Key) {
		t.Helper()
		var flags uint32
		if stored {
			flags = bpf.SvcFlagRevStored
		}
		vip := netip.AddrPortFrom(v.vip.Addr(), 81)
		bid := v.ids[0] + 10
		d.backend(bid, sid+1, v.backends[1], bpf.BackendReady, 0)
		d.serviceFlags(sid+1, vip, v.proto, flags, bid)
		k := Key{Client: netip.AddrPortFrom(v.client, 46601), VIP: vip, Proto: v.proto}
		d.send(k, established...)
		return k, nat.Key{Backend: v.backends[1], Client: k.Client, Proto: k.Proto}
	}
	leftover := func(v variant, k Key, i int, at time.Duration) nat.Entry {
		return nat.Entry{Key: v.natOf(k, i), VIP: v.vip, ServiceID: sid, BackendID: v.ids[i], LastSeen: at}
	}
	tests := []struct {
		name string
		// run changes the maps around flow k (learned as c on the
		// variant's backend 0) and returns when GC should run.
		run   func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration
		check func(t *testing.T, d *dataplane, v variant, k Key, c Entry)
		want  GCResult
		nats  int  // reverse-NAT entries left
		kept  bool // the flow's entry is kept, unchanged
		sweep bool // GC runs sweep 3
	}{
		{"kept without a half: GC makes none and skips repairs", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			return now(t)
		}, nil, GCResult{Scanned: 1}, 0, true, false},

		{"kept beside a complete stored flow: repairs are still skipped", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			other(t, d, v, true)
			return now(t)
		}, nil, GCResult{Scanned: 2, NATScanned: 1}, 1, true, false},

		{"when repairs run for a stored flow, the derived one gets no half", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			_, nk := other(t, d, v, true)
			d.must(d.nat.Delete(nk))
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key, c Entry) {
			nk := nat.Key{Backend: v.backends[1], Client: netip.AddrPortFrom(v.client, 46601), Proto: v.proto}
			if _, ok := d.natLookup(nk); !ok {
				t.Error("the stored flow's half was not repaired")
			}
		}, GCResult{Scanned: 2, NATRepaired: 1}, 1, true, true},

		{"expired: removed alone, no half looked for", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			return c.Deadline + 1
		}, nil, GCResult{Scanned: 1, Expired: 1}, 0, false, false},

		{"expired beside a leftover half: the leftover goes as stale, not as its half", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			d.must(d.nat.Put(leftover(v, k, 0, c.LastSeen)))
			return c.Deadline + 1
		}, nil, GCResult{Scanned: 1, Expired: 1, NATScanned: 1, StaleNATRemoved: 1}, 0, false, false},

		{"drained beside a leftover half: the leftover goes as stale", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			t0 := now(t)
			d.must(d.nat.Put(leftover(v, k, 0, t0)))
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0)
			return t0
		}, nil, GCResult{Scanned: 1, Drained: 1, NATScanned: 1, StaleNATRemoved: 1}, 0, false, false},

		{"a leftover half on its backend is superseded, not its pair", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			// What an earlier, stored flow on the tuple (generation 3, or
			// a frontend that had bpf.SvcFlagRevStored then) left behind
			// when the datapath could not name it.
			d.must(d.nat.Put(leftover(v, k, 0, now(t))))
			return now(t)
		}, nil, GCResult{Scanned: 1, NATScanned: 1, SupersededNATRemoved: 1}, 0, true, false},

		{"a leftover half on another backend is superseded", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			d.must(d.nat.Put(leftover(v, k, 2, now(t))))
			return now(t)
		}, nil, GCResult{Scanned: 1, NATScanned: 1, SupersededNATRemoved: 1}, 0, true, false},

		{"a half without its conntrack entry is repaired as a stored flow", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			// A flow of generation 3 on this frontend whose conntrack
			// half the LRU evicted.
			old := v.flow(46602)
			d.must(d.nat.Put(leftover(v, old, 0, now(t))))
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key, c Entry) {
			old := v.flow(46602)
			e, ok := d.lookup(old)
			if !ok || e.ReverseDerived || !e.HasNATHalf() || e.BackendID != v.ids[0] {
				t.Errorf("repaired entry %+v (present %v), want a stored flow's on backend 0", e, ok)
			}
			if got := d.reply(v.backends[0], old); got != v.vip {
				t.Error("the repaired flow's replies are not translated")
			}
		}, GCResult{Scanned: 1, NATScanned: 1, CTRepaired: 1}, 1, true, false},

		{"failover leaves nothing behind", func(t *testing.T, d *dataplane, v variant, k Key, c Entry) time.Duration {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendUnhealthy, 0)
			d.table(sid, v.ids[1])
			if got := d.send(k, pkt.ACK); got != v.backends[1] {
				t.Fatalf("failover went to %s", got)
			}
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key, c Entry) {
			if e, _ := d.lookup(k); e.BackendID != v.ids[1] || !e.ReverseDerived {
				t.Errorf("entry after the failover %+v", e)
			}
			if got := d.reply(v.backends[1], k); got != v.vip {
				t.Error("the new backend's replies are not translated")
			}
		}, GCResult{Scanned: 1}, 0, false, false},
	}
	sweeps := 0
	testHookRepairSweep = func() { sweeps++ }
	t.Cleanup(func() { testHookRepairSweep = nil })
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					d.t = t
					d.reset()
					v.setup(d)
					k := v.flow(46600)
					d.send(k, established...)
					c, ok := d.lookup(k)
					if !ok || c.Kind != EastWest || !c.ReverseDerived || c.HasNATHalf() {
						t.Fatalf("east-west flow %+v (present %v), want derived replies", c, ok)
					}
					if all, _ := d.nat.List(nat.Filter{}); len(all) != 0 {
						t.Fatalf("the datapath stored NAT entries for a derived flow: %+v", all)
					}
					at := tt.run(t, d, v, k, c)
					sweeps = 0
					if res := d.gc(at); res != tt.want {
						t.Errorf("GC: %v\nwant %v", res, tt.want)
					}
					if ran := sweeps > 0; ran != tt.sweep {
						t.Errorf("sweep 3 ran: %v, want %v", ran, tt.sweep)
					}
					all, err := d.nat.List(nat.Filter{})
					d.must(err)
					if len(all) != tt.nats {
						t.Errorf("%d NAT entries after GC, want %d: %+v", len(all), tt.nats, all)
					}
					if _, ok := d.natLookup(v.natOf(k, 0)); ok {
						t.Error("the derived flow has a NAT half")
					}
					if _, broken := d.pairing(); broken != 0 {
						t.Errorf("%d broken halves after GC", broken)
					}
					if tt.kept {
						if e, ok := d.lookup(k); !ok || e != c {
							t.Errorf("entry %+v (present %v), want it kept as %+v", e, ok, c)
						}
						if got := d.reply(v.backends[0], k); got != v.vip {
							t.Error("the flow's replies are not translated")
						}
					} else if e, ok := d.lookup(k); ok && e.BackendID == c.BackendID {
						t.Errorf("entry %+v survived", e)
					}
					if tt.check != nil {
						tt.check(t, d, v, k, c)
					}
				})
			}
		})
	}
}

// rawCT and rawKey reach the raw conntrack map, to break flows the way
// the LRU does.
func (m *Map) rawCT(k Key) *ebpf.Map {
	if k.Family() == IPv4 {
		return m.flows.Load().ct4
	}
	return m.flows.Load().ct6
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
// the live flows work. The flows are stored ones (bpf.SvcFlagRevStored):
// only they have two halves the LRU can part.
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
			v := storedVariants()[0]
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

// TestGCModesAgree runs the same mixed GC (every reason, every repair,
// flows with derived replies and stored ones) with batch map commands and
// with the key-by-key fallback, in chunks small enough to take several,
// and requires the same outcome.
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
			for _, v := range append(variants(), storedVariants()...) {
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
				if (c.BackendID != 1 && c.BackendID != 4) || !c.HasNATHalf() {
					continue // derived replies: no pair to break
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
	v, sv := variants()[0], storedVariants()[0]
	sv.setup(d)
	sk := sv.flow(49000)
	d.send(sk, established...)
	v.setup(d)
	k := v.flow(49000)
	d.send(k, established...)
	before, _ := d.lookup(k)
	stored, _ := d.lookup(sk)

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
	if e, err := m.Lookup(k); err != nil || e != before || !e.ReverseDerived {
		t.Fatalf("reopened Lookup = %+v, %v; want %+v", e, err, before)
	}
	if e, err := m.Lookup(sk); err != nil || e != stored || e.ReverseDerived {
		t.Fatalf("reopened Lookup = %+v, %v; want %+v", e, err, stored)
	}
	// Both flows expire: the stored one with its NAT half, the derived
	// one alone.
	res, err := m.GC(context.Background(), max(before.Deadline, stored.Deadline)+1)
	if want := (GCResult{Scanned: 2, Expired: 2, PairedNATRemoved: 1}); err != nil || res != want {
		t.Fatalf("reopened GC = %v, %v; want %v", res, err, want)
	}
	// The loaded object's own handles see the same maps.
	if _, ok := d.lookup(k); ok {
		t.Error("entry still visible to the loader's handle")
	}
	if _, ok := d.natLookup(sv.natOf(sk, 0)); ok {
		t.Error("NAT half still visible to the loader's handle")
	}
}

// TestShed: with a horizon, the flows whose deadline falls within it go
// first, counted by state, their NAT halves with them; the others stay,
// and a horizon of 0 is GC. Timeouts (testTimeouts): RST 5s, FIN 15s,
// SYN 20s, UDP 40s, established 300s.
func TestShed(t *testing.T) {
	d := sharedDataplane(t)
	v := storedVariants()[0]
	for _, tc := range []struct {
		horizon time.Duration
		want    ShedCounts
		gone    []bpf.CTState
	}{
		{0, ShedCounts{}, nil},
		{16 * time.Second, ShedCounts{Closed: 2}, []bpf.CTState{bpf.CTTCPFin, bpf.CTTCPRst}},
		{30 * time.Second, ShedCounts{Closed: 2, HalfOpen: 1}, []bpf.CTState{bpf.CTTCPFin, bpf.CTTCPRst, bpf.CTTCPSyn}},
		{50 * time.Second, ShedCounts{Closed: 2, HalfOpen: 1, IdleUDP: 1}, []bpf.CTState{bpf.CTTCPFin, bpf.CTTCPRst, bpf.CTTCPSyn, bpf.CTUDP}},
	} {
		t.Run(tc.horizon.String(), func(t *testing.T) {
			d.t = t
			d.reset()
			keys := map[bpf.CTState]Key{}
			var now time.Duration
			for i, sc := range stateCases {
				v.proto = sc.proto
				v.setup(d)
				k := v.flow(uint16(45000 + i))
				d.send(k, sc.flags...)
				keys[sc.state] = k
				e, ok := d.lookup(k)
				if !ok {
					t.Fatalf("%s: not learned", sc.name)
				}
				now = max(now, e.LastSeen)
			}
			res, err := d.ct.Shed(context.Background(), now, tc.horizon)
			if err != nil {
				t.Fatal(err)
			}
			if res.Shed != tc.want || res.Expired != tc.want.Total() {
				t.Errorf("shed %+v (expired %d), want %+v", res.Shed, res.Expired, tc.want)
			}
			for st, k := range keys {
				_, ok := d.lookup(k)
				_, nok := d.natLookup(v.natOf(k, 0))
				gone := slices.Contains(tc.gone, st)
				if ok == gone || nok == gone {
					t.Errorf("%s: conntrack %v, NAT %v after the shed; want gone %v", st, ok, nok, gone)
				}
			}
		})
	}
}
