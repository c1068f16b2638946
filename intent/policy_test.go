package intent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
)

const (
	examplePolicyPath   = "../examples/service-fabric-v6/identity-policy.json"
	exampleL7PolicyPath = "../examples/service-fabric-v6/http-envoy-policy.json"
)

// TestExamplePolicies: the two example documents decode and validate, and
// say what their comments in the docs say.
func TestExamplePolicies(t *testing.T) {
	read := func(path string) Policy {
		t.Helper()
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		p, err := DecodePolicy(f, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := ValidatePolicy(p); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		return p
	}
	p := read(examplePolicyPath)
	want := Policy{Service: "payments-api", Enabled: ptr(true), DefaultAction: PolicyDeny,
		AllowIdentities: []Identity{1001, 1002}, DenyIdentities: []Identity{2001}}
	if !reflect.DeepEqual(p, want) {
		t.Errorf("identity-policy.json:\n got %+v\nwant %+v", p, want)
	}
	l7 := read(exampleL7PolicyPath)
	if l7.L7 == nil || l7.L7.Mode != L7Enforce || l7.L7.Protocol != L7HTTP || l7.L7.ProxyInterface == "" ||
		len(l7.L7.PathPrefixes) == 0 || len(l7.L7.Authorities) == 0 {
		t.Errorf("http-envoy-policy.json: %+v", l7.L7)
	}
	svc := Service{Name: l7.Service, Mode: ModeNAT, Ports: []ServicePort{{Port: 80, Protocol: TCP}}}
	if err := ValidatePolicyFor(l7, &svc); err != nil {
		t.Errorf("http-envoy-policy.json for a TCP NAT service: %v", err)
	}
}

func TestDecodePolicyErrors(t *testing.T) {
	long := "[" + strings.Repeat("1,", MaxPolicyIdentities) + "1]"
	tests := []struct {
		in    string
		field string
		kind  error
	}{
		{`{"service":"a","default_action":"deny","allow_identites":[1]}`, "allow_identites", ErrMalformed},
		{`{"service":"a","service":"b"}`, "service", ErrMalformed},
		{`{"service":"a","allow_identities":[1.5]}`, "allow_identities[0]", ErrMalformed},
		{`{"service":"a","allow_identities":["1001"]}`, "allow_identities[0]", ErrMalformed},
		{`{"service":"a","deny_identities":[-1]}`, "deny_identities[0]", ErrMalformed},
		{`{"service":"a","deny_identities":[null]}`, "deny_identities[0]", ErrMalformed},
		{`{"service":"a","allow_identities":` + long + `}`, "allow_identities", ErrLimit},
		{`{"service":"a","l7":{"mode":"enforce","path_prefixes":"/"}}`, "l7.path_prefixes", ErrMalformed},
		{`{"service":"a","l7":{"verb":"GET"}}`, "l7.verb", ErrMalformed},
		{`{"service":"a","audit_only":"yes"}`, "audit_only", ErrMalformed},
		{`null`, "", ErrMalformed},
		{`{"service":"a"} x`, "", ErrMalformed},
	}
	for _, tc := range tests {
		_, err := DecodePolicy(strings.NewReader(tc.in), 0)
		var ve *ValidationError
		if !errors.As(err, &ve) || ve.Field != tc.field || !errors.Is(err, tc.kind) {
			t.Errorf("%s:\n error %v (field %q), want field %q, %v", tc.in, err, fieldOf(err), tc.field, tc.kind)
		}
	}
	if _, err := DecodePolicy(strings.NewReader(`{"service":"`+strings.Repeat("a", 100)+`"}`), 20); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversize policy: %v, want ErrTooLarge", err)
	}
	ps, err := DecodePolicies(strings.NewReader(`[{"service":"a","default_action":"allow"},{"service":"b","default_action":"deny","allow_identities":[x]}]`), 0)
	var ve *ValidationError
	if !errors.As(err, &ve) || ps != nil {
		t.Errorf("bad second policy: %v %v", ps, err)
	}

	// The number of policies in one document is bounded (MaxPolicies),
	// before any of them is decoded: the one past the bound is refused
	// even though every element is valid, and exactly MaxPolicies pass.
	array := func(n int) string {
		var b strings.Builder
		b.WriteByte('[')
		for i := range n {
			if i > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, `{"service":"s%d","default_action":"allow"}`, i)
		}
		b.WriteByte(']')
		return b.String()
	}
	ps, err = DecodePolicies(strings.NewReader(array(MaxPolicies)), 1<<30)
	if err != nil || len(ps) != MaxPolicies {
		t.Errorf("%d policies: %d decoded, %v", MaxPolicies, len(ps), err)
	}
	ps, err = DecodePolicies(strings.NewReader(array(MaxPolicies+1)), 1<<30)
	ve = nil
	if !errors.As(err, &ve) || ve.Field != "" || !errors.Is(err, ErrLimit) || ps != nil ||
		!strings.Contains(err.Error(), "too many policies") || !strings.Contains(err.Error(), fmt.Sprint(MaxPolicies)) {
		t.Errorf("%d policies: %v (%d decoded), want ErrLimit naming the bound %d", MaxPolicies+1, err, len(ps), MaxPolicies)
	}
	// An element's own limit error still names the element.
	_, err = DecodePolicies(strings.NewReader(`[{"service":"a","allow_identities":`+long+`}]`), 0)
	if fieldOf(err) != "[0].allow_identities" || !errors.Is(err, ErrLimit) || strings.Contains(err.Error(), "too many policies") {
		t.Errorf("element limit: %v", err)
	}
}

