package fluxvm

import (
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/fluxvm/internal/services"
)

// Maps sized by need (docs/operations.md, "Maps sized by need"). The
// tier's object is loaded as the product description says, its capacities
// the ceiling; each map below that nothing in the configuration or the
// catalog can use is loaded at a token size (bpf.Options.Sizes), and the
// flow maps grow to the ceiling, while traffic runs, in the apply of the
// first service that needs them (growFor, before it writes anything).
//
//	map             full when                                   token size
//	fluxvm_fct4     an IPv4 frontend is in the catalog          1,024 entries
//	fluxvm_fct6     an IPv6 frontend is in the catalog          1,024 entries
//	fluxvm_nat4     an IPv4 frontend is north-south in mode
//	                nat (SNAT), or a backend endpoint is listed
//	                by more frontends than fluxvm_be2fe has
//	                slots (their reverse halves are stored)     1,024 entries
//	fluxvm_nat6     the same for IPv6                           1,024 entries
//	fluxvm_sflows   flow_sample_rate is not 0 (Open)            64 slots
//	fluxvm_haq      ha_epoch is set (Open)                      one page
//	fluxvm_sock_*   cgroup_connect is on (Open; bpf.Options.SocketLB)
//
// No map shrinks: one grown stays at the ceiling after its last user
// left, and a restart keeps a pinned map larger than what the catalog
// needs (bpf.Options.Sizes), so a flow it holds is never lost to a
// resize. Shrinking is not done; a tier change moves every map to the new
// tier (to its token size where the new tier's need is token and the
// pinned map held no more).

// Sizing reasons, the prefix of MapSizeStatus.Reason.
const (
	SizeToken = "token"
	SizeFull  = "full"
)

// MapSizeStatus is one map sized by need: its size now, the tier's
// capacity it grows to, and why it has its size.
type MapSizeStatus struct {
	Map string `json:"map"`
	// MaxEntries is the map's size now (fluxvm_haq: bytes).
	MaxEntries uint32 `json:"max_entries"`
	// Ceiling is the tier's capacity (map_tier): what the map grows to.
	Ceiling uint32 `json:"ceiling"`
	// Entries is what a hash map holds now, as the kernel counts it (the
	// figure of Status.Pressure); absent for the ring, the queue, and
	// where the kernel cannot count.
	Entries *int64 `json:"entries,omitempty"`
	// Size is "token" (below the ceiling: nothing configured can use it)
	// or "full" (at the ceiling).
	Size string `json:"size"`
	// Reason says why, e.g. "token: no IPv6 frontend" or "full: IPv6
	// frontend of service web (grown by its apply)".
	Reason string `json:"reason"`
	// ReasonCode is the reason as a fixed code (the reason label of
	// fluxvm_map_size_info): token: no_ipv4_frontend, no_ipv6_frontend,
	// no_reverse_nat, flow_records_off, ha_off, cgroup_connect_off; full:
	// ipv4_frontend, ipv6_frontend, north_south_nat,
	// stored_reverse_halves, flow_records_on, ha_on, cgroup_connect_on,
	// cls_bpf (hooks attached by cls_bpf), catalog_unreadable,
	// grown_by_pressure; kept (a pinned map larger than the need).
	ReasonCode string `json:"reason_code"`
}

// MapGrowth is what the last grow of the flow maps did (an apply that
// brought their first user).
type MapGrowth struct {
	// Cause is what grew them: "apply of service NAME" (its first user
	// arrived) or "map pressure" (a map below its ceiling filled).
	Cause string `json:"cause"`
	// Maps are the grown maps: entries carried over (kept) and caught up
	// (learned by the old programs during the grow); none is dropped.
	Maps []bpf.FlowMapCompaction `json:"maps"`
	// Switch is how long the switch held the dataplane's lock, Duration
	// the whole grow (new maps, copy, program loads, switch, catch-up).
	Switch   Duration  `json:"switch"`
	Duration Duration  `json:"duration"`
	At       time.Time `json:"at"`
}

// sizeNeed is whether a map sized by need must be at its ceiling, and why
// (reason: prose; code: MapSizeStatus.ReasonCode).
type sizeNeed struct {
	full   bool
	reason string
	code   string
}

