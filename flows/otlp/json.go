package otlp

import (
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"math"
	"strconv"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// MarshalJSON encodes an OTLP message (an export request, or any message of
// the OTLP protos) as OTLP/JSON, the JSON Protobuf Encoding of the OTLP
// specification. It differs from protojson's defaults where the
// specification does:
//
//   - trace_id, span_id and parent_span_id are lowercase hex strings, not
//     base64 (other bytes fields, such as an AnyValue's bytesValue, stay
//     base64 as the proto3 JSON mapping says);
//   - enum values are integers (severityNumber: 9), never their names;
//   - keys are the fields' lowerCamelCase JSON names (timeUnixNano).
//
// 64-bit integers are decimal strings ("1700000000000000000"), as the
// proto3 JSON mapping writes them and every OTLP/JSON receiver accepts.
// Fields that hold their zero value are left out, so a record without ids
// carries no traceId at all. Maps and the well-known wrapper types do not
// occur in OTLP and are rejected.
func MarshalJSON(m proto.Message) ([]byte, error) {
	var e jsonEncoder
	if err := e.message(m.ProtoReflect()); err != nil {
		return nil, err
	}
	return e.buf, nil
}

type jsonEncoder struct{ buf []byte }

// hexBytesFields are the bytes fields OTLP/JSON writes as hex.
var hexBytesFields = map[protoreflect.Name]bool{
	"trace_id":       true,
	"span_id":        true,
	"parent_span_id": true,
}

func (e *jsonEncoder) message(m protoreflect.Message) error {
	e.buf = append(e.buf, '{')
	first := true
	var err error
	// Range visits populated fields only (proto3 zero values are not
	// populated); sort them by number so the output is stable.
	fields := make([]protoreflect.FieldDescriptor, 0, 16)
	m.Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
		fields = append(fields, fd)
		return true
	})
	sortFields(fields)
	for _, fd := range fields {
		if !first {
			e.buf = append(e.buf, ',')
		}
		first = false
		e.buf = appendString(e.buf, fd.JSONName())
		e.buf = append(e.buf, ':')
		v := m.Get(fd)
		switch {
		case fd.IsMap():
			return fmt.Errorf("otlp json: map field %s is not part of OTLP", fd.FullName())
		case fd.IsList():
			l := v.List()
			e.buf = append(e.buf, '[')
			for i := 0; i < l.Len(); i++ {
				if i > 0 {
					e.buf = append(e.buf, ',')
				}
				if err = e.value(fd, l.Get(i)); err != nil {
					return err
				}
			}
			e.buf = append(e.buf, ']')
		default:
			if err = e.value(fd, v); err != nil {
				return err
			}
		}
	}
	e.buf = append(e.buf, '}')
	return nil
}

func sortFields(fs []protoreflect.FieldDescriptor) {
	for i := 1; i < len(fs); i++ {
		for j := i; j > 0 && fs[j].Number() < fs[j-1].Number(); j-- {
			fs[j], fs[j-1] = fs[j-1], fs[j]
		}
	}
}

func (e *jsonEncoder) value(fd protoreflect.FieldDescriptor, v protoreflect.Value) error {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		e.buf = strconv.AppendBool(e.buf, v.Bool())
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		e.buf = strconv.AppendInt(e.buf, v.Int(), 10)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		e.buf = strconv.AppendUint(e.buf, v.Uint(), 10)
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		e.buf = append(e.buf, '"')
		e.buf = strconv.AppendInt(e.buf, v.Int(), 10)
		e.buf = append(e.buf, '"')
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		e.buf = append(e.buf, '"')
		e.buf = strconv.AppendUint(e.buf, v.Uint(), 10)
		e.buf = append(e.buf, '"')
	case protoreflect.FloatKind:
		e.float(v.Float(), 32)
	case protoreflect.DoubleKind:
		e.float(v.Float(), 64)
	case protoreflect.StringKind:
		e.buf = appendString(e.buf, v.String())
	case protoreflect.BytesKind:
		if hexBytesFields[fd.Name()] {
			e.buf = append(e.buf, '"')
			e.buf = hex.AppendEncode(e.buf, v.Bytes())
			e.buf = append(e.buf, '"')
		} else {
			e.buf = append(e.buf, '"')
			e.buf = base64.StdEncoding.AppendEncode(e.buf, v.Bytes())
			e.buf = append(e.buf, '"')
		}
	case protoreflect.EnumKind:
		e.buf = strconv.AppendInt(e.buf, int64(v.Enum()), 10)
	case protoreflect.MessageKind, protoreflect.GroupKind:
		if fd.Message().FullName().Parent() == "google.protobuf" {
			return fmt.Errorf("otlp json: well-known type %s is not part of OTLP", fd.Message().FullName())
		}
		return e.message(v.Message())
	default:
		return fmt.Errorf("otlp json: field %s has unsupported kind %v", fd.FullName(), fd.Kind())
	}
	return nil
}

// float writes a float the way the proto3 JSON mapping does: a number, or
// the strings "NaN", "Infinity" and "-Infinity".
func (e *jsonEncoder) float(f float64, bits int) {
	switch {
	case math.IsNaN(f):
		e.buf = append(e.buf, `"NaN"`...)
	case math.IsInf(f, 1):
		e.buf = append(e.buf, `"Infinity"`...)
	case math.IsInf(f, -1):
		e.buf = append(e.buf, `"-Infinity"`...)
	default:
		e.buf = strconv.AppendFloat(e.buf, f, 'g', -1, bits)
	}
}

// appendString appends s as a JSON string. Invalid UTF-8 (which a valid
// proto string never holds) becomes U+FFFD.
func appendString(b []byte, s string) []byte {
	const hexDigits = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b = append(b, '\\', c)
			case c == '\n':
				b = append(b, '\\', 'n')
			case c == '\r':
				b = append(b, '\\', 'r')
			case c == '\t':
				b = append(b, '\\', 't')
			case c < 0x20 || c == 0x7f:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			default:
				b = append(b, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			b = append(b, `\ufffd`...)
		case r == '\u2028' || r == '\u2029':
			// Valid JSON, but not valid JavaScript: escape them.
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
		default:
			b = append(b, s[i:i+size]...)
		}
		i += size
	}
	return append(b, '"')
}