func fieldOf(err error) string {
	var ve *ValidationError
	if errors.As(err, &ve) {
		return ve.Field
	}
	return ""
}

func TestValidatePolicy(t *testing.T) {
	base := func() Policy {
		return Policy{Service: "web", DefaultAction: PolicyDeny, AllowIdentities: []Identity{1001}, DenyIdentities: []Identity{2001}}
	}
	many := make([]Identity, MaxPolicyIdentities+1)
	for i := range many {
		many[i] = Identity(i + 1)
	}
	tests := []struct {
		name  string
		edit  func(p *Policy)
		field string
		kind  error
	}{
		{"valid", func(p *Policy) {}, "", nil},
		{"overlap: deny wins, accepted", func(p *Policy) { p.DenyIdentities = append(p.DenyIdentities, 1001) }, "", nil},
		{"no service", func(p *Policy) { p.Service = "" }, "service", ErrInvalid},
		{"reserved service name", func(p *Policy) { p.Service = "policies" }, "service", ErrReservedName},
		{"no action", func(p *Policy) { p.DefaultAction = "" }, "default_action", ErrInvalid},
		{"bad action", func(p *Policy) { p.DefaultAction = "drop" }, "default_action", ErrInvalid},
		{"identity 0", func(p *Policy) { p.AllowIdentities = []Identity{0} }, "allow_identities[0]", ErrInvalid},
		{"identity beyond 24 bits", func(p *Policy) { p.DenyIdentities = []Identity{MaxIdentity + 1} }, "deny_identities[0]", ErrInvalid},
		{"repeated", func(p *Policy) { p.AllowIdentities = []Identity{5, 6, 5} }, "allow_identities[2]", ErrInvalid},
		{"too many", func(p *Policy) { p.DenyIdentities = many }, "deny_identities", ErrLimit},
		{"l7 no mode", func(p *Policy) { p.L7 = &L7Policy{Protocol: L7HTTP} }, "l7.mode", ErrInvalid},
		{"l7 bad protocol", func(p *Policy) { p.L7 = &L7Policy{Mode: L7Observe, Protocol: "h2"} }, "l7.protocol", ErrInvalid},
		{"l7 enforce without proxy", func(p *Policy) { p.L7 = &L7Policy{Mode: L7Enforce, Protocol: L7HTTP} }, "l7.proxy_interface", ErrInvalid},
		{"l7 observe without proxy", func(p *Policy) { p.L7 = &L7Policy{Mode: L7Observe, Protocol: L7GRPC} }, "", nil},
		{"l7 long interface", func(p *Policy) {
			p.L7 = &L7Policy{Mode: L7Enforce, Protocol: L7HTTP, ProxyInterface: "sixteen-chars-xx"}
		}, "l7.proxy_interface", ErrInvalid},
		{"l7 path without slash", func(p *Policy) {
			p.L7 = &L7Policy{Mode: L7Observe, Protocol: L7HTTP, PathPrefixes: []string{"/ok", "api"}}
		}, "l7.path_prefixes[1]", ErrInvalid},
		{"l7 path with query", func(p *Policy) {
			p.L7 = &L7Policy{Mode: L7Observe, Protocol: L7HTTP, PathPrefixes: []string{"/a?b"}}
		}, "l7.path_prefixes[0]", ErrInvalid},
		{"l7 authority with path", func(p *Policy) {
			p.L7 = &L7Policy{Mode: L7Observe, Protocol: L7HTTP, Authorities: []string{"a.example/x"}}
		}, "l7.authorities[0]", ErrInvalid},
		{"l7 too many prefixes", func(p *Policy) {
			p.L7 = &L7Policy{Mode: L7Observe, Protocol: L7HTTP, PathPrefixes: make([]string, MaxL7Matches+1)}
		}, "l7.path_prefixes", ErrLimit},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := base()
			tc.edit(&p)
			err := ValidatePolicy(p)
			if tc.kind == nil {
				if err != nil {
					t.Fatalf("rejected: %v", err)
				}
				return
			}
			if !errors.Is(err, tc.kind) || fieldOf(err) != tc.field {
				t.Fatalf("error %v (field %q), want field %q, %v", err, fieldOf(err), tc.field, tc.kind)
			}
		})
	}
}

