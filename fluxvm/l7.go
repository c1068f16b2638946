package fluxvm

import (
	"fmt"

	"github.com/fluxvm/servicefabric/fluxvm/internal/policies"
)

// The L7 document types (package fluxvm/internal/policies').
type (
	// EnvoyDocument is what an Envoy/xDS adapter needs to configure the
	// L7 proxy of one service (the service's policy's l7 part): a
	// listener on each VIP and TCP port of the service, one cluster of
	// its backends, and the routes its authorities and path prefixes
	// allow.
	EnvoyDocument = policies.EnvoyDocument
	// EnvoyListener is one VIP and TCP port of the service.
	EnvoyListener = policies.EnvoyListener
	// EnvoyCluster is the service's backends that take new flows.
	EnvoyCluster = policies.EnvoyCluster
	// EnvoyEndpoint is one backend of the cluster.
	EnvoyEndpoint = policies.EnvoyEndpoint
	// EnvoyRoutes is the route configuration: one virtual host.
	EnvoyRoutes = policies.EnvoyRoutes
	// EnvoyVirtualHost is one set of domains and their routes.
	EnvoyVirtualHost = policies.EnvoyVirtualHost
	// EnvoyRoute sends requests whose path starts with Prefix to
	// Cluster.
	EnvoyRoute = policies.EnvoyRoute
)

// Envoy returns the EnvoyDocument of service: ErrNotFound when the
// service does not exist, has no identity policy, or its policy has no
// l7 part.
func (d *Dataplane) Envoy(service string) (EnvoyDocument, error) {
	if err := d.opened("l7 document"); err != nil {
		return EnvoyDocument{}, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("l7 document"); err != nil {
		return EnvoyDocument{}, err
	}
	s := d.services[service]
	if s == nil {
		return EnvoyDocument{}, fmt.Errorf("fluxvm: l7 document of %q: no such service: %w", service, ErrNotFound)
	}
	doc, err := d.pol.Envoy(&s.Intent, func(b *Backend) BackendState { return d.effectiveState(&s.Intent, b) })
	if err != nil {
		return EnvoyDocument{}, fmt.Errorf("fluxvm: l7 document of %q: %w", service, err)
	}
	return doc, nil
}
