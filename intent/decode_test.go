package intent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"reflect"
	"strings"
	"testing"
	"testing/iotest"
)

const exampleServicePath = "../examples/service-fabric-v4-east-west.json"

// minimal is the smallest valid request; tests splice fields into it.
const minimal = `{"name":"web","vips":["10.96.0.10"],"ports":[{"port":80,"protocol":"tcp"}],"backends":[{"address":"10.200.1.2","port":8080}]}`

func TestDecodeService(t *testing.T) {
	s, err := DecodeService(strings.NewReader(minimal))
	if err != nil {
		t.Fatal(err)
	}
	want := Service{
		Name:     "web",
		VIPs:     []netip.Addr{netip.MustParseAddr("10.96.0.10")},
		Ports:    []ServicePort{{80, TCP}},
		Backends: []Backend{{Address: netip.MustParseAddr("10.200.1.2"), Port: 8080}},
	}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("got %+v\nwant %+v", s, want)
	}
}

func TestDecodeServiceAllFields(t *testing.T) {
	in := `{
	  "name": "web", "enabled": false, "exposure": "both", "mode": "dsr",
	  "vips": ["10.96.0.10", "fd00:96::10"],
	  "ports": [{"port": 80, "protocol": "tcp"}, {"port": 53, "protocol": "udp"}],
	  "backends": [
	    {"address": "10.200.1.2", "port": 8080, "weight": 0, "enabled": false, "state": "draining", "drain_until_unix_ms": 1788850000000},
	    {"address": "fd00:200:1::2", "port": 8080, "weight": null, "enabled": null}
	  ],
	  "health_check": {"kind": "tcp", "timeout_ms": 500, "interval_ms": 2000, "unhealthy_threshold": 3, "healthy_threshold": 2},
	  "max_egress_mbps": 100, "host_routing": true, "advertise": true
	}`
	s, err := DecodeService(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	ip := netip.MustParseAddr
	want := Service{
		Name: "web", Enabled: ptr(false), Exposure: ExposureBoth, Mode: ModeDSR,
		VIPs:  []netip.Addr{ip("10.96.0.10"), ip("fd00:96::10")},
		Ports: []ServicePort{{80, TCP}, {53, UDP}},
		Backends: []Backend{
			{Address: ip("10.200.1.2"), Port: 8080, Weight: ptr[uint32](0), Enabled: ptr(false), State: BackendDraining, DrainUntilUnixMs: 1788850000000},
			{Address: ip("fd00:200:1::2"), Port: 8080},
		},
		HealthCheck:   &HealthCheck{Kind: "tcp", TimeoutMs: 500, IntervalMs: 2000, UnhealthyThreshold: 3, HealthyThreshold: 2},
		MaxEgressMbps: 100, HostRouting: true, Advertise: true,
	}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("got  %+v\nwant %+v", s, want)
	}
	// The same service through encoding/json, so that the two decoders
	// agree on every field's name and shape.
	var std Service
	if err := json.Unmarshal([]byte(in), &std); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(s, std) {
		t.Errorf("encoding/json decodes differently:\n got %+v\nwant %+v", std, s)
	}
}

// splice replaces the first occurrence of old in minimal.
func splice(old, new string) string {
	if !strings.Contains(minimal, old) {
		panic("splice: " + old)
	}
	return strings.Replace(minimal, old, new, 1)
}

