//go:build linux

package scenario

// End-to-end tests of the VM-edge service datapath with real sockets: a
// client VM talks to the service's VIPs (10.96.0.10 and fd00:96::10, port 80,
// TCP and UDP) and the backend VMs' identity servers say who answered. Every
// test builds its own Env (namespaces, pin root, catalog), and Env.Close
// removes all of it, also when the test fails.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

const (
	e2eOK   = 3 * time.Second        // bound on what must succeed
	e2eFail = 300 * time.Millisecond // bound on what must fail
)

var e2eFamilies = []struct {
	name string
	vip  netip.Addr
}{{"ipv4", VIP4}, {"ipv6", VIP6}}

func e2eNewEnv(t *testing.T, backends int) *Env {
	t.Helper()
	return e2eNewEnvConfig(t, backends, nil)
}

// e2eNewEnvConfig is e2eNewEnv with a hook on the node configuration (see
// NewEnvConfig).
func e2eNewEnvConfig(t *testing.T, backends int, configure func(*fluxvm.Config)) *Env {
	t.Helper()
	testenv.RequirePrivileged(t)
	e, err := NewEnvConfig(backends, nil, configure)
	if err != nil {
		t.Fatalf("scenario env: %v", err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("scenario env close: %v", err)
		}
	})
	return e
}

// e2eBackend is one backend VM of a service under test.
type e2eBackend struct {
	vm     string
	weight uint32
	state  fluxvm.BackendState
	until  time.Time // drain deadline of a draining backend
}

// e2eService is Env.Service over the listed backend VMs only (both of each
// VM's addresses), with their weights and states.
func e2eService(t *testing.T, e *Env, bs ...e2eBackend) fluxvm.Service {
	t.Helper()
	s := e.Service("web", nil)
	s.Backends = nil
	for _, b := range bs {
		vm, _, err := e.Backend(b.vm)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range []netip.Addr{vm.Addr4, vm.Addr6} {
			w := b.weight
			fb := fluxvm.Backend{Address: a, Port: BackendPort, Weight: &w, State: b.state}
			if !b.until.IsZero() {
				fb.DrainUntilUnixMs = b.until.UnixMilli()
			}
			s.Backends = append(s.Backends, fb)
		}
	}
	return s
}

func e2eApply(t *testing.T, e *Env, svc fluxvm.Service) fluxvm.ServiceStatus {
	t.Helper()
	st, err := e.DP.ApplyService(context.Background(), svc)
	if err != nil {
		t.Fatalf("apply %s: %v", svc.Name, err)
	}
	return st
}

// e2eUDP is a connected UDP socket in a VM: one 5-tuple, as long as it
// lives. The reply must come from the address the socket is connected to
// (the VIP), so an answer also proves the reverse NAT.
type e2eUDP struct {
	c *net.UDPConn
	// Backend is the VM that answered the first datagram.
	Backend string
	seq     int
}

// e2eDialUDP opens the socket in vm towards dst, from local port lport
// (0: an ephemeral port).
func e2eDialUDP(vm *lab.VM, dst netip.AddrPort, lport uint16) (*e2eUDP, error) {
	var c *net.UDPConn
	err := vm.NS.Do(func() (err error) {
		var laddr *net.UDPAddr
		if lport != 0 {
			laddr = &net.UDPAddr{Port: int(lport)}
		}
		c, err = net.DialUDP("udp", laddr, net.UDPAddrFromAddrPort(dst))
		return err
	})
	if err != nil {
		return nil, err
	}
	return &e2eUDP{c: c}, nil
}

// Ask sends one datagram and returns the name of the VM that answered it.
// Late answers to earlier datagrams are skipped by their payload.
func (f *e2eUDP) Ask(timeout time.Duration) (string, error) {
	f.seq++
	q := fmt.Sprintf("q%d", f.seq)
	f.c.SetDeadline(time.Now().Add(timeout))
	if _, err := f.c.Write([]byte(q)); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	for {
		n, err := f.c.Read(buf)
		if err != nil {
			return "", err
		}
		if name, payload, _ := strings.Cut(string(buf[:n]), "\n"); payload == q {
			return name, nil
		}
	}
}

func (f *e2eUDP) Close() error { return f.c.Close() }

func (f *e2eUDP) String() string { return fmt.Sprintf("udp %s->%s", f.c.LocalAddr(), f.c.RemoteAddr()) }

func e2eTCPName(c *lab.Conn) string {
	return fmt.Sprintf("tcp %s->%s", c.LocalAddr(), c.RemoteAddr())
}

// e2eFlows are long-lived flows through one VIP, by the backend that took
// them.
type e2eFlows struct {
	tcp map[string][]*lab.Conn
	udp map[string][]*e2eUDP
}

