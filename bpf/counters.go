package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// Counter indexes the global per-CPU packet counters (map fluxvm_counters,
// C enum fluxvm_counter). Values are ABI: they are only ever appended.
type Counter uint32

// The counters, tied at compile time to the values bpf2go read from the
// object's BTF.
const (
	CounterIPv4       = Counter(serviceFluxvmCounterFLUXVM_CNT_IPV4)
	CounterIPv6       = Counter(serviceFluxvmCounterFLUXVM_CNT_IPV6)
	CounterTCP        = Counter(serviceFluxvmCounterFLUXVM_CNT_TCP)
	CounterUDP        = Counter(serviceFluxvmCounterFLUXVM_CNT_UDP)
	CounterL4Other    = Counter(serviceFluxvmCounterFLUXVM_CNT_L4OTHER)
	CounterIPv6ExtHdr = Counter(serviceFluxvmCounterFLUXVM_CNT_IPV6EXTHDR)
	CounterFragment   = Counter(serviceFluxvmCounterFLUXVM_CNT_FRAGMENT)
	CounterNonIP      = Counter(serviceFluxvmCounterFLUXVM_CNT_NON_IP)
	CounterTruncated  = Counter(serviceFluxvmCounterFLUXVM_CNT_TRUNCATED)
	CounterMalformed  = Counter(serviceFluxvmCounterFLUXVM_CNT_MALFORMED)
	CounterParseLimit = Counter(serviceFluxvmCounterFLUXVM_CNT_PARSE_LIMIT)
	CounterNATStale   = Counter(serviceFluxvmCounterFLUXVM_CNT_NAT_STALE)
	// CounterHostRouted counts packets host_routing redirected after a
	// FIB hit; CounterHostRouteFallback those it left to the host stack.
	CounterHostRouted        = Counter(serviceFluxvmCounterFLUXVM_CNT_HOST_ROUTED_PACKETS)
	CounterHostRouteFallback = Counter(serviceFluxvmCounterFLUXVM_CNT_HOST_ROUTE_FALLBACKS)
	// CounterSNATRetry counts SNAT port candidates found taken.
	CounterSNATRetry = Counter(serviceFluxvmCounterFLUXVM_CNT_SNAT_RETRIES)
	// CounterDSRForwarded counts packets DSR redirected toward a backend.
	CounterDSRForwarded = Counter(serviceFluxvmCounterFLUXVM_CNT_DSR_FORWARDED)
	// CounterSNATConflicts counts SNAT flows whose port another flow held
	// (after their mapping was evicted) and that were mapped afresh.
	CounterSNATConflicts = Counter(serviceFluxvmCounterFLUXVM_CNT_SNAT_CONFLICTS)
	// CounterICMPErrorsTranslated counts ICMP errors about translated
	// flows whose quoted packet (and, for SNAT, outer destination) was
	// translated back to the client's view.
	CounterICMPErrorsTranslated = Counter(serviceFluxvmCounterFLUXVM_CNT_ICMP_ERRORS_TRANSLATED)
	// CounterXDPTranslated counts VIP packets the XDP object translated
	// (or routed, for DSR) and sent; CounterXDPPassNoRoute those it left
	// to the stack untouched for want of a FIB answer or a resolved
	// neighbour; CounterXDPPassFragment fragments to a VIP it left to TC.
	CounterXDPTranslated   = Counter(serviceFluxvmCounterFLUXVM_CNT_XDP_TRANSLATED)
	CounterXDPPassNoRoute  = Counter(serviceFluxvmCounterFLUXVM_CNT_XDP_PASS_NO_ROUTE)
	CounterXDPPassFragment = Counter(serviceFluxvmCounterFLUXVM_CNT_XDP_PASS_FRAGMENT)
	// CounterXDPPassEgress counts VIP packets XDP left to the stack
	// because their route leaves by an interface not in fluxvm_xdp_tx.
	CounterXDPPassEgress = Counter(serviceFluxvmCounterFLUXVM_CNT_XDP_PASS_EGRESS)
	// CounterSockRewritten counts connects and sends to a VIP that the
	// socket hooks addressed to a backend instead; CounterSockReversed
	// receives and getpeername calls shown the VIP instead of the
	// backend; CounterSockRepicked sockets whose backend could no longer
	// serve them (Unhealthy, removed, drained) and got a new pick.
	CounterSockRewritten = Counter(serviceFluxvmCounterFLUXVM_CNT_SOCK_REWRITTEN)
	CounterSockReversed  = Counter(serviceFluxvmCounterFLUXVM_CNT_SOCK_REVERSED)
	CounterSockRepicked  = Counter(serviceFluxvmCounterFLUXVM_CNT_SOCK_REPICKED)
	// The socket hooks' fail-open reasons: the address is left as the
	// application gave it, and TC serves the VIP (and drops, when the
	// guard is closed). CounterSockOpenNoBackend: no Ready backend of the
	// socket's family; CounterSockOpenMap: the socket maps could not be
	// written.
	CounterSockOpenGuard     = Counter(serviceFluxvmCounterFLUXVM_CNT_SOCK_FAIL_OPEN_GUARD)
	CounterSockOpenNoBackend = Counter(serviceFluxvmCounterFLUXVM_CNT_SOCK_FAIL_OPEN_NO_BACKEND)
	CounterSockOpenMap       = Counter(serviceFluxvmCounterFLUXVM_CNT_SOCK_FAIL_OPEN_MAP)
	// CounterFlowRecorded counts FluxScope records opened (sampled flows
	// and drops); CounterFlowDropLimited drops that found the node's
	// budget of drop records empty and were not recorded.
	CounterFlowRecorded    = Counter(serviceFluxvmCounterFLUXVM_CNT_FLOW_RECORDED)
	CounterFlowDropLimited = Counter(serviceFluxvmCounterFLUXVM_CNT_FLOW_DROP_LIMITED)
	// Identity policy: CounterPolicyAudited counts flows a policy denies
	// that audit_only forwarded; CounterPolicyRechecked packets of
	// established flows decided again (their policy's revision changed);
	// CounterPolicyRevoked those of them denied.
	CounterPolicyAudited   = Counter(serviceFluxvmCounterFLUXVM_CNT_POLICY_AUDITED)
	CounterPolicyRechecked = Counter(serviceFluxvmCounterFLUXVM_CNT_POLICY_RECHECKED)
	CounterPolicyRevoked   = Counter(serviceFluxvmCounterFLUXVM_CNT_POLICY_REVOKED)
	// CounterXDPPassPolicy: a packet to a service with an identity policy,
	// which XDP leaves to TC.
	CounterXDPPassPolicy = Counter(serviceFluxvmCounterFLUXVM_CNT_XDP_PASS_POLICY)
	// CounterSockOpenPolicy: socket load balancing left a connect or send
	// to a service with an identity policy to TC.
	CounterSockOpenPolicy = Counter(serviceFluxvmCounterFLUXVM_CNT_SOCK_FAIL_OPEN_POLICY)
	// CounterL7Redirected counts new flows L7 enforce handed to the proxy
	// interface; CounterL7Bypass packets that came in on the proxy
	// interface to an L7-enforced VIP (the proxy's own, load-balanced as
	// usual). A loop would show as redirected flows beyond the clients'.
	CounterL7Redirected = Counter(serviceFluxvmCounterFLUXVM_CNT_L7REDIRECTED)
	CounterL7Bypass     = Counter(serviceFluxvmCounterFLUXVM_CNT_L7BYPASS)
	// CounterHAEmitted counts records queued in fluxvm_haq (HA
	// replication of north-south flows; east-west flows queue none);
	// CounterXDPPassHA new flows XDP left to TC while HA
	// replication is on (TC queues their records). Records the queue had
	// no room for are in fluxvm_hadrop.
	CounterHAEmitted = Counter(serviceFluxvmCounterFLUXVM_CNT_HA_EMITTED)
	CounterXDPPassHA = Counter(serviceFluxvmCounterFLUXVM_CNT_XDP_PASS_HA)

	// NumCounters is the number of counters (the map's max_entries).
	NumCounters = int(serviceFluxvmCounterFLUXVM_CNT_MAX)
)

