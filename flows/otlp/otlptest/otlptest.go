// Package otlptest holds what tests of the flows OTLP export expect,
// written out by hand rather than derived from the exporter's code, so
// that the unit tests and the test module against the OpenTelemetry
// Collector (test/otelcol) check one contract.
package otlptest

import (
	"testing"

	"github.com/fluxvm/servicefabric/flows"
)

// WantAttributes is what a flow record's log attributes must be, as the
// receiver decodes them (integers as int64).
func WantAttributes(r flows.Record) map[string]any {
	m := map[string]any{
		"network.transport":      r.Protocol,
		"source.address":         r.Client.Addr().String(),
		"source.port":            int64(r.Client.Port()),
		"destination.address":    r.VIP.Addr().String(),
		"destination.port":       int64(r.VIP.Port()),
		"fluxvm.service_id":      int64(r.ServiceID),
		"fluxvm.verdict":         string(r.Verdict),
		"fluxvm.hook":            r.Hook,
		"fluxvm.forward.packets": int64(r.Forward.Packets),
		"fluxvm.forward.bytes":   int64(r.Forward.Bytes),
		"fluxvm.reply.packets":   int64(r.Reply.Packets),
		"fluxvm.reply.bytes":     int64(r.Reply.Bytes),
		"fluxvm.drops":           int64(r.Drops),
		"fluxvm.flow.seq":        int64(r.Seq),
		"fluxvm.flow.first_seen": r.FirstSeen.UnixNano(),
	}
	if r.Client.Addr().Is4() {
		m["network.type"] = "ipv4"
	} else {
		m["network.type"] = "ipv6"
	}
	if r.Service != "" {
		m["fluxvm.service"] = r.Service
	}
	if r.Backend.IsValid() {
		m["fluxvm.backend.address"] = r.Backend.Addr().String()
		m["fluxvm.backend.port"] = int64(r.Backend.Port())
	}
	if r.BackendID != 0 {
		m["fluxvm.backend_id"] = int64(r.BackendID)
	}
	if r.SNAT.IsValid() {
		m["fluxvm.snat.address"] = r.SNAT.Addr().String()
		m["fluxvm.snat.port"] = int64(r.SNAT.Port())
	}
	if r.Reason != "" {
		m["fluxvm.drop.reason"] = r.Reason
	}
	if r.Interface != "" {
		m["fluxvm.interface"] = r.Interface
	}
	return m
}

// CheckAttributes fails t for every attribute of want that got lacks or
// holds another value of, and for every attribute got has beyond want;
// what names the record in the messages.
func CheckAttributes(t testing.TB, what string, got, want map[string]any) {
	t.Helper()
	for k, w := range want {
		if g, ok := got[k]; !ok {
			t.Errorf("%s: %s missing (want %v)", what, k, w)
		} else if g != w {
			t.Errorf("%s: %s = %v (%T), want %v (%T)", what, k, g, g, w, w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: unexpected %s = %v", what, k, g)
		}
	}
}