// e2eOpen opens TCP connections and UDP flows from the client to vip:80
// until each backend in want holds want[vm] of each; flows that land on a
// backend that already has enough are closed again. The attempts are
// bounded: with weights that give each wanted backend a share p, 100
// attempts fail to find it with probability (1-p)^100.
func e2eOpen(t *testing.T, e *Env, vip netip.Addr, want map[string]int) e2eFlows {
	t.Helper()
	const attempts = 100
	dst := netip.AddrPortFrom(vip, 80)
	fl := e2eFlows{tcp: map[string][]*lab.Conn{}, udp: map[string][]*e2eUDP{}}
	missing := func(have func(string) int) bool {
		for vm, n := range want {
			if have(vm) < n {
				return true
			}
		}
		return false
	}
	for i := 0; missing(func(vm string) int { return len(fl.tcp[vm]) }); i++ {
		if i == attempts {
			t.Fatalf("%s tcp: no %v after %d connections (got %v)", vip, want, attempts, fl.tcp)
		}
		c, err := e.Client.DialTCP(dst, e2eOK)
		if err != nil {
			t.Fatalf("%s tcp: connect: %v", vip, err)
		}
		if len(fl.tcp[c.Backend]) < want[c.Backend] {
			fl.tcp[c.Backend] = append(fl.tcp[c.Backend], c)
			t.Cleanup(func() { c.Close() })
		} else {
			c.Close()
		}
	}
	for i := 0; missing(func(vm string) int { return len(fl.udp[vm]) }); i++ {
		if i == attempts {
			t.Fatalf("%s udp: no %v after %d flows (got %v)", vip, want, attempts, fl.udp)
		}
		f, err := e2eDialUDP(e.Client, dst, 0)
		if err != nil {
			t.Fatalf("%s udp: %v", vip, err)
		}
		if f.Backend, err = f.Ask(e2eOK); err != nil {
			f.Close()
			t.Fatalf("%s: no answer: %v", f, err)
		}
		if len(fl.udp[f.Backend]) < want[f.Backend] {
			fl.udp[f.Backend] = append(fl.udp[f.Backend], f)
			t.Cleanup(func() { f.Close() })
		} else {
			f.Close()
		}
	}
	return fl
}

func (fl e2eFlows) add(o e2eFlows) {
	for vm, cs := range o.tcp {
		fl.tcp[vm] = append(fl.tcp[vm], cs...)
	}
	for vm, fs := range o.udp {
		fl.udp[vm] = append(fl.udp[vm], fs...)
	}
}

// e2eKeep checks that every flow on the listed backends (all when none
// are listed) still reaches the backend it started on: a UDP answer names
// it; a TCP echo can only succeed there, since any other backend has no
// socket for the connection and answers with a reset.
func e2eKeep(t *testing.T, phase string, fl e2eFlows, only ...string) {
	t.Helper()
	for vm, cs := range fl.tcp {
		if len(only) > 0 && !slices.Contains(only, vm) {
			continue
		}
		for _, c := range cs {
			if err := c.Echo([]byte(phase), e2eOK); err != nil {
				t.Errorf("%s: %s on %s broke: %v", phase, e2eTCPName(c), vm, err)
			}
		}
	}
	for vm, fs := range fl.udp {
		if len(only) > 0 && !slices.Contains(only, vm) {
			continue
		}
		for _, f := range fs {
			if got, err := f.Ask(e2eOK); err != nil || got != vm {
				t.Errorf("%s: %s of %s answered by %q (%v)", phase, f, vm, got, err)
			}
		}
	}
}

// e2eNewFlows opens n fresh TCP connections (closed right away) and n
// fresh UDP flows (one datagram each, ephemeral ports) to vip:80 and
// counts the backends that answered.
// e2eFreshPorts hands out UDP source ports no flow of the e2e tests used
// before: above the kernel's default ephemeral range (32768-60999), so
// that no socket the kernel numbers takes one either.
var e2eFreshPorts atomic.Uint32

func e2eFreshPort() uint16 {
	return uint16(61000 + e2eFreshPorts.Add(1)%4500)
}

func e2eNewFlows(t *testing.T, e *Env, vip netip.Addr, n int) (tcp, udp map[string]int) {
	t.Helper()
	dst := netip.AddrPortFrom(vip, 80)
	tcp, udp = map[string]int{}, map[string]int{}
	for range n {
		c, err := e.Client.DialTCP(dst, e2eOK)
		if err != nil {
			t.Errorf("%s tcp: new connection: %v", vip, err)
			continue
		}
		tcp[c.Backend]++
		c.Close()
	}
	for range n {
		// A port of its own: one the kernel gave again could continue
		// an earlier flow of the test, pinned to an earlier backend.
		name, err := e.Client.AskUDPFrom(dst, e2eFreshPort(), e2eOK)
		if err != nil {
			t.Errorf("%s udp: new flow: %v", vip, err)
			continue
		}
		udp[name]++
	}
	return tcp, udp
}

// e2eOnly fails unless every count in got is for one of the allowed
// backends.
func e2eOnly(t *testing.T, what string, got map[string]int, allowed ...string) {
	t.Helper()
	for vm, n := range got {
		if !slices.Contains(allowed, vm) {
			t.Errorf("%s: %d new flows went to %s; only %v may take them (got %v)", what, n, vm, allowed, got)
		}
	}
}

// e2eReset checks that a TCP connection no longer reaches its backend: the
// segment goes to another backend, which resets it. A timeout instead
// would mean a blackhole.
func e2eReset(t *testing.T, what string, c *lab.Conn) {
	t.Helper()
	err := c.Echo([]byte(what), e2eOK)
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("%s: %s (was on %s): got %v, want a reset from another backend", what, e2eTCPName(c), c.Backend, err)
	}
}

// e2eFailedOver checks that a UDP flow (same socket, same 5-tuple) whose
// backend lost its flows is now answered by another backend, and keeps
// that one.
func e2eFailedOver(t *testing.T, what string, f *e2eUDP, old string) {
	t.Helper()
	got, err := f.Ask(e2eOK)
	if err != nil || got == old {
		t.Errorf("%s: %s (was on %s): answered by %q (%v), want another backend", what, f, old, got, err)
		return
	}
	if again, err := f.Ask(e2eOK); err != nil || again != got {
		t.Errorf("%s: %s failed over to %s, then answered by %q (%v)", what, f, got, again, err)
	}
}

