package main

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"strconv"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// config is the daemon's view of its configuration file: the
// [sandbox.dataplane.service] table holds the library's keys
// (fluxvm.Config, embedded so that they stay at the table's top level) and
// the daemon's own api sub-table, which only the daemon reads.
type config struct {
	fluxvm.Config
	// OTLPConfig is the flow export (the otlp_* keys, otlp.go), read by
	// the daemon only.
	OTLPConfig
	// IPCacheFile is the node's ipcache (ipcache.go): an absolute path
	// to a JSON document {"entries": [{"prefix": "10.0.0.0/24",
	// "identity": 1001}, ...]} of at most MaxIPCacheFileBytes (16 MiB).
	// The daemon reads and validates it at start (a bad file stops the
	// start, naming the file and the field) and applies it after the
	// dataplane opened; POST /v1/network/services/policies/reconcile
	// reads it again. Empty (the default): the daemon reads no ipcache
	// file, and the ipcache is what the catalog restored (empty on a new
	// node).
	IPCacheFile string `toml:"ipcache_file"`
	// API configures the daemon's REST API.
	API APIConfig `toml:"api"`
}

// Defaults of the api table (see defaultConfig).
const (
	DefaultAPIListen         = "127.0.0.1:7788"
	DefaultAPIMaxBodyBytes   = fluxvm.MaxRequestBytes
	DefaultAPIBodyTimeout    = 30 * time.Second
	DefaultAPIMaxConnections = 256
)

// Bounds of the api table.
const (
	// MinAPIMaxBodyBytes and MaxAPIMaxBodyBytes bound api.max_body_bytes.
	MinAPIMaxBodyBytes = 1 << 10
	MaxAPIMaxBodyBytes = 64 << 20
	// MinAPIMaxSnapshotBytes and MaxAPIMaxSnapshotBytes bound
	// api.max_snapshot_bytes; MinAPIMaxDeltaBytes and MaxAPIMaxDeltaBytes
	// api.max_delta_bytes.
	MinAPIMaxSnapshotBytes = 1 << 20
	MaxAPIMaxSnapshotBytes = 16 << 30
	MinAPIMaxDeltaBytes    = 64 << 10
	MaxAPIMaxDeltaBytes    = 1 << 30
	// MinAPIBodyTimeout and MaxAPIBodyTimeout bound api.body_timeout.
	MinAPIBodyTimeout = time.Second
	MaxAPIBodyTimeout = 10 * time.Minute
	// MinAPIMaxConnections and MaxAPIMaxConnections bound
	// api.max_connections.
	MinAPIMaxConnections = 4
	MaxAPIMaxConnections = 65536
)

// Environment variables the daemon reads for its bearer tokens when
// api.admin_token_file or api.read_token_file is not set.
const (
	EnvAdminToken = "FLUXVM_ADMIN_TOKEN"
	EnvReadToken  = "FLUXVM_READ_TOKEN"
)

