package fluxvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestCheckSNATPeers: the rules of a SNAT peer set, no root needed.
func TestCheckSNATPeers(t *testing.T) {
	own4, own6 := netip.MustParseAddr("10.250.0.1"), netip.MustParseAddr("fd00:250::1")
	a, b := netip.MustParseAddr("10.250.0.2"), netip.MustParseAddr("fd00:250::2")
	many := make([]netip.Addr, MaxSNATPeers+1)
	for i := range many {
		many[i] = netip.AddrFrom4([4]byte{10, 251, byte(i >> 8), byte(i)})
	}
	for _, tc := range []struct {
		name  string
		in    SNATPeers
		field string // "" for a set that is taken
		want  []bpf.SNATPeer
	}{
		{"empty", SNATPeers{}, "", []bpf.SNATPeer{}},
		{"sorted", SNATPeers{Addresses: []netip.Addr{b, a}}, "", []bpf.SNATPeer{{Addr: a}, {Addr: b}}},
		{"announced", SNATPeers{Addresses: []netip.Addr{b, a}, Announce: []netip.Addr{b}}, "", []bpf.SNATPeer{{Addr: a}, {Addr: b, Announce: true}}},
		{"the most", SNATPeers{Addresses: many[:MaxSNATPeers]}, "", nil},
		{"too many", SNATPeers{Addresses: many}, "addresses", nil},
		{"own IPv4", SNATPeers{Addresses: []netip.Addr{a, own4}}, "addresses[1]", nil},
		{"own IPv6", SNATPeers{Addresses: []netip.Addr{own6}}, "addresses[0]", nil},
		{"twice", SNATPeers{Addresses: []netip.Addr{a, b, a}}, "addresses[2]", nil},
		{"invalid", SNATPeers{Addresses: []netip.Addr{{}}}, "addresses[0]", nil},
		{"unspecified", SNATPeers{Addresses: []netip.Addr{netip.IPv4Unspecified()}}, "addresses[0]", nil},
		{"multicast", SNATPeers{Addresses: []netip.Addr{netip.MustParseAddr("224.0.0.1")}}, "addresses[0]", nil},
		{"IPv4-mapped", SNATPeers{Addresses: []netip.Addr{netip.MustParseAddr("::ffff:10.250.0.2")}}, "addresses[0]", nil},
		{"announce of no peer", SNATPeers{Addresses: []netip.Addr{a}, Announce: []netip.Addr{a, b}}, "announce[1]", nil},
		{"announce twice", SNATPeers{Addresses: []netip.Addr{a, b}, Announce: []netip.Addr{b, b}}, "announce[1]", nil},
	} {
		got, err := checkSNATPeers(tc.in, own4, own6)
		var ve *ValidationError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.field == "" && tc.want != nil && !slices.Equal(got, tc.want):
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		case tc.field != "" && (!errors.Is(err, ErrInvalid) || !errors.As(err, &ve) || ve.Field != tc.field):
			t.Errorf("%s: %v; want ErrInvalid naming %s", tc.name, err, tc.field)
		}
	}
}

