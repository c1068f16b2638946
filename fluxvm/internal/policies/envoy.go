package policies

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
	"github.com/fluxvm/servicefabric/intent"
)

// EnvoyDocument is what an Envoy/xDS adapter needs to configure the L7
// proxy of one service (the service's policy's l7 part): a listener on
// each VIP and TCP port of the service, one cluster of its backends, and
// the routes its authorities and path prefixes allow. It is built from
// the service and its policy as they are applied; the adapter turns it
// into Envoy resources (listeners, clusters, route configuration).
type EnvoyDocument struct {
	Service string `json:"service"`
	// Mode is observe (the proxy is told, nothing is redirected) or
	// enforce; Protocol http or grpc (grpc: the cluster speaks HTTP/2).
	Mode           intent.L7Mode     `json:"mode"`
	Protocol       intent.L7Protocol `json:"protocol"`
	ProxyInterface string            `json:"proxy_interface,omitempty"`
	// Revision is the identity policy's revision: it moves whenever the
	// policy or the ipcache changes.
	Revision  uint32          `json:"revision"`
	Listeners []EnvoyListener `json:"listeners"`
	Cluster   EnvoyCluster    `json:"cluster"`
	Routes    EnvoyRoutes     `json:"routes"`
}

// EnvoyListener is one VIP and TCP port of the service.
type EnvoyListener struct {
	Name    string     `json:"name"` // <service>-<vip>-<port>
	Address netip.Addr `json:"address"`
	Port    uint16     `json:"port"`
}

// EnvoyCluster is the service's backends: those that take new flows
// (enabled, Ready as Fabric and the health checks see them, weight above
// 0), with their weights.
type EnvoyCluster struct {
	Name      string          `json:"name"` // the service's name
	HTTP2     bool            `json:"http2"`
	Endpoints []EnvoyEndpoint `json:"endpoints"`
}

// EnvoyEndpoint is one backend of the cluster.
type EnvoyEndpoint struct {
	Address netip.Addr `json:"address"`
	Port    uint16     `json:"port"`
	Weight  uint32     `json:"weight"`
}

// EnvoyRoutes is the route configuration: one virtual host whose domains
// are the policy's authorities ("*": any) and whose routes send the
// policy's path prefixes ("/": any) to the cluster. Anything else the
// proxy answers itself (Envoy: 404 for an unknown host or path; an
// adapter may add a 403 route).
type EnvoyRoutes struct {
	VirtualHosts []EnvoyVirtualHost `json:"virtual_hosts"`
}

// EnvoyVirtualHost is one set of domains and their routes.
type EnvoyVirtualHost struct {
	Name    string       `json:"name"`
	Domains []string     `json:"domains"`
	Routes  []EnvoyRoute `json:"routes"`
}

// EnvoyRoute sends requests whose path starts with Prefix to Cluster.
type EnvoyRoute struct {
	Prefix  string `json:"prefix"`
	Cluster string `json:"cluster"`
}

// Envoy is the EnvoyDocument of svc (the intent of a service of the
// dataplane) under its policy's L7 part; state is a backend's effective
// state (the intent's, with the health overlay). errs.ErrNotFound when
// the service has no identity policy, or its policy has no L7 part.
func (e *Enforcer) Envoy(svc *intent.Service, state func(*intent.Backend) intent.BackendState) (EnvoyDocument, error) {
	e.mu.Lock()
	c := e.prog.Policy(svc.Name)
	e.mu.Unlock()
	if c == nil || c.L7 == nil {
		return EnvoyDocument{}, fmt.Errorf("the service's policy has no l7 part: %w", errs.ErrNotFound)
	}
	return envoyDocument(svc, c.L7, c.Revision, state), nil
}

// envoyDocument builds the document of svc under l7; state is a backend's
// effective state (the intent's, with the health overlay).
func envoyDocument(svc *intent.Service, l7 *intent.L7Policy, revision uint32, state func(*intent.Backend) intent.BackendState) EnvoyDocument {
	doc := EnvoyDocument{Service: svc.Name, Mode: l7.Mode, Protocol: l7.Protocol, ProxyInterface: l7.ProxyInterface,
		Revision: revision, Listeners: []EnvoyListener{},
		Cluster: EnvoyCluster{Name: svc.Name, HTTP2: l7.Protocol == intent.L7GRPC, Endpoints: []EnvoyEndpoint{}}}
	for _, vip := range svc.VIPs {
		for _, p := range svc.Ports {
			if p.Protocol != intent.TCP {
				continue // an HTTP or gRPC proxy serves TCP
			}
			doc.Listeners = append(doc.Listeners, EnvoyListener{Name: fmt.Sprintf("%s-%s-%d", svc.Name, vip, p.Port), Address: vip, Port: p.Port})
		}
	}
	for i := range svc.Backends {
		b := &svc.Backends[i]
		if !b.IsEnabled() || state(b) != intent.BackendReady || b.EffectiveWeight() == 0 {
			continue
		}
		doc.Cluster.Endpoints = append(doc.Cluster.Endpoints, EnvoyEndpoint{Address: b.Address, Port: b.Port, Weight: b.EffectiveWeight()})
	}
	domains := slices.Clone(l7.Authorities)
	if len(domains) == 0 {
		domains = []string{"*"}
	}
	prefixes := slices.Clone(l7.PathPrefixes)
	if len(prefixes) == 0 {
		prefixes = []string{"/"}
	}
	vh := EnvoyVirtualHost{Name: svc.Name, Domains: domains}
	for _, p := range prefixes {
		vh.Routes = append(vh.Routes, EnvoyRoute{Prefix: p, Cluster: svc.Name})
	}
	doc.Routes.VirtualHosts = []EnvoyVirtualHost{vh}
	return doc
}
