package otlp

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"strings"
	"testing"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/fluxvm/servicefabric/flows/otlp/otlptest"
)

// The daemon's spans reach /v1/traces in the configured encoding, with the
// flow logs' resource; OTLP/JSON ids are hex there too.
func TestNewTracerProvider(t *testing.T) {
	for _, enc := range []Encoding{EncodingProtobuf, EncodingJSON} {
		t.Run(string(enc), func(t *testing.T) {
			rc := newReceiver(t, nil)
			tp, err := NewTracerProvider(context.Background(), testConfig(rc.URL, enc))
			if err != nil {
				t.Fatal(err)
			}
			_, span := tp.Tracer("fluxvmd").Start(context.Background(), "reconcile")
			span.End()
			if err := tp.Shutdown(context.Background()); err != nil {
				t.Fatal(err)
			}
			got := rc.requests()
			if len(got) != 1 || got[0].path != "/v1/traces" {
				t.Fatalf("requests %+v", got)
			}
			sc := span.SpanContext()
			switch enc {
			case EncodingProtobuf:
				if got[0].ctype != "application/x-protobuf" {
					t.Errorf("content type %q", got[0].ctype)
				}
				var req coltrace.ExportTraceServiceRequest
				if err := proto.Unmarshal(got[0].body, &req); err != nil {
					t.Fatal(err)
				}
				rs := req.ResourceSpans[0]
				otlptest.CheckAttributes(t, "resource", attrMap(t, rs.Resource.Attributes), map[string]any{
					"service.name": "fluxvmd-test", "host.name": "node-a", "fluxvm.node": "node-a",
				})
				s := rs.ScopeSpans[0].Spans[0]
				if s.Name != "reconcile" || hex.EncodeToString(s.TraceId) != sc.TraceID().String() {
					t.Errorf("span %v", s)
				}
			case EncodingJSON:
				if got[0].ctype != "application/json" || !json.Valid(got[0].body) {
					t.Errorf("content type %q, body %s", got[0].ctype, got[0].body)
				}
				raw := string(got[0].body)
				for _, want := range []string{`"name":"reconcile"`, `"stringValue":"node-a"`} {
					if !strings.Contains(raw, want) {
						t.Errorf("body lacks %s: %s", want, raw)
					}
				}
				// The specification's hex is case-insensitive;
				// otlptracehttp writes capitals.
				var doc struct {
					ResourceSpans []struct {
						ScopeSpans []struct {
							Spans []struct{ TraceID, SpanID string }
						}
					}
				}
				if err := json.Unmarshal(got[0].body, &doc); err != nil {
					t.Fatal(err)
				}
				s := doc.ResourceSpans[0].ScopeSpans[0].Spans[0]
				if !strings.EqualFold(s.TraceID, sc.TraceID().String()) || !strings.EqualFold(s.SpanID, sc.SpanID().String()) {
					t.Errorf("ids %s %s, want hex %s %s", s.TraceID, s.SpanID, sc.TraceID(), sc.SpanID())
				}
			}
		})
	}
}
