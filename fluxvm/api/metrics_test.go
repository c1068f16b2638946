package api_test

import (
	"errors"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
	"github.com/fluxvm/servicefabric/health"
)

// withMetricsData fills dp with services, counters and a GC result.
func withMetricsData(dp *fakeDataplane) *fakeDataplane {
	dp.services["web"] = fluxvm.ServiceStatus{Service: fluxvm.Service{Name: "web"}}
	dp.services["dns"] = fluxvm.ServiceStatus{Service: fluxvm.Service{Name: "dns"}}
	dp.stats = fluxvm.Stats{
		Services: map[string]fluxvm.Counters{
			"web": {Packets: 10, Bytes: 1000, ReplyPackets: 8, ReplyBytes: 4000, NewFlows: 3, Failovers: 1, Drops: 2},
			"dns": {Packets: 4, Bytes: 256},
		},
		Drops: map[string]uint64{"no_backend": 2, "guard_closed": 5, "snat_failed": 4, "dsr_no_route": 1, "edt_horizon": 7},
		Parser: map[string]uint64{"ipv4": 100, "truncated": 1, "nat_stale": 0,
			"host_routed_packets": 9, "host_route_fallbacks": 2, "snat_retries": 6, "dsr_forwarded": 11, "snat_conflicts": 3,
			"sock_rewritten": 21, "sock_reversed": 17, "sock_repicked": 2,
			"sock_fail_open_guard": 1, "sock_fail_open_no_backend": 4, "sock_fail_open_map": 0},
		EDT: map[string]fluxvm.ServiceEDTStatus{
			"web": {MaxEgressMbps: 100, RateBytesPerSec: 12_500_000, Horizon: fluxvm.Duration{Duration: 20 * time.Millisecond}, Bytes: 4000, HorizonDrops: 7},
		},
	}
	dp.status.SNAT.Peers = []netip.Addr{netip.MustParseAddr("10.97.0.2"), netip.MustParseAddr("10.97.0.3")}
	dp.status.SNAT.Announced = []netip.Addr{netip.MustParseAddr("10.97.0.3")}
	dp.status.HA = fluxvm.HAStatus{Enabled: true, Group: true, Node: "e1", Joined: true,
		Sources: map[string]map[string]ha.Cursor{"web": {"e2": {Journal: "j2", Seq: 41, Epoch: 3}}}}
	dp.status.EDT = fluxvm.EDTStatus{Enabled: true, Horizon: fluxvm.Duration{Duration: 20 * time.Millisecond},
		Interfaces: []fluxvm.EDTInterfaceStatus{
			{Name: "eth1", Mode: fluxvm.EDTModeFQ, Qdisc: "fq", Managed: true, PreviousQdisc: "mq"},
			{Name: "tap-vm1", Mode: fluxvm.EDTModeHorizonPolicing, Qdisc: "noqueue", Reason: "root qdisc is noqueue, not fq"},
		}}
	dp.status.LastGC = &fluxvm.GCResult{
		At: time.Unix(1767225600, 500_000_000), Duration: 2500 * time.Microsecond,
		Scanned: 40, Expired: 7, Drained: 2, BackendGone: 3, Orphans: 1, Repaired: 0,
	}
	dp.status.Interfaces = []fluxvm.InterfaceStatus{
		{Name: "eth1", Kind: fluxvm.InterfaceNorthSouth, XDP: "native"},
		{Name: "tap-vm1", Kind: fluxvm.InterfaceVMEdge},
	}
	dp.status.XDPRouteCache = fluxvm.XDPRouteCacheStatus{Enabled: true, Invalidations: 5}
	dp.status.Load.Features = []string{"edt"}
	yes := true
	dp.status.SocketLB = fluxvm.SocketLBStatus{
		Enabled: true, CgroupPath: "/sys/fs/cgroup/unified", CgroupID: 1,
		Hooks:   []string{"connect4", "connect6"},
		Destroy: fluxvm.SocketDestroyStatus{Supported: &yes, Runs: 9, LastDestroyed: 1, Destroyed: 3},
	}
	dp.status.Advertisements = fluxvm.AdvertisementStatus{Generation: 12, Advertised: 2, Withdrawn: 1, LastError: "advert: publish: disk full"}
	dp.status.Pressure = &fluxvm.PressureStatus{Maps: map[string]fluxvm.MapPressure{
		"fluxvm_fct4": {Entries: 52429, MaxEntries: 65536, Percent: 80.0},
	}}
	dp.status.Memory = &fluxvm.MemoryStatus{
		Maps:        map[string]uint64{"fluxvm_fct4": 6_291_456, "fluxvm_maglev": 2_368},
		MaglevInner: fluxvm.InnerMapsMemory{Count: 3, Bytes: 393_600, LargestBytes: 131_200},
		Total:       6_291_456 + 2_368 + 393_600,
	}
	dp.health = fluxvm.HealthReport{Services: []fluxvm.ServiceHealth{{
		Name: "web",
		Backends: []fluxvm.BackendHealth{
			{Observed: health.Healthy}, {Observed: health.Healthy}, {Observed: health.Unhealthy},
		},
	}}}
	return dp
}

