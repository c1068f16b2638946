package xdproutes

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"
	"unsafe"

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

const (
	// rtaNHID is RTA_NH_ID (linux/rtnetlink.h): a route through a
	// nexthop object, which may be a group.
	rtaNHID = 30
	// nlmFDumpIntr is NLM_F_DUMP_INTR: the dump met a change and may be
	// inconsistent.
	nlmFDumpIntr = 0x10
	// routeRescanEvery bounds how often a full read of the node's rules
	// and routes runs while routing churns (the cache stays off until
	// one has run).
	routeRescanEvery = time.Second
)

// hostSystem hears of the node's routing over rtnetlink.
func hostSystem() system {
	return system{
		idle: "the route watch has not started",
		open: func() (events, error) {
			fd, err := routeSocket()
			if err != nil {
				return nil, err
			}
			return netlinkEvents(fd), nil
		},
		scan:        scanRouting,
		rescanEvery: routeRescanEvery,
		renewEvery:  cacheRenew,
	}
}

// Start subscribes to the node's rtnetlink notifications (in the node's
// namespace), reads its rules and routes once, takes the lease on the XDP
// route cache where they allow it, and keeps the cache true until Close,
// from a goroutine of its own. With xdp_mode off it does nothing (Status
// says why). Once; not after Close.
func (w *Watch) Start() {
	if w == nil || w.cfg.XDPOff || !w.begin() {
		return
	}
	var ev events
	var reason string
	err := w.inNS(func() (err error) {
		if ev, err = w.sys.open(); err != nil {
			return err
		}
		// Subscribed first, read second: a change in between is heard.
		reason, w.compat, err = w.sys.scan()
		return err
	})
	if err != nil {
		if ev != nil {
			ev.close()
		}
		w.log.Warn("fluxvm: XDP route cache off", "err", err)
		w.setCache("the node's routing cannot be watched: " + err.Error())
		return
	}
	w.setCache(reason)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed { // Close came first: it found nothing to stop
		ev.close()
		return
	}
	w.ev, w.stop, w.done = ev, make(chan struct{}), make(chan struct{})
	go w.loop(ev, w.stop, w.done)
}

// netlinkEvents reads notifications from the rtnetlink socket fd.
type netlinkEvents int

func (fd netlinkEvents) recv(buf []byte, wait bool) (int, error) {
	flags := unix.MSG_DONTWAIT
	if wait {
		flags = 0 // the socket's receive timeout
	}
	n, _, err := unix.Recvfrom(int(fd), buf, flags)
	return n, err
}

func (fd netlinkEvents) close() error { return unix.Close(int(fd)) }

// routeSocket is a NETLINK_ROUTE socket in the current namespace joined
// to routeWatchGroups, whose reads time out so that a stop is heard.
func routeSocket() (int, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return -1, fmt.Errorf("rtnetlink socket: %w", err)
	}
	fail := func(what string, err error) (int, error) {
		unix.Close(fd)
		return -1, fmt.Errorf("rtnetlink %s: %w", what, err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fail("bind", err)
	}
	for _, g := range routeWatchGroups {
		if err := unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_ADD_MEMBERSHIP, g); err != nil {
			return fail(fmt.Sprintf("join group %d", g), err)
		}
	}
	// Room for a burst of notifications (a routing daemon converging);
	// an overrun is heard (ENOBUFS) and handled, but costs a full read.
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 4<<20); err != nil {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<20)
	}
	tv := unix.NsecToTimeval((200 * time.Millisecond).Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return fail("timeout", err)
	}
	return fd, nil
}

