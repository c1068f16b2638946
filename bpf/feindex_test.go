package bpf

import (
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// feKeyOf is the fluxvm_svc4 key of an IPv4 frontend.
func feKeyOf(ap netip.AddrPort, proto uint8) SvcKey4 {
	return SvcKey4{Vip: AddrWords(ap.Addr())[0], Port: Port(ap.Port()), Proto: proto}
}

// feSlotIdx is the index slot of k in h's index.
func (h *harness) feSlotIdx(k SvcKey4) uint32 { return feSlotOf(feWord(k), h.fe.bits) }

func (h *harness) feRead(k SvcKey4) Fe4Slot {
	h.t.Helper()
	var s Fe4Slot
	h.must(h.objs.FluxvmFe4.Lookup(h.feSlotIdx(k), &s))
	return s
}

func (h *harness) feWrite(k SvcKey4, s Fe4Slot) {
	h.t.Helper()
	h.must(h.objs.FluxvmFe4.Put(h.feSlotIdx(k), s))
}

// feCollider is an address:port of 10.97.0.0/16 (no VIP of the tests)
// whose key for proto lands in the slot of k, and is no key of svc4.
func (h *harness) feCollider(t *testing.T, k SvcKey4, port uint16, proto uint8) netip.AddrPort {
	t.Helper()
	for i := range 1 << 16 {
		ap := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 97, byte(i >> 8), byte(i)}), port)
		if c := feKeyOf(ap, proto); c != k && h.feSlotIdx(c) == h.feSlotIdx(k) {
			return ap
		}
	}
	t.Fatal("no address of 10.97.0.0/16 shares the slot")
	return netip.AddrPort{}
}

// feOtherBackends are the backends of a second service, apart from the
// variants' own.
var feOtherBackends = []netip.AddrPort{
	netip.MustParseAddrPort("10.2.0.1:9090"),
	netip.MustParseAddrPort("10.2.0.2:9090"),
	netip.MustParseAddrPort("10.2.0.3:9090"),
}

// TestFrontendIndex: the frontend stage of IPv4 packets reads the index
// (fluxvm_fe4) the loader writes, computed the same way in Go and C; each
// slot state answers as its comment says, and every answer the index
// cannot give (a slot never written, shared, or torn) comes from
// fluxvm_svc4. The programs run on real packets; what they forward proves
// which map answered.
func TestFrontendIndex(t *testing.T) {
	testenv.RequirePrivileged(t)
	h := newHarness(t)
	for _, v := range variants()[:2] { // IPv4 TCP and UDP
		key := feKeyOf(v.vip, v.proto)
		cases := []struct {
			name string
			run  func(t *testing.T)
		}{
			{"the index answers alone", func(t *testing.T) {
				if s := h.feRead(key); s.State != FeOne || s.feKey() != key || s.ServiceId != sid || !feValid(s) {
					t.Fatalf("slot after Put: %+v, want this frontend's", s)
				}
				// fluxvm_svc4 loses the entry behind the index's back:
				// only the index can still name the service.
				h.must(h.objs.FluxvmSvc4.Delete(key))
				expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			}},
			{"an empty slot is no frontend", func(t *testing.T) {
				h.feWrite(key, feSlot(FeEmpty, SvcKey4{}, SvcValue{}))
				expectUntouched(t, h, "from_vm", v.fwd(40000, pkt.SYN))
				if _, err := h.fe.Rebuild(); err != nil {
					t.Fatal(err)
				}
				expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			}},
			{"a slot never written asks fluxvm_svc4", func(t *testing.T) {
				h.feWrite(key, Fe4Slot{})
				expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
				// The next write of the frontend writes the slot again.
				h.must(h.fe.Put(key, SvcValue{ServiceId: sid, Revision: 2}))
				if s := h.feRead(key); s.State != FeOne || s.feKey() != key {
					t.Errorf("slot after Put: %+v, want this frontend's", s)
				}
				// An index never built leaves slots alone: it cannot know
				// which other keys of fluxvm_svc4 share them.
				fresh, err := NewFrontendIndex(h.objs.FluxvmSvc4, h.objs.FluxvmFe4)
				if err != nil {
					t.Fatal(err)
				}
				h.feWrite(key, Fe4Slot{})
				h.must(fresh.Put(key, SvcValue{ServiceId: sid, Revision: 3}))
				h.must(fresh.Delete(feKeyOf(v.vip, 99)))
				if s := h.feRead(key); s != (Fe4Slot{}) {
					t.Errorf("an index never built wrote a slot: %+v", s)
				}
				expectForward(t, h, v, 40001, pkt.SYN, v.backends[0])
			}},
			{"a torn slot asks fluxvm_svc4", func(t *testing.T) {
				// Another service's answer with a check that does not
				// match: the program must not believe it.
				torn := feSlot(FeOne, key, SvcValue{ServiceId: sid + 1, Flags: SvcFlagDSR})
				torn.ServiceId = sid + 2
				h.feWrite(key, torn)
				expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
			}},
			{"another key's slot is no frontend", func(t *testing.T) {
				other := h.feCollider(t, key, 80, v.proto)
				expectUntouched(t, h, "from_vm", v.frame(v.clientAt(40000), other, pkt.SYN))
			}},
			{"a shared slot asks fluxvm_svc4", func(t *testing.T) {
				other := h.feCollider(t, key, 80, v.proto)
				second := v
				second.vip, second.backends = other, feOtherBackends
				second.setupAt(h, sid+1, 11)
				if s := h.feRead(key); s.State != FeShared || !feValid(s) {
					t.Fatalf("slot of two frontends: %+v, want shared", s)
				}
				expectForward(t, h, v, 40000, pkt.SYN, v.backends[0])
				expectForward(t, h, second, 40001, pkt.SYN, second.backends[0])
				if st := h.fe.Stats(); st.Shared != 1 || st.Sharing != 2 {
					t.Errorf("stats %+v, want one slot shared by two", st)
				}
				// The other one leaves: the slot answers for this one again.
				h.must(h.fe.Delete(feKeyOf(other, v.proto)))
				expectUntouched(t, h, "from_vm", second.fwd(40002, pkt.SYN))
				if s := h.feRead(key); s.State != FeOne || s.feKey() != key {
					t.Errorf("slot after one of two frontends left: %+v, want this frontend's", s)
				}
				h.must(h.objs.FluxvmSvc4.Delete(key)) // only the index knows it now
				expectForward(t, h, v, 40003, pkt.SYN, v.backends[0])
			}},
			{"a changed frontend is followed", func(t *testing.T) {
				// The frontend moves to another service: new flows follow.
				v2 := v
				v2.vip, v2.backends = netip.MustParseAddrPort("10.96.0.42:80"), feOtherBackends
				v2.setupAt(h, sid+1, 11)
				h.must(h.fe.Put(key, SvcValue{ServiceId: sid + 1, Revision: 2}))
				expectForward(t, h, v, 40000, pkt.SYN, v2.backends[0])
				// And a removed one is gone, though its slot is right.
				h.must(h.fe.Delete(key))
				if s := h.feRead(key); s.State != FeEmpty || !feValid(s) {
					t.Errorf("slot after Delete: %+v, want empty", s)
				}
				expectUntouched(t, h, "from_vm", v.fwd(40001, pkt.SYN))
			}},
		}
		for _, c := range cases {
			t.Run(v.name+"/"+c.name, func(t *testing.T) {
				h.reset()
				v.setup(h)
				c.run(t)
			})
		}
	}
}

