package nat

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/mapscan"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

var (
	client4  = netip.MustParseAddrPort("10.0.0.1:40000")
	vip4     = netip.MustParseAddrPort("10.96.0.10:80")
	backend4 = netip.MustParseAddrPort("10.1.0.1:8080")
	client6  = netip.MustParseAddrPort("[fd00::1]:40000")
	vip6     = netip.MustParseAddrPort("[fd00:96::10]:80")
	backend6 = netip.MustParseAddrPort("[fd00:1::1]:8080")
)

func monoNow(t testing.TB) time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC_COARSE, &ts); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ts.Nano())
}

func TestNewRejectsForeignMaps(t *testing.T) {
	testenv.RequirePrivileged(t)
	nv := uint32(binary.Size(bpf.NATValue{}))
	mk := func(typ ebpf.MapType, k, v uint32) *ebpf.Map {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: typ, KeySize: k, ValueSize: v, MaxEntries: 16})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	named := func(name string, k uint32) *ebpf.Map {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Name: name, Type: ebpf.LRUHash, KeySize: k, ValueSize: nv, MaxEntries: 16})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	good4, good6 := mk(ebpf.LRUHash, 16, nv), mk(ebpf.LRUHash, 40, nv)
	tests := []struct {
		name       string
		nat4, nat6 *ebpf.Map
		wantErr    bool
	}{
		{"real layouts", good4, good6, false},
		{"plain hash is accepted", mk(ebpf.Hash, 16, nv), mk(ebpf.Hash, 40, nv), false},
		{"nil nat4", nil, good6, true},
		{"nil nat6", good4, nil, true},
		{"families swapped", good6, good4, true},
		{"array", mk(ebpf.Array, 4, nv), good6, true},
		{"value of another size", good4, mk(ebpf.LRUHash, 40, nv+8), true},
		{"short key", mk(ebpf.LRUHash, 12, nv), good6, true},
		{"conntrack map of the same layout", named("fluxvm_fct4", 16), good6, true},
		{"named right", named("fluxvm_nat4", 16), named("fluxvm_nat6", 40), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tab, err := New(tt.nat4, tt.nat6)
			if tt.wantErr {
				if !errors.Is(err, ErrInvalidMap) || tab != nil {
					t.Fatalf("New = %v, %v; want ErrInvalidMap", tab, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestDatapathAgrees proves the conversions against the real program both
// ways: an entry the program learned reads back as the flow it translated,
// and an entry written with Put is what the program translates replies by.
// The frontend has bpf.SvcFlagRevStored: only such a frontend's east-west
// flows store an entry (bpftest places it past the fluxvm_be2fe slots, so
// its replies are translated by the entry alone). A frontend without the
// flag stores none: its replies are translated from the conntrack entry.
func TestDatapathAgrees(t *testing.T) {
	d := newDataplane(t, 1024)
	for _, tc := range []struct {
		name                 string
		client, vip, backend netip.AddrPort
		proto                uint8
	}{
		{"ipv4 tcp", client4, vip4, backend4, ProtoTCP},
		{"ipv4 udp", client4, vip4, backend4, ProtoUDP},
		{"ipv6 tcp", client6, vip6, backend6, ProtoTCP},
		{"ipv6 udp", client6, vip6, backend6, ProtoUDP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const sid, bid = 3, 9
			d.t = t
			d.serviceFlags(sid, tc.vip, tc.proto, bpf.SvcFlagRevStored, bid)
			d.backend(bid, sid, tc.backend)
			before := monoNow(t)
			d.forward(tc.client, tc.vip, tc.proto)
			key := Key{Backend: tc.backend, Client: tc.client, Proto: tc.proto}
			e, err := d.table.Lookup(key)
			if err != nil {
				t.Fatal(err)
			}
			want := Entry{Key: key, VIP: tc.vip, ServiceID: sid, BackendID: bid, LastSeen: e.LastSeen}
			if e != want {
				t.Errorf("learned %+v\nwant    %+v", e, want)
			}
			if e.LastSeen < before-time.Second || e.LastSeen > monoNow(t)+time.Second {
				t.Errorf("last seen %v not around now %v", e.LastSeen, before)
			}

			// Point the entry at another VIP: the reply must say so. (An
			// ACK, not a SYN-ACK: a SYN-ACK is also checked against the
			// flow's conntrack half, which names the original VIP.)
			other := netip.AddrPortFrom(tc.vip.Addr().Next(), 8443)
			e.VIP = other
			d.must(d.table.Put(e))
			ret, out := d.run(d.o.Programs.FluxvmToVm, frame(tc.backend, tc.client, tc.proto, pkt.ACK))
			if ret != tcOK {
				t.Fatalf("reply verdict %d", int32(ret))
			}
			if wantOut := frame(other, tc.client, tc.proto, pkt.ACK); !bytes.Equal(out, wantOut) {
				t.Errorf("reply\n got %x\nwant %x", out, wantOut)
			}
			d.must(d.table.Delete(key))

			// Without the flag a new flow stores no entry, and its replies
			// are still translated (from its conntrack entry).
			d.service(sid, tc.vip, tc.proto, bid)
			client := netip.AddrPortFrom(tc.client.Addr(), tc.client.Port()+1)
			d.forward(client, tc.vip, tc.proto)
			dkey := Key{Backend: tc.backend, Client: client, Proto: tc.proto}
			if e, err := d.table.Lookup(dkey); !errors.Is(err, ErrNotFound) {
				t.Errorf("a flow with derived replies stored %+v, %v", e, err)
			}
			ret, out = d.run(d.o.Programs.FluxvmToVm, frame(tc.backend, client, tc.proto, pkt.ACK))
			if wantOut := frame(tc.vip, client, tc.proto, pkt.ACK); ret != tcOK || !bytes.Equal(out, wantOut) {
				t.Errorf("derived reply: verdict %d\n got %x\nwant %x", int32(ret), out, wantOut)
			}
		})
	}
}

func TestEntryOperations(t *testing.T) {
	tab := newTable(t, 1024)
	base := Entry{Key: Key{Backend: backend4, Client: client4, Proto: ProtoTCP}, VIP: vip4, ServiceID: 1, BackendID: 2, LastSeen: 5 * time.Second}
	base6 := Entry{Key: Key{Backend: backend6, Client: client6, Proto: ProtoUDP}, VIP: vip6, ServiceID: 1, BackendID: 2, LastSeen: time.Second}
	mapped := base
	mapped.Backend = netip.AddrPortFrom(netip.AddrFrom16(backend4.Addr().As16()), backend4.Port())
	mapped.Client = netip.AddrPortFrom(netip.AddrFrom16(client4.Addr().As16()), client4.Port())
	mapped.VIP = netip.AddrPortFrom(netip.AddrFrom16(vip4.Addr().As16()), vip4.Port())
	invalid := func(f func(*Entry)) Entry { e := base; f(&e); return e }

	tests := []struct {
		name    string
		run     func() error
		wantErr error
	}{
		{"put then lookup ipv4", func() error { return putGet(tab, base, base) }, nil},
		{"put then lookup ipv6", func() error { return putGet(tab, base6, base6) }, nil},
		{"ipv4-mapped addresses are stored as ipv4", func() error { return putGet(tab, mapped, base) }, nil},
		{"put replaces", func() error {
			e := base
			e.BackendID = 7
			if err := tab.Put(e); err != nil {
				return err
			}
			return putGet(tab, e, e)
		}, nil},
		{"create on a taken key", func() error { _ = tab.Put(base); return tab.Create(base) }, ErrExists},
		{"create on a free key", func() error {
			_ = tab.Delete(base.Key)
			if err := tab.Create(base); err != nil {
				return err
			}
			return putGet(tab, base, base)
		}, nil},
		{"delete then lookup", func() error {
			_ = tab.Put(base)
			if err := tab.Delete(base.Key); err != nil {
				return err
			}
			_, err := tab.Lookup(base.Key)
			return err
		}, ErrNotFound},
		{"delete a missing key", func() error { _ = tab.Delete(base6.Key); return tab.Delete(base6.Key) }, ErrNotFound},
		{"lookup a missing key", func() error {
			_, err := tab.Lookup(Key{Backend: backend4, Client: client4, Proto: ProtoUDP})
			return err
		}, ErrNotFound},
		{"mixed families", func() error { return tab.Put(invalid(func(e *Entry) { e.Client = client6 })) }, ErrInvalidEntry},
		{"VIP of the other family", func() error { return tab.Put(invalid(func(e *Entry) { e.VIP = vip6 })) }, ErrInvalidEntry},
		{"ICMP", func() error { return tab.Put(invalid(func(e *Entry) { e.Proto = 1 })) }, ErrInvalidEntry},
		{"VIP port 0", func() error {
			return tab.Put(invalid(func(e *Entry) { e.VIP = netip.AddrPortFrom(vip4.Addr(), 0) }))
		}, ErrInvalidEntry},
		{"backend id 0", func() error { return tab.Put(invalid(func(e *Entry) { e.BackendID = 0 })) }, ErrInvalidEntry},
		{"negative last seen", func() error { return tab.Put(invalid(func(e *Entry) { e.LastSeen = -1 })) }, ErrInvalidEntry},
		{"zero key", func() error { _, err := tab.Lookup(Key{}); return err }, ErrInvalidEntry},
		{"zero entry", func() error { return tab.Put(Entry{}) }, ErrInvalidEntry},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.run()
			if tt.wantErr == nil && err != nil {
				t.Fatal(err)
			}
			if tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Fatalf("error %v, want %v", err, tt.wantErr)
			}
		})
	}
	// Not-found errors keep the cause from the map for callers who test it.
	_, err := tab.Lookup(Key{Backend: backend6, Client: client6, Proto: ProtoTCP})
	if !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("lookup error %v does not wrap ebpf.ErrKeyNotExist", err)
	}
}

