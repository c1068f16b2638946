package conntrack

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/nat"
)

const tcShot = 2 // TC_ACT_SHOT: dropped

// nsVariants are the variants with a client outside the node, for the
// north-south ingress program.
func nsVariants() []variant {
	out := variants()
	for i := range out {
		if out[i].client.Is4() {
			out[i].client = netip.MustParseAddr("198.51.100.7")
		} else {
			out[i].client = netip.MustParseAddr("2001:db8:100::7")
		}
	}
	return out
}

// nsSetup installs the variant's service as a north-south frontend with
// extra frontend flags (bpf.SvcFlagDSR, bpf.SvcFlagHostRouting), its three
// backends Ready, every new flow going to the first, and the SNAT
// configuration.
func nsSetup(d *dataplane, v variant, flags uint32) {
	for i, b := range v.backends {
		d.backend(v.ids[i], sid, b, bpf.BackendReady, 0)
	}
	d.serviceFlags(sid, v.vip, v.proto, bpf.SvcFlagNorthSouth|flags, v.ids[0])
	d.snatConfig()
}

func snatAddr(v variant) netip.Addr {
	if v.client.Is4() {
		return snat4
	}
	return snat6
}

// learnSNAT makes the north-south program learn flow k and returns its
// conntrack entry, checking that the packet left SNATed to the entry's
// SNAT address and port toward backend 0.
func learnSNAT(t *testing.T, d *dataplane, v variant, k Key) Entry {
	t.Helper()
	verdict, src, dst := d.sendNS(k, established...)
	if verdict != tcOK {
		t.Fatalf("%s: north-south verdict %d, want TC_ACT_OK", k, int32(verdict))
	}
	e, ok := d.lookup(k)
	if !ok {
		t.Fatalf("%s: no conntrack entry", k)
	}
	if e.Kind != SNAT || e.SNAT != src || dst != v.backends[0] {
		t.Fatalf("%s: entry kind %s, SNAT %s; packet left %s -> %s", k, e.Kind, e.SNAT, src, dst)
	}
	if p := e.SNAT.Port(); e.SNAT.Addr() != snatAddr(v) || p < snatPortMin || p > snatPortMax {
		t.Fatalf("%s: SNAT %s is not the configured address and range", k, e.SNAT)
	}
	return e
}

// snatKey is the reverse-NAT key of SNAT flow e on the variant's backend i.
func snatKey(v variant, e Entry, i int) nat.Key {
	return nat.Key{Backend: v.backends[i], Client: e.SNAT, Proto: e.Proto}
}

func establishedTimeout(v variant) time.Duration {
	if v.proto == ProtoTCP {
		return testTimeouts.TCPEstablished
	}
	return testTimeouts.UDP
}

func establishedState(v variant) bpf.CTState {
	if v.proto == ProtoTCP {
		return bpf.CTTCPEstablished
	}
	return bpf.CTUDP
}

