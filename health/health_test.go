package health

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"go.uber.org/goleak"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

var errDown = errors.New("connection refused")

// TestStatusTransitions drives the state machine through every
// transition. Each step is one check: "+" a success, "-" a failure; the
// row lists the state and the consecutive counts after every step.
func TestStatusTransitions(t *testing.T) {
	type step struct {
		ok         bool
		state      State
		succ, fail uint32
		changed    bool
	}
	ok := func(st State, succ uint32, changed bool) step { return step{true, st, succ, 0, changed} }
	ko := func(st State, fail uint32, changed bool) step { return step{false, st, 0, fail, changed} }
	tests := []struct {
		name  string
		th    Thresholds
		steps []step
	}{
		{"unknown to healthy on the first success", Thresholds{3, 2}, []step{
			ok(Healthy, 1, true), ok(Healthy, 2, false), ok(Healthy, 3, false)}},
		{"unknown stays unknown below the unhealthy threshold", Thresholds{3, 2}, []step{
			ko(Unknown, 1, false), ko(Unknown, 2, false)}},
		{"unknown to unhealthy at the threshold", Thresholds{3, 2}, []step{
			ko(Unknown, 1, false), ko(Unknown, 2, false), ko(Unhealthy, 3, true), ko(Unhealthy, 4, false)}},
		{"unknown, failures, then success", Thresholds{3, 2}, []step{
			ko(Unknown, 1, false), ko(Unknown, 2, false), ok(Healthy, 1, true)}},
		{"healthy to unhealthy at the threshold", Thresholds{3, 2}, []step{
			ok(Healthy, 1, true), ko(Healthy, 1, false), ko(Healthy, 2, false), ko(Unhealthy, 3, true)}},
		{"a success resets the failure run", Thresholds{3, 2}, []step{
			ok(Healthy, 1, true), ko(Healthy, 1, false), ko(Healthy, 2, false), ok(Healthy, 1, false),
			ko(Healthy, 1, false), ko(Healthy, 2, false), ko(Unhealthy, 3, true)}},
		{"unhealthy to healthy at the threshold", Thresholds{3, 2}, []step{
			ko(Unknown, 1, false), ko(Unknown, 2, false), ko(Unhealthy, 3, true),
			ok(Unhealthy, 1, false), ok(Healthy, 2, true), ok(Healthy, 3, false)}},
		{"a failure resets the success run", Thresholds{1, 3}, []step{
			ko(Unhealthy, 1, true), ok(Unhealthy, 1, false), ok(Unhealthy, 2, false), ko(Unhealthy, 1, false),
			ok(Unhealthy, 1, false), ok(Unhealthy, 2, false), ok(Healthy, 3, true)}},
		{"thresholds of 1", Thresholds{1, 1}, []step{
			ko(Unhealthy, 1, true), ok(Healthy, 1, true), ko(Unhealthy, 1, true), ko(Unhealthy, 2, false),
			ok(Healthy, 1, true), ok(Healthy, 2, false)}},
		{"thresholds of 0 count as 1", Thresholds{0, 0}, []step{
			ko(Unhealthy, 1, true), ok(Healthy, 1, true)}},
		{"flapping below both thresholds keeps healthy", Thresholds{2, 2}, []step{
			ok(Healthy, 1, true), ko(Healthy, 1, false), ok(Healthy, 1, false), ko(Healthy, 1, false),
			ok(Healthy, 1, false), ko(Healthy, 1, false)}},
		{"flapping below both thresholds keeps unhealthy", Thresholds{2, 2}, []step{
			ko(Unknown, 1, false), ko(Unhealthy, 2, true), ok(Unhealthy, 1, false), ko(Unhealthy, 1, false),
			ok(Unhealthy, 1, false), ko(Unhealthy, 1, false)}},
		{"flapping with thresholds of 1 follows every check", Thresholds{1, 1}, []step{
			ok(Healthy, 1, true), ko(Unhealthy, 1, true), ok(Healthy, 1, true), ko(Unhealthy, 1, true)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
			s := NewStatus(t0)
			if s.State != Unknown || !s.LastChange.Equal(t0) || !s.LastCheck.IsZero() {
				t.Fatalf("new status %+v", s)
			}
			lastChange := t0
			for i, st := range tt.steps {
				now := t0.Add(time.Duration(i+1) * time.Second)
				var err error
				if !st.ok {
					err = errDown
				}
				changed := s.Observe(err, tt.th, now)
				if changed {
					lastChange = now
				}
				if s.State != st.state || s.Successes != st.succ || s.Failures != st.fail || changed != st.changed {
					t.Fatalf("step %d (ok=%v): state %s, successes %d, failures %d, changed %v; want %s, %d, %d, %v",
						i, st.ok, s.State, s.Successes, s.Failures, changed, st.state, st.succ, st.fail, st.changed)
				}
				if !s.LastChange.Equal(lastChange) || !s.LastCheck.Equal(now) {
					t.Fatalf("step %d: last change %v, last check %v; want %v, %v", i, s.LastChange, s.LastCheck, lastChange, now)
				}
			}
		})
	}
}