func putGet(tab *Table, put, want Entry) error {
	if err := tab.Put(put); err != nil {
		return err
	}
	got, err := tab.Lookup(put.Key)
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("lookup %+v, want %+v", got, want)
	}
	return nil
}

// fill writes n entries per family: entry i has client port 10000+i,
// service 1+i%3 and backend 1+i%5.
func fill(t *testing.T, tab *Table, n int) []Entry {
	t.Helper()
	var all []Entry
	for _, fam := range []struct{ backend, client, vip netip.AddrPort }{{backend4, client4, vip4}, {backend6, client6, vip6}} {
		for i := range n {
			e := Entry{
				Key:       Key{Backend: fam.backend, Client: netip.AddrPortFrom(fam.client.Addr(), uint16(10000+i)), Proto: ProtoTCP},
				VIP:       fam.vip,
				ServiceID: uint32(1 + i%3), BackendID: uint32(1 + i%5), LastSeen: time.Duration(i),
			}
			if err := tab.Put(e); err != nil {
				t.Fatal(err)
			}
			all = append(all, e)
		}
	}
	return all
}

func sortEntries(es []Entry) {
	slices.SortFunc(es, func(a, b Entry) int {
		if c := a.Backend.Compare(b.Backend); c != 0 {
			return c
		}
		return a.Client.Compare(b.Client)
	})
}

