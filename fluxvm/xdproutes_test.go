package fluxvm

import (
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

// TestDataplaneXDPRouteCache: with XDP on, the route cache is on, every
// routing change in the node's namespace moves its generation on, policy
// rules or a multipath route turn it off (with the reason in the status)
// until they are gone, and VIP traffic keeps flowing through XDP
// meanwhile. xdp_mode off: the cache is off and says why.
func TestDataplaneXDPRouteCache(t *testing.T) {
	e, d, vip4, _ := xdpLab(t)
	defer d.Close()
	wait := func(what string, ok func(XDPRouteCacheStatus) bool) XDPRouteCacheStatus {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			st := d.Status().XDPRouteCache
			if ok(st) {
				return st
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: route cache %+v", what, st)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	node := func(f func() error) {
		t.Helper()
		if err := e.lab.Node.Do(f); err != nil {
			t.Fatal(err)
		}
	}
	translated := func() uint64 {
		t.Helper()
		st, err := d.Stats()
		if err != nil {
			t.Fatal(err)
		}
		return st.Parser["xdp_translated"]
	}
	traffic := func(what string) {
		t.Helper()
		before := translated()
		c, err := e.lab.External.DialTCP(netip.AddrPortFrom(vip4, 80), 3*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		defer c.Close()
		if err := c.Echo([]byte(what), 3*time.Second); err != nil {
			t.Fatalf("%s: echo: %v", what, err)
		}
		if translated() == before {
			t.Errorf("%s: no packet went through XDP", what)
		}
	}

	st := wait("open", func(s XDPRouteCacheStatus) bool { return s.Enabled })
	traffic("cache on")

	// A neighbour entry added: one more generation.
	node(func() error {
		l, err := netlink.LinkByName(nsUplink)
		if err != nil {
			return err
		}
		return netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.Attrs().Index, State: netlink.NUD_PERMANENT,
			IP: net.ParseIP("10.250.0.77"), HardwareAddr: net.HardwareAddr{2, 0, 0, 0, 0, 0x77}})
	})
	inv := st.Invalidations
	st = wait("neighbour added", func(s XDPRouteCacheStatus) bool { return s.Enabled && s.Invalidations > inv })

	// A policy rule: off, with the reason, until it is gone.
	rule := netlink.NewRule()
	rule.Priority, rule.Table, rule.Src = 1000, 100, &net.IPNet{IP: net.ParseIP("192.0.2.0"), Mask: net.CIDRMask(24, 32)}
	node(func() error { return netlink.RuleAdd(rule) })
	wait("rule added", func(s XDPRouteCacheStatus) bool { return !s.Enabled && strings.Contains(s.Reason, "rules") })
	traffic("cache off (rule)")
	node(func() error { return netlink.RuleDel(rule) })
	wait("rule removed", func(s XDPRouteCacheStatus) bool { return s.Enabled })

	// A multipath route: off until it is gone.
	var mp *netlink.Route
	node(func() error {
		l, err := netlink.LinkByName(nsUplink)
		if err != nil {
			return err
		}
		gw1, gw2 := net.ParseIP("10.250.0.201"), net.ParseIP("10.250.0.202")
		for _, gw := range []net.IP{gw1, gw2} {
			if err := netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.Attrs().Index, State: netlink.NUD_PERMANENT, IP: gw, HardwareAddr: net.HardwareAddr{2, 0, 0, 0, 0, gw[15]}}); err != nil {
				return err
			}
		}
		mp = &netlink.Route{Dst: &net.IPNet{IP: net.ParseIP("198.51.100.0"), Mask: net.CIDRMask(24, 32)},
			MultiPath: []*netlink.NexthopInfo{{LinkIndex: l.Attrs().Index, Gw: gw1}, {LinkIndex: l.Attrs().Index, Gw: gw2}}}
		return netlink.RouteAdd(mp)
	})
	wait("multipath route added", func(s XDPRouteCacheStatus) bool { return !s.Enabled && strings.Contains(s.Reason, "multipath") })
	traffic("cache off (multipath)")
	node(func() error { return netlink.RouteDel(mp) })
	wait("multipath route removed", func(s XDPRouteCacheStatus) bool { return s.Enabled })
	traffic("cache on again")

	d.Close()
	e.opts.NorthSouth.XDPMode = "off"
	e.opts.NorthSouth.XDPEgress = nil
	d2 := e.open(t)
	defer d2.Close()
	if st := d2.Status().XDPRouteCache; st.Enabled || !strings.Contains(st.Reason, "xdp_mode") {
		t.Errorf("xdp_mode off: route cache %+v", st)
	}
}
