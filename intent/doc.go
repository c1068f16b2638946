// Package intent is the service intent of FluxVM Service Fabric: what
// Fabric asks a node to serve, and the rules that decide whether a node
// can serve it. It is pure Go with no dependency on Linux, BPF or the
// kernel, so a control plane on any OS (macOS, Windows, a CI runner) can
// decode and validate intent exactly as the node will.
//
// A Service is one load-balanced service: its VIPs and ports (the
// frontends), its Backends, and optionally a HealthCheck. DecodeService
// reads one from JSON strictly (unknown or repeated fields, wrong types
// and trailing data are errors naming the field); ValidateService checks
// it against the rules of the product description and against what the
// node it is meant for has (a Node: north-south interfaces, SNAT
// addresses, EDT). ValidateCatalog checks a whole catalog, the services
// a node serves at once: unique names, no frontend served twice, and a
// fit within the capacities of the node's map tier (Limits).
// CatalogIndex keeps the catalog-wide totals so that one change can be
// checked without walking the whole catalog.
//
// Every error about the content of an input is a *ValidationError whose
// Field is the path of the offending field as the input spells it
// ("backends[2].weight", "services[3].ports[0]"), and whose category is
// one of the sentinel errors (ErrInvalid, ErrMalformed, ErrPrerequisite,
// ErrReservedName, ErrConflict, ErrLimit, ErrTooLarge, ErrUnsupported),
// testable with errors.Is.
//
// Package fluxvm, the node's dataplane, re-exports these names
// (fluxvm.Service is intent.Service) and fills a Node from its Config
// and Limits from the loaded BPF object.
package intent
