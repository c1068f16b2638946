package fluxvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"go.uber.org/goleak"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
	"github.com/fluxvm/servicefabric/maglev"
)

// env is a lab (a client VM and three backend VMs running identity
// servers on port 8080) with a dataplane configuration for it.
type env struct {
	lab      *lab.Lab
	cli      *lab.VM
	backends []*lab.VM
	servers  []*lab.Server // the backends' servers, in backends' order
	opts     Options
}

func newEnv(t *testing.T) *env {
	t.Helper()
	l := lab.NewForTest(t)
	e := &env{lab: l, cli: l.AddVMForTest(t, 1)}
	for i := 2; i <= 4; i++ {
		vm := l.AddVMForTest(t, i)
		srv, err := vm.Serve(8080)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Close() })
		e.backends = append(e.backends, vm)
		e.servers = append(e.servers, srv)
	}
	var ifs []VMEdgeInterface
	for _, vm := range l.VMs {
		ifs = append(ifs, VMEdgeInterface{Name: vm.NodeIf, VMID: vm.Name})
	}
	e.opts = Options{
		Loader:              bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierS},
		CatalogPath:         filepath.Join(t.TempDir(), "catalog.json"),
		ConntrackGCInterval: -1,
		VMEdgeInterfaces:    ifs,
		InNamespace:         l.Node.Do,
	}
	return e
}

