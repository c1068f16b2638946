package fluxvm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// rtnetlink multicast groups the route watch listens to.
var routeWatchGroups = []int{
	unix.RTNLGRP_LINK, unix.RTNLGRP_NEIGH,
	unix.RTNLGRP_IPV4_IFADDR, unix.RTNLGRP_IPV6_IFADDR,
	unix.RTNLGRP_IPV4_ROUTE, unix.RTNLGRP_IPV6_ROUTE,
	unix.RTNLGRP_IPV4_RULE, unix.RTNLGRP_IPV6_RULE,
	unix.RTNLGRP_IPV4_NETCONF, unix.RTNLGRP_IPV6_NETCONF,
	unix.RTNLGRP_NEXTHOP,
}

// rtaNHID is RTA_NH_ID (linux/rtnetlink.h): a route through a nexthop
// object, which may be a group.
const rtaNHID = 30

// startRouteWatch subscribes to the node's rtnetlink notifications (in
// the node's namespace), reads its rules and multipath routes once, sets
// the XDP next-hop cache and keeps it true until stopRouteWatch. With
// xdp_mode off it only records why the cache is off. d.mu held.
func (d *Dataplane) startRouteWatch() {
	w := &routeWatch{fd: -1, multipath: map[string]bool{}}
	d.routes = w
	if d.xdpMode() == "off" {
		w.off, w.status.Reason = "xdp_mode is off", "xdp_mode is off"
		return
	}
	err := d.opts.InNamespace(func() error {
		fd, err := routeSocket()
		if err != nil {
			return err
		}
		w.fd = fd
		// Subscribed first, read second: a change in between is heard.
		return w.scan()
	})
	if err != nil {
		if w.fd >= 0 {
			unix.Close(w.fd)
			w.fd = -1
		}
		w.off = "the node's routes cannot be watched: " + err.Error()
		d.log.Warn("fluxvm: XDP route cache off", "err", err)
		d.applyRouteCache(w)
		return
	}
	d.applyRouteCache(w)
	w.stop, w.done = make(chan struct{}), make(chan struct{})
	go d.routeWatchLoop(w)
}

// routeSocket is a NETLINK_ROUTE socket in the current namespace joined
// to routeWatchGroups, whose reads time out so that a stop is heard.
func routeSocket() (int, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return -1, fmt.Errorf("rtnetlink socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("rtnetlink bind: %w", err)
	}
	for _, g := range routeWatchGroups {
		if err := unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_ADD_MEMBERSHIP, g); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("join rtnetlink group %d: %w", g, err)
		}
	}
	tv := unix.NsecToTimeval((200 * time.Millisecond).Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("rtnetlink timeout: %w", err)
	}
	return fd, nil
}

// stopRouteWatch ends the watch and waits for it. Without d.mu.
func (d *Dataplane) stopRouteWatch() {
	d.mu.Lock()
	w := d.routes
	d.mu.Unlock()
	if w == nil || w.stop == nil {
		return
	}
	close(w.stop)
	<-w.done
	unix.Close(w.fd)
}

// routeWatchLoop reads notifications until stopped: each batch moves the
// cache's generation on (and may turn it on or off).
func (d *Dataplane) routeWatchLoop(w *routeWatch) {
	defer close(w.done)
	buf := make([]byte, 1<<16)
	for {
		select {
		case <-w.stop:
			return
		default:
		}
		n, _, err := unix.Recvfrom(w.fd, buf, 0)
		failed := false
		switch {
		case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.ENOBUFS):
			// Notifications were lost: read the state again; the
			// generation moves on below, whatever they said.
			if err := d.opts.InNamespace(w.scan); err != nil {
				d.log.Warn("fluxvm: XDP route cache: rescan after lost notifications", "err", err)
			}
		case err != nil:
			d.log.Warn("fluxvm: XDP route cache off: the route watch failed", "err", err)
			w.mu.Lock()
			w.off = "the route watch failed: " + err.Error()
			w.mu.Unlock()
			failed = true
		default:
			rules, routes := w.note(buf[:n])
			var err error
			switch {
			case routes:
				err = d.opts.InNamespace(w.scan)
			case rules:
				err = d.opts.InNamespace(w.scanRules)
			}
			if err != nil {
				d.log.Warn("fluxvm: XDP route cache: read the node's routing again", "err", err)
			}
		}
		d.mu.Lock()
		if !d.closed {
			d.applyRouteCache(w)
		}
		d.mu.Unlock()
		if failed {
			return
		}
	}
}