// TestSNATEntriesFromTheDatapath: both halves of a flow the real
// north-south program learned read back typed: the conntrack entry with
// its kind and SNAT address and port, the reverse-NAT half as an SNAT
// mapping back to the client, with the host-routing flag when the service
// has it; and Filter selects by kind.
func TestSNATEntriesFromTheDatapath(t *testing.T) {
	d := sharedDataplane(t)
	for _, v := range nsVariants() {
		for _, hr := range []bool{false, true} {
			name := v.name
			flags := uint32(0)
			if hr {
				name += "_host_routing"
				flags = bpf.SvcFlagHostRouting
			}
			t.Run(name, func(t *testing.T) {
				d.t = t
				d.reset()
				nsSetup(d, v, flags)
				k := v.flow(46100)
				before := now(t)
				e := learnSNAT(t, d, v, k)
				want := Entry{Key: k, ServiceID: sid, BackendID: v.ids[0], State: establishedState(v),
					Created: e.Created, LastSeen: e.LastSeen, Deadline: e.LastSeen + establishedTimeout(v),
					Kind: SNAT, SNAT: e.SNAT}
				if e != want || e.Created < before-time.Second {
					t.Errorf("conntrack %+v\nwant      %+v", e, want)
				}
				n, ok := d.natLookup(snatKey(v, e, 0))
				wantNAT := nat.Entry{Key: snatKey(v, e, 0), VIP: v.vip, ServiceID: sid, BackendID: v.ids[0],
					LastSeen: n.LastSeen, SNAT: true, Origin: k.Client, HostRouting: hr}
				if !ok || n != wantNAT {
					t.Errorf("NAT half %+v (present %v)\nwant %+v", n, ok, wantNAT)
				}
				if _, ok := d.natLookup(v.natOf(k, 0)); ok {
					t.Error("an SNAT flow has an east-west NAT half too")
				}
				// A reply to the SNAT address goes back to the client
				// from the VIP.
				if !d.replyNS(v.backends[0], e.SNAT, k) {
					t.Error("reply to the SNAT address not translated back")
				}
				for _, f := range []struct {
					kinds []Kind
					n     int
				}{{nil, 1}, {[]Kind{SNAT}, 1}, {[]Kind{EastWest, DSR}, 0}, {[]Kind{}, 0}} {
					if got, err := d.ct.List(Filter{Kinds: f.kinds}); err != nil || len(got) != f.n || (f.n == 1 && got[0] != e) {
						t.Errorf("List(Kinds %v) = %+v, %v; want %d entries", f.kinds, got, err, f.n)
					}
				}
				if flows, broken := d.pairing(); flows != 1 || broken != 0 {
					t.Errorf("%d flows, %d broken halves; want 1 and 0", flows, broken)
				}
			})
		}
	}
}

// TestGCSNATFlowLifecycle: an SNAT flow the real north-south program
// created keeps both halves through GC while it lives, and loses both
// together when it expires.
func TestGCSNATFlowLifecycle(t *testing.T) {
	d := sharedDataplane(t)
	for _, v := range nsVariants() {
		t.Run(v.name, func(t *testing.T) {
			d.t = t
			d.reset()
			nsSetup(d, v, 0)
			k := v.flow(46200)
			e := learnSNAT(t, d, v, k)
			nk := snatKey(v, e, 0)
			if res := d.gc(e.Deadline); res != (GCResult{Scanned: 1, NATScanned: 1}) {
				t.Errorf("GC at the deadline: %v", res)
			}
			if _, ok := d.natLookup(nk); !ok {
				t.Fatal("GC removed the mapping of a live flow")
			}
			if !d.replyNS(v.backends[0], e.SNAT, k) {
				t.Error("reply not translated after GC")
			}
			if res := d.gc(e.Deadline + 1); res != (GCResult{Scanned: 1, Expired: 1, PairedNATRemoved: 1}) {
				t.Errorf("GC past the deadline: %v", res)
			}
			if _, ok := d.lookup(k); ok {
				t.Error("expired conntrack entry survived")
			}
			if _, ok := d.natLookup(nk); ok {
				t.Error("mapping of an expired flow survived")
			}
		})
	}
}

