package policies

import (
	"encoding/json"
	"net/netip"
	"reflect"
	"testing"

	"github.com/fluxvm/servicefabric/intent"
)

// TestEnvoyDocument: the document has a listener per VIP and TCP port,
// the backends that take new flows with their weights, and a virtual host
// of the authorities routing the path prefixes to the cluster ("*" and
// "/" when the policy lists none); grpc asks for HTTP/2.
func TestEnvoyDocument(t *testing.T) {
	w0, w3 := uint32(0), uint32(3)
	off := false
	svc := intent.Service{
		Name:  "shop",
		VIPs:  []netip.Addr{netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00:96::10")},
		Ports: []intent.ServicePort{{Port: 80, Protocol: intent.TCP}, {Port: 53, Protocol: intent.UDP}, {Port: 8443, Protocol: intent.TCP}},
		Backends: []intent.Backend{
			{Address: netip.MustParseAddr("10.40.1.21"), Port: 8080, Weight: &w3},
			{Address: netip.MustParseAddr("10.40.1.22"), Port: 8080},
			{Address: netip.MustParseAddr("10.40.1.23"), Port: 8080, State: intent.BackendDraining},
			{Address: netip.MustParseAddr("10.40.1.24"), Port: 8080, Weight: &w0},
			{Address: netip.MustParseAddr("10.40.1.25"), Port: 8080, Enabled: &off},
			{Address: netip.MustParseAddr("10.40.1.26"), Port: 8080}, // unhealthy by its check
		},
	}
	health := func(b *intent.Backend) intent.BackendState {
		if b.Address == netip.MustParseAddr("10.40.1.26") {
			return intent.BackendUnhealthy
		}
		return b.EffectiveState()
	}
	l7 := &intent.L7Policy{Mode: intent.L7Enforce, Protocol: intent.L7HTTP, ProxyInterface: "fxproxy0",
		Authorities: []string{"shop.example.internal"}, PathPrefixes: []string{"/api/", "/healthz"}}
	doc := envoyDocument(&svc, l7, 77, health)
	want := EnvoyDocument{
		Service: "shop", Mode: intent.L7Enforce, Protocol: intent.L7HTTP, ProxyInterface: "fxproxy0", Revision: 77,
		Listeners: []EnvoyListener{
			{Name: "shop-10.96.0.10-80", Address: svc.VIPs[0], Port: 80},
			{Name: "shop-10.96.0.10-8443", Address: svc.VIPs[0], Port: 8443},
			{Name: "shop-fd00:96::10-80", Address: svc.VIPs[1], Port: 80},
			{Name: "shop-fd00:96::10-8443", Address: svc.VIPs[1], Port: 8443},
		},
		Cluster: EnvoyCluster{Name: "shop", Endpoints: []EnvoyEndpoint{
			{Address: netip.MustParseAddr("10.40.1.21"), Port: 8080, Weight: 3},
			{Address: netip.MustParseAddr("10.40.1.22"), Port: 8080, Weight: 1},
		}},
		Routes: EnvoyRoutes{VirtualHosts: []EnvoyVirtualHost{{Name: "shop", Domains: []string{"shop.example.internal"},
			Routes: []EnvoyRoute{{Prefix: "/api/", Cluster: "shop"}, {Prefix: "/healthz", Cluster: "shop"}}}}},
	}
	if !reflect.DeepEqual(doc, want) {
		a, _ := json.MarshalIndent(doc, "", " ")
		b, _ := json.MarshalIndent(want, "", " ")
		t.Fatalf("document\n%s\nwant\n%s", a, b)
	}
	any := envoyDocument(&svc, &intent.L7Policy{Mode: intent.L7Observe, Protocol: intent.L7GRPC}, 1, health)
	vh := any.Routes.VirtualHosts[0]
	if !any.Cluster.HTTP2 || !reflect.DeepEqual(vh.Domains, []string{"*"}) || len(vh.Routes) != 1 || vh.Routes[0].Prefix != "/" {
		t.Errorf("grpc without authorities or prefixes: %+v", any)
	}
}