func TestStatusLastErrorKept(t *testing.T) {
	now := time.Now()
	s := NewStatus(now)
	s.Observe(errors.New("first"), Thresholds{3, 2}, now)
	s.Observe(errors.New("second"), Thresholds{3, 2}, now)
	if s.LastError != "second" {
		t.Errorf("last error %q, want second", s.LastError)
	}
	s.Observe(nil, Thresholds{3, 2}, now)
	if s.LastError != "second" {
		t.Errorf("after a success: last error %q, want it kept", s.LastError)
	}
}

func TestStatusCountsSaturate(t *testing.T) {
	s := NewStatus(time.Now())
	s.Failures = ^uint32(0)
	s.State = Unhealthy
	s.Observe(errDown, Thresholds{3, 2}, time.Now())
	if s.Failures != ^uint32(0) {
		t.Errorf("failures %d, want saturated", s.Failures)
	}
}

// blockingDial never connects: it waits for its context and counts how
// many calls are in it at once. When entered is set, every call sends on
// it (without blocking) once it is counted.
type blockingDial struct {
	mu        sync.Mutex
	now, peak int
	calls     atomic.Int32
	entered   chan struct{}
}

func (b *blockingDial) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	b.calls.Add(1)
	if b.entered != nil {
		select {
		case b.entered <- struct{}{}:
		default:
		}
	}
	b.mu.Lock()
	b.now++
	b.peak = max(b.peak, b.now)
	b.mu.Unlock()
	<-ctx.Done()
	b.mu.Lock()
	b.now--
	b.mu.Unlock()
	return nil, ctx.Err()
}

func TestProberTimeoutAndConcurrency(t *testing.T) {
	leaks := goleak.IgnoreCurrent()
	b := &blockingDial{}
	p := NewProber(b.dial, 4)
	if p.Concurrency() != 4 {
		t.Fatalf("concurrency %d", p.Concurrency())
	}
	var targets []Target
	for i := range 10 {
		targets = append(targets, Target{Addr: netip.AddrPortFrom(netip.MustParseAddr("192.0.2.1"), uint16(1000+i)), Timeout: 30 * time.Millisecond})
	}
	start := time.Now()
	res := p.CheckAll(context.Background(), targets)
	took := time.Since(start)
	if b.peak != 4 {
		t.Errorf("peak of %d checks at once, want 4", b.peak)
	}
	if b.calls.Load() != 10 {
		t.Errorf("%d dials, want 10", b.calls.Load())
	}
	// 10 checks of 30 ms, 4 at a time: 3 waves.
	if took < 90*time.Millisecond {
		t.Errorf("took %v; 3 waves of 30 ms cannot be faster", took)
	}
	for i, r := range res {
		if r.Addr != targets[i].Addr {
			t.Errorf("result %d is for %s, want %s", i, r.Addr, targets[i].Addr)
		}
		if r.Err == nil || !strings.Contains(r.Err.Error(), "no answer within 30ms") || errors.Is(r.Err, ErrCanceled) {
			t.Errorf("result %d: %v, want a timeout", i, r.Err)
		}
	}
	// CheckAll's workers end before it returns.
	goleak.VerifyNone(t, leaks)
}

