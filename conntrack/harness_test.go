package conntrack

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/bpftest"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
	"github.com/fluxvm/servicefabric/nat"
)

// dataplane is the real TC object of tier S with its lifecycle maps shrunk
// (bpftest), the Map and nat.Table over it, and the control-plane writes a
// test needs to make the program learn flows.
type dataplane struct {
	t   testing.TB
	th  *testenv.Thread
	o   *bpftest.Object
	nat *nat.Table
	ct  *Map
	// removed collects what Config.Removed was told of, since reset.
	removed []Key
	// removedIdle is the idle time each removal was told with.
	removedIdle []time.Duration
}

type sizes struct{ ct, nat uint32 }

// newDataplane loads an object of its own for a test that needs special
// map sizes, inside a fresh network namespace thread. Lifecycle maps are
// shrunk: 64k preallocated entries are pointless for a test, and small
// ones let a test fill them.
func newDataplane(t testing.TB, sz sizes, to Timeouts) *dataplane {
	t.Helper()
	testenv.RequirePrivileged(t)
	d, err := load(sz, to)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.close)
	d.t, d.th = t, testenv.NewThread(t)
	return d
}

// shared is the one object most tests use, loaded on first use: program
// verification is the slow part of a test, and more so on a busy machine.
var shared struct {
	once sync.Once
	d    *dataplane
	err  error
}

// sharedDataplane returns the shared object (maps of 4096 entries,
// testTimeouts in the meta map) for t: emptied, with a thread in a fresh
// network namespace of t's own. Tests using it must not run in parallel.
func sharedDataplane(t *testing.T) *dataplane {
	t.Helper()
	testenv.RequirePrivileged(t)
	shared.once.Do(func() { shared.d, shared.err = load(sizes{4096, 4096}, testTimeouts) })
	if shared.err != nil {
		t.Fatal(shared.err)
	}
	d := shared.d
	d.t, d.th = t, testenv.NewThread(t)
	d.reset()
	return d
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.d != nil {
		shared.d.close()
	}
	os.Exit(code)
}

func load(sz sizes, to Timeouts) (*dataplane, error) {
	o, err := bpftest.Load(bpf.TierS, bpftest.Sizes{CT: sz.ct, NAT: sz.nat})
	if err != nil {
		return nil, err
	}
	d := &dataplane{o: o}
	if d.nat, err = nat.New(o.Maps.FluxvmNat4, o.Maps.FluxvmNat6); err == nil {
		d.ct, err = New(Config{CT4: o.Maps.FluxvmFct4, CT6: o.Maps.FluxvmFct6, Backends: o.Maps.FluxvmBackends, NAT: d.nat, Timeouts: to,
			Removed: func(k Key, sid uint32, kind Kind, idle time.Duration) {
				d.removed, d.removedIdle = append(d.removed, k), append(d.removedIdle, idle)
			}})
	}
	if err == nil && to != (Timeouts{}) {
		var m bpf.Meta
		if err = to.ApplyTo(&m); err == nil {
			err = o.Maps.FluxvmMeta.Put(uint32(0), m)
		}
	}
	if err != nil {
		d.close()
		return nil, err
	}
	return d, nil
}

func (d *dataplane) close() { d.o.Close() }

func (d *dataplane) must(err error) {
	d.t.Helper()
	if err != nil {
		d.t.Fatal(err)
	}
}

// reset empties the lifecycle maps and the backend slots a test uses, so
// that one loaded object serves many cases. Backends are removed through
// bpftest, which takes them out of fluxvm_be2fe too: a backend of an
// earlier case must not stay listed for the next one's endpoints.
func (d *dataplane) reset() {
	d.t.Helper()
	d.removed, d.removedIdle = nil, nil
	for id := uint32(0); id < 32; id++ {
		d.must(d.o.RemoveBackend(id))
	}
	for _, m := range []*ebpf.Map{d.o.Maps.FluxvmFct4, d.o.Maps.FluxvmFct6, d.o.Maps.FluxvmNat4, d.o.Maps.FluxvmNat6, d.o.Maps.FluxvmBe2fe} {
		var keys [][]byte
		k := make([]byte, m.KeySize())
		var v []byte
		it := m.Iterate()
		for it.Next(&k, &v) {
			keys = append(keys, append([]byte(nil), k...))
		}
		d.must(it.Err())
		for _, k := range keys {
			d.must(m.Delete(k))
		}
	}
}

