package intent

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
)

// Identity is a numeric security identity: what the FluxVM ipcache says a
// source address is (a VM, a tenant network, an external prefix). Policies
// allow or deny identities, never addresses, so a VM that moves keeps its
// rights and an address that changes hands loses them.
type Identity uint32

// Identities.
const (
	// IdentityUnknown is the identity of a source no ipcache prefix covers.
	// It cannot be listed: a policy's DefaultAction decides for it.
	IdentityUnknown Identity = 0
	// MaxIdentity is the largest identity (24 bits, as in Cilium's
	// numeric identities).
	MaxIdentity Identity = 1<<24 - 1
)

// PolicyAction is what a policy does with a new flow.
type PolicyAction string

// Policy actions.
const (
	PolicyAllow PolicyAction = "allow"
	PolicyDeny  PolicyAction = "deny"
)

// Policy is the identity-aware policy of one service: which sources may
// open new flows to its VIPs. The datapath decides each new flow by its
// source's identity: the deny list wins, then the allow list, then
// DefaultAction. AuditOnly forwards what the policy would drop and counts
// and records it instead (flow verdict "audited"). JSON field names are
// those of the product description.
type Policy struct {
	// Service names the service the policy belongs to.
	Service string `json:"service"`
	// Enabled set to false keeps the policy in the catalog without
	// enforcing it. Default true.
	Enabled *bool `json:"enabled,omitempty"`
	// DefaultAction decides for an identity on neither list, including
	// IdentityUnknown. Required.
	DefaultAction PolicyAction `json:"default_action"`
	// AllowIdentities and DenyIdentities: at most MaxPolicyIdentities
	// each, each identity once per list, 1..MaxIdentity. An identity on
	// both is denied.
	AllowIdentities []Identity `json:"allow_identities"`
	DenyIdentities  []Identity `json:"deny_identities"`
	// AuditOnly forwards every flow; those the policy denies are counted
	// and recorded as audited.
	AuditOnly bool `json:"audit_only,omitempty"`
	// L7 hands the service's HTTP or gRPC traffic to a proxy (Envoy or
	// another) on the node. nil: none.
	L7 *L7Policy `json:"l7"`
}

// IsEnabled reports Enabled with its default.
func (p *Policy) IsEnabled() bool { return p.Enabled == nil || *p.Enabled }

// Clone returns a deep copy of p.
func (p Policy) Clone() Policy {
	c := p
	c.Enabled = clonePtr(p.Enabled)
	c.AllowIdentities = slices.Clone(p.AllowIdentities)
	c.DenyIdentities = slices.Clone(p.DenyIdentities)
	if p.L7 != nil {
		l := *p.L7
		l.Authorities = slices.Clone(p.L7.Authorities)
		l.PathPrefixes = slices.Clone(p.L7.PathPrefixes)
		c.L7 = &l
	}
	return c
}

// L7Mode is how a service's L7 proxy takes part.
type L7Mode string

// L7 modes.
const (
	// L7Observe: the proxy is told about the service (GET …/l7/envoy) but
	// the datapath redirects nothing.
	L7Observe L7Mode = "observe"
	// L7Enforce: TC hands the service's new flows to the proxy interface
	// instead of translating them; what the proxy sends on to the VIP is
	// load-balanced as usual. Only for a service in mode nat whose ports
	// are all TCP, served on the VM edge (exposure east-west or both):
	// see ValidatePolicyFor.
	L7Enforce L7Mode = "enforce"
)

// L7Protocol is the application protocol a proxy speaks for a service.
type L7Protocol string

// L7 protocols.
const (
	L7HTTP L7Protocol = "http"
	L7GRPC L7Protocol = "grpc"
)