func (e *env) open(t *testing.T) *Dataplane {
	t.Helper()
	d, err := Open(context.Background(), e.opts)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

var (
	vip4 = netip.MustParseAddr("10.96.0.10")
	vip6 = netip.MustParseAddr("fd00:96::10")
)

func u32(v uint32) *uint32 { return &v }

// service builds the test service over the env's backends with weights.
func (e *env) service(weights ...uint32) Service {
	s := Service{
		Name:  "web",
		VIPs:  []netip.Addr{vip4, vip6},
		Ports: []ServicePort{{Port: 80, Protocol: TCP}, {Port: 80, Protocol: UDP}},
	}
	for i, vm := range e.backends {
		for _, a := range []netip.Addr{vm.Addr4, vm.Addr6} {
			s.Backends = append(s.Backends, Backend{Address: a, Port: 8080, Weight: u32(weights[i])})
		}
	}
	return s
}

func (e *env) dial(t *testing.T, vip netip.Addr) *lab.Conn {
	t.Helper()
	c, err := e.cli.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
	if err != nil {
		t.Fatalf("connect to %s:80: %v", vip, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func echo(t *testing.T, c *lab.Conn, what string) {
	t.Helper()
	if err := c.Echo([]byte(what), 3*time.Second); err != nil {
		t.Fatalf("%s: connection to %s broke: %v", what, c.Backend, err)
	}
}

func TestDataplaneServesAVIP(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	st, err := d.ApplyService(ctx, e.service(1, 1, 2))
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Frontends) != 4 {
		t.Fatalf("frontends %+v, want 2 VIPs x 2 protocols", st.Frontends)
	}
	for _, fe := range st.Frontends {
		if fe.Eligible != 3 || !fe.GuardOpen {
			t.Errorf("frontend %+v", fe)
		}
	}

	for _, vip := range []netip.Addr{vip4, vip6} {
		got := map[string]int{}
		for range 80 {
			c := e.dial(t, vip)
			got[c.Backend]++
			c.Close()
		}
		t.Logf("%s: %v (weights 1:1:2)", vip, got)
		// Each count within 4.5 standard deviations of its binomial mean
		// (a false alarm about once in 10^5 runs). "vm4 at least as many
		// as each other" failed about once in a hundred runs by chance.
		for vm, p := range map[string]float64{"vm2": 0.25, "vm3": 0.25, "vm4": 0.5} {
			mean, sd := 80*p, math.Sqrt(80*p*(1-p))
			if g := float64(got[vm]); g < mean-4.5*sd || g > mean+4.5*sd || got[vm] == 0 {
				t.Errorf("%s: %s got %d of 80, want %.0f±%.0f: distribution %v does not follow weights 1:1:2", vip, vm, got[vm], mean, 4.5*sd, got)
			}
		}
		name, err := e.cli.AskUDP(netip.AddrPortFrom(vip, 80), 2*time.Second)
		if err != nil || name == "" {
			t.Errorf("%s udp: %q %v", vip, name, err)
		}
	}

	stats, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if c := stats.Services["web"]; c.NewFlows < 160 || c.Packets == 0 || c.ReplyPackets == 0 {
		t.Errorf("service stats %+v", c)
	}
	vs, err := d.VMStats(context.Background(), "vm1")
	if err != nil {
		t.Fatal(err)
	}
	if vs.Counters.NewFlows < 160 || vs.Counters.Packets == 0 || vs.Counters.ReplyPackets == 0 {
		t.Errorf("VM stats %+v", vs)
	}
	if _, err := d.VMStats(context.Background(), "nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("unknown VM: %v", err)
	}
	status := d.Status()
	if len(status.Interfaces) != 4 || status.Interfaces[0].Hooks[0].Mode != "tcx" || status.Services != 1 {
		t.Errorf("status %+v", status)
	}
}

func TestDataplaneRejectsWithoutChanges(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	first, err := d.ApplyService(ctx, e.service(1, 1, 1))
	if err != nil {
		t.Fatal(err)
	}
	again, err := d.ApplyService(ctx, e.service(1, 1, 1))
	if err != nil || again.Revision != first.Revision {
		t.Errorf("re-applying the same intent: revision %d -> %d, %v", first.Revision, again.Revision, err)
	}
	before, _ := os.ReadFile(e.opts.CatalogPath)

	bad := e.service(1, 1, 1)
	bad.Backends[0].Port = 0
	_, err = d.ApplyService(ctx, bad)
	var ve *ValidationError
	if !errors.As(err, &ve) || ve.Field == "" {
		t.Fatalf("invalid backend port: %v", err)
	}
	clash := e.service(1, 1, 1)
	clash.Name = "other"
	if _, err := d.ApplyService(ctx, clash); !errors.Is(err, ErrConflict) {
		t.Errorf("second service on the same frontends: %v, want ErrConflict", err)
	}
	after, _ := os.ReadFile(e.opts.CatalogPath)
	if string(before) != string(after) {
		t.Error("a rejected request changed the catalog")
	}
	if got, _ := d.Service("web"); got.Revision != first.Revision {
		t.Errorf("a rejected request changed the service: %+v", got)
	}
	if len(d.Services()) != 1 {
		t.Errorf("services %v", d.Services())
	}
}

func TestDataplaneKeepsFlowsAcrossUpdatesAndRestart(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	svc := e.service(1, 1, 1)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	conns := []*lab.Conn{e.dial(t, vip4), e.dial(t, vip6)}
	for _, c := range conns {
		echo(t, c, "before")
	}
	pinned := conns[0].Backend
	idx := int(pinned[len(pinned)-1]-'0') - 2

	// The pinned backend's weight drops to 0: new flows avoid it, the
	// established one stays.
	w := []uint32{1, 1, 1}
	w[idx] = 0
	if _, err := d.ApplyService(ctx, e.service(w...)); err != nil {
		t.Fatal(err)
	}
	echo(t, conns[0], "after weight change")
	for range 20 {
		c := e.dial(t, vip4)
		if c.Backend == pinned {
			t.Fatalf("new flow went to %s, whose weight is 0", pinned)
		}
		c.Close()
	}

	// Draining with a deadline ahead keeps it too.
	drain := e.service(1, 1, 1)
	for i := range drain.Backends {
		if i/2 == idx {
			drain.Backends[i].State = BackendDraining
			drain.Backends[i].DrainUntilUnixMs = time.Now().Add(time.Hour).UnixMilli()
		}
	}
	if _, err := d.ApplyService(ctx, drain); err != nil {
		t.Fatal(err)
	}
	echo(t, conns[0], "while draining")

	// The process goes away: the datapath keeps forwarding.
	d.Close()
	for _, c := range conns {
		echo(t, c, "with no dataplane process")
	}
	// A new process adopts pins and catalog without disturbing flows.
	d = e.open(t)
	if st := d.Status(); st.Load.Created || st.Load.SchemaRebuilt || st.Load.Reloaded || st.Services != 1 {
		t.Errorf("status after restart %+v", st)
	}
	for _, c := range conns {
		echo(t, c, "after restart")
	}
	if got, err := d.Service("web"); err != nil || len(got.Frontends) != 4 {
		t.Errorf("restored service %+v, %v", got, err)
	}
	c := e.dial(t, vip6)
	echo(t, c, "new flow after restart")

	res, err := d.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Scanned == 0 {
		t.Errorf("gc %+v scanned nothing", res)
	}
}

func TestDataplaneDeleteAndCleanup(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	e.dial(t, vip4).Close()
	if err := d.DeleteService(ctx, "web"); err != nil {
		t.Fatal(err)
	}
	if err := d.DeleteService(ctx, "web"); !errors.Is(err, ErrNotFound) {
		t.Errorf("second delete: %v", err)
	}
	if _, err := e.cli.DialTCP(netip.AddrPortFrom(vip4, 80), 300*time.Millisecond); err == nil {
		t.Error("the VIP still answers after delete")
	}
	if err := d.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{e.opts.Loader.PinRoot, e.opts.CatalogPath} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still exists after cleanup", p)
		}
	}
}

// TestAddInterfaceAllOrNothing: when the second hook of an interface
// cannot be attached (here a foreign cls_bpf filter holds the egress
// priority we use), the first one is detached again and the interface is
// not recorded.
func TestAddInterfaceAllOrNothing(t *testing.T) {
	e := newEnv(t)
	e.opts.VMEdgeInterfaces = nil
	e.opts.Loader.AttachMode = bpf.AttachClsBPF
	d := e.open(t)
	vm := e.backends[0]
	foreignEgressFilter(t, e, vm)

	if _, err := d.AddInterface(context.Background(), VMEdgeInterface{Name: vm.NodeIf, VMID: vm.Name}); err == nil {
		t.Fatal("AddInterface succeeded over a foreign egress filter")
	}
	for _, ifc := range d.Status().Interfaces {
		if ifc.Name == vm.NodeIf {
			t.Errorf("half-attached interface recorded: %+v", ifc)
		}
	}
	err := e.lab.Node.Do(func() error {
		l, err := netlink.LinkByName(vm.NodeIf)
		if err != nil {
			return err
		}
		fs, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		if err != nil {
			return err
		}
		for _, f := range fs {
			if bf, ok := f.(*netlink.BpfFilter); ok && strings.HasPrefix(bf.Name, "fluxvm") {
				t.Errorf("ingress filter %q left behind", bf.Name)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestClosedDataplaneChangesNothing calls every exported method of
// Dataplane after Close and after Cleanup: each one that returns an error
// fails with ErrClosed (Stats and VMStats used to dereference a nil map
// and panic), the others answer as documented (the state at Close; an
// empty dataplane after Cleanup), nothing panics, a second Close is
// harmless, and Cleanup removes what is left (TestCleanupStandalone). A method added to Dataplane without a row here fails the
// test.
func TestClosedDataplaneChangesNothing(t *testing.T) {
	ctx := context.Background()
	type row struct {
		// call invokes the method; err is nil for methods without one.
		call func(e *env, d *Dataplane) (res any, err error)
		// wantErr: the method returns an error, which must match
		// ErrClosed. Otherwise check says what is wrong with res.
		wantErr bool
		check   func(res any, cleaned bool) string
	}
	rows := map[string]row{
		"ApplyService":  {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.ApplyService(ctx, e.service(2, 1, 1)) }},
		"DeleteService": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return nil, d.DeleteService(ctx, "web") }},
		"AddInterface": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			vm := e.backends[0]
			return d.AddInterface(context.Background(), VMEdgeInterface{Name: vm.NodeIf, VMID: vm.Name})
		}},
		"AddNorthSouthInterface": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return d.AddNorthSouthInterface(context.Background(), "uplink")
		}},
		"RemoveInterface": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return nil, d.RemoveInterface(context.Background(), e.backends[0].NodeIf)
		}},
		"GC":              {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.GC(ctx) }},
		"ReconcileHealth": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.ReconcileHealth(ctx) }},
		"Stats":           {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.Stats(context.Background()) }},
		"VMStats":         {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.VMStats(context.Background(), e.backends[0].Name) }},
		"Service":         {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.Service("web") }},
		"Conntrack":       {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.Conntrack() }},
		"Flows":           {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.Flows(context.Background(), 1, flows.Filter{}) }},
		"ReconcilePolicies": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return d.ReconcilePolicies(ctx, IPCache{}, []Policy{{Service: "web", DefaultAction: PolicyDeny}})
		}},
		"ApplyPolicies": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return d.ApplyPolicies(ctx, Policy{Service: "web", DefaultAction: PolicyDeny})
		}},
		"SetIPCache":   {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.SetIPCache(ctx, IPCache{}) }},
		"DeletePolicy": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return nil, d.DeletePolicy(ctx, "web") }},
		"Policies":     {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.Policies(context.Background()) }},
		"Policy":       {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.Policy(context.Background(), "web") }},
		"Envoy":        {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.Envoy("web") }},
		"ExportFlows": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return d.ExportFlows(ctx, "web", io.Discard)
		}},
		"ImportFlows": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return d.ImportFlows(ctx, "web", strings.NewReader(""), false)
		}},
		"Pressure":          {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.Pressure(context.Background()) }},
		"ReconcilePressure": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.ReconcilePressure(ctx) }},
		"SetSNATPeers": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return d.SetSNATPeers(ctx, SNATPeers{Addresses: []netip.Addr{netip.MustParseAddr("10.97.0.9")}})
		}},
		// The deprecated wrappers, and HA's calls themselves.
		"FlowDelta": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return d.FlowDelta(context.Background(), "web", FlowDeltaRequest{})
		}},
		"AckFlowDelta": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) { return d.AckFlowDelta(context.Background(), "web", 1) }},
		"UpdateLease": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return d.UpdateLease(context.Background(), HALease{Epoch: 9})
		}},
		"ImportFlowDelta": {wantErr: true, call: func(e *env, d *Dataplane) (any, error) {
			return d.ImportFlowDelta(ctx, "web", ha.Delta{Service: "web", Journal: "j", Epoch: 9})
		}},
		"HAStatus": {call: func(e *env, d *Dataplane) (any, error) { return d.HAStatus(), nil }, check: func(res any, _ bool) string {
			if st := res.(HAStatus); st.Enabled {
				return fmt.Sprintf("replication on in a dataplane opened without it: %+v", st)
			}
			return ""
		}},
		"HA": {call: func(e *env, d *Dataplane) (any, error) { return d.HA(), nil }, check: func(res any, _ bool) string {
			h := res.(HA)
			for name, err := range map[string]error{
				"FlowDelta":       errOf(h.FlowDelta(ctx, "web", FlowDeltaRequest{})),
				"AckFlowDelta":    errOf(h.AckFlowDelta(ctx, "web", 1)),
				"UpdateLease":     errOf(h.UpdateLease(ctx, HALease{Epoch: 9})),
				"ImportFlowDelta": errOf(h.ImportFlowDelta(ctx, "web", ha.Delta{Service: "web", Journal: "j", Epoch: 9})),
			} {
				if !errors.Is(err, ErrClosed) {
					return fmt.Sprintf("HA().%s: %v, want ErrClosed", name, err)
				}
			}
			if st := h.Status(); st.Enabled {
				return fmt.Sprintf("HA().Status: replication on in a dataplane opened without it: %+v", st)
			}
			return ""
		}},
		"Cleanup": {call: func(e *env, d *Dataplane) (any, error) { return d.Cleanup(context.Background()), nil }, check: func(res any, _ bool) string {
			if res != nil {
				return fmt.Sprintf("Cleanup (of what is left): %v", res)
			}
			return ""
		}},
		"Close": {call: func(e *env, d *Dataplane) (any, error) { return d.Close(), nil }, check: func(res any, _ bool) string {
			if res != nil {
				return fmt.Sprintf("second Close: %v", res)
			}
			return ""
		}},
		"Status": {call: func(e *env, d *Dataplane) (any, error) { return d.Status(), nil }, check: func(res any, cleaned bool) string {
			st := res.(Status)
			want := 1
			if cleaned {
				want = 0
			}
			if st.Services != want || st.Tier != "S" || (cleaned != (len(st.Interfaces) == 0)) {
				return fmt.Sprintf("%d services, tier %q, %d interfaces; want %d services, tier S, interfaces only after Close", st.Services, st.Tier, len(st.Interfaces), want)
			}
			if st.Memory != nil {
				return fmt.Sprintf("memory section %+v read from released maps", st.Memory)
			}
			return ""
		}},
		"Services": {call: func(e *env, d *Dataplane) (any, error) { return d.Services(), nil }, check: func(res any, cleaned bool) string {
			ss := res.([]ServiceStatus)
			if cleaned != (len(ss) == 0) || ss == nil {
				return fmt.Sprintf("%d services (nil: %t)", len(ss), ss == nil)
			}
			return ""
		}},
		"Health": {call: func(e *env, d *Dataplane) (any, error) { return d.Health(), nil }, check: func(res any, cleaned bool) string {
			h := res.(HealthReport)
			if h.Services == nil || cleaned != (len(h.Services) == 0) {
				return fmt.Sprintf("%+v", h)
			}
			return ""
		}},
		"Advertisements": {call: func(e *env, d *Dataplane) (any, error) { return d.Advertisements(), nil }, check: func(res any, cleaned bool) string {
			s := res.(advert.Snapshot)
			if s.Generation == 0 || len(s.Entries) != 0 {
				return fmt.Sprintf("generation %d, %d entries; want a published snapshot without entries", s.Generation, len(s.Entries))
			}
			return ""
		}},
	}
	typ := reflect.TypeFor[*Dataplane]()
	for i := range typ.NumMethod() {
		if name := typ.Method(i).Name; rows[name].call == nil {
			t.Errorf("Dataplane.%s is not in this test: add a row saying what it does after Close", name)
		}
	}

	for _, how := range []string{"Close", "Cleanup"} {
		t.Run("after "+how, func(t *testing.T) {
			e := newEnv(t)
			// The env's VM-edge interfaces plus a health-checked
			// service: every method has something to report.
			d := e.open(t)
			svc := e.service(1, 1, 1)
			svc.HealthCheck = &HealthCheck{Kind: "tcp", IntervalMs: 60_000}
			if _, err := d.ApplyService(ctx, svc); err != nil {
				t.Fatal(err)
			}
			var err error
			if how == "Close" {
				err = d.Close()
			} else {
				err = d.Cleanup(context.Background())
			}
			if err != nil {
				t.Fatal(err)
			}
			for name, r := range rows {
				res, err, panicked := func() (res any, err error, panicked any) {
					defer func() { panicked = recover() }()
					res, err = r.call(e, d)
					return
				}()
				switch {
				case panicked != nil:
					t.Errorf("%s after %s panicked: %v", name, how, panicked)
				case r.wantErr && !errors.Is(err, ErrClosed):
					t.Errorf("%s after %s: %v, want ErrClosed", name, how, err)
				case !r.wantErr:
					if why := r.check(res, how == "Cleanup"); why != "" {
						t.Errorf("%s after %s: %s", name, how, why)
					}
				}
			}
		})
	}
}

