package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	collogs "go.opentelemetry.io/proto/otlp/collector/logs/v1"
	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/fluxvm/servicefabric/flows/otlp"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// otlpReceiver is an OTLP/HTTP endpoint on loopback in the lab's node
// namespace (where the daemon runs). It keeps every request body by path
// and answers {} at once, or, when blocking, never (until the test ends
// or the client goes away).
type otlpReceiver struct {
	addr     string
	block    bool
	released chan struct{}
	got      chan string // the path of every request, when there is room

	mu     sync.Mutex
	bodies map[string][][]byte
}

func newOTLPReceiver(t *testing.T, l *lab.Lab, block bool) *otlpReceiver {
	t.Helper()
	rc := &otlpReceiver{block: block, released: make(chan struct{}), got: make(chan string, 64), bodies: map[string][][]byte{}}
	var ln net.Listener
	if err := l.Node.Do(func() (err error) {
		ln, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	rc.addr = ln.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		rc.mu.Lock()
		rc.bodies[r.URL.Path] = append(rc.bodies[r.URL.Path], b)
		rc.mu.Unlock()
		select {
		case rc.got <- r.URL.Path:
		default:
		}
		if rc.block {
			select {
			case <-rc.released:
			case <-r.Context().Done():
			}
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte("{}"))
	})}
	go srv.Serve(ln)
	t.Cleanup(func() {
		close(rc.released)
		srv.Close()
	})
	return rc
}

// contains counts the bodies sent to path that hold s.
func (rc *otlpReceiver) contains(path, s string) int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	n := 0
	for _, b := range rc.bodies[path] {
		if bytes.Contains(b, []byte(s)) {
			n++
		}
	}
	return n
}

// flowDaemon is fluxvmd in a lab of a client VM (vm1) and a backend VM
// (vm2, serving on 8080), with flow_sample_rate 1, exporting to rc, and
// service web (10.96.0.10:80 -> vm2:8080) applied.
type flowDaemon struct {
	*daemon
	cli *lab.VM
	vip netip.AddrPort
}

func startFlowDaemon(t *testing.T, bin string, l *lab.Lab, rc *otlpReceiver, otlpKeys string) *flowDaemon {
	t.Helper()
	cli, be := l.AddVMForTest(t, 1), l.AddVMForTest(t, 2)
	srv, err := be.Serve(8080)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	cfg, _ := writeConfig(t, t.TempDir(), fmt.Sprintf(`flow_sample_rate = 1
otlp_endpoint = "http://%s"
%s
`, rc.addr, otlpKeys))
	fd := &flowDaemon{daemon: startDaemon(t, bin, cfg, l), cli: cli, vip: netip.MustParseAddrPort("10.96.0.10:80")}
	applyWeb(t, fd.daemon, fd.vip.Addr(), be)
	return fd
}