// TestGCPairingSNAT: the pairing rule for north-south flows with SNAT,
// whose reverse-NAT half is keyed by the SNAT address and port.
func TestGCPairingSNAT(t *testing.T) {
	d := sharedDataplane(t)
	// otherClient is another client that could hold the flow's SNAT port.
	otherClient := func(k Key) netip.AddrPort { return netip.AddrPortFrom(k.Client.Addr().Next(), k.Client.Port()) }
	tests := []struct {
		name string
		// run breaks flow k (learned as e on the variant's backend 0) and
		// returns when GC should run.
		run   func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration
		check func(t *testing.T, d *dataplane, v variant, k Key, e Entry)
		want  GCResult
		// broken is the number of broken halves left after GC.
		broken int
	}{
		{"complete flow is kept", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			return now(t)
		}, nil, GCResult{Scanned: 1, NATScanned: 1}, 0},

		{"evicted mapping is recreated with the SNAT key and translates replies", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			d.must(d.nat.Delete(snatKey(v, e, 0)))
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key, e Entry) {
			c, _ := d.lookup(k)
			n, ok := d.natLookup(snatKey(v, e, 0))
			want := nat.Entry{Key: snatKey(v, e, 0), VIP: v.vip, ServiceID: sid, BackendID: v.ids[0],
				LastSeen: c.LastSeen, SNAT: true, Origin: k.Client}
			if !ok || n != want {
				t.Errorf("mapping %+v (present %v)\nwant %+v", n, ok, want)
			}
			if !d.replyNS(v.backends[0], e.SNAT, k) {
				t.Error("reply not translated by the repaired mapping")
			}
			if verdict, src, _ := d.sendNS(k, pkt.ACK); verdict != tcOK || src != e.SNAT {
				t.Errorf("the datapath does not take the repaired mapping as the flow's: verdict %d, source %s", int32(verdict), src)
			}
		}, GCResult{Scanned: 1, NATRepaired: 1}, 0},

		{"lost conntrack half is recreated from a fresh mapping, SNAT port and all", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			d.must(d.ct.rawCT(k).Delete(rawKey(k)))
			n, _ := d.natLookup(snatKey(v, e, 0))
			return n.LastSeen + establishedTimeout(v) // the last fresh instant
		}, func(t *testing.T, d *dataplane, v variant, k Key, e Entry) {
			n, _ := d.natLookup(snatKey(v, e, 0))
			c, ok := d.lookup(k)
			want := Entry{Key: k, ServiceID: sid, BackendID: v.ids[0], State: establishedState(v),
				Created: n.LastSeen, LastSeen: n.LastSeen, Deadline: n.LastSeen + establishedTimeout(v),
				Kind: SNAT, SNAT: e.SNAT}
			if !ok || c != want {
				t.Errorf("conntrack %+v (present %v)\nwant %+v", c, ok, want)
			}
			d.table(sid, v.ids[1])
			if verdict, src, dst := d.sendNS(k, pkt.ACK); verdict != tcOK || src != e.SNAT || dst != v.backends[0] {
				t.Errorf("repaired flow left %s -> %s (verdict %d), want %s -> %s", src, dst, int32(verdict), e.SNAT, v.backends[0])
			}
		}, GCResult{NATScanned: 1, CTRepaired: 1}, 0},

		{"mapping without conntrack idle past the timeout is removed", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			d.must(d.ct.rawCT(k).Delete(rawKey(k)))
			n, _ := d.natLookup(snatKey(v, e, 0))
			return n.LastSeen + establishedTimeout(v) + 1
		}, nil, GCResult{NATScanned: 1, StaleNATRemoved: 1}, 0},

		{"mapping without conntrack whose backend keeps no flows is removed", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			d.must(d.ct.rawCT(k).Delete(rawKey(k)))
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendUnhealthy, 0)
			return now(t)
		}, nil, GCResult{NATScanned: 1, StaleNATRemoved: 1}, 0},

		{"backend removed: both halves go", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			d.removeBackend(v.ids[0])
			return now(t)
		}, nil, GCResult{Scanned: 1, BackendGone: 1, NATScanned: 1, StaleNATRemoved: 1}, 0},

		{"drained: both halves go", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			t0 := now(t)
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendDraining, t0)
			return t0
		}, nil, GCResult{Scanned: 1, Drained: 1, PairedNATRemoved: 1}, 0},

		{"mapping of another SNAT port for the same flow is superseded", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			other := snatKey(v, e, 0)
			other.Client = netip.AddrPortFrom(e.SNAT.Addr(), e.SNAT.Port()^1)
			d.must(d.nat.Put(nat.Entry{Key: other, VIP: v.vip, ServiceID: sid, BackendID: v.ids[0],
				LastSeen: e.LastSeen, SNAT: true, Origin: k.Client}))
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key, e Entry) {
			if all, _ := d.nat.List(nat.Filter{}); len(all) != 1 || all[0].Key != snatKey(v, e, 0) {
				t.Errorf("NAT entries left %+v, want only the flow's own mapping", all)
			}
		}, GCResult{Scanned: 1, NATScanned: 2, SupersededNATRemoved: 1}, 0},

		{"east-west entry whose flow is SNAT is superseded", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			d.must(d.nat.Put(nat.Entry{Key: v.natOf(k, 0), VIP: v.vip, ServiceID: sid, BackendID: v.ids[0], LastSeen: e.LastSeen}))
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key, e Entry) {
			if _, ok := d.natLookup(v.natOf(k, 0)); ok {
				t.Error("east-west entry survived")
			}
			if _, ok := d.natLookup(snatKey(v, e, 0)); !ok {
				t.Error("the flow's own mapping went")
			}
		}, GCResult{Scanned: 1, NATScanned: 2, SupersededNATRemoved: 1}, 0},

		{"failover leaves a superseded mapping, which goes", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			d.backend(v.ids[0], sid, v.backends[0], bpf.BackendUnhealthy, 0)
			d.table(sid, v.ids[1])
			if verdict, _, dst := d.sendNS(k, pkt.ACK); verdict != tcOK || dst != v.backends[1] {
				t.Fatalf("failover went to %s (verdict %d)", dst, int32(verdict))
			}
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key, e Entry) {
			if _, ok := d.natLookup(snatKey(v, e, 0)); ok {
				t.Error("old backend's mapping survived")
			}
			c, _ := d.lookup(k)
			if c.Kind != SNAT || !d.replyNS(v.backends[1], c.SNAT, k) {
				t.Errorf("new backend's replies are not translated (%+v)", c)
			}
		}, GCResult{Scanned: 1, NATScanned: 2, SupersededNATRemoved: 1}, 0},

		{"port taken by another flow after eviction: repair leaves it, the datapath remaps", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			nk := snatKey(v, e, 0)
			d.must(d.nat.Delete(nk))
			t0 := now(t)
			d.must(d.nat.Put(nat.Entry{Key: nk, VIP: v.vip, ServiceID: sid, BackendID: v.ids[0],
				LastSeen: t0, SNAT: true, Origin: otherClient(k)}))
			return t0
		}, func(t *testing.T, d *dataplane, v variant, k Key, e Entry) {
			if n, _ := d.natLookup(snatKey(v, e, 0)); n.Origin != otherClient(k) {
				t.Errorf("the other flow's mapping was replaced: %+v", n)
			}
			// The other flow got its conntrack half back; this one keeps
			// its entry until its next packet, which maps it afresh to
			// another port and leaves the other flow's mapping alone.
			if c, ok := d.lookup(Key{Client: otherClient(k), VIP: v.vip, Proto: k.Proto}); !ok || c.Kind != SNAT || c.SNAT != e.SNAT {
				t.Errorf("other flow's conntrack %+v (present %v)", c, ok)
			}
			verdict, src, _ := d.sendNS(k, pkt.ACK)
			if verdict != tcOK || src == e.SNAT || src.Addr() != e.SNAT.Addr() {
				t.Errorf("conflicting flow's packet: verdict %d from %s, want TC_ACT_OK from a new port of %s", int32(verdict), src, e.SNAT.Addr())
			}
			if c, ok := d.lookup(k); !ok || c.SNAT != src {
				t.Errorf("remapped flow's conntrack %+v (present %v), want SNAT %s", c, ok, src)
			}
			if n, _ := d.natLookup(snatKey(v, e, 0)); n.Origin != otherClient(k) {
				t.Errorf("the other flow's mapping was replaced by the remap: %+v", n)
			}
		}, GCResult{Scanned: 1, NATScanned: 1, CTRepaired: 1}, 1},

		{"expired flow leaves the mapping another flow now holds", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			nk := snatKey(v, e, 0)
			d.must(d.nat.Delete(nk))
			at := e.Deadline + 1
			d.must(d.nat.Put(nat.Entry{Key: nk, VIP: v.vip, ServiceID: sid, BackendID: v.ids[0],
				LastSeen: at, SNAT: true, Origin: otherClient(k)}))
			return at
		}, func(t *testing.T, d *dataplane, v variant, k Key, e Entry) {
			if n, ok := d.natLookup(snatKey(v, e, 0)); !ok || n.Origin != otherClient(k) {
				t.Errorf("the other flow's mapping %+v (present %v)", n, ok)
			}
			if _, ok := d.lookup(k); ok {
				t.Error("expired entry survived")
			}
		}, GCResult{Scanned: 1, Expired: 1, NATScanned: 1, CTRepaired: 1}, 0},
	}
	for _, v := range nsVariants() {
		t.Run(v.name, func(t *testing.T) {
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					d.t = t
					d.reset()
					nsSetup(d, v, 0)
					k := v.flow(46300)
					e := learnSNAT(t, d, v, k)
					at := tt.run(t, d, v, k, e)
					if res := d.gc(at); res != tt.want {
						t.Errorf("GC: %v\nwant %v", res, tt.want)
					}
					if _, broken := d.pairing(); broken != tt.broken {
						t.Errorf("%d broken halves after GC, want %d", broken, tt.broken)
					}
					if tt.check != nil {
						tt.check(t, d, v, k, e)
					}
				})
			}
		})
	}
}