// L7Policy is the L7 part of a policy. Authorities and PathPrefixes are
// hints for the proxy's configuration (an Envoy/xDS adapter); the datapath
// does not parse HTTP.
type L7Policy struct {
	Mode     L7Mode     `json:"mode"`
	Protocol L7Protocol `json:"protocol"`
	// ProxyInterface is the node's interface toward the proxy (required
	// for enforce).
	ProxyInterface string `json:"proxy_interface,omitempty"`
	// Authorities the proxy serves (host or host:port); empty: any.
	Authorities []string `json:"authorities,omitempty"`
	// PathPrefixes the proxy lets through (each starting with "/");
	// empty: any.
	PathPrefixes []string `json:"path_prefixes,omitempty"`
}

// Bounds of a policy.
const (
	// MaxPolicyIdentities bounds each identity list of a policy.
	MaxPolicyIdentities = 1024
	// MaxL7Matches bounds Authorities and PathPrefixes each.
	MaxL7Matches = 64
	// MaxAuthorityLen and MaxPathPrefixLen bound one entry of each.
	MaxAuthorityLen  = 255
	MaxPathPrefixLen = 1024
	// MaxInterfaceNameLen is the kernel's IFNAMSIZ less the NUL.
	MaxInterfaceNameLen = 15
	// MaxPolicies bounds the policies of one document (DecodePolicies):
	// the services of the largest map tier (L, FLUXVM_MAX_SERVICES in
	// bpf/fluxvm_service_maps.bpf.h), as no node holds more policies than
	// services. The node's own tier is checked when the policies are
	// applied.
	MaxPolicies = 4096
)

// DecodePolicy reads one Policy from r with the rules of DecodeService
// (exact field names, each once, JSON types checked, identity lists longer
// than MaxPolicyIdentities rejected before their elements are decoded,
// maxBytes bounding the input, MaxRequestBytes when <= 0). It does not
// validate the content: call ValidatePolicy.
func DecodePolicy(r io.Reader, maxBytes int64) (Policy, error) {
	var p Policy
	err := decodeDocument(r, maxBytes, func(raw json.RawMessage) *ValidationError {
		return decodePolicy("", raw, &p)
	})
	if err != nil {
		return Policy{}, fmt.Errorf("intent: decode policy: %w", err)
	}
	return p, nil
}

// DecodePolicies reads a JSON array of policies with the rules of
// DecodePolicy; fields are named from the array ("[2].allow_identities[0]").
// An array of more than MaxPolicies elements is ErrLimit before any of
// them is decoded.
func DecodePolicies(r io.Reader, maxBytes int64) ([]Policy, error) {
	var out []Policy
	err := decodeDocument(r, maxBytes, func(raw json.RawMessage) *ValidationError {
		e := decodeArray("", raw, MaxPolicies, func(path string, raw json.RawMessage) *ValidationError {
			var p Policy
			if e := decodePolicy(path, raw, &p); e != nil {
				return e
			}
			out = append(out, p)
			return nil
		})
		if e != nil && e.Field == "" && e.Kind == ErrLimit {
			// The array's own length (an element's errors name the element).
			e.Reason = "too many policies in one request: " + e.Reason +
				" (the services of the largest map tier; the node's own tier bounds the policies it holds)"
		}
		return e
	})
	if err != nil {
		return nil, fmt.Errorf("intent: decode policies: %w", err)
	}
	if out == nil {
		out = []Policy{}
	}
	return out, nil
}

func decodeIdentities(dst *[]Identity) func(string, json.RawMessage) *ValidationError {
	return func(p string, raw json.RawMessage) *ValidationError {
		*dst = nil
		if !jsonNull(raw) {
			*dst = []Identity{}
		}
		return decodeArray(p, raw, MaxPolicyIdentities, func(p string, raw json.RawMessage) *ValidationError {
			var id uint32
			if jsonNull(raw) {
				return verr(ErrMalformed, p, "must be an identity (an integer), not null")
			}
			if e := decodeUint(&id, 1<<32-1)(p, raw); e != nil {
				return e
			}
			*dst = append(*dst, Identity(id))
			return nil
		})
	}
}