func TestDecodeServiceErrors(t *testing.T) {
	tests := []struct {
		name   string
		in     string
		field  string
		kind   error
		reason string
	}{
		{name: "empty", in: "", kind: ErrMalformed, reason: "empty"},
		{name: "white space only", in: " \n\t", kind: ErrMalformed},
		{name: "syntax", in: `{"name":"web",}`, kind: ErrMalformed, reason: "invalid JSON"},
		{name: "truncated", in: minimal[:40], kind: ErrMalformed},
		{name: "not an object", in: `[1,2]`, kind: ErrMalformed, reason: "object"},
		{name: "a string", in: `"web"`, kind: ErrMalformed},
		{name: "null", in: `null`, kind: ErrMalformed},
		{name: "trailing object", in: minimal + `{}`, kind: ErrMalformed, reason: "trailing data"},
		{name: "trailing garbage", in: minimal + ` x`, kind: ErrMalformed, reason: "trailing data"},
		{name: "trailing comma", in: minimal + `,`, kind: ErrMalformed, reason: "trailing data"},
		{name: "unknown field", in: splice(`"name"`, `"nmae":"x","name"`), field: "nmae", kind: ErrMalformed, reason: "unknown field"},
		{name: "field names are case-sensitive", in: splice(`"name"`, `"Name"`), field: "Name", kind: ErrMalformed},
		{name: "unknown backend field", in: splice(`"port":8080`, `"port":8080,"adress":"10.0.0.1"`), field: "backends[0].adress", kind: ErrMalformed, reason: "address"},
		{name: "unknown port field", in: splice(`"protocol":"tcp"`, `"protocol":"tcp","proto":6`), field: "ports[0].proto", kind: ErrMalformed},
		{name: "unknown health field", in: splice(`"name"`, `"health_check":{"kind":"tcp","path":"/"},"name"`), field: "health_check.path", kind: ErrMalformed},
		{name: "repeated field", in: splice(`"name":"web"`, `"name":"web","name":"api"`), field: "name", kind: ErrMalformed, reason: "repeated"},
		{name: "name not a string", in: splice(`"name":"web"`, `"name":7`), field: "name", kind: ErrMalformed, reason: "string"},
		{name: "vips not an array", in: splice(`["10.96.0.10"]`, `"10.96.0.10"`), field: "vips", kind: ErrMalformed, reason: "array"},
		{name: "vip not an address", in: splice(`"10.96.0.10"`, `"10.96.0.256"`), field: "vips[0]", kind: ErrMalformed, reason: "not an IP address"},
		{name: "vip empty string", in: splice(`"10.96.0.10"`, `""`), field: "vips[0]", kind: ErrMalformed},
		{name: "vip with prefix", in: splice(`"10.96.0.10"`, `"10.96.0.0/24"`), field: "vips[0]", kind: ErrMalformed},
		{name: "backend address bad", in: splice(`"10.200.1.2"`, `"10.200.1"`), field: "backends[0].address", kind: ErrMalformed},
		{name: "backend address a number", in: splice(`"10.200.1.2"`, `167772161`), field: "backends[0].address", kind: ErrMalformed},
		{name: "backend address with port", in: splice(`"10.200.1.2"`, `"10.200.1.2:80"`), field: "backends[0].address", kind: ErrMalformed},
		{name: "port a string", in: splice(`"port":80`, `"port":"80"`), field: "ports[0].port", kind: ErrMalformed, reason: "integer"},
		{name: "port too large", in: splice(`"port":80`, `"port":65536`), field: "ports[0].port", kind: ErrMalformed, reason: "0..65535"},
		{name: "port negative", in: splice(`"port":80`, `"port":-1`), field: "ports[0].port", kind: ErrMalformed},
		{name: "port fraction", in: splice(`"port":80`, `"port":80.5`), field: "ports[0].port", kind: ErrMalformed},
		{name: "port exponent", in: splice(`"port":80`, `"port":8e1`), field: "ports[0].port", kind: ErrMalformed},
		{name: "port null element", in: splice(`[{"port":80,"protocol":"tcp"}]`, `[null]`), field: "ports[0]", kind: ErrMalformed},
		{name: "weight negative", in: splice(`"port":8080`, `"port":8080,"weight":-1`), field: "backends[0].weight", kind: ErrMalformed},
		{name: "weight above uint32", in: splice(`"port":8080`, `"port":8080,"weight":4294967296`), field: "backends[0].weight", kind: ErrMalformed},
		{name: "enabled a string", in: splice(`"name":"web"`, `"name":"web","enabled":"yes"`), field: "enabled", kind: ErrMalformed, reason: "true or false"},
		{name: "drain deadline a string", in: splice(`"port":8080`, `"port":8080,"drain_until_unix_ms":"soon"`), field: "backends[0].drain_until_unix_ms", kind: ErrMalformed},
		{name: "drain deadline above int64", in: splice(`"port":8080`, `"port":8080,"drain_until_unix_ms":9223372036854775808`), field: "backends[0].drain_until_unix_ms", kind: ErrMalformed},
		{name: "backend not an object", in: splice(`[{"address":"10.200.1.2","port":8080}]`, `["10.200.1.2:8080"]`), field: "backends[0]", kind: ErrMalformed, reason: "object"},
		{name: "health_check not an object", in: splice(`"name"`, `"health_check":"tcp","name"`), field: "health_check", kind: ErrMalformed},
		{name: "max_egress negative", in: splice(`"name"`, `"max_egress_mbps":-5,"name"`), field: "max_egress_mbps", kind: ErrMalformed},
		{name: "host_routing a number", in: splice(`"name"`, `"host_routing":1,"name"`), field: "host_routing", kind: ErrMalformed},
		{name: "too many backends", in: splice(`[{"address":"10.200.1.2","port":8080}]`, "["+strings.Repeat(`{"address":"10.200.1.2","port":8080},`, MaxBackendsPerService)+`{}]`),
			field: "backends", kind: ErrLimit, reason: "1025 elements"},
		{name: "too many ports", in: splice(`[{"port":80,"protocol":"tcp"}]`, "["+strings.Repeat(`{},`, MaxPortsPerService)+`{}]`), field: "ports", kind: ErrLimit},
		{name: "second backend", in: splice(`"port":8080}`, `"port":8080},{"address":"10.200.2.2","port":"x"}`), field: "backends[1].port", kind: ErrMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := DecodeService(strings.NewReader(tt.in))
			if err == nil {
				t.Fatalf("decoded %+v, want an error", s)
			}
			if !reflect.DeepEqual(s, Service{}) {
				t.Errorf("a failed decode returned %+v", s)
			}
			checkDecodeError(t, err, tt.field, tt.kind, tt.reason)
		})
	}
}