// TestGCDSR: routed DSR flows have no reverse-NAT half, GC never makes one
// and never takes an east-west entry for theirs.
func TestGCDSR(t *testing.T) {
	d := sharedDataplane(t)
	tests := []struct {
		name  string
		run   func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration
		check func(t *testing.T, d *dataplane, v variant, k Key, e Entry)
		want  GCResult
		nats  int // reverse-NAT entries left
	}{
		{"live flow is kept alone", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			return e.Deadline
		}, nil, GCResult{Scanned: 1}, 0},

		{"no NAT half is made when repairs run", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			// A stored east-west flow of another service with its NAT
			// half lost makes sweep 3 run.
			vip := netip.AddrPortFrom(v.vip.Addr(), 81)
			bid := v.ids[0] + 10
			d.backend(bid, sid+1, v.backends[1], bpf.BackendReady, 0)
			d.serviceFlags(sid+1, vip, v.proto, bpf.SvcFlagRevStored, bid)
			ew := Key{Client: netip.AddrPortFrom(v.client, 46401), VIP: vip, Proto: v.proto}
			d.send(ew, established...)
			d.must(d.nat.Delete(nat.Key{Backend: v.backends[1], Client: ew.Client, Proto: ew.Proto}))
			return now(t)
		}, nil, GCResult{Scanned: 2, NATRepaired: 1}, 1},

		{"expired flow goes without a NAT half", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			return e.Deadline + 1
		}, nil, GCResult{Scanned: 1, Expired: 1}, 0},

		{"backend removed", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			d.removeBackend(v.ids[0])
			return now(t)
		}, nil, GCResult{Scanned: 1, BackendGone: 1}, 0},

		{"east-west entry whose flow is DSR is superseded", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			d.must(d.nat.Put(nat.Entry{Key: v.natOf(k, 0), VIP: v.vip, ServiceID: sid, BackendID: v.ids[0], LastSeen: e.LastSeen}))
			return now(t)
		}, func(t *testing.T, d *dataplane, v variant, k Key, e Entry) {
			if c, _ := d.lookup(k); c != e {
				t.Errorf("DSR entry changed: %+v\nwas %+v", c, e)
			}
		}, GCResult{Scanned: 1, NATScanned: 1, SupersededNATRemoved: 1}, 0},

		{"SNAT mapping whose flow is DSR is superseded", func(t *testing.T, d *dataplane, v variant, k Key, e Entry) time.Duration {
			nk := nat.Key{Backend: v.backends[0], Client: netip.AddrPortFrom(snatAddr(v), snatPortMin), Proto: k.Proto}
			d.must(d.nat.Put(nat.Entry{Key: nk, VIP: v.vip, ServiceID: sid, BackendID: v.ids[0], LastSeen: e.LastSeen,
				SNAT: true, Origin: k.Client}))
			return now(t)
		}, nil, GCResult{Scanned: 1, NATScanned: 1, SupersededNATRemoved: 1}, 0},
	}
	for _, v := range nsVariants() {
		t.Run(v.name, func(t *testing.T) {
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					d.t = t
					d.reset()
					nsSetup(d, v, bpf.SvcFlagDSR)
					k := v.flow(46400)
					// The test namespace has no route to the backend, so
					// the program drops the packet (DSR_NO_ROUTE); it has
					// learned the flow before.
					d.sendNS(k, established...)
					e, ok := d.lookup(k)
					if !ok || e.Kind != DSR || e.SNAT.IsValid() || e.BackendID != v.ids[0] || e.State != establishedState(v) {
						t.Fatalf("DSR flow: %+v (present %v)", e, ok)
					}
					if all, _ := d.nat.List(nat.Filter{}); len(all) != 0 {
						t.Fatalf("the datapath made NAT entries for a DSR flow: %+v", all)
					}
					at := tt.run(t, d, v, k, e)
					if res := d.gc(at); res != tt.want {
						t.Errorf("GC: %v\nwant %v", res, tt.want)
					}
					all, err := d.nat.List(nat.Filter{})
					d.must(err)
					if len(all) != tt.nats {
						t.Errorf("%d NAT entries after GC, want %d: %+v", len(all), tt.nats, all)
					}
					if _, broken := d.pairing(); broken != 0 {
						t.Errorf("%d broken halves after GC", broken)
					}
					if tt.check != nil {
						tt.check(t, d, v, k, e)
					}
				})
			}
		})
	}
}

