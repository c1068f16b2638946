package api

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm"
)

// MetricsSource is the part of [Observer] the metrics collector reads.
type MetricsSource interface {
	// Status describes the dataplane (schema, tier, interfaces, last GC).
	Status() fluxvm.Status
	// Stats reads the datapath counters.
	Stats(ctx context.Context) (fluxvm.Stats, error)
	// Health reports the observed health of the backends of every
	// service with a health check.
	Health() fluxvm.HealthReport
}

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc("fluxvm_"+name, help, labels, nil)
}

// Metric descriptions. Counters are the datapath's own totals, read at
// scrape time; they restart from zero when the node's maps are rebuilt.
var (
	descPackets      = desc("service_packets_total", "Packets from clients to the service's frontends.", "service")
	descBytes        = desc("service_bytes_total", "Bytes from clients to the service's frontends.", "service")
	descReplyPackets = desc("service_reply_packets_total", "Reply packets from backends, reverse-translated.", "service")
	descReplyBytes   = desc("service_reply_bytes_total", "Reply bytes from backends, reverse-translated.", "service")
	descNewFlows     = desc("service_new_flows_total", "Flows that got a backend from Maglev.", "service")
	descFailovers    = desc("service_failovers_total", "Established flows moved to another backend.", "service")
	descServiceDrops = desc("service_drops_total", "Packets to the service that were dropped.", "service")
	descDrops        = desc("datapath_drops_total", "Packets dropped by the datapath, by reason: no_backend, guard_closed, fragment, ..., edt_horizon (a paced service's packet whose departure lay beyond the EDT horizon).", "reason")
	descParser       = desc("datapath_parser_packets_total", "Packets seen by the datapath parser, by kind.", "kind")
	descEvents       = desc("datapath_events_total", "Datapath events, by name: nat_stale, host_routed_packets, host_route_fallbacks, snat_retries, dsr_forwarded, snat_conflicts, icmp_errors_translated, xdp_translated, xdp_pass_no_route, xdp_pass_fragment, xdp_pass_egress, sock_rewritten, sock_reversed, sock_repicked, sock_fail_open_guard, sock_fail_open_no_backend, sock_fail_open_map.", "event")
	descStatsUp      = desc("datapath_stats_up", "1 when the datapath counters could be read in this scrape, else 0.")
	descServices     = desc("services", "Services in the node's catalog.")
	descInfo         = desc("dataplane_info", "Loaded datapath: BPF schema version, program generation and map tier (value 1).",
		"schema_version", "program_generation", "map_tier")
	descFeature    = desc("datapath_feature_loaded", "Node-level features (ha, flow_records, edt) by whether the loaded programs hold them: 1, or 0 when left out at load (a change takes a restart).", "feature")
	descGCTime     = desc("conntrack_gc_last_run_timestamp_seconds", "Unix time of the last conntrack GC.")
	descGCDuration = desc("conntrack_gc_last_duration_seconds", "Duration of the last conntrack GC.")
	descGCEntries  = desc("conntrack_gc_last_entries", "Entries the last conntrack GC scanned or removed, by result.", "result")

	descHealth      = desc("health_backends", "Backends of services with a health check, by observed health (unknown, healthy, unhealthy).", "service", "observed")
	descAdvertVIPs  = desc("advertisement_entries", "Entries of the current VIP advertisement snapshot, by state (advertised, withdrawn).", "state")
	descAdvertGen   = desc("advertisement_generation", "Generation of the current advertisement snapshot (0 before the first publish).")
	descAdvertError = desc("advertisement_publish_failing", "1 while the last publish of the advertisement snapshot failed (the file keeps the previous one), else 0.")

	descPressure    = desc("map_pressure", "Fill of each hash map of the datapath, 0 to 1, as the kernel counts its entries (Status.Pressure).", "map")
	descMapMemory   = desc("map_memory_bytes", "Kernel memory of each BPF map (its fdinfo memlock); the Maglev tables summed as fluxvm_maglev_inner.", "map")
	descMaglevInner = desc("maglev_inner_maps", "Maglev tables (inner maps of fluxvm_maglev) in the datapath.")
	descXDPMode     = desc("xdp_mode", "North-south interfaces by the XDP mode in force (native, generic, off): value 1.", "interface", "mode")
	descXDPRoutes   = desc("xdp_route_cache_enabled", "1 while the XDP program reuses its route lookups toward backends (status xdp_route_cache says why not).")
	descXDPRouteInv = desc("xdp_route_cache_invalidations_total", "Times the XDP route cache was emptied since the dataplane opened: batches of routing changes heard, turning it on or off, backend ids given back for reuse.")

	descSockEnabled   = desc("socket_lb_enabled", "1 when socket load balancing (cgroup_connect) is on, else 0.")
	descSNATPeers     = desc("snat_peers", "SNAT addresses of the other edges of the node's group it holds (state held), and of them those it took over and announces (state announced).", "state")
	descGroupJoined   = desc("ha_group_joined", "On an edge of a group (ha_group): 1 once it holds the group's flows and advertises, 0 while it joins.")
	descGroupCursor   = desc("ha_group_cursor_seq", "On an edge of a group: the last batch of each source edge's journal of each service it applied.", "service", "source")
	descSockHooks     = desc("socket_lb_hooks", "Socket hooks attached to the cgroup of socket load balancing (value 1).", "hook")
	descSockDestroyed = desc("socket_lb_destroyed_sockets_total", "Connected UDP sockets terminated because their backend was removed, Unhealthy or past its drain deadline, since the dataplane opened.")
	descSockRuns      = desc("socket_lb_destroy_runs_total", "Runs of the socket iterator that terminates connected UDP sockets of gone backends, since the dataplane opened.")
	descEDTRate       = desc("service_edt_rate_bytes", "EDT pacing rate of a paced service (max_egress_mbps), in bytes per second; the service as a whole (all its frontends: VIPs, ports, protocols) is held to it, on each node by that node's own clock.", "service")
	descEDTDrops      = desc("service_edt_horizon_drops_total", "Packets of a paced service dropped because their departure lay beyond the EDT horizon.", "service")
	descEDTEnabled    = desc("edt_enabled", "1 when EDT pacing (edt_enabled) is on, else 0.")
	descEDTHorizon    = desc("edt_horizon_seconds", "The EDT horizon (edt_horizon): how far ahead a paced packet's departure may lie.")
	descEDTMode       = desc("edt_interface_mode", "Interfaces paced packets leave by, by EDT mode (fq: the root qdisc holds packets until their departure; horizon-policing: no fq, the horizon polices the rate): value 1.", "interface", "mode")
	descSockSupported = desc("socket_lb_destroy_supported", "1 when the kernel can terminate sockets from BPF (Linux 6.5+), 0 when it refused; absent before the first run.")
)