// TestE2EDistributionFollowsWeights sends 600 TCP connections and 600 UDP
// datagrams per address family, each from its own source port, through a
// service weighted 1:2:3 and checks every backend's share.
//
// Why the tolerance: the flow hash is seeded MurmurHash3 over the 5-tuple,
// so with distinct source ports each flow picks backend i independently
// with probability p_i = w_i/Σw, up to the Maglev table's own imbalance
// (within about 1% of the slots for tier S, see package maglev). A count is
// then Binomial(n, p_i) with σ_i = √(n·p_i·(1−p_i)): 9.1, 11.5 and 12.2 for
// n = 600 at 1:2:3. Each count may differ from n·p_i by 5σ_i plus 1% of n
// for the table. A correct datapath misses one such band with probability
// about 6e-7, so the test's 12 checks fail spuriously with probability
// below 1e-5; an even split (200 each) lies 100 from the weight-1 backend's
// expectation of 100, far outside its ±52 band. The chi-squared statistic
// is logged too (2 degrees of freedom: P(χ² > x) = e^(−x/2)).
func TestE2EDistributionFollowsWeights(t *testing.T) {
	e := e2eNewEnv(t, 3)
	weights := []uint32{1, 2, 3}
	e2eApply(t, e, e.Service("web", weights))
	const n = 600
	for fi, fam := range e2eFamilies {
		dst := netip.AddrPortFrom(fam.vip, 80)
		t.Run(fam.name+"/tcp", func(t *testing.T) {
			got, ports := map[string]int{}, map[uint16]bool{}
			for i := range n {
				c, err := e.Client.DialTCP(dst, e2eOK)
				if err != nil {
					t.Fatalf("connection %d: %v", i, err)
				}
				ports[c.LocalAddr().(*net.TCPAddr).AddrPort().Port()] = true
				got[c.Backend]++
				c.Close()
			}
			if len(ports) != n {
				t.Fatalf("%d connections used only %d distinct source ports", n, len(ports))
			}
			e2eShares(t, e, got, n, weights)
		})
		t.Run(fam.name+"/udp", func(t *testing.T) {
			got := map[string]int{}
			for i := range n {
				// Distinct source ports by construction, below the
				// ephemeral range; one range per family.
				f, err := e2eDialUDP(e.Client, dst, uint16(20000+1000*fi+i))
				if err != nil {
					t.Fatalf("datagram %d: %v", i, err)
				}
				name, err := f.Ask(e2eOK)
				f.Close()
				if err != nil {
					t.Fatalf("datagram %d from %s: no answer: %v", i, f, err)
				}
				got[name]++
			}
			e2eShares(t, e, got, n, weights)
		})
	}
	st, err := e.DP.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("service counters %+v, drops %v", st.Services["web"], e2eNonZero(st.Drops))
	if c := st.Services["web"]; c.NewFlows < 4*n {
		t.Errorf("service counted %d new flows, want at least %d", c.NewFlows, 4*n)
	}
}

func e2eShares(t *testing.T, e *Env, got map[string]int, n int, weights []uint32) {
	t.Helper()
	var sum float64
	for _, w := range weights {
		sum += float64(w)
	}
	total, chi2 := 0, 0.0
	var line []string
	for i, vm := range e.Backends {
		p := float64(weights[i]) / sum
		exp := float64(n) * p
		sigma := math.Sqrt(float64(n) * p * (1 - p))
		tol := 5*sigma + 0.01*float64(n)
		k := got[vm.Name]
		total += k
		chi2 += (float64(k) - exp) * (float64(k) - exp) / exp
		line = append(line, fmt.Sprintf("%s w=%d: %d (expected %.0f ± %.0f)", vm.Name, weights[i], k, exp, tol))
		if math.Abs(float64(k)-exp) > tol {
			t.Errorf("%s took %d of %d flows; weight %d of %.0f expects %.0f ± %.0f (5σ + 1%%)", vm.Name, k, n, weights[i], sum, exp, tol)
		}
	}
	t.Logf("%s; χ²=%.2f (df=2, p=%.3f)", strings.Join(line, ", "), chi2, math.Exp(-chi2/2))
	if total != n {
		t.Errorf("answers from unknown backends: %v", got)
	}
}

func e2eNonZero(m map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range m {
		if v != 0 {
			out[k] = v
		}
	}
	return out
}