// service installs frontend vip/proto -> sid, opens its guard and fills
// its Maglev table from bids, slot i naming bids[i%len(bids)].
func (d *dataplane) service(sid uint32, vip netip.AddrPort, proto uint8, bids ...uint32) {
	d.t.Helper()
	d.serviceFlags(sid, vip, proto, 0, bids...)
}

// serviceFlags is service with frontend flags (bpf.SvcFlag*).
func (d *dataplane) serviceFlags(sid uint32, vip netip.AddrPort, proto uint8, flags uint32, bids ...uint32) {
	d.t.Helper()
	d.must(d.o.Service(sid, vip, proto, flags, bids...))
}

// table swaps in a Maglev table for sid, as the control plane does. Tables
// are built once per backend list and reused: filling 16k slots is the
// slowest control-plane write a test makes.
func (d *dataplane) table(sid uint32, bids ...uint32) {
	d.t.Helper()
	d.must(d.o.Table(sid, bids...))
}

func (d *dataplane) backend(id, sid uint32, ap netip.AddrPort, state bpf.BackendState, drainUntil time.Duration) {
	d.t.Helper()
	d.must(d.o.Backend(id, sid, ap, state, uint64(drainUntil)))
}

func (d *dataplane) removeBackend(id uint32) {
	d.t.Helper()
	d.must(d.o.RemoveBackend(id))
}

// The node's SNAT addresses and port range in north-south tests.
var (
	snat4 = netip.MustParseAddr("192.0.2.1")
	snat6 = netip.MustParseAddr("2001:db8::1")
)

const snatPortMin, snatPortMax = 20000, 20999

// snatConfig writes the north-south SNAT configuration (both families).
func (d *dataplane) snatConfig() {
	d.t.Helper()
	d.must(d.o.SNAT(snat4, snat6, snatPortMin, snatPortMax))
}

func frame(src, dst netip.AddrPort, proto uint8, f pkt.TCPFlags) []byte {
	return bpftest.Frame(src, dst, proto, f)
}

const tcOK = bpftest.TCOK

func (d *dataplane) run(prog *ebpf.Program, in []byte) (uint32, []byte) {
	d.t.Helper()
	var ret uint32
	var out []byte
	var err error
	d.th.Do(func() { ret, out, err = bpftest.Run(prog, in) })
	d.must(err)
	return ret, out
}

// send passes client -> vip packets with the given TCP flags, in order,
// through the VM-edge program; each must be translated. It returns the
// destination the last one was sent to.
func (d *dataplane) send(k Key, flags ...pkt.TCPFlags) netip.AddrPort {
	d.t.Helper()
	if len(flags) == 0 {
		flags = []pkt.TCPFlags{pkt.SYN}
	}
	var out []byte
	for _, f := range flags {
		var ret uint32
		ret, out = d.run(d.o.Programs.FluxvmFromVm, frame(k.Client, k.VIP, k.Proto, f))
		if ret != tcOK {
			d.t.Fatalf("%s: verdict %d, want TC_ACT_OK", k, int32(ret))
		}
	}
	_, dst := endpoints(out)
	return dst
}

// endpoints decodes the source and destination of a frame.
func endpoints(frame []byte) (src, dst netip.AddrPort) { return bpftest.Endpoints(frame) }

// sendNS passes client -> vip packets with the given TCP flags, in order,
// through the north-south ingress program and returns the last verdict
// and the source and destination of the last packet as it left.
func (d *dataplane) sendNS(k Key, flags ...pkt.TCPFlags) (verdict uint32, src, dst netip.AddrPort) {
	d.t.Helper()
	if len(flags) == 0 {
		flags = []pkt.TCPFlags{pkt.SYN}
	}
	var out []byte
	for _, f := range flags {
		verdict, out = d.run(d.o.Programs.FluxvmNsIn, frame(k.Client, k.VIP, k.Proto, f))
	}
	src, dst = endpoints(out)
	return verdict, src, dst
}

