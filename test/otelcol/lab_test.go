//go:build linux

package otelcol

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/collector/component/componenttest"
	"go.opentelemetry.io/collector/consumer/consumertest"
	"go.opentelemetry.io/collector/pdata/plog"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/receiver/receivertest"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
	"github.com/fluxvm/servicefabric/flows/otlp/otlptest"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/internal/testutils/daemontest"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

const (
	labToken       = "otelcol-lab-admin-token-0123456789"
	labNode        = "lab-node"
	labServiceName = "fluxvmd-otelcol" // otlp_service_name
	// collectorAddr is where the Collector's receiver listens, in the
	// lab's node namespace (a fresh one: the port is free).
	collectorAddr = "127.0.0.1:4318"
	// exportInterval is otlp_interval: its minimum, 1s.
	exportInterval = time.Second
)

// buildDaemon builds cmd/fluxvmd from the main module, as it ships.
func buildDaemon(t *testing.T) string { return daemontest.Build(t) }

// startLabCollector runs the Collector's OTLP receiver (HTTP) on
// collectorAddr inside the lab's node namespace, where the daemon runs:
// its listening socket is made there, then served from any thread.
func startLabCollector(t *testing.T, l *lab.Lab) *consumertest.LogsSink {
	t.Helper()
	f := otlpreceiver.NewFactory()
	cfg := f.CreateDefaultConfig().(*otlpreceiver.Config)
	cfg.Protocols.HTTP.GetOrInsertDefault().ServerConfig.NetAddr.Endpoint = collectorAddr
	sink := new(consumertest.LogsSink)
	r, err := f.CreateLogs(context.Background(), receivertest.NewNopSettings(f.Type()), cfg, sink)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Node.Do(func() error { return r.Start(context.Background(), componenttest.NewNopHost()) }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Shutdown(context.Background()); err != nil {
			t.Error(err)
		}
	})
	return sink
}

// labDaemon is fluxvmd running in the lab's node namespace.
type labDaemon struct{ *daemontest.Daemon }

func startLabDaemon(t *testing.T, bin, cfg string, l *lab.Lab) *labDaemon {
	t.Helper()
	return &labDaemon{daemontest.Start(t, bin, cfg, l, labToken)}
}

// metric is the value of the sample named exactly name (labels included)
// in the daemon's /metrics, and whether it is there.
func (d *labDaemon) metric(t *testing.T, name string) (float64, bool) {
	t.Helper()
	body, err := d.Request("GET", "/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(body))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if ok && k == name {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("metric %s: %q", name, v)
			}
			return f, true
		}
	}
	return 0, false
}

// labFlow is one flow the test made, as the lab saw it.
type labFlow struct {
	proto   string // "tcp" or "udp"
	client  netip.AddrPort
	vip     netip.AddrPort
	cli     *lab.VM
	backend *lab.VM // the VM that answered; nil for a drop
	service string
	// sent and recvd are the payload bytes the client wrote and read;
	// sends and recvs the payload-carrying packets each way, at least.
	sent, recvd  int
	sends, recvs int
	dropped      bool
	// began and ended bracket the client's exchange.
	began, ended time.Time
}

type flowKey struct {
	proto  string
	client netip.AddrPort
}

func (f *labFlow) key() flowKey { return flowKey{f.proto, f.client} }

// TestLabFlowsReachCollector is the end-to-end proof of the flow export:
// the real daemon binary, run in a lab node with flow_sample_rate 1 and
// otlp_endpoint pointed at the Collector's own OTLP receiver in this
// process, serves a VIP with two backend VMs. TCP connections with echoed
// payloads and UDP exchanges from two client VMs through the VIP, and a
// connection to a service without a ready backend, leave records that the
// periodic export sends once each, and POST
// /v1/network/services/telemetry/export sends again and reports; the
// collector decodes one log record per flow whose attributes are the
// lab's ground truth (the client's socket address, the VIP, the backend
// VM that answered, protocol, verdict, counts at least the payload) and
// equal to what GET /v1/network/services/flows lists, in both encodings.
func TestLabFlowsReachCollector(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	for _, enc := range []otlp.Encoding{otlp.EncodingJSON, otlp.EncodingProtobuf} {
		t.Run(string(enc), func(t *testing.T) { testLabFlows(t, bin, enc) })
	}
}