// TestE2ELongLivedFlowsKeepBackend holds TCP connections and UDP flows on
// every backend, over both families, while the service changes: (a) the
// weights change, (b) a backend is added, (c) another backend is removed.
// After each change every long-lived flow still reaches its backend, while
// new flows follow the new table.
func TestE2ELongLivedFlowsKeepBackend(t *testing.T) {
	e := e2eNewEnv(t, 4) // vm2..vm5; vm5 joins the service in (b)
	e2eApply(t, e, e2eService(t, e, e2eBackend{vm: "vm2", weight: 1}, e2eBackend{vm: "vm3", weight: 1}, e2eBackend{vm: "vm4", weight: 1}))
	flows := map[string]e2eFlows{}
	for _, fam := range e2eFamilies {
		flows[fam.name] = e2eOpen(t, e, fam.vip, map[string]int{"vm2": 2, "vm3": 2, "vm4": 2})
	}
	newFlows := func(phase string, check func(what string, tcp, udp map[string]int)) {
		t.Helper()
		for _, fam := range e2eFamilies {
			tcp, udp := e2eNewFlows(t, e, fam.vip, 20)
			t.Logf("%s: new %s flows: tcp %v, udp %v", phase, fam.name, tcp, udp)
			check(phase+": "+fam.name, tcp, udp)
		}
	}

	// (a) Weights 1:1:1 -> 0:0:1: every new flow goes to vm4; the flows
	// on vm2 and vm3 stay.
	e2eApply(t, e, e2eService(t, e, e2eBackend{vm: "vm2"}, e2eBackend{vm: "vm3"}, e2eBackend{vm: "vm4", weight: 1}))
	for _, fam := range e2eFamilies {
		e2eKeep(t, "after weight change "+fam.name, flows[fam.name])
	}
	newFlows("after weight change", func(what string, tcp, udp map[string]int) {
		e2eOnly(t, what+" tcp", tcp, "vm4")
		e2eOnly(t, what+" udp", udp, "vm4")
	})

	// (b) vm5 joins with weight 3: new flows go to vm4 or vm5 (vm5 takes
	// 3/4 of them; none of 20 with probability 1e-12); all old flows stay.
	e2eApply(t, e, e2eService(t, e, e2eBackend{vm: "vm2"}, e2eBackend{vm: "vm3"}, e2eBackend{vm: "vm4", weight: 1}, e2eBackend{vm: "vm5", weight: 3}))
	for _, fam := range e2eFamilies {
		e2eKeep(t, "after adding vm5 "+fam.name, flows[fam.name])
	}
	newFlows("after adding vm5", func(what string, tcp, udp map[string]int) {
		e2eOnly(t, what+" tcp", tcp, "vm4", "vm5")
		e2eOnly(t, what+" udp", udp, "vm4", "vm5")
		if tcp["vm5"] == 0 || udp["vm5"] == 0 {
			t.Errorf("%s: the added backend took no new flows: tcp %v, udp %v", what, tcp, udp)
		}
	})
	for _, fam := range e2eFamilies {
		flows[fam.name].add(e2eOpen(t, e, fam.vip, map[string]int{"vm5": 1}))
	}

	// (c) vm4 leaves: the flows on vm2, vm3 and vm5 stay and new flows go
	// to vm5 only. vm4's own flows fail over (removed backend: a new
	// Maglev pick, never a blackhole).
	e2eApply(t, e, e2eService(t, e, e2eBackend{vm: "vm2"}, e2eBackend{vm: "vm3"}, e2eBackend{vm: "vm5", weight: 1}))
	for _, fam := range e2eFamilies {
		e2eKeep(t, "after removing vm4 "+fam.name, flows[fam.name], "vm2", "vm3", "vm5")
	}
	newFlows("after removing vm4", func(what string, tcp, udp map[string]int) {
		e2eOnly(t, what+" tcp", tcp, "vm5")
		e2eOnly(t, what+" udp", udp, "vm5")
	})
	for _, fam := range e2eFamilies {
		fl := flows[fam.name]
		for _, c := range fl.tcp["vm4"] {
			e2eReset(t, "removed backend "+fam.name, c)
		}
		for _, f := range fl.udp["vm4"] {
			e2eFailedOver(t, "removed backend "+fam.name, f, "vm4")
		}
	}
	// The survivors are still where they were after all that.
	for _, fam := range e2eFamilies {
		e2eKeep(t, "at the end "+fam.name, flows[fam.name], "vm2", "vm3", "vm5")
	}
}

