package fluxvm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"regexp"
	"strings"

	toml "github.com/pelletier/go-toml/v2"
)

// Reading the TOML file: strict decoding, errors naming the key.

// LoadConfig reads and parses the TOML file at path (see ParseConfig).
func LoadConfig(path string) (Config, error) {
	data, err := ReadConfigFile(path)
	if err != nil {
		return Config{}, err
	}
	cfg, err := parseConfig(data)
	if err != nil {
		return Config{}, fmt.Errorf("fluxvm: config %s: %w", path, err)
	}
	return cfg, nil
}

// ReadConfigFile reads the configuration file at path, refusing one
// larger than MaxConfigBytes (ErrTooLarge).
func ReadConfigFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("fluxvm: config: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxConfigBytes+1))
	if err != nil {
		return nil, fmt.Errorf("fluxvm: config %s: %w", path, err)
	}
	if len(data) > MaxConfigBytes {
		return nil, fmt.Errorf("fluxvm: config %s: %w", path, verr(ErrTooLarge, "", "larger than %d bytes", MaxConfigBytes))
	}
	return data, nil
}

// ParseConfig parses a TOML document: DefaultConfig overlaid with the keys
// of its [sandbox.dataplane.service] table, then validated. The document
// may hold nothing else: every unknown key or table is an error naming
// it, as is a value of the wrong type. Errors are *ValidationError values
// (joined when there are several) whose Field is the full dotted key.
//
// A file written for the reference daemon may also hold its api
// sub-table ([sandbox.dataplane.service.api]: listen address, tokens,
// TLS) and its flow export keys (otlp_endpoint, otlp_encoding,
// otlp_interval, otlp_timeout, otlp_queue, otlp_max_batch, otlp_headers,
// otlp_service_name) and ipcache_file: those settings are the daemon's,
// so the library reads past them without checking them (the daemon does;
// the library exports nothing over the network, and embedders give it the
// ipcache with Dataplane.SetIPCache). A program with keys of its own
// reads the table with DecodeConfigTable and a table type of its own.
func ParseConfig(data []byte) (Config, error) {
	cfg, err := parseConfig(data)
	if err != nil {
		return Config{}, fmt.Errorf("fluxvm: config: %w", err)
	}
	return cfg, nil
}

