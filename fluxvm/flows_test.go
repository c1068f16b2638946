package fluxvm

import (
	"context"
	"errors"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
)

// flowOf returns the record of the flow from client, or fails.
func flowOf(t *testing.T, d *Dataplane, f flows.Filter, client netip.AddrPort) flows.Record {
	t.Helper()
	recs, err := d.Flows(context.Background(), flows.MaxLimit, f)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r.Client == client {
			return r
		}
	}
	t.Fatalf("no record of the flow from %s in %d records: %+v", client, len(recs), recs)
	return flows.Record{}
}

func metaRate(t *testing.T, d *Dataplane) uint32 {
	t.Helper()
	m, err := d.dp.ReadMeta()
	if err != nil {
		t.Fatal(err)
	}
	return m.FlowSampleRate
}

// TestFlowsRecordsLabTraffic: with flow_sample_rate 1, a TCP exchange
// through a VIP leaves a record with the service's name, the client, the
// VIP, the backend that answered, verdict forwarded and packets both
// ways; a service whose backends are all unhealthy leaves a dropped
// record with reason no_backend; filters select; the rate is in the meta
// map and a reopen with another rate, or another tier (new maps), writes
// that one.
func TestFlowsRecordsLabTraffic(t *testing.T) {
	e := newEnv(t)
	e.opts.FlowSampleRate = 1
	d := e.open(t)
	if got := metaRate(t, d); got != 1 {
		t.Fatalf("meta flow_sample_rate %d, want 1", got)
	}
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c := e.dial(t, vip4)
	echo(t, c, "hello")
	echo(t, c, "again")
	client := netip.MustParseAddrPort(c.LocalAddr().String())
	var backend netip.Addr
	for _, vm := range e.backends {
		if vm.Name == c.Backend {
			backend = vm.Addr4
		}
	}
	c.Close()

	r := flowOf(t, d, flows.Filter{}, client)
	t.Logf("record %+v", r)
	if r.Service != "web" || r.ServiceID == 0 || r.BackendID == 0 || r.Protocol != "tcp" ||
		r.VIP != netip.AddrPortFrom(vip4, 80) || r.Backend != netip.AddrPortFrom(backend, 8080) ||
		r.Verdict != flows.Forwarded || r.Reason != "" || r.Drops != 0 ||
		r.Hook != "from_vm" || r.Interface != e.cli.NodeIf {
		t.Errorf("record %+v: want service web, %s -> %s:80 -> %s:8080 (%s), forwarded by from_vm on %s",
			r, client, vip4, backend, c.Backend, e.cli.NodeIf)
	}
	// SYN, the identity line's ACK, two echoes and their ACKs at least;
	// replies: SYN-ACK, identity line, two echoes.
	if r.Forward.Packets < 3 || r.Forward.Bytes == 0 || r.Reply.Packets < 3 || r.Reply.Bytes == 0 {
		t.Errorf("counts forward %+v reply %+v, want packets both ways", r.Forward, r.Reply)
	}
	if r.FirstSeen.Before(start.Add(-time.Second)) || r.LastSeen.Before(r.FirstSeen) || r.LastSeen.After(time.Now().Add(time.Second)) {
		t.Errorf("first seen %v, last seen %v; the exchange began at %v", r.FirstSeen, r.LastSeen, start)
	}
	// Filters: by service, backend, verdict, since.
	flowOf(t, d, flows.Filter{Service: "web", Backend: backend, Verdict: flows.Forwarded, Since: start.Add(-time.Second)}, client)
	for _, f := range []flows.Filter{{Service: "other"}, {Verdict: flows.Dropped}, {Since: time.Now().Add(time.Hour)}} {
		if recs, err := d.Flows(context.Background(), 100, f); err != nil || len(recs) != 0 {
			t.Errorf("filter %+v: %d records, %v; want none", f, len(recs), err)
		}
	}
	for _, n := range []int{0, flows.MaxLimit + 1} {
		if _, err := d.Flows(context.Background(), n, flows.Filter{}); !errors.Is(err, flows.ErrLimit) {
			t.Errorf("limit %d: %v, want flows.ErrLimit", n, err)
		}
	}

	// No ready backend: the SYN is dropped and recorded.
	dead := Service{Name: "dead", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.11")}, Ports: []ServicePort{{Port: 80, Protocol: TCP}}}
	for _, vm := range e.backends {
		dead.Backends = append(dead.Backends, Backend{Address: vm.Addr4, Port: 8080, State: BackendUnhealthy})
	}
	if _, err := d.ApplyService(ctx, dead); err != nil {
		t.Fatal(err)
	}
	if c, err := e.cli.DialTCP(netip.AddrPortFrom(dead.VIPs[0], 80), 300*time.Millisecond); err == nil {
		c.Close()
		t.Fatalf("a service without a ready backend answered (%s)", c.Backend)
	}
	recs, err := d.Flows(context.Background(), 10, flows.Filter{Service: "dead"})
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) == 0 {
		t.Fatal("no record of the dropped flow to the service without a ready backend")
	}
	r = recs[0]
	t.Logf("drop record %+v", r)
	if r.Verdict != flows.Dropped || r.Reason != "no_backend" || r.Drops == 0 || r.Backend.IsValid() ||
		r.VIP != netip.AddrPortFrom(dead.VIPs[0], 80) || r.Client.Addr() != e.cli.Addr4 || r.Forward.Packets != 0 {
		t.Errorf("drop record %+v: want dropped, no_backend, no backend, from %s to %s:80", r, e.cli.Addr4, dead.VIPs[0])
	}
	if dropped, err := d.Flows(context.Background(), 10, flows.Filter{Verdict: flows.Dropped}); err != nil || len(dropped) != len(recs) {
		t.Errorf("verdict dropped: %d records, %v; want the %d of dead", len(dropped), err, len(recs))
	}

	// A restart with another rate writes it; so does one that recreates
	// the maps (tier change), and a record read after Close is ErrClosed.
	// Reads run outside the lock: one that races Close finishes on its
	// own handles or fails with ErrClosed, nothing else.
	reads := make(chan error, 1)
	go func() {
		var err error
		for err == nil {
			_, err = d.Flows(context.Background(), flows.MaxLimit, flows.Filter{Verdict: flows.Dropped})
		}
		reads <- err
	}()
	time.Sleep(20 * time.Millisecond)
	d.Close()
	if err := <-reads; !errors.Is(err, ErrClosed) {
		t.Errorf("a read racing Close: %v, want ErrClosed", err)
	}
	if _, err := d.Flows(context.Background(), 1, flows.Filter{}); !errors.Is(err, ErrClosed) {
		t.Errorf("flows after close: %v, want ErrClosed", err)
	}
	e.opts.FlowSampleRate = 3
	d = e.open(t)
	if got := metaRate(t, d); got != 3 {
		t.Errorf("after a restart with rate 3: meta %d", got)
	}
	d.Close()
	e.opts.Loader.Tier = bpf.TierM
	d = e.open(t)
	if st := d.dp.Status(); !st.TierChanged {
		t.Errorf("tier change not reported: %+v", st)
	}
	if got := metaRate(t, d); got != 3 {
		t.Errorf("after a tier change with rate 3: meta %d", got)
	}
}

