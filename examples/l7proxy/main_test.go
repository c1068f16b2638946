package main

import (
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"

	"github.com/fluxvm/servicefabric/fluxvm"
)

// TestProxyRoutes: the first virtual host matching the authority decides,
// by its own routes; paths not in their clean form are refused before any
// route sees them; allowed requests reach the cluster.
func TestProxyRoutes(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("backend " + r.URL.Path))
	}))
	defer backend.Close()
	ap := netip.MustParseAddrPort(backend.Listener.Addr().String())
	doc := &fluxvm.EnvoyDocument{Service: "shop",
		Cluster: fluxvm.EnvoyCluster{Name: "shop", Endpoints: []fluxvm.EnvoyEndpoint{{Address: ap.Addr(), Port: ap.Port(), Weight: 1}}},
		Routes: fluxvm.EnvoyRoutes{VirtualHosts: []fluxvm.EnvoyVirtualHost{
			{Name: "a", Domains: []string{"shop.example"}, Routes: []fluxvm.EnvoyRoute{{Prefix: "/api/", Cluster: "shop"}}},
			{Name: "b", Domains: []string{"admin.example"}, Routes: []fluxvm.EnvoyRoute{{Prefix: "/admin", Cluster: "shop"}}},
		}}}
	p, err := newProxy(doc, "cluster")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		host, target string
		want         int
	}{
		{"shop.example", "/api/items", 200},
		{"shop.example:80", "/api/items", 200},
		{"shop.example", "/admin", 403},  // another virtual host's route
		{"admin.example", "/admin", 200}, // its own
		{"admin.example", "/api/items", 403},
		{"other.example", "/api/items", 403},
		{"shop.example", "/api/../admin", 400},
		{"shop.example", "/api/%2e%2e/admin", 400},
		{"shop.example", "/api//items", 400},
		{"shop.example", "/api/..;/admin", 400},
		{"shop.example", "/api/..%5Cadmin", 400},
	} {
		r := httptest.NewRequest("GET", "http://"+tc.host+tc.target, nil)
		r.Host = tc.host
		w := httptest.NewRecorder()
		p.ServeHTTP(w, r)
		if w.Code != tc.want {
			t.Errorf("GET %s%s: %d %q, want %d", tc.host, tc.target, w.Code, w.Body.String(), tc.want)
		}
		if tc.want == 200 && w.Header().Get("X-Fluxvm-L7-Proxy") != "shop" {
			t.Errorf("GET %s%s: no proxy header", tc.host, tc.target)
		}
	}
	if _, err := newProxy(doc, "sideways"); err == nil {
		t.Error("an unknown upstream was accepted")
	}
}
