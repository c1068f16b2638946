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

	// NumCounters is the number of counters (the map's max_entries).
	NumCounters = int(serviceFluxvmCounterFLUXVM_CNT_MAX)
)

var counterNames = [NumCounters]string{
	CounterIPv4:       "ipv4",
	CounterIPv6:       "ipv6",
	CounterTCP:        "tcp",
	CounterUDP:        "udp",
	CounterL4Other:    "l4_other",
	CounterIPv6ExtHdr: "ipv6_exthdr",
	CounterFragment:   "fragment",
	CounterNonIP:      "non_ip",
	CounterTruncated:  "truncated",
	CounterMalformed:  "malformed",
	CounterParseLimit: "parse_limit",
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

// ErrCounterMap reports a map that does not have the fluxvm_counters layout.
var ErrCounterMap = errors.New("not a fluxvm_counters map")

// ReadCounters sums the per-CPU slots of a fluxvm_counters map.
func ReadCounters(m *ebpf.Map) (Counters, error) {
	var out Counters
	if m.Type() != ebpf.PerCPUArray || m.KeySize() != 4 || m.ValueSize() != 8 || int(m.MaxEntries()) != NumCounters {
		return out, fmt.Errorf("bpf: read counters: %w", ErrCounterMap)
	}
	var perCPU []uint64
	for i := range out {
		if err := m.Lookup(uint32(i), &perCPU); err != nil {
			return out, fmt.Errorf("bpf: read counter %s: %w", Counter(i), err)
		}
		for _, v := range perCPU {
			out[i] += v
		}
	}
	return out, nil
}