// MaglevInnerMapLabel is the map label under which fluxvm_map_memory_bytes
// sums the Maglev tables, the inner maps of fluxvm_maglev.
const MaglevInnerMapLabel = "fluxvm_maglev_inner"

// collector exports the dataplane's counters and status.
type collector struct{ src MetricsSource }

// NewCollector returns a Prometheus collector that reads src's Stats and
// Status at every scrape (no background goroutine). New registers one in
// the registry /metrics serves; embedders that serve their own /metrics can
// register one themselves. It exports:
//
//	fluxvm_service_packets_total, fluxvm_service_bytes_total,
//	fluxvm_service_reply_packets_total, fluxvm_service_reply_bytes_total,
//	fluxvm_service_new_flows_total, fluxvm_service_failovers_total,
//	fluxvm_service_drops_total                  counters {service}
//	fluxvm_datapath_drops_total                 counter {reason: no_backend, ..., edt_horizon}
//	fluxvm_service_edt_rate_bytes               gauge {service}: pacing rate of a paced service, bytes/s
//	fluxvm_service_edt_horizon_drops_total      counter {service}: packets dropped beyond the EDT horizon
//	fluxvm_edt_enabled                          gauge: 1 when edt_enabled is on
//	fluxvm_datapath_feature_loaded              gauge {feature: ha, flow_records, edt}: 1 loaded, 0 left out
//	fluxvm_edt_horizon_seconds                  gauge: edt_horizon
//	fluxvm_edt_interface_mode                   gauge 1 {interface, mode: fq, horizon-policing}
//	fluxvm_datapath_parser_packets_total        counter {kind}
//	fluxvm_datapath_events_total                counter {event: nat_stale, host_routed_packets,
//	                                            host_route_fallbacks, snat_retries, dsr_forwarded,
//	                                            snat_conflicts, icmp_errors_translated, xdp_translated,
//	                                            xdp_pass_no_route, xdp_pass_fragment, xdp_pass_egress,
//	                                            sock_rewritten, sock_reversed, sock_repicked,
//	                                            sock_fail_open_guard, sock_fail_open_no_backend,
//	                                            sock_fail_open_map}
//	fluxvm_xdp_mode                             gauge 1 {interface, mode}: north-south XDP mode in force
//	fluxvm_xdp_route_cache_enabled              gauge: 1 while XDP reuses its route lookups
//	fluxvm_xdp_route_cache_invalidations_total  counter: times the route cache was emptied
//	fluxvm_snat_peers                           gauge {state: held, announced}: the group's other SNAT addresses
//	fluxvm_ha_group_joined                      gauge: on a group edge, 1 once joined (advertising)
//	fluxvm_ha_group_cursor_seq                  gauge {service, source}: on a group edge, the last batch applied
//	fluxvm_socket_lb_enabled                    gauge: 1 when cgroup_connect is on
//	fluxvm_socket_lb_hooks                      gauge 1 {hook}: socket hooks attached
//	fluxvm_socket_lb_destroyed_sockets_total    counter: connected UDP sockets of gone backends terminated
//	fluxvm_socket_lb_destroy_runs_total         counter: runs of the socket iterator
//	fluxvm_socket_lb_destroy_supported          gauge: 1 when the kernel can terminate sockets, 0 if not
//	fluxvm_datapath_stats_up                    gauge: 1 when the counters could be read
//	fluxvm_services                             gauge: services in the catalog
//	fluxvm_dataplane_info                       gauge 1 {schema_version, program_generation, map_tier}
//	fluxvm_conntrack_gc_last_run_timestamp_seconds, fluxvm_conntrack_gc_last_duration_seconds  gauges
//	fluxvm_conntrack_gc_last_entries            gauge {result: scanned, expired, drained, backend_gone,
//	                                            orphans_removed, repaired}
//	fluxvm_health_backends                      gauge {service, observed: unknown, healthy, unhealthy}
//	fluxvm_advertisement_entries                gauge {state: advertised, withdrawn}
//	fluxvm_advertisement_generation             gauge
//	fluxvm_advertisement_publish_failing        gauge: 1 while publishing fails
//	fluxvm_map_memory_bytes                     gauge {map}: kernel memory of each BPF map (Status.Memory);
//	                                            the Maglev tables summed under map="fluxvm_maglev_inner"
//	fluxvm_maglev_inner_maps                    gauge: Maglev tables in the datapath
//	fluxvm_map_pressure                         gauge {map}: fill of each hash map, 0..1 (Status.Pressure)
//	fluxvm_map_max_entries                      gauge {map}: size now of each map sized by need (Status.MapSizes)
//	fluxvm_map_ceiling_entries                  gauge {map}: the tier's capacity it grows to
//	fluxvm_map_size_info                        gauge 1 {map, size: token, full, reason: a fixed code
//	                                            (MapSizeStatus.ReasonCode: no_ipv6_frontend, north_south_nat,
//	                                            stored_reverse_halves, kept, grown_by_pressure, ...)}
//	fluxvm_map_last_growth_seconds              gauge {part: total, switch}: the last grow of the flow maps
//
// The GC series appear once the dataplane has run a GC. When Stats fails,
// the status series are still served, fluxvm_datapath_stats_up is 0 and
// the error goes to the handler's log. When the map memory cannot be read
// (Status.Memory.Error), its two series are missing from the scrape and
// the error goes to the handler's log.
func NewCollector(src MetricsSource) prometheus.Collector { return collector{src: src} }