// TestFlowsOffRecordsNothing: with flow_sample_rate 0 (the default) the
// same exchange leaves no record, and neither does a drop.
func TestFlowsOffRecordsNothing(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	if got := metaRate(t, d); got != 0 {
		t.Fatalf("meta flow_sample_rate %d, want 0", got)
	}
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		c := e.dial(t, vip4)
		echo(t, c, "hello")
		c.Close()
	}
	dead := Service{Name: "dead", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.11")}, Ports: []ServicePort{{Port: 80, Protocol: TCP}},
		Backends: []Backend{{Address: e.backends[0].Addr4, Port: 8080, State: BackendUnhealthy}}}
	if _, err := d.ApplyService(ctx, dead); err != nil {
		t.Fatal(err)
	}
	if c, err := e.cli.DialTCP(netip.AddrPortFrom(dead.VIPs[0], 80), 300*time.Millisecond); err == nil {
		c.Close()
		t.Fatal("a service without a ready backend answered")
	}
	st, err := d.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Drops["no_backend"] == 0 {
		t.Fatalf("no no_backend drop counted: %v", st.Drops)
	}
	recs, err := d.Flows(context.Background(), flows.MaxLimit, flows.Filter{})
	if err != nil || len(recs) != 0 {
		t.Errorf("flow_sample_rate 0: %d records, %v; want none: %+v", len(recs), err, recs)
	}
}

