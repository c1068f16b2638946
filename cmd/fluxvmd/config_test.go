package main

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
)

const exampleConfigPath = "../../examples/fluxvmd.toml"

// TestDefaultAPIConfig: the api table's defaults are valid and are those
// the documentation states.
func TestDefaultAPIConfig(t *testing.T) {
	c := defaultConfig()
	if err := c.validate(); err != nil {
		t.Fatalf("the defaults are not valid: %v", err)
	}
	if !reflect.DeepEqual(c.Config, fluxvm.DefaultConfig()) {
		t.Errorf("library keys %+v, want fluxvm.DefaultConfig", c.Config)
	}
	want := APIConfig{Listen: "127.0.0.1:7788", MaxBodyBytes: 1 << 20, MaxSnapshotBytes: 256 << 20, MaxDeltaBytes: 64 << 20,
		BodyTimeout: fluxvm.Duration{Duration: 30 * time.Second}, MaxConnections: 256}
	if c.API != want {
		t.Errorf("api defaults %+v, want %+v", c.API, want)
	}
	// An empty document, or empty tables, are the defaults.
	for _, doc := range []string{"", "[sandbox.dataplane.service]\n", "[sandbox.dataplane.service.api]\n"} {
		got, err := parseConfig([]byte(doc))
		if err != nil {
			t.Fatalf("%q: %v", doc, err)
		}
		if !reflect.DeepEqual(got, c) {
			t.Errorf("%q: got %+v, want the defaults", doc, got)
		}
	}
}

// TestParseConfigEveryAPIKey sets every key of the api table to a value
// other than its default, beside a key of the library's, and checks that
// each lands in its field.
func TestParseConfigEveryAPIKey(t *testing.T) {
	doc := `
[sandbox.dataplane.service]
map_tier = "l"
body_timeout_is_not_here = false

[sandbox.dataplane.service.api]
listen = "[2001:db8::7]:8443"
admin_token_file = "/etc/fluxvm/admin.token"
read_token_file = "/etc/fluxvm/read.token"
tls_cert_file = "/etc/fluxvm/tls.crt"
tls_key_file = "/etc/fluxvm/tls.key"
allow_insecure_non_loopback = true
max_body_bytes = 2097152
max_snapshot_bytes = 1073741824
max_delta_bytes = 1048576
body_timeout = "5s"
max_connections = 64
`
	// A key of neither table is refused, naming it.
	_, err := parseConfig([]byte(doc))
	var ve *fluxvm.ValidationError
	if !errors.As(err, &ve) || ve.Field != "sandbox.dataplane.service.body_timeout_is_not_here" || !errors.Is(err, fluxvm.ErrMalformed) {
		t.Fatalf("unknown key: %v", err)
	}
	c, err := parseConfig([]byte(strings.Replace(doc, "body_timeout_is_not_here = false\n", "", 1)))
	if err != nil {
		t.Fatal(err)
	}
	want := APIConfig{
		Listen:                   "[2001:db8::7]:8443",
		AdminTokenFile:           "/etc/fluxvm/admin.token",
		ReadTokenFile:            "/etc/fluxvm/read.token",
		TLSCertFile:              "/etc/fluxvm/tls.crt",
		TLSKeyFile:               "/etc/fluxvm/tls.key",
		AllowInsecureNonLoopback: true,
		MaxBodyBytes:             2 << 20,
		MaxSnapshotBytes:         1 << 30,
		MaxDeltaBytes:            1 << 20,
		BodyTimeout:              fluxvm.Duration{Duration: 5 * time.Second},
		MaxConnections:           64,
	}
	if c.API != want {
		t.Errorf("got  %+v\nwant %+v", c.API, want)
	}
	if c.MapTier != "l" {
		t.Errorf("map_tier %q: the library's keys were not read beside the api table", c.MapTier)
	}
	// Every field differs from its default, so none was left unset.
	def, got := reflect.ValueOf(defaultAPIConfig()), reflect.ValueOf(c.API)
	for i := range got.NumField() {
		if reflect.DeepEqual(got.Field(i).Interface(), def.Field(i).Interface()) {
			t.Errorf("%s kept its default", got.Type().Field(i).Name)
		}
	}
}

// TestExampleConfig parses examples/fluxvmd.toml and checks that it shows
// every key the daemon knows: the library's and its api table's.
func TestExampleConfig(t *testing.T) {
	data, err := os.ReadFile(exampleConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	c, err := parseConfig(data)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.validate(); err != nil {
		t.Fatal(err)
	}
	if len(c.VMEdgeInterfaces) != 2 || c.VMEdgeInterfaces[0] != (fluxvm.VMEdgeInterface{Name: "tap-vm1", VMID: "vm-1"}) {
		t.Errorf("vm_edge_interfaces %+v", c.VMEdgeInterfaces)
	}
	c2, err := loadConfig(exampleConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c, c2) {
		t.Error("loadConfig and parseConfig disagree")
	}
	for _, k := range tomlKeys(reflect.TypeFor[config]()) {
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(k) + ` = `).Match(data) {
			t.Errorf("%s does not set %s", exampleConfigPath, k)
		}
	}
	// The example keeps the defaults except where it shows a value.
	def := defaultConfig()
	c.VMEdgeInterfaces, c.NorthSouthInterfaces, c.XDPEgressInterfaces, c.EDTInterfaces = nil, nil, nil, nil
	c.API.AdminTokenFile, c.API.ReadTokenFile = "", ""
	if len(c.Headers) != 0 {
		t.Errorf("otlp_headers %v", c.Headers)
	}
	c.Headers = nil
	if !reflect.DeepEqual(c, def) {
		t.Errorf("example differs from the defaults:\n got %+v\nwant %+v", c, def)
	}
}