// sizeReason is why a map has its size now: MapSizeStatus.Reason and
// ReasonCode.
type sizeReason struct {
	text, code string
}

// sizingState is what the dataplane knows of its maps' sizes (under mu).
type sizingState struct {
	// reason of each map's size now (bpf.SizedMaps), from Open or the
	// grow that made it so; nil when Open did not size the maps.
	reason map[string]sizeReason
	// last is the last grow.
	last *MapGrowth
	// viewsStale: a rebind of the flow views after a grow failed, they
	// may write replaced maps; the next apply or pressure round rebinds
	// them (rebindStale).
	viewsStale bool
}

// sizeNeeds computes, from the node's settings and the catalog svcs,
// which maps sized by need must be at their ceiling. ha is whether
// flow-state replication is on.
func sizeNeeds(opts *Options, ha bool, svcs []Service) map[string]sizeNeed {
	out := map[string]sizeNeed{
		"fluxvm_fct4":   {reason: "no IPv4 frontend", code: "no_ipv4_frontend"},
		"fluxvm_fct6":   {reason: "no IPv6 frontend", code: "no_ipv6_frontend"},
		"fluxvm_nat4":   {reason: "no IPv4 frontend is north-south (SNAT) or stores reverse halves", code: "no_reverse_nat"},
		"fluxvm_nat6":   {reason: "no IPv6 frontend is north-south (SNAT) or stores reverse halves", code: "no_reverse_nat"},
		"fluxvm_sflows": {reason: "flow_sample_rate is 0", code: "flow_records_off"},
		"fluxvm_haq":    {reason: "ha_epoch is not set", code: "ha_off"},
	}
	set := func(name, code, why string) {
		if !out[name].full {
			out[name] = sizeNeed{full: true, reason: why, code: code}
		}
	}
	if opts.FlowSampleRate > 0 {
		set("fluxvm_sflows", "flow_records_on", fmt.Sprintf("flow_sample_rate is %d", opts.FlowSampleRate))
	}
	if ha {
		set("fluxvm_haq", "ha_on", "ha_epoch is set")
	}
	fam := func(a netip.Addr) (string, string) {
		if a.Unmap().Is4() {
			return "4", "IPv4"
		}
		return "6", "IPv6"
	}
	feCode := map[string]string{"4": "ipv4_frontend", "6": "ipv6_frontend"}
	// Frontends per backend endpoint: past bpf.Be2feSlots of them, some
	// frontend's flows store reverse halves (be2fe.go). Every frontend
	// listing the endpoint counts, whatever its mode and exposure: a
	// frontend keeps its slot when it stops taking new ones.
	type epKey struct {
		ep    netip.AddrPort
		proto uint8
	}
	lists := map[epKey]map[services.Key]bool{}
	for i := range svcs {
		svc := &svcs[i]
		for _, w := range services.Wanted(svc) {
			f, name := fam(w.Key.VIP)
			set("fluxvm_fct"+f, feCode[f], fmt.Sprintf("%s frontend of service %s", name, svc.Name))
			if svc.IsNorthSouth() && svc.Mode != ModeDSR {
				set("fluxvm_nat"+f, "north_south_nat", fmt.Sprintf("%s frontend of service %s is north-south in mode nat (SNAT)", name, svc.Name))
			}
			for _, b := range w.Backends {
				k := epKey{netip.AddrPortFrom(b.Address.Unmap(), b.Port), w.Key.Proto}
				if lists[k] == nil {
					lists[k] = map[services.Key]bool{}
				}
				lists[k][w.Key] = true
				if len(lists[k]) > bpf.Be2feSlots {
					set("fluxvm_nat"+f, "stored_reverse_halves", fmt.Sprintf("backend %s is listed by more than %d frontends (service %s): their reverse halves are stored",
						k.ep, bpf.Be2feSlots, svc.Name))
				}
			}
		}
	}
	return out
}

// tokenSize is the token size of a map sized by need.
func tokenSize(name string) uint32 {
	switch name {
	case "fluxvm_sflows":
		return bpf.TokenFlowSlots
	case "fluxvm_haq":
		return bpf.TokenHAQueueBytes()
	}
	return bpf.TokenFlowEntries
}