// loop reads notifications until stopped. Any routing change empties the
// cache at once; one that may make a route depend on more than the
// backend (a rule, a multipath, TOS or source route, lost notifications)
// turns it off at once, until a full read of the rules and routes, at
// most one every rescanEvery, finds it may be on. The lease is renewed
// every renewEvery while on.
func (w *Watch) loop(ev events, stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	buf := make([]byte, 1<<16)
	var lastScan, lastRenew time.Time
	rescan := false
	for {
		select {
		case <-stop:
			return
		default:
		}
		var c routeChange
		n, err := ev.recv(buf, true)
		for err == nil || errors.Is(err, unix.ENOBUFS) {
			if err != nil {
				// Notifications were lost: whatever they said.
				c.heard, c.off = true, true
			} else {
				c.add(classifyRouting(buf[:n], w.routeReason(), w.compat))
			}
			// What else is queued, in one batch.
			n, err = ev.recv(buf, false)
		}
		if !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EINTR) {
			w.log.Warn("fluxvm: XDP route cache off: the route watch failed", "err", err)
			w.setCache("the route watch failed: " + err.Error())
			return
		}
		switch {
		case c.off:
			if w.Status().Enabled {
				w.setCache("reading the node's rules and routes again after a change")
			}
			rescan = true
		case c.heard:
			w.Invalidate()
		}
		if c.rescan {
			rescan = true
		}
		now := time.Now()
		if rescan && now.Sub(lastScan) >= w.sys.rescanEvery {
			lastScan = now
			var reason string
			var compat bool
			err := w.inNS(func() (err error) {
				reason, compat, err = w.sys.scan()
				return err
			})
			if err == nil {
				w.compat = compat
			}
			if err != nil {
				reason = "reading the node's rules and routes failed: " + err.Error()
			} else {
				rescan = false
			}
			w.setCache(reason)
			lastRenew = now
			continue
		}
		if w.Status().Enabled && now.Sub(lastRenew) >= w.sys.renewEvery {
			lastRenew = now
			if err := w.dp.SetXDPRouteCache(cacheLease); err != nil {
				w.log.Warn("fluxvm: XDP route cache: renew the lease", "err", err)
			}
		}
	}
}

// routeReason is why the cache is off because of the node's routing, or
// "" (on, or off for another reason).
func (w *Watch) routeReason() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if strings.HasPrefix(w.status.Reason, routeReasonPrefix) {
		return w.status.Reason
	}
	return ""
}

// routeReasonPrefix starts every reason scanRouting gives.
const routeReasonPrefix = "routing that depends on more than the backend: "

// routeChange is what a batch of notifications asks of the watch.
type routeChange struct {
	heard  bool // a routing change: empty the cache
	off    bool // it may make a route depend on more than the backend
	rescan bool // read the rules and routes again (to turn the cache on)
}

func (c *routeChange) add(o routeChange) {
	c.heard, c.off, c.rescan = c.heard || o.heard, c.off || o.off, c.rescan || o.rescan
}

// classifyRouting reads one datagram of notifications; offBy is why the
// cache is off because of the routing now, or ""; compat is the node's
// nexthop_compat_mode.
func classifyRouting(b []byte, offBy string, compat bool) routeChange {
	var c routeChange
	msgs, err := syscall.ParseNetlinkMessage(b)
	if err != nil {
		return routeChange{heard: true, off: true}
	}
	for i := range msgs {
		m := &msgs[i]
		switch m.Header.Type {
		case unix.RTM_NEWNEIGH, unix.RTM_DELNEIGH:
			// A bridge's forwarding database is no neighbour of the FIB.
			if len(m.Data) > 0 && m.Data[0] == unix.AF_BRIDGE {
				continue
			}
			c.heard = true
		case unix.RTM_NEWRULE, unix.RTM_DELRULE:
			c.heard, c.off = true, true
		case unix.RTM_NEWROUTE, unix.RTM_DELROUTE:
			c.heard = true
			if routeDepends(m, compat) != "" {
				c.off = true
			} else if offBy != "" && m.Header.Type == unix.RTM_DELROUTE {
				// Maybe the route that kept the cache off.
				c.rescan = true
			}
		default:
			c.heard = true
		}
	}
	return c
}