func parseConfig(data []byte) (Config, error) {
	table := struct {
		Config
		API map[string]any `toml:"api"` // the daemon's (see ParseConfig)
		daemonKeys
	}{Config: DefaultConfig()}
	if err := DecodeConfigTable(data, &table); err != nil {
		return Config{}, err
	}
	cfg := table.Config
	if err := cfg.validate(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// daemonKeys are the reference daemon's flow export keys (cmd/fluxvmd
// OTLPConfig) and its ipcache file, which ParseConfig reads past.
type daemonKeys struct {
	OTLPEndpoint    any `toml:"otlp_endpoint"`
	OTLPEncoding    any `toml:"otlp_encoding"`
	OTLPInterval    any `toml:"otlp_interval"`
	OTLPTimeout     any `toml:"otlp_timeout"`
	OTLPQueue       any `toml:"otlp_queue"`
	OTLPMaxBatch    any `toml:"otlp_max_batch"`
	OTLPHeaders     any `toml:"otlp_headers"`
	OTLPServiceName any `toml:"otlp_service_name"`
	IPCacheFile     any `toml:"ipcache_file"`
}

// DecodeConfigTable decodes the [sandbox.dataplane.service] table of a
// TOML document into table, strictly and with the errors of ParseConfig,
// without validating. table points to Config or to a struct of a program
// that adds keys of its own to the table: such a struct embeds Config
// without a toml tag (so that its keys stay at the table's top level) and
// tags its own fields, as the reference daemon does with its api
// sub-table. Keys the document leaves out keep the values *table has, so
// fill it with the defaults (DefaultConfig) first.
func DecodeConfigTable(data []byte, table any) error {
	t := reflect.TypeOf(table)
	if t == nil || t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("fluxvm: DecodeConfigTable: table is %T, want a pointer to a struct", table)
	}
	// The document is laid out as sandbox.dataplane.service = *table.
	doc := reflect.New(reflect.StructOf([]reflect.StructField{{
		Name: "Sandbox", Tag: `toml:"sandbox"`,
		Type: reflect.StructOf([]reflect.StructField{{
			Name: "Dataplane", Tag: `toml:"dataplane"`,
			Type: reflect.StructOf([]reflect.StructField{{
				Name: "Service", Tag: `toml:"service"`, Type: t.Elem(),
			}}),
		}}),
	}}))
	svc := doc.Elem().Field(0).Field(0).Field(0)
	svc.Set(reflect.ValueOf(table).Elem())
	if err := toml.NewDecoder(bytes.NewReader(data)).DisallowUnknownFields().Decode(doc.Interface()); err != nil {
		return tomlError(err, data, t.Elem())
	}
	reflect.ValueOf(table).Elem().Set(svc)
	return nil
}

var tomlTypeMismatch = regexp.MustCompile(`^cannot decode TOML (\S+) into .* of type (\S+)$`)

// tomlError turns the TOML library's errors into ValidationErrors naming
// the key, with the line and column.
func tomlError(err error, data []byte, table reflect.Type) error {
	var strict *toml.StrictMissingError
	if errors.As(err, &strict) {
		errs := make([]error, 0, len(strict.Errors))
		for i := range strict.Errors {
			de := &strict.Errors[i]
			line, _ := de.Position()
			k := strings.Join(de.Key(), ".")
			hint := ""
			if !strings.HasPrefix(k, ConfigTable+".") {
				hint = "; the file holds only the [" + ConfigTable + "] table"
			}
			errs = append(errs, verr(ErrMalformed, k, "unknown key (line %d)%s", line, hint))
		}
		return errors.Join(errs...)
	}
	var de *toml.DecodeError
	if errors.As(err, &de) {
		line, col := de.Position()
		msg := strings.TrimPrefix(de.Error(), "toml: ")
		if m := tomlTypeMismatch.FindStringSubmatch(msg); m != nil {
			msg = fmt.Sprintf("wrong type: a TOML %s where %s is wanted", m[1], goTypeName(m[2]))
		}
		return verr(ErrMalformed, strings.Join(de.Key(), "."), "%s (line %d, column %d)", msg, line, col)
	}
	if e := durationTypeError(data, table); e != nil {
		return e
	}
	return verr(ErrMalformed, "", "%s", strings.TrimPrefix(err.Error(), "toml: "))
}

// durationTypeError finds a duration key whose value is not a string. The
// TOML library hands a number to Duration.UnmarshalText without saying
// which key it came from, so the key is found by looking at the document
// again.
func durationTypeError(data []byte, st reflect.Type) *ValidationError {
	var doc map[string]any
	if toml.Unmarshal(data, &doc) != nil {
		return nil
	}
	table := any(doc)
	for _, part := range strings.Split(ConfigTable, ".") {
		m, ok := table.(map[string]any)
		if !ok {
			return nil
		}
		table = m[part]
	}
	return durationTypeErrorIn(table, st, "")
}

// durationTypeErrorIn is durationTypeError for the table t of the
// document, laid out as the struct st, whose keys start with prefix
// ("api.").
func durationTypeErrorIn(table any, st reflect.Type, prefix string) *ValidationError {
	m, ok := table.(map[string]any)
	if !ok {
		return nil
	}
	for i := range st.NumField() {
		f := st.Field(i)
		k := f.Tag.Get("toml")
		if f.Anonymous && k == "" && f.Type.Kind() == reflect.Struct {
			// An embedded table type (Config in a program's table).
			if e := durationTypeErrorIn(table, f.Type, prefix); e != nil {
				return e
			}
			continue
		}
		v, set := m[k]
		if !set {
			continue
		}
		switch {
		case f.Type == reflect.TypeFor[Duration]():
			if _, isString := v.(string); !isString {
				return verr(ErrMalformed, configKey(prefix+k), "%v is not a duration; write a string such as \"30s\", \"6h\" or \"1m30s\" (a bare number does not say its unit)", v)
			}
		case f.Type.Kind() == reflect.Struct:
			if e := durationTypeErrorIn(v, f.Type, prefix+k+"."); e != nil {
				return e
			}
		}
	}
	return nil
}

// goTypeName says in TOML terms what a Go type in the library's message
// wants.
func goTypeName(t string) string {
	switch {
	case t == "string" || t == "bpf.AttachMode" || t == "bpf.XDPMode":
		return "a string"
	case t == "bool":
		return "a boolean"
	case strings.HasPrefix(t, "uint") || strings.HasPrefix(t, "int"):
		return "an integer"
	case strings.HasPrefix(t, "[]"):
		return "an array"
	case strings.HasSuffix(t, "Duration"):
		return "a duration string such as \"30s\""
	case strings.HasSuffix(t, "Addr"):
		return "an IP address string"
	}
	return "a table"
}

// configKey is the full TOML key of a field of the service table.
func configKey(k string) string { return ConfigTable + "." + k }