// TestE2EDrainingUntilDeadline drains vm2 with a deadline 2 s ahead:
// until then its established flows stay and it takes no new ones; after
// the deadline its flows fail over (a TCP connection is reset by the
// backend it now reaches, a UDP flow is answered by another backend), and
// GC removes the drained conntrack entries.
func TestE2EDrainingUntilDeadline(t *testing.T) {
	e := e2eNewEnv(t, 3)
	e2eApply(t, e, e.Service("web", []uint32{1, 1, 1}))
	// Per family: two flows of each protocol on vm2 ([0] is used after
	// the deadline, [1] stays idle until GC) and one on vm3 as a control.
	flows := map[string]e2eFlows{}
	for _, fam := range e2eFamilies {
		flows[fam.name] = e2eOpen(t, e, fam.vip, map[string]int{"vm2": 2, "vm3": 1})
	}

	deadline := time.Now().Add(2 * time.Second)
	st := e2eApply(t, e, e2eService(t, e,
		e2eBackend{vm: "vm2", weight: 1, state: fluxvm.BackendDraining, until: deadline},
		e2eBackend{vm: "vm3", weight: 1}, e2eBackend{vm: "vm4", weight: 1}))
	for _, fe := range st.Frontends {
		if fe.Eligible != 2 || fe.Backends != 3 {
			t.Errorf("frontend %s/%s while draining: eligible %d of %d, want 2 of 3", fe.VIP, fe.Protocol, fe.Eligible, fe.Backends)
		}
	}

	// Before the deadline.
	for _, fam := range e2eFamilies {
		e2eKeep(t, "draining "+fam.name, flows[fam.name])
		tcp, udp := e2eNewFlows(t, e, fam.vip, 10)
		e2eOnly(t, "draining "+fam.name+" tcp", tcp, "vm3", "vm4")
		e2eOnly(t, "draining "+fam.name+" udp", udp, "vm3", "vm4")
	}
	if left := time.Until(deadline); left < 0 {
		t.Fatalf("the checks before the drain deadline ended %v after it; the machine is too loaded for this test", -left)
	}

	// After the deadline (plus a margin for the coarse clock).
	time.Sleep(time.Until(deadline) + 500*time.Millisecond)
	for _, fam := range e2eFamilies {
		fl := flows[fam.name]
		e2eReset(t, "drained "+fam.name, fl.tcp["vm2"][0])
		e2eFailedOver(t, "drained "+fam.name, fl.udp["vm2"][0], "vm2")
		e2eKeep(t, "control "+fam.name, fl, "vm3")
		tcp, udp := e2eNewFlows(t, e, fam.vip, 10)
		e2eOnly(t, "drained "+fam.name+" tcp", tcp, "vm3", "vm4")
		e2eOnly(t, "drained "+fam.name+" udp", udp, "vm3", "vm4")
	}
	stats, err := e.DP.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("service counters %+v, drops %v", stats.Services["web"], e2eNonZero(stats.Drops))
	if f := stats.Services["web"].Failovers; f < 4 {
		t.Errorf("service counted %d failovers, want at least 4 (a TCP and a UDP flow per family)", f)
	}

	// GC: the idle flows (one TCP, one UDP per family) still name vm2,
	// whose drain deadline has passed; the flows that failed over took
	// their reverse-NAT halves for vm2 with them, so none is orphaned.
	ctx := context.Background()
	gc, err := e.DP.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("gc after the deadline: %+v", gc)
	if gc.Drained < 4 {
		t.Errorf("gc removed %d drained entries, want at least the 4 idle flows on vm2", gc.Drained)
	}
	if gc.Orphans != 0 {
		t.Errorf("gc removed %d orphaned reverse-NAT entries, want 0: a failover removes the flow's old half", gc.Orphans)
	}
	gc2, err := e.DP.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if gc2.Drained != 0 || gc2.Orphans != 0 {
		t.Errorf("a second gc still found drained entries: %+v", gc2)
	}
	// The idle flows, now without conntrack entries, go to a Ready
	// backend too.
	for _, fam := range e2eFamilies {
		fl := flows[fam.name]
		e2eReset(t, "idle after gc "+fam.name, fl.tcp["vm2"][1])
		e2eFailedOver(t, "idle after gc "+fam.name, fl.udp["vm2"][1], "vm2")
	}
}

// TestE2EUnhealthyFailsOver marks vm2 unhealthy: the UDP flow it answered
// (same socket, same 5-tuple) is answered by another backend, its TCP
// connection is reset, and no new flow goes to it.
func TestE2EUnhealthyFailsOver(t *testing.T) {
	e := e2eNewEnv(t, 3)
	e2eApply(t, e, e.Service("web", []uint32{1, 1, 1}))
	flows := map[string]e2eFlows{}
	for _, fam := range e2eFamilies {
		flows[fam.name] = e2eOpen(t, e, fam.vip, map[string]int{"vm2": 1, "vm3": 1})
	}

	st := e2eApply(t, e, e2eService(t, e,
		e2eBackend{vm: "vm2", weight: 1, state: fluxvm.BackendUnhealthy},
		e2eBackend{vm: "vm3", weight: 1}, e2eBackend{vm: "vm4", weight: 1}))
	for _, fe := range st.Frontends {
		if fe.Eligible != 2 {
			t.Errorf("frontend %s/%s: %d eligible backends, want 2", fe.VIP, fe.Protocol, fe.Eligible)
		}
	}
	for _, fam := range e2eFamilies {
		fl := flows[fam.name]
		e2eFailedOver(t, "unhealthy "+fam.name, fl.udp["vm2"][0], "vm2")
		e2eReset(t, "unhealthy "+fam.name, fl.tcp["vm2"][0])
		e2eKeep(t, "control "+fam.name, fl, "vm3")
		tcp, udp := e2eNewFlows(t, e, fam.vip, 20)
		t.Logf("%s new flows with vm2 unhealthy: tcp %v, udp %v", fam.name, tcp, udp)
		e2eOnly(t, "unhealthy "+fam.name+" tcp", tcp, "vm3", "vm4")
		e2eOnly(t, "unhealthy "+fam.name+" udp", udp, "vm3", "vm4")
	}
	stats, err := e.DP.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("service counters %+v, drops %v", stats.Services["web"], e2eNonZero(stats.Drops))
	if f := stats.Services["web"].Failovers; f < 4 {
		t.Errorf("service counted %d failovers, want at least 4 (a TCP and a UDP flow per family)", f)
	}
}