func TestOpenRefusesFlowSampleRateAboveMax(t *testing.T) {
	_, err := Open(context.Background(), Options{FlowSampleRate: MaxFlowSampleRate + 1})
	var ve *ValidationError
	if !errors.As(err, &ve) || !errors.Is(err, ErrInvalid) || ve.Field != "FlowSampleRate" {
		t.Errorf("Open with rate %d: %v, want a validation error of FlowSampleRate", MaxFlowSampleRate+1, err)
	}
}

// TestFlowsNoNamespaceAfterClose (review item 10): Flows names the
// interfaces the dataplane did not attach through Options.InNamespace,
// and an embedder may close its namespace handle once Close returned, so
// no such call may start after Close returned, even for a read that began
// before. The test makes every record's interface unknown to the
// dataplane (as for interfaces detached since), and when Flows asks the
// namespace for the first one, closes the dataplane from another
// goroutine, giving Close a second to return: the read's next lookup must
// not reach InNamespace after that (Close waits for the lookup in
// progress, and the read then fails with ErrClosed or ends before Close
// took effect). After Close, Flows fails with ErrClosed.
func TestFlowsNoNamespaceAfterClose(t *testing.T) {
	e := newEnv(t)
	e.opts.FlowSampleRate = 1
	var (
		mu            sync.Mutex
		d             *Dataplane
		armed         bool
		closeReturned bool
		lateCalls     int
		closeDone     = make(chan struct{})
	)
	inner := e.opts.InNamespace
	e.opts.InNamespace = func(fn func() error) error {
		mu.Lock()
		if closeReturned {
			lateCalls++
		}
		first := armed
		armed = false
		mu.Unlock()
		if first {
			go func() {
				d.Close()
				mu.Lock()
				closeReturned = true
				mu.Unlock()
				close(closeDone)
			}()
			select {
			case <-closeDone:
			case <-time.After(time.Second):
			}
		}
		return inner(fn)
	}
	d = e.open(t)
	if _, err := d.ApplyService(context.Background(), e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	// Flows from two VMs: records on two interfaces.
	for _, vm := range []*lab.VM{e.cli, e.backends[0]} {
		if c, err := vm.DialTCP(netip.AddrPortFrom(vip4, 80), time.Second); err == nil {
			c.Close()
		}
	}
	recs, err := d.Flows(context.Background(), flows.MaxLimit, flows.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	ifs := map[string]bool{}
	for _, r := range recs {
		ifs[r.Interface] = true
	}
	if len(ifs) < 2 {
		t.Fatalf("records on %d interfaces (%v), want 2 at least: %+v", len(ifs), ifs, recs)
	}
	// Forget the attached interfaces' names: every record's interface is
	// looked up in the namespace.
	d.mu.Lock()
	for _, ifc := range d.ifaces {
		ifc.index = 0
	}
	d.mu.Unlock()

	mu.Lock()
	armed = true
	mu.Unlock()
	recs, err = d.Flows(context.Background(), flows.MaxLimit, flows.Filter{})
	<-closeDone
	mu.Lock()
	late := lateCalls
	mu.Unlock()
	if late != 0 {
		t.Errorf("Options.InNamespace called %d times after Close returned", late)
	}
	if err != nil && !errors.Is(err, ErrClosed) {
		t.Errorf("the read Close overtook: %v, want ErrClosed or records", err)
	}
	t.Logf("the read Close overtook: %d records, %v", len(recs), err)
	if _, err := d.Flows(context.Background(), 1, flows.Filter{}); !errors.Is(err, ErrClosed) {
		t.Errorf("Flows after Close: %v, want ErrClosed", err)
	}
}
