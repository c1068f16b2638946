package nat

import (
	"bytes"
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/testutils/pkt"
)

var (
	snat4     = netip.MustParseAddrPort("192.0.2.1:20001")
	snat6     = netip.MustParseAddrPort("[2001:db8::1]:20001")
	external4 = netip.MustParseAddrPort("198.51.100.7:40000")
	external6 = netip.MustParseAddrPort("[2001:db8:100::7]:40000")
)

// TestSNATEntryOperations: SNAT mappings and the host-routing flag round
// trip through Put, Create, Lookup and List, and validation covers them.
func TestSNATEntryOperations(t *testing.T) {
	tab := newTable(t, 1024)
	snat := Entry{Key: Key{Backend: backend4, Client: snat4, Proto: ProtoTCP}, VIP: vip4, ServiceID: 1, BackendID: 2,
		LastSeen: 5 * time.Second, SNAT: true, Origin: external4}
	snat6e := Entry{Key: Key{Backend: backend6, Client: snat6, Proto: ProtoUDP}, VIP: vip6, ServiceID: 1, BackendID: 2,
		LastSeen: time.Second, SNAT: true, Origin: external6, HostRouting: true}
	ewHR := Entry{Key: Key{Backend: backend4, Client: client4, Proto: ProtoUDP}, VIP: vip4, ServiceID: 1, BackendID: 2,
		LastSeen: time.Second, HostRouting: true}
	mapped := snat
	mapped.Origin = netip.AddrPortFrom(netip.AddrFrom16(external4.Addr().As16()), external4.Port())
	invalid := func(f func(*Entry)) Entry { e := snat; f(&e); return e }

	tests := []struct {
		name    string
		run     func() error
		wantErr error
	}{
		{"SNAT ipv4", func() error { return putGet(tab, snat, snat) }, nil},
		{"SNAT ipv6 with host routing", func() error { return putGet(tab, snat6e, snat6e) }, nil},
		{"east-west with host routing", func() error { return putGet(tab, ewHR, ewHR) }, nil},
		{"an IPv4-mapped origin is stored as ipv4", func() error { return putGet(tab, mapped, snat) }, nil},
		{"create an SNAT mapping on a free key", func() error {
			_ = tab.Delete(snat.Key)
			if err := tab.Create(snat); err != nil {
				return err
			}
			return putGet(tab, snat, snat)
		}, nil},
		{"create on a port another mapping holds", func() error {
			_ = tab.Put(snat)
			other := snat
			other.Origin = netip.AddrPortFrom(external4.Addr().Next(), 1)
			return tab.Create(other)
		}, ErrExists},
		{"list returns the SNAT fields", func() error {
			all, err := tab.List(Filter{})
			if err != nil {
				return err
			}
			for _, want := range []Entry{snat, snat6e, ewHR} {
				if !slices.Contains(all, want) {
					return errors.New("List lost " + want.Key.String())
				}
			}
			return nil
		}, nil},
		{"SNAT without an origin", func() error { return tab.Put(invalid(func(e *Entry) { e.Origin = netip.AddrPort{} })) }, ErrInvalidEntry},
		{"origin of the other family", func() error { return tab.Put(invalid(func(e *Entry) { e.Origin = external6 })) }, ErrInvalidEntry},
		{"zoned origin", func() error {
			e := snat6e
			e.Origin = netip.AddrPortFrom(external6.Addr().WithZone("eth0"), 1)
			return tab.Put(e)
		}, ErrInvalidEntry},
		{"origin without SNAT", func() error { return tab.Put(invalid(func(e *Entry) { e.SNAT = false })) }, ErrInvalidEntry},
		{"SNAT port 0", func() error {
			return tab.Put(invalid(func(e *Entry) { e.Client = netip.AddrPortFrom(snat4.Addr(), 0) }))
		}, ErrInvalidEntry},
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
}

// TestRawFlags: how raw values read. Program generation 1 left values
// without flags (migrated zero-extended): east-west entries. Client words
// without NATFlagSNAT mean nothing, and unknown flag bits are dropped.
func TestRawFlags(t *testing.T) {
	tab := newTable(t, 64)
	k := Key{Backend: backend4, Client: client4, Proto: ProtoTCP}
	base := bpf.NATValue{Vip: bpf.AddrWords(vip4.Addr()), Vport: bpf.Port(vip4.Port()), ServiceId: 1, BackendId: 2, LastSeenNs: 7}
	ew := Entry{Key: k, VIP: vip4, ServiceID: 1, BackendID: 2, LastSeen: 7}
	with := func(f func(*bpf.NATValue)) bpf.NATValue { v := base; f(&v); return v }
	snat := ew
	snat.SNAT, snat.Origin = true, external4
	for _, tc := range []struct {
		name string
		raw  bpf.NATValue
		want Entry
	}{
		{"generation 1", base, ew},
		{"client words without the flag", with(func(v *bpf.NATValue) {
			v.Client, v.Cport = bpf.AddrWords(external4.Addr()), bpf.Port(external4.Port())
		}), ew},
		{"SNAT with an unknown flag bit", with(func(v *bpf.NATValue) {
			v.Flags = bpf.NATFlagSNAT | 0x80
			v.Client, v.Cport = bpf.AddrWords(external4.Addr()), bpf.Port(external4.Port())
		}), snat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tab.maps.Load().nat4.Put(key4(k), tc.raw); err != nil {
				t.Fatal(err)
			}
			if got, err := tab.Lookup(k); err != nil || got != tc.want {
				t.Errorf("Lookup = %+v, %v\nwant %+v", got, err, tc.want)
			}
		})
	}
}