// TestMaglevMemoryPerFrontend: programming and then updating many
// services keeps a few Maglev build tables for the dataplane (a pool of at
// most GOMAXPROCS, buildTable), not one per frontend. A table per frontend kept its build scratch after the first
// update, about 10 bytes per slot each (160 KiB per frontend at tier S).
func TestMaglevMemoryPerFrontend(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	const services = 40
	svc := func(i int, w uint32) Service {
		s := Service{
			Name:  fmt.Sprintf("svc%d", i),
			VIPs:  []netip.Addr{netip.AddrFrom4([4]byte{10, 97, byte(i >> 8), byte(i)})},
			Ports: []ServicePort{{Port: 80, Protocol: TCP}},
		}
		for _, vm := range e.backends {
			s.Backends = append(s.Backends, Backend{Address: vm.Addr4, Port: 8080, Weight: u32(w)})
		}
		return s
	}
	// The first apply builds a pooled table; measure from there.
	if _, err := d.ApplyService(ctx, svc(0, 1)); err != nil {
		t.Fatal(err)
	}
	heap := func() uint64 {
		var ms runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	for i := 1; i <= services; i++ {
		for _, w := range []uint32{1, 2} { // apply, then update
			if _, err := d.ApplyService(ctx, svc(i, w)); err != nil {
				t.Fatal(err)
			}
		}
	}
	after := heap()
	perFrontend := (int64(after) - int64(before)) / services
	m := int64(d.caps.MaglevSize)
	t.Logf("heap %d -> %d bytes: %d per frontend (M = %d)", before, after, perFrontend, m)
	if perFrontend > m {
		t.Errorf("each frontend retains %d bytes, more than 1 per Maglev slot (M = %d)", perFrontend, m)
	}
}

// TestGCDuringClose runs manual GCs in a loop (with and without the GC
// timer running too) over a well-filled conntrack map while Close runs:
// Close cancels the scans in progress and waits for them, so no scan is
// left running when Close returns, every GC ends with a result or
// ErrClosed (never an error of a map closed under it, never a panic), and
// a GC after Close is ErrClosed. Run it with -race too. It failed when GC
// scanned outside the lock and Close did not wait for it: the scan went
// on over maps Close had released.
func TestGCDuringClose(t *testing.T) {
	for _, timer := range []bool{false, true} {
		t.Run(fmt.Sprintf("timer=%t", timer), func(t *testing.T) { testGCDuringClose(t, timer) })
	}
}

func testGCDuringClose(t *testing.T, timer bool) {
	e := newEnv(t)
	leaks := goleak.IgnoreCurrent()
	d := e.open(t) // without the timer: it starts below, once the hooks are set
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	// Fill fluxvm_fct4 with live flows of the service: every GC scans
	// them all (and the first one repairs their reverse-NAT halves).
	n := min(int(d.dp.Maps().FluxvmFct4.MaxEntries()), 16384)
	fillFlows4(t, e, d, n, 1)
	if _, err := d.GC(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := d.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("a GC over the filled map: %+v", r)
	if r.Scanned < n/2 {
		t.Fatalf("GC scanned %d flows, want most of %d", r.Scanned, n)
	}

	var inScan atomic.Int32
	scanning := make(chan struct{}, 1)
	d.beforeGCScan = func() {
		inScan.Add(1)
		select {
		case scanning <- struct{}{}:
		default:
		}
	}
	d.afterGCScan = func() { inScan.Add(-1) }
	if timer {
		// The GC timer, as Open starts it, ticking faster than a scan.
		gt, err := d.newGCTimer(max(r.Duration/4, time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		d.mu.Lock()
		d.gcTimer = gt
		d.mu.Unlock()
		gt.Start()
	}

	const workers = 3
	errs := make(chan error, workers)
	var completed atomic.Int32
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				_, err := d.GC(ctx)
				switch {
				case errors.Is(err, ErrClosed):
					return
				case err != nil:
					errs <- err
					return
				}
				completed.Add(1)
			}
		})
	}
	<-scanning
	time.Sleep(r.Duration / 4) // well into a scan
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if k := inScan.Load(); k != 0 {
		t.Errorf("Close returned while %d GC scans were running", k)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("GC during Close: %v (want a result or ErrClosed)", err)
	}
	if _, err := d.GC(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("GC after Close: %v, want ErrClosed", err)
	}
	t.Logf("%d GCs completed before Close", completed.Load())
	goleak.VerifyNone(t, leaks) // the timer and every GC have ended
}