// connect opens a connection through the VIP, echoes over it, closes it
// and returns the client's address.
func (fd *flowDaemon) connect(t *testing.T) netip.AddrPort {
	t.Helper()
	c, err := fd.cli.DialTCP(fd.vip, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Echo([]byte("hello"), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	return netip.MustParseAddrPort(c.LocalAddr().String())
}

// terminate sends SIGTERM and returns how long the daemon took to exit
// and how it exited (failing the test after 20s).
func (fd *flowDaemon) terminate(t *testing.T) (time.Duration, error) {
	t.Helper()
	start := time.Now()
	if err := fd.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- fd.Cmd.Wait() }()
	select {
	case err := <-done:
		return time.Since(start), err
	case <-time.After(20 * time.Second):
		fd.Cmd.Process.Kill()
		<-done
		t.Fatalf("daemon did not stop within 20s of SIGTERM:\n%s", fd.Out)
		return 0, nil
	}
}

// TestDaemonStopCancelsExport (review item 9): an on-demand export to a
// receiver that never answers does not hold the daemon's stop. SIGTERM
// arrives while POST .../telemetry/export waits on the receiver (and
// otlp_timeout would let it wait a minute): the daemon gives it the flush
// deadline, cancels it, answers it 503 saying the daemon is stopping, and
// exits cleanly before the REST server's shutdown deadline.
func TestDaemonStopCancelsExport(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	l := lab.NewForTest(t)
	rc := newOTLPReceiver(t, l, true)
	// The periodic export stays quiet (interval 1h): the route's request
	// is the only one before the stop.
	fd := startFlowDaemon(t, bin, l, rc, "otlp_interval = \"1h\"\notlp_timeout = \"1m\"")
	fd.connect(t)

	type answer struct {
		status int
		body   string
		err    error
	}
	answered := make(chan answer, 1)
	go func() {
		req, _ := http.NewRequest("POST", "http://127.0.0.1:7788/v1/network/services/telemetry/export", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		c := *fd.HTTP
		c.Timeout = time.Minute
		resp, err := c.Do(req)
		if err != nil {
			answered <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		answered <- answer{status: resp.StatusCode, body: string(b)}
	}()
	select {
	case p := <-rc.got:
		if p != "/v1/logs" {
			t.Fatalf("the receiver got %s, want /v1/logs", p)
		}
	case a := <-answered:
		t.Fatalf("the export answered before reaching the receiver: %+v", a)
	case <-time.After(10 * time.Second):
		t.Fatalf("the export did not reach the receiver:\n%s", fd.Out)
	}

	took, err := fd.terminate(t)
	if err != nil {
		t.Errorf("daemon exited with %v after %v:\n%s", err, took, fd.Out)
	}
	if limit := otlpFlushTimeout + 2*time.Second; took > limit || took < otlpFlushTimeout-time.Second {
		t.Errorf("the stop took %v; want about the flush deadline %v (at most %v, below the shutdown deadline %v)",
			took, otlpFlushTimeout, limit, apiShutdownTimeout)
	}
	select {
	case a := <-answered:
		if a.err != nil || a.status != http.StatusServiceUnavailable || !strings.Contains(a.body, `"message":"fluxvmd is stopping: the export was cancelled at the stop's flush deadline`) ||
			strings.Contains(a.body, "did not take") {
			t.Errorf("the export's answer: %+v; want 503 saying the daemon is stopping and cancelled it (not blaming the receiver)", a)
		} else {
			t.Logf("the export's answer: %d %s", a.status, a.body)
		}
	case <-time.After(5 * time.Second):
		t.Error("the export got no answer")
	}
	t.Logf("stopped in %v", took)
}

// TestDaemonTracesAndFinalExport runs the daemon with otlp_encoding
// "protobuf" and an interval of an hour, so that neither the periodic
// export nor the span batcher sends anything before the stop. It applies
// a service over REST and opens a connection through the VIP, then stops
// the daemon: the final round of the periodic export sends the flow's
// record (review item 10), and the flush at stop sends the spans of the
// daemon's work to /v1/traces of the same receiver: the REST request
// (named after its route, with the HTTP attributes), the apply it made
// (its child, in the same trace, with the service's counts) and the
// catalog's restore at start.
func TestDaemonTracesAndFinalExport(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	l := lab.NewForTest(t)
	rc := newOTLPReceiver(t, l, false)
	fd := startFlowDaemon(t, bin, l, rc, "otlp_interval = \"1h\"\notlp_encoding = \"protobuf\"")
	client := fd.connect(t)
	time.Sleep(500 * time.Millisecond)
	rc.mu.Lock()
	early := len(rc.bodies)
	rc.mu.Unlock()
	if early != 0 {
		t.Errorf("the receiver got %d requests before the stop; want none (interval 1h)", early)
	}
	if took, err := fd.terminate(t); err != nil || took > otlpFlushTimeout {
		t.Errorf("daemon exited with %v after %v:\n%s", err, took, fd.Out)
	}

	rc.mu.Lock()
	logs, traces := rc.bodies["/v1/logs"], rc.bodies["/v1/traces"]
	rc.mu.Unlock()
	found := false
	for _, b := range logs {
		var req collogs.ExportLogsServiceRequest
		if err := proto.Unmarshal(b, &req); err != nil {
			t.Fatal(err)
		}
		for _, rl := range req.ResourceLogs {
			for _, sl := range rl.ScopeLogs {
				for _, lr := range sl.LogRecords {
					for _, kv := range lr.Attributes {
						if kv.Key == otlp.AttrSourcePort && kv.Value.GetIntValue() == int64(client.Port()) {
							found = true
						}
					}
				}
			}
		}
	}
	if !found {
		t.Errorf("no flow record of client %s in the %d logs requests: the final round did not send it\n%s", client, len(logs), fd.Out)
	}

	spans := map[string][]*tracepb.Span{}
	var resource map[string]string
	for _, b := range traces {
		var req coltrace.ExportTraceServiceRequest
		if err := proto.Unmarshal(b, &req); err != nil {
			t.Fatal(err)
		}
		for _, rs := range req.ResourceSpans {
			resource = map[string]string{}
			for _, kv := range rs.Resource.Attributes {
				resource[kv.Key] = kv.Value.GetStringValue()
			}
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					spans[s.Name] = append(spans[s.Name], s)
				}
			}
		}
	}
	names := make([]string, 0, len(spans))
	for n := range spans {
		names = append(names, n)
	}
	t.Logf("spans: %v", names)
	if resource["service.name"] != "fluxvmd" || resource["fluxvm.node"] != "lab-node" {
		t.Errorf("resource %v", resource)
	}
	attrs := func(s *tracepb.Span) map[string]*commonpb.AnyValue {
		m := map[string]*commonpb.AnyValue{}
		for _, kv := range s.Attributes {
			m[kv.Key] = kv.Value
		}
		return m
	}
	post, apply := spans["POST /v1/network/services"], spans[fluxvm.SpanApplyService]
	if len(post) != 1 || len(apply) != 1 {
		t.Fatalf("%d spans of the apply request and %d of the apply; want 1 and 1", len(post), len(apply))
	}
	if a := attrs(post[0]); post[0].Kind != tracepb.Span_SPAN_KIND_SERVER || a["http.request.method"].GetStringValue() != "POST" ||
		a["http.route"].GetStringValue() != "/v1/network/services" || a["http.response.status_code"].GetIntValue() != 200 {
		t.Errorf("request span %v", post[0])
	}
	if a := attrs(apply[0]); a["fluxvm.service"].GetStringValue() != "web" || a["fluxvm.service.backends"].GetIntValue() != 1 ||
		a["fluxvm.service.frontends"].GetIntValue() != 1 || !a["fluxvm.apply.changed"].GetBoolValue() {
		t.Errorf("apply span %v", apply[0])
	}
	if !bytes.Equal(apply[0].ParentSpanId, post[0].SpanId) || !bytes.Equal(apply[0].TraceId, post[0].TraceId) {
		t.Error("the apply span is not the child of its request's span")
	}
	if len(spans[fluxvm.SpanRestore]) != 1 {
		t.Errorf("%d restore spans, want 1", len(spans[fluxvm.SpanRestore]))
	}
	if len(spans["GET /v1/network/services/status"]) == 0 {
		t.Error("no span of the status request the test made at start")
	}
}