// routeDepends says why the route in m makes the answer toward a
// destination depend on more than the destination and the ingress
// interface, or "".
func routeDepends(m *syscall.NetlinkMessage, compat bool) string {
	if len(m.Data) < unix.SizeofRtMsg {
		return "a route notification that cannot be read"
	}
	rtm := (*unix.RtMsg)(unsafe.Pointer(&m.Data[0]))
	if rtm.Tos != 0 {
		return "a route that selects by TOS"
	}
	if rtm.Src_len != 0 {
		return "a route that selects by source (from)"
	}
	attrs, err := syscall.ParseNetlinkRouteAttr(m)
	if err != nil {
		return "a route notification that cannot be read"
	}
	for _, a := range attrs {
		switch a.Attr.Type {
		case unix.RTA_MULTIPATH:
			return "a multipath route"
		case rtaNHID:
			// With nexthop_compat_mode (the default) a route through a
			// group is also shown with RTA_MULTIPATH; without it, any
			// nexthop object may be a group.
			if !compat {
				return "a route through a nexthop object (net.ipv4.nexthop_compat_mode is 0)"
			}
		}
	}
	return ""
}

// nexthopCompat reads net.ipv4.nexthop_compat_mode of the calling thread's
// namespace (a kernel without nexthop objects has none: compatible).
func nexthopCompat() bool {
	b, err := os.ReadFile("/proc/sys/net/ipv4/nexthop_compat_mode")
	return err != nil || strings.TrimSpace(string(b)) != "0"
}

// scanRouting reads the node's rules and routes (in its namespace) and
// says why a route toward a backend may depend on more than its address
// and the ingress interface, or "". The FIB lookup XDP makes leaves the
// mark, the ports, the protocol and the output interface unset, so rules
// that select on those give every packet the same answer; rules that
// select by source or TOS do not.
func scanRouting() (reason string, compat bool, err error) {
	compat = nexthopCompat()
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		if _, err := os.Stat("/proc/sys/net/ipv6"); fam == unix.AF_INET6 && err != nil {
			continue // IPv6 disabled (ipv6.disable=1): no rules, no routes
		}
		rules, err := dumpRouting(unix.RTM_GETRULE, fam)
		if err != nil {
			return "", compat, fmt.Errorf("rules: %w", err)
		}
		for i := range rules {
			// A rule's header has rtmsg's layout (struct fib_rule_hdr).
			if len(rules[i].Data) < unix.SizeofRtMsg {
				continue
			}
			h := (*unix.RtMsg)(unsafe.Pointer(&rules[i].Data[0]))
			if h.Src_len != 0 || h.Tos != 0 {
				return routeReasonPrefix + "a policy rule that selects by source or TOS (ip rule)", compat, nil
			}
		}
		routes, err := dumpRouting(unix.RTM_GETROUTE, fam)
		if err != nil {
			return "", compat, fmt.Errorf("routes: %w", err)
		}
		for i := range routes {
			if why := routeDepends(&routes[i], compat); why != "" {
				return routeReasonPrefix + why, compat, nil
			}
		}
	}
	return "", compat, nil
}

// dumpRouting dumps rules or routes of a family, again when the kernel
// says a change interrupted the dump.
func dumpRouting(typ, fam int) ([]syscall.NetlinkMessage, error) {
	for range 5 {
		b, err := syscall.NetlinkRIB(typ, fam)
		if err != nil {
			return nil, err
		}
		msgs, err := syscall.ParseNetlinkMessage(b)
		if err != nil {
			return nil, err
		}
		intr := false
		out := msgs[:0]
		for _, m := range msgs {
			intr = intr || m.Header.Flags&nlmFDumpIntr != 0
			if int(m.Header.Type) == typ-2 { // RTM_NEW* of the RTM_GET* asked
				out = append(out, m)
			}
		}
		if !intr {
			return out, nil
		}
	}
	return nil, errors.New("the dump was interrupted by changes five times")
}