// TestE2EDataplaneRestartKeepsOpenFlows closes the Dataplane with 20 TCP
// connections and 6 UDP flows open over both families and opens it again
// from the same options: the pins and the catalog are adopted, nothing is
// rebuilt, and every flow still reaches its backend throughout.
func TestE2EDataplaneRestartKeepsOpenFlows(t *testing.T) {
	e := e2eNewEnv(t, 3)
	e2eApply(t, e, e.Service("web", []uint32{1, 1, 1}))
	var conns []*lab.Conn
	var udps []*e2eUDP
	for _, fam := range e2eFamilies {
		dst := netip.AddrPortFrom(fam.vip, 80)
		for range 10 {
			c, err := e.Client.DialTCP(dst, e2eOK)
			if err != nil {
				t.Fatalf("%s: %v", dst, err)
			}
			t.Cleanup(func() { c.Close() })
			conns = append(conns, c)
		}
		for range 3 {
			f, err := e2eDialUDP(e.Client, dst, 0)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			if f.Backend, err = f.Ask(e2eOK); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			udps = append(udps, f)
		}
	}
	check := func(phase string) {
		t.Helper()
		for _, c := range conns {
			if err := c.Echo([]byte(phase), e2eOK); err != nil {
				t.Errorf("%s: %s on %s broke: %v", phase, e2eTCPName(c), c.Backend, err)
			}
		}
		for _, f := range udps {
			if got, err := f.Ask(e2eOK); err != nil || got != f.Backend {
				t.Errorf("%s: %s of %s answered by %q (%v)", phase, f, f.Backend, got, err)
			}
		}
	}
	check("before restart")
	before, err := e.DP.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}

	if err := e.DP.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	e.DP = nil // Env.Close still removes the pins and namespaces
	check("without a dataplane process")

	d, err := fluxvm.Open(context.Background(), e.Options)
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	e.DP = d
	status := d.Status()
	t.Logf("load after restart: %+v", status.Load)
	if l := status.Load; l.Created || l.SchemaRebuilt || l.Reloaded || l.TierChanged || l.Migrated != 0 || l.NotMigrated != 0 {
		t.Errorf("reopen did not just adopt the pins: %+v", l)
	}
	if status.Services != 1 || len(status.Interfaces) != len(e.Lab.VMs) {
		t.Errorf("restored %d services and %d interfaces, want 1 and %d", status.Services, len(status.Interfaces), len(e.Lab.VMs))
	}
	check("after restart")

	after, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// Adopted, not recreated: the counters carried on.
	if b, a := before.Services["web"], after.Services["web"]; a.NewFlows < b.NewFlows || a.Packets <= b.Packets {
		t.Errorf("service counters went back across the restart: %+v -> %+v", b, a)
	}
	for _, fam := range e2eFamilies {
		tcp, udp := e2eNewFlows(t, e, fam.vip, 5)
		t.Logf("new %s flows after restart: tcp %v, udp %v", fam.name, tcp, udp)
	}
}

// e2ePolicy stands in for the Sandbox Network Fabric's VM policy program,
// which runs after ours on the VM edge. It drops every IPv4 and IPv6 packet
// whose destination is not on its allow list, and counts the packets it
// sees per destination.
type e2ePolicy struct {
	prog           *ebpf.Program
	allow4, allow6 *ebpf.Map // destination (network order) -> 1
	seen4, seen6   *ebpf.Map // destination (network order) -> packets seen
}

func (p *e2ePolicy) Close() {
	p.prog.Close() // nil-safe, like Map.Close
	for _, m := range []*ebpf.Map{p.allow4, p.allow6, p.seen4, p.seen6} {
		m.Close()
	}
}

// htons is a 16-bit value in network byte order as a little- or big-endian
// load of __sk_buff.protocol sees it.
func e2eHtons(v uint16) int32 {
	return int32(binary.NativeEndian.Uint16(binary.BigEndian.AppendUint16(nil, v)))
}

// TCX verdicts (linux/bpf.h).
const (
	e2eTCXNext = -1
	e2eTCXPass = 0
	e2eTCXDrop = 2
)