func checkDecodeError(t *testing.T, err error, field string, kind error, reason string) {
	t.Helper()
	var ve *ValidationError
	if !errors.As(err, &ve) {
		t.Fatalf("error %v (%T) is not a *ValidationError", err, err)
	}
	if ve.Field != field {
		t.Errorf("field %q, want %q (error: %v)", ve.Field, field, err)
	}
	if !errors.Is(err, kind) {
		t.Errorf("error %v is not %v", err, kind)
	}
	if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrLimit) {
		t.Errorf("error %v is neither ErrInvalid nor ErrLimit", err)
	}
	if reason != "" && !strings.Contains(ve.Reason, reason) {
		t.Errorf("reason %q does not mention %q", ve.Reason, reason)
	}
	if !strings.HasPrefix(err.Error(), "intent: decode service") {
		t.Errorf("error %q lacks context", err)
	}
}

func TestDecodeServiceNulls(t *testing.T) {
	in := `{"name":"web","enabled":null,"exposure":null,"mode":null,"vips":["10.96.0.10"],"ports":[{"port":80,"protocol":"tcp"}],
	  "backends":null,"health_check":null,"max_egress_mbps":null,"host_routing":null,"advertise":null}`
	s, err := DecodeService(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if s.Enabled != nil || s.Backends != nil || s.HealthCheck != nil || s.Exposure != "" {
		t.Errorf("null did not decode as absent: %+v", s)
	}
	// An empty array stays an empty array (and re-encodes as one).
	s, err = DecodeService(strings.NewReader(splice(`[{"address":"10.200.1.2","port":8080}]`, `[]`)))
	if err != nil {
		t.Fatal(err)
	}
	if s.Backends == nil || len(s.Backends) != 0 {
		t.Errorf("backends [] decoded as %#v", s.Backends)
	}
}

func TestDecodeServiceSize(t *testing.T) {
	// Exactly MaxRequestBytes (padded with white space) is accepted.
	pad := MaxRequestBytes - len(minimal)
	in := minimal + strings.Repeat(" ", pad)
	if _, err := DecodeService(strings.NewReader(in)); err != nil {
		t.Fatalf("%d bytes: %v", len(in), err)
	}
	// One byte more is rejected before parsing, whatever it is.
	_, err := DecodeService(strings.NewReader(in + " "))
	checkDecodeError(t, err, "", ErrTooLarge, "larger than 1048576 bytes")
	_, err = DecodeService(strings.NewReader(strings.Repeat("x", 5<<20)))
	checkDecodeError(t, err, "", ErrTooLarge, "")

	// A custom limit.
	_, err = DecodeServiceLimit(strings.NewReader(minimal), int64(len(minimal)-1))
	checkDecodeError(t, err, "", ErrTooLarge, "")
	if _, err := DecodeServiceLimit(strings.NewReader(minimal), int64(len(minimal))); err != nil {
		t.Error(err)
	}
	if _, err := DecodeServiceLimit(strings.NewReader(in), 0); err != nil {
		t.Errorf("limit 0 means MaxRequestBytes: %v", err)
	}
}

func TestDecodeServiceReadError(t *testing.T) {
	boom := errors.New("boom")
	_, err := DecodeService(iotest.ErrReader(boom))
	if !errors.Is(err, boom) {
		t.Errorf("error %v does not wrap the reader's", err)
	}
	var ve *ValidationError
	if errors.As(err, &ve) {
		t.Errorf("a read error is not a validation error: %v", err)
	}
}

func TestDecodeServices(t *testing.T) {
	in := "[" + minimal + "," + strings.Replace(minimal, `"web"`, `"api"`, 1) + "]"
	ss, err := DecodeServices(strings.NewReader(in), 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(ss) != 2 || ss[0].Name != "web" || ss[1].Name != "api" {
		t.Errorf("got %+v", ss)
	}
	ss, err = DecodeServices(strings.NewReader("[]"), 0)
	if err != nil || ss == nil || len(ss) != 0 {
		t.Errorf("[] decoded as %#v, %v", ss, err)
	}
	for _, c := range []struct{ in, field string }{
		{"[" + minimal + "," + splice(`"name"`, `"nmae":1,"name"`) + "]", "[1].nmae"},
		{"[" + minimal + ",null]", "[1]"},
		{minimal, ""},
		{"[" + minimal + "] []", ""},
	} {
		_, err := DecodeServices(strings.NewReader(c.in), 0)
		var ve *ValidationError
		if !errors.As(err, &ve) || ve.Field != c.field || !errors.Is(err, ErrMalformed) {
			t.Errorf("%.40q: error %v, want field %q", c.in, err, c.field)
		}
	}
	_, err = DecodeServices(strings.NewReader(in), 10)
	if !errors.Is(err, ErrTooLarge) {
		t.Errorf("limit 10: %v", err)
	}
}

// TestExampleService loads examples/service-fabric-v4-east-west.json: it
// decodes, validates with the default configuration, fits every tier, and
// is what the product description says: dual-stack, port 80/tcp, three
// backend hosts with weights, one of them draining.
func TestExampleService(t *testing.T) {
	f, err := os.Open(exampleServicePath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s, err := DecodeService(f)
	if err != nil {
		t.Fatal(err)
	}
	if err := ValidateService(s, Node{}); err != nil {
		t.Fatal(err)
	}
	if err := ValidateCatalog([]Service{s}, Node{}, tierS); err != nil {
		t.Fatal(err)
	}
	ip := netip.MustParseAddr
	if !reflect.DeepEqual(s.VIPs, []netip.Addr{ip("10.96.0.10"), ip("fd00:96::10")}) ||
		!reflect.DeepEqual(s.Ports, []ServicePort{{80, TCP}}) {
		t.Errorf("frontends %v %v", s.VIPs, s.Ports)
	}
	var v4, v6, draining, weighted int
	for _, b := range s.Backends {
		if b.Address.Is4() {
			v4++
		} else {
			v6++
		}
		if b.EffectiveState() == BackendDraining && b.DrainUntilUnixMs > 0 {
			draining++
		}
		if b.EffectiveWeight() > 1 {
			weighted++
		}
	}
	if v4 != 3 || v6 != 3 || draining == 0 || weighted == 0 {
		t.Errorf("backends: %d IPv4, %d IPv6, %d draining, %d with weight > 1", v4, v6, draining, weighted)
	}
	roundTrip(t, s)
}

// roundTrip checks that s re-encodes with encoding/json and decodes back
// to an equal value.
func roundTrip(t *testing.T, s Service) {
	t.Helper()
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatalf("marshal %+v: %v", s, err)
	}
	s2, err := DecodeService(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("re-decode %s: %v", b, err)
	}
	if !reflect.DeepEqual(s, s2) {
		t.Fatalf("round trip changed the service:\n was %+v\n now %+v\njson %s", s, s2, b)
	}
	if err := ValidateService(s2, Node{}); err != nil {
		t.Fatalf("re-decoded service no longer valid: %v", err)
	}
}

// FuzzDecodeService feeds arbitrary bytes through DecodeService and
// ValidateService: neither may panic, every error must be a
// *ValidationError with a category, and whatever is accepted must
// survive encoding/json and a second decode unchanged.
func FuzzDecodeService(f *testing.F) {
	if b, err := os.ReadFile(exampleServicePath); err == nil {
		f.Add(b)
	}
	for _, s := range []string{
		minimal,
		`{"name":"a","vips":["fd00::1"],"ports":[{"port":1,"protocol":"udp"}],"backends":[]}`,
		`{"name":"a","vips":["10.0.0.1","::ffff:10.0.0.2"],"ports":[{"port":1,"protocol":"tcp"}]}`,
		`{"name":"web","vips":["10.96.0.10"],"ports":[{"port":80,"protocol":"tcp"}],"backends":[{"address":"10.200.1.2","port":8080,"weight":3,"enabled":false,"state":"draining","drain_until_unix_ms":1}]}`,
		`{"name":"web","health_check":{"kind":"tcp"},"advertise":true,"exposure":"both","mode":"dsr","max_egress_mbps":1,"host_routing":true}`,
		`{"name":"w\u0065b","vips":["10.96.0.10"],"ports":[{"port":80,"protocol":"tcp"}],"backends":null}`,
		`[]`, `null`, `{}`, `{"name":1}`, `{"vips":[1]}`, `{} {}`, `{"a":`,
	} {
		f.Add([]byte(s))
	}
	var node Node
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := DecodeService(bytes.NewReader(data))
		if err != nil {
			var ve *ValidationError
			if !errors.As(err, &ve) || ve.Kind == nil || !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrLimit) {
				t.Fatalf("decode error %v is not a categorised ValidationError", err)
			}
			return
		}
		err = ValidateService(s, node)
		if err != nil {
			var ve *ValidationError
			if !errors.As(err, &ve) || ve.Kind == nil {
				t.Fatalf("validation error %v is not a categorised ValidationError", err)
			}
			return
		}
		roundTrip(t, s)
		if err := ValidateCatalog([]Service{s}, node, Limits{Services: 1 << 20, Frontends: 1 << 20, Backends: 1 << 20, MaglevSize: 1 << 20}); err != nil {
			t.Fatalf("a valid service is not a valid catalog: %v", err)
		}
	})
}

