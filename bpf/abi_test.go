package bpf

import (
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// TestCounterABI checks the Go Counter names against the enum in the
// object's BTF, so a counter added in C without its Go name (or renumbered)
// fails here rather than being misreported.
func TestCounterABI(t *testing.T) {
	spec, err := loadService()
	if err != nil {
		t.Fatal(err)
	}
	var enum *btf.Enum
	if err := spec.Types.TypeByName("fluxvm_counter", &enum); err != nil {
		t.Fatalf("fluxvm_counter not in BTF: %v", err)
	}
	seen := 0
	for _, v := range enum.Values {
		if v.Name == "FLUXVM_CNT_MAX" {
			if int(v.Value) != NumCounters {
				t.Errorf("FLUXVM_CNT_MAX = %d, Go NumCounters = %d", v.Value, NumCounters)
			}
			continue
		}
		seen++
		c := Counter(v.Value)
		want := strings.ToLower(strings.TrimPrefix(v.Name, "FLUXVM_CNT_"))
		if got := c.String(); got != want {
			t.Errorf("%s (%d): Go name %q, want %q", v.Name, v.Value, got, want)
		}
	}
	if seen != NumCounters {
		t.Errorf("BTF has %d counters, Go has %d", seen, NumCounters)
	}

	m := spec.Maps["fluxvm_counters"]
	if m == nil {
		t.Fatal("no fluxvm_counters map in the object")
	}
	if m.Type != ebpf.PerCPUArray || m.KeySize != 4 || m.ValueSize != 8 || int(m.MaxEntries) != NumCounters {
		t.Errorf("fluxvm_counters = %v key %d value %d entries %d; want per-CPU array, 4, 8, %d",
			m.Type, m.KeySize, m.ValueSize, m.MaxEntries, NumCounters)
	}
}

func TestCounterString(t *testing.T) {
	if got := CounterTruncated.String(); got != "truncated" {
		t.Errorf("CounterTruncated = %q", got)
	}
	if got := Counter(999).String(); got != "counter(999)" {
		t.Errorf("unknown counter = %q", got)
	}
}