// TestDataplaneRestoresReservedName restarts on a catalog holding a
// service whose name is now reserved (as an older version, or a hand
// edit, could leave it): the node starts, warns, keeps the service's
// flows and frontends, lets other services be applied, refuses to apply
// the reserved name again and deletes it on request.
func TestDataplaneRestoresReservedName(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	c := e.dial(t, vip4)
	echo(t, c, "before")
	d.Close()

	// Rename the service in the catalog file to a reserved word.
	raw, err := os.ReadFile(e.opts.CatalogPath)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	doc["services"].([]any)[0].(map[string]any)["service"].(map[string]any)["name"] = "flows"
	if raw, err = json.Marshal(doc); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.opts.CatalogPath, raw, 0o600); err != nil {
		t.Fatal(err)
	}

	var logs strings.Builder
	e.opts.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	d = e.open(t)
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "service=flows") {
		t.Errorf("no warning about the reserved name:\n%s", logs.String())
	}
	echo(t, c, "after restart")
	st, err := d.Service("flows")
	if err != nil || len(st.Frontends) != 4 {
		t.Fatalf("restored service %+v, %v", st, err)
	}
	for _, fe := range st.Frontends {
		if !fe.GuardOpen {
			t.Errorf("frontend %s/%s closed", fe.VIP, fe.Protocol)
		}
	}
	echo(t, e.dial(t, vip4), "new flow after restart")

	// It cannot be applied again under its name.
	before, _ := os.ReadFile(e.opts.CatalogPath)
	again := e.service(1, 1, 2)
	again.Name = "flows"
	if _, err := d.ApplyService(ctx, again); !errors.Is(err, ErrReservedName) {
		t.Errorf("apply flows: %v, want ErrReservedName", err)
	}
	if after, _ := os.ReadFile(e.opts.CatalogPath); string(after) != string(before) {
		t.Error("a refused apply changed the catalog")
	}
	// Other services can be applied beside it.
	other := Service{Name: "dns", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.53")},
		Ports: []ServicePort{{Port: 53, Protocol: UDP}}, Backends: []Backend{{Address: e.backends[0].Addr4, Port: 8080}}}
	if _, err := d.ApplyService(ctx, other); err != nil {
		t.Errorf("apply beside a restored reserved name: %v", err)
	}
	// It can be deleted, and its frontends then serve a new name.
	if err := d.DeleteService(ctx, "flows"); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Errorf("apply web after deleting flows: %v", err)
	}
	if _, err := d.ApplyService(ctx, again); !errors.Is(err, ErrReservedName) {
		t.Errorf("apply flows after its delete: %v, want ErrReservedName", err)
	}
}