// Describe implements prometheus.Collector.
func (collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		descPackets, descBytes, descReplyPackets, descReplyBytes, descNewFlows, descFailovers,
		descServiceDrops, descDrops, descParser, descEvents, descStatsUp, descServices, descInfo, descFeature,
		descGCTime, descGCDuration, descGCEntries, descHealth, descAdvertVIPs, descAdvertGen, descAdvertError,
		descMapMemory, descMaglevInner, descPressure, descXDPMode, descXDPRoutes, descXDPRouteInv,
		descSockEnabled, descSockHooks, descSockDestroyed, descSockRuns, descSockSupported,
		descEDTRate, descEDTDrops, descEDTEnabled, descEDTHorizon, descEDTMode,
		descSNATPeers, descGroupJoined, descGroupCursor,
	} {
		ch <- d
	}
	for _, d := range sizingDescs {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	emit := func(d *prometheus.Desc, t prometheus.ValueType, v float64, labels ...string) {
		m, err := prometheus.NewConstMetric(d, t, v, labels...)
		if err != nil {
			m = prometheus.NewInvalidMetric(d, fmt.Errorf("fluxvm metrics: %w", err))
		}
		ch <- m
	}

	st := c.src.Status()
	emit(descServices, prometheus.GaugeValue, float64(st.Services))
	for _, i := range st.Interfaces {
		if i.Kind == fluxvm.InterfaceNorthSouth && i.XDP != "" {
			emit(descXDPMode, prometheus.GaugeValue, 1, i.Name, i.XDP)
		}
	}
	rc := st.XDPRouteCache
	enabled := 0.0
	if rc.Enabled {
		enabled = 1
	}
	emit(descXDPRoutes, prometheus.GaugeValue, enabled)
	emit(descXDPRouteInv, prometheus.CounterValue, float64(rc.Invalidations))
	emit(descSNATPeers, prometheus.GaugeValue, float64(len(st.SNAT.Peers)), "held")
	emit(descSNATPeers, prometheus.GaugeValue, float64(len(st.SNAT.Announced)), "announced")
	if st.HA.Group {
		emit(descGroupJoined, prometheus.GaugeValue, b2f(st.HA.Joined))
		for svc, srcs := range st.HA.Sources {
			for src, c := range srcs {
				emit(descGroupCursor, prometheus.GaugeValue, float64(c.Seq), svc, src)
			}
		}
	}
	sock := st.SocketLB
	emit(descSockEnabled, prometheus.GaugeValue, b2f(sock.Enabled))
	for _, h := range sock.Hooks {
		emit(descSockHooks, prometheus.GaugeValue, 1, h)
	}
	if sock.Enabled {
		emit(descSockDestroyed, prometheus.CounterValue, float64(sock.Destroy.Destroyed))
		emit(descSockRuns, prometheus.CounterValue, float64(sock.Destroy.Runs))
		if s := sock.Destroy.Supported; s != nil {
			emit(descSockSupported, prometheus.GaugeValue, b2f(*s))
		}
	}
	emit(descEDTEnabled, prometheus.GaugeValue, b2f(st.EDT.Enabled))
	if st.EDT.Enabled {
		emit(descEDTHorizon, prometheus.GaugeValue, st.EDT.Horizon.Seconds())
		for _, i := range st.EDT.Interfaces {
			emit(descEDTMode, prometheus.GaugeValue, 1, i.Name, i.Mode)
		}
	}
	emit(descInfo, prometheus.GaugeValue, 1,
		strconv.FormatUint(uint64(st.SchemaVersion), 10), strconv.FormatUint(uint64(st.Generation), 10), st.Tier)
	if st.Load.Features != nil { // nil: not opened
		for _, f := range bpf.AllFeatures.Names() {
			emit(descFeature, prometheus.GaugeValue, b2f(slices.Contains(st.Load.Features, f)), f)
		}
	}
	if gc := st.LastGC; gc != nil {
		emit(descGCTime, prometheus.GaugeValue, float64(gc.At.UnixNano())/1e9)
		emit(descGCDuration, prometheus.GaugeValue, gc.Duration.Seconds())
		for _, e := range []struct {
			result string
			n      int
		}{
			{"scanned", gc.Scanned}, {"expired", gc.Expired}, {"drained", gc.Drained},
			{"backend_gone", gc.BackendGone}, {"orphans_removed", gc.Orphans}, {"repaired", gc.Repaired},
		} {
			emit(descGCEntries, prometheus.GaugeValue, float64(e.n), e.result)
		}
	}

	adv := st.Advertisements
	emit(descAdvertVIPs, prometheus.GaugeValue, float64(adv.Advertised), "advertised")
	emit(descAdvertVIPs, prometheus.GaugeValue, float64(adv.Withdrawn), "withdrawn")
	emit(descAdvertGen, prometheus.GaugeValue, float64(adv.Generation))
	failing := 0.0
	if adv.LastError != "" {
		failing = 1
	}
	emit(descAdvertError, prometheus.GaugeValue, failing)
	if mem := st.Memory; mem != nil {
		if mem.Error != "" {
			ch <- prometheus.NewInvalidMetric(descMapMemory, fmt.Errorf("fluxvm metrics: map memory: %s", mem.Error))
		} else {
			for name, b := range mem.Maps {
				emit(descMapMemory, prometheus.GaugeValue, float64(b), name)
			}
			emit(descMapMemory, prometheus.GaugeValue, float64(mem.MaglevInner.Bytes), MaglevInnerMapLabel)
			emit(descMaglevInner, prometheus.GaugeValue, float64(mem.MaglevInner.Count))
		}
	}
	collectMapSizes(ch, st.MapSizes, emit)
	if p := st.Pressure; p != nil && !p.Unsupported {
		if p.Error != "" {
			ch <- prometheus.NewInvalidMetric(descPressure, fmt.Errorf("fluxvm metrics: map pressure: %s", p.Error))
		} else {
			for name, m := range p.Maps {
				emit(descPressure, prometheus.GaugeValue, m.Percent/100, name)
			}
		}
	}
	for _, sh := range c.src.Health().Services {
		n := map[string]int{"unknown": 0, "healthy": 0, "unhealthy": 0}
		for _, b := range sh.Backends {
			n[string(b.Observed)]++
		}
		for state, k := range n {
			emit(descHealth, prometheus.GaugeValue, float64(k), sh.Name, state)
		}
	}

	// A scrape has no context of its own (prometheus.Collector).
	stats, err := c.src.Stats(context.Background())
	if err != nil {
		emit(descStatsUp, prometheus.GaugeValue, 0)
		ch <- prometheus.NewInvalidMetric(descPackets, fmt.Errorf("fluxvm metrics: read stats: %w", err))
		return
	}
	emit(descStatsUp, prometheus.GaugeValue, 1)
	for name, s := range stats.Services {
		for _, e := range []struct {
			d *prometheus.Desc
			v uint64
		}{
			{descPackets, s.Packets}, {descBytes, s.Bytes}, {descReplyPackets, s.ReplyPackets},
			{descReplyBytes, s.ReplyBytes}, {descNewFlows, s.NewFlows}, {descFailovers, s.Failovers},
			{descServiceDrops, s.Drops},
		} {
			emit(e.d, prometheus.CounterValue, float64(e.v), name)
		}
	}
	for name, e := range stats.EDT {
		emit(descEDTRate, prometheus.GaugeValue, float64(e.RateBytesPerSec), name)
		emit(descEDTDrops, prometheus.CounterValue, float64(e.HorizonDrops), name)
	}
	for reason, n := range stats.Drops {
		emit(descDrops, prometheus.CounterValue, float64(n), reason)
	}
	for kind, n := range stats.Parser {
		if fluxvm.IsEventCounter(kind) {
			emit(descEvents, prometheus.CounterValue, float64(n), kind)
		} else {
			emit(descParser, prometheus.CounterValue, float64(n), kind)
		}
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// newMetricsHandler serves reg in the Prometheus exposition formats. A
// collector error is logged and the remaining series are still served
// (fluxvm_datapath_stats_up tells a failed counter read apart).
func newMetricsHandler(reg *prometheus.Registry, log *slog.Logger) http.Handler {
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:      promLogger{log},
		ErrorHandling: promhttp.ContinueOnError,
	})
}

// promLogger adapts slog to promhttp.Logger.
type promLogger struct{ log *slog.Logger }

func (l promLogger) Println(v ...any) { l.log.Error("api: metrics: " + fmt.Sprint(v...)) }
