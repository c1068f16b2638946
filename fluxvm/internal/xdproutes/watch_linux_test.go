package xdproutes

import (
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// fakeDP records what the watch asks of the datapath's route cache.
type fakeDP struct {
	mu          sync.Mutex
	leases      []time.Duration // SetXDPRouteCache calls
	invalidated int             // InvalidateXDPRoutes calls
	err         error           // what both return
}

func (f *fakeDP) SetXDPRouteCache(lease time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.leases = append(f.leases, lease)
	return f.err
}

func (f *fakeDP) InvalidateXDPRoutes() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.invalidated++
	return f.err
}

func (f *fakeDP) counts() (leases, renewals, invalidated int, last time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, l := range f.leases {
		if l == cacheLease {
			renewals++
		}
	}
	if n := len(f.leases); n > 0 {
		last = f.leases[n-1]
	}
	return len(f.leases), renewals, f.invalidated, last
}

// fakeEvents hands the watch the datagrams (or errors) the test sends.
type fakeEvents struct {
	ch     chan datagram
	mu     sync.Mutex
	closed bool
}

type datagram struct {
	b   []byte
	err error
}

func (e *fakeEvents) recv(buf []byte, wait bool) (int, error) {
	var d datagram
	if wait {
		select {
		case d = <-e.ch:
		case <-time.After(5 * time.Millisecond):
			return 0, unix.EAGAIN
		}
	} else {
		select {
		case d = <-e.ch:
		default:
			return 0, unix.EAGAIN
		}
	}
	return copy(buf, d.b), d.err
}

func (e *fakeEvents) close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	return nil
}

// fakeRouting is the node's routing as scan reads it.
type fakeRouting struct {
	mu     sync.Mutex
	reason string
	err    error
	scans  int
}

func (r *fakeRouting) set(reason string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reason, r.err = reason, err
}

func (r *fakeRouting) scan() (string, bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.scans++
	return r.reason, true, r.err
}

// nlmsg is one netlink message of type typ with payload data.
func nlmsg(typ uint16, data []byte) []byte {
	b := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+len(data)+3)
	binary.NativeEndian.PutUint32(b[0:], uint32(unix.NLMSG_HDRLEN+len(data)))
	binary.NativeEndian.PutUint16(b[4:], typ)
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// rtmsg is a struct rtmsg with the given source length and TOS, then the
// attributes of the given types (four bytes of zeros each).
func rtmsg(srcLen, tos uint8, attrs ...uint16) []byte {
	b := make([]byte, unix.SizeofRtMsg)
	b[0], b[2], b[3] = unix.AF_INET, srcLen, tos
	for _, a := range attrs {
		attr := make([]byte, 8)
		binary.NativeEndian.PutUint16(attr[0:], 8)
		binary.NativeEndian.PutUint16(attr[2:], a)
		b = append(b, attr...)
	}
	return b
}