// APIConfig is the [sandbox.dataplane.service.api] table, read by the
// daemon's REST API.
type APIConfig struct {
	// Listen is the host:port the REST API listens on. Default
	// DefaultAPIListen (127.0.0.1:7788). A host that is not a loopback
	// address (including an empty host, meaning every address) needs TLS
	// or AllowInsecureNonLoopback.
	Listen string `toml:"listen"`
	// AdminTokenFile holds the bearer tokens for mutating requests: one
	// per line, surrounding white space trimmed, empty lines and lines
	// starting with '#' skipped; every token listed is accepted (so that
	// a token can be rotated). When empty the daemon takes the token from
	// the environment variable FLUXVM_ADMIN_TOKEN. The daemon refuses a
	// token file whose mode grants any permission to group or others.
	AdminTokenFile string `toml:"admin_token_file"`
	// ReadTokenFile holds the bearer tokens for read-only requests, in
	// the format of AdminTokenFile; when empty the daemon takes the token
	// from FLUXVM_READ_TOKEN. Admin tokens are accepted for reads too.
	ReadTokenFile string `toml:"read_token_file"`
	// TLSCertFile and TLSKeyFile (PEM) enable HTTPS; both or neither.
	TLSCertFile string `toml:"tls_cert_file"`
	TLSKeyFile  string `toml:"tls_key_file"`
	// AllowInsecureNonLoopback allows plain HTTP on a non-loopback
	// address. Default false.
	AllowInsecureNonLoopback bool `toml:"allow_insecure_non_loopback"`
	// MaxBodyBytes bounds a request body (api.Options.MaxBodyBytes).
	// Default DefaultAPIMaxBodyBytes (1 MiB), range
	// MinAPIMaxBodyBytes..MaxAPIMaxBodyBytes.
	MaxBodyBytes int64 `toml:"max_body_bytes"`
	// MaxSnapshotBytes bounds the snapshot a standby imports (POST
	// …/{name}/conntrack/import, streamed; api.Options.MaxSnapshotBytes):
	// 128 bytes a flow and a little more. Default api.DefaultMaxSnapshotBytes
	// (256 MiB, about 2M flows), range
	// MinAPIMaxSnapshotBytes..MaxAPIMaxSnapshotBytes. The whole snapshot
	// must arrive within body_timeout.
	MaxSnapshotBytes int64 `toml:"max_snapshot_bytes"`
	// MaxDeltaBytes bounds the JSON delta a standby imports (POST
	// …/{name}/conntrack/delta/import; api.Options.MaxDeltaBytes). Default
	// api.DefaultMaxDeltaBytes (64 MiB), range
	// MinAPIMaxDeltaBytes..MaxAPIMaxDeltaBytes.
	MaxDeltaBytes int64 `toml:"max_delta_bytes"`
	// BodyTimeout bounds the time an authenticated request may take to
	// deliver its body, from the end of its headers
	// (api.Options.BodyTimeout); a body that has not arrived by then gets
	// 408 and the connection is closed. Default DefaultAPIBodyTimeout
	// (30 s), range MinAPIBodyTimeout..MaxAPIBodyTimeout.
	BodyTimeout fluxvm.Duration `toml:"body_timeout"`
	// MaxConnections bounds the connections the daemon serves at once;
	// further clients wait in the listen queue until one closes. Default
	// DefaultAPIMaxConnections (256), range
	// MinAPIMaxConnections..MaxAPIMaxConnections.
	MaxConnections int `toml:"max_connections"`
}

// defaultAPIConfig returns the api table with every default applied.
func defaultAPIConfig() APIConfig {
	return APIConfig{
		Listen:           DefaultAPIListen,
		MaxBodyBytes:     DefaultAPIMaxBodyBytes,
		MaxSnapshotBytes: api.DefaultMaxSnapshotBytes,
		MaxDeltaBytes:    api.DefaultMaxDeltaBytes,
		BodyTimeout:      fluxvm.Duration{Duration: DefaultAPIBodyTimeout},
		MaxConnections:   DefaultAPIMaxConnections,
	}
}

// defaultConfig returns the configuration with every default applied.
func defaultConfig() config {
	return config{Config: fluxvm.DefaultConfig(), OTLPConfig: defaultOTLPConfig(), API: defaultAPIConfig()}
}

// loadConfig reads and parses the configuration file at path.
func loadConfig(path string) (config, error) {
	data, err := fluxvm.ReadConfigFile(path)
	if err != nil {
		return config{}, err
	}
	c, err := parseConfig(data)
	if err != nil {
		return config{}, fmt.Errorf("config %s: %w", path, err)
	}
	return c, nil
}

// parseConfig parses a TOML document: the defaults overlaid with the keys
// of its [sandbox.dataplane.service] table (the library's and the api
// sub-table), then validated. The errors are those of fluxvm.ParseConfig:
// *fluxvm.ValidationError values, joined, naming the full key.
func parseConfig(data []byte) (config, error) {
	c := defaultConfig()
	if err := fluxvm.DecodeConfigTable(data, &c); err != nil {
		return config{}, err
	}
	if err := c.validate(); err != nil {
		return config{}, err
	}
	return c, nil
}

// validate checks the library's keys (fluxvm.Config.Validate) and the api
// table, and returns every problem found, joined.
func (c *config) validate() error {
	var errs []error
	if err := c.Config.Validate(); err != nil {
		errs = append(errs, err)
	}
	bad := func(category error, k, format string, args ...any) {
		errs = append(errs, &fluxvm.ValidationError{Field: fluxvm.ConfigTable + "." + k, Reason: fmt.Sprintf(format, args...), Kind: category})
	}
	c.API.validate(bad)
	if c.IPCacheFile != "" && !filepath.IsAbs(c.IPCacheFile) {
		bad(fluxvm.ErrInvalid, "ipcache_file", "%q is not an absolute path", c.IPCacheFile)
	}
	c.OTLPConfig.validate(c.NodeName, bad)
	return errors.Join(errs...)
}