// TestMaglevTablesSizedByBackends: each frontend's table in the kernel has
// maglev.SizeFor(its backends) slots, reported in the service status, not
// the tier's largest; a drain does not change it, adding backends past a
// rung does; traffic flows through tables of every size.
func TestMaglevTablesSizedByBackends(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	// The inner map in the kernel behind fe's slot of fluxvm_maglev.
	kernelSize := func(sid uint32) uint32 {
		t.Helper()
		m := kernelMaglevMap(t, d, sid)
		defer m.Close()
		return m.MaxEntries()
	}
	check := func(phase string, want uint32) {
		t.Helper()
		st, err := d.Service("web")
		if err != nil {
			t.Fatal(err)
		}
		for _, fe := range st.Frontends {
			if fe.MaglevSize != want {
				t.Errorf("%s: frontend %s/%s reports %d slots, want %d", phase, fe.VIP, fe.Protocol, fe.MaglevSize, want)
			}
			if got := kernelSize(fe.ServiceID); got != want {
				t.Errorf("%s: frontend %s/%s has a kernel table of %d slots, want %d", phase, fe.VIP, fe.Protocol, got, want)
			}
		}
	}
	weights := make([]uint32, len(e.backends))
	for i := range weights {
		weights[i] = 1
	}
	svc := e.service(weights...)
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	n := len(e.backends) // per family
	want := maglev.SizeFor(n, d.caps.MaglevSize)
	if want >= d.caps.MaglevSize {
		t.Fatalf("%d backends need %d slots: the test needs fewer than the tier's %d", n, want, d.caps.MaglevSize)
	}
	check("applied", want)
	// The kernel's own accounting: 4 tables (2 VIPs x TCP, UDP), each
	// about 8 bytes a slot, far below a table of the tier's size.
	mem := d.Status().Memory
	if mem == nil || mem.MaglevInner.Count != 4 || mem.MaglevInner.LargestBytes > uint64(want)*8+4096 {
		t.Errorf("memory status %+v: want 4 tables of about %d bytes", mem, want*8)
	} else {
		t.Logf("4 tables of %d slots: %d bytes of kernel memory (a table of the tier's %d slots: ~%d each)",
			want, mem.MaglevInner.Bytes, d.caps.MaglevSize, d.caps.MaglevSize*8)
	}
	c := e.dial(t, vip4)
	echo(t, c, "through a small table")
	// The flow, through the typed view an embedder gets.
	ct, err := d.Conntrack()
	if err != nil {
		t.Fatal(err)
	}
	flows, err := ct.List(conntrack.Filter{})
	if err != nil || len(flows) == 0 || flows[0].VIP != netip.AddrPortFrom(vip4, 80) {
		t.Errorf("Conntrack().List() = %+v, %v; want the flow to %s:80", flows, err, vip4)
	}

	// A drain leaves the size alone (the slot of every new flow stays).
	svc.Backends[0].State, svc.Backends[0].DrainUntilUnixMs = BackendDraining, time.Now().Add(time.Hour).UnixMilli()
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	check("one draining", want)
	echo(t, c, "after the drain")

	// More backends than the rung holds: the next rung.
	big := svc
	big.Backends = append([]Backend(nil), svc.Backends...)
	for i := len(big.Backends); uint64(len(big.Backends)/2)*maglev.SlotsPerBackend <= uint64(want); i++ {
		big.Backends = append(big.Backends, Backend{Address: netip.AddrFrom4([4]byte{10, 123, byte(i >> 8), byte(i)}), Port: 8080, Weight: u32(0)})
		big.Backends = append(big.Backends, Backend{Address: netip.AddrFrom16([16]byte{0xfd, 0, 0x12, 0x3, 14: byte(i >> 8), 15: byte(i)}), Port: 8080, Weight: u32(0)})
	}
	if _, err := d.ApplyService(ctx, big); err != nil {
		t.Fatal(err)
	}
	next := maglev.SizeFor(len(big.Backends)/2, d.caps.MaglevSize)
	if next <= want {
		t.Fatalf("%d backends: size %d, want above %d", len(big.Backends)/2, next, want)
	}
	check("grown", next)
	echo(t, c, "after the table grew")
	c2 := e.dial(t, vip4)
	echo(t, c2, "new flow through the grown table")
}

