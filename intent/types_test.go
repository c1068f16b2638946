package intent

import (
	"net/netip"
	"reflect"
	"testing"
)

// TestServiceCloneSharesNothing: every slice and pointer of a clone can be
// changed without touching the original (ApplyService keeps a clone, so a
// caller's later edits never reach the stored intent).
func TestServiceCloneSharesNothing(t *testing.T) {
	u := func(v uint32) *uint32 { return &v }
	b := func(v bool) *bool { return &v }
	orig := Service{
		Name:        "web",
		Enabled:     b(true),
		VIPs:        []netip.Addr{netip.MustParseAddr("10.96.0.10")},
		Ports:       []ServicePort{{Port: 80, Protocol: TCP}},
		Backends:    []Backend{{Address: netip.MustParseAddr("10.1.0.1"), Port: 8080, Weight: u(2), Enabled: b(true)}},
		HealthCheck: &HealthCheck{Kind: "tcp", TimeoutMs: 500},
	}
	want := orig.Clone()
	c := orig.Clone()
	if !reflect.DeepEqual(c, orig) {
		t.Fatalf("clone differs: %+v", c)
	}
	*c.Enabled = false
	c.VIPs[0] = netip.MustParseAddr("10.96.0.11")
	c.Ports[0].Port = 81
	*c.Backends[0].Weight = 9
	*c.Backends[0].Enabled = false
	c.Backends[0].Port = 9090
	c.HealthCheck.TimeoutMs = 1
	if !reflect.DeepEqual(orig, want) {
		t.Errorf("editing the clone changed the original: %+v", orig)
	}
	if z := (Service{}).Clone(); !reflect.DeepEqual(z, Service{}) {
		t.Errorf("zero service clones to %+v", z)
	}
}
