package conntrack

import (
	"net/netip"
	"testing"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/nat"
)

// synAck passes a SYN-ACK from backend to the flow's client through the
// program toward the VM and reports whether it left translated to the VIP.
func (d *dataplane) synAck(backend netip.AddrPort, k Key) bool {
	d.t.Helper()
	ret, out := d.run(d.o.Programs.FluxvmToVm, frame(backend, k.Client, k.Proto, pkt.SYNACK))
	if ret != tcOK {
		return false
	}
	src, dst := endpoints(out)
	return src == k.VIP && dst == k.Client
}

// TestTupleReuseAfterRepicksAndRemoval is the churn found under load
// (issue 14, point 1): a client reuses its port for new connections while
// the Maglev table moves (weight changes) and then a backend is removed
// and the GC runs. Every new connection on the reused tuple must work: its
// SYN-ACK is translated, whatever the earlier connections on that tuple
// left behind.
func TestTupleReuseAfterRepicksAndRemoval(t *testing.T) {
	d := sharedDataplane(t)
	for _, v := range append(variants(), storedVariants()...) {
		if v.proto != ProtoTCP {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			d.reset()
			v.setup(d) // B1, B2, B3 Ready; the table sends new flows to B1
			k := v.flow(40000)
			connect := func(want int) {
				t.Helper()
				if got := d.send(k, pkt.SYN); got != v.backends[want] {
					t.Fatalf("SYN went to %s, want backend %d (%s)", got, want, v.backends[want])
				}
				if !d.synAck(v.backends[want], k) {
					t.Fatalf("SYN-ACK of backend %d not translated", want)
				}
				d.send(k, pkt.ACK)
				if got := d.reply(v.backends[want], k); got != v.vip {
					t.Fatalf("reply of backend %d not translated", want)
				}
			}
			closeFlow := func() {
				t.Helper()
				d.send(k, pkt.FIN)
			}

			connect(0)
			closeFlow()
			// A weight change moves the tuple's slot to B2: the reused
			// tuple's fresh SYN re-picks.
			d.table(sid, v.ids[1])
			connect(1)
			closeFlow()
			// The earlier connection's reverse half (stored) must not
			// outlive the re-pick, nor a derived flow get one: nothing but
			// the live flow remains.
			if flows, broken := d.pairing(); flows != 1 || broken != 0 {
				t.Errorf("after the re-pick: %d flows, %d broken halves; want 1 and 0", flows, broken)
			}

			// B2 goes away; the table now sends the tuple to B1 again.
			d.removeBackend(v.ids[1])
			d.table(sid, v.ids[0])
			res := d.gc(now(t))
			t.Logf("GC: %v", res)
			if res.CTRepaired != 0 {
				t.Errorf("GC recreated %d conntrack halves from reverse-NAT entries of finished flows", res.CTRepaired)
			}
			connect(0)
		})
	}
}

// TestFreshSYNOnEstablishedEntry: a SYN without ACK on a tuple whose
// conntrack entry is established (the previous connection's end was not
// seen, or the entry was recreated from its reverse half) is a new
// connection: its SYN-ACK must be translated, not dropped as stale.
func TestFreshSYNOnEstablishedEntry(t *testing.T) {
	d := sharedDataplane(t)
	for _, v := range append(variants(), storedVariants()...) {
		if v.proto != ProtoTCP {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			d.reset()
			v.setup(d)
			k := v.flow(40001)
			d.send(k, established...)
			if e, _ := d.lookup(k); bpf.CTState(e.State) != bpf.CTTCPEstablished {
				t.Fatalf("state %v, want established", e.State)
			}
			for try := range 3 { // the SYN and two retransmits
				if got := d.send(k, pkt.SYN); got != v.backends[0] {
					t.Fatalf("SYN %d went to %s", try, got)
				}
				if !d.synAck(v.backends[0], k) {
					t.Fatalf("SYN-ACK %d not translated", try)
				}
			}
			d.send(k, pkt.ACK)
			if e, _ := d.lookup(k); bpf.CTState(e.State) != bpf.CTTCPEstablished {
				t.Errorf("state %v after the handshake, want established", e.State)
			}
		})
	}
}

// TestGCDoesNotReviveFinishedFlows: a reverse-NAT entry left behind by an
// earlier flow of a tuple (here written directly, as a datapath that could
// not name it would leave it) is removed with the tuple's conntrack entry,
// not repaired into a conntrack entry of its own: that phantom flow would
// pin the tuple's next connection to a backend the table no longer names.
// The tuple's own flow goes with its NAT half if it is stored (found as
// stale: the backend slot is gone), alone if its replies are derived.
func TestGCDoesNotReviveFinishedFlows(t *testing.T) {
	d := sharedDataplane(t)
	for _, v := range append(variants(), storedVariants()...) {
		t.Run(v.name, func(t *testing.T) {
			d.reset()
			v.setup(d)
			k := v.flow(40002)
			d.send(k, established...)
			old := v.natOf(k, 2)
			d.must(d.nat.Create(nat.Entry{Key: old, VIP: v.vip, ServiceID: sid, BackendID: v.ids[2], LastSeen: now(t)}))

			d.removeBackend(v.ids[0])
			res := d.gc(now(t))
			t.Logf("GC: %v", res)
			if res.CTRepaired != 0 {
				t.Errorf("GC recreated %d conntrack entries", res.CTRepaired)
			}
			if _, ok := d.lookup(k); ok {
				t.Errorf("the tuple still has a conntrack entry")
			}
			if _, ok := d.natLookup(old); ok {
				t.Errorf("the earlier flow's reverse-NAT entry is still there")
			}
			if res.BackendGone != 1 || res.StaleNATRemoved != 1+v.halves() {
				t.Errorf("GC removed %d flows (backend gone) and %d stale NAT entries, want 1 and %d", res.BackendGone, res.StaleNATRemoved, 1+v.halves())
			}
		})
	}
}
