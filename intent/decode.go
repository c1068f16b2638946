package intent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"strings"
)

// MaxRequestBytes is the size limit of one JSON document read by
// DecodeService: 1 MiB, which holds a service with MaxBackendsPerService
// backends many times over. A larger body fails with ErrTooLarge before
// anything is parsed.
const MaxRequestBytes = 1 << 20

// DecodeService reads one Service from r, strictly:
//
//   - at most MaxRequestBytes are read (ErrTooLarge beyond that);
//   - the input is exactly one JSON object, optionally surrounded by
//     white space; trailing data is an error;
//   - field names are matched exactly (case-sensitive) and each may
//     appear once; an unknown field is an error naming it;
//   - values must have the field's JSON type (a port is an integer
//     0..65535, not a string or a float; addresses are strings that
//     net/netip parses); null leaves a field at its zero value;
//   - ports and backends longer than MaxPortsPerService and
//     MaxBackendsPerService are rejected (ErrLimit) before their elements
//     are decoded, as validation would reject them anyway.
//
// Errors are *ValidationError values wrapping ErrMalformed, ErrLimit or
// ErrTooLarge, whose Field is the path of the offending field
// ("backends[2].weight"). DecodeService does not validate the content:
// call ValidateService.
func DecodeService(r io.Reader) (Service, error) {
	return DecodeServiceLimit(r, MaxRequestBytes)
}

// DecodeServiceLimit is DecodeService with a size limit of maxBytes
// (MaxRequestBytes when maxBytes <= 0), for an API configured with a
// different max_body_bytes.
func DecodeServiceLimit(r io.Reader, maxBytes int64) (Service, error) {
	var s Service
	err := decodeDocument(r, maxBytes, func(raw json.RawMessage) *ValidationError {
		return decodeService("", raw, &s)
	})
	if err != nil {
		return Service{}, fmt.Errorf("intent: decode service: %w", err)
	}
	return s, nil
}