// scan reads the node's rules and multipath routes (in its namespace).
func (w *routeWatch) scan() error {
	mp := map[string]bool{}
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := netlink.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return fmt.Errorf("list routes: %w", err)
		}
		for _, r := range rs {
			// A route through a nexthop group is dumped with its
			// nexthops as RTA_MULTIPATH (net.ipv4.nexthop_compat_mode,
			// on by default).
			if len(r.MultiPath) > 0 {
				mp[routeKey(fam, r.Table, r.Dst, r.Tos, r.Priority)] = true
			}
		}
	}
	w.mu.Lock()
	w.multipath = mp
	w.mu.Unlock()
	return w.scanRules()
}

// scanRules reads whether rules beyond the kernel's defaults exist (in
// the node's namespace): rule changes are rare, and a list is exact
// where counting notifications is not.
func (w *routeWatch) scanRules() error {
	rules := false
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := netlink.RuleList(fam)
		if err != nil {
			w.mu.Lock()
			w.rules = true // unknown: keep the cache off
			w.mu.Unlock()
			return fmt.Errorf("list rules: %w", err)
		}
		for _, r := range rs {
			if !defaultRule(r.Priority, r.Table) {
				rules = true
			}
		}
	}
	w.mu.Lock()
	w.rules = rules
	w.mu.Unlock()
	return nil
}

// defaultRule: the rules every namespace starts with (local, main,
// default), which send every lookup to the main table.
func defaultRule(prio, table int) bool {
	return (prio == 0 && table == unix.RT_TABLE_LOCAL) ||
		(prio == 32766 && table == unix.RT_TABLE_MAIN) ||
		(prio == 32767 && table == unix.RT_TABLE_DEFAULT)
}

func dstMask(dst *net.IPNet) (int, int) {
	if dst == nil {
		return 0, 0
	}
	return dst.Mask.Size()
}

func routeKey(fam, table int, dst *net.IPNet, tos, prio int) string {
	d := "default"
	if ones, _ := dstMask(dst); dst != nil && (ones > 0 || !dst.IP.IsUnspecified()) {
		d = dst.String()
	}
	return fmt.Sprintf("%d/%d/%s/%d/%d", fam, table, d, tos, prio)
}

// note reads one batch of notifications: what must be read again, the
// rules (one changed) or the routes (a multipath one changed: an IPv6
// multipath route comes and goes a nexthop at a time, so the set is read
// again rather than edited).
func (w *routeWatch) note(b []byte) (rules, routes bool) {
	msgs, err := syscall.ParseNetlinkMessage(b)
	if err != nil {
		return true, true
	}
	for i := range msgs {
		switch msgs[i].Header.Type {
		case unix.RTM_NEWRULE, unix.RTM_DELRULE:
			rules = true
		case unix.RTM_NEWROUTE, unix.RTM_DELROUTE:
			if w.multipathChange(&msgs[i]) {
				routes = true
			}
		}
	}
	return rules, routes
}

// multipathChange: the route notification m is of a multipath route, or
// of one the set holds.
func (w *routeWatch) multipathChange(m *syscall.NetlinkMessage) bool {
	if len(m.Data) < unix.SizeofRtMsg {
		return true
	}
	rtm := (*unix.RtMsg)(unsafe.Pointer(&m.Data[0]))
	attrs, err := syscall.ParseNetlinkRouteAttr(m)
	if err != nil {
		return true
	}
	table, prio := int(rtm.Table), 0
	var dst *net.IPNet
	for _, a := range attrs {
		switch a.Attr.Type {
		case unix.RTA_TABLE:
			if len(a.Value) >= 4 {
				table = int(binary.NativeEndian.Uint32(a.Value))
			}
		case unix.RTA_PRIORITY:
			if len(a.Value) >= 4 {
				prio = int(binary.NativeEndian.Uint32(a.Value))
			}
		case unix.RTA_DST:
			dst = &net.IPNet{IP: net.IP(a.Value), Mask: net.CIDRMask(int(rtm.Dst_len), len(a.Value)*8)}
		case unix.RTA_MULTIPATH, rtaNHID:
			return true
		}
	}
	fam := netlink.FAMILY_V4
	if rtm.Family == unix.AF_INET6 {
		fam = netlink.FAMILY_V6
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.multipath[routeKey(fam, table, dst, int(rtm.Tos), prio)]
}
