package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestChurn is the operator's day in one test (issue 14): real traffic
// through the VIP while the control plane churns, with the real daemon.
//
// Traffic, all from one client VM:
//   - long-lived TCP connections, echoing all the time;
//   - short TCP connections at full speed from a small pool of client
//     ports, so that tuples are reused at once (net.ipv4.tcp_tw_reuse=1,
//     half of them closed by RST, which leaves no TIME_WAIT);
//   - UDP request/response.
//
// Churn: a backend added, weights changed many times, a backend drained
// and made ready again, the added backend drained and removed (with the
// GC running every second), and `kill -9` restarts of fluxvmd, one of them changing
// map_tier and one changing it back.
//
// It passes with no long-lived connection broken, no connect timeout, no
// short connection or UDP request failed, and no packet to the VIP seen
// by the node's stack untranslated (an nftables counter in the node's
// prerouting hook, which runs after the TC ingress programs).
//
// CI runs one round (about half a minute); FLUXVM_CHURN_ROUNDS=N runs the
// restart rounds N times.
func TestChurn(t *testing.T) {
	testenv.RequirePrivileged(t)
	if _, err := exec.LookPath("nft"); err != nil {
		msg := fmt.Sprintf("nft (nftables) is needed to count untranslated VIP packets: %v", err)
		if testenv.Required() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	rounds := 1
	if s := os.Getenv("FLUXVM_CHURN_ROUNDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 100 {
			t.Fatalf("FLUXVM_CHURN_ROUNDS=%q: want 1..100", s)
		}
		rounds = n
	}
	bin := buildDaemon(t)

	l := lab.NewForTest(t)
	cli := l.AddVMForTest(t, 1)
	var backends []*lab.VM
	for i := 2; i <= 5; i++ {
		vm := l.AddVMForTest(t, i)
		srv, err := vm.Serve(8080)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Close() })
		backends = append(backends, vm)
	}
	if err := cli.NS.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/tcp_tw_reuse", []byte("1"), 0o644)
	}); err != nil {
		t.Fatal(err)
	}
	vip := netip.MustParseAddr("10.96.0.10")
	probe := newVIPProbe(t, l, vip)

	pinRoot := filepath.Join(testenv.PinRoot(t), "service")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "fluxvmd.toml")
	writeConfig := func(tier string) {
		var ifs []string
		for _, vm := range append([]*lab.VM{cli}, backends...) {
			ifs = append(ifs, fmt.Sprintf("{ name = %q, vm_id = %q }", vm.NodeIf, vm.Name))
		}
		conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = %q
pin_root = %q
catalog_path = %q
advertisements_path = %q
conntrack_gc_interval = "1s"
vm_edge_interfaces = [ %s ]
`, tier, pinRoot, filepath.Join(dir, "catalog.json"), filepath.Join(dir, "adv.json"), strings.Join(ifs, ", "))
		if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeConfig("S")
	d := startDaemon(t, bin, cfg, l)

	// The service: TCP and UDP on port 80 of the VIP; backends vm2..vm4,
	// vm5 joins and leaves during the churn.
	type member struct {
		vm     *lab.VM
		in     bool
		weight uint32
		state  fluxvm.BackendState
		until  int64
	}
	members := make([]*member, len(backends))
	for i, vm := range backends {
		members[i] = &member{vm: vm, in: i < 3, weight: 1, state: fluxvm.BackendReady}
	}
	apply := func() {
		t.Helper()
		svc := fluxvm.Service{
			Name: "web", VIPs: []netip.Addr{vip},
			Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}, {Port: 80, Protocol: fluxvm.UDP}},
		}
		for _, m := range members {
			if !m.in {
				continue
			}
			w := m.weight
			svc.Backends = append(svc.Backends, fluxvm.Backend{
				Address: m.vm.Addr4, Port: 8080, Weight: &w, State: m.state, DrainUntilUnixMs: m.until,
			})
		}
		if _, err := d.Request("POST", "/v1/network/services", svc); err != nil {
			t.Fatal(err)
		}
	}
	apply()

	dst := netip.AddrPortFrom(vip, 80)
	tr := &churnTraffic{t: t, cli: cli, dst: dst, stop: make(chan struct{})}
	tr.openLongLived(30)
	tr.start(3)

	rng := rand.New(rand.NewPCG(14, 14))
	reweigh := func(n int) {
		for range n {
			for _, m := range members {
				m.weight = 1 + rng.Uint32N(5)
			}
			apply()
			time.Sleep(100 * time.Millisecond)
		}
	}
	// vm5 joins, takes new flows through many weight changes, and is
	// removed; the GC (every second) then runs over the leftovers.
	//
	// It is removed as an operator removes a backend: drained first (new
	// flows stop going to it; the GC drops its flows once the deadline
	// passes), then taken out. A backend taken out at once breaks the
	// handshakes in flight to it by design (its flows fail over), which
	// would make this test's zero-failure rule a race; the GC's handling
	// of the flows it leaves behind, which this scenario exists for, is
	// the same either way.
	churnMember := func() {
		members[3].in, members[3].state, members[3].until = true, fluxvm.BackendReady, 0
		members[3].weight = 3
		apply()
		reweigh(15)
		members[3].state, members[3].until = fluxvm.BackendDraining, time.Now().Add(time.Second).UnixMilli()
		apply()
		time.Sleep(1500 * time.Millisecond)
		members[3].in = false
		apply()
		time.Sleep(2500 * time.Millisecond)
	}
	restart := func(tier string) {
		t.Helper()
		if err := d.Cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		d.Cmd.Wait()
		time.Sleep(300 * time.Millisecond) // traffic meets the datapath alone
		writeConfig(tier)
		began := time.Now()
		d = startDaemon(t, bin, cfg, l)
		t.Logf("restart (tier %s): REST back after %v", tier, time.Since(began).Round(time.Millisecond))
	}

	time.Sleep(time.Second)
	churnMember()
	// vm4 drains (its long-lived flows stay) and comes back.
	members[2].state, members[2].until = fluxvm.BackendDraining, time.Now().Add(time.Minute).UnixMilli()
	apply()
	time.Sleep(time.Second)
	members[2].state, members[2].until = fluxvm.BackendReady, 0
	apply()
	for round := range rounds {
		restart("S")
		churnMember()
		restart("M")
		st := daemonStatus(t, d)
		if !st.Load.TierChanged || st.Load.NotMigrated != 0 || st.Load.Migrated <= 0 || len(st.Load.Migrations) == 0 {
			t.Errorf("round %d: status after S->M: %+v, want a tier change with every entry migrated", round, st.Load)
		}
		churnMember()
		restart("S")
		if st := daemonStatus(t, d); !st.Load.TierChanged || st.Load.NotMigrated < 0 {
			t.Errorf("round %d: status after M->S: %+v", round, st.Load)
		}
		reweigh(5)
		time.Sleep(time.Second)
	}
	res := tr.finish()

	untranslated := probe.count(t)
	t.Logf("long-lived: %d, broken %d, slowest echo %v; short: %d connected (%d busy-port skips), %d connect timeouts, %d other failures; udp: %d answered, %d lost; VIP packets untranslated: %d",
		res.longLived, res.broken, res.slowest.Round(time.Millisecond), res.short, res.busy, res.timeouts, res.failed, res.udpOK, res.udpLost, untranslated)
	for _, e := range res.errors {
		t.Log(e)
	}
	if res.broken != 0 || res.timeouts != 0 || res.failed != 0 || res.udpLost != 0 {
		t.Errorf("traffic failed under churn (see above)")
	}
	if untranslated != 0 {
		t.Errorf("%d packets to the VIP reached the node's stack untranslated", untranslated)
	}
	if res.short < 200 || res.udpOK < 50 {
		t.Errorf("too little traffic to prove anything: %d short connections, %d UDP answers", res.short, res.udpOK)
	}
}

func daemonStatus(t *testing.T, d *daemon) fluxvm.Status {
	t.Helper()
	body, err := d.Request("GET", "/v1/network/services/status", nil)
	if err != nil {
		t.Fatal(err)
	}
	var st fluxvm.Status
	if err := json.Unmarshal(body, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// churnTraffic is the client's traffic and what became of it.
type churnTraffic struct {
	t    *testing.T
	cli  *lab.VM
	dst  netip.AddrPort
	long []*lab.Conn
	stop chan struct{}
	wg   sync.WaitGroup

	broken, short, busy, timeouts, failed, udpOK, udpLost atomic.Int64
	// slowest is the longest echo of a long-lived connection: a TCP
	// retransmission (a packet lost on the way) shows as 200 ms or more.
	slowest atomic.Int64

	mu     sync.Mutex
	errors []string
}

type churnResult struct {
	longLived                                             int
	slowest                                               time.Duration
	broken, short, busy, timeouts, failed, udpOK, udpLost int64
	errors                                                []string
}

func (tr *churnTraffic) fail(format string, args ...any) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if len(tr.errors) < 20 {
		tr.errors = append(tr.errors, time.Now().Format("15:04:05.000 ")+fmt.Sprintf(format, args...))
	}
}

func (tr *churnTraffic) openLongLived(n int) {
	tr.t.Helper()
	for range n {
		c, err := tr.cli.DialTCP(tr.dst, 3*time.Second)
		if err != nil {
			tr.t.Fatal(err)
		}
		tr.t.Cleanup(func() { c.Close() })
		tr.long = append(tr.long, c)
	}
}

// start runs the traffic: the long-lived echoes, shortWorkers short
// connection loops and a UDP loop, until finish.
func (tr *churnTraffic) start(shortWorkers int) {
	tr.wg.Add(2 + shortWorkers)
	go tr.longLoop()
	for w := range shortWorkers {
		go tr.shortLoop(w)
	}
	go tr.udpLoop()
}

func (tr *churnTraffic) stopped() bool {
	select {
	case <-tr.stop:
		return true
	default:
		return false
	}
}

func (tr *churnTraffic) longLoop() {
	defer tr.wg.Done()
	alive := make([]bool, len(tr.long))
	for i := range alive {
		alive[i] = true
	}
	for n := 0; !tr.stopped(); n++ {
		for i, c := range tr.long {
			if !alive[i] {
				continue
			}
			began := time.Now()
			if err := c.Echo([]byte(fmt.Sprintf("ping %d\n", n)), 3*time.Second); err != nil {
				alive[i] = false
				tr.broken.Add(1)
				tr.fail("long-lived connection %d to %s broke: %v", i, c.Backend, err)
				continue
			}
			if d := int64(time.Since(began)); d > tr.slowest.Load() {
				tr.slowest.Store(d)
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// shortLoop connects again and again from 8 client ports of its own, so
// that every tuple is reused within moments.
func (tr *churnTraffic) shortLoop(w int) {
	defer tr.wg.Done()
	for n := 0; !tr.stopped(); n++ {
		port := uint16(41000 + w*8 + n%8)
		err := tr.shortConn(port, n%2 == 1)
		var se syscall.Errno
		switch {
		case err == nil:
			tr.short.Add(1)
		case errors.As(err, &se) && (se == syscall.EADDRINUSE || se == syscall.EADDRNOTAVAIL):
			// The port is still in TIME_WAIT toward the VIP: not ours to
			// judge, the client's stack refused it.
			tr.busy.Add(1)
		case isTimeout(err):
			tr.timeouts.Add(1)
			tr.fail("short connection from port %d: %v", port, err)
		default:
			tr.failed.Add(1)
			tr.fail("short connection from port %d: %v", port, err)
		}
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// shortConn connects from port, reads the backend's name, echoes once and
// closes (by RST when rst is set, leaving no TIME_WAIT behind).
func (tr *churnTraffic) shortConn(port uint16, rst bool) error {
	var c net.Conn
	err := tr.cli.NS.Do(func() (err error) {
		dl := net.Dialer{
			Timeout:   3 * time.Second,
			LocalAddr: &net.TCPAddr{IP: tr.cli.Addr4.AsSlice(), Port: int(port)},
			Control: func(_, _ string, rc syscall.RawConn) error {
				var serr error
				if err := rc.Control(func(fd uintptr) {
					serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1)
				}); err != nil {
					return err
				}
				return serr
			},
		}
		c, err = dl.Dial("tcp", tr.dst.String())
		return err
	})
	if err != nil {
		return err
	}
	defer func() {
		if rst {
			c.(*net.TCPConn).SetLinger(0)
		}
		c.Close()
	}()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	if err != nil {
		return fmt.Errorf("identity: %w", err)
	}
	if !strings.HasPrefix(string(buf[:n]), "vm") {
		return fmt.Errorf("identity %q", buf[:n])
	}
	return nil
}

// udpLoop asks from one client port over and over; the flow follows its
// backend's fate (a removal moves it).
func (tr *churnTraffic) udpLoop() {
	defer tr.wg.Done()
	var c net.Conn
	if err := tr.cli.NS.Do(func() (err error) {
		c, err = net.DialUDP("udp", &net.UDPAddr{IP: tr.cli.Addr4.AsSlice(), Port: 42000}, net.UDPAddrFromAddrPort(tr.dst))
		return err
	}); err != nil {
		tr.failed.Add(1)
		tr.fail("udp: %v", err)
		return
	}
	defer c.Close()
	buf := make([]byte, 512)
	for n := 0; !tr.stopped(); n++ {
		msg := fmt.Sprintf("req %d", n)
		c.SetDeadline(time.Now().Add(time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			tr.udpLost.Add(1)
			tr.fail("udp %s: %v", msg, err)
			continue
		}
		// Read until this request's answer (a late answer to an earlier
		// one may come first).
		for {
			k, err := c.Read(buf)
			if err != nil {
				tr.udpLost.Add(1)
				tr.fail("udp %s: %v", msg, err)
				break
			}
			if strings.HasSuffix(string(buf[:k]), "\n"+msg) {
				tr.udpOK.Add(1)
				break
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (tr *churnTraffic) finish() churnResult {
	close(tr.stop)
	tr.wg.Wait()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return churnResult{
		longLived: len(tr.long), slowest: time.Duration(tr.slowest.Load()), broken: tr.broken.Load(), short: tr.short.Load(), busy: tr.busy.Load(),
		timeouts: tr.timeouts.Load(), failed: tr.failed.Load(), udpOK: tr.udpOK.Load(), udpLost: tr.udpLost.Load(),
		errors: tr.errors,
	}
}

// vipProbe counts, in the node namespace's prerouting hook (after the TC
// ingress programs), packets still addressed to the VIP.
type vipProbe struct {
	l     *lab.Lab
	table string
}

func newVIPProbe(t *testing.T, l *lab.Lab, vip netip.Addr) *vipProbe {
	t.Helper()
	p := &vipProbe{l: l, table: "fvchurn"}
	rules := fmt.Sprintf(`table ip %s {
	counter vip { }
	chain pre {
		type filter hook prerouting priority -500; policy accept;
		ip daddr %s counter name "vip"
	}
}
`, p.table, vip)
	if out, err := p.nft(rules, "-f", "-"); err != nil {
		t.Fatalf("nft: %v\n%s", err, out)
	}
	// The table lives in the lab's node namespace and goes with it.
	return p
}

func (p *vipProbe) nft(stdin string, args ...string) ([]byte, error) {
	cmd := exec.Command("nft", args...)
	cmd.Stdin = strings.NewReader(stdin)
	var out []byte
	err := p.l.Node.Do(func() (err error) {
		out, err = cmd.CombinedOutput()
		return err
	})
	return out, err
}

var packetsRE = regexp.MustCompile(`packets (\d+)`)

func (p *vipProbe) count(t *testing.T) int {
	t.Helper()
	out, err := p.nft("", "list", "counter", "ip", p.table, "vip")
	if err != nil {
		t.Fatalf("nft list counter: %v\n%s", err, out)
	}
	m := packetsRE.FindSubmatch(out)
	if m == nil {
		t.Fatalf("nft counter output %q", out)
	}
	n, _ := strconv.Atoi(string(m[1]))
	return n
}
