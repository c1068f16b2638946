package api_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

// TestCollectorMapSizes: each map sized by need has its size, its ceiling
// and the reason of its size in /metrics, and the last grow its durations.
func TestCollectorMapSizes(t *testing.T) {
	dp := newFake()
	dp.status.MapSizes = &fluxvm.MapSizesStatus{
		Maps: []fluxvm.MapSizeStatus{
			{Map: "fluxvm_fct4", MaxEntries: 262144, Ceiling: 262144, Size: fluxvm.SizeFull, Reason: "full: IPv4 frontend of service web", ReasonCode: "ipv4_frontend"},
			{Map: "fluxvm_fct6", MaxEntries: 1024, Ceiling: 262144, Size: fluxvm.SizeToken, Reason: "token: no IPv6 frontend", ReasonCode: "no_ipv6_frontend"},
		},
		LastGrowth: &fluxvm.MapGrowth{Cause: "apply of service web", Maps: []bpf.FlowMapCompaction{{Map: "fluxvm_fct4"}},
			Switch: fluxvm.Duration{Duration: 250 * time.Microsecond}, Duration: fluxvm.Duration{Duration: 800 * time.Millisecond}},
	}
	want := `
# HELP fluxvm_map_ceiling_entries Tier's capacity of each map sized by need: what it grows to.
# TYPE fluxvm_map_ceiling_entries gauge
fluxvm_map_ceiling_entries{map="fluxvm_fct4"} 262144
fluxvm_map_ceiling_entries{map="fluxvm_fct6"} 262144
# HELP fluxvm_map_last_growth_seconds Duration of the last grow of the flow maps since the dataplane opened (the apply of their first user, or map pressure), by part: total or switch (under the dataplane's lock).
# TYPE fluxvm_map_last_growth_seconds gauge
fluxvm_map_last_growth_seconds{part="switch"} 0.00025
fluxvm_map_last_growth_seconds{part="total"} 0.8
# HELP fluxvm_map_max_entries Size of each map sized by need (fluxvm_haq: bytes): a token size while nothing configured can use it, the tier's capacity once it grew (Status.MapSizes).
# TYPE fluxvm_map_max_entries gauge
fluxvm_map_max_entries{map="fluxvm_fct4"} 262144
fluxvm_map_max_entries{map="fluxvm_fct6"} 1024
# HELP fluxvm_map_size_info Why each map sized by need has its size (value 1): size token or full, and the reason as a fixed code (MapSizeStatus.ReasonCode; status has the prose).
# TYPE fluxvm_map_size_info gauge
fluxvm_map_size_info{map="fluxvm_fct4",reason="ipv4_frontend",size="full"} 1
fluxvm_map_size_info{map="fluxvm_fct6",reason="no_ipv6_frontend",size="token"} 1
`
	names := []string{"fluxvm_map_max_entries", "fluxvm_map_ceiling_entries", "fluxvm_map_size_info", "fluxvm_map_last_growth_seconds"}
	if err := testutil.CollectAndCompare(api.NewCollector(dp), strings.NewReader(want), names...); err != nil {
		t.Error(err)
	}
	dp.status.MapSizes = nil
	if n := testutil.CollectAndCount(api.NewCollector(dp), names...); n != 0 {
		t.Errorf("%d series without map sizes", n)
	}
}