func testLabFlows(t *testing.T, bin string, enc otlp.Encoding) {
	began := time.Now()
	l := lab.NewForTest(t)
	clients := []*lab.VM{l.AddVMForTest(t, 1), l.AddVMForTest(t, 2)}
	backends := []*lab.VM{l.AddVMForTest(t, 3), l.AddVMForTest(t, 4)}
	servers := map[string]*lab.Server{}
	byName := map[string]*lab.VM{}
	for _, be := range backends {
		srv, err := be.Serve(8080)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Close() })
		servers[be.Name] = srv
		byName[be.Name] = be
	}
	// Before the daemon, so that it is shut down after the daemon's flush.
	sink := startLabCollector(t, l)

	dir := t.TempDir()
	var edges []string
	for _, vm := range append(append([]*lab.VM{}, clients...), backends...) {
		edges = append(edges, fmt.Sprintf("{ name = %q, vm_id = %q }", vm.NodeIf, vm.Name))
	}
	conf := fmt.Sprintf(`[sandbox.dataplane.service]
map_tier = "S"
pin_root = %q
catalog_path = %q
advertisements_path = %q
node_name = %q
flow_sample_rate = 1
otlp_endpoint = "http://%s"
otlp_encoding = %q
otlp_interval = %q
otlp_timeout = "5s"
otlp_service_name = %q
vm_edge_interfaces = [ %s ]
`, filepath.Join(testenv.PinRoot(t), "service"), filepath.Join(dir, "catalog.json"), filepath.Join(dir, "adv.json"),
		labNode, collectorAddr, enc, exportInterval, labServiceName, strings.Join(edges, ", "))
	cfgPath := filepath.Join(dir, "fluxvmd.toml")
	if err := os.WriteFile(cfgPath, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startLabDaemon(t, bin, cfgPath, l)

	vip := netip.MustParseAddr("10.96.0.10")
	web := fluxvm.Service{
		Name: "web", VIPs: []netip.Addr{vip},
		Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}, {Port: 80, Protocol: fluxvm.UDP}},
	}
	deadVIP := netip.MustParseAddr("10.96.0.11")
	dead := fluxvm.Service{Name: "dead", VIPs: []netip.Addr{deadVIP}, Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}}}
	for _, be := range backends {
		web.Backends = append(web.Backends, fluxvm.Backend{Address: be.Addr4, Port: 8080})
		dead.Backends = append(dead.Backends, fluxvm.Backend{Address: be.Addr4, Port: 8080, State: fluxvm.BackendUnhealthy})
	}
	for _, svc := range []fluxvm.Service{web, dead} {
		if _, err := d.Request("POST", "/v1/network/services", svc); err != nil {
			t.Fatal(err)
		}
	}

	// Traffic: TCP connections with echoed payloads from both clients
	// (at least three each, more until both backends answered), a UDP
	// exchange from each client, one SYN to the service without a ready
	// backend.
	var made []*labFlow
	webTCP := netip.AddrPortFrom(vip, 80)
	answered := map[string]bool{}
	for i := 0; i < 6 || (len(answered) < len(backends) && i < 16); i++ {
		f := tcpFlow(t, clients[i%len(clients)], webTCP, []int{100 + 37*i, 1200}, byName)
		answered[f.backend.Name] = true
		made = append(made, f)
	}
	if len(answered) < len(backends) {
		t.Fatalf("16 connections all went to %v", answered)
	}
	for _, cli := range clients {
		made = append(made, udpFlow(t, cli, netip.AddrPortFrom(vip, 80), []int{64, 512, 900}, byName))
	}
	// The dropped SYN's client port lies below the namespaces' ephemeral
	// range (32768-60999), so that no connection above can have taken it
	// (flows are keyed by client socket).
	drop := dropFlow(t, clients[0], netip.AddrPortFrom(deadVIP, 80), 20345)
	made = append(made, drop)
	trafficDone := time.Now()
	want := map[flowKey]*labFlow{}
	for _, f := range made {
		if f.backend != nil {
			// The backend's server saw the client itself (east-west: no
			// SNAT), and no other backend did.
			for name, srv := range servers {
				if saw := containsPeer(srv.Peers(), f.client); saw != (name == f.backend.Name) {
					t.Errorf("%s %s: backend %s saw it: %v (answered: %s)", f.proto, f.client, name, saw, f.backend.Name)
				}
			}
		}
		want[f.key()] = f
	}

	// The periodic export sends every record once it has been idle an
	// interval.
	waitFor(t, "the periodic export of every flow", 20*time.Second, func() bool {
		got := 0
		for k := range byFlow(t, sink) {
			if want[k] != nil {
				got++
			}
		}
		return got == len(want)
	})
	// Two more rounds: nothing sent twice, nothing else sent.
	time.Sleep(2*exportInterval + exportInterval/2)
	periodicAt := time.Now()
	periodic := byFlow(t, sink)
	t.Logf("periodic export: %d records in %d requests, %v after the traffic", sink.LogRecordCount(), len(sink.AllLogs()), periodicAt.Sub(trafficDone))
	if n := sink.LogRecordCount(); n != len(want) {
		t.Errorf("periodic export: %d log records at the collector, want one per flow (%d)", n, len(want))
	}
	listed := listFlows(t, d)
	for k, f := range want {
		lr, ok := periodic[k]
		if !ok {
			t.Errorf("periodic export: no record of %s %s", f.proto, f.client)
			continue
		}
		checkLabRecord(t, lr, f, listed[k], trafficDone.Add(-time.Minute), periodicAt)
		if testing.Verbose() && (f.dropped || f == made[0]) {
			t.Logf("decoded: %q %v", lr.Body().AsString(), lr.Attributes().AsRaw())
		}
	}
	for k := range periodic {
		if want[k] == nil {
			t.Errorf("periodic export: a record of a flow the test did not make: %s %s", k.proto, k.client)
		}
	}

	// The on-demand route sends the ring's records now and says so.
	sink.Reset()
	before := time.Now()
	body, err := d.Request("POST", "/v1/network/services/telemetry/export?limit=256", nil)
	if err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	var rep api.ExportResponse
	if err := json.Unmarshal(body, &rep); err != nil {
		t.Fatalf("export: %v: %s", err, body)
	}
	t.Logf("export route: %s", body)
	if rep.Read != len(want) || rep.Sent.Records != rep.Read || rep.Sent.Batches < 1 || rep.Sent.Rejected != 0 ||
		rep.Sent.Retries != 0 || rep.Sent.Bytes <= 0 || rep.Sent.Encoding != enc {
		t.Errorf("export route reported %s: want %d records read and sent in %s, none rejected", body, len(want), enc)
	}
	if n := sink.LogRecordCount(); n != rep.Sent.Records {
		t.Errorf("export route: the collector has %d log records, the route reported %d sent", n, rep.Sent.Records)
	}
	onDemand := byFlow(t, sink)
	listed = listFlows(t, d)
	for k, f := range want {
		lr, ok := onDemand[k]
		if !ok {
			t.Errorf("export route: no record of %s %s", f.proto, f.client)
			continue
		}
		checkLabRecord(t, lr, f, listed[k], before, after)
		if p, ok := periodic[k]; ok && attr(p, otlp.AttrFlowSeq) != attr(lr, otlp.AttrFlowSeq) {
			t.Errorf("%s %s: seq %v by the periodic export, %v by the route", f.proto, f.client, attr(p, otlp.AttrFlowSeq), attr(lr, otlp.AttrFlowSeq))
		}
	}

	// /metrics counts what the collector got, and no loss.
	if v, ok := d.metric(t, "fluxvm_otlp_records_sent_total"); !ok || int(v) != 2*len(want) {
		t.Errorf("fluxvm_otlp_records_sent_total %v (present %v), want %d", v, ok, 2*len(want))
	}
	for _, m := range []string{"fluxvm_otlp_failed_batches_total", `fluxvm_otlp_dropped_total{reason="queue_full"}`, `fluxvm_otlp_dropped_total{reason="failed"}`} {
		if v, ok := d.metric(t, m); ok && v != 0 {
			t.Errorf("%s %v, want 0", m, v)
		}
	}
	if t.Failed() {
		t.Logf("daemon output:\n%s", d.Out)
	}
	t.Logf("%s: %d flows through the lab, decoded by the collector; %v", enc, len(want), time.Since(began).Round(time.Millisecond))
}