// TestFrontendIndexOpen: Open rebuilds the index from the frontends it
// adopts, so a node whose pins predate the index (or whose index was
// damaged) answers from the first packet; Status counts the slots.
func TestFrontendIndexOpen(t *testing.T) {
	testenv.RequirePrivileged(t)
	root := filepath.Join(testenv.PinRoot(t), "service")
	d := openT(t, Options{PinRoot: root, Tier: TierS})
	if st := d.Status().FrontendIndex; st.Slots != 4096 || st.Frontends != 0 || st.One != 0 {
		t.Errorf("empty node's index: %+v, want 4096 slots, nothing in them", st)
	}
	keys := []SvcKey4{
		feKeyOf(netip.MustParseAddrPort("10.96.0.10:80"), ipTCP),
		feKeyOf(netip.MustParseAddrPort("10.96.0.10:0"), ipTCP),
		feKeyOf(netip.MustParseAddrPort("10.96.0.11:53"), ipUDP),
	}
	for i, k := range keys {
		if err := d.PutFrontend4(k, SvcValue{ServiceId: uint32(i + 1), Flags: uint32(i)}); err != nil {
			t.Fatal(err)
		}
	}
	// Damage every slot: never written (as a map an older release pinned
	// would be, had it had one).
	for i := range d.Maps().FluxvmFe4.MaxEntries() {
		if err := d.Maps().FluxvmFe4.Put(i, Fe4Slot{}); err != nil {
			t.Fatal(err)
		}
	}
	d.Close()
	d = openT(t, Options{PinRoot: root, Tier: TierS})
	if st := d.Status().FrontendIndex; st.Frontends != len(keys) || st.One+st.Sharing != len(keys) {
		t.Errorf("index after restart: %+v, want the %d frontends", st, len(keys))
	}
	b, _ := feBits(d.Maps().FluxvmFe4)
	for i, k := range keys {
		var s Fe4Slot
		if err := d.Maps().FluxvmFe4.Lookup(feSlotOf(feWord(k), b), &s); err != nil {
			t.Fatal(err)
		}
		if want := feSlot(FeOne, k, SvcValue{ServiceId: uint32(i + 1), Flags: uint32(i)}); s != want {
			t.Errorf("slot of %+v: %+v, want %+v", k, s, want)
		}
	}
	// Every other slot says: no frontend.
	empty := 0
	var (
		idx uint32
		s   Fe4Slot
	)
	it := d.Maps().FluxvmFe4.Iterate()
	for it.Next(&idx, &s) {
		if s == feSlot(FeEmpty, SvcKey4{}, SvcValue{}) {
			empty++
		}
	}
	if want := 4096 - len(keys); empty != want {
		t.Errorf("%d empty slots, want %d", empty, want)
	}
	// Deleting through the datapath empties the slot and the entry.
	if err := d.DeleteFrontend4(keys[0]); err != nil {
		t.Fatal(err)
	}
	var v SvcValue
	if err := d.Maps().FluxvmSvc4.Lookup(keys[0], &v); err == nil {
		t.Error("fluxvm_svc4 still holds the deleted frontend")
	}
	if err := d.Maps().FluxvmFe4.Lookup(feSlotOf(feWord(keys[0]), b), &s); err != nil || s != feSlot(FeEmpty, SvcKey4{}, SvcValue{}) {
		t.Errorf("slot of the deleted frontend: %+v, %v; want empty", s, err)
	}
}