// TestEntriesOfEveryKindRaw writes conntrack values the way program
// generation 1 left them (migrated zero-extended: no flags), the way
// generation 4 writes east-west flows (bpf.CTFlagRevDerived), and of kinds
// and flags the datapath never writes, and checks how they read and how GC
// treats them.
func TestEntriesOfEveryKindRaw(t *testing.T) {
	d := sharedDataplane(t)
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			d.t = t
			d.reset()
			v.setup(d)
			k := v.flow(46500)
			t0 := now(t)
			base := bpf.CTValue{ServiceId: sid, BackendId: v.ids[0], CreatedNs: uint64(t0), LastSeenNs: uint64(t0),
				DeadlineNs: uint64(t0 + time.Minute), State: uint8(establishedState(v))}
			put := func(ct bpf.CTValue) {
				if k.Family() == IPv4 {
					d.must(d.o.Maps.FluxvmFct4.Put(key4(k), ct))
				} else {
					d.must(d.o.Maps.FluxvmFct6.Put(key6(k), ct))
				}
			}
			ew := nat.Entry{Key: v.natOf(k, 0), VIP: v.vip, ServiceID: sid, BackendID: v.ids[0], LastSeen: t0}

			// Generation 1: no flags, zero tail. An east-west flow, and a
			// stored one (as are generations 2 and 3's).
			put(base)
			d.must(d.nat.Put(ew))
			e, _ := d.lookup(k)
			if e.Kind != EastWest || e.SNAT.IsValid() || e.ReverseDerived || !e.HasNATHalf() {
				t.Errorf("generation-1 entry reads as %+v", e)
			}
			if res := d.gc(t0); res != (GCResult{Scanned: 1, NATScanned: 1}) {
				t.Errorf("GC of a generation-1 flow: %v", res)
			}

			// Derived replies: an east-west flow without a half. The NAT
			// entry at its key is a leftover and goes; GC makes none.
			derived := base
			derived.Flags = bpf.CTFlagRevDerived
			put(derived)
			if e, _ := d.lookup(k); e.Kind != EastWest || !e.ReverseDerived || e.HasNATHalf() {
				t.Errorf("derived entry reads as %+v", e)
			}
			if res := d.gc(t0); res != (GCResult{Scanned: 1, NATScanned: 1, SupersededNATRemoved: 1}) {
				t.Errorf("GC of a derived flow with a leftover half: %v", res)
			}
			if res := d.gc(t0); res != (GCResult{Scanned: 1}) {
				t.Errorf("GC of a derived flow: %v", res)
			}
			if all, _ := d.nat.List(nat.Filter{}); len(all) != 0 {
				t.Errorf("NAT entries left: %+v", all)
			}

			// The flag on an SNAT flow means nothing: its mapping is its
			// half, looked for and repaired as any SNAT flow's.
			snatDerived := base
			snatDerived.Flags = bpf.CTFlagSNAT | bpf.CTFlagRevDerived
			snatDerived.NatPort, snatDerived.NatAddr = bpf.Port(20002), bpf.AddrWords(snatAddr(v))
			put(snatDerived)
			if e, _ := d.lookup(k); e.Kind != SNAT || e.ReverseDerived || !e.HasNATHalf() {
				t.Errorf("SNAT entry with the derived flag reads as %+v", e)
			}
			if res := d.gc(t0); res != (GCResult{Scanned: 1, NATRepaired: 1}) {
				t.Errorf("GC of an SNAT flow with the derived flag: %v", res)
			}
			mk := nat.Key{Backend: v.backends[0], Client: netip.AddrPortFrom(snatAddr(v), 20002), Proto: k.Proto}
			if n, ok := d.natLookup(mk); !ok || !n.SNAT || n.Origin != k.Client {
				t.Errorf("SNAT mapping %+v (present %v)", n, ok)
			}
			d.must(d.nat.Delete(mk))
			put(base)
			d.must(d.nat.Put(ew))

			// SNAT words without the flag mean nothing.
			junk := base
			junk.NatPort, junk.NatAddr = bpf.Port(20001), bpf.AddrWords(snatAddr(v))
			put(junk)
			if e, _ := d.lookup(k); e.Kind != EastWest || e.SNAT.IsValid() {
				t.Errorf("unflagged SNAT words read as %s, SNAT %s", e.Kind, e.SNAT)
			}

			// Both kind bits: no kind the datapath writes. No NAT half
			// pairs with it, none is made for it.
			both := base
			both.Flags = bpf.CTFlagSNAT | bpf.CTFlagDSR
			put(both)
			if e, _ := d.lookup(k); e.Kind != Kind(3) || e.Kind.String() != "kind(3)" || e.SNAT.IsValid() {
				t.Errorf("both kind bits read as %s, SNAT %s", e.Kind, e.SNAT)
			}
			if res := d.gc(t0); res != (GCResult{Scanned: 1, NATScanned: 1, SupersededNATRemoved: 1}) {
				t.Errorf("GC: %v", res)
			}
			if all, _ := d.nat.List(nat.Filter{}); len(all) != 0 {
				t.Errorf("NAT entries left: %+v", all)
			}

			// L7 enforce: handed to the proxy, no backend (0, a slot no
			// service owns) and no half. Kept until it expires; a
			// leftover half at its key goes.
			l7 := base
			l7.BackendId, l7.Flags, l7.L7Ifindex = 0, bpf.CTFlagL7, 42
			put(l7)
			d.must(d.nat.Put(ew))
			if e, _ := d.lookup(k); e.Kind != L7 || e.ProxyIfindex != 42 || e.HasNATHalf() || e.SNAT.IsValid() {
				t.Errorf("L7 entry reads as %+v", e)
			}
			if res := d.gc(t0); res != (GCResult{Scanned: 1, NATScanned: 1, SupersededNATRemoved: 1}) {
				t.Errorf("GC of a live L7 flow with a leftover half: %v", res)
			}
			if res := d.gc(t0 + 2*time.Minute); res != (GCResult{Scanned: 1, Expired: 1}) {
				t.Errorf("GC of an expired L7 flow: %v", res)
			}
		})
	}
	var names []string
	for _, k := range []Kind{EastWest, SNAT, DSR, L7} {
		names = append(names, k.String())
	}
	if got := strings.Join(names, ","); got != "east-west,snat,dsr,l7" {
		t.Errorf("kind names %s", got)
	}
}