// TestDatapathAgreesSNAT proves the SNAT fields against the real
// north-south program both ways: the mapping it learned reads back as the
// flow it translated, and a mapping written with Put is what it translates
// replies to the SNAT address by.
func TestDatapathAgreesSNAT(t *testing.T) {
	d := newDataplane(t, 1024)
	for _, tc := range []struct {
		name                 string
		client, vip, backend netip.AddrPort
		proto                uint8
	}{
		{"ipv4 tcp", external4, vip4, backend4, ProtoTCP},
		{"ipv4 udp", external4, vip4, backend4, ProtoUDP},
		{"ipv6 tcp", external6, vip6, backend6, ProtoTCP},
		{"ipv6 udp", external6, vip6, backend6, ProtoUDP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const sid, bid = 3, 9
			d.t = t
			d.serviceFlags(sid, tc.vip, tc.proto, bpf.SvcFlagNorthSouth, bid)
			d.backend(bid, sid, tc.backend)
			d.snatConfig(snat4.Addr(), snat6.Addr(), 30000, 30099)
			ret, out := d.run(d.o.Programs.FluxvmNsIn, frame(tc.client, tc.vip, tc.proto, pkt.SYN))
			if ret != tcOK {
				t.Fatalf("forward verdict %d", int32(ret))
			}
			p := pkt.Decode(out)
			src, _ := netip.AddrFromSlice(p.NetworkLayer().NetworkFlow().Src().Raw())
			raw := p.TransportLayer().TransportFlow().Src().Raw()
			sn := netip.AddrPortFrom(src.Unmap(), uint16(raw[0])<<8|uint16(raw[1]))
			key := Key{Backend: tc.backend, Client: sn, Proto: tc.proto}
			e, err := d.table.Lookup(key)
			if err != nil {
				t.Fatalf("no mapping for the SNAT source %s: %v", sn, err)
			}
			want := Entry{Key: key, VIP: tc.vip, ServiceID: sid, BackendID: bid, LastSeen: e.LastSeen, SNAT: true, Origin: tc.client}
			if e != want || sn.Port() < 30000 || sn.Port() > 30099 {
				t.Errorf("learned %+v\nwant    %+v", e, want)
			}

			// Point the mapping at another client and VIP: the reply
			// must say so.
			e.VIP = netip.AddrPortFrom(tc.vip.Addr().Next(), 8443)
			e.Origin = netip.AddrPortFrom(tc.client.Addr().Next(), 40001)
			d.must(d.table.Put(e))
			ret, out = d.run(d.o.Programs.FluxvmNsIn, frame(tc.backend, sn, tc.proto, pkt.ACK))
			if ret != tcOK {
				t.Fatalf("reply verdict %d", int32(ret))
			}
			if wantOut := frame(e.VIP, e.Origin, tc.proto, pkt.ACK); !bytes.Equal(out[:len(wantOut)], wantOut) {
				t.Errorf("reply\n got %x\nwant %x", out, wantOut)
			}
			d.must(d.table.Delete(key))
		})
	}
}
