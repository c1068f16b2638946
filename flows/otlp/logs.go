package otlp

import (
	"fmt"
	"math"
	"strings"
	"time"

	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	collogs "go.opentelemetry.io/proto/otlp/collector/logs/v1"
	common "go.opentelemetry.io/proto/otlp/common/v1"
	logs "go.opentelemetry.io/proto/otlp/logs/v1"
	resource "go.opentelemetry.io/proto/otlp/resource/v1"

	"github.com/fluxvm/servicefabric/flows"
)

// Names of what the exporter writes. The network.*, source.* and
// destination.* keys are OpenTelemetry's semantic conventions; the rest is
// FluxVM's own, under fluxvm.*.
const (
	// ScopeName is the instrumentation scope of every flow LogRecord.
	ScopeName = "github.com/fluxvm/servicefabric/flows/otlp"
	// EventName is every flow LogRecord's event name.
	EventName = "fluxvm.flow"

	AttrNetworkTransport   = string(semconv.NetworkTransportKey) // "tcp" or "udp"
	AttrNetworkType        = string(semconv.NetworkTypeKey)      // "ipv4" or "ipv6"
	AttrSourceAddress      = string(semconv.SourceAddressKey)    // the client
	AttrSourcePort         = string(semconv.SourcePortKey)
	AttrDestinationAddress = string(semconv.DestinationAddressKey) // the VIP
	AttrDestinationPort    = string(semconv.DestinationPortKey)

	AttrService        = "fluxvm.service"
	AttrServiceID      = "fluxvm.service_id"
	AttrBackendAddress = "fluxvm.backend.address"
	AttrBackendPort    = "fluxvm.backend.port"
	AttrBackendID      = "fluxvm.backend_id"
	AttrSNATAddress    = "fluxvm.snat.address"
	AttrSNATPort       = "fluxvm.snat.port"
	AttrVerdict        = "fluxvm.verdict"
	AttrDropReason     = "fluxvm.drop.reason"
	AttrHook           = "fluxvm.hook"
	AttrInterface      = "fluxvm.interface"
	AttrForwardPackets = "fluxvm.forward.packets"
	AttrForwardBytes   = "fluxvm.forward.bytes"
	AttrReplyPackets   = "fluxvm.reply.packets"
	AttrReplyBytes     = "fluxvm.reply.bytes"
	AttrDrops          = "fluxvm.drops"
	AttrFlowSeq        = "fluxvm.flow.seq"
	AttrFlowFirstSeen  = "fluxvm.flow.first_seen" // unix nanoseconds

	// Resource attributes.
	AttrServiceName = string(semconv.ServiceNameKey) // Config.ServiceName
	AttrHostName    = string(semconv.HostNameKey)    // Config.NodeName
	AttrNode        = "fluxvm.node"                  // Config.NodeName
)

// NewRequest builds the OTLP logs export request for recs: one
// ResourceLogs for the node, one ScopeLogs, one LogRecord per flow, in the
// order of recs. observed is the LogRecords' observedTimeUnixNano.
func NewRequest(recs []flows.Record, serviceName, nodeName string, observed time.Time) *collogs.ExportLogsServiceRequest {
	lrs := make([]*logs.LogRecord, len(recs))
	for i := range recs {
		lrs[i] = LogRecord(&recs[i], observed)
	}
	return &collogs.ExportLogsServiceRequest{
		ResourceLogs: []*logs.ResourceLogs{{
			Resource: &resource.Resource{Attributes: []*common.KeyValue{
				str(AttrServiceName, serviceName),
				str(AttrHostName, nodeName),
				str(AttrNode, nodeName),
			}},
			ScopeLogs: []*logs.ScopeLogs{{
				Scope:      &common.InstrumentationScope{Name: ScopeName},
				LogRecords: lrs,
			}},
			SchemaUrl: semconv.SchemaURL,
		}},
	}
}

