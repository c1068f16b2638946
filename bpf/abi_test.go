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
	checkEnum(t, spec, "fluxvm_counter", "FLUXVM_CNT_", NumCounters, func(v uint64) string { return Counter(v).String() })
	checkEnum(t, spec, "fluxvm_drop_reason", "FLUXVM_DROP_", NumDropReasons, func(v uint64) string { return DropReason(v).String() })

	for name, n := range map[string]int{"fluxvm_counters": NumCounters, "fluxvm_drops": NumDropReasons} {
		m := spec.Maps[name]
		if m == nil {
			t.Fatalf("no %s map in the object", name)
		}
		if m.Type != ebpf.PerCPUArray || m.KeySize != 4 || m.ValueSize != 8 || int(m.MaxEntries) != n {
			t.Errorf("%s = %v key %d value %d entries %d; want per-CPU array, 4, 8, %d",
				name, m.Type, m.KeySize, m.ValueSize, m.MaxEntries, n)
		}
	}
}

// checkEnum requires a Go name for every value of the C enum, equal to the
// C name without prefix in lower case, and the MAX value to equal n.
func checkEnum(t *testing.T, spec *ebpf.CollectionSpec, cname, prefix string, n int, goName func(uint64) string) {
	t.Helper()
	var enum *btf.Enum
	if err := spec.Types.TypeByName(cname, &enum); err != nil {
		t.Fatalf("%s not in BTF: %v", cname, err)
	}
	seen := 0
	for _, v := range enum.Values {
		if v.Name == prefix+"MAX" {
			if int(v.Value) != n {
				t.Errorf("%sMAX = %d, Go has %d", prefix, v.Value, n)
			}
			continue
		}
		seen++
		want := strings.ToLower(strings.TrimPrefix(v.Name, prefix))
		if got := goName(v.Value); got != want {
			t.Errorf("%s (%d): Go name %q, want %q", v.Name, v.Value, got, want)
		}
	}
	if seen != n {
		t.Errorf("%s: BTF has %d values, Go has %d", cname, seen, n)
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