var (
	neigh       = nlmsg(unix.RTM_NEWNEIGH, []byte{unix.AF_INET, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	bridgeNeigh = nlmsg(unix.RTM_NEWNEIGH, []byte{unix.AF_BRIDGE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	rule        = nlmsg(unix.RTM_NEWRULE, rtmsg(0, 0))
	route       = nlmsg(unix.RTM_NEWROUTE, rtmsg(0, 0))
	delRoute    = nlmsg(unix.RTM_DELROUTE, rtmsg(0, 0))
	multipath   = nlmsg(unix.RTM_NEWROUTE, rtmsg(0, 0, unix.RTA_MULTIPATH))
	fromRoute   = nlmsg(unix.RTM_NEWROUTE, rtmsg(24, 0))
	tosRoute    = nlmsg(unix.RTM_NEWROUTE, rtmsg(0, 0x10))
	nhRoute     = nlmsg(unix.RTM_NEWROUTE, rtmsg(0, 0, rtaNHID))
	link        = nlmsg(unix.RTM_NEWLINK, make([]byte, unix.SizeofIfInfomsg))
	// truncated says it is longer than it is.
	truncated = func() []byte {
		b := nlmsg(unix.RTM_NEWNEIGH, make([]byte, 12))
		binary.NativeEndian.PutUint32(b, 100)
		return b
	}()
)

// TestClassifyRouting: what a datagram of notifications asks of the
// watch: empty the cache for any routing change but a bridge's
// forwarding entries, turn it off for rules and routes that make the
// answer depend on more than the backend, read the routing again when a
// route goes while the routing keeps the cache off.
func TestClassifyRouting(t *testing.T) {
	heard, off, rescan := routeChange{heard: true}, routeChange{heard: true, off: true}, routeChange{heard: true, rescan: true}
	for _, tc := range []struct {
		name   string
		b      []byte
		offBy  string
		compat bool
		want   routeChange
	}{
		{"neighbour", neigh, "", true, heard},
		{"bridge fdb entry", bridgeNeigh, "", true, routeChange{}},
		{"link", link, "", true, heard},
		{"rule", rule, "", true, off},
		{"route", route, "", true, heard},
		{"route while off for routing", route, routeReasonPrefix + "x", true, heard},
		{"route deleted", delRoute, "", true, heard},
		{"route deleted while off for routing", delRoute, routeReasonPrefix + "x", true, rescan},
		{"multipath route", multipath, "", true, off},
		{"route by source", fromRoute, "", true, off},
		{"route by TOS", tosRoute, "", true, off},
		{"route through a nexthop, compat", nhRoute, "", true, heard},
		{"route through a nexthop, no compat", nhRoute, "", false, off},
		{"a batch", append(append([]byte{}, neigh...), multipath...), "", true, off},
		{"a short route", nlmsg(unix.RTM_NEWROUTE, []byte{1, 2}), "", true, off},
		{"unreadable", truncated, "", true, off},
	} {
		if got := classifyRouting(tc.b, tc.offBy, tc.compat); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

// watching starts a watch on the fake datapath, events and routing.
func watching(t *testing.T, dp *fakeDP, r *fakeRouting, openErr error) (*Watch, *fakeEvents) {
	t.Helper()
	w, err := New(Config{}, Deps{Datapath: dp, Log: quiet})
	if err != nil {
		t.Fatal(err)
	}
	ev := &fakeEvents{ch: make(chan datagram, 16)}
	w.sys = system{
		idle: "idle",
		open: func() (events, error) {
			if openErr != nil {
				return nil, openErr
			}
			return ev, nil
		},
		scan:        r.scan,
		rescanEvery: 20 * time.Millisecond,
		renewEvery:  10 * time.Millisecond,
	}
	w.Start()
	t.Cleanup(func() { w.Close() })
	return w, ev
}

// waitStatus polls the watch's status for up to 5 s.
func waitStatus(t *testing.T, w *Watch, what string, ok func(Status) bool) Status {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st := w.Status()
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: status %+v", what, st)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestWatch drives the watch's loop through routing changes: each
// empties the cache (counted in the status, and on the datapath); a
// rule, a multipath route or lost notifications turn it off at once,
// until a read of the routing finds it may be on again (or says why
// not); the lease is renewed while on; Close waits for the loop, closes
// the notifications and drops the lease.
func TestWatch(t *testing.T) {
	dp, r := &fakeDP{}, &fakeRouting{}
	w, ev := watching(t, dp, r, nil)
	st := waitStatus(t, w, "start", func(s Status) bool { return s.Enabled })
	if _, _, _, last := dp.counts(); last != cacheLease || st.Reason != "" || st.Invalidations != 1 {
		t.Fatalf("start: status %+v, last lease %v", st, last)
	}
	on := func(s Status) bool { return s.Enabled }
	offFor := func(why string) func(Status) bool {
		return func(s Status) bool { return !s.Enabled && strings.Contains(s.Reason, why) }
	}
	for _, step := range []struct {
		name    string
		routing string // what a read of the routing finds from now on
		send    []datagram
		want    func(Status) bool
		emptied bool // InvalidateXDPRoutes called
		quiet   bool // the cache left alone: nothing counted
	}{
		{name: "a neighbour", send: []datagram{{b: neigh}}, want: on, emptied: true},
		{name: "a batch of three", send: []datagram{{b: neigh}, {b: route}, {b: link}}, want: on, emptied: true},
		{name: "a bridge's fdb entry", send: []datagram{{b: bridgeNeigh}}, want: on, quiet: true},
		{name: "a rule by source", routing: routeReasonPrefix + "a policy rule that selects by source or TOS (ip rule)",
			send: []datagram{{b: rule}}, want: offFor("a policy rule")},
		{name: "a route while off", routing: routeReasonPrefix + "a policy rule that selects by source or TOS (ip rule)",
			send: []datagram{{b: route}}, want: offFor("a policy rule"), emptied: true},
		{name: "the rule removed, a route deleted", send: []datagram{{b: delRoute}}, want: on, emptied: true},
		{name: "a multipath route", routing: routeReasonPrefix + "a multipath route",
			send: []datagram{{b: multipath}}, want: offFor("multipath")},
		{name: "the multipath route deleted", send: []datagram{{b: delRoute}}, want: on, emptied: true},
		{name: "lost notifications", send: []datagram{{err: unix.ENOBUFS}}, want: on},
		{name: "a rule the routing allows", routing: "", send: []datagram{{b: rule}}, want: on},
	} {
		r.set(step.routing, nil)
		before := w.Status().Invalidations
		_, _, inv, _ := dp.counts()
		for _, d := range step.send {
			ev.ch <- d
		}
		if !step.quiet {
			waitStatus(t, w, step.name, func(s Status) bool { return s.Invalidations > before && step.want(s) })
		}
		time.Sleep(30 * time.Millisecond) // past a rescan: what it says stays
		if st := w.Status(); !step.want(st) || step.quiet && st.Invalidations != before {
			t.Errorf("%s: later, status %+v (%d invalidations before)", step.name, st, before)
		}
		if _, _, inv2, _ := dp.counts(); (inv2 > inv) != step.emptied {
			t.Errorf("%s: %d invalidations of the datapath, want some: %v", step.name, inv2-inv, step.emptied)
		}
	}

	// Renewed while on.
	_, renewals, _, _ := dp.counts()
	time.Sleep(50 * time.Millisecond)
	if _, r2, _, _ := dp.counts(); r2 < renewals+2 {
		t.Errorf("%d renewals in 50 ms, want a few (every 10 ms)", r2-renewals)
	}

	// A read of the routing that fails keeps the cache off, saying why.
	r.set("", errors.New("dump broke"))
	ev.ch <- datagram{b: rule}
	waitStatus(t, w, "a failed read", offFor("reading the node's rules and routes failed: dump broke"))
	r.set("", nil)
	waitStatus(t, w, "a read that works again", on)

	w.Close()
	if st := w.Status(); st.Enabled || st.Reason != "the dataplane is closed" {
		t.Errorf("after Close: status %+v", st)
	}
	if _, _, _, last := dp.counts(); last != 0 {
		t.Errorf("after Close: the last lease set is %v, want 0 (off)", last)
	}
	ev.mu.Lock()
	closed := ev.closed
	ev.mu.Unlock()
	if !closed {
		t.Error("after Close: the notifications are still open")
	}
	n, _, _, _ := dp.counts()
	time.Sleep(30 * time.Millisecond)
	if n2, _, _, _ := dp.counts(); n2 != n {
		t.Errorf("after Close: %d more lease calls", n2-n)
	}
	w.Close() // idempotent
}

// TestWatchFails: a watch whose notifications fail turns the cache off
// and stops, saying why.
func TestWatchFails(t *testing.T) {
	dp, r := &fakeDP{}, &fakeRouting{}
	w, ev := watching(t, dp, r, nil)
	waitStatus(t, w, "start", func(s Status) bool { return s.Enabled })
	ev.ch <- datagram{err: unix.EBADF}
	st := waitStatus(t, w, "a broken socket", func(s Status) bool { return !s.Enabled })
	if !strings.HasPrefix(st.Reason, "the route watch failed: ") {
		t.Errorf("status %+v", st)
	}
	if _, _, _, last := dp.counts(); last != 0 {
		t.Errorf("the last lease set is %v, want 0 (off)", last)
	}
	ev.ch <- datagram{b: neigh}
	time.Sleep(30 * time.Millisecond)
	if _, _, inv, _ := dp.counts(); inv != 0 {
		t.Errorf("%d invalidations after the watch stopped", inv)
	}
}

// TestStart: how a watch starts. xdp_mode off: no watch, nothing asked of
// the datapath, Invalidate does nothing; notifications or the routing
// that cannot be read: off, with why; routing that depends on more than
// the backend: off with why, watching; a datapath that refuses the lease:
// off, with its error.
func TestStart(t *testing.T) {
	for _, tc := range []struct {
		name      string
		xdpOff    bool
		openErr   error
		scanErr   error
		routing   string
		dpErr     error
		want      Status
		leases    []time.Duration
		evClosed  bool
		watching  bool
		invalided int // InvalidateXDPRoutes calls by one Invalidate
	}{
		{name: "xdp_mode off", xdpOff: true, want: Status{Reason: "xdp_mode is off"}},
		{name: "on", want: Status{Enabled: true, Invalidations: 1}, leases: []time.Duration{cacheLease}, watching: true, invalided: 1},
		{name: "no notifications", openErr: errors.New("rtnetlink socket: EPERM"),
			want:   Status{Reason: "the node's routing cannot be watched: rtnetlink socket: EPERM", Invalidations: 1},
			leases: []time.Duration{0}, invalided: 1},
		{name: "routing unreadable", scanErr: errors.New("rules: EPERM"),
			want:   Status{Reason: "the node's routing cannot be watched: rules: EPERM", Invalidations: 1},
			leases: []time.Duration{0}, evClosed: true, invalided: 1},
		{name: "routing by source", routing: routeReasonPrefix + "a route that selects by source (from)",
			want:   Status{Reason: routeReasonPrefix + "a route that selects by source (from)", Invalidations: 1},
			leases: []time.Duration{0}, watching: true, invalided: 1},
		{name: "the datapath refuses", dpErr: errors.New("map update: EPERM"),
			want: Status{Reason: "map update: EPERM"}, leases: []time.Duration{cacheLease}, watching: true, invalided: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dp := &fakeDP{err: tc.dpErr}
			ev := &fakeEvents{ch: make(chan datagram)}
			var inNS int
			w, err := New(Config{XDPOff: tc.xdpOff}, Deps{Datapath: dp, Log: quiet,
				InNamespace: func(f func() error) error { inNS++; return f() }})
			if err != nil {
				t.Fatal(err)
			}
			opened := false
			w.sys.open = func() (events, error) {
				opened = true
				if tc.openErr != nil {
					return nil, tc.openErr
				}
				return ev, nil
			}
			w.sys.scan = func() (string, bool, error) { return tc.routing, true, tc.scanErr }
			w.sys.rescanEvery, w.sys.renewEvery = time.Hour, time.Hour
			w.Start()
			defer w.Close()
			if opened != !tc.xdpOff || inNS != map[bool]int{true: 0, false: 1}[tc.xdpOff] {
				t.Errorf("opened %v, %d calls in the namespace", opened, inNS)
			}
			if st := w.Status(); st != tc.want {
				t.Errorf("status %+v, want %+v", st, tc.want)
			}
			dp.mu.Lock()
			leases := append([]time.Duration(nil), dp.leases...)
			dp.mu.Unlock()
			if !slices.Equal(leases, tc.leases) {
				t.Errorf("leases %v, want %v", leases, tc.leases)
			}
			if ev.closed != tc.evClosed {
				t.Errorf("notifications closed %v, want %v", ev.closed, tc.evClosed)
			}
			w.mu.Lock()
			running := w.stop != nil
			w.mu.Unlock()
			if running != tc.watching {
				t.Errorf("watching %v, want %v", running, tc.watching)
			}
			before := w.Status().Invalidations
			w.Invalidate()
			_, _, inv, _ := dp.counts()
			if inv != tc.invalided {
				t.Errorf("Invalidate: %d calls of the datapath, want %d", inv, tc.invalided)
			}
			if got, want := w.Status().Invalidations-before, uint64(tc.invalided); tc.dpErr == nil && got != want || tc.dpErr != nil && got != 0 {
				t.Errorf("Invalidate: %d counted", got)
			}
		})
	}
	var none *Watch
	none.Start()
	none.Invalidate()
	if st := none.Status(); st.Reason != "xdp_mode is off" || none.Close() != nil {
		t.Errorf("nil watch: status %+v", st)
	}
	if _, err := New(Config{}, Deps{}); err == nil {
		t.Error("New without a datapath succeeded")
	}
}