func ExampleDecodeService() {
	body := `{"name": "web", "vips": ["10.96.0.10"], "ports": [{"port": 80, "protocol": "tcp"}],
	  "backends": [{"address": "10.200.1.2", "port": 8080, "wieght": 2}]}`
	_, err := DecodeService(strings.NewReader(body))
	var ve *ValidationError
	if errors.As(err, &ve) {
		fmt.Println(ve.Field)
		fmt.Println(errors.Is(err, ErrInvalid))
	}
	// Output:
	// backends[0].wieght
	// true
}

func ExampleValidateService() {
	body := `{"name": "web", "vips": ["10.96.0.10"], "ports": [{"port": 80, "protocol": "tcp"}],
	  "backends": [{"address": "fd00:200:1::2", "port": 8080}]}`
	s, err := DecodeService(strings.NewReader(body))
	if err != nil {
		panic(err)
	}
	err = ValidateService(s, Node{})
	fmt.Println(err)
	// Output:
	// intent: service "web": backends[0].address: IPv6 backend fd00:200:1::2, but the service has no IPv6 VIP
}

// TestExampleNorthSouthService loads examples/service-fabric-north-south.json:
// it decodes, is refused without north-south interfaces and SNAT addresses
// (naming what is missing), and validates with a configuration that has
// them: exposure both, NAT with SNAT for both families, advertised, with a
// TCP health check.
func TestExampleNorthSouthService(t *testing.T) {
	f, err := os.Open("../examples/service-fabric-north-south.json")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s, err := DecodeService(f)
	if err != nil {
		t.Fatal(err)
	}
	var ve *ValidationError
	if err := ValidateService(s, Node{}); !errors.As(err, &ve) || !errors.Is(err, ErrPrerequisite) {
		t.Fatalf("without north-south interfaces: %v, want a prerequisite error", err)
	}
	if err := ValidateService(s, nsNode()); err != nil {
		t.Fatal(err)
	}
	if s.Exposure != ExposureBoth || !s.Advertise || s.HealthCheck == nil || s.HealthCheck.Kind != "tcp" || len(s.VIPs) != 2 {
		t.Errorf("example service %+v", s)
	}
}
