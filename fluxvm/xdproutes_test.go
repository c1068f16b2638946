package fluxvm

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/fluxvm/servicefabric/bpf"
)

// TestDataplaneXDPRouteCache: with XDP on, the route cache is on and the
// kernel holds its lease; a neighbour that changes under a cached route
// is followed at once (the watch empties the cache, long before an
// answer's one-second life ends); rules and routes that select by source
// or TOS, and multipath routes, turn it off (with the reason in the
// status) until they are gone, while rules that select by mark do not;
// VIP traffic flows through XDP throughout; Close turns the cache off in
// the kernel (the program stays attached); xdp_mode off: off, with why.
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
	on := func(s XDPRouteCacheStatus) bool { return s.Enabled }
	offFor := func(why string) func(XDPRouteCacheStatus) bool {
		return func(s XDPRouteCacheStatus) bool { return !s.Enabled && strings.Contains(s.Reason, why) }
	}
	node := func(f func() error) {
		t.Helper()
		if err := e.lab.Node.Do(f); err != nil {
			t.Fatal(err)
		}
	}
	translated := func() uint64 {
		t.Helper()
		st, err := d.Stats(context.Background())
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
	// The control word the attached program reads (lib/nh.h).
	kernelCtl := func() bpf.NHControl {
		t.Helper()
		id, _ := e.xdpOnUplink(t, nsUplink)
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		info, err := p.Info()
		if err != nil {
			t.Fatal(err)
		}
		ids, _ := info.MapIDs()
		for _, mid := range ids {
			m, err := ebpf.NewMapFromID(mid)
			if err != nil {
				t.Fatal(err)
			}
			mi, err := m.Info()
			if err == nil && mi.Name == "fluxvm_nh_ctl" {
				var v bpf.NHControl
				err = m.Lookup(uint32(0), &v)
				m.Close()
				if err != nil {
					t.Fatal(err)
				}
				return v
			}
			m.Close()
		}
		t.Fatal("the XDP program has no fluxvm_nh_ctl")
		return bpf.NHControl{}
	}

	st := wait("open", on)
	if v := kernelCtl(); v.Until == 0 {
		t.Errorf("open: the kernel's control word %+v holds no lease", v)
	}
	traffic("cache on")

	// A neighbour that changes under a cached route. A service with one
	// backend, asked over UDP (each ask a new flow to that backend).
	one := e.nsService("one", netip.MustParseAddr("10.96.3.2"), netip.MustParseAddr("fd00:96:3::2"), ExposureNorthSouth, ModeNAT, false)
	one.Ports = []ServicePort{{Port: 80, Protocol: UDP}}
	be := e.backends[0]
	one.Backends = []Backend{{Address: be.Addr4, Port: 8080}}
	if _, err := d.ApplyService(context.Background(), one); err != nil {
		t.Fatal(err)
	}
	ask := func(timeout time.Duration) error {
		_, err := e.lab.External.AskUDP(netip.AddrPortFrom(one.VIPs[0], 80), timeout)
		return err
	}
	if err := ask(3 * time.Second); err != nil {
		t.Fatalf("one backend: %v", err)
	}
	inv := wait("traffic", on).Invalidations
	node(func() error {
		l, err := netlink.LinkByName(be.NodeIf)
		if err != nil {
			return err
		}
		return netlink.NeighSet(&netlink.Neigh{LinkIndex: l.Attrs().Index, State: netlink.NUD_PERMANENT,
			IP: be.Addr4.AsSlice(), HardwareAddr: net.HardwareAddr{2, 0xde, 0xad, 0, 0, 1}})
	})
	wait("neighbour changed", func(s XDPRouteCacheStatus) bool { return s.Enabled && s.Invalidations > inv })
	// The backend's stack drops frames to another MAC; XDP now caches
	// that answer, per CPU: a few asks (each a new flow, each run by XDP
	// on the CPU its sender ran on) leave it on every CPU.
	for range 6 {
		if err := ask(50 * time.Millisecond); err == nil {
			t.Fatal("a wrong neighbour address: the backend still answered")
		}
	}
	// Deleted: the FIB has no neighbour; XDP must ask it again now (the
	// stack resolves it), not reuse the wrong answer for the rest of its
	// second.
	inv = d.Status().XDPRouteCache.Invalidations
	node(func() error {
		l, err := netlink.LinkByName(be.NodeIf)
		if err != nil {
			return err
		}
		return netlink.NeighDel(&netlink.Neigh{LinkIndex: l.Attrs().Index, IP: be.Addr4.AsSlice()})
	})
	// Heard (the watch's goroutine may be slow on a loaded machine), the
	// one request of the next ask must find its way: one sent by the
	// cached wrong answer would be lost, however long the ask waits.
	wait("neighbour deleted", func(s XDPRouteCacheStatus) bool { return s.Invalidations > inv })
	for i := range 4 {
		if err := ask(2 * time.Second); err != nil {
			t.Fatalf("the neighbour deleted, ask %d: %v (the cached wrong answer was used)", i, err)
		}
	}

	// Rules: by mark (what XDP's lookup never carries) the cache stays
	// on; by source, off until the rule is gone.
	mark := netlink.NewRule()
	mark.Priority, mark.Table, mark.Mark = 900, 100, 0x1234
	node(func() error { return netlink.RuleAdd(mark) })
	wait("a rule by mark", func(s XDPRouteCacheStatus) bool { return s.Enabled && s.Invalidations > inv })
	time.Sleep(1200 * time.Millisecond) // past a rescan
	wait("a rule by mark, later", on)
	node(func() error { return netlink.RuleDel(mark) })
	rule := netlink.NewRule()
	rule.Priority, rule.Table, rule.Src = 1000, 100, &net.IPNet{IP: net.ParseIP("192.0.2.0"), Mask: net.CIDRMask(24, 32)}
	node(func() error { return netlink.RuleAdd(rule) })
	wait("a rule by source", offFor("rule"))
	if v := kernelCtl(); v.Until != 0 {
		t.Errorf("a rule by source: the kernel's control word %+v still holds a lease", v)
	}
	traffic("cache off (rule)")
	node(func() error { return netlink.RuleDel(rule) })
	wait("the rule removed", on)

	// Routes: multipath, and an IPv6 route by source.
	var mp, from *netlink.Route
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
	wait("a multipath route", offFor("multipath"))
	traffic("cache off (multipath)")
	node(func() error { return netlink.RouteDel(mp) })
	wait("the multipath route removed", on)
	node(func() error {
		l, err := netlink.LinkByName(nsUplink)
		if err != nil {
			return err
		}
		from = &netlink.Route{LinkIndex: l.Attrs().Index, Dst: &net.IPNet{IP: net.ParseIP("2001:db8:1::"), Mask: net.CIDRMask(48, 128)}}
		// The source prefix is RTA_SRC, which netlink.Route cannot set.
		return ipRoute6From(from.Dst, "2001:db8:2::/48", nsUplink)
	})
	wait("an IPv6 route by source", offFor("source"))
	node(func() error { return ipRoute6FromDel(from.Dst, "2001:db8:2::/48", nsUplink) })
	wait("the route by source removed", on)
	traffic("cache on again")

	// Close: nothing keeps the cache true any more; the program stays.
	d.Close()
	if v := kernelCtl(); v.Until != 0 {
		t.Errorf("after Close the kernel's control word %+v still holds a lease", v)
	}
	if st = d.Status().XDPRouteCache; st.Enabled {
		t.Errorf("after Close: route cache %+v", st)
	}

	e.opts.NorthSouth.XDPMode = bpf.XDPOff
	e.opts.NorthSouth.XDPEgress = nil
	d2 := e.open(t)
	defer d2.Close()
	if st := d2.Status().XDPRouteCache; st.Enabled || !strings.Contains(st.Reason, "xdp_mode") {
		t.Errorf("xdp_mode off: route cache %+v", st)
	}
}

// ipRoute6From adds (ipRoute6FromDel removes) an IPv6 route to dst from
// the source prefix src out of dev, with ip(8) in the calling thread's
// namespace.
func ipRoute6From(dst *net.IPNet, src, dev string) error {
	return ipCmd("-6", "route", "add", dst.String(), "from", src, "dev", dev)
}

func ipRoute6FromDel(dst *net.IPNet, src, dev string) error {
	return ipCmd("-6", "route", "del", dst.String(), "from", src, "dev", dev)
}

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}