func e2eNewPolicy(t *testing.T) *e2ePolicy {
	t.Helper()
	p := &e2ePolicy{}
	t.Cleanup(p.Close)
	newMap := func(name string, key, value uint32) *ebpf.Map {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Name: name, Type: ebpf.Hash, KeySize: key, ValueSize: value, MaxEntries: 256})
		if err != nil {
			t.Fatalf("map %s: %v", name, err)
		}
		return m
	}
	p.allow4, p.allow6 = newMap("e2e_allow4", 4, 4), newMap("e2e_allow6", 16, 4)
	p.seen4, p.seen6 = newMap("e2e_seen4", 4, 8), newMap("e2e_seen6", 16, 8)

	// Stack slots.
	const (
		key4 = -8  // fp-8:  IPv4 destination, 4 bytes
		key6 = -24 // fp-24: IPv6 destination, 16 bytes
		tmp  = -32 // fp-32: IPv6 next header byte, then the counter's first value
		eth  = 14  // Ethernet header: TC sees packets from the MAC header on
	)
	// load: bpf_skb_load_bytes(skb, off, fp+slot, n); drop if the packet
	// is too short.
	load := func(off, slot, n int32) asm.Instructions {
		return asm.Instructions{
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.Mov.Imm(asm.R2, off),
			asm.Mov.Reg(asm.R3, asm.R10),
			asm.Add.Imm(asm.R3, slot),
			asm.Mov.Imm(asm.R4, n),
			asm.FnSkbLoadBytes.Call(),
			asm.JNE.Imm(asm.R0, 0, "drop"),
		}
	}
	// judge: seen[key]++, then pass if allow[key] exists, else drop.
	judge := func(fam string, seen, allow *ebpf.Map, key int32) asm.Instructions {
		return asm.Instructions{
			asm.LoadMapPtr(asm.R1, seen.FD()),
			asm.Mov.Reg(asm.R2, asm.R10),
			asm.Add.Imm(asm.R2, key),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, fam+"_first"),
			asm.Mov.Imm(asm.R1, 1),
			asm.StoreXAdd(asm.R0, asm.R1, asm.DWord), // atomic *counter += 1
			asm.Ja.Label(fam + "_allow"),
			// First packet to this destination: seen[key] = 1.
			asm.Mov.Imm(asm.R1, 1).WithSymbol(fam + "_first"),
			asm.StoreMem(asm.R10, tmp, asm.R1, asm.DWord),
			asm.LoadMapPtr(asm.R1, seen.FD()),
			asm.Mov.Reg(asm.R2, asm.R10),
			asm.Add.Imm(asm.R2, key),
			asm.Mov.Reg(asm.R3, asm.R10),
			asm.Add.Imm(asm.R3, tmp),
			asm.Mov.Imm(asm.R4, 0), // BPF_ANY
			asm.FnMapUpdateElem.Call(),
			// The verdict.
			asm.LoadMapPtr(asm.R1, allow.FD()).WithSymbol(fam + "_allow"),
			asm.Mov.Reg(asm.R2, asm.R10),
			asm.Add.Imm(asm.R2, key),
			asm.FnMapLookupElem.Call(),
			asm.JNE.Imm(asm.R0, 0, "pass"),
			asm.Ja.Label("drop"),
		}
	}
	labeled := func(label string, ins asm.Instructions) asm.Instructions {
		ins[0] = ins[0].WithSymbol(label)
		return ins
	}

	var ins asm.Instructions
	ins = append(ins,
		asm.Mov.Reg(asm.R6, asm.R1),               // r6 = skb
		asm.LoadMem(asm.R2, asm.R6, 16, asm.Word), // r2 = skb->protocol
		asm.JEq.Imm(asm.R2, e2eHtons(0x0800), "ipv4"),
		asm.JEq.Imm(asm.R2, e2eHtons(0x86dd), "ipv6"),
		asm.Mov.Imm(asm.R0, e2eTCXNext), // not IP (ARP): not the policy's business
		asm.Return(),
	)
	// IPv4: the destination is at byte 16 of the header.
	ins = append(ins, labeled("ipv4", load(eth+16, key4, 4))...)
	ins = append(ins, judge("v4", p.seen4, p.allow4, key4)...)
	// IPv6: ICMPv6 passes (neighbour discovery must work); otherwise the
	// destination at byte 24 of the header decides.
	ins = append(ins, labeled("ipv6", load(eth+6, tmp, 1))...)
	ins = append(ins,
		asm.LoadMem(asm.R2, asm.R10, tmp, asm.Byte),
		asm.JEq.Imm(asm.R2, 58, "pass"),
	)
	ins = append(ins, load(eth+24, key6, 16)...)
	ins = append(ins, judge("v6", p.seen6, p.allow6, key6)...)
	ins = append(ins,
		asm.Mov.Imm(asm.R0, e2eTCXPass).WithSymbol("pass"),
		asm.Return(),
		asm.Mov.Imm(asm.R0, e2eTCXDrop).WithSymbol("drop"),
		asm.Return(),
	)

	var err error
	p.prog, err = ebpf.NewProgram(&ebpf.ProgramSpec{Name: "e2e_policy", Type: ebpf.SchedCLS, License: "Dual MIT/GPL", Instructions: ins})
	if err != nil {
		t.Fatalf("policy program: %v", err)
	}
	return p
}

func (p *e2ePolicy) allow(t *testing.T, a netip.Addr) {
	t.Helper()
	var err error
	if a.Is4() {
		err = p.allow4.Put(a.As4(), uint32(1))
	} else {
		err = p.allow6.Put(a.As16(), uint32(1))
	}
	if err != nil {
		t.Fatalf("allow %s: %v", a, err)
	}
}