func TestValidatePolicyFor(t *testing.T) {
	enforce := Policy{Service: "web", DefaultAction: PolicyAllow,
		L7: &L7Policy{Mode: L7Enforce, Protocol: L7HTTP, ProxyInterface: "proxy0"}}
	tcp := Service{Name: "web", Ports: []ServicePort{{Port: 80, Protocol: TCP}, {Port: 443, Protocol: TCP}}}
	tests := []struct {
		name string
		p    Policy
		s    *Service
		kind error
	}{
		{"enforce on TCP NAT", enforce, &tcp, nil},
		{"no such service", enforce, nil, ErrPrerequisite},
		{"another service", enforce, &Service{Name: "api"}, ErrPrerequisite},
		{"enforce on DSR", enforce, &Service{Name: "web", Mode: ModeDSR, Ports: tcp.Ports}, ErrUnsupported},
		{"enforce on a north-south-only service", enforce, &Service{Name: "web", Exposure: ExposureNorthSouth, Ports: tcp.Ports}, ErrUnsupported},
		{"enforce on both edges", enforce, &Service{Name: "web", Exposure: ExposureBoth, Ports: tcp.Ports}, nil},
		{"enforce with a UDP port", enforce, &Service{Name: "web", Ports: []ServicePort{{Port: 80, Protocol: TCP}, {Port: 53, Protocol: UDP}}}, ErrUnsupported},
		{"observe on UDP", Policy{Service: "web", DefaultAction: PolicyAllow, L7: &L7Policy{Mode: L7Observe, Protocol: L7GRPC}},
			&Service{Name: "web", Ports: []ServicePort{{Port: 53, Protocol: UDP}}}, nil},
	}
	for _, tc := range tests {
		err := ValidatePolicyFor(tc.p, tc.s)
		if (tc.kind == nil) != (err == nil) || tc.kind != nil && !errors.Is(err, tc.kind) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.kind)
		}
	}
}

// FuzzDecodePolicy: DecodePolicy and ValidatePolicy never panic, every
// error is a categorised *ValidationError, and an accepted policy
// survives encoding/json and a second decode unchanged.
func FuzzDecodePolicy(f *testing.F) {
	for _, path := range []string{examplePolicyPath, exampleL7PolicyPath} {
		if b, err := os.ReadFile(path); err == nil {
			f.Add(b)
		}
	}
	for _, s := range []string{
		`{"service":"a","default_action":"allow"}`,
		`{"service":"a","default_action":"deny","allow_identities":[1,16777215],"deny_identities":null,"audit_only":true}`,
		`{"service":"a","default_action":"deny","l7":{"mode":"observe","protocol":"grpc","authorities":["x:1"],"path_prefixes":["/"]}}`,
		`{"service":"a","allow_identities":[4294967296]}`, `[]`, `null`, `{}`, `{"l7":[]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := DecodePolicy(bytes.NewReader(data), 0)
		if err != nil {
			var ve *ValidationError
			if !errors.As(err, &ve) || ve.Kind == nil || !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrLimit) {
				t.Fatalf("decode error %v is not a categorised ValidationError", err)
			}
			return
		}
		if err := ValidatePolicy(p); err != nil {
			var ve *ValidationError
			if !errors.As(err, &ve) || ve.Kind == nil {
				t.Fatalf("validation error %v is not a categorised ValidationError", err)
			}
			return
		}
		b, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		p2, err := DecodePolicy(bytes.NewReader(b), 0)
		if err != nil {
			t.Fatalf("re-decode of %s: %v", b, err)
		}
		if !reflect.DeepEqual(p.Clone(), p2.Clone()) && !equalModuloEmpty(p, p2) {
			t.Fatalf("round trip changed the policy:\n was %+v\n now %+v", p, p2)
		}
	})
}

// equalModuloEmpty compares two policies treating nil and empty lists as
// the same (omitempty drops empty L7 lists).
func equalModuloEmpty(a, b Policy) bool {
	norm := func(p *Policy) {
		if len(p.AllowIdentities) == 0 {
			p.AllowIdentities = nil
		}
		if len(p.DenyIdentities) == 0 {
			p.DenyIdentities = nil
		}
		if p.L7 != nil {
			if len(p.L7.Authorities) == 0 {
				p.L7.Authorities = nil
			}
			if len(p.L7.PathPrefixes) == 0 {
				p.L7.PathPrefixes = nil
			}
		}
	}
	a, b = a.Clone(), b.Clone()
	norm(&a)
	norm(&b)
	return reflect.DeepEqual(a, b)
}