func containsPeer(peers []netip.AddrPort, ap netip.AddrPort) bool {
	for _, p := range peers {
		if p == ap {
			return true
		}
	}
	return false
}

// tcpFlow connects from cli to vip, echoes payloads of the given sizes and
// closes; backends are the backend VMs by name.
func tcpFlow(t *testing.T, cli *lab.VM, vip netip.AddrPort, sizes []int, backends map[string]*lab.VM) *labFlow {
	t.Helper()
	began := time.Now()
	c, err := cli.DialTCP(vip, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	f := &labFlow{proto: "tcp", vip: vip, cli: cli, service: "web", began: began,
		client: netip.MustParseAddrPort(c.LocalAddr().String())}
	defer func() { c.Close(); f.ended = time.Now() }()
	if f.backend = backends[c.Backend]; f.backend == nil {
		t.Fatalf("%s: answered by %q, not a backend", f.client, c.Backend)
	}
	f.recvd, f.recvs = len(c.Backend)+1, 1 // the identity line
	for i, n := range sizes {
		msg := bytes.Repeat([]byte{byte('a' + i)}, n)
		if err := c.Echo(msg, 3*time.Second); err != nil {
			t.Fatalf("%s: echo of %d bytes: %v", f.client, n, err)
		}
		f.sent += n
		f.recvd += n
		f.sends++
		f.recvs++
	}
	return f
}

// udpFlow sends datagrams of the given sizes from cli to vip on one
// socket, each answered by the backend's name and the payload.
func udpFlow(t *testing.T, cli *lab.VM, vip netip.AddrPort, sizes []int, backends map[string]*lab.VM) *labFlow {
	t.Helper()
	began := time.Now()
	var c net.Conn
	if err := cli.NS.Do(func() (err error) {
		c, err = net.Dial("udp", vip.String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	f := &labFlow{proto: "udp", vip: vip, cli: cli, service: "web", began: began,
		client: netip.MustParseAddrPort(c.LocalAddr().String())}
	defer func() { c.Close(); f.ended = time.Now() }()
	buf := make([]byte, 4096)
	for i, n := range sizes {
		msg := bytes.Repeat([]byte{byte('A' + i)}, n)
		c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		m, err := c.Read(buf)
		if err != nil {
			t.Fatalf("udp %s -> %s: %v", f.client, vip, err)
		}
		name, payload, _ := bytes.Cut(buf[:m], []byte("\n"))
		be := backends[string(name)]
		if be == nil || (f.backend != nil && be != f.backend) || !bytes.Equal(payload, msg) {
			t.Fatalf("udp %s -> %s: answer %d bytes from %q (earlier %v)", f.client, vip, m, name, f.backend)
		}
		f.backend = be
		f.sent += n
		f.recvd += m
		f.sends++
		f.recvs++
	}
	return f
}

// dropFlow tries a TCP connection from cli's port to vip, a service
// without a ready backend: the SYN is dropped.
func dropFlow(t *testing.T, cli *lab.VM, vip netip.AddrPort, port uint16) *labFlow {
	t.Helper()
	f := &labFlow{proto: "tcp", vip: vip, cli: cli, service: "dead", dropped: true,
		client: netip.AddrPortFrom(cli.Addr4, port), began: time.Now()}
	defer func() { f.ended = time.Now() }()
	err := cli.NS.Do(func() error {
		dl := net.Dialer{Timeout: 300 * time.Millisecond, LocalAddr: net.TCPAddrFromAddrPort(f.client)}
		c, err := dl.Dial("tcp", vip.String())
		if err == nil {
			c.Close()
			return fmt.Errorf("%s answered, though no backend is ready", vip)
		}
		// Only a timeout means the SYN left and was dropped; any other
		// error (the port taken, a refusal) is not the flow this wants.
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			return fmt.Errorf("dial %s from %s: %w, want a timeout (the SYN dropped)", vip, f.client, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	f.sends = 1 // the SYN
	return f
}

// byFlow is what the sink holds, one log record per flow keyed by
// protocol and client (received checks the resource, the scope and that
// no seq came twice).
func byFlow(t *testing.T, sink *consumertest.LogsSink) map[flowKey]plog.LogRecord {
	t.Helper()
	out := map[flowKey]plog.LogRecord{}
	for _, lr := range receivedFrom(t, sink, labServiceName, labNode) {
		a := lr.Attributes().AsRaw()
		addr, err := netip.ParseAddr(fmt.Sprint(a[otlp.AttrSourceAddress]))
		port, ok := a[otlp.AttrSourcePort].(int64)
		if err != nil || !ok {
			t.Fatalf("record without a client: %v", a)
		}
		k := flowKey{fmt.Sprint(a[otlp.AttrNetworkTransport]), netip.AddrPortFrom(addr, uint16(port))}
		if _, dup := out[k]; dup {
			t.Errorf("two records of %s %s", k.proto, k.client)
		}
		out[k] = lr
	}
	return out
}

// listFlows is GET /v1/network/services/flows, keyed as byFlow.
func listFlows(t *testing.T, d *labDaemon) map[flowKey]flows.Record {
	t.Helper()
	body, err := d.Request("GET", "/v1/network/services/flows?limit=256", nil)
	if err != nil {
		t.Fatal(err)
	}
	var list api.FlowsResponse
	if err := json.Unmarshal(body, &list); err != nil {
		t.Fatal(err)
	}
	out := map[flowKey]flows.Record{}
	for _, r := range list.Records {
		out[flowKey{r.Protocol, r.Client}] = r
	}
	return out
}

func attr(lr plog.LogRecord, k string) any { return lr.Attributes().AsRaw()[k] }

// checkLabRecord checks what the collector decoded of flow f: against the
// lab (who, where, which backend, what verdict, counts at least what the
// sockets moved) and against rec, the daemon's listing of the same flow
// (every attribute, the times within a reading's clock conversion).
// from and to bound the export (the observed timestamp).
func checkLabRecord(t *testing.T, lr plog.LogRecord, f *labFlow, rec flows.Record, from, to time.Time) {
	t.Helper()
	at := fmt.Sprintf("%s %s -> %s", f.proto, f.client, f.vip)
	a := lr.Attributes().AsRaw()
	i64 := func(k string) int64 { v, _ := a[k].(int64); return v }
	str := func(k string) string { v, _ := a[k].(string); return v }

	// The lab's ground truth.
	if str(otlp.AttrNetworkTransport) != f.proto || str(otlp.AttrNetworkType) != "ipv4" ||
		str(otlp.AttrSourceAddress) != f.client.Addr().String() || i64(otlp.AttrSourcePort) != int64(f.client.Port()) ||
		str(otlp.AttrDestinationAddress) != f.vip.Addr().String() || i64(otlp.AttrDestinationPort) != int64(f.vip.Port()) {
		t.Errorf("%s: decoded as %v %v %v:%v -> %v:%v", at, a[otlp.AttrNetworkTransport], a[otlp.AttrNetworkType],
			a[otlp.AttrSourceAddress], a[otlp.AttrSourcePort], a[otlp.AttrDestinationAddress], a[otlp.AttrDestinationPort])
	}
	if str(otlp.AttrService) != f.service || i64(otlp.AttrServiceID) == 0 {
		t.Errorf("%s: service %v (id %v), want %s", at, a[otlp.AttrService], a[otlp.AttrServiceID], f.service)
	}
	if str(otlp.AttrHook) != "from_vm" || str(otlp.AttrInterface) != f.cli.NodeIf {
		t.Errorf("%s: hook %v on %v, want from_vm on %s", at, a[otlp.AttrHook], a[otlp.AttrInterface], f.cli.NodeIf)
	}
	// Each frame carries at least Ethernet, IPv4 and the L4 header.
	hdr := int64(14 + 20 + 20)
	if f.proto == "udp" {
		hdr = 14 + 20 + 8
	}
	fp, fb := i64(otlp.AttrForwardPackets), i64(otlp.AttrForwardBytes)
	rp, rb := i64(otlp.AttrReplyPackets), i64(otlp.AttrReplyBytes)
	if f.dropped {
		if str(otlp.AttrVerdict) != string(flows.Dropped) || str(otlp.AttrDropReason) != "no_backend" || i64(otlp.AttrDrops) < 1 {
			t.Errorf("%s: verdict %v reason %v drops %v, want dropped, no_backend", at, a[otlp.AttrVerdict], a[otlp.AttrDropReason], a[otlp.AttrDrops])
		}
		if _, ok := a[otlp.AttrBackendAddress]; ok {
			t.Errorf("%s: dropped before a backend was picked, yet backend %v", at, a[otlp.AttrBackendAddress])
		}
		if fp != 0 || rp != 0 || rb != 0 {
			t.Errorf("%s: %d packets forwarded, a reply of %d packets, %d bytes; the SYN was dropped", at, fp, rp, rb)
		}
		if lr.SeverityNumber() != plog.SeverityNumberWarn {
			t.Errorf("%s: severity %v, want WARN", at, lr.SeverityNumber())
		}
	} else {
		if str(otlp.AttrVerdict) != string(flows.Forwarded) || a[otlp.AttrDropReason] != nil || i64(otlp.AttrDrops) != 0 {
			t.Errorf("%s: verdict %v reason %v drops %v, want forwarded", at, a[otlp.AttrVerdict], a[otlp.AttrDropReason], a[otlp.AttrDrops])
		}
		if str(otlp.AttrBackendAddress) != f.backend.Addr4.String() || i64(otlp.AttrBackendPort) != 8080 || i64(otlp.AttrBackendID) == 0 {
			t.Errorf("%s: backend %v:%v (id %v), but %s (%s:8080) answered", at,
				a[otlp.AttrBackendAddress], a[otlp.AttrBackendPort], a[otlp.AttrBackendID], f.backend.Name, f.backend.Addr4)
		}
		if _, ok := a[otlp.AttrSNATAddress]; ok {
			t.Errorf("%s: east-west, yet SNAT %v", at, a[otlp.AttrSNATAddress])
		}
		if fp < int64(f.sends) || fb < int64(f.sent)+fp*hdr || rp < int64(f.recvs) || rb < int64(f.recvd)+rp*hdr {
			t.Errorf("%s: forward %d pkts/%d B, reply %d pkts/%d B; the client sent %d B in %d writes and read %d B in %d",
				at, fp, fb, rp, rb, f.sent, f.sends, f.recvd, f.recvs)
		}
		// UDP has no other packets: a datagram each, its frame exactly.
		if f.proto == "udp" && (fp != int64(f.sends) || fb != int64(f.sent)+fp*hdr || rp != int64(f.recvs) || rb != int64(f.recvd)+rp*hdr) {
			t.Errorf("%s: forward %d pkts/%d B, reply %d pkts/%d B; want exactly %d datagrams of %d B in all, and %d of %d B back, each with its %d B of headers",
				at, fp, fb, rp, rb, f.sends, f.sent, f.recvs, f.recvd, hdr)
		}
		if lr.SeverityNumber() != plog.SeverityNumberInfo {
			t.Errorf("%s: severity %v, want INFO", at, lr.SeverityNumber())
		}
	}
	if lr.EventName() != otlp.EventName {
		t.Errorf("%s: event name %q", at, lr.EventName())
	}
	// The datapath's clock is the coarse one (a tick, 4 ms at HZ=250,
	// each way); the last ACK of a TCP close may follow the client's
	// close.
	const tick = 10 * time.Millisecond
	first, last := time.Unix(0, i64(otlp.AttrFlowFirstSeen)), lr.Timestamp().AsTime()
	if first.Before(f.began.Add(-tick)) || first.After(f.ended.Add(tick)) || last.Before(first) || last.After(f.ended.Add(time.Second)) {
		t.Errorf("%s: first seen %v, last seen %v; the client's exchange was [%v, %v]", at, first, last, f.began, f.ended)
	}
	if obs := lr.ObservedTimestamp().AsTime(); obs.Before(from) || obs.After(to) {
		t.Errorf("%s: observed %v outside [%v, %v]", at, obs, from, to)
	}

	// The daemon's own listing of the flow: the same attributes, and the
	// same times up to the clock conversion of each reading.
	if rec.Seq == 0 {
		t.Errorf("%s: not listed by GET /v1/network/services/flows", at)
		return
	}
	wantA := otlptest.WantAttributes(rec)
	const slack = 50 * time.Millisecond
	gotFirst := time.Unix(0, i64(otlp.AttrFlowFirstSeen))
	if d := gotFirst.Sub(rec.FirstSeen); d < -slack || d > slack {
		t.Errorf("%s: first seen %v, listed %v", at, gotFirst, rec.FirstSeen)
	}
	if d := lr.Timestamp().AsTime().Sub(rec.LastSeen); d < -slack || d > slack {
		t.Errorf("%s: timestamp %v, listed last seen %v", at, lr.Timestamp().AsTime(), rec.LastSeen)
	}
	delete(wantA, otlp.AttrFlowFirstSeen)
	gotA := lr.Attributes().AsRaw()
	delete(gotA, otlp.AttrFlowFirstSeen)
	otlptest.CheckAttributes(t, at+" (against the daemon's listing)", gotA, wantA)
	if got := lr.Body().AsString(); got != otlp.Summary(&rec) {
		t.Errorf("%s: body %q, listed %q", at, got, otlp.Summary(&rec))
	}
}