// openSizes returns the sizes Open loads the maps with (bpf.Options.Sizes:
// a token size for each map nothing needs), from the settings and the
// catalog at CatalogPath, and the reasons. With hooks attached by cls_bpf
// (AttachMode cls_bpf, or the automatic mode on a kernel without TCX) a
// map cannot grow while traffic runs: every map is loaded at its ceiling
// then.
func openSizes(opts *Options, ha bool) (bpf.Sizes, map[string]sizeReason) {
	reason := map[string]sizeReason{}
	mode := opts.Loader.AttachMode
	if mode == bpf.AttachClsBPF || mode == "" && !bpf.HaveTCX() {
		why := "attach_mode cls_bpf"
		if mode == "" {
			why = "the kernel has no TCX: hooks attach by cls_bpf"
		}
		for _, name := range bpf.SizedMaps {
			reason[name] = sizeReason{SizeFull + ": " + why + " (its filters cannot be switched to grown maps)", "cls_bpf"}
		}
		return bpf.Sizes{}, reason
	}
	var svcs []Service
	if opts.CatalogPath != "" {
		cat, err := catalog.Read(opts.CatalogPath, opts.Logger)
		if err != nil {
			// The restore reports it; meanwhile nothing is left small.
			for _, name := range bpf.SizedMaps {
				reason[name] = sizeReason{SizeFull + ": the catalog could not be read to size the maps", "catalog_unreadable"}
			}
			return bpf.Sizes{}, reason
		}
		for _, cs := range cat.Services {
			svcs = append(svcs, cs.Service)
		}
	}
	var sizes bpf.Sizes
	for name, n := range sizeNeeds(opts, ha, svcs) {
		if n.full {
			reason[name] = sizeReason{SizeFull + ": " + n.reason, n.code}
			continue
		}
		sizes.Set(name, tokenSize(name))
		reason[name] = sizeReason{SizeToken + ": " + n.reason, n.code}
	}
	return sizes, reason
}

// MapSizesStatus is Status.MapSizes.
type MapSizesStatus struct {
	Maps []MapSizeStatus `json:"maps"`
	// LastGrowth is the last grow since Open, if any.
	LastGrowth *MapGrowth `json:"last_growth,omitempty"`
	// Error says why the sizes could not be read.
	Error string `json:"error,omitempty"`
}

// mapSizesStatus is Status.MapSizes, with the entries of p (nil: none).
// d.mu must be held.
func (d *Dataplane) mapSizesStatus(p *PressureStatus) *MapSizesStatus {
	sizes, err := d.dp.MapSizes()
	if err != nil {
		return &MapSizesStatus{Error: err.Error()}
	}
	out := make([]MapSizeStatus, 0, len(sizes))
	for _, s := range sizes {
		r := d.sizing.reason[s.Map]
		st := MapSizeStatus{Map: s.Map, MaxEntries: s.MaxEntries, Ceiling: s.Ceiling, Size: SizeToken, Reason: r.text, ReasonCode: r.code}
		if s.MaxEntries >= s.Ceiling {
			st.Size = SizeFull
		}
		if mp, ok := pressureEntries(p, s.Map); ok {
			st.Entries = &mp
		}
		switch {
		case s.Map == "fluxvm_sock_fwd" || s.Map == "fluxvm_sock_rev":
			st.Reason, st.ReasonCode = SizeToken+": cgroup_connect is off", "cgroup_connect_off"
			if d.opts.SocketLB.CgroupConnect {
				st.Reason, st.ReasonCode = SizeFull+": cgroup_connect is on", "cgroup_connect_on"
			}
		case strings.HasPrefix(st.Reason, SizeToken+":") && s.MaxEntries > tokenSize(s.Map):
			// A pinned map of an earlier start, larger than the need:
			// kept, as maps do not shrink.
			st.ReasonCode = "kept"
			st.Reason = fmt.Sprintf("kept: the pinned map was this large (maps do not shrink); need: %s", strings.TrimPrefix(st.Reason, SizeToken+": "))
		}
		out = append(out, st)
	}
	return &MapSizesStatus{Maps: out, LastGrowth: d.sizing.last}
}
