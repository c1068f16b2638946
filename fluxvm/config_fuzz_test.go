package fluxvm

import (
	"errors"
	"os"
	"reflect"
	"testing"

	toml "github.com/pelletier/go-toml/v2"
)

// FuzzParseConfig feeds arbitrary bytes through ParseConfig: it must never
// panic, every error must be (or join) categorised ValidationErrors, and
// a configuration that parses must validate and survive encoding to TOML
// and parsing again unchanged.
func FuzzParseConfig(f *testing.F) {
	if b, err := os.ReadFile(exampleConfigPath); err == nil {
		f.Add(b)
	}
	for _, s := range []string{
		"", "[sandbox.dataplane.service]\n",
		"[sandbox.dataplane.service]\nmap_tier = \"l\"\nhash_seed = 9223372036854775807\nmaglev_seed = 9223372036854775807\n",
		"[sandbox.dataplane.service]\nnorth_south_interfaces = [\"eth1\"]\nsnat_address = \"203.0.113.10\"\nsnat_address_v6 = \"2001:db8::10\"\nsnat_port_min = 1024\nsnat_port_max = 1024\n",
		"[sandbox.dataplane.service]\nvm_edge_interfaces = [{name = \"tap0\", vm_id = \"vm-1\"}]\nconntrack_gc_interval = \"1m30s\"\n",
		"[sandbox.dataplane.service]\ntcp_syn_timeout = 60\n",
		"[sandbox.dataplane.service]\nadvertisements_path = \"/run/x.json\"\nnode_name = \"n1\"\n",
		"[sandbox.dataplane.service.api]\nlisten = \"[::1]:7788\"\nmax_body_bytes = 1024\n",
		"[sandbox]\nx = 1\n", "a = [", "[sandbox.dataplane.service]\nsnat_address = 1\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := ParseConfig(data)
		if err != nil {
			checkConfigError(t, err)
			return
		}
		if err := cfg.Validate(); err != nil {
			t.Fatalf("ParseConfig accepted a configuration that does not validate: %v", err)
		}
		var doc struct {
			Sandbox struct {
				Dataplane struct {
					Service Config `toml:"service"`
				} `toml:"dataplane"`
			} `toml:"sandbox"`
		}
		doc.Sandbox.Dataplane.Service = cfg
		enc, err := toml.Marshal(doc)
		if err != nil {
			t.Fatalf("encode %+v: %v", cfg, err)
		}
		again, err := ParseConfig(enc)
		if err != nil {
			t.Fatalf("re-parse of\n%s\nfailed: %v", enc, err)
		}
		if !reflect.DeepEqual(nilEmpty(again), nilEmpty(cfg)) {
			t.Fatalf("round trip changed the configuration:\n got %+v\nwant %+v\nvia\n%s", again, cfg, enc)
		}
	})
}

// nilEmpty makes empty lists nil: TOML writes both as [], and they mean
// the same.
func nilEmpty(c Config) Config {
	if len(c.VMEdgeInterfaces) == 0 {
		c.VMEdgeInterfaces = nil
	}
	if len(c.EDTInterfaces) == 0 {
		c.EDTInterfaces = nil
	}
	if len(c.NorthSouthInterfaces) == 0 {
		c.NorthSouthInterfaces = nil
	}
	if len(c.XDPEgressInterfaces) == 0 {
		c.XDPEgressInterfaces = nil
	}
	return c
}

// checkConfigError checks that err is made of categorised
// ValidationErrors only.
func checkConfigError(t *testing.T, err error) {
	t.Helper()
	var leaves []error
	var walk func(error)
	walk = func(e error) {
		switch x := e.(type) {
		case *ValidationError:
			leaves = append(leaves, x)
		case interface{ Unwrap() []error }:
			for _, c := range x.Unwrap() {
				walk(c)
			}
		case interface{ Unwrap() error }:
			walk(x.Unwrap())
		default:
			t.Fatalf("error %v contains %T (%v), not a ValidationError", err, e, e)
		}
	}
	walk(err)
	if len(leaves) == 0 {
		t.Fatalf("error %v has no ValidationError", err)
	}
	for _, l := range leaves {
		var ve *ValidationError
		if !errors.As(l, &ve) || ve.Kind == nil {
			t.Fatalf("error %v: %v has no category", err, l)
		}
	}
}
