package api_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/netip"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// demoServices stands in for the *fluxvm.Dataplane an embedder gets from
// fluxvm.Open (which needs root; with one, api.RolesOf(d) gives every
// role). Embedding the role interface leaves the methods the example does
// not call unimplemented.
type demoServices struct{ api.ServiceStore }

func (demoServices) Services() []fluxvm.ServiceStatus {
	return []fluxvm.ServiceStatus{{
		Service: fluxvm.Service{
			Name:  "web",
			VIPs:  []netip.Addr{netip.MustParseAddr("10.96.0.10")},
			Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}},
		},
		Revision: 1,
	}}
}

// An embedder mounts the REST handler under a prefix of its own server,
// next to its own routes.
func Example_mount() {
	// The routes the example calls need the Services role alone; the
	// others are there, unimplemented.
	roles := api.Roles{
		Services: demoServices{}, Observer: struct{ api.Observer }{}, Admin: struct{ api.Admin }{},
		Flows: struct{ api.FlowReader }{}, Policies: struct{ api.PolicyStore }{},
		Snapshots: struct{ api.Snapshots }{}, Replication: struct{ api.Replication }{},
	}
	fabric, err := api.New(roles, api.Options{
		AdminTokens: []string{"admin-token"},
		ReadTokens:  []string{"read-token"},
	})
	if err != nil {
		log.Fatal(err)
	}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	// The handler serves /v1/... and /metrics; strip the embedder's prefix.
	mux.Handle("/fluxvm/", http.StripPrefix("/fluxvm", fabric))

	srv := httptest.NewServer(mux)
	defer srv.Close()

	get := func(path, token string) {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		fmt.Printf("%s %d %s", path, resp.StatusCode, body)
	}
	get("/healthz", "")
	get("/fluxvm/v1/network/services", "")
	get("/fluxvm/v1/network/services", "read-token")

	// Output:
	// /healthz 200 ok
	// /fluxvm/v1/network/services 401 {"error":{"code":"unauthorized","message":"missing bearer token"}}
	// /fluxvm/v1/network/services 200 [{"service":{"name":"web","vips":["10.96.0.10"],"ports":[{"port":80,"protocol":"tcp"}],"backends":null},"revision":1,"applied_at":"0001-01-01T00:00:00Z","frontends":null}]
}