// TestSNATPeersContinueFlows: edge A of a group translates external
// connections to its SNAT address and goes away; edge B, with an SNAT
// address of its own, takes A's snapshot. While A's address is not B's
// peer, B skips A's flows as foreign; once it is (SetSNATPeers), B imports
// them and every open connection goes on through B with A's translation
// (same backend, SNAT address and port: a new source would be reset by
// the backend), its replies to A's address translated back by B; new
// flows take B's own address; the set survives a restart, and a refused
// set changes nothing.
func TestSNATPeersContinueFlows(t *testing.T) {
	e := newNSEnv(t)
	a := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 1, 1)
	svc.Ports, svc.Exposure = []ServicePort{{Port: 80, Protocol: TCP}}, ExposureNorthSouth
	if _, err := a.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	var conns []*lab.Conn
	for i := range 12 {
		c, err := e.lab.External.DialTCP(netip.AddrPortFrom([]netip.Addr{vip4, vip6}[i%2], 80), 3*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if err := c.Echo([]byte("on A"), 3*time.Second); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	time.Sleep(300 * time.Millisecond) // the last ACKs settle
	var snap bytes.Buffer
	exp, err := a.ExportFlows(ctx, "web", &snap)
	if err != nil || exp.Flows < uint64(len(conns)) {
		t.Fatalf("export: %+v, %v; want at least %d flows", exp, err, len(conns))
	}
	if err := a.Cleanup(ctx); err != nil {
		t.Fatal(err)
	}

	// Edge B: its own pin root, catalog and SNAT addresses.
	b4, b6 := netip.MustParseAddr("10.250.0.101"), netip.MustParseAddr("fd00:250::101")
	e.opts.Loader.PinRoot = filepath.Join(testenv.PinRoot(t), "edge-b")
	e.opts.CatalogPath = filepath.Join(t.TempDir(), "catalog.json")
	e.opts.NorthSouth.SNATAddress, e.opts.NorthSouth.SNATAddressV6 = b4, b6
	b := e.open(t)
	if _, err := b.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	res, err := b.ImportFlows(ctx, "web", bytes.NewReader(snap.Bytes()), false)
	if err != nil || res.Written != 0 || res.ForeignSNAT != exp.Flows {
		t.Fatalf("import before A's address is a peer: %+v, %v; want all %d flows skipped as foreign", res, err, exp.Flows)
	}

	// Refused sets change nothing.
	for _, bad := range []SNATPeers{
		{Addresses: []netip.Addr{nsSNAT4, b4}}, {Addresses: []netip.Addr{nsSNAT4, nsSNAT4}}, {Addresses: []netip.Addr{{}}},
		{Addresses: []netip.Addr{nsSNAT4}, Announce: []netip.Addr{nsSNAT6}},
	} {
		if _, err := b.SetSNATPeers(ctx, bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("SetSNATPeers(%v): %v, want ErrInvalid", bad, err)
		}
	}
	if p := b.Status().SNAT.Peers; len(p) != 0 {
		t.Fatalf("peers after refused sets: %v", p)
	}
	st, err := b.SetSNATPeers(ctx, SNATPeers{Addresses: []netip.Addr{nsSNAT6, nsSNAT4}, Announce: []netip.Addr{nsSNAT4}})
	if want := []netip.Addr{nsSNAT4, nsSNAT6}; err != nil || !slices.Equal(st.Peers, want) || !slices.Equal(st.Announced, want[:1]) || st.Address4 != b4 {
		t.Fatalf("SetSNATPeers: %+v, %v; want peers %v, %s announced, beside B's own %s", st, err, want, nsSNAT4, b4)
	}
	// The address B took over is in the advertisement snapshot, withdrawn
	// (this node leaves its SNAT routing to others: advertise_snat off).
	if e, ok := advertEntry(b, nsSNAT4); !ok || e.Kind != advert.KindSNATPeer || e.Advertised || e.Reason != advert.ReasonSNATNotAdvertised {
		t.Errorf("advertisement of the address taken over: %+v (listed %v)", e, ok)
	}
	if _, ok := advertEntry(b, nsSNAT6); ok {
		t.Error("a peer's address not taken over is in the advertisement snapshot")
	}
	if f := snatFlags(t, b); f&bpf.SNATFlagPeers == 0 {
		t.Fatalf("fluxvm_snat flags %#x without SNATFlagPeers", f)
	}
	res, err = b.ImportFlows(ctx, "web", bytes.NewReader(snap.Bytes()), false)
	if err != nil || res.Written != exp.Flows || res.ForeignSNAT != 0 {
		t.Fatalf("import with A's address a peer: %+v, %v; want all %d flows written", res, err, exp.Flows)
	}
	echoAll := func(step string) {
		t.Helper()
		for i, c := range conns {
			if err := c.Echo([]byte(step), 3*time.Second); err != nil {
				t.Errorf("%s: connection %d (on %s) broke: %v", step, i, c.Backend, err)
			}
		}
	}
	echoAll("on B")
	ct, err := b.Conntrack()
	if err != nil {
		t.Fatal(err)
	}
	snatOf := func() map[netip.Addr]int {
		es, err := ct.List(conntrack.Filter{})
		if err != nil {
			t.Fatal(err)
		}
		n := map[netip.Addr]int{}
		for _, en := range es {
			if en.Kind == conntrack.SNAT {
				n[en.SNAT.Addr()]++
			}
		}
		return n
	}
	before := snatOf()
	if got := before[nsSNAT4] + before[nsSNAT6]; got != len(conns) {
		t.Errorf("flows on A's addresses: %v; want %d", before, len(conns))
	}
	fresh, err := e.lab.External.DialTCP(netip.AddrPortFrom(vip4, 80), 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fresh.Close() })
	if err := fresh.Echo([]byte("new on B"), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	if n := snatOf()[b4]; n != before[b4]+1 {
		t.Errorf("a new flow on B: %d flows on B's own %s, want %d", n, b4, before[b4]+1)
	}

	// A restart keeps the set (the pinned map).
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	b = e.open(t)
	if s := b.Status().SNAT; !slices.Equal(s.Peers, []netip.Addr{nsSNAT4, nsSNAT6}) || !slices.Equal(s.Announced, []netip.Addr{nsSNAT4}) {
		t.Fatalf("peers after a restart: %+v", s)
	}
	echoAll("after B restarted")

	if st, err := b.SetSNATPeers(ctx, SNATPeers{}); err != nil || len(st.Peers) != 0 || len(st.Announced) != 0 {
		t.Fatalf("clearing: %+v, %v", st, err)
	}
	if f := snatFlags(t, b); f&bpf.SNATFlagPeers != 0 {
		t.Errorf("fluxvm_snat flags %#x: SNATFlagPeers left with no peer", f)
	}
	if l, err := b.snatPeerList(); err != nil || len(l) != 0 {
		t.Errorf("fluxvm_snat_peers after clearing: %v, %v", l, err)
	}

	// advertise_snat: B's own addresses and the one it takes over are
	// advertised beside the VIPs, for the adapters to announce.
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	e.opts.NorthSouth.AdvertiseSNAT = true
	b = e.open(t)
	if _, err := b.SetSNATPeers(ctx, SNATPeers{Addresses: []netip.Addr{nsSNAT4, nsSNAT6}, Announce: []netip.Addr{nsSNAT4}}); err != nil {
		t.Fatal(err)
	}
	for _, w := range []struct {
		a    netip.Addr
		kind advert.Kind
	}{{b4, advert.KindSNAT}, {b6, advert.KindSNAT}, {nsSNAT4, advert.KindSNATPeer}} {
		if e, ok := advertEntry(b, w.a); !ok || e.Kind != w.kind || !e.Advertised || e.Service != advert.SNATService {
			t.Errorf("advertise_snat: entry of %s: %+v (listed %v), want kind %s advertised", w.a, e, ok, w.kind)
		}
	}
	if _, ok := advertEntry(b, nsSNAT6); ok {
		t.Error("advertise_snat: a peer's address not taken over is listed")
	}
	if !slices.Contains(b.Advertisements().AdvertisedPrefixes(), netip.PrefixFrom(nsSNAT4, 32)) {
		t.Error("advertise_snat: the address taken over is not among the prefixes to announce")
	}
}

// TestAdvertiseSNATNeedsAnAddress: advertise_snat without an SNAT address
// has nothing to advertise and is refused.
func TestAdvertiseSNATNeedsAnAddress(t *testing.T) {
	ns := NorthSouth{Interfaces: []string{"uplink"}, AdvertiseSNAT: true}
	var ve *ValidationError
	if err := ns.Validate(); !errors.Is(err, ErrPrerequisite) || !errors.As(err, &ve) || ve.Field != "NorthSouth.AdvertiseSNAT" {
		t.Errorf("Validate: %v; want ErrPrerequisite naming NorthSouth.AdvertiseSNAT", err)
	}
	ns.SNATAddress = netip.MustParseAddr("10.97.0.1")
	if err := ns.Validate(); err != nil {
		t.Errorf("with an address: %v", err)
	}
}

// snatFlags reads fluxvm_snat's flags.
func snatFlags(t *testing.T, d *Dataplane) uint32 {
	t.Helper()
	var v bpf.SNATConfig
	if err := d.dp.Maps().FluxvmSnat.Lookup(uint32(0), &v); err != nil {
		t.Fatal(fmt.Errorf("fluxvm_snat: %w", err))
	}
	return v.Flags
}

// advertEntry is the advertisement snapshot's entry of address a.
func advertEntry(d *Dataplane, a netip.Addr) (advert.Entry, bool) {
	for _, e := range d.Advertisements().Entries {
		if e.VIP == a {
			return e, true
		}
	}
	return advert.Entry{}, false
}

// snatPeerList reads fluxvm_snat_peers.
func (d *Dataplane) snatPeerList() ([]bpf.SNATPeer, error) {
	p, err := bpf.NewSNATPeers(d.dp.Maps().FluxvmSnatPeers)
	if err != nil {
		return nil, err
	}
	return p.List()
}