func TestCollector(t *testing.T) {
	dp := withMetricsData(newFake())
	const want = `
# HELP fluxvm_service_packets_total Packets from clients to the service's frontends.
# TYPE fluxvm_service_packets_total counter
fluxvm_service_packets_total{service="dns"} 4
fluxvm_service_packets_total{service="web"} 10
# HELP fluxvm_service_bytes_total Bytes from clients to the service's frontends.
# TYPE fluxvm_service_bytes_total counter
fluxvm_service_bytes_total{service="dns"} 256
fluxvm_service_bytes_total{service="web"} 1000
# HELP fluxvm_service_reply_packets_total Reply packets from backends, reverse-translated.
# TYPE fluxvm_service_reply_packets_total counter
fluxvm_service_reply_packets_total{service="dns"} 0
fluxvm_service_reply_packets_total{service="web"} 8
# HELP fluxvm_service_reply_bytes_total Reply bytes from backends, reverse-translated.
# TYPE fluxvm_service_reply_bytes_total counter
fluxvm_service_reply_bytes_total{service="dns"} 0
fluxvm_service_reply_bytes_total{service="web"} 4000
# HELP fluxvm_service_new_flows_total Flows that got a backend from Maglev.
# TYPE fluxvm_service_new_flows_total counter
fluxvm_service_new_flows_total{service="dns"} 0
fluxvm_service_new_flows_total{service="web"} 3
# HELP fluxvm_service_failovers_total Established flows moved to another backend.
# TYPE fluxvm_service_failovers_total counter
fluxvm_service_failovers_total{service="dns"} 0
fluxvm_service_failovers_total{service="web"} 1
# HELP fluxvm_service_drops_total Packets to the service that were dropped.
# TYPE fluxvm_service_drops_total counter
fluxvm_service_drops_total{service="dns"} 0
fluxvm_service_drops_total{service="web"} 2
# HELP fluxvm_datapath_drops_total Packets dropped by the datapath, by reason: no_backend, guard_closed, fragment, ..., edt_horizon (a paced service's packet whose departure lay beyond the EDT horizon).
# TYPE fluxvm_datapath_drops_total counter
fluxvm_datapath_drops_total{reason="dsr_no_route"} 1
fluxvm_datapath_drops_total{reason="edt_horizon"} 7
fluxvm_datapath_drops_total{reason="guard_closed"} 5
fluxvm_datapath_drops_total{reason="no_backend"} 2
fluxvm_datapath_drops_total{reason="snat_failed"} 4
# HELP fluxvm_datapath_parser_packets_total Packets seen by the datapath parser, by kind.
# TYPE fluxvm_datapath_parser_packets_total counter
fluxvm_datapath_parser_packets_total{kind="ipv4"} 100
fluxvm_datapath_parser_packets_total{kind="truncated"} 1
# HELP fluxvm_datapath_events_total Datapath events, by name: nat_stale, host_routed_packets, host_route_fallbacks, snat_retries, dsr_forwarded, snat_conflicts, icmp_errors_translated, xdp_translated, xdp_pass_no_route, xdp_pass_fragment, xdp_pass_egress, sock_rewritten, sock_reversed, sock_repicked, sock_fail_open_guard, sock_fail_open_no_backend, sock_fail_open_map.
# TYPE fluxvm_datapath_events_total counter
fluxvm_datapath_events_total{event="dsr_forwarded"} 11
fluxvm_datapath_events_total{event="host_route_fallbacks"} 2
fluxvm_datapath_events_total{event="host_routed_packets"} 9
fluxvm_datapath_events_total{event="nat_stale"} 0
fluxvm_datapath_events_total{event="snat_conflicts"} 3
fluxvm_datapath_events_total{event="snat_retries"} 6
fluxvm_datapath_events_total{event="sock_fail_open_guard"} 1
fluxvm_datapath_events_total{event="sock_fail_open_map"} 0
fluxvm_datapath_events_total{event="sock_fail_open_no_backend"} 4
fluxvm_datapath_events_total{event="sock_repicked"} 2
fluxvm_datapath_events_total{event="sock_reversed"} 17
fluxvm_datapath_events_total{event="sock_rewritten"} 21
# HELP fluxvm_datapath_stats_up 1 when the datapath counters could be read in this scrape, else 0.
# TYPE fluxvm_datapath_stats_up gauge
fluxvm_datapath_stats_up 1
# HELP fluxvm_services Services in the node's catalog.
# TYPE fluxvm_services gauge
fluxvm_services 2
# HELP fluxvm_socket_lb_enabled 1 when socket load balancing (cgroup_connect) is on, else 0.
# TYPE fluxvm_socket_lb_enabled gauge
fluxvm_socket_lb_enabled 1
# HELP fluxvm_socket_lb_hooks Socket hooks attached to the cgroup of socket load balancing (value 1).
# TYPE fluxvm_socket_lb_hooks gauge
fluxvm_socket_lb_hooks{hook="connect4"} 1
fluxvm_socket_lb_hooks{hook="connect6"} 1
# HELP fluxvm_socket_lb_destroyed_sockets_total Connected UDP sockets terminated because their backend was removed, Unhealthy or past its drain deadline, since the dataplane opened.
# TYPE fluxvm_socket_lb_destroyed_sockets_total counter
fluxvm_socket_lb_destroyed_sockets_total 3
# HELP fluxvm_socket_lb_destroy_runs_total Runs of the socket iterator that terminates connected UDP sockets of gone backends, since the dataplane opened.
# TYPE fluxvm_socket_lb_destroy_runs_total counter
fluxvm_socket_lb_destroy_runs_total 9
# HELP fluxvm_socket_lb_destroy_supported 1 when the kernel can terminate sockets from BPF (Linux 6.5+), 0 when it refused; absent before the first run.
# TYPE fluxvm_socket_lb_destroy_supported gauge
fluxvm_socket_lb_destroy_supported 1
# HELP fluxvm_dataplane_info Loaded datapath: BPF schema version, program generation and map tier (value 1).
# TYPE fluxvm_dataplane_info gauge
fluxvm_dataplane_info{map_tier="M",program_generation="8",schema_version="4"} 1
# HELP fluxvm_datapath_feature_loaded Node-level features (ha, flow_records, edt) by whether the loaded programs hold them: 1, or 0 when left out at load (a change takes a restart).
# TYPE fluxvm_datapath_feature_loaded gauge
fluxvm_datapath_feature_loaded{feature="edt"} 1
fluxvm_datapath_feature_loaded{feature="flow_records"} 0
fluxvm_datapath_feature_loaded{feature="ha"} 0
# HELP fluxvm_conntrack_gc_last_run_timestamp_seconds Unix time of the last conntrack GC.
# TYPE fluxvm_conntrack_gc_last_run_timestamp_seconds gauge
fluxvm_conntrack_gc_last_run_timestamp_seconds 1.7672256005e+09
# HELP fluxvm_conntrack_gc_last_duration_seconds Duration of the last conntrack GC.
# TYPE fluxvm_conntrack_gc_last_duration_seconds gauge
fluxvm_conntrack_gc_last_duration_seconds 0.0025
# HELP fluxvm_conntrack_gc_last_entries Entries the last conntrack GC scanned or removed, by result.
# TYPE fluxvm_conntrack_gc_last_entries gauge
fluxvm_conntrack_gc_last_entries{result="backend_gone"} 3
fluxvm_conntrack_gc_last_entries{result="drained"} 2
fluxvm_conntrack_gc_last_entries{result="expired"} 7
fluxvm_conntrack_gc_last_entries{result="orphans_removed"} 1
fluxvm_conntrack_gc_last_entries{result="repaired"} 0
fluxvm_conntrack_gc_last_entries{result="scanned"} 40
# HELP fluxvm_health_backends Backends of services with a health check, by observed health (unknown, healthy, unhealthy).
# TYPE fluxvm_health_backends gauge
fluxvm_health_backends{observed="healthy",service="web"} 2
fluxvm_health_backends{observed="unhealthy",service="web"} 1
fluxvm_health_backends{observed="unknown",service="web"} 0
# HELP fluxvm_advertisement_entries Entries of the current VIP advertisement snapshot, by state (advertised, withdrawn).
# TYPE fluxvm_advertisement_entries gauge
fluxvm_advertisement_entries{state="advertised"} 2
fluxvm_advertisement_entries{state="withdrawn"} 1
# HELP fluxvm_advertisement_generation Generation of the current advertisement snapshot (0 before the first publish).
# TYPE fluxvm_advertisement_generation gauge
fluxvm_advertisement_generation 12
# HELP fluxvm_advertisement_publish_failing 1 while the last publish of the advertisement snapshot failed (the file keeps the previous one), else 0.
# TYPE fluxvm_advertisement_publish_failing gauge
fluxvm_advertisement_publish_failing 1
# HELP fluxvm_map_memory_bytes Kernel memory of each BPF map (its fdinfo memlock); the Maglev tables summed as fluxvm_maglev_inner.
# TYPE fluxvm_map_memory_bytes gauge
fluxvm_map_memory_bytes{map="fluxvm_fct4"} 6.291456e+06
fluxvm_map_memory_bytes{map="fluxvm_maglev"} 2368
fluxvm_map_memory_bytes{map="fluxvm_maglev_inner"} 393600
# HELP fluxvm_maglev_inner_maps Maglev tables (inner maps of fluxvm_maglev) in the datapath.
# TYPE fluxvm_maglev_inner_maps gauge
fluxvm_maglev_inner_maps 3
# HELP fluxvm_map_pressure Fill of each hash map of the datapath, 0 to 1, as the kernel counts its entries (Status.Pressure).
# TYPE fluxvm_map_pressure gauge
fluxvm_map_pressure{map="fluxvm_fct4"} 0.8
# HELP fluxvm_xdp_mode North-south interfaces by the XDP mode in force (native, generic, off): value 1.
# TYPE fluxvm_xdp_mode gauge
fluxvm_xdp_mode{interface="eth1",mode="native"} 1
# HELP fluxvm_xdp_route_cache_enabled 1 while the XDP program reuses its route lookups toward backends (status xdp_route_cache says why not).
# TYPE fluxvm_xdp_route_cache_enabled gauge
fluxvm_xdp_route_cache_enabled 1
# HELP fluxvm_xdp_route_cache_invalidations_total Times the XDP route cache was emptied since the dataplane opened: batches of routing changes heard, turning it on or off, backend ids given back for reuse.
# TYPE fluxvm_xdp_route_cache_invalidations_total counter
fluxvm_xdp_route_cache_invalidations_total 5
# HELP fluxvm_service_edt_rate_bytes EDT pacing rate of a paced service (max_egress_mbps), in bytes per second; the service as a whole (all its frontends: VIPs, ports, protocols) is held to it, on each node by that node's own clock.
# TYPE fluxvm_service_edt_rate_bytes gauge
fluxvm_service_edt_rate_bytes{service="web"} 1.25e+07
# HELP fluxvm_service_edt_horizon_drops_total Packets of a paced service dropped because their departure lay beyond the EDT horizon.
# TYPE fluxvm_service_edt_horizon_drops_total counter
fluxvm_service_edt_horizon_drops_total{service="web"} 7
# HELP fluxvm_edt_enabled 1 when EDT pacing (edt_enabled) is on, else 0.
# TYPE fluxvm_edt_enabled gauge
fluxvm_edt_enabled 1
# HELP fluxvm_edt_horizon_seconds The EDT horizon (edt_horizon): how far ahead a paced packet's departure may lie.
# TYPE fluxvm_edt_horizon_seconds gauge
fluxvm_edt_horizon_seconds 0.02
# HELP fluxvm_edt_interface_mode Interfaces paced packets leave by, by EDT mode (fq: the root qdisc holds packets until their departure; horizon-policing: no fq, the horizon polices the rate): value 1.
# TYPE fluxvm_edt_interface_mode gauge
fluxvm_edt_interface_mode{interface="eth1",mode="fq"} 1
fluxvm_edt_interface_mode{interface="tap-vm1",mode="horizon-policing"} 1
# HELP fluxvm_snat_peers SNAT addresses of the other edges of the node's group it holds (state held), and of them those it took over and announces (state announced).
# TYPE fluxvm_snat_peers gauge
fluxvm_snat_peers{state="announced"} 1
fluxvm_snat_peers{state="held"} 2
# HELP fluxvm_ha_group_joined On an edge of a group (ha_group): 1 once it holds the group's flows and advertises, 0 while it joins.
# TYPE fluxvm_ha_group_joined gauge
fluxvm_ha_group_joined 1
# HELP fluxvm_ha_group_cursor_seq On an edge of a group: the last batch of each source edge's journal of each service it applied.
# TYPE fluxvm_ha_group_cursor_seq gauge
fluxvm_ha_group_cursor_seq{service="web",source="e2"} 41
`
	if err := testutil.CollectAndCompare(api.NewCollector(dp), strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
	// The collector is consistent with its descriptions.
	if problems, err := testutil.CollectAndLint(api.NewCollector(dp)); err != nil || len(problems) != 0 {
		t.Errorf("lint: %v %+v", err, problems)
	}
}

// TestCollectorSocketLB: without cgroup_connect only the enabled gauge
// (0) is served; a kernel that refused to destroy sockets shows 0 in
// fluxvm_socket_lb_destroy_supported.
func TestCollectorSocketLB(t *testing.T) {
	dp := newFake()
	c := api.NewCollector(dp)
	const off = `
# HELP fluxvm_socket_lb_enabled 1 when socket load balancing (cgroup_connect) is on, else 0.
# TYPE fluxvm_socket_lb_enabled gauge
fluxvm_socket_lb_enabled 0
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(off), "fluxvm_socket_lb_enabled"); err != nil {
		t.Error(err)
	}
	for _, name := range []string{"fluxvm_socket_lb_hooks", "fluxvm_socket_lb_destroyed_sockets_total", "fluxvm_socket_lb_destroy_runs_total", "fluxvm_socket_lb_destroy_supported"} {
		if n := testutil.CollectAndCount(c, name); n != 0 {
			t.Errorf("%s: %d series without cgroup_connect", name, n)
		}
	}
	no := false
	dp.status.SocketLB = fluxvm.SocketLBStatus{Enabled: true, Hooks: []string{"connect4"}, Destroy: fluxvm.SocketDestroyStatus{Supported: &no, Runs: 1}}
	const want = `
# HELP fluxvm_socket_lb_destroy_supported 1 when the kernel can terminate sockets from BPF (Linux 6.5+), 0 when it refused; absent before the first run.
# TYPE fluxvm_socket_lb_destroy_supported gauge
fluxvm_socket_lb_destroy_supported 0
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "fluxvm_socket_lb_destroy_supported"); err != nil {
		t.Error(err)
	}
}