// fillFlows4 writes n live, established flows of web's IPv4 TCP
// frontend on the first backend into fluxvm_fct4, as the datapath would,
// from the clients 10.<net>.x.y.
func fillFlows4(t *testing.T, e *env, d *Dataplane, n int, net byte) {
	t.Helper()
	d.mu.Lock()
	fe := d.prog.Frontend(feKey(vip4, 80, 6))
	sid, bid := fe.ID(), fe.BackendID(netip.AddrPortFrom(e.backends[0].Addr4, 8080))
	d.mu.Unlock()
	now, err := conntrack.Now()
	if err != nil {
		t.Fatal(err)
	}
	keys := make([]bpf.Tuple4, n)
	vals := make([]bpf.CTValue, n)
	for i := range keys {
		client := netip.AddrFrom4([4]byte{10, net, byte(i >> 8), byte(i)})
		keys[i] = bpf.Tuple4{Saddr: bpf.AddrWords(client)[0], Daddr: bpf.AddrWords(vip4)[0], Sport: bpf.Port(40000), Dport: bpf.Port(80), Proto: 6}
		vals[i] = bpf.CTValue{ServiceId: sid, BackendId: bid, CreatedNs: uint64(now), LastSeenNs: uint64(now),
			DeadlineNs: uint64(now + time.Hour), State: uint8(bpf.CTTCPEstablished)}
	}
	if _, err := d.dp.Maps().FluxvmFct4.BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}
}