// DecodeServices reads a JSON array of services with the rules of
// DecodeService; fields are named from the array ("[3].backends[0].port").
// maxBytes bounds the input (MaxRequestBytes when maxBytes <= 0); a
// catalog of many services may need more than one request's worth.
func DecodeServices(r io.Reader, maxBytes int64) ([]Service, error) {
	var out []Service
	err := decodeDocument(r, maxBytes, func(raw json.RawMessage) *ValidationError {
		return decodeArray("", raw, 0, func(path string, raw json.RawMessage) *ValidationError {
			var s Service
			if e := decodeService(path, raw, &s); e != nil {
				return e
			}
			out = append(out, s)
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("intent: decode services: %w", err)
	}
	if out == nil {
		out = []Service{}
	}
	return out, nil
}

// decodeDocument reads at most maxBytes from r, checks that they are
// exactly one JSON value and hands it to top.
func decodeDocument(r io.Reader, maxBytes int64, top func(json.RawMessage) *ValidationError) error {
	if maxBytes <= 0 {
		maxBytes = MaxRequestBytes
	}
	data, err := io.ReadAll(io.LimitReader(r, maxBytes+1))
	if err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if int64(len(data)) > maxBytes {
		return verr(ErrTooLarge, "", "larger than %d bytes", maxBytes)
	}
	d := json.NewDecoder(bytes.NewReader(data))
	var raw json.RawMessage
	if err := d.Decode(&raw); err != nil {
		if errors.Is(err, io.EOF) {
			return verr(ErrMalformed, "", "empty input: want a JSON value")
		}
		return syntaxError(err)
	}
	if _, err := d.Token(); !errors.Is(err, io.EOF) {
		return verr(ErrMalformed, "", "trailing data after the JSON value (at byte %d)", d.InputOffset())
	}
	if e := top(raw); e != nil {
		return e
	}
	return nil
}

func syntaxError(err error) *ValidationError {
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return verr(ErrMalformed, "", "invalid JSON at byte %d: %s", se.Offset, strings.TrimPrefix(se.Error(), "json: "))
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return verr(ErrMalformed, "", "invalid JSON: unexpected end of input")
	}
	return verr(ErrMalformed, "", "invalid JSON: %s", strings.TrimPrefix(err.Error(), "json: "))
}

// jsonField decodes one field of an object; path is the field's path.
type jsonField struct {
	name   string
	decode func(path string, raw json.RawMessage) *ValidationError
}

func fieldPath(parent, name string) string {
	if parent == "" {
		return name
	}
	return parent + "." + name
}

func jsonNull(raw json.RawMessage) bool { return string(raw) == "null" }

// decodeObject walks a JSON object (raw is known to be valid JSON),
// rejecting unknown and repeated fields, and decodes each known field.
// null decodes as an absent object.
func decodeObject(path string, raw json.RawMessage, fields []jsonField) *ValidationError {
	if jsonNull(raw) {
		return nil
	}
	if len(raw) == 0 || raw[0] != '{' {
		return verr(ErrMalformed, path, "must be a JSON object")
	}
	d := json.NewDecoder(bytes.NewReader(raw))
	if _, err := d.Token(); err != nil { // '{'
		return syntaxError(err)
	}
	seen := make(map[string]bool, len(fields))
	for d.More() {
		tok, err := d.Token()
		if err != nil {
			return syntaxError(err)
		}
		key, _ := tok.(string)
		var v json.RawMessage
		if err := d.Decode(&v); err != nil {
			return syntaxError(err)
		}
		fp := fieldPath(path, key)
		var f *jsonField
		for i := range fields {
			if fields[i].name == key {
				f = &fields[i]
				break
			}
		}
		if f == nil {
			names := make([]string, len(fields))
			for i := range fields {
				names[i] = fields[i].name
			}
			return verr(ErrMalformed, fp, "unknown field (known fields: %s)", strings.Join(names, ", "))
		}
		if seen[key] {
			return verr(ErrMalformed, fp, "repeated field")
		}
		seen[key] = true
		if e := f.decode(fp, v); e != nil {
			return e
		}
	}
	return nil
}

// decodeArray calls elem for each element of a JSON array; null is an
// absent array and decodes nothing.
// More than limit elements (limit > 0) is ErrLimit, before any element
// is decoded.
func decodeArray(path string, raw json.RawMessage, limit int, elem func(path string, raw json.RawMessage) *ValidationError) *ValidationError {
	if jsonNull(raw) {
		return nil
	}
	if len(raw) == 0 || raw[0] != '[' {
		return verr(ErrMalformed, path, "must be a JSON array")
	}
	var elems []json.RawMessage
	if err := json.Unmarshal(raw, &elems); err != nil {
		return verr(ErrMalformed, path, "must be a JSON array")
	}
	if limit > 0 && len(elems) > limit {
		return verr(ErrLimit, path, "%d elements; at most %d are allowed", len(elems), limit)
	}
	for i, e := range elems {
		if ve := elem(fmt.Sprintf("%s[%d]", path, i), e); ve != nil {
			return ve
		}
	}
	return nil
}

func decodeString[T ~string](dst *T) func(string, json.RawMessage) *ValidationError {
	return func(path string, raw json.RawMessage) *ValidationError {
		if jsonNull(raw) {
			return nil
		}
		var s string
		if raw[0] != '"' || json.Unmarshal(raw, &s) != nil {
			return verr(ErrMalformed, path, "must be a string, got %s", describeJSON(raw))
		}
		*dst = T(s)
		return nil
	}
}

func decodeBool(dst *bool) func(string, json.RawMessage) *ValidationError {
	return func(path string, raw json.RawMessage) *ValidationError {
		if jsonNull(raw) {
			return nil
		}
		if err := json.Unmarshal(raw, dst); err != nil {
			return verr(ErrMalformed, path, "must be true or false, got %s", describeJSON(raw))
		}
		return nil
	}
}

func decodeOptBool(dst **bool) func(string, json.RawMessage) *ValidationError {
	return func(path string, raw json.RawMessage) *ValidationError {
		if jsonNull(raw) {
			*dst = nil
			return nil
		}
		var b bool
		if e := decodeBool(&b)(path, raw); e != nil {
			return e
		}
		*dst = &b
		return nil
	}
}

// parseJSONInt accepts a JSON number that is an integer in min..max, written
// without fraction or exponent.
func parseJSONInt(path string, raw json.RawMessage, min, max int64) (int64, *ValidationError) {
	n, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil || n < min || n > max {
		return 0, verr(ErrMalformed, path, "must be an integer in %d..%d, got %s", min, max, describeJSON(raw))
	}
	return n, nil
}

func decodeUint[T uint16 | uint32](dst *T, max int64) func(string, json.RawMessage) *ValidationError {
	return func(path string, raw json.RawMessage) *ValidationError {
		if jsonNull(raw) {
			return nil
		}
		n, e := parseJSONInt(path, raw, 0, max)
		if e != nil {
			return e
		}
		*dst = T(n)
		return nil
	}
}

func decodeOptUint32(dst **uint32) func(string, json.RawMessage) *ValidationError {
	return func(path string, raw json.RawMessage) *ValidationError {
		if jsonNull(raw) {
			*dst = nil
			return nil
		}
		var v uint32
		if e := decodeUint(&v, 1<<32-1)(path, raw); e != nil {
			return e
		}
		*dst = &v
		return nil
	}
}

func decodeInt64(dst *int64) func(string, json.RawMessage) *ValidationError {
	return func(path string, raw json.RawMessage) *ValidationError {
		if jsonNull(raw) {
			return nil
		}
		n, e := parseJSONInt(path, raw, -1<<63, 1<<63-1)
		if e != nil {
			return e
		}
		*dst = n
		return nil
	}
}

func decodeAddr(path string, raw json.RawMessage, dst *netip.Addr) *ValidationError {
	if jsonNull(raw) {
		return nil
	}
	var s string
	if raw[0] != '"' || json.Unmarshal(raw, &s) != nil {
		return verr(ErrMalformed, path, "must be an IP address string, got %s", describeJSON(raw))
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return verr(ErrMalformed, path, "%q is not an IP address", s)
	}
	*dst = a
	return nil
}

// describeJSON names the JSON type of raw for an error message, with the
// value itself when it is short.
func describeJSON(raw json.RawMessage) string {
	kind := "the number"
	switch raw[0] {
	case '"':
		kind = "the string"
	case '{':
		return "an object"
	case '[':
		return "an array"
	case 't', 'f':
		kind = "the boolean"
	case 'n':
		return "null"
	}
	if len(raw) <= 32 {
		return kind + " " + string(raw)
	}
	return "a " + kind[len("the "):] + " too long to quote"
}

func decodeService(path string, raw json.RawMessage, s *Service) *ValidationError {
	if jsonNull(raw) {
		return verr(ErrMalformed, path, "must be a JSON object (a service), not null")
	}
	return decodeObject(path, raw, []jsonField{
		{"name", decodeString(&s.Name)},
		{"enabled", decodeOptBool(&s.Enabled)},
		{"exposure", decodeString(&s.Exposure)},
		{"mode", decodeString(&s.Mode)},
		{"vips", func(p string, raw json.RawMessage) *ValidationError {
			s.VIPs = nil
			if !jsonNull(raw) {
				s.VIPs = []netip.Addr{}
			}
			return decodeArray(p, raw, 0, func(p string, raw json.RawMessage) *ValidationError {
				var a netip.Addr
				if e := decodeAddr(p, raw, &a); e != nil {
					return e
				}
				s.VIPs = append(s.VIPs, a)
				return nil
			})
		}},
		{"ports", func(p string, raw json.RawMessage) *ValidationError {
			s.Ports = nil
			if !jsonNull(raw) {
				s.Ports = []ServicePort{}
			}
			return decodeArray(p, raw, MaxPortsPerService, func(p string, raw json.RawMessage) *ValidationError {
				var sp ServicePort
				if jsonNull(raw) {
					return verr(ErrMalformed, p, "must be an object, not null")
				}
				if e := decodeObject(p, raw, []jsonField{
					{"port", decodeUint(&sp.Port, 65535)},
					{"protocol", decodeString(&sp.Protocol)},
				}); e != nil {
					return e
				}
				s.Ports = append(s.Ports, sp)
				return nil
			})
		}},
		{"backends", func(p string, raw json.RawMessage) *ValidationError {
			s.Backends = nil
			if !jsonNull(raw) {
				s.Backends = []Backend{}
			}
			return decodeArray(p, raw, MaxBackendsPerService, func(p string, raw json.RawMessage) *ValidationError {
				var b Backend
				if jsonNull(raw) {
					return verr(ErrMalformed, p, "must be an object, not null")
				}
				if e := decodeObject(p, raw, []jsonField{
					{"address", func(p string, raw json.RawMessage) *ValidationError { return decodeAddr(p, raw, &b.Address) }},
					{"port", decodeUint(&b.Port, 65535)},
					{"weight", decodeOptUint32(&b.Weight)},
					{"enabled", decodeOptBool(&b.Enabled)},
					{"state", decodeString(&b.State)},
					{"drain_until_unix_ms", decodeInt64(&b.DrainUntilUnixMs)},
				}); e != nil {
					return e
				}
				s.Backends = append(s.Backends, b)
				return nil
			})
		}},
		{"health_check", func(p string, raw json.RawMessage) *ValidationError {
			if jsonNull(raw) {
				s.HealthCheck = nil
				return nil
			}
			var h HealthCheck
			if e := decodeObject(p, raw, []jsonField{
				{"kind", decodeString(&h.Kind)},
				{"timeout_ms", decodeUint(&h.TimeoutMs, 1<<32-1)},
				{"interval_ms", decodeUint(&h.IntervalMs, 1<<32-1)},
				{"unhealthy_threshold", decodeUint(&h.UnhealthyThreshold, 1<<32-1)},
				{"healthy_threshold", decodeUint(&h.HealthyThreshold, 1<<32-1)},
			}); e != nil {
				return e
			}
			s.HealthCheck = &h
			return nil
		}},
		{"max_egress_mbps", decodeUint(&s.MaxEgressMbps, 1<<32-1)},
		{"host_routing", decodeBool(&s.HostRouting)},
		{"advertise", decodeBool(&s.Advertise)},
	})
}