func TestCollectorNoGCYet(t *testing.T) {
	dp := newFake()
	if n := testutil.CollectAndCount(api.NewCollector(dp), "fluxvm_conntrack_gc_last_entries"); n != 0 {
		t.Errorf("%d GC series before any GC", n)
	}
}

// TestCollectorMapMemory: the memory series sum to Status.Memory's total
// (the Maglev tables under their own label, never twice), are absent
// without a memory section (after Close), and a failed read is an error
// of the scrape with the other series still served.
func TestCollectorMapMemory(t *testing.T) {
	dp := withMetricsData(newFake())
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(api.NewCollector(dp))
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, f := range families {
		if f.GetName() == "fluxvm_map_memory_bytes" {
			for _, m := range f.GetMetric() {
				sum += m.GetGauge().GetValue()
			}
		}
	}
	if sum != float64(dp.status.Memory.Total) {
		t.Errorf("fluxvm_map_memory_bytes sums to %v, the status total is %d", sum, dp.status.Memory.Total)
	}

	dp.status.Memory = nil
	for _, name := range []string{"fluxvm_map_memory_bytes", "fluxvm_maglev_inner_maps"} {
		if n := testutil.CollectAndCount(api.NewCollector(dp), name); n != 0 {
			t.Errorf("%d %s series without a memory section", n, name)
		}
	}

	dp.status.Memory = &fluxvm.MemoryStatus{Error: "bpf: map memory: fluxvm_fct4: EPERM"}
	if _, err := reg.Gather(); err == nil || !strings.Contains(err.Error(), "fluxvm_fct4: EPERM") {
		t.Errorf("Gather error = %v, want the memory error", err)
	}
	e := newEnv(t)
	withMetricsData(e.dp).status.Memory = dp.status.Memory
	w := e.do(req{method: "GET", path: "/metrics", token: readToken})
	if body := w.Body.String(); w.Code != http.StatusOK || !strings.Contains(body, "fluxvm_services 2") ||
		strings.Contains(body, "fluxvm_map_memory_bytes{") || strings.Contains(body, "fluxvm_maglev_inner_maps ") {
		t.Errorf("/metrics with a memory error: %d\n%s", w.Code, body)
	}
	if !strings.Contains(e.log.String(), "fluxvm_fct4: EPERM") {
		t.Errorf("memory error not logged:\n%s", e.log)
	}
}