// LogRecord is r as one OTLP LogRecord: timeUnixNano is r.LastSeen,
// severity INFO for a flow the datapath let through and WARN for a dropped
// one, the body a one-line summary, the attributes those named Attr*
// (optional ones only when the record has them).
func LogRecord(r *flows.Record, observed time.Time) *logs.LogRecord {
	sev, sevText := logs.SeverityNumber_SEVERITY_NUMBER_INFO, "INFO"
	if r.Verdict == flows.Dropped {
		sev, sevText = logs.SeverityNumber_SEVERITY_NUMBER_WARN, "WARN"
	}
	attrs := make([]*common.KeyValue, 0, 26)
	attrs = append(attrs, str(AttrNetworkTransport, r.Protocol))
	if t := networkType(r); t != "" {
		attrs = append(attrs, str(AttrNetworkType, t))
	}
	if r.Client.IsValid() {
		attrs = append(attrs,
			str(AttrSourceAddress, r.Client.Addr().String()),
			num(AttrSourcePort, uint64(r.Client.Port())))
	}
	if r.VIP.IsValid() {
		attrs = append(attrs,
			str(AttrDestinationAddress, r.VIP.Addr().String()),
			num(AttrDestinationPort, uint64(r.VIP.Port())))
	}
	if r.Service != "" {
		attrs = append(attrs, str(AttrService, r.Service))
	}
	attrs = append(attrs, num(AttrServiceID, uint64(r.ServiceID)))
	if r.Backend.IsValid() {
		attrs = append(attrs,
			str(AttrBackendAddress, r.Backend.Addr().String()),
			num(AttrBackendPort, uint64(r.Backend.Port())))
	}
	if r.BackendID != 0 {
		attrs = append(attrs, num(AttrBackendID, uint64(r.BackendID)))
	}
	if r.SNAT.IsValid() {
		attrs = append(attrs,
			str(AttrSNATAddress, r.SNAT.Addr().String()),
			num(AttrSNATPort, uint64(r.SNAT.Port())))
	}
	attrs = append(attrs, str(AttrVerdict, string(r.Verdict)))
	if r.Reason != "" {
		attrs = append(attrs, str(AttrDropReason, r.Reason))
	}
	attrs = append(attrs, str(AttrHook, r.Hook))
	if r.Interface != "" {
		attrs = append(attrs, str(AttrInterface, r.Interface))
	}
	attrs = append(attrs,
		num(AttrForwardPackets, r.Forward.Packets),
		num(AttrForwardBytes, r.Forward.Bytes),
		num(AttrReplyPackets, r.Reply.Packets),
		num(AttrReplyBytes, r.Reply.Bytes),
		num(AttrDrops, r.Drops),
		num(AttrFlowSeq, r.Seq),
		num(AttrFlowFirstSeen, unixNano(r.FirstSeen)),
	)
	return &logs.LogRecord{
		TimeUnixNano:         unixNano(r.LastSeen),
		ObservedTimeUnixNano: unixNano(observed),
		SeverityNumber:       sev,
		SeverityText:         sevText,
		Body:                 &common.AnyValue{Value: &common.AnyValue_StringValue{StringValue: Summary(r)}},
		Attributes:           attrs,
		EventName:            EventName,
	}
}

// Summary is the one-line human summary a flow LogRecord carries as its
// body, e.g. "tcp 10.0.0.5:41234 -> 10.96.0.10:80 (web) via 10.1.0.7:8080:
// forwarded, 12 pkts/3400 B out, 10 pkts/5600 B back".
func Summary(r *flows.Record) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s -> %s", r.Protocol, addrPort(r.Client), addrPort(r.VIP))
	if r.Service != "" {
		fmt.Fprintf(&b, " (%s)", r.Service)
	}
	if r.Backend.IsValid() {
		fmt.Fprintf(&b, " via %s", r.Backend)
	}
	if r.SNAT.IsValid() {
		fmt.Fprintf(&b, " snat %s", r.SNAT)
	}
	fmt.Fprintf(&b, ": %s", r.Verdict)
	if r.Reason != "" {
		fmt.Fprintf(&b, " (%s)", r.Reason)
	}
	fmt.Fprintf(&b, ", %d pkts/%d B out, %d pkts/%d B back", r.Forward.Packets, r.Forward.Bytes, r.Reply.Packets, r.Reply.Bytes)
	if r.Drops > 0 {
		fmt.Fprintf(&b, ", %d dropped", r.Drops)
	}
	return b.String()
}

func addrPort(ap interface {
	IsValid() bool
	String() string
}) string {
	if !ap.IsValid() {
		return "?"
	}
	return ap.String()
}

func networkType(r *flows.Record) string {
	a := r.Client.Addr()
	if !a.IsValid() {
		a = r.VIP.Addr()
	}
	switch {
	case !a.IsValid():
		return ""
	case a.Is4() || a.Is4In6():
		return "ipv4"
	default:
		return "ipv6"
	}
}

func str(k, v string) *common.KeyValue {
	return &common.KeyValue{Key: k, Value: &common.AnyValue{Value: &common.AnyValue_StringValue{StringValue: v}}}
}

// num is an int attribute (OTLP's intValue is an int64); a uint64 beyond
// math.MaxInt64 (no counter of a flow gets there) is capped.
func num(k string, v uint64) *common.KeyValue {
	return &common.KeyValue{Key: k, Value: &common.AnyValue{Value: &common.AnyValue_IntValue{IntValue: int64(min(v, math.MaxInt64))}}}
}

// unixNano is t in unix nanoseconds, 0 for the zero time ("unknown" in
// OTLP).
func unixNano(t time.Time) uint64 {
	if t.IsZero() || t.Before(time.Unix(0, 0)) {
		return 0
	}
	return uint64(t.UnixNano())
}