func decodeStrings(dst *[]string, limit int) func(string, json.RawMessage) *ValidationError {
	return func(p string, raw json.RawMessage) *ValidationError {
		*dst = nil
		return decodeArray(p, raw, limit, func(p string, raw json.RawMessage) *ValidationError {
			var s string
			if jsonNull(raw) {
				return verr(ErrMalformed, p, "must be a string, not null")
			}
			if e := decodeString(&s)(p, raw); e != nil {
				return e
			}
			*dst = append(*dst, s)
			return nil
		})
	}
}

func decodePolicy(path string, raw json.RawMessage, p *Policy) *ValidationError {
	if jsonNull(raw) {
		return verr(ErrMalformed, path, "must be a JSON object (a policy), not null")
	}
	return decodeObject(path, raw, []jsonField{
		{"service", decodeString(&p.Service)},
		{"enabled", decodeOptBool(&p.Enabled)},
		{"default_action", decodeString(&p.DefaultAction)},
		{"allow_identities", decodeIdentities(&p.AllowIdentities)},
		{"deny_identities", decodeIdentities(&p.DenyIdentities)},
		{"audit_only", decodeBool(&p.AuditOnly)},
		{"l7", func(path string, raw json.RawMessage) *ValidationError {
			if jsonNull(raw) {
				p.L7 = nil
				return nil
			}
			var l L7Policy
			if e := decodeObject(path, raw, []jsonField{
				{"mode", decodeString(&l.Mode)},
				{"protocol", decodeString(&l.Protocol)},
				{"proxy_interface", decodeString(&l.ProxyInterface)},
				{"authorities", decodeStrings(&l.Authorities, MaxL7Matches)},
				{"path_prefixes", decodeStrings(&l.PathPrefixes, MaxL7Matches)},
			}); e != nil {
				return e
			}
			p.L7 = &l
			return nil
		}},
	})
}

// ValidatePolicy checks a policy on its own: the service name, the action,
// the identity lists (range, repeats, bounds) and the L7 part. Whether its
// service exists and can take it is ValidatePolicyFor's question.
func ValidatePolicy(p Policy) error {
	if e := validatePolicy(&p); e != nil {
		return fmt.Errorf("intent: policy %s: %w", quoteName(p.Service), e)
	}
	return nil
}

func validatePolicy(p *Policy) *ValidationError {
	if p.Service == "" {
		return verr(ErrInvalid, "service", "required: the name of the service the policy belongs to")
	}
	if e := checkName(p.Service); e != nil {
		e.Field = "service"
		return e
	}
	if IsReservedName(p.Service) {
		return verr(ErrReservedName, "service", "%q is a path segment of the REST API, never a service's name", p.Service)
	}
	switch p.DefaultAction {
	case PolicyAllow, PolicyDeny:
	case "":
		return verr(ErrInvalid, "default_action", "required: %q or %q", PolicyAllow, PolicyDeny)
	default:
		return verr(ErrInvalid, "default_action", "%q: want %q or %q", p.DefaultAction, PolicyAllow, PolicyDeny)
	}
	for _, l := range []struct {
		field string
		ids   []Identity
	}{{"allow_identities", p.AllowIdentities}, {"deny_identities", p.DenyIdentities}} {
		if len(l.ids) > MaxPolicyIdentities {
			return verr(ErrLimit, l.field, "%d identities; at most %d are allowed", len(l.ids), MaxPolicyIdentities)
		}
		seen := make(map[Identity]int, len(l.ids))
		for i, id := range l.ids {
			f := fmt.Sprintf("%s[%d]", l.field, i)
			switch {
			case id == IdentityUnknown:
				return verr(ErrInvalid, f, "identity 0 is the unknown source (no ipcache prefix covers it): default_action decides for it")
			case id > MaxIdentity:
				return verr(ErrInvalid, f, "identity %d is out of range 1..%d", id, MaxIdentity)
			}
			if j, ok := seen[id]; ok {
				return verr(ErrInvalid, f, "identity %d repeats %s[%d]", id, l.field, j)
			}
			seen[id] = i
		}
	}
	if p.L7 != nil {
		if e := checkL7(p.L7); e != nil {
			return withinField(e, "l7")
		}
	}
	return nil
}