var counterNames = [NumCounters]string{
	CounterIPv4:                 "ipv4",
	CounterIPv6:                 "ipv6",
	CounterTCP:                  "tcp",
	CounterUDP:                  "udp",
	CounterL4Other:              "l4_other",
	CounterIPv6ExtHdr:           "ipv6_exthdr",
	CounterFragment:             "fragment",
	CounterNonIP:                "non_ip",
	CounterTruncated:            "truncated",
	CounterMalformed:            "malformed",
	CounterParseLimit:           "parse_limit",
	CounterNATStale:             "nat_stale",
	CounterHostRouted:           "host_routed_packets",
	CounterHostRouteFallback:    "host_route_fallbacks",
	CounterSNATRetry:            "snat_retries",
	CounterDSRForwarded:         "dsr_forwarded",
	CounterSNATConflicts:        "snat_conflicts",
	CounterICMPErrorsTranslated: "icmp_errors_translated",
	CounterXDPTranslated:        "xdp_translated",
	CounterXDPPassNoRoute:       "xdp_pass_no_route",
	CounterXDPPassFragment:      "xdp_pass_fragment",
	CounterXDPPassEgress:        "xdp_pass_egress",
	CounterSockRewritten:        "sock_rewritten",
	CounterSockReversed:         "sock_reversed",
	CounterSockRepicked:         "sock_repicked",
	CounterSockOpenGuard:        "sock_fail_open_guard",
	CounterSockOpenNoBackend:    "sock_fail_open_no_backend",
	CounterSockOpenMap:          "sock_fail_open_map",
	CounterFlowRecorded:         "flow_recorded",
	CounterFlowDropLimited:      "flow_drop_limited",
	CounterPolicyAudited:        "policy_audited",
	CounterPolicyRechecked:      "policy_rechecked",
	CounterPolicyRevoked:        "policy_revoked",
	CounterXDPPassPolicy:        "xdp_pass_policy",
	CounterSockOpenPolicy:       "sock_fail_open_policy",
	CounterL7Redirected:         "l7_redirected",
	CounterL7Bypass:             "l7_bypass",
	CounterHAEmitted:            "ha_emitted",
	CounterXDPPassHA:            "xdp_pass_ha",
}