// replyNS passes a reply from backend to the SNAT address and port through
// the north-south ingress program and reports whether it left translated
// to exactly the packet from the VIP to the client.
func (d *dataplane) replyNS(backend, snat netip.AddrPort, k Key) bool {
	d.t.Helper()
	ret, out := d.run(d.o.Programs.FluxvmNsIn, frame(backend, snat, k.Proto, pkt.ACK))
	if ret != tcOK {
		return false
	}
	want := frame(k.VIP, k.Client, k.Proto, pkt.ACK)
	return string(out[:len(want)]) == string(want)
}

// reply passes backend -> client through the program toward the VM and
// returns the source the client sees, or the invalid AddrPort when the
// reply was not translated.
func (d *dataplane) reply(backend netip.AddrPort, k Key) netip.AddrPort {
	d.t.Helper()
	ret, out := d.run(d.o.Programs.FluxvmToVm, frame(backend, k.Client, k.Proto, pkt.ACK))
	if ret != tcOK {
		return netip.AddrPort{}
	}
	want := frame(k.VIP, k.Client, k.Proto, pkt.ACK)
	if string(out[:len(want)]) != string(want) {
		d.t.Fatalf("reply from %s for %s:\n got %x\nwant %x", backend, k, out[:len(want)], want)
	}
	return k.VIP
}

func (d *dataplane) gc(now time.Duration) GCResult {
	d.t.Helper()
	res, err := d.ct.GC(context.Background(), now)
	if err != nil {
		d.t.Fatalf("gc: %v", err)
	}
	return res
}

func (d *dataplane) lookup(k Key) (Entry, bool) {
	d.t.Helper()
	e, err := d.ct.Lookup(k)
	if errors.Is(err, ErrNotFound) {
		return e, false
	}
	d.must(err)
	return e, true
}

func (d *dataplane) natLookup(k nat.Key) (nat.Entry, bool) {
	d.t.Helper()
	e, err := d.nat.Lookup(k)
	if errors.Is(err, nat.ErrNotFound) {
		return e, false
	}
	d.must(err)
	return e, true
}

func (d *dataplane) backendOf(id uint32) bpf.Backend {
	d.t.Helper()
	var b bpf.Backend
	d.must(d.o.Maps.FluxvmBackends.Lookup(id, &b))
	return b
}

// natHalf is the reverse-NAT key of flow c on backend b, as GC names it,
// or false for a flow without one (DSR, derived replies).
func (d *dataplane) natHalf(c Entry, b bpf.Backend) (nat.Key, bool) {
	d.t.Helper()
	if !c.HasNATHalf() {
		return nat.Key{}, false
	}
	k := nat.Key{Backend: backendAddr(c.Family(), &b), Client: c.Client, Proto: c.Proto}
	if c.Kind == SNAT {
		k.Client = c.SNAT
	}
	return k, true
}

// pairing checks the pairing rule over the whole maps and returns the
// number of complete flows and the number of broken halves (a conntrack
// entry without its NAT half, or a NAT entry without its conntrack half).
// DSR flows and flows with derived replies are complete without a NAT
// half; a NAT entry whose conntrack half is DSR or has derived replies is
// broken (those flows have none).
func (d *dataplane) pairing() (flows, broken int) {
	d.t.Helper()
	cts, err := d.ct.List(Filter{})
	d.must(err)
	nats, err := d.nat.List(nat.Filter{})
	d.must(err)
	for _, c := range cts {
		nk, ok := d.natHalf(c, d.backendOf(c.BackendID))
		if !ok {
			flows++
			continue
		}
		e, ok := d.natLookup(nk)
		if ok && e.BackendID == c.BackendID && e.VIP == c.VIP && e.ServiceID == c.ServiceID &&
			e.SNAT == (c.Kind == SNAT) && (!e.SNAT || e.Origin == c.Client) {
			flows++
		} else {
			broken++
		}
	}
	for _, e := range nats {
		client, kind, snat := e.Client, EastWest, netip.AddrPort{}
		if e.SNAT {
			client, kind, snat = e.Origin, SNAT, e.Client
		}
		c, ok := d.lookup(Key{Client: client, VIP: e.VIP, Proto: e.Proto})
		if !ok || c.BackendID != e.BackendID || c.Kind != kind || c.SNAT != snat || !c.HasNATHalf() {
			broken++
		}
	}
	return flows, broken
}

// now is CLOCK_MONOTONIC_COARSE, the clock the program stamps with.
func now(t testing.TB) time.Duration {
	n, err := Now()
	if err != nil {
		t.Fatal(err)
	}
	return n
}