// tomlKeys lists the toml tags of t's fields, recursing into struct and
// slice-of-struct fields (whose keys appear in their own tables).
func tomlKeys(t reflect.Type) []string {
	var out []string
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("toml")
		if f.Anonymous && tag == "" {
			out = append(out, tomlKeys(f.Type)...) // fluxvm.Config in config
			continue
		}
		if tag == "" || f.Type == reflect.TypeFor[fluxvm.Duration]() || f.Type == reflect.TypeFor[netip.Addr]() {
			if tag != "" {
				out = append(out, tag)
			}
			continue
		}
		switch {
		case f.Type.Kind() == reflect.Struct:
			out = append(out, tomlKeys(f.Type)...)
		case f.Type.Kind() == reflect.Slice && f.Type.Elem().Kind() == reflect.Struct:
			out = append(out, tomlKeys(f.Type.Elem())...)
		default:
			out = append(out, tag)
		}
	}
	return out
}

func TestConfigListen(t *testing.T) {
	for _, c := range []struct {
		listen, cert, key string
		insecure          bool
		ok                bool
	}{
		{listen: "127.0.0.1:7788", ok: true},
		{listen: "127.1.2.3:7788", ok: true},
		{listen: "[::1]:7788", ok: true},
		{listen: "localhost:7788", ok: true},
		{listen: "10.0.0.1:7788", ok: false},
		{listen: "10.0.0.1:7788", insecure: true, ok: true},
		{listen: "10.0.0.1:7788", cert: "/c", key: "/k", ok: true},
		{listen: "0.0.0.0:7788", cert: "/c", key: "/k", ok: true},
		{listen: "[::]:7788", ok: false},
		{listen: ":7788", insecure: true, ok: true},
		{listen: "127.0.0.1:7788", cert: "/c", ok: false},
		{listen: "10.0.0.1:7788", key: "/k", insecure: true, ok: false},
	} {
		cfg := defaultConfig()
		cfg.API.Listen, cfg.API.TLSCertFile, cfg.API.TLSKeyFile, cfg.API.AllowInsecureNonLoopback = c.listen, c.cert, c.key, c.insecure
		err := cfg.validate()
		if (err == nil) != c.ok {
			t.Errorf("%+v: error %v, want ok=%v", c, err, c.ok)
		}
	}
}