// String returns the counter's metric-style name, e.g. "truncated".
func (c Counter) String() string {
	if int(c) < NumCounters && counterNames[c] != "" {
		return counterNames[c]
	}
	return fmt.Sprintf("counter(%d)", uint32(c))
}

// Counters holds one total per Counter, summed over CPUs.
type Counters [NumCounters]uint64

// ErrCounterMap reports a map that does not have the layout of the counter
// map it was read as.
var ErrCounterMap = errors.New("not a fluxvm_counters map")

// ReadCounters sums the per-CPU slots of a fluxvm_counters map.
func ReadCounters(m *ebpf.Map) (Counters, error) {
	var out Counters
	if m.Type() != ebpf.PerCPUArray || m.KeySize() != 4 || m.ValueSize() != 8 || int(m.MaxEntries()) != NumCounters {
		return out, fmt.Errorf("bpf: read counters: %w", ErrCounterMap)
	}
	if err := sumPerCPU(m, out[:]); err != nil {
		return out, fmt.Errorf("bpf: read counters: %w", err)
	}
	return out, nil
}

// DropReason indexes the per-CPU drop counters (map fluxvm_drops, C enum
// fluxvm_drop_reason). Values are ABI: they are only ever appended.
type DropReason uint32

// The drop reasons, tied at compile time to the object's BTF.
const (
	DropNoBackend      = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_NO_BACKEND)
	DropBackendInvalid = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_BACKEND_INVALID)
	DropGuardClosed    = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_GUARD_CLOSED)
	DropFragment       = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_FRAGMENT)
	DropCTUpdate       = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_CT_UPDATE)
	DropNATUpdate      = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_NAT_UPDATE)
	DropRewrite        = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_REWRITE)
	// DropSNATFailed: no free SNAT port after the bounded retries, or no
	// SNAT address for the family.
	DropSNATFailed = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_SNAT_FAILED)
	// DropDSRNoRoute: DSR found no route, neighbour or TTL to the backend.
	DropDSRNoRoute = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_DSR_NO_ROUTE)
	// DropEDTHorizon: a paced service's packet whose departure lay beyond
	// the service's horizon while an earlier one was still scheduled.
	DropEDTHorizon = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_EDT_HORIZON)
	// DropPolicyDenied: the service's identity policy denies the source.
	DropPolicyDenied = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_POLICY_DENIED)
	// DropPolicyMissing: the service has a policy (SvcFlagPolicy) that the
	// policy maps lack (not restored after a reload yet): fail closed.
	DropPolicyMissing = DropReason(serviceFluxvmDropReasonFLUXVM_DROP_POLICY_MISSING)

	// NumDropReasons is the size of the drop counter map; index 0 is unused.
	NumDropReasons = int(serviceFluxvmDropReasonFLUXVM_DROP_MAX)
)

var dropNames = [NumDropReasons]string{
	0:                  "none",
	DropNoBackend:      "no_backend",
	DropBackendInvalid: "backend_invalid",
	DropGuardClosed:    "guard_closed",
	DropFragment:       "fragment",
	DropCTUpdate:       "ct_update",
	DropNATUpdate:      "nat_update",
	DropRewrite:        "rewrite",
	DropSNATFailed:     "snat_failed",
	DropDSRNoRoute:     "dsr_no_route",
	DropEDTHorizon:     "edt_horizon",
	DropPolicyDenied:   "policy_denied",
	DropPolicyMissing:  "policy_missing",
}

// String returns the reason's metric-style name, e.g. "no_backend".
func (r DropReason) String() string {
	if int(r) < NumDropReasons && dropNames[r] != "" {
		return dropNames[r]
	}
	return fmt.Sprintf("drop_reason(%d)", uint32(r))
}

// Drops holds one total per DropReason, summed over CPUs.
type Drops [NumDropReasons]uint64

// ReadDrops sums the per-CPU slots of a fluxvm_drops map.
func ReadDrops(m *ebpf.Map) (Drops, error) {
	var out Drops
	if m.Type() != ebpf.PerCPUArray || m.KeySize() != 4 || m.ValueSize() != 8 || int(m.MaxEntries()) != NumDropReasons {
		return out, fmt.Errorf("bpf: read drops: %w", ErrCounterMap)
	}
	if err := sumPerCPU(m, out[:]); err != nil {
		return out, fmt.Errorf("bpf: read drops: %w", err)
	}
	return out, nil
}

// sumPerCPU fills out[i] with the sum over CPUs of the u64 at index i.
func sumPerCPU(m *ebpf.Map, out []uint64) error {
	var perCPU []uint64
	for i := range out {
		if err := m.Lookup(uint32(i), &perCPU); err != nil {
			return fmt.Errorf("index %d: %w", i, err)
		}
		for _, v := range perCPU {
			out[i] += v
		}
	}
	return nil
}