func TestProberCanceled(t *testing.T) {
	leaks := goleak.IgnoreCurrent()
	b := &blockingDial{entered: make(chan struct{}, 1)}
	p := NewProber(b.dial, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Cancel once the first check is in its dial; the second waits for
	// the only slot meanwhile.
	go func() {
		select {
		case <-b.entered:
			cancel()
		case <-time.After(10 * time.Second):
			t.Error("the first check never dialed")
			cancel()
		}
	}()
	target := Target{Addr: netip.MustParseAddrPort("192.0.2.1:80"), Timeout: time.Minute}
	res := p.CheckAll(ctx, []Target{target, target})
	for i, r := range res {
		if !errors.Is(r.Err, ErrCanceled) {
			t.Errorf("result %d: %v, want ErrCanceled", i, r.Err)
		}
	}
	if n := b.calls.Load(); n != 1 {
		t.Errorf("%d dials; the second check waits for the slot and sees the cancel", n)
	}
	if got := p.CheckAll(context.Background(), nil); len(got) != 0 {
		t.Errorf("no targets: %v", got)
	}
	goleak.VerifyNone(t, leaks)
}

// TestProberRealSockets checks against real sockets in a namespace of the
// test's own: a listener answers, a closed port refuses, and an address
// that nobody answers ARP for times out. The dial
// function enters the namespace, as fluxvm's does for the node.
func TestProberRealSockets(t *testing.T) {
	ns := testenv.NewNetNS(t, "fvhealth")
	var open, closed net.Listener
	err := ns.Do(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			return err
		}
		// 192.0.2.2 is on a veth whose peer has no address: the ARP
		// request goes unanswered, so a connect there hangs.
		a, _, err := testenv.VethPair("fvh-a", "fvh-b")
		if err != nil {
			return err
		}
		addr, _ := netlink.ParseAddr("192.0.2.1/24")
		if err := netlink.AddrAdd(a, addr); err != nil {
			return err
		}
		if open, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			return err
		}
		closed, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	closedAddr := netip.MustParseAddrPort(closed.Addr().String())
	closed.Close()
	accepted := make(chan struct{}, 1)
	go func() {
		for {
			c, err := open.Accept()
			if err != nil {
				return
			}
			c.Close()
			select {
			case accepted <- struct{}{}:
			default:
			}
		}
	}()

	dial := func(ctx context.Context, network, addr string) (c net.Conn, err error) {
		err = ns.Do(func() error {
			var d net.Dialer
			c, err = d.DialContext(ctx, network, addr)
			return err
		})
		return c, err
	}
	p := NewProber(dial, 0)
	if p.Concurrency() != DefaultConcurrency {
		t.Errorf("concurrency %d, want %d", p.Concurrency(), DefaultConcurrency)
	}
	res := p.CheckAll(context.Background(), []Target{
		{Addr: netip.MustParseAddrPort(open.Addr().String()), Timeout: time.Second},
		{Addr: closedAddr, Timeout: time.Second},
		{Addr: netip.MustParseAddrPort("192.0.2.2:80"), Timeout: 100 * time.Millisecond},
	})
	if res[0].Err != nil {
		t.Errorf("listening port: %v", res[0].Err)
	}
	select {
	case <-accepted:
	case <-time.After(time.Second):
		t.Error("the listener saw no connection")
	}
	if res[1].Err == nil || !strings.Contains(res[1].Err.Error(), "refused") {
		t.Errorf("closed port: %v, want connection refused", res[1].Err)
	}
	if res[2].Err == nil || !strings.Contains(res[2].Err.Error(), "no answer within 100ms") {
		t.Errorf("blackholed address: %v, want a timeout", res[2].Err)
	}
	if res[2].Took < 100*time.Millisecond || res[2].Took > 2*time.Second {
		t.Errorf("blackholed address: took %v", res[2].Took)
	}
}