// seen returns the packets the policy program saw, by destination.
func (p *e2ePolicy) seen(t *testing.T) map[netip.Addr]uint64 {
	t.Helper()
	out := map[netip.Addr]uint64{}
	var (
		k4 [4]byte
		k6 [16]byte
		n  uint64
	)
	it := p.seen4.Iterate()
	for it.Next(&k4, &n) {
		out[netip.AddrFrom4(k4)] = n
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	it = p.seen6.Iterate()
	for it.Next(&k6, &n) {
		out[netip.AddrFrom16(k6)] = n
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func e2eFormatSeen(m map[netip.Addr]uint64) string {
	var s []string
	for a, n := range m {
		s = append(s, fmt.Sprintf("%s:%d", a, n))
	}
	sort.Strings(s)
	return strings.Join(s, " ")
}

// TestE2EPolicyBehindServiceChain puts a VM policy stand-in after our
// program on the client VM's edge (TCX, tail) that only lets packets to the
// external client through. Flows through the VIP still work, because our
// program ends the chain after the NAT rewrite, and the policy program
// never sees a packet to a VIP or a backend from them; the policy still
// filters everything else: a direct connection to a backend is dropped
// and the allowed destination passes.
func TestE2EPolicyBehindServiceChain(t *testing.T) {
	e := e2eNewEnv(t, 2)
	e2eApply(t, e, e.Service("web", []uint32{1, 1}))
	ext := e.Lab.External
	srv, err := ext.Serve(9090)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	be := e.Backends[0] // the backend the client also tries directly
	direct := []netip.AddrPort{netip.AddrPortFrom(be.Addr4, BackendPort), netip.AddrPortFrom(be.Addr6, BackendPort)}
	allowed := []netip.AddrPort{netip.AddrPortFrom(ext.Addr4, 9090), netip.AddrPortFrom(ext.Addr6, 9090)}

	// Without the policy the client reaches a backend directly. The
	// connection is closed abortively: the reset leaves within Close, so
	// no FIN exchange of it can reach the policy program later.
	for _, dst := range direct {
		c, err := e.Client.DialTCP(dst, e2eOK)
		if err != nil {
			t.Fatalf("direct to %s without the policy: %v", dst, err)
		}
		c.Conn.(*net.TCPConn).SetLinger(0)
		c.Close()
		if name, err := e.Client.AskUDP(dst, e2eOK); err != nil || name != be.Name {
			t.Fatalf("direct udp to %s without the policy: %q %v", dst, name, err)
		}
	}

	p := e2eNewPolicy(t)
	p.allow(t, ext.Addr4)
	p.allow(t, ext.Addr6)
	var l link.Link
	err = e.Lab.Node.Do(func() (err error) {
		l, err = link.AttachTCX(link.TCXOptions{Interface: e.Client.NodeIfIndex, Program: p.prog,
			Attach: ebpf.AttachTCXIngress, Anchor: link.Tail()})
		return err
	})
	if err != nil {
		t.Fatalf("attach the policy after ours on %s: %v", e.Client.NodeIf, err)
	}
	t.Cleanup(func() { l.Close() })

	// The chain on the client's edge: ours first, the policy last.
	var chain []string
	err = e.Lab.Node.Do(func() (err error) {
		chain, err = testenv.TCXProgramNames(e.Client.NodeIfIndex, ebpf.AttachTCXIngress)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(chain, []string{"fluxvm_from_vm", "e2e_policy"}) {
		t.Fatalf("TCX ingress chain of %s: %v, want [fluxvm_from_vm e2e_policy]", e.Client.NodeIf, chain)
	}

	// Through the VIPs: TCP and UDP, both families, all work.
	viaVIP := func(phase string) {
		t.Helper()
		for _, fam := range e2eFamilies {
			tcp, udp := e2eNewFlows(t, e, fam.vip, 10)
			if tcp[e.Backends[0].Name]+tcp[e.Backends[1].Name] != 10 || udp[e.Backends[0].Name]+udp[e.Backends[1].Name] != 10 {
				t.Errorf("%s: through %s with the policy behind us: tcp %v, udp %v, want 10 answers each", phase, fam.vip, tcp, udp)
			}
			c, err := e.Client.DialTCP(netip.AddrPortFrom(fam.vip, 80), e2eOK)
			if err != nil {
				t.Fatalf("%s: %s: %v", phase, fam.vip, err)
			}
			if err := c.Echo(make([]byte, 64<<10), e2eOK); err != nil {
				t.Errorf("%s: 64 KiB echo through %s: %v", phase, fam.vip, err)
			}
			c.Close()
		}
	}
	neverSeen := func(phase string, seen map[netip.Addr]uint64, dsts ...netip.Addr) {
		t.Helper()
		for _, a := range dsts {
			if n := seen[a]; n > 0 {
				t.Errorf("%s: the policy program saw %d packets to %s; our program should have ended the chain", phase, n, a)
			}
		}
	}
	serviceDsts := []netip.Addr{VIP4, VIP6}
	for _, vm := range e.Backends {
		serviceDsts = append(serviceDsts, vm.Addr4, vm.Addr6)
	}
	viaVIP("with the policy")

	// The allowed destination passes, and the policy did see it.
	for _, dst := range allowed {
		c, err := e.Client.DialTCP(dst, e2eOK)
		if err != nil {
			t.Errorf("allowed %s: %v", dst, err)
		} else {
			if c.Backend != ext.Name || c.Echo([]byte("allowed"), e2eOK) != nil {
				t.Errorf("allowed %s: answered by %q", dst, c.Backend)
			}
			c.Close()
		}
		if name, err := e.Client.AskUDP(dst, e2eOK); err != nil || name != ext.Name {
			t.Errorf("allowed %s udp: %q %v", dst, name, err)
		}
	}
	seen := p.seen(t)
	t.Logf("policy saw (destination:packets) after VIP and allowed traffic: %s", e2eFormatSeen(seen))
	neverSeen("VIP flows", seen, serviceDsts...)
	for _, a := range []netip.Addr{ext.Addr4, ext.Addr6} {
		if seen[a] == 0 {
			t.Errorf("the policy program saw no packet to the allowed %s: is it in the chain at all?", a)
		}
	}

	// Directly to a backend, around the service: the policy drops it.
	for _, dst := range direct {
		if c, err := e.Client.DialTCP(dst, e2eFail); err == nil {
			c.Close()
			t.Errorf("direct tcp to %s passed the policy (answered by %s)", dst, c.Backend)
		}
		if name, err := e.Client.AskUDP(dst, e2eFail); err == nil {
			t.Errorf("direct udp to %s passed the policy (answered by %s)", dst, name)
		}
	}
	seen = p.seen(t)
	t.Logf("policy saw after direct attempts: %s", e2eFormatSeen(seen))
	for _, a := range []netip.Addr{be.Addr4, be.Addr6} {
		if seen[a] == 0 {
			t.Errorf("the direct attempts to %s never reached the policy program", a)
		}
	}

	// And the service still works, still unseen by the policy: nothing
	// more reaches it for the VIPs or any backend.
	viaVIP("after the direct attempts")
	end := p.seen(t)
	neverSeen("VIP flows at the end", end, VIP4, VIP6, e.Backends[1].Addr4, e.Backends[1].Addr6)
	for _, a := range []netip.Addr{be.Addr4, be.Addr6} {
		if end[a] != seen[a] {
			t.Errorf("the policy program saw %d more packets to %s from VIP flows", end[a]-seen[a], a)
		}
	}
	vs, err := e.DP.VMStats(context.Background(), e.Client.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("client VM counters: %+v", vs.Counters)
}