// validate checks the api table:
//
//   - listen host:port with a numeric port 1..65535; a non-loopback host
//     needs TLS (tls_cert_file and tls_key_file) or
//     allow_insecure_non_loopback;
//   - tls_cert_file and tls_key_file both or neither; file paths absolute;
//   - max_body_bytes 1 KiB..64 MiB; max_snapshot_bytes 1 MiB..16 GiB;
//     max_delta_bytes 64 KiB..1 GiB; body_timeout 1s..10m;
//     max_connections 4..65536.
//
// It reads no files: run and check-config read the token files.
func (a *APIConfig) validate(bad func(category error, k, format string, args ...any)) {
	loopback := true
	host, port, err := net.SplitHostPort(a.Listen)
	if err != nil {
		bad(fluxvm.ErrInvalid, "api.listen", "%q is not host:port", a.Listen)
	} else {
		if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
			bad(fluxvm.ErrInvalid, "api.listen", "port %q is not a number in 1..65535", port)
		}
		if host == "localhost" {
			host = "127.0.0.1"
		}
		ip, err := netip.ParseAddr(host)
		loopback = err == nil && ip.IsLoopback()
	}
	tls := a.TLSCertFile != "" || a.TLSKeyFile != ""
	switch {
	case a.TLSCertFile != "" && a.TLSKeyFile == "":
		bad(fluxvm.ErrInvalid, "api.tls_key_file", "required with tls_cert_file")
	case a.TLSKeyFile != "" && a.TLSCertFile == "":
		bad(fluxvm.ErrInvalid, "api.tls_cert_file", "required with tls_key_file")
	}
	if !loopback && !tls && !a.AllowInsecureNonLoopback {
		bad(fluxvm.ErrInvalid, "api.listen", "%q is not a loopback address: set tls_cert_file and tls_key_file, or allow_insecure_non_loopback = true to serve bearer tokens over plain HTTP", a.Listen)
	}
	for _, p := range []struct{ k, v string }{
		{"api.admin_token_file", a.AdminTokenFile},
		{"api.read_token_file", a.ReadTokenFile},
		{"api.tls_cert_file", a.TLSCertFile},
		{"api.tls_key_file", a.TLSKeyFile},
	} {
		if p.v != "" && !filepath.IsAbs(p.v) {
			bad(fluxvm.ErrInvalid, p.k, "%q is not an absolute path", p.v)
		}
	}
	if a.MaxSnapshotBytes < MinAPIMaxSnapshotBytes || a.MaxSnapshotBytes > MaxAPIMaxSnapshotBytes {
		bad(fluxvm.ErrInvalid, "api.max_snapshot_bytes", "%d is outside %d..%d", a.MaxSnapshotBytes, MinAPIMaxSnapshotBytes, MaxAPIMaxSnapshotBytes)
	}
	if a.MaxDeltaBytes < MinAPIMaxDeltaBytes || a.MaxDeltaBytes > MaxAPIMaxDeltaBytes {
		bad(fluxvm.ErrInvalid, "api.max_delta_bytes", "%d is outside %d..%d", a.MaxDeltaBytes, MinAPIMaxDeltaBytes, MaxAPIMaxDeltaBytes)
	}
	if a.MaxBodyBytes < MinAPIMaxBodyBytes || a.MaxBodyBytes > MaxAPIMaxBodyBytes {
		bad(fluxvm.ErrInvalid, "api.max_body_bytes", "%d is outside %d..%d", a.MaxBodyBytes, MinAPIMaxBodyBytes, MaxAPIMaxBodyBytes)
	}
	if d := a.BodyTimeout.Duration; d < MinAPIBodyTimeout || d > MaxAPIBodyTimeout {
		bad(fluxvm.ErrInvalid, "api.body_timeout", "%v is outside %v..%v", d, MinAPIBodyTimeout, MaxAPIBodyTimeout)
	}
	if n := a.MaxConnections; n < MinAPIMaxConnections || n > MaxAPIMaxConnections {
		bad(fluxvm.ErrInvalid, "api.max_connections", "%d is outside %d..%d", n, MinAPIMaxConnections, MaxAPIMaxConnections)
	}
}