func TestCollectorStatsError(t *testing.T) {
	dp := withMetricsData(newFake())
	dp.statsErr = errors.New("read per-cpu map: EPERM")
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(api.NewCollector(dp))
	if _, err := reg.Gather(); err == nil || !strings.Contains(err.Error(), "EPERM") {
		t.Errorf("Gather error = %v, want the stats error", err)
	}
}

func TestMetricsEndpoint(t *testing.T) {
	e := newEnv(t)
	withMetricsData(e.dp)
	w := e.do(req{method: "GET", path: "/metrics", token: readToken})
	if w.Code != http.StatusOK {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	if ct := w.Header().Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Errorf("Content-Type = %q", ct)
	}
	if cc := w.Header().Get("Cache-Control"); cc != "no-store" {
		t.Errorf("Cache-Control = %q", cc)
	}
	body := w.Body.String()
	for _, want := range []string{
		`fluxvm_service_packets_total{service="web"} 10`,
		`fluxvm_service_reply_bytes_total{service="web"} 4000`,
		`fluxvm_service_failovers_total{service="web"} 1`,
		`fluxvm_datapath_drops_total{reason="no_backend"} 2`,
		`fluxvm_datapath_parser_packets_total{kind="truncated"} 1`,
		`fluxvm_datapath_events_total{event="host_routed_packets"} 9`,
		`fluxvm_datapath_events_total{event="host_route_fallbacks"} 2`,
		`fluxvm_datapath_drops_total{reason="snat_failed"} 4`,
		`fluxvm_services 2`,
		`fluxvm_conntrack_gc_last_entries{result="expired"} 7`,
		`fluxvm_datapath_stats_up 1`,
		`fluxvm_map_memory_bytes{map="fluxvm_maglev_inner"} 393600`,
		`fluxvm_maglev_inner_maps 3`,
		`fluxvm_snat_peers{state="held"} 2`,
		`fluxvm_snat_peers{state="announced"} 1`,
		`fluxvm_ha_group_joined 1`,
		`fluxvm_ha_group_cursor_seq{service="web",source="e2"} 41`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}

	// A failing counter read still serves the status series.
	e.dp.statsErr = errors.New("read per-cpu map: EPERM")
	w = e.do(req{method: "GET", path: "/metrics", token: readToken})
	if w.Code != http.StatusOK {
		t.Fatalf("status %d with a stats error", w.Code)
	}
	for _, want := range []string{"fluxvm_services 2", "fluxvm_datapath_stats_up 0"} {
		if !strings.Contains(w.Body.String(), want) {
			t.Errorf("/metrics with a stats error lacks %q:\n%s", want, w.Body)
		}
	}
	if strings.Contains(w.Body.String(), "fluxvm_service_packets_total") {
		t.Error("counters served although Stats failed")
	}
	if !strings.Contains(e.log.String(), "EPERM") {
		t.Errorf("stats error not logged:\n%s", e.log)
	}
}

func TestMetricsRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	extra := prometheus.NewCounter(prometheus.CounterOpts{Name: "embedder_things_total", Help: "Things."})
	reg.MustRegister(extra)
	extra.Add(3)
	e := newEnv(t, func(o *api.Options) { o.Registry = reg })
	w := e.do(req{method: "GET", path: "/metrics", token: adminToken})
	for _, want := range []string{"embedder_things_total 3", "fluxvm_services 0"} {
		if !strings.Contains(w.Body.String(), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// The same registry cannot take a second dataplane collector.
	if _, err := api.New(newFake().roles(), api.Options{AdminTokens: []string{"a"}, Registry: reg}); err == nil {
		t.Error("New registered a second collector in the same registry")
	}
}
