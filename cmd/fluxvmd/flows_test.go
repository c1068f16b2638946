package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// logsReceiver is an OTLP/HTTP logs endpoint listening on loopback in the
// lab's node namespace (where the daemon runs): it keeps the request
// bodies it got on /v1/logs.
type logsReceiver struct {
	mu     sync.Mutex
	bodies [][]byte
	addr   string
}

func newLogsReceiver(t *testing.T, l *lab.Lab) *logsReceiver {
	t.Helper()
	rc := &logsReceiver{}
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
		if r.URL.Path == "/v1/logs" {
			rc.mu.Lock()
			rc.bodies = append(rc.bodies, b)
			rc.mu.Unlock()
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte("{}"))
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return rc
}

// has counts the requests whose body names the client port (OTLP/JSON
// source.port is {"intValue":"<port>"}).
func (rc *logsReceiver) has(port uint16) int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	n := 0
	want := []byte(`"intValue":"` + strconv.Itoa(int(port)) + `"`)
	for _, b := range rc.bodies {
		if bytes.Contains(b, want) {
			n++
		}
	}
	return n
}

// TestDaemonFlows runs the real binary with flow_sample_rate 1 and an OTLP
// receiver: a connection through the VIP is listed by GET
// /v1/network/services/flows with its service, backend and counts, the
// export route sends it now and reports it, and the periodic export sends
// it once, after it went idle.
func TestDaemonFlows(t *testing.T) {
	testenv.RequirePrivileged(t)
	bin := buildDaemon(t)
	l, cli, be := clientAndBackend(t)
	rc := newLogsReceiver(t, l)

	cfg, _ := writeConfig(t, t.TempDir(), fmt.Sprintf(`flow_sample_rate = 1
otlp_endpoint = "http://%s"
otlp_interval = "1s"
`, rc.addr))
	d := startDaemon(t, bin, cfg, l)
	vip := netip.MustParseAddr("10.96.0.10")
	applyWeb(t, d, vip, be)
	c, err := cli.DialTCP(netip.AddrPortFrom(vip, 80), 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Echo([]byte("hello"), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	client := netip.MustParseAddrPort(c.LocalAddr().String())
	c.Close()

	body, err := d.Request("GET", "/v1/network/services/flows?service=web&verdict=forwarded", nil)
	if err != nil {
		t.Fatal(err)
	}
	var list api.FlowsResponse
	if err := json.Unmarshal(body, &list); err != nil {
		t.Fatal(err)
	}
	var rec *flows.Record
	for i := range list.Records {
		if list.Records[i].Client == client {
			rec = &list.Records[i]
		}
	}
	if rec == nil || rec.Backend != netip.AddrPortFrom(be.Addr4, 8080) || rec.VIP != netip.AddrPortFrom(vip, 80) ||
		rec.Forward.Packets == 0 || rec.Reply.Packets == 0 || rec.Interface != "vm1" {
		t.Fatalf("no record of the flow from %s to web via %s: %s", client, be.Addr4, body)
	}

	body, err = d.Request("POST", "/v1/network/services/telemetry/export?limit=10", nil)
	if err != nil {
		t.Fatal(err)
	}
	var rep api.ExportResponse
	if err := json.Unmarshal(body, &rep); err != nil || rep.Read == 0 || rep.Sent.Records != rep.Read || rep.Sent.Encoding != "json" {
		t.Fatalf("export: %s %v", body, err)
	}
	if n := rc.has(client.Port()); n != 1 {
		t.Errorf("after the export route, %d requests name the flow, want 1", n)
	}
	// The periodic export sends it once it has been idle a second.
	deadline := time.Now().Add(10 * time.Second)
	for rc.has(client.Port()) < 2 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	time.Sleep(2500 * time.Millisecond) // two more rounds: no second copy
	if n := rc.has(client.Port()); n != 2 {
		t.Errorf("%d requests name the flow, want 2 (the route's and the periodic export's)\n%s", n, d.Out)
	}
}