// modes runs fn with batch map commands and with the key-by-key fallback a
// kernel without them gets, and with chunks small enough that a scan takes
// several.
func modes(t *testing.T, tab *Table, fn func(t *testing.T)) {
	for _, m := range []struct {
		name  string
		batch bool
	}{{"batch", true}, {"iterate", false}} {
		t.Run(m.name, func(t *testing.T) {
			tab.mode.SetBatch(!(!m.batch))
			tab.chunk = mapscan.MinChunk
			t.Cleanup(func() { tab.mode.SetBatch(!(false)); tab.chunk = mapscan.DefaultChunk })
			fn(t)
		})
	}
}

func TestScanAndList(t *testing.T) {
	tab := newTable(t, 4096)
	const n = 300
	modes(t, tab, func(t *testing.T) {
		all := fill(t, tab, n)
		filters := []struct {
			name string
			f    Filter
		}{
			{"all", Filter{}},
			{"ipv4", Filter{Family: IPv4}},
			{"ipv6", Filter{Family: IPv6}},
			{"service 2", Filter{ServiceIDs: []uint32{2}}},
			{"backends 1 and 4", Filter{BackendIDs: []uint32{1, 4}}},
			{"ipv6 service 3 backend 5", Filter{Family: IPv6, ServiceIDs: []uint32{3}, BackendIDs: []uint32{5}}},
			{"no such service", Filter{ServiceIDs: []uint32{99}}},
			{"empty non-nil list matches nothing", Filter{ServiceIDs: []uint32{}}},
		}
		for _, ft := range filters {
			t.Run(ft.name, func(t *testing.T) {
				var want []Entry
				for _, e := range all {
					if ft.f.matches(e.Family(), e.ServiceID, e.BackendID) {
						want = append(want, e)
					}
				}
				got, err := tab.List(ft.f)
				if err != nil {
					t.Fatal(err)
				}
				sortEntries(got)
				sortEntries(want)
				if !slices.Equal(got, want) {
					t.Fatalf("List(%+v): %d entries, want %d", ft.f, len(got), len(want))
				}
			})
		}

		t.Run("deleting while scanning sees every entry once", func(t *testing.T) {
			// Delete every other entry of each chunk and always its last
			// one, where a naive iteration would resume: resuming from a
			// deleted key restarts at the first key, and the entries kept
			// would be seen twice.
			seen := map[Key]int{}
			chunks, deleted := 0, 0
			err := tab.Scan(Filter{}, func(es []Entry) error {
				chunks++
				var keys []Key
				for i, e := range es {
					seen[e.Key]++
					if i%2 == 1 || i == len(es)-1 {
						keys = append(keys, e.Key)
					}
				}
				n, err := tab.DeleteKeys(keys)
				deleted += n
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(seen) != 2*n || chunks < 2*n/mapscan.MinChunk {
				t.Errorf("saw %d entries in %d chunks, want %d in at least %d", len(seen), chunks, 2*n, 2*n/mapscan.MinChunk)
			}
			for k, c := range seen {
				if c != 1 {
					t.Errorf("%s seen %d times", k, c)
				}
			}
			if rest, _ := tab.List(Filter{}); len(rest) != 2*n-deleted {
				t.Errorf("%d entries left, want %d", len(rest), 2*n-deleted)
			}
			all, _ := tab.List(Filter{})
			for _, e := range all {
				_ = tab.Delete(e.Key)
			}
		})

		t.Run("an error from the callback stops the scan", func(t *testing.T) {
			fill(t, tab, n)
			stop := errors.New("enough")
			calls := 0
			err := tab.Scan(Filter{}, func([]Entry) error { calls++; return stop })
			if err != stop || calls != 1 {
				t.Errorf("Scan = %v after %d calls, want the callback's error after 1", err, calls)
			}
		})
	})
}

func TestDeleteKeysSkipsMissing(t *testing.T) {
	tab := newTable(t, 1024)
	modes(t, tab, func(t *testing.T) {
		all := fill(t, tab, 50)
		var keys []Key
		for i, e := range all {
			keys = append(keys, e.Key)
			if i%10 == 0 {
				// A key the LRU "evicted" in the middle of the batch.
				keys = append(keys, Key{Backend: e.Backend, Client: netip.AddrPortFrom(e.Client.Addr(), 1), Proto: ProtoUDP})
			}
		}
		n, err := tab.DeleteKeys(keys)
		if err != nil || n != len(all) {
			t.Fatalf("DeleteKeys = %d, %v; want %d", n, err, len(all))
		}
		if rest, _ := tab.List(Filter{}); len(rest) != 0 {
			t.Errorf("%d entries left", len(rest))
		}
		if _, err := tab.DeleteKeys([]Key{{}}); !errors.Is(err, ErrInvalidEntry) {
			t.Errorf("invalid key: %v", err)
		}
	})
}
