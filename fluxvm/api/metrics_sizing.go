package api

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/fluxvm/servicefabric/fluxvm"
)

// The maps sized by need (Status.MapSizes).
var (
	descMapMaxEntries = desc("map_max_entries", "Size of each map sized by need (fluxvm_haq: bytes): a token size while nothing configured can use it, the tier's capacity once it grew (Status.MapSizes).", "map")
	descMapCeiling    = desc("map_ceiling_entries", "Tier's capacity of each map sized by need: what it grows to.", "map")
	descMapSize       = desc("map_size_info", "Why each map sized by need has its size (value 1): size token or full, and the reason as a fixed code (MapSizeStatus.ReasonCode; status has the prose).", "map", "size", "reason")
	descMapGrowths    = desc("map_last_growth_seconds", "Duration of the last grow of the flow maps since the dataplane opened (the apply of their first user, or map pressure), by part: total or switch (under the dataplane's lock).", "part")

	sizingDescs = []*prometheus.Desc{descMapMaxEntries, descMapCeiling, descMapSize, descMapGrowths}
)

// collectMapSizes emits the metrics of st.MapSizes.
func collectMapSizes(ch chan<- prometheus.Metric, st *fluxvm.MapSizesStatus,
	emit func(*prometheus.Desc, prometheus.ValueType, float64, ...string)) {
	if st == nil {
		return
	}
	if st.Error != "" {
		ch <- prometheus.NewInvalidMetric(descMapMaxEntries, fmt.Errorf("fluxvm metrics: map sizes: %s", st.Error))
		return
	}
	for _, m := range st.Maps {
		emit(descMapMaxEntries, prometheus.GaugeValue, float64(m.MaxEntries), m.Map)
		emit(descMapCeiling, prometheus.GaugeValue, float64(m.Ceiling), m.Map)
		emit(descMapSize, prometheus.GaugeValue, 1, m.Map, m.Size, m.ReasonCode)
	}
	if g := st.LastGrowth; g != nil {
		emit(descMapGrowths, prometheus.GaugeValue, g.Duration.Seconds(), "total")
		emit(descMapGrowths, prometheus.GaugeValue, g.Switch.Seconds(), "switch")
	}
}