// TestParseConfigAPIErrors: every problem of the api table is a
// *fluxvm.ValidationError naming the full key, as the library's are.
func TestParseConfigAPIErrors(t *testing.T) {
	const api = "[sandbox.dataplane.service.api]\n"
	k := func(s string) string { return "sandbox.dataplane.service." + s }
	tests := []struct {
		name   string
		doc    string
		field  string
		kind   error
		reason string
	}{
		{name: "unknown api key", doc: api + "lissen = \"127.0.0.1:1\"\n", field: k("api.lissen"), kind: fluxvm.ErrMalformed},
		{name: "max_body_bytes a float", doc: api + "max_body_bytes = 1.5\n", field: k("api.max_body_bytes"), kind: fluxvm.ErrMalformed},
		// API.
		{name: "listen without port", doc: api + "listen = \"127.0.0.1\"\n", field: k("api.listen"), kind: fluxvm.ErrInvalid},
		{name: "listen port 0", doc: api + "listen = \"127.0.0.1:0\"\n", field: k("api.listen"), kind: fluxvm.ErrInvalid},
		{name: "listen port by name", doc: api + "listen = \"127.0.0.1:http\"\n", field: k("api.listen"), kind: fluxvm.ErrInvalid},
		{name: "listen port too large", doc: api + "listen = \"127.0.0.1:65536\"\n", field: k("api.listen"), kind: fluxvm.ErrInvalid},
		{name: "listen non-loopback without TLS", doc: api + "listen = \"10.0.0.1:7788\"\n", field: k("api.listen"), kind: fluxvm.ErrInvalid, reason: "allow_insecure_non_loopback"},
		{name: "listen every address without TLS", doc: api + "listen = \":7788\"\n", field: k("api.listen"), kind: fluxvm.ErrInvalid},
		{name: "listen host name without TLS", doc: api + "listen = \"node1.example:7788\"\n", field: k("api.listen"), kind: fluxvm.ErrInvalid},
		{name: "tls cert without key", doc: api + "tls_cert_file = \"/etc/fluxvm/tls.crt\"\n", field: k("api.tls_key_file"), kind: fluxvm.ErrInvalid},
		{name: "tls key without cert", doc: api + "tls_key_file = \"/etc/fluxvm/tls.key\"\n", field: k("api.tls_cert_file"), kind: fluxvm.ErrInvalid},
		{name: "tls cert relative", doc: api + "tls_cert_file = \"tls.crt\"\ntls_key_file = \"/etc/fluxvm/tls.key\"\n", field: k("api.tls_cert_file"), kind: fluxvm.ErrInvalid},
		{name: "admin token file relative", doc: api + "admin_token_file = \"admin.token\"\n", field: k("api.admin_token_file"), kind: fluxvm.ErrInvalid},
		{name: "read token file relative", doc: api + "read_token_file = \"read.token\"\n", field: k("api.read_token_file"), kind: fluxvm.ErrInvalid},
		{name: "max_body_bytes too small", doc: api + "max_body_bytes = 100\n", field: k("api.max_body_bytes"), kind: fluxvm.ErrInvalid},
		{name: "max_body_bytes too large", doc: api + "max_body_bytes = 134217728\n", field: k("api.max_body_bytes"), kind: fluxvm.ErrInvalid},
		{name: "max_connections too few", doc: api + "max_connections = 2\n", field: k("api.max_connections"), kind: fluxvm.ErrInvalid},
		{name: "max_connections too many", doc: api + "max_connections = 100000\n", field: k("api.max_connections"), kind: fluxvm.ErrInvalid},
		{name: "max_connections a string", doc: api + "max_connections = \"many\"\n", field: k("api.max_connections"), kind: fluxvm.ErrMalformed},
		{name: "body_timeout too short", doc: api + "body_timeout = \"500ms\"\n", field: k("api.body_timeout"), kind: fluxvm.ErrInvalid},
		{name: "body_timeout too long", doc: api + "body_timeout = \"1h\"\n", field: k("api.body_timeout"), kind: fluxvm.ErrInvalid},
		{name: "body_timeout a number", doc: api + "body_timeout = 30\n", field: k("api.body_timeout"), kind: fluxvm.ErrMalformed},
		{name: "body_timeout garbage", doc: api + "body_timeout = \"soon\"\n", field: k("api.body_timeout"), kind: fluxvm.ErrMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := parseConfig([]byte(tt.doc))
			if err == nil {
				t.Fatalf("parsed %+v, want an error", c)
			}
			var ve *fluxvm.ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("error %v (%T) is not a *ValidationError", err, err)
			}
			if ve.Field != tt.field {
				t.Errorf("field %q, want %q (error: %v)", ve.Field, tt.field, err)
			}
			if !errors.Is(err, tt.kind) {
				t.Errorf("error %v is not %v", err, tt.kind)
			}
			if tt.reason != "" && !strings.Contains(ve.Reason, tt.reason) {
				t.Errorf("reason %q does not mention %q", ve.Reason, tt.reason)
			}
		})
	}
}

// TestParseConfigReportsEveryProblem: the problems of the library's keys
// and of the api table are reported together.
func TestParseConfigReportsEveryProblem(t *testing.T) {
	doc := "[sandbox.dataplane.service]\nmap_teir = \"S\"\nfoo = 1\n[sandbox.dataplane.service.api]\nlissen = \"x\"\n"
	_, err := parseConfig([]byte(doc))
	for _, key := range []string{"map_teir", "foo", "api.lissen"} {
		if !strings.Contains(fmt.Sprint(err), "sandbox.dataplane.service."+key+": unknown key") {
			t.Errorf("error %v does not name %s", err, key)
		}
	}
	c := defaultConfig()
	c.MapTier, c.PinRoot, c.API.Listen = "Q", "x", "0.0.0.0:1"
	err = c.validate()
	for _, key := range []string{"map_tier", "pin_root", "api.listen"} {
		if !strings.Contains(fmt.Sprint(err), "sandbox.dataplane.service."+key+":") {
			t.Errorf("error %v does not name %s", err, key)
		}
	}
}

// TestLoadConfigFile: loadConfig names the file in its errors and keeps
// the library's bound on the file's size.
func TestLoadConfigFile(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.toml")
	if err := os.WriteFile(bad, []byte("[sandbox.dataplane.service.api]\nmax_connections = 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := loadConfig(bad)
	var ve *fluxvm.ValidationError
	if !errors.As(err, &ve) || ve.Field != "sandbox.dataplane.service.api.max_connections" || !strings.Contains(err.Error(), bad) {
		t.Errorf("bad file: %v", err)
	}
	big := filepath.Join(dir, "big.toml")
	if err := os.WriteFile(big, []byte(strings.Repeat("#", fluxvm.MaxConfigBytes+1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := loadConfig(big); !errors.Is(err, fluxvm.ErrTooLarge) {
		t.Errorf("big file: %v", err)
	}
}