func checkL7(l *L7Policy) *ValidationError {
	switch l.Mode {
	case L7Observe, L7Enforce:
	default:
		return verr(ErrInvalid, "mode", "%q: want %q or %q", l.Mode, L7Observe, L7Enforce)
	}
	switch l.Protocol {
	case L7HTTP, L7GRPC:
	default:
		return verr(ErrInvalid, "protocol", "%q: want %q or %q", l.Protocol, L7HTTP, L7GRPC)
	}
	switch {
	case l.Mode == L7Enforce && l.ProxyInterface == "":
		return verr(ErrInvalid, "proxy_interface", "required in mode enforce: the interface the proxy listens behind")
	case len(l.ProxyInterface) > MaxInterfaceNameLen || strings.ContainsAny(l.ProxyInterface, "/ \t\n\x00"):
		return verr(ErrInvalid, "proxy_interface", "%q is not an interface name", l.ProxyInterface)
	}
	if len(l.Authorities) > MaxL7Matches {
		return verr(ErrLimit, "authorities", "%d entries; at most %d are allowed", len(l.Authorities), MaxL7Matches)
	}
	for i, a := range l.Authorities {
		if a == "" || len(a) > MaxAuthorityLen || strings.ContainsAny(a, "/ \t\r\n\x00") {
			return verr(ErrInvalid, fmt.Sprintf("authorities[%d]", i), "%q is not a host or host:port", a)
		}
	}
	if len(l.PathPrefixes) > MaxL7Matches {
		return verr(ErrLimit, "path_prefixes", "%d entries; at most %d are allowed", len(l.PathPrefixes), MaxL7Matches)
	}
	for i, pp := range l.PathPrefixes {
		if !strings.HasPrefix(pp, "/") || len(pp) > MaxPathPrefixLen || strings.ContainsAny(pp, " \t\r\n\x00?#") {
			return verr(ErrInvalid, fmt.Sprintf("path_prefixes[%d]", i), "%q is not a path prefix (starts with \"/\", no spaces, query or fragment)", pp)
		}
	}
	return nil
}

// ValidatePolicyFor checks p against the service s it names, on top of
// ValidatePolicy: L7 enforce needs a service in mode nat whose ports are
// all TCP (the proxy terminates TCP; DSR keeps the VIP on the wire),
// served on the VM edge (where the proxy's own connections come in).
func ValidatePolicyFor(p Policy, s *Service) error {
	if e := validatePolicy(&p); e != nil {
		return fmt.Errorf("intent: policy %s: %w", quoteName(p.Service), e)
	}
	if s == nil || s.Name != p.Service {
		return fmt.Errorf("intent: policy %s: %w", quoteName(p.Service), verr(ErrPrerequisite, "service", "no service of that name"))
	}
	if p.L7 == nil || p.L7.Mode != L7Enforce {
		return nil
	}
	if s.Mode == ModeDSR {
		return fmt.Errorf("intent: policy %s: %w", quoteName(p.Service), verr(ErrUnsupported, "l7.mode", "enforce needs a service in mode nat, not dsr"))
	}
	if s.Exposure == ExposureNorthSouth {
		return fmt.Errorf("intent: policy %s: %w", quoteName(p.Service), verr(ErrUnsupported, "l7.mode",
			"enforce needs a service served on the VM edge (exposure %s or %s): the proxy's own connections to the VIP come in there",
			ExposureEastWest, ExposureBoth))
	}
	for i, sp := range s.Ports {
		if sp.Protocol != TCP {
			return fmt.Errorf("intent: policy %s: %w", quoteName(p.Service),
				verr(ErrUnsupported, "l7.mode", "enforce needs TCP ports only; the service's ports[%d] is %s", i, sp))
		}
	}
	return nil
}