// TestDeleteKinds: Delete removes an SNAT flow's mapping only while it
// maps back to the flow, and leaves everything else of a DSR flow alone.
func TestDeleteKinds(t *testing.T) {
	d := sharedDataplane(t)
	for _, v := range nsVariants()[:1] {
		d.reset()
		nsSetup(d, v, 0)
		k := v.flow(46600)
		e := learnSNAT(t, d, v, k)
		d.must(d.ct.Delete(k))
		if _, ok := d.natLookup(snatKey(v, e, 0)); ok {
			t.Error("Delete left the flow's mapping")
		}

		e = learnSNAT(t, d, v, k)
		other := netip.AddrPortFrom(k.Client.Addr().Next(), k.Client.Port())
		n, _ := d.natLookup(snatKey(v, e, 0))
		n.Origin = other
		d.must(d.nat.Put(n))
		d.must(d.ct.Delete(k))
		if n, ok := d.natLookup(snatKey(v, e, 0)); !ok || n.Origin != other {
			t.Error("Delete removed another flow's mapping of the same port")
		}

		d.reset()
		nsSetup(d, v, bpf.SvcFlagDSR)
		d.sendNS(k, established...)
		ew := nat.Entry{Key: v.natOf(k, 0), VIP: v.vip, ServiceID: sid, BackendID: v.ids[0], LastSeen: now(t)}
		d.must(d.nat.Put(ew))
		d.must(d.ct.Delete(k))
		if _, ok := d.natLookup(ew.Key); !ok {
			t.Error("Delete of a DSR flow removed an east-west NAT entry")
		}
		if _, ok := d.lookup(k); ok {
			t.Error("DSR entry survived Delete")
		}
	}
}
